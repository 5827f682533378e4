"""The Triton kernels: layout forward / backward, the structured (no index list) forward / backward,
their shared element rules and TMA descriptors, and ``backend``, the ``"triton"`` backend of
``sparse_attention``. Never imports ``attention.cuda``."""
