"""Selection state that a static-cache decode step updates for its new key only (O(new keys) per step).

A learned selection is a function of the cached keys. Recomputing it at every decode step reads the
whole cache: per-key SparseK scores and the prefix top-k lists, the DSA indexer keys, the page
summaries of the training-free selection. Each of these is a function of one key (or, for the prefix
lists, of a prefix of positions that only grows), so a decode step keeps them in buffers
(``sparse_k.selection.step_state``: allocated once, fixed address, written in place, so CUDA graphs replay
them) and updates them for the key it writes:

* ``"sparse_k"`` (a ``SparseKScorer``): ``u (B, Hkv, Skv)``, the score of every key slot, and for the
  prefix scan (``selectors._prefix_topk_layout``) lists of positions, packed ascending (-1 after):
  ``L (B, Hkv, M)``, the ``M = 2 * top_k`` best positions before chunk ``chunk (B,)`` (``PREFIX_CHUNK``
  positions a chunk); ``N``, the next ``L`` (the ``M`` best before ``next (B,)``); ``R (B, Hkv, top_k)``,
  the best candidates so far; ``S``, the current block's selection. A step scores its key and
  (``selectors._advance_prefix_list``) inserts one position into ``R`` and a few into ``N``
  (``selectors._insert_last``: elementwise work and two reductions over the list, no top-k, no sort),
  swaps ``N`` in as ``L`` when its block's candidates enter the next chunk (``torch.where``) and, at a
  block's first step, stores ``R`` as ``S``. Its layout is ``S`` with the SparseK weights of the prefix
  scan over ``L`` and its chunk (``selectors._stepped_select``): equal to the full recomputation, exactly.
  Those weights are the same for every step of a block (its candidates, ``L`` and chunk are fixed
  there), so they are kept in ``W`` (valid where ``W_ok``; a full call clears it): a later step of the
  block runs the SparseK operator with a budget of 0 for its row (the Triton kernel then writes zeros
  without reading the row) and reads ``W``. The list work above runs every step (small: insertions
  instead of the merge's and the block's top-k and sorts).
* ``"dsa"`` (a ``LightningIndexer``): ``ik (B, Skv, key_width)``, the indexer key of every slot. A step
  computes its key's. The block's selection is kept (below): the indexer scores of the block's first query
  against every stored key and their top-k run at the block's first step only (with ``DSA_PRESELECT``, whose
  page pre-selection stays in PyTorch, every step computes and the kept selection is returned).
* ``"pages"`` (no selector, ``page_selection``): ``kmin, kmax (B, Hkv, P, D)`` and ``ok (B, 1, P)`` of
  every page; a step folds its key into its page (exact: a min and a max). The block's selection is kept
  (below): the page-bound scores and the page top-k run at the block's first step only.

The kept selection (``"dsa"``, ``"pages"``): ``sel (B, Hkv, top_k)`` (key indices, ascending, -1 past the
count), ``sel_n (B, Hkv)`` and ``sel_ok (B,)`` (``selection_specs``). A row is *fresh* at its block's first step
(``block_start``) or when ``sel_ok`` is False (a full call clears it); a step computes the layout for the fresh
rows and returns the kept one elsewhere (``keep_selection``: ``torch.where``), then stores what it returns.
The selection is the same at every step of a block (a function of the block's first query and of keys
complete when the block starts), so this equals the full recomputation, exactly.

Skipping the work on the steps inside a block: a compiled step is one CUDA graph that replays the same
kernels every step, so it cannot branch on the block's start; ``torch.cond`` would branch, but Inductor
(torch 2.11, ``_inductor/lowering.py``, the ``cond`` lowering) disables CUDA graphs for any graph holding
one ("control flow operator: torch.cond") and reads the predicate on the host. So the expensive parts run
in Triton kernels that take the fresh flag per row on the device and return at once in the other rows
(``select_triton``: the page-bound scores, the DSA indexer scores, the top-k; on CUDA, and on the CPU under
``TRITON_INTERPRET=1``, where ``page_selection.row_kernels`` gives them; every call of a generation uses them,
so decode equals recompute bit for bit); the step launches them every time and the rows inside a block cost
a flag read. The SparseK budget-0 rows return as early (``sparsek_triton``: ``p = 0`` written, no read). What
stays per step is small and elementwise (the candidate masks, the ``torch.where`` of the kept selection). On
the CPU (PyTorch path) every row is computed and the ``torch.where`` keeps the block's selection.

Which calls step: the adapter passes a state dict only for calls over a static cache (the key mask
covers every slot, as Transformers' ``StaticCache`` gives). A call with one query per row and no
autograd steps when the state's buffers fit (batch, heads, slots, dtype, device) and belong to the same
cache and selector; an eager call checks that on the host (``owner_tag``: the key tensor's address, the
selector, the pattern), a traced call cannot and trusts the state (a compiled step follows the eager
prefill that wrote it). Every other call computes the selection in full and rewrites the state. The
key of a step sits at tensor index ``q_start`` (its query's own slot).

Limitation: a beam reorder of a static cache (``reorder_cache``) permutes the keys but not this state;
eager steps notice (the key tensor is replaced) and recompute, a compiled step does not.
"""

