"""Torch op namespace of the pip package (``sparse_k``).

Ops registered with ``torch.library`` take their qualified name from ``add_op_namespace_prefix``.
The hub build (``scripts/build_kernel.py``) replaces this file in every build variant by one whose
namespace is the variant's unique id (``_sparse_k_<backend>_<hash>``), so that the pip package and
any number of hub builds can be loaded into one process without their ops clashing.
"""

import torch

_OPS_NAMESPACE = "sparse_k"

ops = getattr(torch.ops, _OPS_NAMESPACE)


def add_op_namespace_prefix(op_name: str) -> str:
    """``"<namespace>::<op_name>"``: the qualified name to register or look up ``op_name`` under."""
    return f"{_OPS_NAMESPACE}::{op_name}"
