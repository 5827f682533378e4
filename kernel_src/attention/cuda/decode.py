"""Hopper CUDA decode for a token layout fused with its static part (``csrc/decode_sm90.cuh``).

One query token per row (``Sq == 1``) at the last key (bottom-right, no padding: ``q_start = Skv -
1``, every key valid). Its keys form one virtual list: the streaming sinks not inside the window, the
window ``[Skv - W, Skv - 1]``, then the ``K`` slots of the query's selection block ``(Skv - 1) //
query_block - first_block[b]``. A selected slot counts as in ``triton.fwd._selection_loop``: ``c <
min(count, K)``, its key ``j`` in ``[0, Skv)``, its weight (if any) positive, and the static rule not
already allowing it (``Skv - 1 - j >= W`` and ``j >= sinks``); ``log w`` joins the logit.

The list is cut into ``nsplit`` CTAs per (row, KV head), one CTA an SM in one wave (``decode_plan``).
A CTA resolves its keys with one round of loads, then its eight warps each stream their share of
16-key tiles through a private three-stage ``cp.async`` ring and run tensor-core products on them
(S = Q K^T with the query heads as rows, an online softmax in registers, O += P V). The warps merge
in shared memory; two to eight splits merge in a thread-block cluster through distributed shared
memory, more through a workspace (the last CTA to arrive, ``launch_buffers.split_counters``, or a second
small kernel when there are no counters). ``dispatch`` hands it every decode
call ``plan`` gives it (``cuda_sm90_decode``); the caller's ``num_splits`` / ``pack`` do not
apply. Its speed against the Triton split-KV kernel, and the earlier designs it replaced:
docs/benchmarks.md (decode rows) and docs/history.md (token-layout decode).
"""

from __future__ import annotations

import torch

from .build import load_sm90_extension
from .contract import DECODE_GROUPS, DECODE_STATIC_PATTERNS, decode_call_ok, length_capped, on_sm90

__all__ = ["cuda_decode_forward", "cuda_decode_ok", "decode_plan", "load_extension"]

_SOURCES = ("decode_sm90.cpp", "decode_sm90.cu", "decode_sm90_bf16.cu", "decode_sm90_fp16.cu")
_STAGE = 64  # at most one split per 64 keys (decode_sm90.cuh)
_SMS: dict = {}


def load_extension():
    """Build the extension on first use (then loaded from the cache folder, ``cuda.build``) and return it."""
    return load_sm90_extension("decode_sm90", _SOURCES)


