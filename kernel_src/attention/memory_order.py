"""The memory order of attention outputs: an output follows its queries' layout.

A Transformers layer hands the attention function ``q (B, H, S, D)`` as a transposed view of its
``(B, S, H, D)`` projections, and FlashAttention-style callers (``flash_api``) pass ``(B, S, H, D)``
tensors; both want ``(B, S, H, D)`` memory back. Every forward kernel (CUDA and Triton) writes by
strides, so allocating the output in q's order makes the caller's ``out.transpose(1, 2)`` contiguous
without a copy. The custom op's fake implementation allocates by the same rule (``torch.compile``
checks the strides of a custom op's outputs).
"""

from __future__ import annotations

import torch

__all__ = ["new_output", "sequence_major"]


def sequence_major(q: torch.Tensor) -> bool:
    """Whether ``q (B, H, S, D)`` lies in ``(B, S, H, D)`` order (its sequence stride exceeds its head
    stride), with ``H > 1`` and ``S > 1`` (otherwise the two orders are the same memory)."""
    return q.shape[1] > 1 and q.shape[2] > 1 and q.stride(2) > q.stride(1)


def new_output(q: torch.Tensor, head_dim: int | None = None) -> torch.Tensor:
    """An uninitialised ``(B, H, S, head_dim)`` tensor in q's dtype and device (``head_dim`` defaults
    to q's): a view of ``(B, S, H, head_dim)`` storage when ``sequence_major(q)``, else contiguous."""
    B, H, S, D = q.shape
    d = D if head_dim is None else head_dim
    if sequence_major(q):
        return torch.empty(B, S, H, d, device=q.device, dtype=q.dtype).transpose(1, 2)
    return torch.empty(B, H, S, d, device=q.device, dtype=q.dtype)