from __future__ import annotations

import torch

from ..layouts.token_layout import TokenLayout
from .page_selection import front_pack, top_mask
from .step_state import buffers_fit, state_buffers

__all__ = ["best_of", "block_start", "keep_selection", "owner_tag", "prepare", "ready", "state_kind"]


def state_kind(selector) -> str:
    """``"sparse_k"``, ``"dsa"`` or ``"pages"`` (no selector) for a layer's selector."""
    if selector is None:
        return "pages"
    return getattr(selector, "kind", type(selector).__name__)


def owner_tag(kind: str, key: torch.Tensor, slots: int, selector, pattern) -> tuple | None:
    """What the state was written for, on the host (None while tracing: no address to read): the cache's
    key tensor (address, ``slots``), the selector and the pattern."""
    if torch.compiler.is_compiling():
        return None
    return (kind, key.data_ptr(), tuple(key.shape[:2]), slots, id(selector), pattern)


def ready(state: dict | None, spec: dict, key: torch.Tensor, tag) -> bool:
    """Whether a one-query call may step ``state`` (module docstring): its buffers fit ``spec`` and, in an
    eager call, it was written for this cache and selector (``tag``)."""
    if state is None or torch.is_grad_enabled() or not buffers_fit(state, spec, key.device):
        return False
    return tag is None or state.get("owner") == tag


def prepare(state: dict, spec: dict, key: torch.Tensor, tag) -> None:
    """Buffers for a full call, reset to their fill values (the call then writes what its keys give);
    records ``tag`` as the owner."""
    if state_buffers(state, spec, key.device):
        for name, (_, _, fill) in spec.items():
            state[name].fill_(fill)
    if tag is not None:
        state["owner"] = tag


def best_of(cand: torch.Tensor, val: torch.Tensor, M: int) -> torch.Tensor:
    """The ``M`` best positions of ``cand (..., W)`` (-1 = empty) by ``val (..., W)`` (-inf = empty), ties to the
    earlier position: ``(..., M)`` ascending, packed to the front, -1 past them.

    Valid entries of ``cand`` must be in ascending position order (ties then go to the smaller index, and
    packing them in ``cand``'s order keeps them ascending: no sort).
    """
    neg = torch.full((), float("-inf"), dtype=val.dtype, device=val.device)
    val = torch.where(cand >= 0, val, neg)
    return front_pack(top_mask(val, M) & (val > neg), M, cand, -1)


def block_start(pattern, geometry, batch: int) -> torch.Tensor:
    """``(B,)`` bool: the row's query (a one-query call's) is the first of its query block (position
    ``q_start - k_start``, at least 0, a multiple of ``query_block``)."""
    q = (geometry.q_start - geometry.k_start).expand(batch).clamp_min(0)
    return q % pattern.query_block == 0


def selection_specs(pattern, key: torch.Tensor) -> dict:
    """Buffers of a block's kept selection (``"dsa"``, ``"pages"``; module docstring) for ``key (B, Hkv, ., D)``:
    ``sel (B, Hkv, top_k)`` int32 key indices (ascending, -1 past the count), ``sel_n (B, Hkv)`` int32 counts and
    ``sel_ok (B,)`` bool (a step wrote them since the last full call)."""
    B, H = key.shape[:2]
    return {"sel": ((B, H, pattern.top_k), torch.int32, -1), "sel_n": ((B, H), torch.int32, 0),
            "sel_ok": ((B,), torch.bool, False)}


def keep_selection(state: dict, layout: TokenLayout, fresh: torch.Tensor) -> TokenLayout:
    """A one-query step's layout: ``layout`` (``indices (B, Hkv, 1, K)``, ``counts (B, Hkv, 1)``) in the rows where
    ``fresh (B,)`` holds, the kept selection of the row's block elsewhere; stores the result as the kept selection."""
    idx, cnt = layout.indices, layout.counts
    K, top = idx.shape[-1], state["sel"].shape[-1]
    f = fresh[:, None, None]
    idx = torch.where(f[..., None], idx, state["sel"][:, :, None, :K])
    cnt = torch.where(f, cnt, state["sel_n"][:, :, None])
    state["sel"].copy_(torch.nn.functional.pad(idx[:, :, 0], (0, top - K), value=-1))
    state["sel_n"].copy_(cnt[:, :, 0])
    state["sel_ok"].fill_(True)
    return TokenLayout(indices=idx, counts=cnt, query_block=layout.query_block, first_block=layout.first_block,
                       weights=None)


def _new_slot(geometry, batch: int) -> torch.Tensor:
    """``(B,)`` tensor index of each row's new key (its query's own slot)."""
    return geometry.q_start.expand(batch)


