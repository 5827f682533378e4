"""hf_sparse_attention: sparse attention for Hugging Face Transformers.

``import hf_sparse_attention`` registers ``attn_implementation="sparse_k"`` with Transformers (when
Transformers is installed). The compute core lives in the ``sparse_k`` module (``kernel_src/``).
"""

from sparse_k import *  # noqa: F401,F403
from sparse_k import __all__ as _core_all

__version__ = "0.1.0"

__all__ = list(_core_all)
