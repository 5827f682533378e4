"""Hopper CUDA backward for the structured causal patterns (``csrc/structured_bwd_sm90.cu``).

An FA3-style kernel: one CTA per 128-key tile of a (batch row, KV head), a TMA producer warpgroup
streaming 64-row Q / dO tiles of every query head of the group, two wgmma consumer warpgroups (64 keys
each) computing five matrix products per tile pair (``S^T = K Q^T``, ``dP^T = V dO^T``, ``dV +=
P^T dO``, ``dK += dS^T Q``, ``dQ = dS K``), dK/dV summed over the group in registers and dQ added
into a float32 buffer by TMA reduce-adds (issued by a producer-side warp while the consumers go on). Patterns: dense, sliding_window, streaming (causal), plain
self-attention geometry (``Sq == Skv``, no padding), D = 64 or 128, bf16/fp16; the contract of
``triton.structured_bwd.structured_backward`` restricted to those. The extension is compiled on first
use (``cuda.build``: nvcc, ``sm_90a``, cached on disk); ``dispatch`` hands it the
calls ``plan`` gives it (``cuda_sm90_structured_bwd``). Its speed against FlexAttention's backward and
``triton_structured_bwd``: docs/benchmarks.md.
"""

from __future__ import annotations

import torch

from .build import load_sm90_extension
from .contract import (
    BWD_ROW_PAD,
    STRUCTURED_BWD_CUDA_PATTERNS,
    check_pattern_args,
    length_capped,
    on_sm90,
    structured_bwd_call_ok,
)

__all__ = ["CUDA_BWD_PATTERNS", "cuda_structured_backward", "cuda_structured_bwd_ok", "load_extension"]

#: Pattern ids (``pattern_codes.PATTERN_IDS``) the kernel computes: dense, sliding_window, streaming (causal).
CUDA_BWD_PATTERNS = STRUCTURED_BWD_CUDA_PATTERNS

_SOURCES = ("structured_bwd_sm90.cpp", "structured_bwd_sm90.cu")


def load_extension():
    """Build the extension on first use (then loaded from the cache folder, ``cuda.build``) and return it."""
    return load_sm90_extension("structured_bwd_sm90", _SOURCES)



def cuda_structured_bwd_ok(
    do, q, k, v, out, lse, *, pattern_id: int, causal: bool = True, plain_geometry: bool = True, softcap=None,
    sink_logits=None, key_mask=None,
) -> bool:
    """Whether ``cuda_structured_backward`` computes this call exactly (else use another path).

    ``plain_geometry``: no padding and query ``i`` at key index ``i`` (``q_start == k_start == 0``,
    ``k_end == Skv``).
    """
    return on_sm90(q) and structured_bwd_call_ok(do, q, k, v, out, lse, pattern_id=pattern_id, causal=causal,
                                                 plain_geometry=plain_geometry, softcap=softcap,
                                                 sink_logits=sink_logits, key_mask=key_mask)


def cuda_structured_backward(do, q, k, v, out, lse, *, pattern_id: int, window: int = 0, sinks: int = 0, scale: float,
                             stats):
    """Gradients of causal structured attention on an sm_90 GPU.

    Args:
        do, q, out: ``(B, Hq, S, D)``; k, v: ``(B, Hkv, S, D)``; ``D`` 64 or 128, bf16 or fp16, ``Hq % Hkv == 0``;
            q, k, v, do contiguous or strided views (``cuda.contract.tma_view_ok``: e.g. transposed
            ``(B, S, H, D)`` tensors), read in place; out any strides; lse ``(B, Hq, S)`` float32, the
            forward's natural-log LSE.
        pattern_id: 0 dense, 1 sliding_window, 2 streaming (``CUDA_BWD_PATTERNS``).
        window: the window ``W`` (query ``i`` sees keys ``i - W + 1 .. i``); ignored for dense.
        sinks: streaming only, the number of leading keys every query sees.
        scale: softmax scale (> 0).
        stats: ``(delta, lse2)`` float32 ``(B, Hq, S)``: ``delta = rowsum(dO * O)`` and ``lse2 = lse *
            log2(e)`` (``+inf`` where ``lse = -inf``), as ``triton.bwd.bwd_preprocess`` computes them.
    Returns: ``dq, dk, dv`` in the input dtype, shaped like ``q, k, v`` and laid out like them where
    they are dense (``torch.empty_like``), else contiguous.
    """
    check_pattern_args(pattern_id, window, sinks, scale, CUDA_BWD_PATTERNS)
    if not cuda_structured_bwd_ok(do, q, k, v, out, lse, pattern_id=pattern_id):
        raise ValueError(
            "cuda_structured_backward: inputs outside the kernel's contract (CUDA sm_90, bf16/fp16 views with unit "
            "last stride and 16-byte multiple strides, D=64 or 128, Sq == Skv, Hq % Hkv == 0, lse (B, Hq, S) float32): "
            f"q {tuple(q.shape)} {q.dtype} strides {q.stride()}, k {tuple(k.shape)} {k.dtype} strides {k.stride()}, "
            f"v {tuple(v.shape)} {v.dtype} strides {v.stride()}, do {tuple(do.shape)} {do.dtype} strides "
            f"{do.stride()}, lse {tuple(getattr(lse, 'shape', ()))} {getattr(lse, 'dtype', None)}"
        )
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dq_acc = _launch(do, q, k, v, out, lse, dk, dv, pattern_id, window, sinks, scale, stats)
    dq = torch.empty_like(q).copy_(dq_acc[:, :, : q.shape[2]])  # cast and layout in one pass
    return dq, dk, dv


def padded_stats(stats):
    """``stats = (delta, lse2)`` ``(B, Hq, S)`` as ``(lse2, delta)`` padded to ``S_pad`` rows (a multiple
    of 64): ``+inf`` and 0 on the padding, so that padded query rows get ``P = 0``. Shapes ``(B, Hq, S_pad)``."""
    delta, lse2 = stats
    S = lse2.shape[2]
    pad = (-S) % BWD_ROW_PAD
    if pad:
        lse2 = torch.nn.functional.pad(lse2, (0, pad), value=float("inf"))
        delta = torch.nn.functional.pad(delta, (0, pad), value=0.0)
    return lse2.contiguous(), delta.contiguous()


def _launch(do, q, k, v, out, lse, dk, dv, pattern_id, window, sinks, scale, stats):
    """Write ``dk`` and ``dv`` (allocated by the caller) and return the float32 ``dq_acc``
    ``(B, Hq, S_pad, D)`` (scale applied; rows past S are zero)."""
    mod = load_extension()
    lse2, delta = padded_stats(stats)
    B, Hq, S, D = q.shape
    dq_acc = torch.zeros(B, Hq, lse2.shape[2], D, device=q.device, dtype=torch.float32)
    with torch.cuda.device(q.device):
        stream = torch.cuda.current_stream(q.device).cuda_stream
        mod.structured_bwd(q, k, v, do, lse2, delta, dq_acc, dk, dv, int(pattern_id), length_capped(window, S),
                           length_capped(sinks, S), float(scale), int(stream))
    return dq_acc
