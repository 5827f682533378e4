"""The ``"triton"`` backend of ``sparse_k.sparse_attention`` (registered when triton imports).

``why_unsupported(call)`` names the first reason the kernels cannot run a call (the API then falls
back to the PyTorch path with a one-time warning); ``run(call)`` picks tile sizes and launches:

* prefill / training: ``BLOCK_M x BLOCK_N`` tiles over the block layout (``tile_config``), one query
  head per program; with gradients the layout's transpose travels with the op for the backward;
* decode (``Sq <= 16``, no gradient): the query heads of a KV group packed into one tile and the
  key tiles split across programs (flash-decoding), merged by the last split program of each tile
  (or a combine kernel), which adds the sink;
* prefill with a token layout and no gradient: the query heads of a KV group packed as in decode
  (``selection_prefill_config``).

A decode step of a causal dense / sliding_window / streaming pattern (or a learned pattern's static
part) builds no ``BlockLayout``: it runs on a ``decode_layout.DecodeLayout`` and the kernel computes
its key tiles from the row geometry, so nothing on the host depends on ``kv_len`` but a few ints.

Compiled variants are bounded: the kernels specialise on the constexpr flags (pattern id, causal,
tile sizes, head dim, softcap / sink / key-mask presence, ``Skv % BLOCK_N == 0`` outside decode
layouts, the split count's power of two) and never on the lengths, strides or layout widths, which
are declared ``do_not_specialize`` (``triton_fwd.ATTN_FWD_RUNTIME_ARGS``: Triton would otherwise
compile a new variant whenever ``kv_len``'s divisibility by 16 changed). Decode steps over a growing
cache compile nothing new once the split count settles (the cache holds more key tiles than one
wave of programs takes, or than the window spans).
"""

from __future__ import annotations

import os

import torch
import triton  # noqa: F401  (ImportError here keeps the backend unregistered)

from .api import AttentionCall, register_backend
from .decode_layout import DecodeLayout, decode_layout
from .pattern_codes import PATTERN_IDS
from .patterns import BigBird

__all__ = ["bigbird_tiles", "decode_config", "run", "selection_prefill_config", "tile_config", "why_unsupported"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HEAD_DIMS = (16, 32, 64, 128, 256)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def tile_config(head_dim: int, device_type: str, need_grad: bool) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` of the prefill / training kernels."""
    if device_type != "cuda":
        return 16, 16
    if need_grad:
        return (64, 64) if head_dim <= 128 else (32, 32)
    return (128, 128) if head_dim <= 128 else (64, 64)


def decode_config(q_len: int, group: int, device_type: str, head_dim: int) -> tuple[int, int, int]:
    """``(rows per head, heads packed, BLOCK_N)`` of the decode kernel (``BLOCK_M = rows * pack``)."""
    rows = 1
    while rows < q_len:
        rows *= 2
    min_m = 16
    max_m = 128 if head_dim <= 128 else 64
    # Pack the largest power of two of heads that divides the group, so BLOCK_M = rows * pack stays a
    # power of two (tl.arange needs one); a group of 3 (SmolLM2: 9 query heads, 3 KV heads) packs 1.
    pack = 1
    while group % (pack * 2) == 0 and rows * pack * 2 <= max_m:
        pack *= 2
    if rows * pack < min_m:
        rows = min_m // pack
    # 64-key tiles (H100, B=8, 128K cache, scripts/tune_decode.py, 2026-11-22): with 4 warps and 3 stages
    # a program needs 70 KB of shared memory, so 2-3 programs share an SM; the gathered rows of a token
    # layout ran 47 us (graph replay) against 48-54 us with 128-key tiles, a window 64.5 vs 63-65 us.
    block_n = 16 if device_type != "cuda" else 64
    return rows, pack, block_n


def selection_prefill_config(group: int, device_type: str, head_dim: int) -> tuple[int, int, int]:
    """``(rows per head, heads packed, BLOCK_N)`` of an inference prefill with a token layout.

    ``BLOCK_M = rows * pack = 128``: the query heads of a KV group share every gathered K/V tile
    (GQA packing) and 64-key tiles pipeline 3 stages deep, so the index loads of the gathered tiles
    run ahead too (H100, S=64K, top-2048 + window 1024: 16.8 ms vs 20.8 ms with one head per program
    and 128-key tiles, 2 stages; with the session-4 selection loop 10.5 ms; scripts/tune_decode.py,
    2026-11-22)."""
    if device_type != "cuda" or head_dim != 128:  # measured at D=128 only; other head dims keep the prefill tiles
        bm, bn = tile_config(head_dim, device_type, False)
        return bm, 1, bn
    pack = 1
    while group % (pack * 2) == 0 and pack * 2 <= 4:
        pack *= 2
    return 128 // pack, pack, 64


def bigbird_tiles(block: int, head_dim: int, device_type: str, need_grad: bool, q_len: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` of bigbird on the layout path: tiles that divide the block (a tile then
    lies in one block pair, allowed or not as a whole). Prefill without gradients on the GPU with blocks
    of 128 or more runs 64x64 tiles (two programs per SM; H100, block 128, S=64K, 2026-11-22: 2.65 ms
    against 2.70 ms with 128x128 tiles; 2.40 ms since the tile indices are prefetched; the query heads
    of a KV group packed in one program, 2 or 4 of them, 2.95-3.19 ms); otherwise the block itself."""
    if device_type == "cuda" and not need_grad and q_len > 16 and block >= 128 and block % 64 == 0 and head_dim <= 128:
        return 64, 64
    return block, block


def _bigbird_reason(call: AttentionCall, block_q: int, block_k: int) -> str | None:
    p = call.pattern
    if p.block % block_q or p.block % block_k:
        return f"bigbird needs tiles that divide its block ({p.block}); the kernels use {block_q}x{block_k}"
    g = call.geometry
    if bool(((g.k_start % p.block) != 0).any()) or bool((((g.q_start - g.k_start) % p.block) != 0).any()):
        return "bigbird blocks do not line up with the kernel tiles for these row offsets (padding or q_start)"
    return None


def _want_grad(call: AttentionCall) -> bool:
    """Whether autograd will ask for a backward: any of q, k, v, the sink logits or the selection's
    weights (a trained SparseK scorer's, even when q, k, v of a frozen model carry no gradient)."""
    weights = None if call.selection is None else call.selection.weights
    return bool(call.need_grad) or (
        torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (call.q, call.k, call.v, call.sink_logits, weights))
    )


def _plan(call: AttentionCall):
    """``(block_q, block_k, pack, decode)`` for this call."""
    q = call.q
    B, Hq, Sq, D = q.shape
    G = Hq // call.k.shape[1]
    dev = q.device.type
    need_grad = _want_grad(call)
    if isinstance(call.pattern, BigBird):
        bq, bk = bigbird_tiles(call.pattern.block, D, dev, need_grad, Sq)
        return bq, bk, 1, False
    if Sq <= 16 and not need_grad:
        rows, pack, bn = decode_config(Sq, G, dev, D)
        return rows, bn, pack, True
    if call.selection is not None and not need_grad:
        rows, pack, bn = selection_prefill_config(G, dev, D)
        return rows, bn, pack, False
    bm, bn = tile_config(D, dev, need_grad)
    return bm, bn, 1, False


def why_unsupported(call: AttentionCall) -> str | None:
    q, k, v = call.q, call.k, call.v
    if q.device.type != "cuda" and not (q.device.type == "cpu" and _interpreting()):
        return f"tensors on {q.device.type} (the Triton kernels need CUDA, or TRITON_INTERPRET=1 on the CPU)"
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} (supported: float16, bfloat16, float32)"
    if q.shape[-1] not in _HEAD_DIMS or v.shape[-1] != q.shape[-1]:
        return f"head dim {q.shape[-1]} (supported: {', '.join(map(str, _HEAD_DIMS))}, same for q, k, v)"
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "the last dimension of q, k and v must be contiguous"
    if call.sink_logits is not None and call.sink_logits.dtype == torch.float64:
        return "float64 sink_logits"
    rule = call.pattern.static_part() if call.pattern.learned else call.pattern
    if rule.name not in PATTERN_IDS:
        return f"pattern {rule.name!r} has no kernel rule (the kernels evaluate {', '.join(sorted(set(PATTERN_IDS)))})"
    if isinstance(call.pattern, BigBird):
        bq, bk, _, _ = _plan(call)
        if bq not in (16, 32, 64, 128):
            return f"bigbird block {bq} (the kernels take blocks of 16, 32, 64 or 128)"
        if bq > 64 and _want_grad(call):
            return f"bigbird block {bq} with gradients (the backward kernels take blocks up to 64)"
        return _bigbird_reason(call, bq, bk)
    return None


