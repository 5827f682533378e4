"""Block layout: which key tiles each query tile visits, split into full and partial tiles.

A ``BlockLayout`` is what the block-sparse kernels and the PyTorch path consume (design §5). It has
the spirit of FlexAttention's ``BlockMask``. With ``NQ = ceil(q_len / block_q)`` query tiles and
``NK = ceil(kv_len / block_k)`` key tiles (tiles are ranges of *tensor indices*):

* ``kv_num_blocks``: ``(B', H', NQ)`` int32 — how many *partial* key tiles query tile ``m`` visits.
* ``kv_indices``: ``(B', H', NQ, P)`` int32 — their key-tile indices, ascending; entries at
  ``[..., kv_num_blocks:]`` are unspecified (filled with 0).
* ``full_kv_num_blocks`` / ``full_kv_indices``: the same for *full* tiles, where every (query, key)
  pair is allowed, so kernels skip the element mask there.

``B'`` is 1 when every batch row has the same geometry (no padding, scalar offsets) and ``B``
otherwise; ``H'`` is 1 unless the pattern differs per KV head (``bigbird``), then ``Hkv``. Query
heads of one KV group share a row. Inside a partial tile the kernels evaluate the element rule
``pattern.allowed(qpos, kpos)`` in registers (causal edge, window edge, sinks, dilation stride) plus
key validity ``k_start <= j < k_end`` from the ``RowGeometry``. A partial tile may turn out to
allow nothing; a full tile never holds a disallowed pair.

The dense mask the layout stands for is rebuilt like this (``to_dense`` does it, for tests)::

    for b, h, m in product(range(B'), range(H'), range(NQ)):
        for n in full_kv_indices[b, h, m, :full_kv_num_blocks[b, h, m]]:
            dense[b, h, tile_q(m), tile_k(n)] = True
        for n in kv_indices[b, h, m, :kv_num_blocks[b, h, m]]:
            dense[b, h, tile_q(m), tile_k(n)] = rule(b, h, tile_q(m), tile_k(n))

Building costs time and memory proportional to the visited tiles: the pattern names a few key
intervals per query tile (``Pattern.key_intervals``); nothing S x S is ever allocated.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .geometry import RowGeometry
from .patterns import BigBird, Pattern

__all__ = ["BlockLayout", "build_block_layout", "clear_layout_cache", "full_tiles_contiguous", "transposed_layout"]

_CACHE: "OrderedDict[tuple, BlockLayout]" = OrderedDict()
_CACHE_SIZE = 64


def clear_layout_cache() -> None:
    _CACHE.clear()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class BlockLayout:
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    block_q: int
    block_k: int
    q_len: int
    kv_len: int
    pattern: Pattern
    layer_idx: int
    num_kv_heads: int
    geometry: RowGeometry

    @property
    def num_q_blocks(self) -> int:
        return _ceil_div(self.q_len, self.block_q)

    @property
    def num_k_blocks(self) -> int:
        return _ceil_div(self.kv_len, self.block_k)

    def allowed_tiles(self) -> int:
        """Number of (query tile, key tile) pairs visited, summed over rows and heads of the layout."""
        return int(self.kv_num_blocks.sum().item() + self.full_kv_num_blocks.sum().item())

    def element_rule(self, q_idx: torch.Tensor, k_idx: torch.Tensor, row: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """The in-tile rule on tensor indices (broadcastable int64 tensors; ``row``/``head`` index
        the layout's ``B'``/``H'``): pattern rule on positions and key validity."""
        g = self.geometry
        ks, qs, ke = g.k_start[row], g.q_start[row], g.k_end[row]
        qpos = qs + q_idx - ks
        kpos = k_idx - ks
        ok = self.pattern.allowed(qpos, kpos, self.layer_idx, head, self.kv_len)
        return ok & (k_idx >= ks) & (k_idx < ke)

    def to_dense(self) -> torch.Tensor:
        """``(B', H', q_len, kv_len)`` bool mask that this layout stands for (tests only: S x S)."""
        Bp, Hp, NQ = self.kv_num_blocks.shape
        dev = self.kv_num_blocks.device
        kinds = torch.zeros(Bp, Hp, NQ, self.num_k_blocks + 1, dtype=torch.int8, device=dev)
        for num, idx, val in ((self.kv_num_blocks, self.kv_indices, 1), (self.full_kv_num_blocks, self.full_kv_indices, 2)):
            slot = torch.arange(idx.shape[-1], device=dev)
            tgt = torch.where(slot < num.unsqueeze(-1), idx.long(), self.num_k_blocks)
            kinds.scatter_(-1, tgt, torch.full_like(tgt, val, dtype=torch.int8))
        kinds = kinds[..., : self.num_k_blocks]
        el = kinds.repeat_interleave(self.block_q, 2).repeat_interleave(self.block_k, 3)[:, :, : self.q_len, : self.kv_len]
        q_idx = torch.arange(self.q_len, device=dev).view(1, 1, -1, 1)
        k_idx = torch.arange(self.kv_len, device=dev).view(1, 1, 1, -1)
        row = torch.arange(Bp, device=dev).view(-1, 1, 1, 1)
        head = torch.arange(Hp, device=dev).view(1, -1, 1, 1)
        rule = self.element_rule(q_idx, k_idx, row, head)
        return (el == 2) | ((el == 1) & rule)

    def expand(self, batch: int, num_kv_heads: int) -> "BlockLayout":
        """The same layout with ``B' = batch`` and ``H' = num_kv_heads`` (views, no copies)."""

        def ex(t):
            return t.expand(batch, num_kv_heads, *t.shape[2:])

        return BlockLayout(
            ex(self.kv_num_blocks), ex(self.kv_indices), ex(self.full_kv_num_blocks), ex(self.full_kv_indices),
            self.block_q, self.block_k, self.q_len, self.kv_len, self.pattern, self.layer_idx, self.num_kv_heads,
            self.geometry,
        )

    # ----- FlexAttention interop ----------------------------------------------------------
    def mask_mod(self):
        """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` computing the same element rule.

        ``h`` is a *query* head; query heads map to KV heads as ``h // (Hq // Hkv)`` — call
        ``mask_mod_for(num_q_heads)`` for per-head patterns.
        """
        return self.mask_mod_for(self.num_kv_heads)

    def mask_mod_for(self, num_q_heads: int):
        g = self.geometry
        rows = g.rows
        group = max(1, num_q_heads // max(1, self.num_kv_heads))
        pattern, layer_idx, kv_len = self.pattern, self.layer_idx, self.kv_len
        qs, ks, ke = g.q_start, g.k_start, g.k_end
        if isinstance(pattern, BigBird) and pattern.random_blocks:
            nqb = _ceil_div(kv_len + self.q_len, pattern.block) + 1
            table = pattern.random_table(layer_idx, self.num_kv_heads, nqb, pattern._num_k_blocks(kv_len), qs.device)
        else:
            table = None

        def mask_mod(b, h, q_idx, kv_idx):
            r = b if rows > 1 else 0
            qpos = qs[r] + q_idx - ks[r]
            kpos = kv_idx - ks[r]
            if table is None:
                ok = pattern.allowed(qpos, kpos, layer_idx, h // group, kv_len)
            else:
                ok = _bigbird_rule_from_table(pattern, qpos, kpos, table, h // group)
            return ok & (kv_idx >= ks[r]) & (kv_idx < ke[r])

        return mask_mod

    def to_block_mask(self, batch: int, num_q_heads: int):
        """FlexAttention ``BlockMask`` with the same tiles and an equivalent ``mask_mod``."""
        from torch.nn.attention.flex_attention import BlockMask

        Bp, Hp = self.kv_num_blocks.shape[:2]
        NK = self.num_k_blocks

        def widen(idx):
            out = torch.zeros(*idx.shape[:-1], NK, dtype=torch.int32, device=idx.device)
            out[..., : idx.shape[-1]] = idx
            return out

        group = num_q_heads // self.num_kv_heads

        def per_q_head(t):
            t = t.expand(batch, t.shape[1], *t.shape[2:])
            if Hp == 1:
                return t.expand(batch, num_q_heads, *t.shape[2:]).contiguous()
            return t.repeat_interleave(group, 1).contiguous()

        return BlockMask.from_kv_blocks(
            per_q_head(self.kv_num_blocks),
            per_q_head(widen(self.kv_indices)),
            per_q_head(self.full_kv_num_blocks),
            per_q_head(widen(self.full_kv_indices)),
            BLOCK_SIZE=(self.block_q, self.block_k),
            mask_mod=self.mask_mod_for(num_q_heads),
            seq_lengths=(self.q_len, self.kv_len),
        )

    @classmethod
    def from_block_mask(cls, block_mask, pattern: Pattern, geometry: RowGeometry, layer_idx: int = 0, num_kv_heads: int = 1) -> "BlockLayout":
        """Take the tiles of a FlexAttention ``BlockMask`` whose ``mask_mod`` computes ``pattern``.

        The mask's head dimension may be 1, ``num_kv_heads``, or a multiple of it (one row per query
        head, shared within each KV group as ``to_block_mask`` writes it): then the first query head of
        every group stands for its KV head.
        """
        bq, bk = block_mask.BLOCK_SIZE
        q_len, kv_len = block_mask.seq_lengths
        num, idx = block_mask.kv_num_blocks, block_mask.kv_indices
        full_num, full_idx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
        if full_num is None:
            full_num = torch.zeros_like(num)
            full_idx = torch.zeros_like(idx[..., :1])
        heads = num.shape[1]
        if heads not in (1, num_kv_heads):
            if heads % num_kv_heads:
                raise ValueError(f"BlockMask has {heads} heads, not 1 or a multiple of num_kv_heads={num_kv_heads}")
            step = heads // num_kv_heads
            num, idx, full_num, full_idx = (t[:, ::step] for t in (num, idx, full_num, full_idx))
        return cls(
            num.to(torch.int32), idx.to(torch.int32), full_num.to(torch.int32), full_idx.to(torch.int32),
            bq, bk, q_len, kv_len, pattern, layer_idx, num_kv_heads, geometry,
        )


def _bigbird_rule_from_table(p: BigBird, qpos, kpos, table, kv_head):
    qb = torch.div(qpos, p.block, rounding_mode="floor")
    kb = torch.div(kpos, p.block, rounding_mode="floor")
    w = p.window_blocks
    win = ((kb >= qb - w) & (kb <= qb)) if p.causal else ((qb - kb).abs() <= w)
    ok = win | (kb < p.global_blocks)
    picks = table[kv_head, qb.clamp(0, table.shape[1] - 1)]
    for s in range(p.random_blocks):
        ok = ok | ((picks[..., s] == kb) & (qb >= 0))
    ok = ok & (kpos >= 0)
    if p.causal:
        ok = ok & (kpos <= qpos)
    return ok


def _pack(mask: torch.Tensor, cand: torch.Tensor, sentinel: int):
    """Move the candidates where ``mask`` holds to the front, ascending; return (count, indices)."""
    key = torch.where(mask, cand, torch.full_like(cand, sentinel))
    key, _ = key.sort(-1)
    count = mask.sum(-1).to(torch.int32)
    width = max(1, int(count.max().item()) if count.numel() else 1)
    idx = key[..., :width]
    idx = torch.where(idx == sentinel, torch.zeros_like(idx), idx).to(torch.int32)
    return count, idx


def build_block_layout(
    pattern: Pattern,
    q_len: int,
    kv_len: int,
    geometry: RowGeometry,
    *,
    block_q: int = 128,
    block_k: int = 128,
    layer_idx: int = 0,
    num_kv_heads: int = 1,
    cache: bool = True,
) -> BlockLayout:
    """Compile ``pattern`` for these lengths and row geometry into a ``BlockLayout``.

    Learned patterns compile their static part (sinks + window). Results are cached by everything
    they depend on (pattern config, lengths, geometry, block sizes, device, and the layer index /
    KV-head count where the pattern uses them); not inside a ``torch.compile`` trace, where the
    layout's tensors may live in a CUDA graph's memory pool that the next replay overwrites.

    Raises ``TypeError`` for a ``pattern`` that is no ``Pattern`` or a block size that is no int, ``ValueError`` for a
    block size below 1.
    """
    if not isinstance(pattern, Pattern):
        raise TypeError(
            f"build_block_layout: `pattern` must be a Pattern (sparse_k.get_pattern(name, ...) makes one), "
            f"got {type(pattern).__name__}"
        )
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"build_block_layout: `{name}` must be an int, got {type(size).__name__} ({size!r})")
        if size < 1:
            raise ValueError(f"build_block_layout: `{name}` must be >= 1, got {size}")
    if pattern.learned:
        pattern = pattern.static_part()
    device = geometry.q_start.device
    key = None
    if cache and not torch.compiler.is_compiling():
        key = (
            pattern, q_len, kv_len, geometry.cache_key(), block_q, block_k, str(device),
            layer_idx if pattern.uses_layer else None, num_kv_heads if pattern.per_head else None,
        )
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    layout = _build(pattern, q_len, kv_len, geometry, block_q, block_k, layer_idx, num_kv_heads)
    if key is not None:
        _CACHE[key] = layout
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return layout


def _build(pattern, q_len, kv_len, geometry, bq, bk, layer_idx, num_kv_heads) -> BlockLayout:
    device = geometry.q_start.device
    NQ, NK = _ceil_div(q_len, bq), _ceil_div(kv_len, bk)
    heads = num_kv_heads if pattern.per_head else 1
    qs, ks, ke = geometry.q_start[:, None], geometry.k_start[:, None], geometry.k_end[:, None]  # (B', 1)
    t = torch.arange(NQ, device=device, dtype=torch.int64)[None, :]
    q_lo_idx = t * bq
    q_hi_idx = torch.clamp(t * bq + bq, max=q_len) - 1
    q_lo = qs + q_lo_idx - ks  # (B', NQ) positions
    q_hi = qs + q_hi_idx - ks

    lo, hi = pattern.key_intervals(q_lo, q_hi, layer_idx, heads, kv_len)  # (H', B', NQ, n)
    n_valid = (ke - ks).clamp_min(0)  # (B', 1)
    lo = lo.clamp_min(0)
    hi = torch.minimum(hi, (n_valid - 1).unsqueeze(-1).expand_as(hi))
    nonempty = lo <= hi
    kt_lo = torch.div(lo + ks.unsqueeze(-1), bk, rounding_mode="floor")
    kt_hi = torch.div(hi + ks.unsqueeze(-1), bk, rounding_mode="floor")
    span = torch.where(nonempty, kt_hi - kt_lo + 1, torch.zeros_like(kt_lo))
    M = max(1, int(span.max().item()) if span.numel() else 1)
    steps = torch.arange(M, device=device)
    cand = kt_lo.unsqueeze(-1) + steps  # (H', B', NQ, n, M)
    valid = steps < span.unsqueeze(-1)
    cand = torch.where(valid, cand, torch.full_like(cand, NK)).flatten(-2)
    cand, _ = cand.sort(-1)
    dup = torch.zeros_like(cand, dtype=torch.bool)
    dup[..., 1:] = cand[..., 1:] == cand[..., :-1]
    valid = (cand < NK) & ~dup

    # Classify the candidate tiles.
    k_lo_idx = cand * bk
    k_hi_idx = torch.clamp(cand * bk + bk, max=kv_len) - 1
    ks4, ke4 = ks.unsqueeze(-1), ke.unsqueeze(-1)  # (B', 1, 1)
    inside = (k_lo_idx >= ks4) & (k_hi_idx < ke4)
    full = pattern.tile_full(
        q_lo.unsqueeze(-1), q_hi.unsqueeze(-1), k_lo_idx - ks4, k_hi_idx - ks4, layer_idx, heads, kv_len
    )
    full = full & inside & valid
    partial = valid & ~full

    full_num, full_idx = _pack(full, cand, NK)
    part_num, part_idx = _pack(partial, cand, NK)
    tr = lambda x: x.transpose(0, 1).contiguous()  # noqa: E731  (H', B', ...) -> (B', H', ...)
    return BlockLayout(
        tr(part_num), tr(part_idx), tr(full_num), tr(full_idx), bq, bk, q_len, kv_len,
        pattern, layer_idx, num_kv_heads, geometry,
    )


def transposed_layout(layout: BlockLayout):
    """Query tiles per key tile: ``(full_num, full_idx, part_num, part_idx)``, shapes ``(B', H', NK[, W])``.

    Computed once per layout (kept on the layout object); costs ``B' * H' * NQ * NK`` bytes.
    """
    cached = getattr(layout, "_transposed", None)
    if cached is not None:
        return cached
    NQ, NK = layout.num_q_blocks, layout.num_k_blocks
    Bp, Hp = layout.kv_num_blocks.shape[:2]
    dev = layout.kv_num_blocks.device
    kinds = torch.zeros(Bp, Hp, NQ, NK + 1, dtype=torch.int8, device=dev)
    for num, idx, val in (
        (layout.kv_num_blocks, layout.kv_indices, 1), (layout.full_kv_num_blocks, layout.full_kv_indices, 2),
    ):
        slot = torch.arange(idx.shape[-1], device=dev)
        tgt = torch.where(slot < num.unsqueeze(-1), idx.long(), NK)
        kinds.scatter_(-1, tgt, torch.full_like(tgt, val, dtype=torch.int8))
    kinds = kinds[..., :NK].transpose(-1, -2)  # (B', H', NK, NQ)
    cand = torch.arange(NQ, device=dev, dtype=torch.int64).expand_as(kinds)
    full_num, full_idx = _pack(kinds == 2, cand, NQ)
    part_num, part_idx = _pack(kinds == 1, cand, NQ)
    result = (full_num.contiguous(), full_idx.contiguous(), part_num.contiguous(), part_idx.contiguous())
    layout._transposed = result
    return result


def full_tiles_contiguous(layout) -> bool:
    """True when every query tile's full key tiles are one ascending run ``n0, n0 + 1, ...``.

    Sliding-window and dense layouts are; the kernel then skips the per-tile index load. Computed
    once per layout (kept on it; one host synchronisation)."""
    cached = getattr(layout, "_full_contig", None)
    if cached is not None:
        return cached
    idx, num = layout.full_kv_indices, layout.full_kv_num_blocks
    slot = torch.arange(idx.shape[-1], device=idx.device)
    in_run = (idx.long() - idx[..., :1].long()) == slot
    ok = bool(torch.where(slot < num.unsqueeze(-1), in_run, torch.ones_like(in_run)).all())
    try:
        layout._full_contig = ok
    except AttributeError:
        pass
    return ok
