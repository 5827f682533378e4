"""Decode layouts without index lists: the key tiles of a short query run, computed in the kernel.

A decode step (``Sq <= 16``, queries bottom-right over the cache) of any causal pattern (or the static
part of a learned one) visits key tiles that follow from the row geometry by arithmetic: dense,
sliding_window, streaming and block_diagonal visit the sink tiles, then one contiguous run of key tiles
ending at the query's tile (block_diagonal: from the start of the first query's block) whose middle is
full; dilated the run of its widest scale (its first scale's window full); l2_aligned its block-aligned
window run, then one or two tiles per segment for the anchors before it; bigbird its global blocks,
its window run (from the first query's block minus the window blocks), then the tiles of the random
blocks of the (at most two) query blocks of the step, drawn in the kernel from the same hash as
``patterns.BigBird.random_table``. The Triton decode kernel (``triton.fwd._attn_fwd`` with ``STRUCT``)
computes these runs from the row geometry it already loads (``q_start``, ``k_start``, ``k_end``;
``triton.fwd._struct_runs``, ``_random_slot``, ``_anchor_slot``), so a step builds nothing on the host: no
``BlockLayout`` per ``kv_len`` (``block_layout._build`` cost about 1 ms per layer and step on an H100
host, and its cache missed at every step because the length grew), no index tensors, no host
synchronisation. The same holds when the geometry lives on the device only (a padded batch, a
StaticCache whose valid length comes from the mask).

``DecodeLayout`` stands where the kernels take a ``BlockLayout``: it carries the tile sizes, lengths,
pattern and geometry, placeholder index tensors (never read), and ``max_tiles``, a host bound on
the tile slots one query tile walks (it sizes the split-KV ranges; splits past a row's slots are
empty; an anchor or random slot that repeats a tile is skipped, so slots may exceed tiles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layouts.geometry import RowGeometry
from ..layouts.patterns import BigBird, BlockDiagonal, Dense, Dilated, L2Aligned, Pattern, SlidingWindow, Streaming
from .launch_buffers import placeholder
from .pattern_codes import PatternCode, decode_pattern_code

__all__ = ["DecodeLayout", "decode_block_k", "decode_layout", "decode_tile_bound"]

#: Longest query run handled as a decode step (``triton.backend`` runs split-KV decode up to this).
MAX_DECODE_QUERIES = 16


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def decode_tile_bound(pattern: Pattern, block_q: int, kv_len: int, block_k: int) -> int:
    """Most key tile slots (sinks / globals + window run + anchor or random slots) that ``block_q``
    consecutive queries of ``pattern`` walk in the decode kernel, for any row geometry over ``kv_len``
    key slots (bigbird: any layer and KV head)."""
    all_tiles = _ceil_div(kv_len, block_k)
    if isinstance(pattern, Dense):
        return all_tiles
    if isinstance(pattern, (SlidingWindow, Streaming)):
        span = pattern.window  # keys a query sees in its run, at most
    elif isinstance(pattern, BlockDiagonal):
        span = pattern.block
    else:
        return _slot_bound(pattern, block_q, kv_len, block_k)
    bound = _ceil_div(span + block_q - 1, block_k) + 1
    if isinstance(pattern, Streaming) and pattern.sinks > 0:
        bound += _ceil_div(pattern.sinks, block_k) + 1
    return max(1, min(all_tiles, bound))


def _slot_bound(pattern: Pattern, block_q: int, kv_len: int, block_k: int) -> int:
    """``decode_tile_bound`` of dilated, l2_aligned and bigbird: the window run, plus l2_aligned's anchor slots
    or bigbird's global tiles and random slots of two query blocks (slots: not capped by the tile count)."""
    if isinstance(pattern, Dilated):
        return max(1, min(_ceil_div(kv_len, block_k), _ceil_div(pattern.reach + block_q - 1, block_k) + 1))
    if isinstance(pattern, L2Aligned):
        run = _ceil_div(pattern.window_blocks * pattern.block + block_q - 1, block_k) + 1
        if pattern.anchor == 0:
            return run
        return run + _ceil_div(kv_len, pattern._seg()) * (_ceil_div(pattern.anchor, block_k) + 1)
    if isinstance(pattern, BigBird):
        run = _ceil_div((pattern.window_blocks + 1) * pattern.block + block_q - 1, block_k) + 1
        globals_ = _ceil_div(pattern.global_blocks * pattern.block, block_k) + 1
        return run + globals_ + 2 * pattern.random_blocks * (_ceil_div(pattern.block, block_k) + 1)
    raise ValueError(f"decode_tile_bound: no decode tiles for pattern {pattern.name!r}")