def _num_splits(programs: int, max_tiles: int, device, gathered: bool = False) -> int:
    """Split-KV factor of a decode launch of ``programs`` (batch x KV heads x packs x query tiles).

    One wave: ``SMs // programs`` splits for contiguous key tiles (longer runs per program win), twice
    that when selected keys are gathered (each gathered tile waits on its index load; more programs
    hide it). H100, B=8 (64 programs), 128K cache: window 4096 best at 2 splits (64.5 us graph replay;
    5 splits, the old rule, 66-67), top-2048 at 4 (47.3 us; 6: 47.2-48.6, 8: 52-55; with the
    session-4 selection loop 44.5 us, 3 splits 44.2-45.0, 5 splits 45.1-45.9)."""
    if device.type != "cuda":
        return max(1, min(max_tiles, 3))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    waves = 2 if gathered else 1
    return max(1, min(max_tiles, waves * sms // max(1, programs), 64))


def run(call: AttentionCall):
    from .ops import block_attn

    bq, bk, pack, decode = _plan(call)
    layout = None
    if decode:  # dense / sliding_window / streaming (or a learned static part): tiles computed in the kernel
        layout = decode_layout(call.pattern, call.q.shape[2], call.k.shape[2], call.geometry, block_q=bq, block_k=bk,
                               layer_idx=call.layer_idx, num_kv_heads=call.k.shape[1])
    if layout is None:
        layout = call.layout(bq, bk)
    need_grad = _want_grad(call)
    splits = 1
    if decode:
        B, Hkv = call.k.shape[:2]
        G = call.q.shape[1] // Hkv
        if isinstance(layout, DecodeLayout):
            # Splits by the wave alone (splits past a row's tiles are empty): the split count, a
            # compile-time constant of the kernel, then stays the same as the cache grows.
            max_tiles = 1 << 30
        else:
            max_tiles = layout.kv_indices.shape[-1] + layout.full_kv_indices.shape[-1]
        if call.selection is not None:
            max_tiles += -(-call.selection.indices.shape[-1] // bk)
        splits = _num_splits(B * Hkv * (G // pack) * layout.num_q_blocks, max_tiles, call.q.device,
                             gathered=call.selection is not None)
    return block_attn(
        call.q, call.k, call.v, layout, scale=call.scale, softcap=call.softcap, sink_logits=call.sink_logits,
        key_mask=call.key_mask, pack=pack, num_splits=splits, need_grad=need_grad, selection=call.selection,
    )


register_backend("triton", why_unsupported, run, auto_priority=0)
