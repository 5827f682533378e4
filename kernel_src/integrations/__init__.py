"""``sparse_k`` inside other libraries: the ``config.sparse_attention`` schema of a model config, the
Transformers attention function, and the kernel-hub entry points (``flash_attn_forward``)."""
