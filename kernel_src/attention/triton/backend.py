"""The ``"triton"`` backend of ``sparse_k.sparse_attention`` (registered when triton imports).

``why_unsupported(call)`` names the first reason the kernels cannot run a call (the API then falls
back to the PyTorch path with a one-time warning); ``run(call)`` launches on the tiles ``plan.plan_tiles``
picks:

* prefill / training: ``BLOCK_M x BLOCK_N`` tiles over the block layout (``plan.tile_config``), one query
  head per program; with gradients the layout's transpose travels with the op for the backward;
* decode (``Sq <= 16``, no gradient): the query heads of a KV group packed into one tile and the
  key tiles split across programs (flash-decoding), merged by the last split program of each tile
  (or a combine kernel), which adds the sink;
* prefill with a token layout and no gradient: the query heads of a KV group packed as in decode
  (``plan.selection_prefill_config``).

A decode step of a causal pattern (or a learned pattern's static part; bigbird with blocks of 16 or
more and at most 16 random blocks) builds no ``BlockLayout``: it runs on a ``decode_layout.DecodeLayout``
and the kernel computes its key tiles from the row geometry, so nothing on the host depends on
``kv_len`` but a few ints, and bigbird needs no alignment of its blocks with the rows. A bigbird call
that block tiles cannot serve (a left-padded batch, a chunk starting inside a block, a block that is no
tile size) runs the layout kernels over tiles no wider than its block, listed from its block layout, with
its rule evaluated in the partial tiles, forward and backward (``plan.bigbird_rule_tiles``; the launch takes
bigbird's ``decode_pattern_code``).

Compiled variants are bounded: the kernels specialise on the constexpr flags (pattern id, causal,
tile sizes, head dim, softcap / sink / key-mask presence, ``Skv % BLOCK_N == 0`` outside decode
layouts, the split count's power of two) and never on the lengths, key-mask strides or layout widths,
which are declared ``do_not_specialize`` (``triton.fwd.ATTN_FWD_RUNTIME_ARGS``: Triton would otherwise
compile a new variant whenever ``kv_len``'s divisibility by 16 changed); the q / k / v strides stay
specialised (a cache's strides are multiples of its row stride, so their class holds from step to step,
and 16-divisible strides give 16-byte loads of gathered rows). Decode steps over a growing
cache compile nothing new once the split count settles (the cache holds more key tiles than one
wave of programs takes, or than the window spans).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton  # noqa: F401  (ImportError here keeps the backend unregistered)

from ...layouts.geometry import host_rows
from ...layouts.patterns import BigBird
from ..backends import AttentionCall, register_backend
from ..decode_layout import MAX_DECODE_QUERIES, DecodeLayout, decode_block_k, decode_layout
from ..pattern_codes import PATTERN_IDS, decode_pattern_code
from ..plan import bigbird_cuda, bigbird_rule_tiles, plan_tiles, split_count

__all__ = ["run", "why_unsupported"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HEAD_DIMS = (16, 32, 64, 128, 256)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _bigbird_reason(call: AttentionCall, block_q: int, block_k: int, need_grad: bool) -> str | None:
    """Why bigbird's block tiles (``block_q x block_k``) cannot serve ``call`` on the layout path, else None (one
    host read of the row offsets, unless they are known on the host)."""
    p = call.pattern
    if block_q not in (16, 32, 64, 128):
        return f"bigbird block {block_q} (the kernels take blocks of 16, 32, 64 or 128)"
    if block_q > 64 and need_grad:
        return f"bigbird block {block_q} with gradients (the backward kernels take blocks up to 64)"
    if p.block % block_q or p.block % block_k:
        return f"bigbird needs tiles that divide its block ({p.block}); the kernels use {block_q}x{block_k}"
    if _rows_off_blocks(call.geometry, p.block):
        return "bigbird blocks do not line up with the kernel tiles for these row offsets (padding or q_start)"
    return None


def _rows_off_blocks(geometry, block: int) -> bool:
    """Whether some row's first valid key or first query sits inside a block (``k_start`` or ``q_start - k_start``
    not a multiple of ``block``): from the host offsets when known, else one read of the device."""
    host = geometry.host_offsets()
    if host is not None:
        return any(k % block or (q - k) % block for q, k, _ in host_rows(host))
    off = ((geometry.k_start % block) != 0) | (((geometry.q_start - geometry.k_start) % block) != 0)
    return bool(off.any())


def _want_grad(call: AttentionCall) -> bool:
    """Whether autograd will ask for a backward: any of q, k, v, the sink logits or the selection's
    weights (a trained SparseK scorer's, even when q, k, v of a frozen model carry no gradient)."""
    weights = None if call.selection is None else call.selection.weights
    return bool(call.need_grad) or (
        torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (call.q, call.k, call.v, call.sink_logits, weights))
    )