def decode_plan(kv_len: int, window: int, sinks: int, pattern_id: int, top_k: int, rows_heads: int = 1,
                sms: int = 1) -> tuple[int, int, int]:
    """``(total, nsplit, chunk)``: virtual keys of the query (static keys counted once, plus ``top_k``
    slots), CTAs per (row, KV head) and keys per CTA.

    One wave of one CTA an SM: ``nsplit = sms // rows_heads`` (``rows_heads = B * Hkv``), at least 1,
    at most one per 64 keys; every split gets keys (none empty)."""
    qpos = kv_len - 1
    w_lo = max(0, qpos - window + 1)
    n_sink = min(sinks, w_lo) if pattern_id == 2 else 0
    total = n_sink + (qpos - w_lo + 1) + top_k
    nsplit = max(1, min(sms // max(1, rows_heads), -(-total // _STAGE)))
    chunk = -(-total // nsplit)
    nsplit = -(-total // chunk)
    return total, nsplit, -(-total // nsplit)


def _sm_count(device) -> int:
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    count = _SMS.get(index)
    if count is None:
        count = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def cuda_decode_ok(q, k, v, selection, *, pattern_id: int, causal: bool = True, decode_geometry: bool = True,
                   softcap=None, sink_logits=None, key_mask=None) -> bool:
    """Whether ``cuda_decode_forward`` computes this call exactly (else use the Triton path).

    ``decode_geometry``: every row's query sits at key index ``Skv - 1`` and all keys are valid
    (``geometry.decode_geometry``). ``selection``: a ``TokenLayout`` (or a namespace with its fields).
    """
    return on_sm90(q) and decode_call_ok(q, k, v, selection, pattern_id=pattern_id, causal=causal,
                                         decode_geometry=decode_geometry, softcap=softcap, sink_logits=sink_logits,
                                         key_mask=key_mask)


def cuda_decode_forward(q, k, v, selection, *, pattern_id: int, window: int, sinks: int = 0, scale: float,
                        counters: torch.Tensor | None = None, cluster: bool = True):
    """Token-layout attention of one query token per row on an sm_90 GPU.

    Args:
        q: ``(B, Hq, 1, 128)``; k, v: ``(B, Hkv, Skv, 128)`` with unit last stride and 16-byte aligned
            rows, bf16 or fp16, ``Hq / Hkv`` in ``DECODE_GROUPS``; the query sits at key ``Skv - 1``.
        selection: ``TokenLayout``: indices ``(B, Hkv, NB, K)`` int32, counts ``(B, Hkv, NB)`` int32,
            ``query_block``, first_block ``(B,)`` (or ``(1,)``) int, optional weights ``(B, Hkv, NB, K)``.
        pattern_id: the static part, 1 sliding_window or 2 streaming (``DECODE_STATIC_PATTERNS``).
        window: the static window ``W >= 1``; sinks: streaming's leading keys (``>= 0``).
        scale: softmax scale (> 0).
        counters: int32 arrival counters (``>= B * Hkv`` entries, zero; left zero) for the fused merge,
            or None: a second kernel merges the splits.
        cluster: with 2 to 8 splits, the splits of one (row, KV head) form a thread-block cluster and
            merge through distributed shared memory (``counters`` unused); False: through global memory.
    Returns: ``out (B, Hq, 1, 128)`` in q's dtype and ``lse (B, Hq, 1)`` float32 (natural log).
    """
    if pattern_id not in DECODE_STATIC_PATTERNS:
        raise ValueError(f"pattern_id={pattern_id!r}: the CUDA decode kernel fuses {DECODE_STATIC_PATTERNS} "
                         "(sliding_window, streaming)")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r}: a positive int is required")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks={sinks!r}: a non-negative int is required")
    if not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale={scale!r}: a positive float is required")
    if not cuda_decode_ok(q, k, v, selection, pattern_id=pattern_id):
        raise ValueError(
            "cuda_decode_forward: inputs outside the kernel's contract (CUDA sm_90, bf16/fp16, D=128, Sq == 1, "
            f"Hq / Hkv in {DECODE_GROUPS}, 16-byte aligned k/v rows, int32 indices (B, Hkv, NB, K) and counts): "
            f"q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} strides {k.stride()}, indices "
            f"{tuple(selection.indices.shape)} {selection.indices.dtype}, query_block {selection.query_block!r}"
        )
    B, Hq, _, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    window, sinks = length_capped(window, S), length_capped(sinks, S)
    query_block = length_capped(selection.query_block, S, 128)
    idx = selection.indices
    _, nsplit, chunk = decode_plan(S, window, sinks, pattern_id, idx.shape[3], B * Hkv, _sm_count(q.device))
    w = selection.weights
    if w is None:
        w = torch.empty(0, device=q.device, dtype=torch.float32)
    else:
        w = w.detach().to(torch.float32)
        if w.stride(-1) != 1:
            w = w.contiguous()
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    first = selection.first_block.to(device=q.device, dtype=torch.int64).expand(B).contiguous()
    out = torch.empty(B, Hq, 1, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, Hq, 1, device=q.device, dtype=torch.float32)
    o_part = torch.empty(B * Hkv * nsplit * G * D, device=q.device, dtype=torch.float32)
    l_part = torch.empty(B * Hkv * nsplit * G, device=q.device, dtype=torch.float32)
    if counters is None:
        counters = torch.empty(0, device=q.device, dtype=torch.int32)
    mod = load_extension()
    with torch.cuda.device(q.device):
        stream = torch.cuda.current_stream(q.device).cuda_stream
        mod.decode_fwd(q, k, v, out, lse, o_part, l_part, counters, idx, selection.counts, w, first,
                       int(query_block), int(pattern_id), int(window), int(sinks), float(scale),
                       int(nsplit), int(chunk), bool(cluster), int(stream))
    return out, lse
