"""The calls the Hopper CUDA kernels take (each kernel's contract), as rules on the tensors' shapes,
strides, dtypes and pointers that do not ask which device they are on: ``plan`` applies them with
the device's capability beside them (so they answer for CPU and meta tensors too), and each launcher
(``cuda.structured`` ...) refuses a call outside its contract with ``on_sm90`` added."""

from __future__ import annotations

import torch

from .build import is_sm90

__all__ = [
    "BWD_ROW_PAD", "DECODE_GROUPS", "DECODE_STATIC_PATTERNS", "STRUCTURED_BWD_CUDA_PATTERNS", "STRUCTURED_CUDA_PATTERNS",
    "STRUCTURED_HEAD_DIMS", "TOKEN_STATIC_PATTERNS",
    "check_pattern_args", "length_capped",
    "LISTED_CUDA_PATTERNS", "decode_call_ok", "listed_call_ok", "on_sm90", "plain_call_ok", "selection_ok",
    "structured_bwd_call_ok", "structured_call_ok",
    "tensors_ok", "tma_view_ok", "token_call_ok",
]

#: Pattern ids (``pattern_codes.PATTERN_IDS``) the structured forward computes (causal): dense, sliding_window,
#: streaming, block_diagonal.
STRUCTURED_CUDA_PATTERNS = (0, 1, 2, 3)
#: Pattern ids the listed forward computes over a block layout of 128 x 128 tiles (causal): bigbird.
LISTED_CUDA_PATTERNS = (4,)
#: Pattern ids the structured backward computes (causal): dense, sliding_window, streaming.
STRUCTURED_BWD_CUDA_PATTERNS = (0, 1, 2)
#: Static-part pattern ids the token-layout kernels fuse: sliding_window, streaming.
TOKEN_STATIC_PATTERNS = (1, 2)
DECODE_STATIC_PATTERNS = TOKEN_STATIC_PATTERNS
#: Query heads per KV head the decode kernel is compiled for.
DECODE_GROUPS = (1, 2, 4, 8)
#: Query rows per step of the backward kernel: its lse2 / delta / dq_acc rows are padded to a multiple.
BWD_ROW_PAD = 64
#: Head dims of the structured, listed and token-layout forwards and the structured backward (the decode kernel: 128
#: only).
STRUCTURED_HEAD_DIMS = (64, 128)


def on_sm90(t) -> bool:
    """Whether ``t`` is a CUDA tensor on an sm_90 device (the device every kernel here needs)."""
    return isinstance(t, torch.Tensor) and t.is_cuda and is_sm90(t.device)


def plain_call_ok(pattern_id: int, causal: bool, plain_geometry: bool, softcap, sink_logits, key_mask,
                  patterns: tuple[int, ...] = STRUCTURED_CUDA_PATTERNS) -> bool:
    """A causal pattern of ``patterns`` over the plain geometry (no padding, query ``i`` at key index ``i``)
    without softcap, sink logits or key mask."""
    return (pattern_id in patterns and bool(causal) and bool(plain_geometry)
            and softcap is None and sink_logits is None and key_mask is None)


