"""Keep a per-layer decode memo in step with the cache's rows when something reorders them (beam search).

A memo of the last blocks' first queries (``block_ring``: ``page_selection.block_queries``, the DSA indexer's
``_block_memo``) lives on the attention module when the cache is one of Transformers' own
(``DynamicCache``, ``StaticCache``): nothing tells the module when ``generate(num_beams=...)`` calls
``cache.reorder_cache(beam_idx)``, so without this the memo of row ``i`` would describe another beam's
block and decode would no longer equal recomputation. (``hf_sparse_attention.SparseCache`` reorders its
own memo; this module is for the memos it does not own.)

The memo remembers, per row, the key its block's first query wrote into the cache (``remember``: the
*fingerprint*, ``(B, Hkv, D)``). Before the next call, row ``i``'s memo comes from the old row whose
fingerprint is nearest the key that row ``i`` of the cache now holds at that old row's block start
(``realign``): the old row itself when nothing moved, the beam it continues after a reorder (its keys are
copies of that beam's, so the distance is 0). Rows with equal fingerprints have equal prefixes up to the
block start, hence equal first queries, so a tie takes any of them (the row itself first). Everything
runs on the device (a ``(B, B)`` distance table and ``index_select``), with no host read, so a captured
decode step can hold it; one-row batches skip it (nothing can move).
"""

from __future__ import annotations

import torch

from ..layouts.token_layout import TokenLayout
from .step_state import state_buffers

__all__ = ["FINGERPRINT", "ROW_ENTRIES", "realign", "remember", "select_rows"]

#: The memo entry holding each row's fingerprint ``(B, Hkv, D)``.
FINGERPRINT = "row_key"

#: The per-row tensors of the memos (``block_ring``'s latest block, ring block ids and first queries, with the DSA
#: indexer's head weights; ``page_selection``'s ``OBS`` ring); each is ``(B, ...)``.
ROW_ENTRIES = ("block", "blocks", "q", "w", "obs", "ovalid", "oblock", "ring", "rvalid", "ring_end")


def _block_slots(memo: dict, key: torch.Tensor, k_start: torch.Tensor, query_block: int):
    """``(slot (B,), valid (B,))``: the key index of each row's memo block start (``memo["block"] * query_block``
    plus the row's ``k_start``), clamped into the key tensor, and whether the block is set and its slot exists."""
    B, Skv = key.shape[0], key.shape[2]
    slot = memo["block"] * query_block + k_start.to(key.device).expand(B)
    valid = (memo["block"] >= 0) & (slot < Skv)
    return slot.clamp(0, Skv - 1), valid


def realign(memo: dict | None, key: torch.Tensor, k_start: torch.Tensor, query_block: int) -> None:
    """Permute every per-row entry of ``memo`` (in place) so that row ``i`` holds the memo of the old row whose
    block row ``i`` now continues (module docstring). ``key (B, Hkv, Skv, D)``: this call's keys (after the
    cache update); ``k_start``: ``(B,)`` or ``(1,)`` key index of position 0. A memo without a fingerprint
    (first call, another batch size) is left as it is."""
    if memo is None or key.shape[0] < 2 or FINGERPRINT not in memo or "block" not in memo:
        return
    B = key.shape[0]
    old = memo[FINGERPRINT]
    if old.shape != (B, *key.shape[1:2], key.shape[3]) or memo["block"].shape != (B,) or old.device != key.device:
        return
    slot, valid = _block_slots(memo, key, k_start, query_block)
    keys = key.index_select(2, slot).permute(0, 2, 1, 3)  # (B_i, B_j, Hkv, D): row i's key at row j's block start
    dist = (keys.float() - old.float()[None]).square().sum((-1, -2))  # (B_i, B_j)
    dist = torch.where(valid[None, :], dist, torch.inf)
    rows = torch.arange(B, device=key.device)
    dist[rows, rows] = torch.where(dist[rows, rows] <= dist.amin(1), -1.0, dist[rows, rows])  # ties: the row itself
    src = torch.where(torch.isfinite(dist).any(1), dist.argmin(1), rows)  # (B,) old row of each new row
    select_rows(memo, src)
    layout = memo.get("layout")  # the reused decode layout (eager decode over a dynamic cache only)
    if isinstance(layout, TokenLayout) and layout.indices.shape[0] == B:
        memo["layout"] = _layout_rows(layout, src)


def select_rows(memo: dict, rows: torch.Tensor) -> None:
    """Row ``i`` of every per-row entry of ``memo`` becomes the old row ``rows[i]`` (in place: the buffers may sit in a
    captured step, ``step_state``). By name: a traced step reads (and guards on) only these entries."""
    for name in ROW_ENTRIES:
        value = memo.get(name)
        if isinstance(value, torch.Tensor) and value.shape[:1] == rows.shape:
            value.copy_(value.index_select(0, rows.to(value.device)))


def _layout_rows(layout: TokenLayout, src: torch.Tensor) -> TokenLayout:
    """The layout whose row ``i`` is ``layout``'s row ``src[i]``."""
    pick = lambda t: None if t is None else t.index_select(0, src.to(t.device))
    return TokenLayout(indices=pick(layout.indices), counts=pick(layout.counts), query_block=layout.query_block,
                       first_block=pick(layout.first_block), weights=pick(layout.weights))


def remember(memo: dict | None, key: torch.Tensor, k_start: torch.Tensor, query_block: int) -> None:
    """Store each row's fingerprint: its cached key at the memo's block start (zeros where there is none)."""
    if memo is None or key.shape[0] < 2 or not isinstance(memo.get("block"), torch.Tensor):
        return
    B, Hkv, _, D = key.shape
    if memo["block"].shape != (B,):
        return
    slot, valid = _block_slots(memo, key, k_start, query_block)
    own = key[torch.arange(B, device=key.device), :, slot]  # (B, Hkv, D)
    own = torch.where(valid[:, None, None], own, 0)
    state_buffers(memo, {FINGERPRINT: ((B, Hkv, D), key.dtype, 0.0)}, key.device)
    memo[FINGERPRINT].copy_(own.detach())
