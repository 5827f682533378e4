"""Per-query-block selection for the learned patterns (``sparse_k``, ``dsa``): ``build_selection``.

For every query block ``[b0, b0 + query_block)`` of the call (blocks are counted by *position*, so
decode and recompute share them) the candidates are the keys with positions in
``[sinks, b0 - window]`` (``pattern.candidate_range``: outside the sinks and the window of the
block's first query, so nothing is counted twice). With at most ``top_k`` candidates all of them
are taken with weight 1; otherwise:

* ``SparseK`` + ``SparseKScorer``: query-independent key scores ``u``; SparseK weights
  ``p = sparsek(u over the candidates, top_k)``. The ``top_k`` keys with the largest ``u`` are
  kept with their weights ``p``: they are the ``top_k`` largest ``p`` (``p`` is monotone in ``u``
  and at most ``top_k`` entries reach 1); fractional entries past them are dropped, so the kept
  weights sum to at most ``top_k``. Ties go to the earlier key. Long rows (more than
  ``2 * top_k + PREFIX_CHUNK`` candidates) take the same top-k from a prefix scan
  (``_prefix_topk_layout``: no sort of whole rows; the weights are exact while the SparseK support
  before the block's grid chunk has at most ``2 * top_k`` keys).
  With the pattern's ``refine = F`` (two stages, ``_refined_layout``): the scorer keeps a *pool* of the ``F * top_k``
  candidates with the largest ``u`` (the selection above with ``top_k`` scaled by ``F``; query-independent, so a
  cache can evict what leaves the pool), and each block keeps the ``top_k`` keys of its pool with the largest
  attention probability of the block's first query (``page_selection.refine_probabilities``), weight 1.
* ``DSA`` + ``LightningIndexer``: indexer scores of the block's *first* query against the
  candidates, top ``top_k`` (weight 1), one selection shared by all KV heads (a ``per_kv_head``
  indexer scores and selects for every KV head separately). Only the first query
  is used so that the selection is fixed when the block starts: decode equals recompute. A call
  that starts inside a block (decode) uses the indexer query the indexer memoised when the block's
  first query went through it (``LightningIndexer._block_memo``); without that memo it falls back
  to the call's first query with a one-time warning. ``DSA_PRESELECT`` (off) ranks pages by an upper
  bound of the indexer score first (``_dsa_preselected_layout``).
* ``selector=None``: the **query-aware training-free default** (one-time warning that trained
  selectors do better): Quest-style pages scored against the block's first query
  (``sparse_k.selection.page_selection``), the same for both patterns, unweighted; its decode memo is the
  ``memo`` argument. The former default, ``u = -||k_j||_2`` (``training_free_scores``), is kept as the
  initial ranking of an untrained ``SparseKScorer`` (its key-norm term).
* DSA and the training-free default run their scores and top-k in Triton (``select_triton``) where
  ``page_selection.row_kernels`` gives the kernels (float32 on CUDA; the CPU under ``TRITON_INTERPRET=1``),
  for every call, so that a decode step inside a query block skips them (``selection_state``: the block's
  kept selection). Elsewhere, on CUDA, top-k runs as one ``torch.topk`` over int64 keys
  (``page_selection.top_indices``: the float's order-preserving bits, then the reversed index), exact with
  ties to the earlier key. Where the
  result only has to be ascending (the prefix lists, the prefix scan's block selection, a one-block call
  such as a DSA decode step), the top-k set is a mask (``page_selection.top_mask``: ``topk(sorted=False)``)
  packed in key order with a scan (``page_selection.front_pack``): no sort.

Scores from the scorer/indexer keep their autograd graph, so gradients reach the selector through
the SparseK weights (``log p`` is added to the logit by the attention paths).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..warn import warn_once
from ..layouts.geometry import RowGeometry, after_last_true, host_rows
from ..layouts.host_memo import host_memo
from ..layouts.patterns import Pattern, SparseK
from .scorers import LightningIndexer, SparseKScorer
from . import block_ring
from .page_selection import REFINE_LIST_ENTRIES, observe as _observe, block_queries, front_pack, most_probable, page_size, \
    page_summaries, quest_layout, refine_probabilities, row_kernels, static_positions, top_indices as _top_indices, top_mask, \
    top_pages
from . import selection_state as sst
from .sparsek import sparsek
from .step_state import new_state_dict
from ..layouts.token_layout import TokenLayout

__all__ = ["build_selection", "pool_pattern", "selection_blocks", "selection_from_scores", "training_free_scores"]

#: Upper bound on elements of one (B, Hkv, blocks, keys) score slab (memory of the SparseK sort).
_CHUNK_ELEMENTS = 1 << 21
#: The same on a GPU: larger slabs, fewer kernel launches (about 1.5 GiB of temporaries at 128K).
_CHUNK_ELEMENTS_CUDA = 1 << 26

#: Grid of the prefix top-k scan of a trained ``SparseKScorer`` (``_prefix_topk_layout``), in positions.
PREFIX_CHUNK = 2048
#: Most positions a decode step inserts into the next prefix list (``_advance_prefix_list``: ``ceil(PREFIX_CHUNK /
#: (PREFIX_CHUNK - query_block + 1))``, 2 for ``query_block <= PREFIX_CHUNK / 2``); above it a step merges the chunk
#: its block leaves in one top-M instead.
MAX_STEP_INSERTS = 4
#: DSA page pre-selection (``_dsa_preselected_layout``): off by default, since the exact selection already
#: costs a fraction of attention (H100, 128K, top-2048: docs/selection.md); pages of ``PRESELECT_PAGE``
#: positions, ``PRESELECT_FACTOR`` times as many pages as ``top_k`` fills.
DSA_PRESELECT = False
PRESELECT_PAGE = 64
PRESELECT_FACTOR = 4


def training_free_scores(key: torch.Tensor) -> torch.Tensor:
    """The key-norm score ``u (B, Hkv, Skv) = -||k||_2`` (float32) from ``key (B, Hkv, Skv, D)`` (the former
    training-free default; an untrained ``SparseKScorer`` ranks like it)."""
    return -key.float().norm(dim=-1)


def _host_extent(pattern, host, q_len: int, kv_len: int):
    """``(blocks spanned, most candidates of a block, last candidate key index + 1)`` from host offsets.

    ``host``: ``RowGeometry.host_offsets()`` or None; without it, bounds that hold for any offsets
    (the layout may then carry empty trailing blocks and slots, which no query reads).
    """
    bq, lo = pattern.query_block, pattern.sinks
    if host is None:
        return (q_len + bq - 2) // bq + 1, max(0, kv_len - lo), kv_len
    nb = n_cand = span = 0
    for qs, ks, ke in host_rows(host):
        p0, p1 = max(0, qs - ks), max(0, qs - ks + q_len - 1)
        nb = max(nb, p1 // bq - p0 // bq + 1)
        hi = min((p1 // bq) * bq - pattern.window, ke - ks - 1)  # the last block has the most candidates
        if hi >= lo:
            n_cand = max(n_cand, hi - lo + 1)
            span = max(span, ks + hi + 1)
    return nb, n_cand, min(max(span, 1), kv_len)


@dataclass(frozen=True)
class BlockCandidates:
    """The candidate mask of a call's query blocks, built a chunk of blocks at a time: with one query per block the
    whole ``(B, NB, Skv)`` mask would be ``S x S`` (17 GB of bools at 128K).

    ``lo, hi (B, NB)`` candidate positions (``pattern.candidate_range``), ``block_ok (B, NB)``, ``kpos, valid (B, Skv)``
    key positions and validity.
    """

    lo: torch.Tensor
    hi: torch.Tensor
    block_ok: torch.Tensor
    kpos: torch.Tensor
    valid: torch.Tensor

    @property
    def blocks(self) -> int:
        return self.lo.shape[1]

    def rows(self, c0: int, c1: int) -> "BlockCandidates":
        """The candidates of blocks ``[c0, c1)``."""
        return BlockCandidates(self.lo[:, c0:c1], self.hi[:, c0:c1], self.block_ok[:, c0:c1], self.kpos, self.valid)

    def mask(self, c0: int = 0, c1: int | None = None, span: int | None = None) -> torch.Tensor:
        """``(B, c1 - c0, span)`` bool: key ``j < span`` is a candidate of block ``c0 + i``."""
        c1 = self.blocks if c1 is None else c1
        kp, ok = self.kpos[:, None, :span], self.valid[:, None, :span]
        lo, hi, bo = self.lo[:, c0:c1, None], self.hi[:, c0:c1, None], self.block_ok[:, c0:c1, None]
        return (kp >= lo) & (kp <= hi) & ok & bo


def block_candidates(pattern: Pattern, geometry: RowGeometry, batch: int, q_len: int, kv_len: int, nb: int | None = None):
    """``selection_blocks`` with the candidates as a ``BlockCandidates`` (no mask over every block). With host-known
    offsets the tensors are shared by every layer of a forward (``layouts.host_memo``)."""
    host = geometry.host_offsets()
    if nb is None:
        nb = _host_extent(pattern, host, q_len, kv_len)[0]
    if host is None or not all(isinstance(x, int) for x in (batch, q_len, kv_len, nb)):
        return _block_candidates(pattern, geometry, batch, q_len, kv_len, nb)
    key = ("block_candidates", type(pattern), pattern.query_block, pattern.sinks, pattern.window,
           tuple(tuple(x) for x in host), batch, q_len, kv_len, nb)
    return host_memo(key, geometry.q_start.device,
                     lambda: _block_candidates(pattern, geometry, batch, q_len, kv_len, nb))


def _block_candidates(pattern: Pattern, geometry: RowGeometry, batch: int, q_len: int, kv_len: int, nb: int):
    bq = pattern.query_block
    qpos = geometry.q_positions(q_len).expand(batch, q_len)
    first = torch.div(qpos[:, 0].clamp_min(0), bq, rounding_mode="floor")
    last = torch.div(qpos[:, -1].clamp_min(0), bq, rounding_mode="floor")
    blocks = first[:, None] + torch.arange(nb, device=first.device)
    block_ok = blocks <= last[:, None]
    block_start = blocks * bq
    lo, hi = pattern.candidate_range(block_start)
    kpos = geometry.k_positions(kv_len).expand(batch, kv_len)
    valid = geometry.key_valid(kv_len).expand(batch, kv_len)
    return first, block_start, block_ok, BlockCandidates(lo, hi, block_ok, kpos, valid), kpos


def selection_blocks(pattern: Pattern, geometry: RowGeometry, batch: int, q_len: int, kv_len: int, nb: int | None = None):
    """The query blocks of a call and their candidate masks.

    Returns ``first_block (B,)`` int64, ``block_start (B, NB)`` int64 positions, ``block_ok (B, NB)``
    bool (the block holds a query of this row), ``cand (B, NB, Skv)`` bool candidate mask on key
    tensor indices and ``kpos (B, Skv)`` key positions. ``nb``: the number of blocks (default: from
    ``geometry.host_offsets()``, or a bound when only the device knows the offsets); nothing here
    reads the device. The mask spans every block: for analyses (oracles, distillation); the selection
    itself builds it per chunk of blocks (``block_candidates``).
    """
    first, block_start, block_ok, cand, kpos = block_candidates(pattern, geometry, batch, q_len, kv_len, nb)
    return first, block_start, block_ok, cand.mask(), kpos


def _check_inputs(pattern, query, key, value, geometry, layer_idx, selector):
    if not isinstance(pattern, Pattern):
        raise TypeError(f"build_selection: `pattern` must be a Pattern, got {type(pattern).__name__}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"build_selection: `{name}` must be a 4-D tensor (B, H, S, D), got {getattr(t, 'shape', t)!r}")
    B, Hq = query.shape[:2]
    if key.shape[:3] != value.shape[:3] or key.shape[0] != B:
        raise ValueError(f"build_selection: key {tuple(key.shape)} / value {tuple(value.shape)} do not match query {tuple(query.shape)}")
    if Hq % key.shape[1] != 0:
        raise ValueError(f"build_selection: query heads ({Hq}) must be a multiple of KV heads ({key.shape[1]})")
    if not isinstance(geometry, RowGeometry):
        raise TypeError(f"build_selection: `geometry` must be a RowGeometry, got {type(geometry).__name__}")
    if geometry.rows not in (1, B):
        raise ValueError(f"build_selection: geometry has {geometry.rows} rows, batch is {B}")
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
        raise ValueError(f"build_selection: `layer_idx` must be a non-negative int, got {layer_idx!r}")
    if selector is not None:
        want = SparseKScorer if isinstance(pattern, SparseK) else LightningIndexer
        if not isinstance(selector, want):
            raise TypeError(
                f"build_selection: pattern {pattern.name!r} needs a {want.__name__} selector, got {type(selector).__name__}"
            )


def build_selection(
    pattern: Pattern,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    geometry: RowGeometry,
    *,
    layer_idx: int,
    selector: nn.Module | None = None,
    index_keys: torch.Tensor | None = None,
    memo: dict | None = None,
    state: dict | None = None,
    state_slots: int | None = None,
) -> TokenLayout | None:
    """The learned selection of one attention call (module docstring for the rules).

    Args:
        pattern: a ``SparseK`` or ``DSA`` pattern (any other pattern returns None).
        query: ``(B, Hq, Sq, D)``; key, value: ``(B, Hkv, Skv, D)``, after RoPE and the cache update.
        geometry: the call's ``RowGeometry`` (positions = key index - ``k_start``).
        layer_idx: the layer (for messages; the selector is already the layer's own).
        selector: the layer's ``SparseKScorer`` / ``LightningIndexer``, or None (training-free).
        index_keys: DSA only: the indexer keys ``(B, Skv, d_I)`` of ``key`` when the caller caches them
            (decoding computes them for the new keys only); default: computed here.
        memo: the training-free selection and a ``SparseKScorer`` with ``refine``: a dict the caller keeps per layer
            across the calls of one generation (the first query of the current block, ``sparse_k.selection.page_selection``);
            None: a call that starts inside a block uses its own first query (one-time warning).
        state: a dict the caller keeps per layer for calls over a static cache (``sparse_k.selection.selection_state``):
            a one-query call updates it for its new key instead of recomputing the selection's inputs from
            every cached key; any other call rewrites it. state_slots: the cache's slots (default ``Skv``;
            more when the call's key tensor is the written front of a static cache).
    Returns:
        ``TokenLayout`` with ``indices (B, Hkv, NB, K)`` key tensor indices (ascending, -1 past the
        count), ``counts (B, Hkv, NB)``, ``first_block (B,)``, ``weights`` (SparseK with a scorer:
        ``p``; otherwise None) and ``K = min(top_k, most candidates of any block)``; None when the
        pattern is not learned, ``top_k == 0`` or no block has a candidate.

    No host synchronisation: output sizes come from ``geometry.host_offsets()`` (or bounds when only
    the device knows the offsets, e.g. a padded batch on the GPU: then ``K = top_k`` and blocks
    without a candidate have count 0); nothing reads a device value.
    """
    if not getattr(pattern, "learned", False):
        return None
    _check_inputs(pattern, query, key, value, geometry, layer_idx, selector)
    if pattern.top_k == 0:
        return None
    B, _, Sq, _ = query.shape
    Hkv, Skv = key.shape[1], key.shape[2]
    host = geometry.host_offsets()
    nb, max_c, span = _host_extent(pattern, host, Sq, Skv)
    K = min(pattern.top_k, max_c)
    kind, step, spec, tag = sst.state_kind(selector), False, None, None
    sel_pattern = pool_pattern(pattern, selector)  # SparseK with refine: the scorer's stage selects the pool
    if state is not None:
        slots = Skv if state_slots is None else max(int(state_slots), Skv)
        spec = _state_spec(kind, sel_pattern, selector, key, value, slots)
        tag = sst.owner_tag(kind, key, slots, selector, sel_pattern)
        step = Sq == 1 and slots == Skv and (kind != "sparse_k" or pattern.query_block <= PREFIX_CHUNK) and sst.ready(state, spec, key, tag)
        if not step:
            sst.prepare(state, spec, key, tag)
    reuse_key = _decode_reuse_key(pattern, host, query.shape, Hkv, nb, K, span, query.device) \
        if selector is None and memo is not None and state is None else None
    if memo is not None and reuse_key is None:  # a prefill, a traced step: the next decode call selects afresh
        memo.pop("layout_key", None)
        memo.pop("layout", None)
    feats = None if state is None else _state_features(kind, state, step, sel_pattern, selector, key, value, geometry, Sq, span)
    # A step of a kept selection (dsa, pages): only the rows at their block's first step (or the first step after a
    # full call) select; the others keep their block's selection (``selection_state.keep_selection``).
    fresh = sst.block_start(pattern, geometry, B) | ~state["sel_ok"] if step and kind != "sparse_k" else None
    if max_c == 0:
        if fresh is not None:
            state["sel_ok"].fill_(False)
        return None
    if reuse_key is not None and memo.get("layout_key") == reuse_key:
        _observe(memo, query, geometry)  # page_selection.OBS: the observation ring still moves
        return memo["layout"]
    first, block_start, block_ok, cand, kpos = block_candidates(pattern, geometry, B, Sq, Skv, nb)
    if selector is None:
        per_query = pattern.query_block == 1 and getattr(pattern, "refine", 0) >= 8
        warn_once(
            f"{pattern.name}: no trained selector for layer {layer_idx} (and maybe others); using the training-free "
            "query-aware page selection (Quest-style, see sparse_k.selection.page_selection); trained selectors do better: "
            "train one with scripts/train_selector.py and set config.sparse_attention['selector_path']."
            + ("" if per_query else " Blocks of queries that share one selection miss facts far back in the context; "
               "query_block=1, refine=8 selects per query and retrieves like dense attention, at several times its "
               "prefill cost (docs/selection.md)."),
            key=f"{pattern.name}: training-free selection",
        )
        layout = quest_layout(pattern, query, key, geometry, host, first, block_start, block_ok, K, span, memo=memo,
                              summaries=feats, flag=fresh)
        if fresh is not None:
            return sst.keep_selection(state, layout, fresh)
        if reuse_key is not None:  # (never while tracing: a graph's output is not kept across steps)
            memo["layout_key"], memo["layout"] = reuse_key, layout
        return layout
    if getattr(pattern, "refine", 0) and not isinstance(selector, SparseKScorer):
        warn_once(f"{pattern.name}: refine={pattern.refine} applies to the training-free selection and to trained "
                  f"sparse_k scorers; layer {layer_idx} has a DSA indexer, which selects without it",
                  key=f"{pattern.name}: refine with a selector")
    if isinstance(selector, SparseKScorer):
        if step:
            u, listed, chunk, chosen = feats
        else:
            u = selector(value, kpos, key) if feats is None else feats
        sk, K_pool = sel_pattern, min(sel_pattern.top_k, max_c)
        if max_c > 2 * sk.top_k + PREFIX_CHUNK:
            if step:
                lay = _stepped_select(listed, chunk, chosen, u, sk, geometry, first, *sk.candidate_range(block_start),
                                      block_ok, state)
            else:
                lay = _prefix_topk_layout(u, sk, geometry, first, block_start, block_ok, K_pool, span)
        else:
            lay = _topk_layout(u[:, :, None, :], cand, K_pool, sk.top_k, first, sk.query_block, span,
                               weighted=sk is pattern)
        if sk is pattern:
            return lay
        return _refined_layout(lay, pattern, query, key, geometry, host, first, block_start, block_ok, memo, K)
    if feats is not None:
        index_keys = feats
    elif index_keys is None:
        index_keys = selector.index_keys(key)
    elif tuple(index_keys.shape) != (B, Skv, selector.key_width):
        raise ValueError(f"build_selection: `index_keys` must be ({B}, {Skv}, {selector.key_width}), got {tuple(index_keys.shape)}")
    qb, wb = _dsa_block_queries(selector, query, geometry, host, pattern.query_block, first, block_start, block_ok)
    n_pre = PRESELECT_FACTOR * -(-pattern.top_k // PRESELECT_PAGE)
    if DSA_PRESELECT and not selector.per_kv_head and pattern.window >= PRESELECT_PAGE and max_c > n_pre * PRESELECT_PAGE:
        lay = _dsa_preselected_layout(selector, qb, wb, index_keys, pattern, geometry, host, first, block_start,
                                      block_ok, K, span, n_pre)
    elif (kern := row_kernels(index_keys)) is not None:
        lay = _dsa_kernel_layout(kern, selector, qb, wb, index_keys, cand, K, span, first, pattern.query_block, fresh)
    else:
        lay = _dsa_torch_layout(selector, qb, wb, index_keys, cand, K, pattern, first, span)
    if not selector.per_kv_head:
        shape = (B, Hkv, *lay.indices.shape[2:])
        lay = TokenLayout(
            indices=lay.indices.expand(shape).contiguous(), counts=lay.counts.expand(shape[:3]).contiguous(),
            query_block=pattern.query_block, first_block=first, weights=None,
        )
    return lay if fresh is None else sst.keep_selection(state, lay, fresh)


def pool_pattern(pattern: Pattern, selector) -> Pattern:
    """The pattern whose selection a ``SparseKScorer`` computes: ``pattern`` itself, or with ``refine = F`` the pool
    (``top_k`` scaled by ``F``, no refinement) that ``_refined_layout`` refines."""
    if isinstance(selector, SparseKScorer) and getattr(pattern, "refine", 0):
        return pattern.replace(top_k=pattern.refine * pattern.top_k, refine=0)
    return pattern


def _refined_layout(pool: TokenLayout, pattern, query, key, geometry, host, first, block_start, block_ok, memo,
                    K: int) -> TokenLayout:
    """SparseK's second stage: per block and KV head, the ``top_k`` keys of the ``pool`` (``indices (B, Hkv, NB, Kp)``,
    ascending) with the largest attention probability of the block's first query (``page_selection.refine_probabilities``:
    its softmax over its sinks, its window and the pool, summed over the KV head's query heads); weight 1.
    ``(B, Hkv, NB, K)`` indices, ascending. Blocks go in chunks (bounded temporaries, host-known sizes)."""
    B, Hq, Sq, D = query.shape
    Hkv = key.shape[1]
    G, NB, Kp = Hq // Hkv, block_start.shape[1], pool.indices.shape[-1]
    q_pos0 = geometry.q_positions(Sq).expand(B, Sq)[:, 0]
    qb = block_queries(query, q_pos0, block_start, host, pattern.query_block, memo, first, block_ok, G)
    k_start, k_end = geometry.k_start.expand(B), geometry.k_end.expand(B)
    spos, sok = static_positions(block_start, pattern.candidate_range(block_start)[1], (k_end - k_start).clamp_min(0),
                                 pattern.sinks, pattern.window)
    sidx = spos.clamp_min(0) + k_start[:, None, None]
    idx = pool.indices.long()
    limit = _CHUNK_ELEMENTS_CUDA if key.is_cuda else _CHUNK_ELEMENTS
    per_key = REFINE_LIST_ENTRIES if row_kernels(qb) is not None else G * D  # kernels: no gathered key vectors
    step = max(1, limit // max(1, B * Hkv * (Kp + spos.shape[-1]) * per_key))
    ind_parts, cnt_parts = [], []
    for c0 in range(0, NB, step):
        c1 = min(NB, c0 + step)
        ic = idx[:, :, c0:c1]
        prob = refine_probabilities(qb[:, :, c0:c1], key, ic, ic >= 0, sidx[:, None, c0:c1], sok[:, None, c0:c1])
        ind, cnt = most_probable(prob, ic, ic >= 0, pattern.top_k, K)
        ind_parts.append(ind)
        cnt_parts.append(cnt)
    return TokenLayout(indices=torch.cat(ind_parts, 2).to(torch.int32), counts=torch.cat(cnt_parts, 2).to(torch.int32),
                       query_block=pattern.query_block, first_block=first, weights=None)


def _dsa_torch_layout(selector, qb, wb, index_keys, cand, K, pattern, first, span) -> TokenLayout:
    """The DSA selection in PyTorch: indexer scores of the blocks' first queries ``qb (B, NB, H, d_I)`` (weights ``wb
    (B, NB, H)``) against ``index_keys (B, Skv, key_width)``, top ``K`` per block (and KV head, ``per_kv_head``) among
    ``cand`` (``BlockCandidates``); blocks in chunks of bounded score memory (one block per query would otherwise
    score ``S x S``)."""
    B, NB = qb.shape[:2]
    G = selector.num_kv_heads if selector.per_kv_head else 1
    limit = _CHUNK_ELEMENTS_CUDA if index_keys.is_cuda else _CHUNK_ELEMENTS
    step = max(1, limit // max(1, B * G * selector.indexer_heads * index_keys.shape[1]))
    parts = []
    for c0 in range(0, NB, step):
        c1 = min(NB, c0 + step)
        scores = selector.scores(qb[:, c0:c1], wb[:, c0:c1], index_keys)  # (B, c, Skv) or, per KV head, (B, c, Hkv, Skv)
        scores = scores.transpose(1, 2) if scores.dim() == 4 else scores[:, None]
        parts.append(_topk_layout(scores, cand.rows(c0, c1), K, pattern.top_k, first, pattern.query_block, span,
                                  weighted=False))
    return _cat_layouts(parts)


def _cat_layouts(parts: list[TokenLayout]) -> TokenLayout:
    """The layouts of consecutive chunks of blocks (same rows, heads and ``K``) as one."""
    if len(parts) == 1:
        return parts[0]
    weights = None if parts[0].weights is None else torch.cat([p.weights for p in parts], 2)
    return TokenLayout(indices=torch.cat([p.indices for p in parts], 2), counts=torch.cat([p.counts for p in parts], 2),
                       query_block=parts[0].query_block, first_block=parts[0].first_block, weights=weights)


def _dsa_kernel_layout(kern, selector, qb, wb, index_keys, cand, K, span, first, query_block, flag) -> TokenLayout:
    """The DSA selection through ``select_triton``: indexer scores of the blocks' first queries ``qb (B, NB, H, d_I)``
    (weights ``wb (B, NB, H)``) against ``index_keys (B, Skv, key_width)`` on the candidates ``cand`` (``BlockCandidates``), then
    the top ``K`` of every block (and KV head, ``per_kv_head``), ascending; rows off ``flag (B,)`` (None: all) select
    nothing. Blocks go in chunks of bounded score memory, as ``_topk_layout``."""
    B, NB = qb.shape[0], cand.blocks
    G = selector.num_kv_heads if selector.per_kv_head else 1
    limit = _CHUNK_ELEMENTS_CUDA if index_keys.is_cuda else _CHUNK_ELEMENTS
    chunk = max(1, limit // max(1, B * G * span))
    idx_out = []
    for c0 in range(0, NB, chunk):
        c1 = min(NB, c0 + chunk)
        rows = None if flag is None else flag[:, None, None].expand(B, c1 - c0, G)
        mask = cand.mask(c0, c1, span)  # (B, c, span)
        scores = kern.index_scores(qb[:, c0:c1].detach(), wb[:, c0:c1].detach(), index_keys[:, :span].detach(),
                                   mask, G, rows)  # (B, c, G, span), -inf off the candidates
        idx = kern.topk_rows(scores, K, flag=rows, lengths=after_last_true(mask)[..., None])  # (B, c, G, K) ascending, -1 after
        if rows is not None:
            idx = torch.where(rows[..., None], idx, -1)
        idx_out.append(idx.transpose(1, 2))
    idx = torch.cat(idx_out, 2)  # (B, G, NB, K)
    return TokenLayout(indices=idx, counts=(idx >= 0).sum(-1).to(torch.int32), query_block=query_block,
                       first_block=first, weights=None)


def _state_spec(kind: str, pattern, selector, key, value, slots: int) -> dict:
    """The buffers of a layer's ``sparse_k.selection.selection_state`` for a cache of ``slots`` slots."""
    if kind == "sparse_k":
        return sst.sparsek_specs(pattern, key, value, slots)
    if kind == "dsa":
        return sst.dsa_specs(pattern, selector, key, slots)
    return sst.page_specs(pattern, key, page_size(pattern), slots)


