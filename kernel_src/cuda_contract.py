"""The calls the Hopper CUDA kernels take: checks shared by the structured forward and backward and
by the token-layout kernels (prefill and decode)."""

from __future__ import annotations

import torch

from .cuda_build import is_sm90

__all__ = [
    "STRUCTURED_CUDA_PATTERNS", "check_pattern_args", "plain_call_ok", "selection_ok", "tensors_ok", "tma_view_ok",
]

#: Pattern ids (``triton_fwd.PATTERN_IDS``) the kernels compute: dense, sliding_window, streaming (causal).
STRUCTURED_CUDA_PATTERNS = (0, 1, 2)


def plain_call_ok(pattern_id: int, causal: bool, plain_geometry: bool, softcap, sink_logits, key_mask) -> bool:
    """A causal structured pattern over the plain geometry (no padding, query ``i`` at key index ``i``)
    without softcap, sink logits or key mask."""
    return (pattern_id in STRUCTURED_CUDA_PATTERNS and bool(causal) and bool(plain_geometry)
            and softcap is None and sink_logits is None and key_mask is None)


def tma_view_ok(t: torch.Tensor) -> bool:
    """Whether the 4-D tensor ``t (B, H, S, D)`` is a view the kernels read through a 4-D TMA map
    (``cuda/sm90_tma_host.h``) and write by strides: unit last stride, 16-byte aligned data, and
    every other stride a positive multiple of 16 bytes below 2**40 bytes, except that a dimension of
    size 1 may have any stride. Contiguous tensors qualify, and so do the transposed ``(B, S, H, D)``
    projections Transformers passes (strides ``(S*H*D, D, H*D, 1)``) and slices of a fused QKV
    projection; expanded (stride 0) or odd-strided views do not. Reads strides and the data pointer
    only, so it answers for CPU tensors too."""
    if t.dim() != 4 or t.stride(3) != 1 or t.data_ptr() % 16:
        return False
    size = t.element_size()
    return all(n == 1 or (s > 0 and (s * size) % 16 == 0 and s * size < 2**40)
               for n, s in zip(t.shape[:3], t.stride()[:3]))


def tensors_ok(q, k, v, like_q=(), tma=(), max_len: int = 2**31 - 1) -> bool:
    """``q (B, Hq, S, 128)``, ``k, v (B, Hkv, S, 128)`` and the ``like_q`` tensors (shaped like q):
    CUDA tensors of one sm_90 device, bf16 or fp16 alike, ``Hq % Hkv == 0``, ``1 <= S <= max_len``;
    q, k, v and the ``tma`` tensors views that ``tma_view_ok`` accepts (read through TMA maps)."""
    tensors = (q, k, v, *like_q)
    if not all(isinstance(t, torch.Tensor) and t.is_cuda and t.dim() == 4 for t in tensors):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or any(t.dtype != q.dtype for t in tensors):
        return False
    if any(t.device != q.device for t in tensors) or not is_sm90(q.device):
        return False
    B, Hq, S, D = q.shape
    if D != 128 or k.shape != v.shape or k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        return False
    if any(t.shape != q.shape for t in like_q):
        return False
    if k.shape[1] < 1 or Hq % k.shape[1] != 0 or not 1 <= S <= max_len or B * Hq >= 2**31:
        return False
    return all(tma_view_ok(t) for t in (q, k, v, *tma))


def selection_ok(selection, q, num_kv_heads: int, max_slots: int = 2**31) -> bool:
    """A ``TokenLayout``'s tensors (or a namespace with its fields) as the token-layout kernels read
    them, on q's device: int32 indices ``(B, Hkv, NB, K)`` with ``NB >= 1`` and ``1 <= K < max_slots``,
    int32 counts ``(B, Hkv, NB)``, an integer first_block ``(B,)`` or ``(1,)``, and weights shaped like
    the indices in float32 / fp16 / bf16 or None (``B = q.shape[0]``)."""
    idx, cnt, w, first = selection.indices, selection.counts, selection.weights, selection.first_block
    B = q.shape[0]
    if not all(isinstance(t, torch.Tensor) and t.device == q.device for t in (idx, cnt, first)):
        return False
    if idx.dtype != torch.int32 or idx.dim() != 4 or tuple(idx.shape[:2]) != (B, num_kv_heads) or idx.shape[2] < 1:
        return False
    if not 1 <= idx.shape[3] < max_slots or idx.shape[2] >= 2**31:
        return False
    if cnt.dtype != torch.int32 or tuple(cnt.shape) != tuple(idx.shape[:3]):
        return False
    if first.dim() != 1 or first.shape[0] not in (1, B) or first.dtype.is_floating_point or first.dtype == torch.bool:
        return False
    if w is not None:
        if not isinstance(w, torch.Tensor) or w.device != q.device or tuple(w.shape) != tuple(idx.shape):
            return False
        if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return False
    return True


def check_pattern_args(pattern_id, window, sinks, scale) -> None:
    """ValueError naming the value when the pattern arguments are not ones the kernels take."""
    if pattern_id not in STRUCTURED_CUDA_PATTERNS:
        raise ValueError(f"pattern_id={pattern_id!r}: the CUDA kernels compute {STRUCTURED_CUDA_PATTERNS} "
                         "(dense, sliding_window, streaming)")
    if pattern_id != 0 and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window={window!r}: a positive int is required for pattern_id {pattern_id}")
    if pattern_id == 2 and (not isinstance(sinks, int) or sinks < 0):
        raise ValueError(f"sinks={sinks!r}: a non-negative int is required for streaming")
    if not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale={scale!r}: a positive float is required")
