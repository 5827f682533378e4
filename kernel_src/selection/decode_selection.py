"""Incremental SparseK selection for decoding (design §6): no re-sort of all candidates per block.

``SparseKDecodeState`` follows one layer of one generation block by block. The candidates of query
block ``b`` are the key positions ``[sinks, b * query_block - window]``; moving to a later block
only *adds* candidates. Scores are query-independent and fixed once computed, so:

* the top-``k`` of the new block is the top-``k`` of (the previous top-``k`` ∪ the new candidates);
* the SparseK threshold ``tau`` only rises as candidates arrive, so a candidate with ``u <= tau``
  has weight 0 now and in every later block, and the ``tau`` of the next block is the root of the
  capped-simplex sum over (previous support ``{u > tau}`` ∪ new candidates) alone.

The state therefore keeps, per row and KV head, the *support* (scores and positions of the
candidates with ``u > tau``, at least ``k`` of them once there are more than ``k`` candidates) and
the current selection. Advancing one block merges ``query_block`` new scores into it: a sort of
``|support| + query_block`` entries instead of all candidates. The support's size is data
dependent (ties at the threshold make many fractional entries): the state keeps one score and one
position per entry (no key or value vectors), and compacting it reads its size on the host once
per block.

Selections equal ``build_selection`` from scratch: the same top-``k`` (ties to the earlier key) and
the same weights ``p = clip(u - tau, 0, 1)`` up to the float64 summation order inside the threshold.
The training-free score (``-||k||``, weights None) follows the same rules.
"""

from __future__ import annotations

import torch

from ..layouts.patterns import SparseK
from .sparsek import sparsek

__all__ = ["SparseKDecodeState"]


class SparseKDecodeState:
    """Running SparseK selection of one layer over unpadded rows (module docstring).

    Args:
        pattern: the layer's ``SparseK`` pattern. weighted: keep SparseK weights (a trained scorer)
            or not (training-free selection).
    Attributes (after ``advance``): ``block`` (int), ``positions (B, Hkv, K)`` int64 selected key
    positions ascending (-1 past ``counts``), ``counts (B, Hkv)`` int64, ``weights (B, Hkv, K)`` or None.
    """

    def __init__(self, pattern: SparseK, *, weighted: bool):
        if not isinstance(pattern, SparseK):
            raise TypeError(f"SparseKDecodeState needs a SparseK pattern, got {type(pattern).__name__}")
        self.pattern, self.weighted = pattern, bool(weighted)
        self.block = -1
        self.merged_hi = pattern.sinks - 1  # candidates merged: positions [sinks, merged_hi]
        self.sup_u = self.sup_pos = None
        self.positions = self.counts = self.weights = None

    def candidate_hi(self, block: int) -> int:
        """Last candidate position of ``block``."""
        return block * self.pattern.query_block - self.pattern.window

    def advance(self, block: int, scores) -> None:
        """Move to query ``block`` (>= the current one), merging the candidates it adds.

        ``scores(lo, hi)`` returns ``u (B, Hkv, hi - lo + 1)`` float scores of key positions
        ``lo .. hi`` (called once per advance, only for the new candidates).
        """
        if block < self.block:
            raise ValueError(f"SparseKDecodeState: blocks only move forward ({self.block} -> {block})")
        hi = self.candidate_hi(block)
        lo = self.merged_hi + 1
        self.block = block
        if hi < lo:
            return
        u_new = scores(lo, hi)
        B, H, n = u_new.shape
        pos_new = torch.arange(lo, hi + 1, device=u_new.device).expand(B, H, n)
        if self.sup_u is None:
            u, pos = u_new, pos_new
        else:
            u = torch.cat([self.sup_u, u_new.to(self.sup_u.dtype)], -1)
            pos = torch.cat([self.sup_pos, pos_new], -1)
        self.merged_hi = hi
        self._select(u, pos, hi - self.pattern.sinks + 1)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows (B',)`` int64 in that order (a beam reorder): row ``i`` becomes the old row ``rows[i]``."""
        for name in ("sup_u", "sup_pos", "positions", "counts", "weights"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows.to(t.device)))

    def _select(self, u: torch.Tensor, pos: torch.Tensor, n_total: int) -> None:
        """Selection and support from the merged entries ``u, pos (B, H, n)`` (ascending positions,
        -1 = empty slot) of ``n_total`` candidates in all."""
        k = self.pattern.top_k
        valid = pos >= 0
        K = min(k, n_total)
        neg_inf = torch.full((), float("-inf"), dtype=u.dtype, device=u.device)
        order = torch.sort(torch.where(valid, u, neg_inf), dim=-1, descending=True, stable=True).indices[..., :K]
        top_pos = pos.gather(-1, order)
        counts = valid.sum(-1).clamp_max(K)
        keep = torch.arange(K, device=u.device) < counts[..., None]
        big = torch.iinfo(torch.int64).max
        sel_pos, perm = torch.sort(torch.where(keep, top_pos, torch.full_like(top_pos, big)), dim=-1)
        keep = sel_pos != big
        self.positions = torch.where(keep, sel_pos, torch.full_like(sel_pos, -1))
        self.counts = counts
        if n_total <= k:
            # Every candidate is selected with weight 1; all of them stay in the support.
            self.weights = torch.where(keep, torch.ones_like(sel_pos, dtype=u.dtype), torch.zeros_like(sel_pos, dtype=u.dtype)) if self.weighted else None
            self.sup_u, self.sup_pos = u, pos
            return
        if self.weighted:
            with torch.no_grad():
                p = sparsek(u, k, valid)
            w = p.gather(-1, order).gather(-1, perm)
            self.weights = torch.where(keep, w, torch.zeros_like(w))
            # Support: p > 0 (u > tau); it holds the top-k, and nothing outside it can ever return.
            live = valid & (p > 0)
        else:
            self.weights = None
            # Without weights only the top-k matter for later blocks.
            live = torch.zeros_like(valid).scatter_(-1, order, torch.arange(K, device=u.device) < counts[..., None])
        n_live = int(live.sum(-1).max())
        # Stable sort on "not live" keeps the live entries first and in ascending position order.
        idx = torch.sort((~live).to(torch.int8), dim=-1, stable=True).indices[..., :n_live]
        live_k = live.gather(-1, idx)
        self.sup_u = torch.where(live_k, u.gather(-1, idx), neg_inf)
        self.sup_pos = torch.where(live_k, pos.gather(-1, idx), torch.full_like(idx, -1))