def _bigbird_decode(call: AttentionCall, need_grad: bool) -> bool:
    """Whether a bigbird call is a decode step whose tiles the kernel computes (``decode_layout``)."""
    return (call.q.shape[2] <= MAX_DECODE_QUERIES and not need_grad
            and decode_pattern_code(call.pattern, call.layer_idx) is not None)


def _tiles(call: AttentionCall):
    """``plan.plan_tiles`` for this call (bigbird: 128x128 tiles where the CUDA listed forward takes it; a
    bigbird decode step: the decode tiles, keys no wider than its block; a bigbird call that block tiles cannot
    serve, e.g. a left-padded batch, with or without gradients: ``plan.bigbird_rule_tiles``)."""
    q = call.q
    need_grad = _want_grad(call)
    bigbird = isinstance(call.pattern, BigBird)
    bigbird_decode = bigbird and _bigbird_decode(call, need_grad)
    if bigbird_decode:
        bigbird = False
    on_cuda = bigbird and q.device.type == "cuda" and bigbird_cuda(
        call.pattern.block, call.pattern.causal, q, call.k, call.v, call.geometry, need_grad)
    query_block = getattr(call.selection, "query_block", None)
    tiles = plan_tiles(q_len=q.shape[2], group=q.shape[1] // call.k.shape[1], head_dim=q.shape[3],
                       device_type=q.device.type, need_grad=need_grad, selection=call.selection is not None,
                       bigbird_block=call.pattern.block if bigbird else None, bigbird_cuda=on_cuda,
                       query_block=query_block if isinstance(query_block, int) else None)
    if bigbird_decode:
        return dataclasses.replace(tiles, block_k=decode_block_k(call.pattern, tiles.block_k))
    if (bigbird and decode_pattern_code(call.pattern, call.layer_idx) is not None
            and _bigbird_reason(call, tiles.block_q, tiles.block_k, need_grad) is not None):
        bq, bk = bigbird_rule_tiles(call.pattern.block, q.device.type)
        return dataclasses.replace(tiles, block_q=bq, block_k=bk, bigbird_rule=True,
                                   reason="bigbird without block tiles (rows off its blocks, or a block that is no "
                                          "tile size): tiles no wider than its block, its rule in the kernel")
    return tiles


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
    if isinstance(call.pattern, BigBird) and not _bigbird_decode(call, _want_grad(call)):
        tiles = _tiles(call)
        need_grad = _want_grad(call)
        if tiles.bigbird_rule or (not need_grad and decode_pattern_code(call.pattern, call.layer_idx) is not None):
            return None  # its rule in the kernel, or ``_tiles`` found that block tiles serve the call
        return _bigbird_reason(call, tiles.block_q, tiles.block_k, need_grad)
    return None


def run(call: AttentionCall):
    from ..ops import block_attn

    tiles = _tiles(call)
    bq, bk, pack, decode = tiles.block_q, tiles.block_k, tiles.pack, tiles.decode
    layout = None
    if tiles.bigbird_rule:  # listed tiles that straddle bigbird's blocks: its code carries the rule's inputs
        layout = dataclasses.replace(call.layout(bq, bk), pattern=decode_pattern_code(call.pattern, call.layer_idx))
    elif decode:  # a causal pattern (or a learned static part): tiles computed in the kernel
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
        splits = split_count(B * Hkv * (G // pack) * layout.num_q_blocks, max_tiles, call.q.device,
                             gathered=call.selection is not None)
    return block_attn(
        call.q, call.k, call.v, layout, scale=call.scale, softcap=call.softcap, sink_logits=call.sink_logits,
        key_mask=call.key_mask, pack=pack, num_splits=splits, need_grad=need_grad, selection=call.selection,
    )


register_backend("triton", why_unsupported, run, auto_priority=0)
