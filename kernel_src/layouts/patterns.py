"""Sparse attention patterns: typed, validated configurations and their element rules.

Every pattern is a frozen dataclass (hashable, so layouts can be cached by it) with three jobs:

* ``allowed(qpos, kpos, ...)`` — the exact element rule of design §4 (``docs/design.md``) on
  *positions* (not tensor indices), vectorised over broadcastable integer tensors. The exact
  reference and ``BlockLayout.to_dense`` use it.
* ``key_intervals(q_lo, q_hi, ...)`` — for a tile of query positions ``[q_lo, q_hi]`` a few
  inclusive intervals of key positions that contain every allowed key (a superset). The layout
  builder enumerates key tiles from them, so building costs time proportional to the allowed
  blocks, never S×S.
* ``tile_full(q_lo, q_hi, k_lo, k_hi, ...)`` — a conservative test that *every* pair of a tile is
  allowed (``False`` when unsure: the tile is then treated as partial, which is always correct).

``sparse_k`` and ``dsa`` are learned: their static part (sinks + window) is a ``streaming`` rule;
the data-dependent selection travels beside it as a ``TokenLayout``.

Integer parameters take Python or numpy integers (stored as Python ints, so ``to_dict`` stays JSON) and are bounded
(``ValueError`` naming the value): windows, blocks, counts and the reaches computed from them at most ``MAX_SIZE``
(2**62), ``sinks`` any int64, bigbird's ``random_blocks`` at most ``MAX_RANDOM_BLOCKS``.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from dataclasses import InitVar, dataclass
from typing import ClassVar

import torch

__all__ = [
    "Pattern",
    "Dense",
    "SlidingWindow",
    "Streaming",
    "BlockDiagonal",
    "BigBird",
    "Dilated",
    "L2Aligned",
    "SparseK",
    "DSA",
    "available_patterns",
    "get_pattern",
    "pattern_from_dict",
    "resolve_l2_segment",
]


#: Largest window, block, count or offset (in tokens or blocks) a pattern takes: far past any sequence (a window or block
#: longer than the sequence selects what one as long as the sequence does), with room for the int64 arithmetic on
#: positions (``i - window``, ``block * window_blocks``...) not to overflow.
MAX_SIZE = 1 << 62

#: Largest ``sinks``: only compared with key positions (``j < sinks``), so any int64 (``sys.maxsize``: "every key").
MAX_SINKS = (1 << 63) - 1

#: Most random blocks per query block of ``bigbird`` (its table holds ``random_blocks`` entries per query block and KV
#: head; a budget-matched bigbird at 1M tokens, block 128, draws about 3,000).
MAX_RANDOM_BLOCKS = 4096


def _plain_int(value):
    """A numpy integer (any ``numbers.Integral`` but a bool) as the Python int it holds; any other value as is (the
    checks name its type), so parameters stay JSON-friendly."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    return value