def decode_block_k(pattern: Pattern, block_k: int) -> int:
    """The key tile of a decode step of ``pattern``: ``block_k``, halved while it exceeds a bigbird block
    (the kernel's bigbird rule takes tiles that span at most two key blocks), not below 16."""
    if isinstance(pattern, BigBird):
        while block_k > 16 and block_k > pattern.block:
            block_k //= 2
    return block_k


@dataclass
class DecodeLayout:
    """Stands for the ``BlockLayout`` of a decode step (module docstring); the kernel computes the tiles.

    ``full_kv_num_blocks``/``kv_num_blocks``: ``(1, 1, 1)`` int32 and ``full_kv_indices``/``kv_indices``:
    ``(1, 1, 1, 1)`` int32 placeholders (never read)."""

    block_q: int
    block_k: int
    q_len: int
    kv_len: int
    pattern: Pattern | PatternCode
    layer_idx: int
    num_kv_heads: int
    geometry: RowGeometry
    max_tiles: int
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor

    #: Marks the layout for ``triton.fwd.layout_forward`` (the kernel's ``STRUCT`` flag).
    structured_decode = True
    #: ``block_layout.full_tiles_contiguous`` reads this instead of the (placeholder) index lists.
    _full_contig = True

    @property
    def num_q_blocks(self) -> int:
        return _ceil_div(self.q_len, self.block_q)

    @property
    def num_k_blocks(self) -> int:
        return _ceil_div(self.kv_len, self.block_k)


_STRUCTURED = (Dense, SlidingWindow, Streaming, BlockDiagonal)


def _static(pattern: Pattern) -> Pattern:
    return pattern.static_part() if pattern.learned else pattern


def decode_layout(pattern: Pattern, q_len: int, kv_len: int, geometry: RowGeometry, *, block_q: int, block_k: int,
                  layer_idx: int = 0, num_kv_heads: int = 1) -> DecodeLayout | None:
    """A ``DecodeLayout`` for a decode step of ``pattern`` (``q_len <= 16``; causal, a pattern
    ``pattern_codes.decode_pattern_code`` encodes, or a learned pattern's static part), else None
    (build a ``BlockLayout``). No host work beyond a few integer operations. A bigbird layout's
    ``pattern`` is its ``PatternCode`` for ``layer_idx`` (the random blocks differ per layer), and
    ``block_k`` must not exceed its block (``decode_block_k``)."""
    p = _static(pattern)
    if q_len > MAX_DECODE_QUERIES:
        return None
    kernel_pattern: Pattern | PatternCode = p
    if type(p) in _STRUCTURED:  # the common case first: nothing more to look up (fewer compile guards)
        if not p.causal:
            return None
    else:
        code = decode_pattern_code(p, layer_idx)
        if code is None:
            return None
        if isinstance(p, BigBird):
            if block_k > p.block:
                raise ValueError(f"decode_layout: bigbird block {p.block} needs key tiles of at most its block, got "
                                 f"block_k={block_k} (decode_block_k picks one)")
            kernel_pattern = code
    dev = geometry.q_start.device
    num, idx = placeholder(dev, torch.int32, 3), placeholder(dev, torch.int32, 4)
    return DecodeLayout(
        block_q, block_k, q_len, kv_len, kernel_pattern, layer_idx, num_kv_heads, geometry,
        decode_tile_bound(p, block_q, kv_len, block_k), num, idx, num, idx,
    )
