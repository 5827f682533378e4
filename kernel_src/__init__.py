"""sparse_k: the compute core of hf_sparse_attention (also the Hugging Face kernel-hub module).

Pattern configurations, block and token layouts, the exact reference, the PyTorch path and the
GPU kernels. Imports only torch (and triton, where kernels are used); relative imports only.
"""

from .api import available_backends, register_backend, sparse_attention
from .integrations.config import DEFAULT_SPARSE_CONFIG, pattern_for_layer, pattern_to_config, validate_sparse_config
from .layouts.block_layout import BlockLayout, build_block_layout, clear_layout_cache
from .layouts.geometry import RowGeometry, row_geometry
from .layouts.patterns import (
    DSA,
    BigBird,
    BlockDiagonal,
    Dense,
    Dilated,
    L2Aligned,
    Pattern,
    SlidingWindow,
    SparseK,
    Streaming,
    available_patterns,
    get_pattern,
    pattern_from_dict,
    resolve_l2_segment,
)
from .attention.reference import masked_attention, pattern_mask, reference_attention
from .layouts.token_layout import TokenLayout
from .attention.torch_path import torch_sparse_attention
from .selection.sparsek import sparsek
from .selection.scorers import LightningIndexer, SparseKScorer
from .selection.selectors import build_selection

from . import flash_api
from .flash_api import flash_attn_func, flash_attn_with_kvcache
from .integrations.hub_attention import flash_attn_forward, supports_flash_attn

try:  # the GPU kernels register the "triton" backend only where triton imports
    from .attention.triton import backend as triton_backend  # noqa: F401
except ImportError:
    triton_backend = None

__version__ = "0.1.0"

__all__ = [
    "sparse_attention",
    "available_backends",
    "register_backend",
    "available_patterns",
    "get_pattern",
    "pattern_from_dict",
    "resolve_l2_segment",
    "Pattern",
    "Dense",
    "SlidingWindow",
    "Streaming",
    "BlockDiagonal",
    "BigBird",
    "Dilated",
    "L2Aligned",
    "SparseK",
    "DSA",
    "BlockLayout",
    "build_block_layout",
    "clear_layout_cache",
    "TokenLayout",
    "RowGeometry",
    "row_geometry",
    "reference_attention",
    "masked_attention",
    "pattern_mask",
    "torch_sparse_attention",
    "sparsek",
    "SparseKScorer",
    "LightningIndexer",
    "build_selection",
    "DEFAULT_SPARSE_CONFIG",
    "pattern_for_layer",
    "pattern_to_config",
    "validate_sparse_config",
    "flash_attn_func",
    "flash_api",
    "flash_attn_with_kvcache",
    "flash_attn_forward",
    "supports_flash_attn",
]