def _check_int(owner: str, name: str, value, minimum: int, maximum: int = MAX_SIZE) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: `{name}` must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{owner}: `{name}` must be >= {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{owner}: `{name}` must be <= {maximum}, got {value}")


def _check_span(owner: str, what: str, value: int) -> None:
    """``value``, a reach computed from several parameters (``what`` names the product), at most ``MAX_SIZE``."""
    if value > MAX_SIZE:
        raise ValueError(f"{owner}: {what} = {value} must be <= {MAX_SIZE} (2**62)")


def _check_bool(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: `{name}` must be a bool, got {type(value).__name__} ({value!r})")


def _full_range(q_lo, q_hi, k_lo, k_hi):
    """Smallest and largest ``i - j`` over a tile (all int64 tensors of one shape)."""
    return q_lo - k_hi, q_hi - k_lo


@dataclass(frozen=True)
class Pattern:
    """Base class. ``causal=True`` adds ``j <= i`` to every rule."""

    name: ClassVar[str] = ""
    #: True when the rule depends on the KV head (the layout then has one row per KV head).
    per_head: ClassVar[bool] = False
    #: True when the rule depends on the layer index (keys of the layout cache include it).
    uses_layer: ClassVar[bool] = False
    #: True for learned patterns whose selection comes from a TokenLayout.
    learned: ClassVar[bool] = False
    #: Whether a bidirectional (``causal=False``) version exists.
    bidirectional_ok: ClassVar[bool] = False

    causal: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # numpy integers stored as Python ints (frozen: set through object)
            object.__setattr__(self, f.name, _plain_int(getattr(self, f.name)))
        _check_bool(self.name, "causal", self.causal)
        if not self.causal and not self.bidirectional_ok:
            raise ValueError(f"pattern {self.name!r} has no bidirectional version; use causal=True")
        self._validate()

    def _validate(self) -> None:
        pass

    # ----- rules (override) -------------------------------------------------------------
    def _rule(self, qpos, kpos, layer_idx: int, kv_head, kv_len):
        raise NotImplementedError

    def _intervals(self, q_lo, q_hi, layer_idx: int, num_kv_heads: int, kv_len):
        raise NotImplementedError

    def _tile_full(self, q_lo, q_hi, k_lo, k_hi, layer_idx: int, num_kv_heads: int, kv_len):
        return torch.zeros(torch.broadcast_shapes(q_lo.shape, k_lo.shape), dtype=torch.bool, device=q_lo.device)

    # ----- public API -------------------------------------------------------------------
    def allowed(self, qpos: torch.Tensor, kpos: torch.Tensor, layer_idx: int = 0, kv_head=0, kv_len: int | None = None) -> torch.Tensor:
        """Element rule on positions: ``bool`` tensor of the broadcast shape of the inputs.

        ``qpos``/``kpos`` are int64 tensors of query and key *positions* (design §3);
        ``kv_head`` an int or an int64 tensor broadcastable with them (used by per-head rules).
        Negative key positions (padding before a row's first token) are never allowed.
        """
        ok = self._rule(qpos, kpos, layer_idx, kv_head, kv_len) & (kpos >= 0)
        if self.causal:
            ok = ok & (kpos <= qpos)
        if self.per_head and isinstance(kv_head, torch.Tensor):
            ok = ok.expand(torch.broadcast_shapes(ok.shape, kv_head.shape))
        return ok

    def key_intervals(self, q_lo: torch.Tensor, q_hi: torch.Tensor, layer_idx: int = 0, num_kv_heads: int = 1, kv_len: int | None = None):
        """Inclusive key-position intervals that contain every key allowed for queries in ``[q_lo, q_hi]``.

        Args: ``q_lo``, ``q_hi`` int64 tensors of one shape ``(...,)``.
        Returns ``(lo, hi)`` of shape ``(H', ..., n)`` with ``H' = num_kv_heads`` for per-head patterns
        and 1 otherwise; an interval with ``lo > hi`` is empty.
        """
        lo, hi = self._intervals(q_lo, q_hi, layer_idx, num_kv_heads, kv_len)
        if self.causal:
            hi = torch.minimum(hi, q_hi.unsqueeze(-1).expand_as(hi))
        return lo, hi

    def tile_full(self, q_lo, q_hi, k_lo, k_hi, layer_idx: int = 0, num_kv_heads: int = 1, kv_len: int | None = None) -> torch.Tensor:
        """Conservative: True only where every (i, j) in ``[q_lo, q_hi] x [k_lo, k_hi]`` is allowed.

        Shapes as ``key_intervals``' output; per-head patterns take a leading head dimension.
        """
        full = self._tile_full(q_lo, q_hi, k_lo, k_hi, layer_idx, num_kv_heads, kv_len) & (k_lo >= 0)
        if self.causal:
            full = full & (k_hi <= q_lo)
        return full

    def to_dict(self) -> dict:
        """Plain dict (JSON-friendly) that ``pattern_from_dict`` turns back into this pattern."""
        d = {"pattern": self.name}
        d.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        return d

    def replace(self, **changes) -> "Pattern":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Dense(Pattern):
    """Every key (causal: every earlier key)."""

    name: ClassVar[str] = "dense"
    bidirectional_ok: ClassVar[bool] = True

    def _rule(self, qpos, kpos, layer_idx, kv_head, kv_len):
        return torch.ones(torch.broadcast_shapes(qpos.shape, kpos.shape), dtype=torch.bool, device=qpos.device)

    def _intervals(self, q_lo, q_hi, layer_idx, num_kv_heads, kv_len):
        lo = torch.zeros_like(q_lo)
        hi = torch.full_like(q_hi, torch.iinfo(torch.int64).max // 4)
        return lo[None, ..., None], hi[None, ..., None]

    def _tile_full(self, q_lo, q_hi, k_lo, k_hi, layer_idx, num_kv_heads, kv_len):
        return torch.ones(torch.broadcast_shapes(q_lo.shape, k_lo.shape), dtype=torch.bool, device=q_lo.device)


@dataclass(frozen=True)
class SlidingWindow(Pattern):
    """Causal: ``i - window < j <= i`` (Transformers' ``sliding_window``). Bidirectional:
    ``|i - j| <= window`` (Transformers' bidirectional sliding-window mask, inclusive)."""

    name: ClassVar[str] = "sliding_window"
    bidirectional_ok: ClassVar[bool] = True
    window: int = 4096

    def _validate(self):
        _check_int(self.name, "window", self.window, 1)

    def _rule(self, qpos, kpos, layer_idx, kv_head, kv_len):
        d = qpos - kpos
        return d < self.window if self.causal else d.abs() <= self.window

    def _intervals(self, q_lo, q_hi, layer_idx, num_kv_heads, kv_len):
        if self.causal:
            lo, hi = q_lo - self.window + 1, q_hi
        else:
            lo, hi = q_lo - self.window, q_hi + self.window
        return lo[None, ..., None], hi[None, ..., None]

    def _tile_full(self, q_lo, q_hi, k_lo, k_hi, layer_idx, num_kv_heads, kv_len):
        dmin, dmax = _full_range(q_lo, q_hi, k_lo, k_hi)
        if self.causal:
            return dmax < self.window
        return (dmax <= self.window) & (dmin >= -self.window)


@dataclass(frozen=True)
class Streaming(Pattern):
    """StreamingLLM: the first ``sinks`` tokens plus a causal window: ``j < sinks or i - window < j``."""

    name: ClassVar[str] = "streaming"
    sinks: int = 4
    window: int = 4096

    def _validate(self):
        _check_int(self.name, "sinks", self.sinks, 0, MAX_SINKS)
        _check_int(self.name, "window", self.window, 1)

    def _rule(self, qpos, kpos, layer_idx, kv_head, kv_len):
        return (kpos < self.sinks) | (qpos - kpos < self.window)

    def _intervals(self, q_lo, q_hi, layer_idx, num_kv_heads, kv_len):
        lo = torch.stack([torch.zeros_like(q_lo), q_lo - self.window + 1], -1)
        hi = torch.stack([torch.full_like(q_hi, self.sinks - 1), q_hi], -1)
        return lo[None], hi[None]

    def _tile_full(self, q_lo, q_hi, k_lo, k_hi, layer_idx, num_kv_heads, kv_len):
        return (k_hi < self.sinks) | (q_hi - k_lo < self.window)


@dataclass(frozen=True)
class BlockDiagonal(Pattern):
    """Queries see only keys of their own block: ``i // block == j // block``."""

    name: ClassVar[str] = "block_diagonal"
    bidirectional_ok: ClassVar[bool] = True
    block: int = 512

    def _validate(self):
        _check_int(self.name, "block", self.block, 1)

    def _rule(self, qpos, kpos, layer_idx, kv_head, kv_len):
        return torch.div(qpos, self.block, rounding_mode="floor") == torch.div(kpos, self.block, rounding_mode="floor")

    def _intervals(self, q_lo, q_hi, layer_idx, num_kv_heads, kv_len):
        lo = torch.div(q_lo, self.block, rounding_mode="floor") * self.block
        hi = (torch.div(q_hi, self.block, rounding_mode="floor") + 1) * self.block - 1
        return lo[None, ..., None], hi[None, ..., None]

    def _tile_full(self, q_lo, q_hi, k_lo, k_hi, layer_idx, num_kv_heads, kv_len):
        b = self.block
        f = lambda x: torch.div(x, b, rounding_mode="floor")  # noqa: E731
        return (f(q_lo) == f(q_hi)) & (f(k_lo) == f(k_hi)) & (f(q_lo) == f(k_lo))


@dataclass(frozen=True)
class BigBird(Pattern):
    """BigBird-style block sparsity with blocks of ``block`` tokens (``qb = i // block``, ``kb = j // block``).

    A key block is attended when it is in the window (``qb - window_blocks <= kb <= qb``; bidirectional:
    ``|qb - kb| <= window_blocks``), global (``kb < global_blocks``), or one of ``random_blocks`` blocks
    drawn per (seed, layer, KV head, absolute qb) among the blocks not already allowed (all of them
    when there are fewer; ``random_blocks`` is at most ``MAX_RANDOM_BLOCKS``). Random draws are deterministic, so
    decoding equals recomputing.
    """

    name: ClassVar[str] = "bigbird"
    per_head: ClassVar[bool] = True
    uses_layer: ClassVar[bool] = True
    bidirectional_ok: ClassVar[bool] = True
    block: int = 64
    window_blocks: int = 1
    global_blocks: int = 1
    random_blocks: int = 2
    seed: int = 0

    def _validate(self):
        _check_int(self.name, "block", self.block, 1)
        _check_int(self.name, "window_blocks", self.window_blocks, 0)
        _check_int(self.name, "global_blocks", self.global_blocks, 0)
        _check_int(self.name, "random_blocks", self.random_blocks, 0, MAX_RANDOM_BLOCKS)
        _check_int(self.name, "seed", self.seed, 0)
        _check_span(self.name, "block * (window_blocks + 1)", self.block * (self.window_blocks + 1))
        _check_span(self.name, "block * global_blocks", self.block * self.global_blocks)

    def random_table(self, layer_idx: int, num_kv_heads: int, num_q_blocks: int, num_k_blocks: int | None = None, device=None):
        """Random key blocks, ``(num_kv_heads, num_q_blocks, random_blocks)`` int64, -1 where none.

        ``num_k_blocks`` (bidirectional only) bounds the candidates to the blocks that exist.
        Rows of different query blocks are drawn independently, so a table built for more query
        blocks holds this one as a prefix: tables are cached per (pattern, layer, heads, key blocks,
        device) with room for the next power of two of ``num_q_blocks`` and sliced (decoding asks
        for one more query block at a time). Inside a ``torch.compile`` trace the table is computed
        and not cached: a tensor made there may live in a CUDA graph's memory pool
        (``mode="reduce-overhead"``), which the next replay overwrites.
        """
        if not self.causal and num_k_blocks is None:
            num_k_blocks = num_q_blocks
        if torch.compiler.is_compiling():
            return _bigbird_random_table(self, layer_idx, num_kv_heads, num_q_blocks, num_k_blocks, device)
        key = (self, layer_idx, num_kv_heads, num_k_blocks, str(torch.device(device) if device is not None else "cpu"))
        return cached_block_table(
            _RANDOM_TABLES, _RANDOM_TABLES_MAX, key, num_q_blocks,
            lambda room: _bigbird_random_table(self, layer_idx, num_kv_heads, room, num_k_blocks, device))

    def layer_seed(self, layer_idx: int) -> int:
        """The 31-bit seed of layer ``layer_idx``'s random-block hash (``random_table``; the decode kernel's
        draws take it through ``pattern_codes.decode_pattern_code``)."""
        return (self.seed * 7919 + layer_idx * 104729 + 17) & ((1 << 31) - 1)

    def _blocks(self, x):
        return torch.div(x, self.block, rounding_mode="floor")

    def _num_k_blocks(self, kv_len):
        if self.causal:
            return None
        if kv_len is None:
            raise ValueError("bigbird with causal=False draws random blocks among all key blocks: pass kv_len")
        return -(-kv_len // self.block)

    def _rule(self, qpos, kpos, layer_idx, kv_head, kv_len):
        qb, kb = self._blocks(qpos), self._blocks(kpos)
        w = self.window_blocks
        win = ((kb >= qb - w) & (kb <= qb)) if self.causal else ((qb - kb).abs() <= w)
        ok = win | (kb < self.global_blocks)
        if self.random_blocks == 0:
            return ok
        kv_head = torch.as_tensor(kv_head, device=qpos.device)
        shape = torch.broadcast_shapes(qb.shape, kb.shape, kv_head.shape)
        qb_b, kb_b, h_b = qb.expand(shape), kb.expand(shape), kv_head.expand(shape)
        n_heads = int(h_b.max().item()) + 1 if h_b.numel() else 1
        n_qb = int(qb_b.clamp_min(0).max().item()) + 1 if qb_b.numel() else 1
        table = self.random_table(layer_idx, n_heads, n_qb, self._num_k_blocks(kv_len), qpos.device)  # (H, NQB, r)
        picks = table[h_b.clamp_min(0), qb_b.clamp_min(0)]  # (*shape, r)
        rnd = (picks == kb_b.unsqueeze(-1)).any(-1) & (qb_b >= 0)
        return ok | rnd

    def _intervals(self, q_lo, q_hi, layer_idx, num_kv_heads, kv_len):
        B, w, g, r = self.block, self.window_blocks, self.global_blocks, self.random_blocks
        qb_lo, qb_hi = self._blocks(q_lo), self._blocks(q_hi)
        win_lo = (qb_lo - w) * B
        win_hi = (qb_hi + 1) * B - 1 if self.causal else (qb_hi + w + 1) * B - 1
        los = [win_lo, torch.zeros_like(q_lo)]
        his = [win_hi, torch.full_like(q_hi, g * B - 1)]
        lo = torch.stack(los, -1)[None].expand(num_kv_heads, *q_lo.shape, 2)
        hi = torch.stack(his, -1)[None].expand(num_kv_heads, *q_lo.shape, 2)
        if r == 0:
            return lo, hi
        # Random blocks of every query block the tile touches.
        span = int((qb_hi - qb_lo).max().item()) + 1 if q_lo.numel() else 1
        n_qb = int(qb_hi.clamp_min(0).max().item()) + 1 if q_lo.numel() else 1
        table = self.random_table(layer_idx, num_kv_heads, n_qb, self._num_k_blocks(kv_len), q_lo.device)
        qbs = qb_lo.unsqueeze(-1) + torch.arange(span, device=q_lo.device)  # (..., span)
        valid = (qbs <= qb_hi.unsqueeze(-1)) & (qbs >= 0)
        picks = table[:, qbs.clamp(0, n_qb - 1)]  # (H, ..., span, r)
        picks = torch.where(valid.unsqueeze(-1), picks, torch.full_like(picks, -1))
        picks = picks.flatten(-2)
        rlo = torch.where(picks >= 0, picks * B, torch.ones_like(picks))
        rhi = torch.where(picks >= 0, picks * B + B - 1, torch.zeros_like(picks))
        return torch.cat([lo, rlo], -1), torch.cat([hi, rhi], -1)

    def _tile_full(self, q_lo, q_hi, k_lo, k_hi, layer_idx, num_kv_heads, kv_len):
        qb_lo, qb_hi, kb_lo, kb_hi = (self._blocks(x) for x in (q_lo, q_hi, k_lo, k_hi))
        one_block = (qb_lo == qb_hi) & (kb_lo == kb_hi)
        w = self.window_blocks
        win = ((kb_lo >= qb_lo - w) & (kb_lo <= qb_lo)) if self.causal else ((qb_lo - kb_lo).abs() <= w)
        glob = kb_lo < self.global_blocks
        full = one_block & (win | glob)
        if self.random_blocks and full.ndim > 0 and full.numel():
            n_qb = int(qb_lo.clamp_min(0).max().item()) + 1
            table = self.random_table(layer_idx, num_kv_heads, n_qb, self._num_k_blocks(kv_len), q_lo.device)
            heads = torch.arange(num_kv_heads, device=q_lo.device).view(-1, *([1] * (full.ndim - 1)))
            shape = full.shape
            picks = table[heads.expand(shape), qb_lo.expand(shape).clamp(0, n_qb - 1)]
            rnd = (picks == kb_lo.expand(shape).unsqueeze(-1)).any(-1)
            full = full | (one_block & rnd)
        return full



#: BigBird random tables by (pattern, layer, heads, key blocks, device); see ``BigBird.random_table``.
_RANDOM_TABLES: dict = {}
_RANDOM_TABLES_MAX = 512


def cached_block_table(cache: dict, max_entries: int, key, num_q_blocks: int, build) -> torch.Tensor:
    """``(H, num_q_blocks, ...)`` rows of a table whose rows are drawn per query block independently (so a longer
    table holds a shorter one as its prefix): ``build(room)`` for ``room`` query blocks, the next power of two (at
    least 64), kept in ``cache`` under ``key`` and sliced (decoding asks for one query block more at a time); the
    cache is emptied when it holds ``max_entries``."""
    table = cache.get(key)
    if table is None or table.shape[1] < num_q_blocks:
        if len(cache) >= max_entries:
            cache.clear()
        table = build(max(64, 1 << max(0, num_q_blocks - 1).bit_length()))
        cache[key] = table
    return table[:, :num_q_blocks]


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash (all intermediates stay below 2**62, so int64 never overflows)."""
    m = (1 << 31) - 1
    x = x & m
    for mult in (1103515245, 1664525, 22695477):
        x = (x * mult + 12345) & m
        x = x ^ (x >> 13)
    return x


def _bigbird_random_table(p: BigBird, layer_idx, num_kv_heads, num_q_blocks, num_k_blocks, device):
    return bigbird_draws(p.random_blocks, p.global_blocks, p.window_blocks, p.causal, p.layer_seed(layer_idx),
                         num_kv_heads, num_q_blocks, num_k_blocks, device)


def bigbird_draws(r: int, g: int, w: int, causal: bool, seed: int, num_kv_heads: int, num_q_blocks: int,
                  num_k_blocks: int | None, device) -> torch.Tensor:
    """bigbird's random key blocks, ``(num_kv_heads, num_q_blocks, r)`` int64, -1 where none: ``r`` random,
    ``g`` global and ``w`` window blocks, ``seed`` the layer's seed (``BigBird.layer_seed``; ``BigBird.random_table``
    is this with the pattern's fields, cached)."""
    qb = torch.arange(num_q_blocks, device=device, dtype=torch.int64)[None, :]  # (1, NQB)
    heads = torch.arange(num_kv_heads, device=device, dtype=torch.int64)[:, None]  # (H, 1)
    if causal:
        # Candidates g .. qb-w-1 (neither global nor in the window).
        first = torch.full_like(qb, g)
        count = (qb - w - g).clamp_min(0)
        skip_lo = skip_len = torch.zeros_like(qb)
    else:
        nk = num_k_blocks if num_k_blocks is not None else num_q_blocks
        first = torch.full_like(qb, g)
        win_lo = (qb - w).clamp_min(g)
        win_hi = (qb + w).clamp_max(nk - 1)
        skip_len = (win_hi - win_lo + 1).clamp_min(0)
        skip_lo = win_lo - g
        count = (nk - g - skip_len).clamp_min(0)
    count = count.expand(num_kv_heads, -1)
    seed_mix = _mix(torch.tensor(seed, device=device))
    base = _mix(seed_mix + heads * 1000003 + qb * 9176)  # (H, NQB)
    table = torch.full((num_kv_heads, num_q_blocks, r), -1, dtype=torch.int64, device=device)
    # Floyd's sampling of r distinct indices in [0, count): for t = count-r .. count-1. No row has more than
    # `most` candidates (host-known): with r >= most every row takes all of them (below) and nothing is drawn.
    most = max(0, num_q_blocks - w - g) if causal else max(0, (num_k_blocks or num_q_blocks) - g)
    for j in range(r if r < most else 0):
        t = count - r + j
        x = _mix(base + (j + 1) * 7777) % (t + 1).clamp_min(1)
        seen = (table[..., :j] == x.unsqueeze(-1)).any(-1) if j else torch.zeros_like(x, dtype=torch.bool)
        table[..., j] = torch.where(seen, t, x)
    small = count <= r  # take all candidates
    all_idx = torch.arange(r, device=device).view(1, 1, r).expand_as(table)
    table = torch.where(small.unsqueeze(-1), torch.where(all_idx < count.unsqueeze(-1), all_idx, -1), table)
    # Map candidate index -> key block (skipping the window for bidirectional).
    valid = table >= 0
    kb = table + first.unsqueeze(-1)
    if not causal:
        kb = torch.where(table >= skip_lo.unsqueeze(-1), kb + skip_len.unsqueeze(-1), kb)
    return torch.where(valid, kb, torch.full_like(kb, -1))


@dataclass(frozen=True)
class Dilated(Pattern):
    """Multi-scale dilated window: key j is attended when, for some scale s in ``0..scales-1``,
    ``(i - j) % 2**s == 0`` and ``|i - j| < window * 2**s``."""

    name: ClassVar[str] = "dilated"
    bidirectional_ok: ClassVar[bool] = True
    window: int = 1024
    scales: int = 3

    def _validate(self):
        _check_int(self.name, "window", self.window, 1)
        _check_int(self.name, "scales", self.scales, 1)
        if self.scales > 30:
            raise ValueError(f"dilated: `scales` must be <= 30, got {self.scales}")
        _check_span(self.name, "window * 2**(scales - 1)", self.reach)

    @property
    def reach(self) -> int:
        return self.window * 2 ** (self.scales - 1)

    def _rule(self, qpos, kpos, layer_idx, kv_head, kv_len):
        d = (qpos - kpos).abs()
        ok = torch.zeros(d.shape, dtype=torch.bool, device=d.device)
        for s in range(self.scales):
            stride = 1 << s
            ok = ok | ((d % stride == 0) & (d < self.window * stride))
        return ok

    def _intervals(self, q_lo, q_hi, layer_idx, num_kv_heads, kv_len):
        lo = q_lo - self.reach + 1
        hi = q_hi if self.causal else q_hi + self.reach - 1
        return lo[None, ..., None], hi[None, ..., None]

    def _tile_full(self, q_lo, q_hi, k_lo, k_hi, layer_idx, num_kv_heads, kv_len):
        dmin, dmax = _full_range(q_lo, q_hi, k_lo, k_hi)
        return (dmax < self.window) & (dmin > -self.window)


@dataclass(frozen=True)
class L2Aligned(Pattern):
    """Block-aligned window plus anchors: ``i // block - window_blocks < j // block`` or
    ``j % segment < anchor``, with ``0 <= anchor <= segment`` (``anchor == segment``: every key is an anchor; a
    ``segment`` shorter than the default anchor of 64 needs an ``anchor`` of its own).

    ``segment`` (tokens) is resolved once from the GPU's L2 size and the layer's KV bytes per token
    (``resolve_l2_segment``) and then stored as an int, so results never depend on the machine that
    replays them. ``None`` means "not resolved yet".
    """

    name: ClassVar[str] = "l2_aligned"
    block: int = 128
    window_blocks: int = 32
    segment: int | None = None
    anchor: int = 64

    def _validate(self):
        _check_int(self.name, "block", self.block, 1)
        _check_int(self.name, "window_blocks", self.window_blocks, 1)
        _check_int(self.name, "anchor", self.anchor, 0)
        _check_span(self.name, "block * window_blocks", self.block * self.window_blocks)
        if self.segment is not None:
            _check_int(self.name, "segment", self.segment, 1)
            if self.anchor > self.segment:
                raise ValueError(
                    f"l2_aligned: `anchor` ({self.anchor}; the default is {L2Aligned.anchor}) must be in [0, segment] = "
                    f"[0, {self.segment}] (the anchors are the first `anchor` keys of each segment); pass "
                    f"anchor <= {self.segment} or a segment >= {self.anchor}"
                )

    def _seg(self) -> int:
        if self.segment is None:
            raise ValueError(
                "l2_aligned: `segment` is not resolved; call resolve_l2_segment(pattern, kv_bytes_per_token) "
                "or pass segment=<tokens>"
            )
        return self.segment

    def _rule(self, qpos, kpos, layer_idx, kv_head, kv_len):
        b = self.block
        win = torch.div(qpos, b, rounding_mode="floor") - self.window_blocks < torch.div(kpos, b, rounding_mode="floor")
        return win | (kpos % self._seg() < self.anchor)

    def _intervals(self, q_lo, q_hi, layer_idx, num_kv_heads, kv_len):
        b, seg = self.block, self._seg()
        lo_w = (torch.div(q_lo, b, rounding_mode="floor") - self.window_blocks + 1) * b
        n_seg = int(torch.div(q_hi.clamp_min(0).max(), seg, rounding_mode="floor").item()) + 1 if q_hi.numel() else 1
        starts = torch.arange(n_seg, device=q_lo.device, dtype=torch.int64) * seg
        shape = (*q_lo.shape, n_seg)
        lo = torch.cat([lo_w.unsqueeze(-1), starts.expand(shape)], -1)
        hi = torch.cat([q_hi.unsqueeze(-1), (starts + self.anchor - 1).expand(shape)], -1)
        return lo[None], hi[None]

    def _tile_full(self, q_lo, q_hi, k_lo, k_hi, layer_idx, num_kv_heads, kv_len):
        b, seg = self.block, self._seg()
        win = torch.div(q_hi, b, rounding_mode="floor") - self.window_blocks < torch.div(k_lo, b, rounding_mode="floor")
        anchor = (torch.div(k_lo, seg, rounding_mode="floor") == torch.div(k_hi, seg, rounding_mode="floor")) & (
            k_hi % seg < self.anchor
        )
        return win | anchor


def resolve_l2_segment(pattern: L2Aligned, kv_bytes_per_token: int, l2_bytes: int | None = None, fraction: float = 0.5) -> L2Aligned:
    """Fix ``segment`` so that one segment's K and V fill ``fraction`` of the L2 cache.

    ``kv_bytes_per_token`` is ``2 * Hkv * D * dtype_bytes`` for the layer. ``l2_bytes`` defaults to the
    current CUDA device's L2 size, or 50 MiB (an H100's) without CUDA. The result is rounded down to a
    multiple of ``pattern.block`` (at least one block) and at least ``pattern.anchor``.
    """
    if not isinstance(pattern, L2Aligned):
        raise TypeError(f"resolve_l2_segment expects an L2Aligned pattern, got {type(pattern).__name__}")
    kv_bytes_per_token = _plain_int(kv_bytes_per_token)
    _check_int("resolve_l2_segment", "kv_bytes_per_token", kv_bytes_per_token, 1)
    if l2_bytes is None:
        if torch.cuda.is_available():
            l2_bytes = int(torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size)
        else:
            l2_bytes = 50 * 1024 * 1024
    tokens = int(l2_bytes * fraction) // kv_bytes_per_token
    seg = max(pattern.block, (tokens // pattern.block) * pattern.block, pattern.anchor)
    return dataclasses.replace(pattern, segment=seg)


@dataclass(frozen=True)
class _Learned(Pattern):
    """Sinks + window (static, a ``streaming`` rule) plus ``top_k`` learned keys per query block.

    ``refine``: 0 selects in one stage. ``F >= 1`` selects in two: a first stage preselects ``F`` times the budget,
    then the ``top_k`` keys of it with the highest exact attention probability of the block's first query are kept.
    The first stage is, without a trained selector, the ``F * top_k / page`` pages of highest Quest bound
    (``sparse_k.selection.page_selection``); with a trained SparseK scorer, the ``F * top_k`` keys of highest score
    (a query-independent pool: a ``SparseCache`` keeps only the pool); a DSA indexer ignores it (warning). With
    ``query_block=1`` and ``refine=8`` both come near dense quality (docs/selection.md), at a high prefill cost."""

    learned: ClassVar[bool] = True
    sinks: int = 4
    window: int = 256
    top_k: int = 256
    query_block: int = 64
    refine: int = 0
    #: Not a parameter: trained selector files are named by ``selector_path`` (a non-None value raises TypeError).
    selector: InitVar[str | None] = None

    def __post_init__(self, selector=None) -> None:
        if selector is not None:
            raise TypeError(
                f"{self.name}: `selector` is not a pattern parameter (got {selector!r}); name a trained selector file "
                "with selector_path: configure(model, ..., selector_path=...) or config.sparse_attention['selector_path']"
            )
        super().__post_init__()

    def _validate(self):
        _check_int(self.name, "sinks", self.sinks, 0, MAX_SINKS)
        _check_int(self.name, "window", self.window, 1)
        _check_int(self.name, "top_k", self.top_k, 0)
        _check_int(self.name, "query_block", self.query_block, 1)
        _check_int(self.name, "refine", self.refine, 0)
        _check_span(self.name, "refine * top_k (the first stage's pool)", self.refine * self.top_k)

    def static_part(self) -> Streaming:
        """The sinks + window rule that stays a block layout beside the selection (built once per pattern: every
        layer's call asks for it)."""
        return self._static

    @functools.cached_property
    def _static(self) -> Streaming:
        return Streaming(sinks=self.sinks, window=self.window)

    def candidate_range(self, block_start: torch.Tensor):
        """Inclusive candidate key positions ``[sinks, block_start - window]`` of a query block (design §6)."""
        return torch.full_like(block_start, self.sinks), block_start - self.window

    def _rule(self, qpos, kpos, layer_idx, kv_head, kv_len):
        return self.static_part()._rule(qpos, kpos, layer_idx, kv_head, kv_len)

    def _intervals(self, q_lo, q_hi, layer_idx, num_kv_heads, kv_len):
        return self.static_part()._intervals(q_lo, q_hi, layer_idx, num_kv_heads, kv_len)

    def _tile_full(self, q_lo, q_hi, k_lo, k_hi, layer_idx, num_kv_heads, kv_len):
        return self.static_part()._tile_full(q_lo, q_hi, k_lo, k_hi, layer_idx, num_kv_heads, kv_len)


@dataclass(frozen=True)
class SparseK(_Learned):
    """Learned SparseK selection (design §6): per query block, the ``top_k`` keys with the largest
    SparseK weights among the candidates outside sinks and window; the weight ``p_j`` enters as
    ``log p_j`` on the logit. Trained scorers come from ``selector_path`` (none: the training-free score)."""

    name: ClassVar[str] = "sparse_k"


@dataclass(frozen=True)
class DSA(_Learned):
    """DeepSeek-style lightning indexer (design §7): ``indexer_heads`` small heads of ``indexer_dim``
    score every candidate key; per query block the top ``top_k`` join sinks and window."""

    name: ClassVar[str] = "dsa"
    indexer_heads: int = 4
    indexer_dim: int = 32

    def _validate(self):
        super()._validate()
        _check_int(self.name, "indexer_heads", self.indexer_heads, 1)
        _check_int(self.name, "indexer_dim", self.indexer_dim, 1)


_PATTERNS: dict[str, type[Pattern]] = {
    cls.name: cls for cls in (Dense, SlidingWindow, Streaming, BlockDiagonal, BigBird, Dilated, L2Aligned, SparseK, DSA)
}


def available_patterns() -> list[str]:
    """Names accepted wherever a pattern is expected."""
    return list(_PATTERNS)


def get_pattern(pattern: "str | Pattern | dict", **overrides) -> Pattern:
    """A pattern object from a name (defaults, plus ``overrides``), a dict, or a pattern (returned as is)."""
    if isinstance(pattern, Pattern):
        return dataclasses.replace(pattern, **overrides) if overrides else pattern
    if isinstance(pattern, dict):
        return pattern_from_dict({**pattern, **overrides})
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a name, a dict or a Pattern, got {type(pattern).__name__}")
    cls = _PATTERNS.get(pattern)
    if cls is None:
        raise ValueError(f"unknown pattern {pattern!r}; available: {', '.join(_PATTERNS)}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(overrides) - names - ({"selector"} if cls.learned else set())  # its TypeError names selector_path
    if unknown:
        raise ValueError(f"pattern {pattern!r} has no parameter(s) {sorted(unknown)}; it takes {sorted(names)}")
    return cls(**overrides)


def pattern_from_dict(d: dict) -> Pattern:
    """Inverse of ``Pattern.to_dict``: ``{"pattern": name, **parameters}``."""
    if not isinstance(d, dict) or "pattern" not in d:
        raise ValueError(f"a pattern dict needs a 'pattern' key naming one of {available_patterns()}, got {d!r}")
    d = dict(d)
    return get_pattern(d.pop("pattern"), **d)

