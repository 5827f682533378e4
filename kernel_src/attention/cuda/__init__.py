"""The Hopper (sm_90) CUDA kernels: ``csrc/`` holds the sources, ``build`` compiles them on first use,
``contract`` says which calls they take, and one launcher per kernel (structured forward / backward,
token forward, decode). Never imports ``attention.triton``."""