def tma_view_ok(t: torch.Tensor) -> bool:
    """Whether the 4-D tensor ``t (B, H, S, D)`` is a view the kernels read through a 4-D TMA map
    (``csrc/sm90_tma_host.h``) and write by strides: unit last stride, 16-byte aligned data, and
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


def tensors_ok(q, k, v, like_q=(), tma=(), max_len: int = 2**31 - 1, head_dims: tuple[int, ...] = (128,)) -> bool:
    """``q (B, Hq, S, D)``, ``k, v (B, Hkv, S, D)`` with ``D`` in ``head_dims`` and the ``like_q`` tensors (shaped
    like q): tensors of one device, bf16 or fp16 alike, ``Hq % Hkv == 0``, ``1 <= S <= max_len``; q, k, v and
    the ``tma`` tensors views that ``tma_view_ok`` accepts (read through TMA maps)."""
    tensors = (q, k, v, *like_q)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or any(t.dtype != q.dtype for t in tensors):
        return False
    if any(t.device != q.device for t in tensors):
        return False
    B, Hq, S, D = q.shape
    if D not in head_dims or k.shape != v.shape or k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
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


def length_capped(value: int, length: int, multiple: int = 1) -> int:
    """``value`` (a window, sink count, block_diagonal block or query block) capped at ``length`` rounded up to a
    multiple of ``multiple``, as the kernels take it (an int32).

    Every position a launch compares lies below ``length`` (the keys' count), so the capped value selects the same
    keys: a window, block or query block that long already spans every position, and sinks past the last key are no
    keys. A pattern may carry any Python int (``window=2**40`` for "no limit"), which the kernels would otherwise
    read truncated to 32 bits."""
    return min(int(value), -(-int(length) // multiple) * multiple)


def check_pattern_args(pattern_id, window, sinks, scale, patterns: tuple[int, ...] = STRUCTURED_CUDA_PATTERNS) -> None:
    """ValueError naming the value when the pattern arguments are not ones the kernel (computing
    ``patterns``) takes."""
    if pattern_id not in patterns:
        names = ("dense", "sliding_window", "streaming", "block_diagonal")
        raise ValueError(f"pattern_id={pattern_id!r}: this CUDA kernel computes {patterns} "
                         f"({', '.join(names[i] for i in patterns)})")
    if pattern_id != 0 and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window={window!r}: a positive int (the window, or block_diagonal's block) is required "
                         f"for pattern_id {pattern_id}")
    if pattern_id == 2 and (not isinstance(sinks, int) or sinks < 0):
        raise ValueError(f"sinks={sinks!r}: a non-negative int is required for streaming")
    if not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale={scale!r}: a positive float is required")


def structured_call_ok(q, k, v, *, pattern_id: int, causal: bool = True, plain_geometry: bool = True, softcap=None,
                       sink_logits=None, key_mask=None) -> bool:
    """The structured forward's contract (``cuda.structured``) but the device: a causal dense /
    sliding_window / streaming / block_diagonal call over the plain geometry (no padding, query ``i`` at key index ``i``:
    ``q_start == k_start == 0``, ``k_end == Skv``) without softcap, sink logits or key mask, on tensors
    ``tensors_ok`` accepts with a head dim of ``STRUCTURED_HEAD_DIMS``."""
    return (plain_call_ok(pattern_id, causal, plain_geometry, softcap, sink_logits, key_mask)
            and tensors_ok(q, k, v, head_dims=STRUCTURED_HEAD_DIMS))


def listed_call_ok(q, k, v, layout, *, pattern_id: int, causal: bool = True, plain_geometry: bool = True, softcap=None,
                   sink_logits=None, key_mask=None) -> bool:
    """The listed forward's contract (``cuda.structured.cuda_listed_forward``) but the device: a causal bigbird
    call over the plain geometry without softcap, sink logits or key mask, on tensors ``tensors_ok`` accepts with a
    head dim of ``STRUCTURED_HEAD_DIMS``, and ``layout`` a block layout (``BlockLayout`` or the custom op's
    namespace) of 128 x 128 tiles whose int32 tile lists are ``(B', H', ceil(S / 128)[, W])`` on q's device with
    ``B'`` 1 or B and ``H'`` 1 or Hkv."""
    if not plain_call_ok(pattern_id, causal, plain_geometry, softcap, sink_logits, key_mask, LISTED_CUDA_PATTERNS):
        return False
    if any(getattr(getattr(layout, "pattern", None), "params", ())):  # a code with bigbird's rule: tiles straddle
        return False  # its blocks, and this kernel masks listed tiles by causality alone
    if not tensors_ok(q, k, v, head_dims=STRUCTURED_HEAD_DIMS):
        return False
    if getattr(layout, "block_q", None) != 128 or getattr(layout, "block_k", None) != 128:
        return False
    B, Hkv, S = q.shape[0], k.shape[1], q.shape[2]
    nq = -(-S // 128)
    for num, idx in ((layout.full_kv_num_blocks, layout.full_kv_indices), (layout.kv_num_blocks, layout.kv_indices)):
        if not all(isinstance(t, torch.Tensor) and t.device == q.device and t.dtype == torch.int32 for t in (num, idx)):
            return False
        if num.dim() != 3 or idx.dim() != 4 or tuple(idx.shape[:3]) != tuple(num.shape):
            return False
        if num.shape[0] not in (1, B) or num.shape[1] not in (1, Hkv) or num.shape[2] != nq:
            return False
    return True


def token_call_ok(q, k, v, selection, *, pattern_id: int, causal: bool = True, plain_geometry: bool = True,
                  softcap=None, sink_logits=None, key_mask=None) -> bool:
    """The token-layout forward's contract (``cuda.token``) but the device: ``structured_call_ok`` with a
    sliding_window / streaming static part, ``query_block`` a multiple of 128 and a selection that
    ``selection_ok`` accepts (a ``TokenLayout`` or the custom op's namespace with its fields)."""
    if pattern_id not in TOKEN_STATIC_PATTERNS:
        return False
    if not structured_call_ok(q, k, v, pattern_id=pattern_id, causal=causal, plain_geometry=plain_geometry,
                              softcap=softcap, sink_logits=sink_logits, key_mask=key_mask):
        return False
    qb = selection.query_block
    if not isinstance(qb, int) or qb < 128 or qb % 128:
        return False
    return selection_ok(selection, q, k.shape[1])


def structured_bwd_call_ok(do, q, k, v, out, lse, *, pattern_id: int, causal: bool = True, plain_geometry: bool = True,
                           softcap=None, sink_logits=None, key_mask=None) -> bool:
    """The structured backward's contract (``cuda.structured_bwd``) but the device: as
    ``structured_call_ok`` with dO and O shaped like q (dO a TMA view too), at most 65535 key tiles
    and ``lse (B, Hq, S)`` float32 on q's device."""
    if not plain_call_ok(pattern_id, causal, plain_geometry, softcap, sink_logits, key_mask,
                         STRUCTURED_BWD_CUDA_PATTERNS):
        return False
    if not tensors_ok(q, k, v, like_q=(do, out), tma=(do,), max_len=2**31 - 1 - BWD_ROW_PAD,
                      head_dims=STRUCTURED_HEAD_DIMS):
        return False
    B, Hq, S, _ = q.shape
    if (S + 127) // 128 > 65535:  # key tiles: grid dimension y
        return False
    return isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.device == q.device and tuple(
        lse.shape) == (B, Hq, S)


def _aligned_rows(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:3])


def decode_call_ok(q, k, v, selection, *, pattern_id: int, causal: bool = True, decode_geometry: bool = True,
                   softcap=None, sink_logits=None, key_mask=None) -> bool:
    """The decode kernel's contract (``cuda.decode``) but the device: one query per row at key index
    ``Skv - 1`` with every key valid (``decode_geometry``), a sliding_window / streaming static part,
    bf16 / fp16, D = 128, ``Hq / Hkv`` in ``DECODE_GROUPS``, k / v with unit last stride and 16-byte
    aligned rows, and a selection ``selection_ok`` accepts."""
    if pattern_id not in DECODE_STATIC_PATTERNS or not causal or not decode_geometry:
        return False
    if softcap is not None or sink_logits is not None or key_mask is not None:
        return False
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if k.device != q.device or v.device != q.device:
        return False
    B, Hq, Sq, D = q.shape
    if Sq != 1 or D != 128 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or k.shape[1] < 1:
        return False
    Hkv, S = k.shape[1], k.shape[2]
    if Hq % Hkv or Hq // Hkv not in DECODE_GROUPS or not 1 <= S < 2**31 or B * Hkv > 65535:
        return False
    if q.stride(-1) != 1 or not _aligned_rows(k) or not _aligned_rows(v):
        return False
    qb = selection.query_block
    if isinstance(qb, bool) or not isinstance(qb, int) or qb < 1:
        return False
    return selection_ok(selection, q, Hkv, max_slots=2**30)
