"""Which keys a learned pattern attends to: the SparseK operator (exact and Triton), the scorers,
the selectors that turn scores into a ``TokenLayout``, the training-free page selection and the
state a selection keeps across decode steps (over a static cache, and over a cache that drops keys:
``cache_state``). Imports ``layouts`` only."""
