"""hf_sparse_attention: sparse attention for Hugging Face Transformers.

``import hf_sparse_attention`` registers ``attn_implementation="sparse_k"`` with Transformers (when
Transformers is installed). The compute core lives in the ``sparse_k`` module (``kernel_src/``).
"""

from sparse_k import *  # noqa: F401,F403
from sparse_k import __all__ as _core_all

from .configure import configure
from .example_model import load_example_model

__version__ = "0.1.0"

__all__ = [*_core_all, "configure", "load_example_model"]

try:
    import transformers as _transformers  # noqa: F401
except ImportError:
    _transformers = None
if _transformers is not None:
    from .cache import SparseCache
    from .integration import ModelNotSupportedError
    from .integration import register as _register

    _register()
    __all__ += ["ModelNotSupportedError", "SparseCache"]

from .selectors import SELECTOR_FILE, load_selectors, load_selectors_for_model, save_selectors  # noqa: E402

__all__ += ["SELECTOR_FILE", "load_selectors", "load_selectors_for_model", "save_selectors"]
