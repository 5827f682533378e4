"""TMA tensor descriptors for the Triton kernels (Hopper+): when a ``(B, H, S, D)`` tensor can be read
as one 2-D ``(B * H * S, D)`` matrix, and the descriptor itself."""

from __future__ import annotations

import torch

__all__ = ["kv_descriptor", "tma_ok"]


def tma_ok(k, v) -> bool:
    """TMA descriptors on Hopper+ when K/V collapse to a 16-byte-aligned ``(B * Hkv * Skv, D)`` matrix."""
    if k.device.type != "cuda" or torch.cuda.get_device_capability(k.device)[0] < 9:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    for t in (k, v):
        B, H, S, D = t.shape
        if t.stride() != (H * S * D, S * D, D, 1) or t.data_ptr() % 16 or (D * t.element_size()) % 16:
            return False
    return True


def kv_descriptor(t, block_n):
    """A 2-D TMA descriptor over ``t (B, H, S, D)`` as ``(B * H * S, D)`` with ``(block_n, D)`` boxes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, H, S, D = t.shape
    return TensorDescriptor(t, [B * H * S, D], [D, 1], [block_n, D])
