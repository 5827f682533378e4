"""The key budget ``k`` of the SparseK operator, checked and broadcast to one int64 per row (shared
by the PyTorch path ``sparsek`` and the Triton kernel ``sparsek_triton``), and ``require``, the operator's
input check that reads no device value."""

from __future__ import annotations

import torch

__all__ = ["key_budget", "require"]


def key_budget(k, lead_shape, device) -> torch.Tensor:
    """``k`` (an int, or an integer tensor broadcastable to ``lead_shape``) as int64 ``lead_shape``
    on ``device``; TypeError / ValueError naming the value otherwise."""
    if isinstance(k, bool):
        raise TypeError("sparsek: `k` must be an int or an integer tensor, got bool")
    if isinstance(k, int):
        if k < 0:
            raise ValueError(f"sparsek: `k` must be >= 0, got {k}")
        return torch.full(lead_shape, k, dtype=torch.int64, device=device)
    if not isinstance(k, torch.Tensor):
        raise TypeError(f"sparsek: `k` must be an int or an integer tensor, got {type(k).__name__}")
    if k.dtype.is_floating_point or k.dtype == torch.bool:
        raise TypeError(f"sparsek: `k` must hold integers, got dtype {k.dtype}")
    require(~(k < 0).any(), "sparsek: every `k` must be >= 0")
    return k.to(device=device, dtype=torch.int64).expand(lead_shape)


def require(ok: torch.Tensor, message: str) -> None:
    """ValueError(``message``) unless the 0-d bool ``ok`` holds: read on the host for an eager CPU tensor; on
    the device or inside a traced graph an assert without a host synchronisation (``torch._assert_async``)."""
    if ok.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(ok):
            raise ValueError(message)
    else:
        torch._assert_async(ok, message)
