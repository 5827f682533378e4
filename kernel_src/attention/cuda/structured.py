"""Hopper CUDA forward for the structured causal patterns (``csrc/structured_fwd_sm90.cu``), and for bigbird
over its block layout (``cuda_listed_forward``: the same kernel with the key tiles listed).

An FA3-style kernel (TMA producer warpgroup, two wgmma consumer warpgroups, 128x128 tiles) for
dense, sliding_window, streaming and block_diagonal causal self-attention, D = 64 or 128, bf16/fp16, q/k/v contiguous or
strided views (4-D TMA maps: the transposed ``(B, S, H, D)`` projections of a Transformers layer are
read in place, and the output is written in q's memory order). The contract is that
of ``triton.structured.structured_forward`` with a plain geometry (no padding, ``Sq == Skv``, no
softcap, sink logits or key mask): query ``i`` sees key ``j <= i`` when ``i - j < window`` (or ``j <
sinks`` for streaming; dense: always). The extension is compiled on first use (``cuda.build``: nvcc,
``sm_90a``, cached on disk). ``dispatch``
hands it the calls ``plan`` gives it (``cuda_sm90_structured``). Its speed against Triton's structured kernel,
FlexAttention and SDPA: docs/benchmarks.md; how it got there: docs/history.md.
"""

from __future__ import annotations

import torch

from ..memory_order import new_output
from .build import load_sm90_extension
from .contract import (
    STRUCTURED_CUDA_PATTERNS,
    check_pattern_args,
    length_capped,
    listed_call_ok,
    on_sm90,
    structured_call_ok,
)

__all__ = ["CUDA_PATTERNS", "cuda_listed_forward", "cuda_structured_forward", "cuda_structured_ok", "load_extension"]

#: Pattern ids (``pattern_codes.PATTERN_IDS``) the kernel computes: dense, sliding_window, streaming, block_diagonal
#: (causal).
CUDA_PATTERNS = STRUCTURED_CUDA_PATTERNS

_SOURCES = ("structured_fwd_sm90.cpp", "structured_fwd_sm90.cu")


def load_extension():
    """Build the extension on first use (then loaded from the cache folder, ``cuda.build``) and return it."""
    return load_sm90_extension("structured_sm90", _SOURCES)



def cuda_structured_ok(
    q, k, v, *, pattern_id: int, causal: bool = True, plain_geometry: bool = True, softcap=None, sink_logits=None,
    key_mask=None,
) -> bool:
    """Whether ``cuda_structured_forward`` computes this call exactly (else use another path).

    ``plain_geometry``: no padding and query ``i`` at key index ``i`` (the caller's ``RowGeometry``
    has ``q_start == k_start == 0`` and ``k_end == Skv``).
    """
    return on_sm90(q) and structured_call_ok(q, k, v, pattern_id=pattern_id, causal=causal,
                                             plain_geometry=plain_geometry, softcap=softcap,
                                             sink_logits=sink_logits, key_mask=key_mask)


def cuda_structured_forward(q, k, v, *, pattern_id: int, window: int = 0, sinks: int = 0, scale: float):
    """Causal structured attention forward on an sm_90 GPU.

    Args:
        q: ``(B, Hq, S, D)``; k, v: ``(B, Hkv, S, D)``, D 64 or 128; bf16 or fp16, ``Hq % Hkv == 0``; contiguous
            or strided views (``cuda.contract.tma_view_ok``: e.g. transposed ``(B, S, H, D)`` tensors), read
            in place.
        pattern_id: 0 dense, 1 sliding_window, 2 streaming, 3 block_diagonal (``CUDA_PATTERNS``).
        window: the window ``W`` (query ``i`` sees keys ``i - W + 1 .. i``), or block_diagonal's block (query
            ``i`` sees keys ``j <= i`` with ``j // W == i // W``); ignored for dense.
        sinks: streaming only, the number of leading keys every query sees.
        scale: softmax scale (> 0).
    Returns: ``out (B, Hq, S, D)`` in q's dtype and memory order (``memory_order.new_output``: a view
    of ``(B, S, Hq, D)`` storage when q is one) and ``lse (B, Hq, S)`` float32 (natural log).
    """
    check_pattern_args(pattern_id, window, sinks, scale)
    if not cuda_structured_ok(q, k, v, pattern_id=pattern_id):
        raise ValueError(
            "cuda_structured_forward: inputs outside the kernel's contract (CUDA sm_90, bf16/fp16 views with unit "
            "last stride and 16-byte multiple strides, D 64 or 128, Sq == Skv, Hq % Hkv == 0): "
            f"q {tuple(q.shape)} {q.dtype} strides {q.stride()}, k {tuple(k.shape)} {k.dtype} strides {k.stride()}, "
            f"v {tuple(v.shape)} {v.dtype} strides {v.stride()}"
        )
    out, lse = _outputs(q)
    _launch(q, k, v, out, lse, pattern_id, window, sinks, scale)
    return out, lse


