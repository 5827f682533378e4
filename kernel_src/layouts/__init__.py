"""What a call attends to: patterns (the element rule), row geometry (tensor indices -> token
positions), and the layouts compiled from them (``BlockLayout``: key tiles per query tile;
``TokenLayout``: selected key blocks per query block). Imports nothing else of ``sparse_k``."""