def _key_at(t: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``t (B, H, S, D)`` at one slot per row: ``(B, H, 1, D)``."""
    B, H, _, D = t.shape
    return t.gather(2, slot[:, None, None, None].expand(B, H, 1, D))


def sparsek_specs(pattern, key: torch.Tensor, value: torch.Tensor, S: int) -> dict:
    """Buffers of the ``"sparse_k"`` state (module docstring) for ``key/value (B, Hkv, ., D)`` and ``S`` cache slots."""
    B, H = key.shape[:2]
    dtype = torch.float64 if value.dtype == torch.float64 else torch.float32
    return {"u": ((B, H, S), dtype, 0.0), "L": ((B, H, 2 * pattern.top_k), torch.int64, -1),
            "chunk": ((B,), torch.int64, 0), "N": ((B, H, 2 * pattern.top_k), torch.int64, -1),
            "next": ((B,), torch.int64, 0), "R": ((B, H, pattern.top_k), torch.int64, -1),
            "S": ((B, H, pattern.top_k), torch.int64, -1), "W": ((B, H, pattern.top_k), dtype, 0.0),
            "W_ok": ((B,), torch.bool, False)}


def step_sparsek_scores(state: dict, selector, key: torch.Tensor, value: torch.Tensor, geometry) -> torch.Tensor:
    """Score the new key of every row into ``state["u"]``; returns ``u (B, Hkv, Skv)`` (the buffer)."""
    B, H = key.shape[:2]
    slot = _new_slot(geometry, B)
    kpos = (slot - geometry.k_start.expand(B))[:, None]
    u_new = selector(_key_at(value, slot), kpos, _key_at(key, slot))  # (B, H, 1)
    rows = torch.arange(B, device=slot.device)
    state["u"][rows, :, slot] = u_new[:, :, 0].to(state["u"].dtype)  # index_put_: Inductor writes it in place
    return state["u"]


def dsa_specs(pattern, selector, key: torch.Tensor, S: int) -> dict:
    B = key.shape[0]
    dtype = torch.float64 if key.dtype == torch.float64 else torch.float32
    return {"ik": ((B, S, selector.key_width), dtype, 0.0), **selection_specs(pattern, key)}


def step_index_keys(state: dict, selector, key: torch.Tensor, geometry) -> torch.Tensor:
    """The new key's indexer key into ``state["ik"]``; returns the indexer keys ``(B, Skv, key_width)`` (the buffer)."""
    B = key.shape[0]
    slot = _new_slot(geometry, B)
    ik = state["ik"]
    rows = torch.arange(B, device=slot.device)
    ik[rows, slot] = selector.index_keys(_key_at(key, slot))[:, 0].to(ik.dtype)
    return ik


def page_specs(pattern, key: torch.Tensor, page: int, S: int) -> dict:
    B, H, _, D = key.shape
    P = max(1, -(-S // page))
    dtype = torch.float64 if key.dtype == torch.float64 else torch.float32
    return {"kmin": ((B, H, P, D), dtype, float("inf")), "kmax": ((B, H, P, D), dtype, float("-inf")),
            "ok": ((B, 1, P), torch.bool, False), **selection_specs(pattern, key)}


def fill_pages(state: dict, summaries) -> None:
    """Write full ``page_summaries`` (``kmin, kmax (B, Hkv, P', D)``, ``ok (B, 1, P')``) of the call's keys into the
    state's first ``P'`` pages."""
    for name, t in zip(("kmin", "kmax", "ok"), summaries):
        state[name][:, :, : t.shape[2]].copy_(t)


def step_pages(state: dict, key: torch.Tensor, geometry, page: int, sinks: int) -> tuple:
    """Fold every row's new key into its page (reset when the key is the page's first position); returns
    the state's ``(kmin, kmax, ok)``. Equals ``page_summaries`` over the keys written so far."""
    B, H, S, D = key.shape
    kmin, kmax, ok = state["kmin"], state["kmax"], state["ok"]
    slot = _new_slot(geometry, B)
    pos = slot - geometry.k_start.expand(B)
    pg = torch.div(pos.clamp_min(0), page, rounding_mode="floor").clamp_max(kmin.shape[2] - 1)
    fresh = (pos % page == 0)[:, None, None, None]
    take = ((pos >= sinks) & (slot < geometry.k_end.expand(B)) & (slot < S))[:, None, None, None]
    k = _key_at(key, slot).to(kmin.dtype)
    rows = torch.arange(B, device=key.device)
    inf = torch.full((), float("inf"), dtype=kmin.dtype, device=key.device)
    lo = torch.where(fresh, inf, kmin[rows, :, pg][:, :, None])  # (B, H, 1, D): each row's page, every head
    hi = torch.where(fresh, -inf, kmax[rows, :, pg][:, :, None])
    kmin[rows, :, pg] = torch.where(take, torch.minimum(lo, k), lo)[:, :, 0]
    kmax[rows, :, pg] = torch.where(take, torch.maximum(hi, k), hi)[:, :, 0]
    was = ok[rows, 0, pg] & ~fresh[:, 0, 0, 0]
    ok[rows, 0, pg] = was | take[:, 0, 0, 0]
    return kmin, kmax, ok