def _outputs(q):
    """``out`` shaped like q in its memory order (``memory_order.new_output``) and ``lse (B, Hq, S)`` float32."""
    B, Hq, S, _ = q.shape
    return new_output(q), torch.empty(B, Hq, S, device=q.device, dtype=torch.float32)


def cuda_listed_forward(q, k, v, layout, *, scale: float):
    """Causal bigbird forward on an sm_90 GPU over ``layout``'s key tiles (the same kernel, its key tiles listed).

    Args:
        q, k, v: as ``cuda_structured_forward``.
        layout: a ``BlockLayout`` (or the custom op's namespace) of 128 x 128 tiles of a bigbird pattern whose
            block is a multiple of 128: each query tile's full key tiles (every row sees every key) and partial
            ones (row ``i`` sees key ``j <= i`` of them), ``cuda.contract.listed_call_ok``.
        scale: softmax scale (> 0).
    Returns: ``out`` and ``lse`` as ``cuda_structured_forward``.
    """
    if not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale={scale!r}: a positive float is required")
    if not (on_sm90(q) and listed_call_ok(q, k, v, layout, pattern_id=4)):
        raise ValueError(
            "cuda_listed_forward: inputs outside the kernel's contract (CUDA sm_90, bf16/fp16 views with unit last "
            "stride and 16-byte multiple strides, D 64 or 128, Sq == Skv, Hq % Hkv == 0, a block layout of 128x128 "
            f"tiles with int32 tile lists on q's device): q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, "
            f"layout tiles {getattr(layout, 'block_q', None)}x{getattr(layout, 'block_k', None)}"
        )
    out, lse = _outputs(q)
    _launch_listed(q, k, v, layout, out, lse, scale)
    return out, lse


def _launch_listed(q, k, v, layout, out, lse, scale):
    """Write ``out`` and ``lse`` (allocated by the caller, shapes as returned by ``cuda_listed_forward``)."""
    B, Hkv = q.shape[0], k.shape[1]

    def lists(num, idx):  # (B, Hkv, NQ) counts and (B, Hkv, NQ, W >= 1) tiles, contiguous
        num = num.expand(B, Hkv, num.shape[2]).contiguous()
        idx = idx.expand(B, Hkv, *idx.shape[2:])
        idx = idx.contiguous() if idx.shape[3] else idx.new_zeros(B, Hkv, idx.shape[2], 1)
        return num, idx

    fnum, fidx = lists(layout.full_kv_num_blocks, layout.full_kv_indices)
    pnum, pidx = lists(layout.kv_num_blocks, layout.kv_indices)
    mod = load_extension()
    with torch.cuda.device(q.device):
        stream = torch.cuda.current_stream(q.device).cuda_stream
        mod.listed_fwd(q, k, v, out, lse, fnum, fidx, pnum, pidx, float(scale), int(stream))


def _launch(q, k, v, out, lse, pattern_id, window, sinks, scale):
    """Write ``out`` and ``lse`` (allocated by the caller, shapes as returned by ``cuda_structured_forward``)."""
    S = q.shape[2]
    mod = load_extension()
    with torch.cuda.device(q.device):
        stream = torch.cuda.current_stream(q.device).cuda_stream
        mod.structured_fwd(q, k, v, out, lse, int(pattern_id), length_capped(window, S), length_capped(sinks, S),
                           float(scale), int(stream))

