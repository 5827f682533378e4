"""Decode layouts without index lists: the key tiles of a short query run, computed in the kernel.

A decode step (``Sq <= 16``, queries bottom-right over the cache) of a causal ``dense``,
``sliding_window``, ``streaming`` or ``block_diagonal`` pattern (or the static part of a learned one)
visits the sink tiles, then one contiguous run of key tiles ending at the query's tile (block_diagonal:
from the start of the first query's block), whose middle is full. The
Triton decode kernel (``triton.fwd._attn_fwd`` with ``STRUCT``) computes these runs from the row
geometry it already loads (``q_start``, ``k_start``, ``k_end``; ``triton.fwd._struct_runs``), so a
step builds nothing on the host: no ``BlockLayout`` per ``kv_len`` (``block_layout._build`` cost
about 1 ms per layer and step on an H100 host, and its cache missed at every step because the
length grew), no index tensors, no host synchronisation. The same holds when the geometry lives on
the device only (a padded batch, a StaticCache whose valid length comes from the mask).

``DecodeLayout`` stands where the kernels take a ``BlockLayout``: it carries the tile sizes, lengths,
pattern and geometry, placeholder index tensors (never read), and ``max_tiles``, a host bound on
the tiles one query tile visits (it sizes the split-KV ranges; splits past a row's tiles are empty).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layouts.geometry import RowGeometry
from ..layouts.patterns import BlockDiagonal, Dense, Pattern, SlidingWindow, Streaming
from .launch_buffers import placeholder

__all__ = ["DecodeLayout", "decode_layout", "decode_tile_bound"]

#: Longest query run handled as a decode step (``triton.backend`` runs split-KV decode up to this).
MAX_DECODE_QUERIES = 16


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def decode_tile_bound(pattern: Pattern, block_q: int, kv_len: int, block_k: int) -> int:
    """Most key tiles (sinks + window run) that ``block_q`` consecutive queries of ``pattern`` visit,
    for any row geometry over ``kv_len`` key slots."""
    all_tiles = _ceil_div(kv_len, block_k)
    if isinstance(pattern, Dense):
        return all_tiles
    span = pattern.block if isinstance(pattern, BlockDiagonal) else pattern.window  # keys a query sees, at most
    bound = _ceil_div(span + block_q - 1, block_k) + 1
    if isinstance(pattern, Streaming) and pattern.sinks > 0:
        bound += _ceil_div(pattern.sinks, block_k) + 1
    return max(1, min(all_tiles, bound))


@dataclass
class DecodeLayout:
    """Stands for the ``BlockLayout`` of a decode step (module docstring); the kernel computes the tiles.

    ``full_kv_num_blocks``/``kv_num_blocks``: ``(1, 1, 1)`` int32 and ``full_kv_indices``/``kv_indices``:
    ``(1, 1, 1, 1)`` int32 placeholders (never read)."""

    block_q: int
    block_k: int
    q_len: int
    kv_len: int
    pattern: Pattern
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


def _static(pattern: Pattern) -> Pattern:
    return pattern.static_part() if pattern.learned else pattern


def decode_layout(pattern: Pattern, q_len: int, kv_len: int, geometry: RowGeometry, *, block_q: int, block_k: int,
                  layer_idx: int = 0, num_kv_heads: int = 1) -> DecodeLayout | None:
    """A ``DecodeLayout`` for a decode step of ``pattern`` (``q_len <= 16``; causal dense,
    sliding_window, streaming or block_diagonal, or a learned pattern's static part), else None (build a
    ``BlockLayout``). No host work beyond a few integer operations."""
    p = _static(pattern)
    if q_len > MAX_DECODE_QUERIES or type(p) not in (Dense, SlidingWindow, Streaming, BlockDiagonal) or not p.causal:
        return None
    dev = geometry.q_start.device
    num, idx = placeholder(dev, torch.int32, 3), placeholder(dev, torch.int32, 4)
    return DecodeLayout(
        block_q, block_k, q_len, kv_len, p, layer_idx, num_kv_heads, geometry,
        decode_tile_bound(p, block_q, kv_len, block_k), num, idx, num, idx,
    )
