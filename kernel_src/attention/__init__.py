"""Attention over a layout: the exact reference, the PyTorch path, and the GPU kernels (``triton/``,
``cuda/``). ``plan`` decides which kernel runs a call, ``dispatch`` launches it, ``ops`` wraps it as
torch custom ops, ``backends`` holds the registry the public API picks from. Imports ``layouts``."""