def _state_features(kind: str, state: dict, step: bool, pattern, selector, key, value, geometry, q_len: int, span: int):
    """What the selection reads from every cached key, kept in ``state`` (``sparse_k.selection.selection_state``).

    ``step``: update the state for the call's new key only and return its buffers; otherwise compute
    from every key, write the state and return what was computed (with its autograd graph). Returns
    ``u (B, Hkv, Skv)`` (sparse_k; a step: ``(u, L, chunk, S)``, ``_advance_prefix_list``), the indexer keys ``(B, Skv, key_width)`` (dsa) or the page
    summaries ``(kmin, kmax, ok)`` over every page of the key tensor (pages).
    """
    B, _, S, _ = key.shape
    if kind == "pages":
        page = page_size(pattern)
        if step:
            return sst.step_pages(state, key, geometry, page, pattern.sinks)
        summaries = page_summaries(key, geometry.k_start.expand(B), geometry.k_end.expand(B), page, pattern.sinks,
                                   max(1, -(-S // page)))
        sst.fill_pages(state, summaries)
        return summaries
    if kind == "dsa":
        if step:
            return sst.step_index_keys(state, selector, key, geometry)
        ik = selector.index_keys(key)
        state["ik"][:, :S].copy_(ik.detach())
        return ik
    if step:
        u = sst.step_sparsek_scores(state, selector, key, value, geometry)
        return (u, *_advance_prefix_list(state, pattern, geometry, span))
    u = selector(value, geometry.k_positions(S).expand(B, S), key)
    state["u"][:, :, :S].copy_(u.detach())
    _fill_prefix_list(state, pattern, geometry, q_len)
    return u


def _u_at(u: torch.Tensor, cand: torch.Tensor, geometry, sinks: int):
    """Scores ``u (B, H, S)`` (by tensor index) at positions ``cand (B, H, ...)``: ``(values, ok)``, values -inf
    where ``ok`` is False (not a possible candidate: a sink, before or past the row's keys, or -1)."""
    B, S = u.shape[0], u.shape[2]
    shape = (B,) + (1,) * (cand.dim() - 1)
    ks, ke = geometry.k_start.expand(B).view(shape), geometry.k_end.expand(B).view(shape)
    idx = cand + ks
    ok = (cand >= 0) & (cand >= sinks) & (idx < ke) & (idx < S)
    val = u.gather(2, idx.clamp(0, S - 1).flatten(2)).view(cand.shape)
    return torch.where(ok, val, torch.full((), float("-inf"), dtype=u.dtype, device=u.device)), ok


def _fill_prefix_list(state: dict, pattern, geometry, q_len: int) -> None:
    """The prefix lists of a full call's last query, from ``state["u"]`` (``_advance_prefix_list`` for what they are):
    ``L, chunk`` (``_prefix_topk_layout``'s list for the row's last block), ``N, next``, ``R`` and ``S``."""
    u = state["u"]
    B, H, S = u.shape
    Z, bq, M, K = PREFIX_CHUNK, pattern.query_block, state["L"].shape[-1], state["R"].shape[-1]
    q_last = (geometry.q_start + q_len - 1 - geometry.k_start).expand(B).clamp_min(0)
    hi = torch.div(q_last, bq, rounding_mode="floor") * bq - pattern.window
    chunk = torch.div(hi.clamp_min(0), Z, rounding_mode="floor")
    nxt = torch.minimum(q_last + 1, (chunk + 1) * Z)
    pos = torch.arange(S, device=u.device)

    def best(below, n):  # the n best positions < below (B,)
        cand = torch.where(pos < below[:, None], pos, -1)[:, None].expand(B, H, S)
        return sst.best_of(cand, _u_at(u, cand, geometry, pattern.sinks)[0], n)

    state["L"].copy_(best(chunk * Z, M))
    state["chunk"].copy_(chunk)
    state["N"].copy_(best(nxt, M))
    state["next"].copy_(nxt)
    state["R"].copy_(best(q_last - pattern.window + 1, K))
    state["S"].copy_(best(hi + 1, K))


def _insert_last(lst: torch.Tensor, p: torch.Tensor, u: torch.Tensor, geometry, sinks: int) -> torch.Tensor:
    """The ``W`` best of ``lst (B, H, W)`` (positions, ascending, packed, -1 after; the ``W`` best of the positions
    seen so far, ties to the earlier) and position ``p (B,)`` (after all of them; -1 or not a possible candidate:
    none), by the scores ``u (B, H, S)``: ``(B, H, W)``, packed ascending. Elementwise work and two reductions:
    a full list drops its worst entry (lowest score, the latest among equal scores) when ``p`` scores higher
    (an equal score loses: ``p`` is the later position)."""
    B, H, W = lst.shape
    v, ok = _u_at(u, p[:, None, None].expand(B, H, 1), geometry, sinks)  # (B, H, 1)
    have = lst >= 0
    vals = _u_at(u, lst, geometry, sinks)[0]
    count = have.sum(-1, keepdim=True)
    inf = torch.full((), float("inf"), dtype=vals.dtype, device=vals.device)
    worst = torch.where(have, vals, inf).amin(-1, keepdim=True)
    idx = torch.arange(W, device=lst.device)
    j = torch.where(have & (vals == worst), idx, -1).amax(-1, keepdim=True)
    full = count == W
    take = ok & (~full | (v > worst))
    shifted = lst.gather(-1, torch.where(full & (idx >= j), idx + 1, idx).clamp_max(W - 1).expand(B, H, W))
    slot = torch.where(full, W - 1, count)
    return torch.where(take & (idx == slot), p[:, None, None], torch.where(take, shifted, lst))


def _advance_prefix_list(state, pattern, geometry, span):
    """Step the prefix lists of a one-query call (``sparse_k.selection.selection_state``) for its position ``q``; no
    top-k, no sort. Writes the state; returns ``(L (B, H, M), chunk (B,), S (B, H, top_k))``.

    * ``L``, ``chunk``: the ``M = 2 * top_k`` best positions before chunk ``chunk`` (``_prefix_topk_layout``'s
      list for the step's block, whose last candidate lies in ``chunk``).
    * ``N``, ``next``: the ``M`` best positions before ``next`` (``<= (chunk + 1) * PREFIX_CHUNK``): the next
      ``L``, built a few positions a step (``_insert_last``; ``ceil(Z / (Z - query_block + 1))`` a step fill a
      chunk between two chunk advances, which are ``>= Z - query_block + 1`` steps apart, and its keys are
      written before it is needed). When the block's candidates enter the next chunk, ``L = N`` (complete).
      Above ``MAX_STEP_INSERTS`` insertions a step (a query block close to ``Z``), ``L`` merges the chunk it
      leaves in one top-M instead (``N`` unused).
    * ``R``: the ``top_k`` best candidates ``[sinks, q - window]`` (one insertion a step); ``S``: ``R`` as it was at
      the block's first step, the block's selection (the top ``top_k`` of its candidates: equal to the prefix
      scan's, whose list holds the ``M >= top_k`` best before the chunk).
    """
    u, L, have = state["u"], state["L"], state["chunk"]
    N, nxt, R, Sel = state["N"], state["next"], state["R"], state["S"]
    B, H = u.shape[:2]
    Z, M, bq = PREFIX_CHUNK, L.shape[-1], pattern.query_block
    # A row whose new key is its first (a generation restarted on the same cache), or that has no key yet (its
    # new slot is left padding), has no lists yet.
    restart = geometry.q_start.expand(B) <= geometry.k_start.expand(B)
    L, N, R, Sel = (torch.where(restart[:, None, None], -1, t) for t in (L, N, R, Sel))
    have, nxt = torch.where(restart, 0, have), torch.where(restart, 0, nxt)
    q = (geometry.q_start - geometry.k_start).expand(B).clamp_min(0)
    R = _insert_last(R, q - pattern.window, u, geometry, pattern.sinks)
    inserts = -(-Z // (Z - bq + 1))
    if inserts <= MAX_STEP_INSERTS:
        end = torch.minimum(q + 1, (have + 1) * Z)  # written, and inside the chunk N is built for
        for _ in range(inserts):
            put = nxt < end
            N = _insert_last(N, torch.where(put, nxt, -1), u, geometry, pattern.sinks)
            nxt = nxt + put.long()
        merged = N
    else:  # a query block close to the chunk: merge the chunk the block leaves in one top-M (every step)
        left = (have * Z)[:, None] + torch.arange(Z, device=u.device)
        cand = torch.cat([L, left[:, None].expand(B, H, Z)], -1)
        merged = sst.best_of(cand, _u_at(u, cand, geometry, pattern.sinks)[0], M)
    n_chunks = max(1, -(-span // Z))
    hi = pattern.candidate_range(torch.div(q, bq, rounding_mode="floor") * bq)[1]
    need = torch.div(hi.clamp_min(0), Z, rounding_mode="floor").clamp_max(n_chunks - 1)
    advance = need > have
    L = torch.where(advance[:, None, None], merged, L)
    Sel = torch.where((q % bq == 0)[:, None, None], R, Sel)
    for name, t in (("L", L), ("chunk", torch.where(advance, have + 1, have)), ("N", N), ("next", nxt), ("R", R),
                    ("S", Sel)):
        state[name].copy_(t)
    return L, need, Sel


def _decode_reuse_key(pattern, host, q_shape, n_kv_heads: int, nb: int, K: int, span: int, device):
    """The key under which a training-free decode call may return the layout of the call before it, or None.

    A block's training-free selection depends only on the block's first query and on pages complete when
    the block starts (``page_selection``), so it is the same for every decode step inside the block. A
    call qualifies when it has one query per row, the offsets are known on the host (no device read) and
    nothing is being traced; the key holds every input of the layout's shape and content that can change
    between such calls (rows' blocks, key offsets, ``K``, ``span``), so a new block, an evicting cache or
    another batch computes afresh.
    """
    if host is None or nb != 1 or q_shape[2] != 1 or torch.compiler.is_compiling():
        return None
    starts = host_rows(host)
    blocks = tuple(max(0, qs - ks) // pattern.query_block for qs, ks, _ in starts)
    return (pattern, tuple(q_shape), n_kv_heads, K, span, blocks, tuple(ks for _, ks, _ in starts), str(device))


def selection_from_scores(pattern: Pattern, scores: torch.Tensor, geometry: RowGeometry, q_len: int,
                          kv_len: int) -> TokenLayout | None:
    """The learned pattern's selection (module docstring's candidate rules) for given key scores.

    For analyses that score keys by other means than a selector (e.g. oracle scores read from dense
    attention, ``scripts/selection_ceiling.py``): per query block and KV head, the ``top_k``
    candidates with the largest score, weight 1 (``weights`` None); ties go to the earlier key.

    Args:
        pattern: a learned pattern (``SparseK`` or ``DSA``); its sinks, window, top_k, query_block apply.
        scores: ``(B, Hkv, 1, Skv)`` (one score per key for every block) or ``(B, Hkv, NB, Skv)`` with
            ``NB`` the call's query blocks (``selection_blocks``: from the block of each row's first
            query); any float dtype.
        geometry: the call's ``RowGeometry``. q_len, kv_len: query and key tensor lengths.
    Returns:
        a ``TokenLayout`` as ``build_selection``'s, or None when ``top_k == 0`` or no block has a candidate.
    """
    if not getattr(pattern, "learned", False):
        raise TypeError(f"selection_from_scores: `pattern` must be a learned pattern, got {pattern!r}")
    if not isinstance(geometry, RowGeometry):
        raise TypeError(f"selection_from_scores: `geometry` must be a RowGeometry, got {type(geometry).__name__}")
    nb, max_c, span = _host_extent(pattern, geometry.host_offsets(), q_len, kv_len)
    if not isinstance(scores, torch.Tensor) or scores.dim() != 4 or scores.shape[2] not in (1, nb) \
            or scores.shape[-1] != kv_len or not scores.is_floating_point():
        raise ValueError(f"selection_from_scores: `scores` must be a float (B, Hkv, 1 or {nb}, {kv_len}) tensor, "
                         f"got {getattr(scores, 'shape', scores)!r}")
    if pattern.top_k == 0 or max_c == 0:
        return None
    first, _, _, cand, _ = block_candidates(pattern, geometry, scores.shape[0], q_len, kv_len, nb)
    return _topk_layout(scores, cand, min(pattern.top_k, max_c), pattern.top_k, first, pattern.query_block,
                        span, weighted=False)


def _topk_layout(u, cand, K, top_k, first, query_block, span, *, weighted: bool) -> TokenLayout:
    """Top-``K`` per block from scores ``u (B, H, NB', S)`` (NB' in {1, NB}) and candidates ``cand`` (``BlockCandidates``
    of NB blocks); keys at tensor indices ``>= span`` are never candidates."""
    B, H, S = u.shape[0], u.shape[1], u.shape[-1]
    NB = cand.blocks
    u = u[..., :span]
    limit = _CHUNK_ELEMENTS_CUDA if u.is_cuda else _CHUNK_ELEMENTS
    chunk = max(1, limit // max(1, B * H * span))
    idx_out, w_out, cnt_out = [], [], []
    for c0 in range(0, NB, chunk):
        c1 = min(NB, c0 + chunk)
        m = cand.mask(c0, c1, span)[:, None].expand(B, H, c1 - c0, span)
        uc = u[:, :, c0:c1] if u.shape[2] > 1 else u
        uc = uc.expand(B, H, c1 - c0, span)
        neg_inf = torch.full((), float("-inf"), dtype=uc.dtype, device=uc.device)
        cnt = m.sum(-1).clamp_max(K)  # (B, H, c)
        if NB == 1:  # one block (a decode step): the top K as a mask, packed in key order (no top-K list, no sort)
            sel = top_mask(torch.where(m, uc.detach(), neg_inf), K) & m
            idx = front_pack(sel, K, torch.arange(span, device=u.device).expand(sel.shape), S)
        else:
            order = _top_indices(torch.where(m, uc.detach(), neg_inf), K)
            keep = torch.arange(K, device=u.device) < cnt[..., None]
            idx = torch.where(keep, order, torch.full_like(order, S))  # past-count entries sort last
            idx = torch.sort(idx, dim=-1).values
        keep = idx < S
        if weighted:
            p = sparsek(uc, top_k, m)
            w = p.gather(-1, idx.clamp_max(span - 1))
            w_out.append(torch.where(keep, w, torch.zeros_like(w)))
        idx_out.append(torch.where(keep, idx, torch.full_like(idx, -1)))
        cnt_out.append(cnt)
    return TokenLayout(
        indices=torch.cat(idx_out, 2).to(torch.int32), counts=torch.cat(cnt_out, 2).to(torch.int32),
        query_block=query_block, first_block=first, weights=torch.cat(w_out, 2) if weighted else None,
    )


def _prefix_topk_layout(u, pattern, geometry, first, block_start, block_ok, K, span) -> TokenLayout:
    """Exact SparseK selection from query-independent scores ``u (B, H, Skv)`` without sorting whole rows.

    The candidates of a block are a prefix of positions, so with a grid of ``PREFIX_CHUNK`` positions:
    ``L_c`` = the ``M = 2 * top_k`` best keys of positions ``[0, c * PREFIX_CHUNK)`` (``_prefix_best_lists``:
    a parallel prefix scan over the grid), and a block whose candidates end in
    chunk ``c`` takes its top ``K`` from ``L_c`` and its own chunk's candidates: at most
    ``M + PREFIX_CHUNK`` entries per block instead of every candidate. The top ``K`` is exact (ties to
    the earlier key); the SparseK threshold is computed over those entries, exact whenever the SparseK
    support (``u > tau``) of the block has at most ``M`` keys before its chunk.
    """
    B, H, S = u.shape
    Z, M = PREFIX_CHUNK, 2 * pattern.top_k
    n_chunks = max(1, -(-span // Z))
    n = n_chunks * Z
    k_start, k_end = geometry.k_start.expand(B), geometry.k_end.expand(B)
    pos = torch.arange(n, device=u.device)
    idx = k_start[:, None] + pos  # (B, n) tensor index of each position
    ok = (pos >= pattern.sinks) & (idx < k_end[:, None]) & (idx < S)
    neg = torch.full((), float("-inf"), dtype=u.dtype, device=u.device)
    u_pos = torch.where(ok[:, None], u.gather(2, idx.clamp(0, S - 1)[:, None].expand(B, H, n)), neg)  # (B, H, n)
    lo, hi = pattern.candidate_range(block_start)  # (B, NB)
    c_blk = torch.div(hi.clamp_min(0), Z, rounding_mode="floor").clamp_max(n_chunks - 1)  # chunk of each block's last candidate
    L = _prefix_best_lists(u_pos.detach(), n_chunks, Z, M)  # (B, H, n_chunks, M)
    NB = block_start.shape[1]

    def u_at(cand):
        flat = cand.clamp_min(0).flatten(2)
        return u_pos.gather(2, flat).view(cand.shape), ok.gather(1, flat.flatten(1)).view(cand.shape)

    limit = _CHUNK_ELEMENTS_CUDA if u.is_cuda else _CHUNK_ELEMENTS
    step = max(1, limit // max(1, B * H * (M + Z)))  # blocks per chunk: bounded (B, H, c, M + Z) entries
    parts = []
    for c0 in range(0, NB, step):
        c1 = min(NB, c0 + step)
        prev = L.gather(2, c_blk[:, None, c0:c1, None].expand(B, H, c1 - c0, M))  # (B, H, c, M)
        parts.append(_prefix_select(prev, c_blk[:, c0:c1], u_at, pattern, geometry, first, lo[:, c0:c1], hi[:, c0:c1],
                                    block_ok[:, c0:c1], K))
    return _cat_layouts(parts)


def _prefix_candidates(prev, c_blk, u_at, lo, hi, block_ok):
    """``_prefix_select``'s entries: ``cand (B, H, NB, M + Z)`` positions (``prev`` then chunk ``c_blk``'s own, ascending
    among the valid ones), their scores ``uc`` and candidate mask ``m``."""
    B, H, NB, _ = prev.shape
    Z = PREFIX_CHUNK
    tail = (c_blk * Z)[..., None] + torch.arange(Z, device=prev.device)  # (B, NB, Z)
    cand = torch.cat([prev, tail[:, None].expand(B, H, NB, Z)], -1)  # positions, ascending
    uc, okc = u_at(cand)
    m = (cand >= lo[:, None, :, None]) & (cand <= hi[:, None, :, None]) & block_ok[:, None, :, None] & okc
    return cand, uc, m


def _stepped_select(L, chunk, chosen, u, pattern, geometry, first, lo, hi, block_ok, state) -> TokenLayout:
    """A one-query call's layout from its stepped lists (``_advance_prefix_list``): the block's selection ``chosen
    (B, H, top_k)`` (positions, packed ascending) and the SparseK weights of ``_prefix_select`` over the same
    entries (``L (B, H, M)`` and chunk ``chunk (B,)``), read at the chosen positions: equal to ``_prefix_select``
    without its top-k. The weights are computed at a block's first step (or when ``state["W_ok"]`` is False: the
    first step after a full call) and kept in ``state["W"]`` for the block's later steps, whose rows run the
    SparseK operator with a budget of 0 (no search): one graph for every step, no branch."""
    B, H, M = L.shape
    cand, uc, m = _prefix_candidates(L[:, :, None], chunk[:, None], lambda c: _u_at(u, c, geometry, pattern.sinks),
                                     lo, hi, block_ok)
    fresh = sst.block_start(pattern, geometry, B) | ~state["W_ok"]  # (B,) rows whose weights are computed this step
    budget = torch.where(fresh, pattern.top_k, 0)[:, None, None].expand(B, H, 1)
    p = sparsek(uc, budget, m)  # (B, H, 1, M + Z); all zero in the rows that keep their weights
    sel = chosen[:, :, None]
    ok = sel >= 0
    big = torch.full((), torch.iinfo(torch.int64).max, dtype=L.dtype, device=L.device)
    listed = torch.searchsorted(torch.where(L >= 0, L, big), chosen.contiguous())[:, :, None]  # no view of the
    # sorted sequence: Inductor (torch 2.11) cannot lower searchsorted over a reshaped computed buffer
    c0 = (chunk * PREFIX_CHUNK)[:, None, None, None]
    at = torch.where(sel >= c0, M + sel - c0, listed).clamp(0, cand.shape[-1] - 1)
    w = torch.where(ok, p.gather(-1, at), torch.zeros((), dtype=p.dtype, device=p.device))
    w = torch.where(fresh[:, None, None, None], w, state["W"][:, :, None].to(w.dtype))
    state["W"].copy_(w[:, :, 0])
    state["W_ok"].fill_(True)
    ind = torch.where(ok, sel + geometry.k_start.expand(B)[:, None, None, None], -1)
    return TokenLayout(indices=ind.to(torch.int32), counts=ok.sum(-1).to(torch.int32),
                       query_block=pattern.query_block, first_block=first, weights=w)


def _prefix_select(prev, c_blk, u_at, pattern, geometry, first, lo, hi, block_ok, K) -> TokenLayout:
    """The top ``K`` and SparseK weights of every block among ``prev (B, H, NB, M)`` (the best positions before
    the block's chunk ``c_blk (B, NB)``) and the chunk's own positions; ``u_at(cand) -> (scores, ok)`` at
    positions ``cand (B, H, NB, W)``; ``lo, hi (B, NB)`` candidate ranges."""
    B = prev.shape[0]
    cand, uc, m = _prefix_candidates(prev, c_blk, u_at, lo, hi, block_ok)
    neg = torch.full((), float("-inf"), dtype=uc.dtype, device=uc.device)
    # The top K as a mask, packed in cand's (ascending) order: no top-K list, no sort (candidates have finite scores).
    sel = top_mask(torch.where(m, uc.detach(), neg), K) & m
    p = sparsek(uc, pattern.top_k, m)
    w = front_pack(sel, K, p, 0.0)
    k_start = geometry.k_start.expand(B)
    ind = front_pack(sel, K, cand + k_start[:, None, None, None], -1)
    return TokenLayout(indices=ind.to(torch.int32), counts=m.sum(-1).clamp_max(K).to(torch.int32),
                       query_block=pattern.query_block, first_block=first, weights=w)


def _best_positions(cand: torch.Tensor, u_pos: torch.Tensor, M: int) -> torch.Tensor:
    """The ``M`` best of the positions ``cand (B, H, C, W)`` (-1 = empty) by score ``u_pos (B, H, n)``, ties to
    the earlier position: ``(B, H, C, M)`` positions, ascending among the valid ones, -1 for empty slots.

    Valid entries of ``cand`` must be in ascending position order along the last axis (ties then go to the
    smaller index, which is the earlier position); entries with score -inf count as empty.
    """
    return sst.best_of(cand, u_pos.gather(2, cand.clamp_min(0).flatten(2)).view(cand.shape), M)


def _prefix_best_lists(u_pos: torch.Tensor, n_chunks: int, Z: int, M: int) -> torch.Tensor:
    """``L (B, H, n_chunks, M)``: ``L[..., c, :]`` = the ``M`` best positions of ``[0, c * Z)`` by ``u_pos (B, H, n)``
    (``n >= n_chunks * Z``; ascending, -1 empty; ties to the earlier position).

    A Hillis-Steele scan: each chunk's own best ``M``, then ``log2(n_chunks)`` rounds that merge every list
    with the list ``2**r`` chunks before it. "Best ``M`` of a union" is associative with the tie rule, so
    the result equals the sequential scan, in O(log n_chunks) batched steps instead of n_chunks small ones.
    """
    B, H = u_pos.shape[:2]
    grid = torch.arange(n_chunks, device=u_pos.device)[:, None] * Z + torch.arange(Z, device=u_pos.device)
    best = _best_positions(grid.expand(B, H, n_chunks, Z), u_pos, M)  # best of chunk c alone
    step = 1
    while step < n_chunks:
        before = torch.cat([best.new_full((B, H, step, M), -1), best[:, :, : n_chunks - step]], 2)
        best = _best_positions(torch.cat([before, best], -1), u_pos, M)  # chunks (c - 2 * step, c]
        step *= 2
    return torch.cat([best.new_full((B, H, 1, M), -1), best[:, :, : n_chunks - 1]], 2)  # exclusive prefix


def _dsa_block_queries(indexer: LightningIndexer, query, geometry, host, query_block, first, block_start, block_ok):
    """Indexer queries ``(B, NB, H, d_I)`` and head weights ``(B, NB, H)`` of every block's first query
    (design §7; module docstring).

    The memo is a ``block_ring`` of the last few blocks' first queries. Host-known offsets: whether it holds the
    block a call starts inside is checked on the host (its mirror), so nothing reads the device; with device-only
    offsets the memo is applied where it matches, unchecked.
    """
    B, _, Sq, _ = query.shape
    q_index, w = indexer.index_queries(query)  # (B, Sq, H_I, d_I), (B, Sq, H_I)
    qpos0 = geometry.q_positions(Sq).expand(B, Sq)[:, 0]
    qi = block_start - qpos0[:, None]  # (B, NB) query tensor index of each block's first query
    inside = (qi >= 0) & (qi < Sq)
    b_ix = torch.arange(B, device=query.device)[:, None]
    qb = q_index[b_ix, qi.clamp(0, Sq - 1)]  # (B, NB, H_I, d_I)
    wb = w[b_ix, qi.clamp(0, Sq - 1)]
    need = ~inside[:, 0] & block_ok[:, 0]  # rows whose first block started in an earlier call
    memo = indexer._block_memo
    if memo is None:
        memo = new_state_dict(indexer, "_block_memo")
    # A block_ring of the last blocks' first queries, in buffers written in place (step_state: CUDA-graph safe).
    values = {"q": (tuple(qb.shape[2:]), qb.dtype), "w": (tuple(wb.shape[2:]), wb.dtype)}
    memo_ok = block_ring.prepare(memo, B, query_block, values, first.device)
    p0 = block_ring.host_starts(host, B)
    if block_ring.host_missing(memo, p0, query_block, memo_ok):
        warn_once(
            "dsa: a call starts inside a query block whose first query the indexer has not seen (run the "
            "selector on every call of a generation); using the call's first query for that block"
        )
    found, (q_memo, w_memo) = block_ring.lookup(memo, first, ["q", "w"])
    use = need & found
    qb[:, 0] = torch.where(use[:, None, None], q_memo, qb[:, 0])
    wb[:, 0] = torch.where(use[:, None], w_memo, wb[:, 0])
    block_ring.store(memo, first, block_ok.sum(-1) - 1, inside, {"q": qb, "w": wb})
    block_ring.host_store(memo, p0, Sq, query_block, fresh=not memo_ok)
    return qb, wb


def _dsa_preselected_layout(indexer, qb, wb, index_keys, pattern, geometry, host, first, block_start, block_ok, K, span,
                            n_pre) -> TokenLayout:
    """DSA selection with page pre-selection (shared indexer keys ``(B, Skv, d_I)``).

    Stage 1: per block, the ``n_pre`` candidate pages with the largest upper bound of the indexer score
    over the page (per indexer head: ``relu`` of the Quest bound of ``q . k`` from the channel-wise
    min/max of the page's indexer keys, times the head weight; a negative weight takes the lower bound).
    Stage 2: exact indexer scores of the candidates in those pages, top ``K``. Pages must be complete
    when the block starts (``window >= PRESELECT_PAGE``, checked by the caller). Equal to the full
    selection whenever the chosen pages hold its top ``K``.
    """
    B, S, dI = index_keys.shape
    page = PRESELECT_PAGE
    n_pages = max(1, -(-span // page))
    k_start, k_end = geometry.k_start.expand(B), geometry.k_end.expand(B)
    aligned = host is not None and all(x == 0 for x in host[1])
    kmin, kmax, ok = page_summaries(index_keys[:, None], k_start, k_end, page, pattern.sinks, n_pages, aligned=aligned)
    kmin, kmax = kmin[:, 0], kmax[:, 0]  # (B, P, d_I)
    okf = ok[:, 0, :, None]
    kmin, kmax = torch.where(okf, kmin, 0.0), torch.where(okf, kmax, 0.0)
    q = qb.to(kmin.dtype)  # (B, NB, H, d_I)
    qq = torch.cat([q.clamp_min(0), q.clamp_max(0)], -1).flatten(1, 2)  # (B, NB*H, 2 d_I)
    ub = torch.matmul(qq, torch.cat([kmax, kmin], -1).transpose(1, 2)).view(*q.shape[:3], -1)  # (B, NB, H, P)
    lb = torch.matmul(qq, torch.cat([kmin, kmax], -1).transpose(1, 2)).view(*q.shape[:3], -1)
    w = wb.to(kmin.dtype)[..., None]
    bound = torch.where(w >= 0, w * ub.relu(), w * lb.relu()).sum(2) / (indexer.indexer_dim ** 0.5)  # (B, NB, P)
    lo, hi = pattern.candidate_range(block_start)
    p_idx = torch.arange(n_pages, device=q.device)
    cand_pages = ok & (p_idx * page <= hi[..., None]) & block_ok[..., None]  # (B, NB, P)
    pages, chosen = top_pages(bound[:, None], cand_pages[:, None], n_pre)  # (B, 1, NB, n_pre)
    tok = (pages[..., None] * page + torch.arange(page, device=q.device)).flatten(-2)[:, 0]  # (B, NB, L) positions
    n_keys = (k_end - k_start)[:, None, None]
    m = chosen[:, 0].repeat_interleave(page, -1) & (tok >= lo[..., None]) & (tok <= hi[..., None]) & (tok < n_keys)
    kidx = (tok + k_start[:, None, None]).clamp(0, S - 1)
    kt = index_keys.gather(1, kidx.flatten(1)[..., None].expand(-1, -1, dI)).view(*tok.shape, dI)  # (B, NB, L, d_I)
    dots = torch.einsum("bnhd,bnld->bnhl", qb.to(kt.dtype), kt) / (indexer.indexer_dim ** 0.5)
    sc = torch.einsum("bnh,bnhl->bnl", wb.to(kt.dtype), dots.relu())
    neg = torch.full((), float("-inf"), dtype=sc.dtype, device=sc.device)
    Kp = min(K, tok.shape[-1])
    top = _top_indices(torch.where(m, sc, neg), Kp)
    keep = m.gather(-1, top)
    big = tok.shape[-1]
    top, _ = torch.sort(torch.where(keep, top, torch.full_like(top, big)), dim=-1)
    keep = top < big
    ind = torch.where(keep, kidx.gather(-1, top.clamp_max(big - 1)), torch.full_like(top, -1))
    if Kp < K:
        ind = torch.nn.functional.pad(ind, (0, K - Kp), value=-1)
    return TokenLayout(indices=ind[:, None].to(torch.int32), counts=m.sum(-1).clamp_max(Kp)[:, None].to(torch.int32),
                       query_block=pattern.query_block, first_block=first, weights=None)
