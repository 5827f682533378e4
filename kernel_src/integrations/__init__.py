"""``sparse_k`` inside other libraries: the ``config.sparse_attention`` schema of a model config, the
Transformers attention function with the protocol its cache layers follow (``cache_protocol``), and
the kernel-hub entry points (``flash_attn_forward``)."""
