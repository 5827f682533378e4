"""Hopper CUDA forward for a token layout fused with its static part (``csrc/token_fwd_sm90.cu``).

The inference prefill of the learned ``sparse_k`` pattern: per query block the ``TokenLayout``'s
selected keys (gathered 128-row K/V tiles, ``cp.async`` into the swizzled layout) plus the static
sliding_window / streaming part (contiguous TMA tiles), in one FA3-style kernel (the structured
forward's TMA producer warpgroup, two wgmma consumer warpgroups with ping-pong, persistent grid).
The semantics are those of ``triton.fwd._selection_loop``: query ``i`` of batch row ``b`` uses block
``i // query_block - first_block[b]`` (none outside ``[0, NB)``); slot ``c`` counts when ``c <
min(count, K)``, its key ``j`` satisfies ``0 <= j < S``, its weight (if any) is positive, and the
static rule does not already allow it (``i - j >= window`` and ``j >= sinks``, hence causal);
``log w`` is added to the logit. Plain causal self-attention only (no padding, ``Sq == Skv``), D =
64 or 128, bf16/fp16, ``query_block`` a multiple of 128; ``dispatch`` hands it the calls
``plan`` gives it (``cuda_sm90_token``), everything else stays on the Triton path.

Its speed against the Triton token kernel and the structured forward: docs/benchmarks.md (token
layout row) and docs/history.md (Hopper CUDA kernels for the structured patterns).
"""

from __future__ import annotations

import torch

from ..memory_order import new_output
from .build import load_sm90_extension
from .contract import TOKEN_STATIC_PATTERNS, length_capped, on_sm90, token_call_ok

__all__ = ["cuda_token_forward", "cuda_token_ok", "load_extension"]

_SOURCES = ("token_fwd_sm90.cpp", "token_fwd_sm90.cu")


def load_extension():
    """Build the extension on first use (then loaded from the cache folder, ``cuda.build``) and return it."""
    return load_sm90_extension("token_sm90", _SOURCES)



def cuda_token_ok(q, k, v, selection, *, pattern_id: int, causal: bool = True, plain_geometry: bool = True,
                  softcap=None, sink_logits=None, key_mask=None) -> bool:
    """Whether ``cuda_token_forward`` computes this call exactly (else use the Triton path).

    ``selection``: a ``TokenLayout`` (or the custom op's namespace with the same fields).
    """
    return on_sm90(q) and token_call_ok(q, k, v, selection, pattern_id=pattern_id, causal=causal,
                                        plain_geometry=plain_geometry, softcap=softcap, sink_logits=sink_logits,
                                        key_mask=key_mask)


def cuda_token_forward(q, k, v, selection, *, pattern_id: int, window: int, sinks: int = 0, scale: float):
    """Causal token-layout attention forward on an sm_90 GPU.

    Args:
        q: ``(B, Hq, S, D)``; k, v: ``(B, Hkv, S, D)``; ``D`` 64 or 128, bf16 or fp16, ``Hq % Hkv == 0``; contiguous
            or strided views (``cuda.contract.tma_view_ok``: e.g. transposed ``(B, S, H, D)`` tensors), read
            in place.
        selection: ``TokenLayout``: indices ``(B, Hkv, NB, K)`` int32, counts ``(B, Hkv, NB)`` int32,
            ``query_block`` a multiple of 128, first_block ``(B,)`` (or ``(1,)``) int, optional weights
            ``(B, Hkv, NB, K)`` float.
        pattern_id: the static part, 1 sliding_window or 2 streaming (``TOKEN_STATIC_PATTERNS``).
        window: the static window ``W >= 1``; sinks: streaming's leading keys (``>= 0``).
        scale: softmax scale (> 0).
    Returns: ``out (B, Hq, S, D)`` in q's dtype and memory order (``memory_order.new_output``) and
    ``lse (B, Hq, S)`` float32 (natural log).
    """
    if pattern_id not in TOKEN_STATIC_PATTERNS:
        raise ValueError(f"pattern_id={pattern_id!r}: the CUDA token kernel fuses {TOKEN_STATIC_PATTERNS} "
                         "(sliding_window, streaming)")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r}: a positive int is required")
    if not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks={sinks!r}: a non-negative int is required")
    if not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale={scale!r}: a positive float is required")
    if not cuda_token_ok(q, k, v, selection, pattern_id=pattern_id):
        raise ValueError(
            "cuda_token_forward: inputs outside the kernel's contract (CUDA sm_90, bf16/fp16 views with unit last "
            "stride and 16-byte multiple strides, D=64 or 128, Sq == Skv, Hq % Hkv == 0, int32 indices (B, Hkv, NB, K) "
            "and counts, query_block a multiple of 128): "
            f"q {tuple(q.shape)} {q.dtype} strides {q.stride()}, k {tuple(k.shape)} strides {k.stride()}, "
            f"indices {tuple(selection.indices.shape)} "
            f"{selection.indices.dtype}, query_block {selection.query_block!r}"
        )
    B, Hq, S, _ = q.shape
    out = new_output(q)
    lse = torch.empty(B, Hq, S, device=q.device, dtype=torch.float32)
    _launch(q, k, v, out, lse, selection, pattern_id, window, sinks, scale)
    return out, lse


def _launch(q, k, v, out, lse, selection, pattern_id, window, sinks, scale):
    """Write ``out`` (shaped like q, non-overlapping and dense, any 16-byte multiple strides) and ``lse``
    (``(B, Hq, S)`` float32 contiguous), both allocated by the caller."""
    B, S = q.shape[0], q.shape[2]
    idx = selection.indices if selection.indices.stride(-1) == 1 else selection.indices.contiguous()
    w = selection.weights
    if w is None:
        w = torch.empty(0, device=q.device, dtype=torch.float32)
    else:
        w = w.detach().to(torch.float32)
        if w.stride(-1) != 1:
            w = w.contiguous()
    first = selection.first_block.to(device=q.device, dtype=torch.int64).expand(B).contiguous()
    mod = load_extension()
    with torch.cuda.device(q.device):
        stream = torch.cuda.current_stream(q.device).cuda_stream
        mod.token_fwd(q, k, v, out, lse, idx, selection.counts, w, first, length_capped(selection.query_block, S, 128),
                      int(pattern_id), length_capped(window, S), length_capped(sinks, S), float(scale), int(stream))
