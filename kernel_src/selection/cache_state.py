"""Selection state of one learned layer over a cache that may drop keys (``sparse_k`` and ``dsa``).

``CachedSelection`` is the bookkeeping behind ``hf_sparse_attention.SparseCache``'s ``SelectionLayer``
(which stores the key/value tensors and delegates here). Between the calls of a generation it keeps:

* ``sparse_k`` with a trained scorer: the running selection (``decode_selection.SparseKDecodeState``);
  a call runs its queries block by block over the selection of their block. With ``evict=True`` the
  keys that can never be selected again are dropped after each call: the cache keeps the sinks, the
  current block's ``top_k`` selection and the keys from the current block's first candidate-to-be
  onwards (at most ``sinks + top_k + window + query_block - 2`` keys between calls). With the pattern's
  ``refine = F`` the running selection is the scorer's pool (``F * top_k`` keys, what the cache keeps), and each
  block attends to the ``top_k`` keys of it that its first query gives the most attention probability
  (``selectors._refined_layout``'s rule; the block's first query is kept for the calls that start inside the block);
* ``dsa`` with a trained indexer: the indexer keys of the cached tokens (a call computes its new ones only);
* no trained selector (either pattern, ``page_selection``): the memo of the last blocks' first queries (``block_ring``).

Slots of the cached key tensor: a *front* of ``F`` slots (the sinks and the kept selection, at
positions ``front_pos (B, Hkv, F)``, ascending; empty slots at ``BIG``), then the *tail*: the
contiguous positions ``tail_start ..`` up to the newest token. Before anything is evicted ``F == 0``
and ``tail_start == 0`` (slot = position). Rows must be unpadded (the caller refuses padded batches).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..layouts.geometry import row_geometry
from ..layouts.patterns import DSA, SparseK
from ..layouts.token_layout import TokenLayout
from .beam_rows import select_rows
from .block_ring import ring_blocks
from .decode_selection import SparseKDecodeState
from .page_selection import most_probable, refine_probabilities, static_positions
from .selectors import build_selection, pool_pattern

__all__ = ["BIG", "CachedSelection"]

#: Position of an empty front slot.
BIG = torch.iinfo(torch.int64).max
#: ``TokenLayout.query_block`` of the one-block layouts handed to attention: every query of the call is in block 0.
_ONE_BLOCK = 1 << 30


class CachedSelection:
    """Decode state of one learned layer (module docstring).

    Args:
        pattern: the layer's ``SparseK`` or ``DSA`` pattern. evict: drop the keys no later query can
            select (``sparse_k`` only; ignored for ``dsa``).
    """

    def __init__(self, pattern, evict: bool = True):
        if not isinstance(pattern, (SparseK, DSA)):
            raise TypeError(f"CachedSelection needs a sparse_k or dsa pattern, got {type(pattern).__name__}")
        self.pattern, self.evict = pattern, bool(evict) and isinstance(pattern, SparseK)
        self.reset()

    def reset(self) -> None:
        """Forget everything (a new generation)."""
        self.front_pos: torch.Tensor | None = None
        self.tail_start = 0
        self.state: SparseKDecodeState | None = None
        self.index_keys: torch.Tensor | None = None
        self.memo: dict = {}  # training-free selection: the last blocks' first queries (block_ring)
        self._index_owner = None
        self._first_queries: dict[int, torch.Tensor] = {}  # refine: block -> its first query (B, Hq, D), the last few

    @property
    def evicted(self) -> bool:
        """True once keys were dropped (the cache no longer holds every position)."""
        return self.front_pos is not None

    def attend(self, query, key, value, pattern, run: Callable[..., torch.Tensor], *, selector, layer_idx: int,
               seen: int, new_tokens: int):
        """Attention of this call's queries over the cached slots ``key/value (B, Hkv, Skv, D)``.

        ``seen``: tokens the cache has taken so far (this call's included), ``new_tokens``: this call's.
        ``run(q, k, v, pattern, selection, q_start, key_mask)`` runs ``sparse_attention``.
        Returns ``(out (B, Hq, Sq, D), kept)``: ``kept`` is None, or the ``(keys, values)`` the cache
        keeps from now on (after an eviction).
        """
        if pattern != self.pattern:
            raise ValueError(f"SparseCache: layer {layer_idx} runs {pattern!r}, its cache was built for {self.pattern!r}")
        if isinstance(pattern, DSA) or selector is None:
            if self.evicted:
                raise ValueError(f"SparseCache: layer {layer_idx} evicted keys under a trained selector, which is gone now")
            return self._attend_from_scratch(query, key, value, run, selector, layer_idx, new_tokens), None
        if self.state is None:
            geo_sel = build_selection(pattern, query, key, value, _geometry(query, key), layer_idx=layer_idx, selector=selector)
            out = run(query, key, value, pattern if geo_sel is not None else pattern.static_part(), geo_sel, None, None)
            pool = pool_pattern(pattern, selector)
            self.state = SparseKDecodeState(pool, weighted=pool is pattern)
        else:
            out = self._attend_blocks(query, key, value, run, selector, seen)
        self._keep_first_query(query, seen)
        return out, self._after_call(key, value, selector, seen)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Reorder the rows (beam search): row ``i`` becomes the old row ``beam_idx[i]``."""
        pick = lambda t: None if t is None else t.index_select(0, beam_idx.to(t.device))
        self.front_pos, self.index_keys = pick(self.front_pos), pick(self.index_keys)
        select_rows(self.memo, beam_idx)
        for name in ("layout_key", "layout"):  # the reused decode layout belongs to the old row order
            self.memo.pop(name, None)
        index_memo = getattr(self._index_owner, "_block_memo", None)  # a DSA indexer's block-first query memo
        if isinstance(index_memo, dict):
            select_rows(index_memo, beam_idx)
        self._first_queries = {blk: pick(q) for blk, q in self._first_queries.items()}
        if self.state is not None:
            self.state.select_rows(beam_idx)

    def crop(self, length: int, seen: int) -> None:
        """The cache was cut back from ``seen`` tokens to its first ``length`` (only before any eviction, and not
        inside a query block whose first query the memo no longer keeps: it keeps the last ``block_ring.ring_blocks``
        blocks', and the next call would continue that block without it)."""
        if self.evicted:
            raise ValueError("a SparseCache layer that evicted keys cannot be cropped")
        qb = self.pattern.query_block
        kept = ring_blocks(qb)
        first_query_memo = ("blocks" in self.memo or self._first_queries
                            or isinstance(getattr(self._index_owner, "_block_memo", None), dict))
        if first_query_memo and length % qb and (seen - 1) // qb - length // qb >= kept:
            raise ValueError(
                f"SparseCache: cannot cut back to {length} tokens, inside query block {length // qb} "
                f"(query_block={qb}): the selection keeps the first queries of the last {kept} blocks only, and the "
                f"latest is block {(seen - 1) // qb}; cut at a multiple of query_block, or by fewer tokens"
            )
        self._first_queries = {blk: q for blk, q in self._first_queries.items() if blk * qb < length}
        self.state = None  # rebuilt from scratch at the next call
        if self.index_keys is not None:
            self.index_keys = self.index_keys[:, :length]

    def _attend_from_scratch(self, query, key, value, run, selector, layer_idx, new_tokens):
        """Selection from scratch each call (``dsa``, and the training-free default of both patterns),
        with the memo of the last blocks' first queries (training-free) or the cached indexer keys."""
        index_keys = None
        if selector is not None and isinstance(self.pattern, DSA):
            old = key.shape[2] - new_tokens
            fresh = self._index_owner is selector and self.index_keys is not None and self.index_keys.shape[1] == old
            with torch.no_grad():
                if fresh:  # indexer keys of the new tokens only
                    self.index_keys = torch.cat([self.index_keys, selector.index_keys(key[:, :, old:])], 1)
                else:
                    self.index_keys = selector.index_keys(key)
            self._index_owner = selector
            index_keys = self.index_keys
        sel = build_selection(self.pattern, query, key, value, _geometry(query, key), layer_idx=layer_idx, selector=selector,
                              index_keys=index_keys, memo=self.memo if selector is None else None)
        return run(query, key, value, self.pattern if sel is not None else self.pattern.static_part(), sel, None, None)

    def _front(self) -> int:
        return 0 if self.front_pos is None else self.front_pos.shape[-1]

    def _slots(self, pos: torch.Tensor) -> torch.Tensor:
        """Slot index of key positions ``pos (B, Hkv, n)`` (-1 stays -1)."""
        F = self._front()
        idx = F + pos - self.tail_start
        if F:
            front = torch.searchsorted(self.front_pos, pos.contiguous())
            idx = torch.where(pos >= self.tail_start, idx, front)
        return torch.where(pos >= 0, idx, torch.full_like(idx, -1))

    def _scores(self, key, value, selector):
        """``scores(lo, hi)``: the selector's scores ``(B, Hkv, hi - lo + 1)`` of positions ``lo .. hi`` (in the tail)."""
        def scores(lo: int, hi: int) -> torch.Tensor:
            i0 = self._front() + lo - self.tail_start
            k, v = key[:, :, i0 : i0 + hi - lo + 1], value[:, :, i0 : i0 + hi - lo + 1]
            with torch.no_grad():
                return selector(v, torch.arange(lo, hi + 1, device=k.device)[None], k)

        return scores

    def _attend_blocks(self, query, key, value, run, selector, seen):
        """The call's queries block by block, each over its block's running selection."""
        B, _, Sq, _ = query.shape
        Skv, bq = key.shape[2], self.pattern.query_block
        q0 = seen - Sq  # position of the call's first query
        scores = self._scores(key, value, selector)
        outs, t = [], 0
        while t < Sq:
            blk = (q0 + t) // bq
            t1 = min(Sq, (blk + 1) * bq - q0)
            self.state.advance(blk, scores)
            st = self.state
            if st.positions is None:  # no candidate yet: sinks + window
                outs.append(run(query[:, :, t:t1], key, value, self.pattern.static_part(), None, Skv - Sq + t, None))
            else:
                positions, counts = st.positions, st.counts
                if self.pattern.refine:
                    first = query[:, :, blk * bq - q0] if blk * bq >= q0 else self._kept_first_query(blk)
                    positions, counts = self._refine(first, key, positions, blk, seen)
                lay = TokenLayout(
                    indices=self._slots(positions)[:, :, None].to(torch.int32),
                    counts=counts[:, :, None].to(torch.int32), query_block=_ONE_BLOCK,
                    first_block=torch.zeros(B, dtype=torch.int64, device=key.device),
                    weights=None if st.weights is None else st.weights[:, :, None],
                )
                outs.append(run(query[:, :, t:t1], key, value, self.pattern, lay, Skv - Sq + t, None))
            t = t1
        return torch.cat(outs, 2)

    def _keep_first_query(self, query, seen) -> None:
        """``refine``: keep the first queries of the last ``block_ring.ring_blocks`` blocks (those the call holds)."""
        if not getattr(self.pattern, "refine", 0):
            return
        bq, q0 = self.pattern.query_block, seen - query.shape[2]
        last, kept = (seen - 1) // bq, ring_blocks(bq)
        for blk in range(max(-(-q0 // bq), last - kept + 1), last + 1):
            self._first_queries[blk] = query[:, :, blk * bq - q0].detach().clone()
        self._first_queries = {blk: q for blk, q in self._first_queries.items() if blk > last - kept}

    def _kept_first_query(self, blk: int) -> torch.Tensor:
        if blk not in self._first_queries:
            raise RuntimeError(f"SparseCache: the first query of block {blk} was not kept (refine needs it)")
        return self._first_queries[blk]

    def _refine(self, first, key, positions, blk: int, seen: int):
        """The ``top_k`` of the block's pool ``positions (B, Hkv, Kp)`` with the largest attention probability of the
        block's first query ``first (B, Hq, D)`` over its sinks, window and the pool (``selectors._refined_layout``):
        ``(positions (B, Hkv, K), counts (B, Hkv))``."""
        p = self.pattern
        B, Hkv = positions.shape[:2]
        Hq, D = first.shape[1], first.shape[2]
        b0 = torch.full((B, 1), blk * p.query_block, device=key.device)
        spos, sok = static_positions(b0, b0 - p.window, torch.full((B,), seen, device=key.device), p.sinks, p.window)
        sidx = self._slots(torch.where(sok, spos, -1)[:, 0, None].expand(B, Hkv, spos.shape[-1]))  # (B, Hkv, Ws)
        qb = first.to(torch.float64 if first.dtype == torch.float64 else torch.float32).view(B, Hkv, 1, Hq // Hkv, D)
        ok = positions >= 0
        prob = refine_probabilities(qb, key, self._slots(positions)[:, :, None], ok[:, :, None], sidx[:, :, None],
                                    sidx[:, :, None] >= 0)
        chosen, counts = most_probable(prob, positions[:, :, None], ok[:, :, None], p.top_k,
                                       min(p.top_k, positions.shape[-1]))
        return chosen[:, :, 0], counts[:, :, 0]

    def _after_call(self, key, value, selector, seen):
        """Advance the state to the next query's block; with eviction, return the ``(keys, values)`` it can
        still use (else None)."""
        p = self.pattern
        nxt = seen // p.query_block
        self.state.advance(nxt, self._scores(key, value, selector))
        new_tail = nxt * p.query_block - p.window + 1
        if not self.evict or new_tail <= p.sinks or self.state.positions is None:
            return None
        B, H = key.shape[:2]
        dev = key.device
        sinks = torch.arange(p.sinks, device=dev).expand(B, H, p.sinks)
        sel = torch.where(self.state.positions >= 0, self.state.positions, torch.full_like(self.state.positions, BIG))
        front = torch.cat([sinks, sel], -1)
        idx = self._slots(torch.where(front == BIG, torch.full_like(front, -1), front))
        ok = idx >= 0
        g = idx.clamp_min(0)[..., None]
        fk = torch.where(ok[..., None], key.gather(2, g.expand(-1, -1, -1, key.shape[-1])), torch.zeros((), dtype=key.dtype, device=dev))
        fv = torch.where(ok[..., None], value.gather(2, g.expand(-1, -1, -1, value.shape[-1])), torch.zeros((), dtype=value.dtype, device=dev))
        t0 = self._front() + new_tail - self.tail_start
        kept = torch.cat([fk, key[:, :, t0:]], 2), torch.cat([fv, value[:, :, t0:]], 2)
        self.front_pos, self.tail_start = front, new_tail
        return kept


def _geometry(query, key):
    return row_geometry(query.shape[0], query.shape[2], key.shape[2], device=query.device)
