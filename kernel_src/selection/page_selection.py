"""Page-level selection: the query-aware training-free default and the page pre-selection stage.

Keys are grouped in *pages* of ``page`` consecutive positions (page ``p`` holds positions
``[p * page, (p + 1) * page)`` of its row; positions, not tensor indices, so left padding and
decoding see the same pages). Only keys that can ever be candidates enter a page's summary (a valid
key at a position ``>= sinks``).

A page is a *candidate page* of query block ``b`` (first position ``b0``) when it holds a
candidate key (design §6: positions ``[sinks, b0 - window]``) and its last position is a candidate
(``<= b0 - window``): so it is complete when the block starts (its summary is fixed before the block's
first query and decoding sees the same pages as a recompute), its bound covers no key of the window,
and a chosen page brings ``page`` keys (page 0: ``page - sinks``). The last, partly-candidate page
(the one holding ``b0 - window`` when that is not a page's last position) is never chosen: its summary
would mix in window keys, which inflates its bound, and it would spend a page of the budget on fewer keys.

Training-free default (``quest_layout``, after Quest, Tang et al. 2024, arXiv 2406.10774): the
summary of a page is the channel-wise ``min`` and ``max`` of its keys; for a query ``q`` the score
``sum_c max(q_c * kmin_c, q_c * kmax_c) = relu(q) . kmax + min(q, 0) . kmin`` is an upper bound of
``q . k`` over the page's keys (one matmul against ``[kmax, kmin]``). The query side of block ``b``
is the block's *first* query (the only query of the block that exists when it starts: decode
equals recompute), per query head; the page score of a KV head is the sum of the bounds of its
query heads (``HEAD_REDUCE``: or their max; or ``"rank"``: pages chosen per query head, merged round
robin: a page's priority is its best rank among the group's query heads, ties by the summed bound). Per
block and KV head, the ``top_k // page`` candidate pages with the highest score are taken and expanded
to their candidate keys (so at most ``top_k`` keys); with at most ``top_k`` candidates, all of them. The result is an ordinary ``TokenLayout``: every attention path consumes it.
Query blocks are scored in chunks (``CHUNK_ELEMENTS`` score entries, ``CHUNK_ELEMENTS_CUDA`` on a
GPU), so the selection's temporaries stay bounded at any length; chunk sizes come from host-known
shapes (no device read). With host-known offsets the call's geometry-only tensors (candidate ranges, each block's
last candidate page) are shared by every layer of a forward (``layouts.host_memo``), and when every row starts at the
same position the block queries are a strided slice of the queries (``block_queries``).

Options (default off; their screening is in docs/selection.md): the pattern's ``refine`` (or the module constant
``REFINE`` for patterns that leave it 0; two-stage: exact attention probabilities over more pages than the
budget) and ``OBS`` (an observation window of the queries just before the block, SnapKV-style; it did not
retrieve in the screening). With ``OBS`` the decode memo also keeps a ring of the
last ``OBS`` queries and the current block's observation queries.

Decoding: a call that starts inside a block needs that block's first query, which an earlier call
saw. ``quest_layout`` reads and updates a *memo* (a dict the caller keeps per layer: a ``block_ring`` of the first
queries ``(Hq, D)`` of each row's last few blocks, so that assisted decoding can cut back into an earlier block);
without a matching memo it uses the call's first query and warns once (as the DSA indexer does). The memo's tensors are buffers written in
place (``sparse_k.selection.step_state``), so a compiled decode step (CUDA graphs) never keeps one of its outputs.

Kernels: where ``row_kernels`` gives the Triton module (``select_triton``: float32 summaries on CUDA, or on the CPU
under ``TRITON_INTERPRET=1``), the page summaries, the page scores, the page top-k and (pages of a power of two) the
chosen keys' layout of ``quest_layout`` run there, for every call (so
a decode step equals a recompute bit for bit), and skip the rows whose ``flag`` is off (a decode step inside a query
block: ``selection_state``); so do the refinement's scores and its top-k (``most_probable``; the scores of the
training-free pages per tile of blocks, ``select_triton.refine_page_scores``, when the page size is a power of two,
else and for trained SparseK pools ``refine_probabilities``); otherwise (``HEAD_REDUCE`` other than "sum", ``OBS``,
float64, the CPU) PyTorch.
"""

from __future__ import annotations

import torch

from ..layouts.geometry import host_rows
from ..layouts.host_memo import host_memo
from ..warn import warn_once
from .kernel_module import KernelModule, interpreter_on
from . import block_ring
from .step_state import state_buffers

__all__ = ["DEFAULT_PAGE", "block_queries", "expand_pages", "most_probable", "obs_page_scores", "observe", "page_size",
           "page_summaries", "quest_layout", "quest_scores", "rank_merge", "refine_probabilities", "front_pack",
           "row_kernels", "static_positions", "top_indices", "top_mask", "top_pages"]

#: Page size of the training-free default (docs/selection.md: chosen by measurement on SmolLM2-135M).
DEFAULT_PAGE = 16
#: How the bounds of a KV head's query heads combine into its page score: "sum" (default), "max" or
#: "rank" (pages chosen per query head, merged round robin: module docstring).
HEAD_REDUCE = "sum"
#: Score entries (rows x query heads x pages) per chunk of query blocks: bounds the selection's temporaries.
CHUNK_ELEMENTS = 1 << 22
CHUNK_ELEMENTS_CUDA = 1 << 27
#: Two-stage selection: 0 (default) takes the ``top_k // page`` best pages; ``F > 0`` preselects the ``F * top_k // page``
#: best pages, then keeps the ``top_k`` keys of those pages with the largest attention probability of the block's
#: first query (its ``q . k`` softmax over its sinks, its window and the preselected keys, per query head, summed over
#: the KV head's query heads).
REFINE = 0
#: Observation window (SnapKV-style, after Li et al. 2024, arXiv 2404.14469): 0 (default) scores with the block's
#: first query alone; ``n > 0`` scores with the ``n`` queries at positions ``[b0 - n + 1, b0]`` (the block's first query
#: and the ``n - 1`` before it: all known when the block starts). Each observation query and query head contributes its
#: softmax over the candidate pages of the Quest bound (times ``D ** -0.5``), summed over the observation queries and
#: the KV head's query heads (``HEAD_REDUCE`` is not used); with ``REFINE`` the second stage sums the observation
#: queries' attention probabilities (each over its causal sinks, its causal part of the block's window and the
#: preselected keys). Decode state: the last ``n`` queries (a ring) and the current block's ``n`` observation queries.
OBS = 0
#: The training-free refinement's softmax normaliser (``refine_probabilities``, ``select_triton.refine_page_scores``):
#: "full" (default) over the block's static keys (sinks and window) and every preselected key; "static" over the static
#: keys alone, so the kernels skip their first pass over the preselected keys (the ranking differs only through the
#: weight of each query head in the sum; docs/selection.md). Trained SparseK pools keep "full".
REFINE_NORMALISER = "full"
#: Refinement (``refine_probabilities``): the block queries' logits come from one matmul with every key, read at the
#: preselected keys, when the key tensor holds at most this many times the keys a block reads (preselected and
#: static) and the matmul's temporaries are no larger than the gathered keys; otherwise the keys are gathered.
DENSE_REFINE_FACTOR = 4
#: Entries of the preselection's per-key lists (positions, flags, indices, scores; in units of a key vector's float)
#: per preselected key that bound a chunk of the refinement with the kernels (``quest_layout``, ``selectors._refined_layout``).
REFINE_LIST_ENTRIES = 8
#: Whether the selection runs its Triton kernels (``select_triton``) where they apply (``row_kernels``).
TRITON_SELECTION = True

_KERNELS = KernelModule(".select_triton", "_topk_kernel")


def row_kernels(t: torch.Tensor):
    """The ``select_triton`` module when the selection's kernels run for float32 work on ``t``'s device: CUDA, or
    the CPU under ``TRITON_INTERPRET=1`` with the module imported interpreted; else None (the PyTorch path)."""
    return _kernels_on(t.device) if t.dtype == torch.float32 else None


def _kernels_on(device: torch.device):
    """``row_kernels`` by device alone (for inputs of any float dtype whose kernel computes in float32)."""
    if not TRITON_SELECTION or device.type not in ("cuda", "cpu"):
        return None
    if device.type == "cpu" and not interpreter_on():
        return None
    try:
        mod = _KERNELS.module if _KERNELS.module is not None else _KERNELS.load()
    except ImportError:
        return None
    if device.type == "cuda":
        return mod
    return mod if _KERNELS.interpreted() else None


def page_size(pattern, page: int | None = None) -> int:
    """The page size ``quest_layout`` uses for ``pattern``: ``page`` (default ``DEFAULT_PAGE``), at most ``top_k``."""
    return max(1, min(page or DEFAULT_PAGE, pattern.top_k))


def _compute(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def page_summaries(key: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, page: int, sinks: int,
                   n_pages: int, *, aligned: bool = False):
    """Channel-wise ``(kmin, kmax)`` of every page, each ``(B, Hkv, n_pages, D)`` float32 (float64 keys: float64), and
    ``ok (B, 1, n_pages)`` bool (the page holds a key at a position ``>= sinks``).

    ``key (B, Hkv, Skv, D)``; ``k_start, k_end (B' in {1, B},)`` the rows' valid key range (tensor
    indices; position = index - k_start). ``aligned``: every ``k_start`` is 0 (skips the gather).
    Empty slots hold ``+inf`` (kmin) / ``-inf`` (kmax).
    """
    B, H, S, D = key.shape
    kern = None if key.dtype == torch.float64 else _kernels_on(key.device)
    if kern is not None:  # (the summaries feed discrete choices only: no gradient)
        return kern.page_summaries(key.detach(), k_start, k_end, page, sinks, n_pages)
    n = n_pages * page
    pos = torch.arange(n, device=key.device)
    if aligned:
        k = _compute(key[:, :, : min(S, n)])
        if n > S:
            k = torch.nn.functional.pad(k, (0, 0, 0, n - S))
        idx = pos.expand(B, n)
    else:
        idx = k_start.expand(B)[:, None] + pos  # (B, n) tensor index of each position
        g = idx.clamp(0, S - 1)[:, None, :, None].expand(B, H, n, D)
        k = _compute(key.gather(2, g))
    ok = (pos >= sinks) & (idx < k_end.expand(B)[:, None]) & (idx < S)  # (B, n)
    ok4 = ok[:, None, :, None]
    inf = torch.full((), float("inf"), dtype=k.dtype, device=key.device)
    kmin = torch.where(ok4, k, inf).view(B, H, n_pages, page, D).amin(3)
    kmax = torch.where(ok4, k, -inf).view(B, H, n_pages, page, D).amax(3)
    return kmin, kmax, ok.view(B, n_pages, page).any(-1)[:, None]


def _page_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """The Quest bound ``relu(q) . kmax + min(q, 0) . kmin`` of queries ``q (B, Hkv, N, D)`` over every page:
    ``(B, Hkv, N, P)`` in the summaries' dtype, one matmul; pages without a key (``ok (B, 1, P)`` False) give 0."""
    B, H, N, D = q.shape
    q = q.to(kmin.dtype)
    qq = torch.cat([q.clamp_min(0), q.clamp_max(0)], -1)  # (B, H, N, 2D)
    okf = ok[..., None]
    kk = torch.cat([torch.where(okf, kmax, 0.0), torch.where(okf, kmin, 0.0)], -1)  # (B, H, P, 2D)
    return torch.matmul(qq, kk.transpose(-1, -2))


def quest_scores(q_blocks: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, ok: torch.Tensor,
                 cand_pages: torch.Tensor | None = None) -> torch.Tensor:
    """Page scores ``(B, Hkv, NB, P)``, higher is better: for every block's query heads ``q_blocks (B, Hkv, NB, G, D)``
    the Quest bound ``relu(q) . kmax + min(q, 0) . kmin`` summed over the ``G`` heads (float32; ``HEAD_REDUCE``
    "max": maxed; "rank": the round-robin priority of ``rank_merge`` over ``cand_pages (B, 1|Hkv, NB, P)``,
    float64). Pages without a key (``ok (B, 1, P)`` False) score 0 here (the caller masks them)."""
    B, H, NB, G, D = q_blocks.shape
    per_head = _page_bounds(q_blocks.reshape(B, H, NB * G, D), kmin, kmax, ok).view(B, H, NB, G, -1)
    if HEAD_REDUCE == "rank":
        if cand_pages is None:
            raise ValueError("quest_scores: HEAD_REDUCE 'rank' needs cand_pages")
        return rank_merge(per_head, cand_pages)
    if HEAD_REDUCE not in ("sum", "max"):
        raise ValueError(f"page_selection.HEAD_REDUCE must be 'sum', 'max' or 'rank', got {HEAD_REDUCE!r}")
    return per_head.amax(3) if HEAD_REDUCE == "max" else per_head.sum(3)


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Rank (0 = best) of every entry along the last dim of ``x``, descending, ties to the smaller index."""
    order = top_indices(x, x.shape[-1])
    n = x.shape[-1]
    return torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=x.device).expand_as(order))


def rank_merge(per_head: torch.Tensor, cand_pages: torch.Tensor) -> torch.Tensor:
    """Pages chosen per query head, merged round robin: ``(B, H, NB, P)`` float64 priorities (higher first).

    ``per_head (B, H, NB, G, P)`` the query heads' page scores; ``cand_pages (B, 1|H, NB, P)`` bool. Each
    query head ranks the candidate pages (best first, ties to the earlier page); a page's priority orders
    by its best rank over the ``G`` heads, then by the summed score (ties to the earlier page), so the top
    ``n`` pages hold every head's best ``n // G`` pages. Every priority is distinct (exact in float64).
    """
    neg = torch.full((), float("-inf"), dtype=per_head.dtype, device=per_head.device)
    P = per_head.shape[-1]
    best = _ranks(torch.where(cand_pages[:, :, :, None, :], per_head, neg)).amin(3)  # (B, H, NB, P)
    tie = _ranks(torch.where(cand_pages, per_head.sum(3), neg))
    return -(best * P + tie).to(torch.float64)


def top_indices(x: torch.Tensor, K: int, *, fused: bool | None = None) -> torch.Tensor:
    """Indices of the ``K`` largest entries of every row of ``x (..., n)``, best first, ties to the smaller index.

    ``fused`` (default: float32 on CUDA): one ``torch.topk`` on an int64 key (the float's order-preserving
    bits, then the reversed index), exact and without sorting whole rows; otherwise a stable sort.
    """
    if fused is None:
        fused = x.is_cuda and x.dtype == torch.float32
    if not fused:
        return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :K]
    bits = (x.float() + 0.0).contiguous().view(torch.int32)  # + 0.0 turns -0.0 into +0.0 (they tie)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # int order == float order
    n = x.shape[-1]
    key = (key << 32) | (n - 1 - torch.arange(n, device=x.device))
    return torch.topk(key, K, dim=-1, sorted=True).indices


def top_mask(x: torch.Tensor, K: int) -> torch.Tensor:
    """``(..., n)`` bool: the ``K`` largest entries of every row of ``x (..., n)`` (the set ``top_indices`` returns,
    ties to the smaller index), without ordering them.

    Float32 and narrower: one ``torch.topk(sorted=False)`` on ``top_indices``' int64 key (distinct keys, so the
    set is exact; unsorted: no sort of the ``K`` results, which ``sorted=True`` adds on CUDA), scattered into
    the mask; float64 (whose order the float32 key would not keep): the indices of ``top_indices`` scattered.
    """
    n = x.shape[-1]
    if K >= n:
        return torch.ones(x.shape, dtype=torch.bool, device=x.device)
    if K <= 0:
        return torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    if x.dtype == torch.float64:
        return torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter_(-1, top_indices(x, K), True)
    bits = (x.float() + 0.0).contiguous().view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    key = (key << 32) | (n - 1 - torch.arange(n, device=x.device))  # distinct: the top-K set is unique
    top = torch.topk(key, K, dim=-1, sorted=False).indices
    return torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter_(-1, top, True)


def front_pack(mask: torch.Tensor, K: int, src: torch.Tensor, fill) -> torch.Tensor:
    """The entries of ``src (..., n)`` where ``mask (..., n)`` holds (at most ``K`` per row), moved to the front in
    their order: ``(..., K)``, ``fill`` past each row's count. A scan and a scatter (no sort); differentiable
    in ``src``."""
    dest = torch.where(mask, mask.cumsum(-1) - 1, K)  # unselected entries go to a slot K that is cut off
    out = torch.full((*src.shape[:-1], K + 1), fill, dtype=src.dtype, device=src.device)
    return out.scatter(-1, dest, torch.where(mask, src, torch.full((), fill, dtype=src.dtype, device=src.device)))[..., :K]


def top_pages(scores: torch.Tensor, cand_pages: torch.Tensor, n_sel: int):
    """The ``n_sel`` best candidate pages per row of ``scores (B, H, NB, P)`` (``cand_pages (B, 1|H, NB, P)``
    bool): ``pages (B, H, NB, n)`` ascending, ``chosen (B, H, NB, n)`` bool (False: fewer candidates)."""
    n = min(n_sel, scores.shape[-1])
    neg = torch.full((), float("-inf"), dtype=scores.dtype, device=scores.device)
    pages = top_indices(torch.where(cand_pages, scores, neg), n)  # ties to the earlier page
    chosen = cand_pages.expand_as(scores).gather(-1, pages)
    big = scores.shape[-1]
    pages = torch.sort(torch.where(chosen, pages, torch.full_like(pages, big)), dim=-1).values
    chosen = pages < big
    return pages, chosen


def _page_keys(pages: torch.Tensor, chosen: torch.Tensor, page: int, lo: torch.Tensor, hi: torch.Tensor,
               n_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every key position of the ``pages (B, H, NB, n)``, slot ``j * page + o`` for key ``o`` of page ``j``: ``(B, H,
    NB, n * page)``, and whether it is a key of a ``chosen`` page inside ``[lo, hi]`` ``(B, NB)`` and below ``n_keys
    (B,)``."""
    pos = (pages[..., None] * page + torch.arange(page, device=pages.device)).flatten(-2)
    ok = chosen.repeat_interleave(page, -1) & (pos >= lo[:, None, :, None]) & (pos <= hi[:, None, :, None]) \
        & (pos < n_keys[:, None, None, None])
    return pos, ok


def expand_pages(pages: torch.Tensor, chosen: torch.Tensor, page: int, lo: torch.Tensor, hi: torch.Tensor,
                 n_keys: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key positions of the chosen pages inside ``[lo, hi]`` and below ``n_keys``, packed to the front.

    ``pages, chosen (B, H, NB, n)`` (ascending pages); ``lo, hi (B, NB)`` candidate range;
    ``n_keys (B,)`` valid keys of each row. Returns ``positions (B, H, NB, width)`` int64 ascending
    (-1 past the count) and ``counts (B, H, NB)`` int64. ``width`` must be ``>=`` the largest count.
    """
    B, H, NB = pages.shape[:3]
    pos, ok = _page_keys(pages, chosen, page, lo, hi, n_keys)
    dest = torch.where(ok, ok.long().cumsum(-1) - 1, torch.full_like(pos, width))
    out = torch.full((B, H, NB, width + 1), -1, dtype=torch.int64, device=pages.device)
    out.scatter_(-1, dest, torch.where(ok, pos, torch.full_like(pos, -1)))
    return out[..., :width], ok.sum(-1)


def _gather_logits(qb, key, k_start, pos, ok):
    """``q . k / sqrt(D)`` ``(B, H, NB, G, W)`` of the block queries ``qb (B, H, NB, G, D)`` with the keys at positions
    ``pos (B, 1|H, NB, W)``; ``-inf`` where ``ok`` is False."""
    B = qb.shape[0]
    return _logits_at(qb, key, pos.clamp_min(0) + k_start.view(B, 1, 1, 1), ok)


def _logits_at(qb, key, idx, ok):
    """``q . k / sqrt(D)`` ``(B, H, NB, G, W)`` of the block queries ``qb (B, H, NB, G, D)`` with the keys at tensor
    indices ``idx (B, 1|H, NB, W)`` of ``key (B, H, S, D)``; ``-inf`` where ``ok`` is False."""
    B, H, NB, G, D = qb.shape
    W = idx.shape[-1]
    idx, ok = idx.expand(B, H, NB, W).clamp(0, key.shape[2] - 1), ok.expand(B, H, NB, W)
    kg = _compute(key.gather(2, idx.reshape(B, H, NB * W, 1).expand(B, H, NB * W, D))).view(B, H, NB, W, D)
    logits = torch.einsum("bhngd,bhnwd->bhngw", qb.to(kg.dtype), kg) * D ** -0.5
    return logits.masked_fill(~ok[:, :, :, None], float("-inf"))


def refine_probabilities(qb: torch.Tensor, key: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor, static_idx: torch.Tensor,
                         static_ok: torch.Tensor, flag: torch.Tensor | None = None, *,
                         static_norm: bool = False) -> torch.Tensor:
    """The refinement score of preselected keys: ``(B, Hkv, NB, W)``, each key's share of the softmax of the block
    query ``qb (B, Hkv, NB, G, D)`` over its static keys (tensor indices ``static_idx (B, 1|Hkv, NB, Ws)``, valid where
    ``static_ok``) and the preselected keys (``idx (B, 1|Hkv, NB, W)``, valid where ``ok``), per query head, summed over
    the KV head's ``G`` query heads (a head that attends to its sinks and window gives the preselected keys little
    weight); 0 where ``ok`` is False. ``static_norm``: normalised over the static keys alone (``REFINE_NORMALISER``;
    a head's probabilities then exceed 1 where the preselected keys outweigh them). Float32 queries where
    ``row_kernels`` gives the kernels: Triton (``select_triton.refine_scores``: no gathered key vectors, a block's keys
    split over programs), which leaves the rows off ``flag (B, Hkv, NB)`` unwritten (None: every row); else PyTorch,
    gathered or by one matmul (every row)."""
    B, H, NB, G, D = qb.shape
    S, W, Ws = key.shape[2], idx.shape[-1], static_idx.shape[-1]
    kern = row_kernels(qb)
    if kern is not None:  # a score for a discrete choice: no gradient
        return kern.refine_scores(qb.detach(), key.detach(), idx, ok, static_idx, static_ok, flag,
                                  static_norm=static_norm)
    if _dense_refine(G, D, S, W + Ws):
        logits, lse = _dense_refine_logits(qb, key, idx, ok, static_idx, static_ok, static_norm)
    else:
        logits = _logits_at(qb, key, idx, ok)
        lse = torch.logsumexp(_logits_at(qb, key, static_idx, static_ok), -1)  # (B, Hkv, NB, G)
        if not static_norm:
            lse = torch.logaddexp(lse, torch.logsumexp(logits, -1))
    return torch.exp(logits - lse[..., None]).nan_to_num(0.0).sum(3)


def _dense_refine(G: int, D: int, S: int, reads: int) -> bool:
    """Whether ``refine_probabilities`` takes the matmul over every one of ``S`` keys (``DENSE_REFINE_FACTOR``) when a
    block reads ``reads`` keys with ``G`` query heads of width ``D``."""
    return S <= DENSE_REFINE_FACTOR * reads and 3 * G * S <= D * reads


def _dense_refine_logits(qb, key, idx, ok, static_idx, static_ok, static_norm: bool = False):
    """``refine_probabilities``' logits at the preselected keys ``(B, H, NB, G, W)`` (-inf where not ``ok``) and the
    log-normaliser over the preselected and static keys (``static_norm``: the static keys) ``(B, H, NB, G)``, from one
    matmul of the block queries with every key (no gather of key vectors; the keys the normaliser reads are marked in a
    ``(B, H, NB, S)`` count)."""
    B, H, NB, G, D = qb.shape
    S = key.shape[2]
    kf = _compute(key)
    logits = torch.einsum("bhngd,bhsd->bhngs", qb.to(kf.dtype), kf) * D ** -0.5  # (B, H, NB, G, S)
    read = torch.zeros(B, H, NB, S, dtype=torch.int32, device=key.device)
    for i, m in ((static_idx, static_ok),) if static_norm else ((idx, ok), (static_idx, static_ok)):
        n = i.shape[-1]
        read.scatter_add_(-1, i.expand(B, H, NB, n).clamp(0, S - 1), m.expand(B, H, NB, n).to(torch.int32))
    lse = torch.logsumexp(logits.masked_fill((read == 0)[:, :, :, None], float("-inf")), -1)
    W = idx.shape[-1]
    at = logits.gather(-1, idx.expand(B, H, NB, W).clamp(0, S - 1)[:, :, :, None].expand(B, H, NB, G, W))
    return at.masked_fill(~ok.expand(B, H, NB, W)[:, :, :, None], float("-inf")), lse


def static_positions(block_start, hi, n_keys, sinks: int, window: int):
    """The static keys of each block's first query: positions ``(B, NB, sinks + window)`` (the sinks, then the
    window back from ``block_start``) and whether each is a key of the row that is not a candidate (``<= hi``)."""
    B, NB = block_start.shape
    spos = torch.cat([torch.arange(sinks, device=block_start.device).expand(B, NB, sinks),
                      block_start[..., None] - torch.arange(window, device=block_start.device)], -1)
    sok = (spos >= 0) & (spos < n_keys[:, None, None]) & ((spos < sinks) | (spos > hi[..., None]))
    sok[..., sinks:] &= spos[..., sinks:] >= sinks
    return spos, sok


def most_probable(prob, pos, ok, top_k: int, width: int, flag: torch.Tensor | None = None):
    """The ``top_k`` positions ``pos (B, Hkv, NB, W)`` (valid where ``ok``, ascending there) of highest ``prob``:
    ``(positions (B, Hkv, NB, width)`` ascending, -1 past the count, ``counts (B, Hkv, NB))``. With the kernels, the
    rows off ``flag (B, Hkv, NB)`` (None: every row) are not computed and choose nothing."""
    k = min(top_k, pos.shape[-1])
    kern = row_kernels(prob)
    if kern is not None:  # the same set (the valid entries are >= 0 > -1), ascending
        at = kern.topk_rows(prob, k, mask=ok.expand(prob.shape), flag=flag).long()  # (B, Hkv, NB, k), -1 after
        if flag is not None:
            at = torch.where(flag[..., None], at, -1)
        chosen = torch.where(at >= 0, pos.expand(prob.shape).gather(-1, at.clamp_min(0)), -1)
        chosen = torch.nn.functional.pad(chosen, (0, max(0, width - k)), value=-1)[..., :width]
        return chosen, (at >= 0).sum(-1).clamp_max(width)
    neg = torch.full((), -1.0, dtype=prob.dtype, device=prob.device)
    keep = top_mask(torch.where(ok, prob, neg), k) & ok
    return front_pack(keep, width, pos, -1), keep.sum(-1).clamp_max(width)


def _refine(qb, key, k_start, pages, chosen, page, lo, hi, n_keys, width, top_k, block_start, sinks, window, flag=None):
    """The ``top_k`` keys of the preselected ``pages`` by the block query's attention probability (``REFINE``):
    ``positions (B, Hkv, NB, width)`` ascending (-1 past the count), ``counts (B, Hkv, NB)``; with the kernels, the rows
    off ``flag (B,)`` (None: all) are skipped and choose nothing.

    The probability of a key is its share of the softmax of the block's first query over its static keys (sinks
    and window) and the preselected keys, per query head; the KV head sums its query heads' probabilities (a
    head that attends to its sinks and window gives the candidates little weight)."""
    W = pages.shape[-1] * page
    pos, _ = expand_pages(pages, chosen, page, lo, hi, n_keys, W)  # (B, H, NB, W)
    ok = pos >= 0
    spos, sok = static_positions(block_start, hi, n_keys, sinks, window)
    ks = k_start.view(-1, 1, 1, 1)
    rows = None if flag is None else flag[:, None, None].expand(pos.shape[:3])
    prob = refine_probabilities(qb, key, pos.clamp_min(0) + ks, ok, spos[:, None].clamp_min(0) + ks, sok[:, None], rows,
                                static_norm=_static_norm(sinks, window))
    return most_probable(prob, pos, ok, top_k, width, rows)


def _static_norm(sinks: int, window: int) -> bool:
    """Whether the training-free refinement normalises over the static keys alone (``REFINE_NORMALISER``): "static"
    with static keys to normalise over (``sinks + window > 0``)."""
    if REFINE_NORMALISER not in ("full", "static"):
        raise ValueError(f"page_selection.REFINE_NORMALISER must be 'full' or 'static', got {REFINE_NORMALISER!r}")
    return REFINE_NORMALISER == "static" and sinks + window > 0


def _refined_slots(kern, qb, key, k_start, pages, page, n_keys, top_k, block_start, sinks, window, flag):
    """``_refine`` through the kernels for pages from ``_kernel_page_ids`` (``pages (B, Hkv, NB, n)`` ascending, -1
    after; ``page`` a power of two): the scores come per tile of blocks from ``refine_page_scores`` in page-slot order
    (-inf at a slot that holds no candidate key), whose positions ascend like ``expand_pages``' packed ones, so the
    ``top_k`` slots above -inf (``topk_rows``) are the keys ``most_probable`` chooses: ``(B, Hkv, NB, k)`` int32 slots,
    ascending, -1 after (``select_triton.page_layout`` turns them into key indices)."""
    rows = None if flag is None else flag[:, None, None].expand(pages.shape[:3])
    prob = kern.refine_page_scores(qb, key, pages, page, block_start, n_keys, k_start, sinks, window, rows,
                                   static_norm=_static_norm(sinks, window))
    listed = (pages >= 0).sum(-1) * page  # the slots past a block's listed pages are -inf: not read
    at = kern.topk_rows(prob, min(top_k, prob.shape[-1]), flag=rows, lengths=listed)
    return at if rows is None else torch.where(rows[..., None], at, -1)


def obs_page_scores(qo: torch.Tensor, qo_ok: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, ok: torch.Tensor,
                    cand_pages: torch.Tensor) -> torch.Tensor:
    """Page scores ``(B, Hkv, NB, P)`` of the observation window (``OBS``): for every observation query ``qo (B, Hkv, NB,
    G, O, D)`` (valid where ``qo_ok (B, NB, O)``) and query head, the softmax over the candidate pages (``cand_pages
    (B, 1|Hkv, NB, P)``) of the Quest bound times ``D ** -0.5``, summed over the valid queries and the ``G`` heads."""
    B, H, NB, G, O, D = qo.shape
    bound = _page_bounds(qo.reshape(B, H, NB * G * O, D), kmin, kmax, ok).view(B, H, NB, G, O, -1) * D ** -0.5
    bound = bound.masked_fill(~cand_pages[:, :, :, None, None, :], float("-inf"))
    prob = torch.softmax(bound, -1).nan_to_num(0.0) * qo_ok[:, None, :, None, :, None]
    return prob.sum((3, 4))


def _refine_obs(qo, qo_ok, key, k_start, pages, chosen, page, lo, hi, n_keys, width, top_k, block_start, sinks, window):
    """``_refine`` with the observation window: a preselected key's score is the sum over the valid observation
    queries (position ``b0 - O + 1 + i``) and the KV head's query heads of its attention probability, each query's
    softmax taken over the preselected keys and its causal static keys (sinks, and the block's window keys up to the
    query's own position)."""
    B, H, NB, G, O, D = qo.shape
    W = pages.shape[-1] * page
    pos, _ = expand_pages(pages, chosen, page, lo, hi, n_keys, W)  # (B, H, NB, W)
    ok = pos >= 0
    flat = qo.reshape(B, H, NB, G * O, D)
    logits = _gather_logits(flat, key, k_start, pos, ok).view(B, H, NB, G, O, W)
    spos, sok = static_positions(block_start, hi, n_keys, sinks, window)
    s_logits = _gather_logits(flat, key, k_start, spos[:, None], sok[:, None]).view(B, H, NB, G, O, -1)
    opos = block_start[..., None] - O + 1 + torch.arange(O, device=pos.device)  # (B, NB, O)
    causal = spos[:, :, None, :] <= opos[..., None]  # (B, NB, O, S)
    s_logits = s_logits.masked_fill(~causal[:, None, :, None], float("-inf"))
    lse = torch.logaddexp(torch.logsumexp(s_logits, -1), torch.logsumexp(logits, -1))  # (B, H, NB, G, O)
    prob = torch.exp(logits - lse[..., None]).nan_to_num(0.0) * qo_ok[:, None, :, None, :, None]
    prob = prob.sum((3, 4))  # (B, H, NB, W)
    return most_probable(prob, pos, ok, top_k, width)


def _obs_spec(B, Hq, O, D, dtype):
    return {"oblock": ((B,), torch.int64, -1), "obs": ((B, Hq, O, D), dtype, 0.0), "ovalid": ((B, O), torch.bool, False),
            "ring": ((B, Hq, O, D), dtype, 0.0), "rvalid": ((B, O), torch.bool, False), "ring_end": ((B,), torch.int64, -1)}


def _obs_extended(query, q_pos0, memo, O):
    """The call's queries after the memo's ring of the ``O`` queries before them: ``ext (B, Hq, O + Sq, D)`` (ext
    index ``e`` is position ``q_pos0 - O + e``) and ``ext_ok (B, O + Sq)`` (a query at a position ``>= 0``; ring
    entries only when the ring ends at ``q_pos0``)."""
    B, Hq, Sq, D = query.shape
    q = _compute(query)
    epos = q_pos0[:, None] - O + torch.arange(O + Sq, device=query.device)
    if memo is not None:
        state_buffers(memo, _obs_spec(B, Hq, O, D, q.dtype), query.device)
        match = memo["ring_end"] == q_pos0  # (B,)
        ring = torch.where(match[:, None, None, None], memo["ring"], 0.0)
        rok = memo["rvalid"] & match[:, None]
    else:
        ring = q.new_zeros(B, Hq, O, D)
        rok = torch.zeros(B, O, dtype=torch.bool, device=query.device)
    ext = torch.cat([ring, q], 2)
    ext_ok = torch.cat([rok, torch.ones(B, Sq, dtype=torch.bool, device=query.device)], 1) & (epos >= 0)
    return ext, ext_ok


def _obs_commit_ring(memo, ext, ext_ok, q_pos0, Sq, O):
    """The memo's ring: the last ``O`` entries of ``ext`` (written in place)."""
    memo["ring"].copy_(ext[:, :, Sq:Sq + O].detach())
    memo["rvalid"].copy_(ext_ok[:, Sq:Sq + O])
    memo["ring_end"].copy_(q_pos0 + Sq)


def observe(memo: dict, query: torch.Tensor, geometry) -> None:
    """A decode call that reuses its block's layout (``selectors.build_selection``) still moves the ``OBS`` ring."""
    if OBS <= 0 or memo is None:
        return
    B, _, Sq, _ = query.shape
    q_pos0 = geometry.q_positions(Sq).expand(B, Sq)[:, 0]
    ext, ext_ok = _obs_extended(query, q_pos0, memo, OBS)
    _obs_commit_ring(memo, ext, ext_ok, q_pos0, Sq, OBS)


def _obs_windows(ext, ext_ok, q_pos0, block_start, O):
    """Observation queries ``(B, Hq, NB, O, D)`` and mask ``(B, NB, O)`` of the blocks ``block_start (B, NB)`` from
    ``_obs_extended``'s tensors (entries before the ring: invalid)."""
    B, Hq, E, D = ext.shape
    e = block_start[..., None] - q_pos0[:, None, None] + 1 + torch.arange(O, device=ext.device)  # (B, NB, O)
    inside = (e >= 0) & (e < E)
    ec = e.clamp(0, E - 1)
    NB = block_start.shape[1]
    qo = ext.gather(2, ec.view(B, 1, NB * O, 1).expand(B, Hq, NB * O, D)).view(B, Hq, NB, O, D)
    return qo, inside & ext_ok.gather(1, ec.view(B, NB * O)).view(B, NB, O)


def _obs_prepare(query, q_pos0, block_start, block_ok, first, host, memo, O):
    """``_obs_extended``'s tensors and the first block's observation queries ``(B, Hq, 1, O, D)`` and mask ``(B, 1, O)``:
    a block that started in an earlier call (only a call's first block can) takes the memo's when the memo holds that
    block. Then the memo keeps each row's last block when it starts in this call, and the ring moves on."""
    ext, ext_ok = _obs_extended(query, q_pos0, memo, O)
    qo0, ok0 = _obs_windows(ext, ext_ok, q_pos0, block_start[:, :1], O)
    if memo is None:
        if host is not None and any(qs - ks > 0 for qs, ks, _ in host_rows(host)):
            _warn_memo()
        return ext, ext_ok, qo0, ok0
    need = (block_start[:, 0] < q_pos0) & block_ok[:, 0]
    use = need & (memo["oblock"] == first)
    qo0 = torch.where(use[:, None, None, None, None], memo["obs"][:, :, None], qo0)
    ok0 = torch.where(use[:, None, None], memo["ovalid"][:, None], ok0)
    last = block_ok.sum(-1) - 1
    b_last = block_start.gather(1, last[:, None])
    seen = b_last[:, 0] >= q_pos0
    ql, okl = _obs_windows(ext, ext_ok, q_pos0, b_last, O)
    memo["obs"].copy_(torch.where(seen[:, None, None, None], ql[:, :, 0].detach(), memo["obs"]))
    memo["ovalid"].copy_(torch.where(seen[:, None], okl[:, 0], memo["ovalid"]))
    memo["oblock"].copy_(torch.where(seen, first + last, memo["oblock"]))
    _obs_commit_ring(memo, ext, ext_ok, q_pos0, query.shape[2], O)
    return ext, ext_ok, qo0, ok0

def block_queries(query, q_pos0, block_start, host, query_block, memo, first, block_ok, G):
    """First query of every block ``(B, Hkv, NB, G, D)``; reads and updates ``memo`` (module docstring).

    The memo is a ``block_ring`` of the last few blocks' first queries. Host-known offsets: whether it holds the
    block a call starts inside is checked on the host (its mirror), so nothing reads the device; with device-only
    offsets the memo is applied where it matches, unchecked. When every row's call starts at the same host-known
    position the block queries are a strided slice of ``query`` and the ring is written by slices
    (``_uniform_block_queries``).
    """
    B, Hq, Sq, D = query.shape
    p0 = block_ring.host_starts(host, B)
    values = {"q": ((Hq, D), torch.float64 if query.dtype == torch.float64 else torch.float32)}
    usable = memo is not None and block_ring.prepare(memo, B, query_block, values, first.device)
    if block_ring.host_missing(memo, p0, query_block, usable):
        _warn_memo()
    offsets = None if host is None else {qs - ks for qs, ks, _ in host_rows(host)}
    if Sq > 0 and offsets is not None and len(offsets) == 1 and min(offsets) >= 0:
        qb = _uniform_block_queries(query, min(offsets), query_block, memo)
    else:
        qb = _device_block_queries(query, q_pos0, block_start, query_block, memo, first, block_ok)
    if memo is not None:
        block_ring.host_store(memo, p0, Sq, query_block, fresh=not usable)
    return qb.view(B, Hq // G, G, -1, D).transpose(2, 3)


def _uniform_block_queries(query, p0: int, query_block: int, memo):
    """``block_queries``' ``(B, Hq, NB, D)`` when every row's first query is at position ``p0``: the call's own block
    queries are ``query[:, :, start::query_block]``; a first block that started in an earlier call takes the memo's
    query (else the call's first query)."""
    Sq = query.shape[2]
    start = (-p0) % query_block  # query index of the first block that starts in this call
    qb = _compute(query[:, :, start::query_block])
    if start:
        q0 = _compute(query[:, :, 0])
        if memo is not None:
            found, (q_memo,) = block_ring.lookup(memo, torch.full_like(memo["block"], p0 // query_block), ["q"])
            q0 = torch.where(found[:, None, None], q_memo, q0)
        qb = torch.cat([q0[:, :, None], qb], 2)
    if memo is not None:
        block_ring.store_from_host(memo, p0, Sq, query_block, {"q": qb.transpose(1, 2)})
    return qb


def _device_block_queries(query, q_pos0, block_start, query_block, memo, first, block_ok):
    """``block_queries``' ``(B, Hq, NB, D)`` from device offsets (rows may start at different positions)."""
    B, Hq, Sq, D = query.shape
    qi = block_start - q_pos0[:, None]  # (B, NB) query tensor index of each block's first query
    inside = (qi >= 0) & (qi < Sq)
    g = qi.clamp(0, Sq - 1)[:, None, :, None].expand(B, Hq, qi.shape[1], D)
    qb = _compute(query.gather(2, g))  # (B, Hq, NB, D)
    if memo is not None:  # buffers written in place (sparse_k.selection.step_state: CUDA-graph safe)
        need = ~inside[:, 0] & block_ok[:, 0]  # rows whose first block started in an earlier call
        found, (q_memo,) = block_ring.lookup(memo, first, ["q"])
        qb[:, :, 0] = torch.where((need & found)[:, None, None], q_memo, qb[:, :, 0])
        last = block_ok.sum(-1) - 1  # (B,) each row's last block
        block_ring.store(memo, first, last, inside, {"q": qb.transpose(1, 2)})
    return qb


def _warn_memo():
    warn_once("training-free selection: a call starts inside a query block whose first query was not seen (keep a "
              "selection memo per layer, e.g. with hf_sparse_attention.SparseCache); using the call's first query")


def _kernel_page_ids(kern, qb, kmin, kmax, ok, last, lengths, n_sel: int, flag):
    """The ``n_sel`` best candidate pages of the blocks' first queries ``qb (B, H, C, G, D)`` through the kernels:
    ``(B, H, C, n)`` int32 ascending, ``-1`` after. ``last (B, C)`` int64 each block's last candidate page (-1: none),
    ``lengths (B, H, C)`` int32 ``last + 1``; rows off ``flag (B,)`` choose none."""
    B, H, C = qb.shape[:3]
    rows = None if flag is None else flag[:, None, None].expand(B, H, C)
    scores = kern.page_bound_scores(qb, kmin, kmax, ok, last, rows)  # (B, H, C, P), -inf off the candidates
    pages = kern.topk_rows(scores, min(n_sel, kmin.shape[2]), flag=rows, lengths=lengths)  # ascending, -1 after
    return pages if rows is None else torch.where(rows[..., None], pages, -1)


def _kernel_pages(kern, qb, kmin, kmax, ok, last, lengths, n_sel: int, flag):
    """``_kernel_page_ids`` as int64 pages and ``chosen`` (``top_pages``' form, for the refinements)."""
    pages = _kernel_page_ids(kern, qb, kmin, kmax, ok, last, lengths, n_sel, flag).long()
    return pages, pages >= 0


def _call_tensors(pattern, geometry, host, B: int, Sq: int, Skv: int, Hkv: int, page: int, block_start, block_ok):
    """The geometry-only tensors of a call: ``n_keys (B,)``, ``q_pos0 (B,)`` (first query position), the candidate
    range ``lo, hi (B, NB)``, each block's last candidate page ``last (B, NB)`` int64 (-1: none; a page is a candidate
    when complete) and ``lengths (B, Hkv, NB)`` int32 (``last + 1``: the page top-k's row lengths). With host-known
    offsets every layer of a forward shares them (``layouts.host_memo``; ``block_start, block_ok`` are then the
    call's own, from ``selectors.block_candidates``)."""

    def build():
        n_keys = (geometry.k_end.expand(B) - geometry.k_start.expand(B)).clamp_min(0)
        q_pos0 = geometry.q_positions(Sq).expand(B, Sq)[:, 0]
        lo, hi = pattern.candidate_range(block_start)
        last = torch.where(block_ok, torch.div(hi + 1, page, rounding_mode="floor") - 1, -1)
        lengths = (last + 1)[:, None].expand(B, Hkv, last.shape[1]).to(torch.int32).contiguous()
        return n_keys, q_pos0, lo, hi, last, lengths

    if host is None:
        return build()
    key = ("quest_layout", type(pattern), pattern.query_block, pattern.sinks, pattern.window,
           tuple(tuple(x) for x in host), B, Sq, Skv, block_start.shape[1], Hkv, page)
    return host_memo(key, block_start.device, build)


def quest_layout(pattern, query, key, geometry, host, first, block_start, block_ok, width, span, *, memo=None,
                 page: int | None = None, summaries=None, flag: torch.Tensor | None = None):
    """The training-free selection of one call as a ``TokenLayout`` (module docstring).

    ``query (B, Hq, Sq, D)``, ``key (B, Hkv, Skv, D)``; ``first, block_start, block_ok`` from
    ``selectors.selection_blocks``; ``width`` the layout's ``K``; ``span`` one past the last key
    index any block can select; ``memo`` a per-layer dict for decoding (or None); ``summaries``: the
    ``page_summaries`` ``(kmin, kmax, ok)`` of at least the pages below ``span`` when the caller keeps them
    (``sparse_k.selection.selection_state``), else computed here. ``flag (B,)`` bool: the rows whose selection the
    caller uses (None: all); with the kernels (``row_kernels``) the other rows' page scores and top-k are skipped
    and they select no page (their layout is meaningless: the caller replaces it).
    """
    from ..layouts.token_layout import TokenLayout

    B, Hq, Sq = query.shape[:3]
    Hkv = key.shape[1]
    page = page_size(pattern, page)
    NB = block_start.shape[1]
    k_start = geometry.k_start.expand(B)
    n_keys, q_pos0, lo, hi, last, lengths = _call_tensors(pattern, geometry, host, B, Sq, key.shape[2], Hkv, page,
                                                          block_start, block_ok)
    aligned = host is not None and all(x == 0 for x in host[1])
    n_pages = max(1, -(-span // page))
    if summaries is None:
        kmin, kmax, ok = page_summaries(key, k_start, geometry.k_end.expand(B), page, pattern.sinks, n_pages,
                                        aligned=aligned)
    else:
        kmin, kmax, ok = (t[:, :, :n_pages] for t in summaries)
    G, D, O = Hq // Hkv, key.shape[-1], max(0, OBS)
    if O:
        ext, ext_ok, qo0, ok0 = _obs_prepare(query, q_pos0, block_start, block_ok, first, host, memo, O)
    else:
        qb = block_queries(query, q_pos0, block_start, host, pattern.query_block, memo, first, block_ok, G)
    limit = CHUNK_ELEMENTS_CUDA if key.is_cuda else CHUNK_ELEMENTS
    per_q = G * max(1, O)  # query vectors scored per block and KV head
    step = max(1, limit // max(1, B * Hkv * n_pages * per_q))  # blocks per chunk: bounded score memory
    refine = getattr(pattern, "refine", 0) or REFINE
    n_pre = refine * (pattern.top_k // page) if refine > 0 else 0
    kern = row_kernels(kmin) if HEAD_REDUCE == "sum" and not O else None
    if n_pre:  # the refinement's temporaries: gathered key vectors (PyTorch) or a few lists of the preselected keys
        step = max(1, min(step, limit // max(1, B * Hkv * n_pre * page * (REFINE_LIST_ENTRIES if kern else D))))
        if O:
            step = max(1, min(step, limit // max(1, B * Hkv * per_q * (n_pre * page + pattern.sinks + pattern.window))))
    if kern is not None and page & (page - 1) == 0:  # pages (and their refinement) to the layout in kernels
        return _kernel_page_layout(kern, pattern, qb, key, query.dtype, kmin, kmax, ok, last, lengths, lo, hi,
                                   block_start, block_ok, n_keys, k_start, page, width, step, n_pre, first, flag)
    p_idx = torch.arange(n_pages, device=key.device)
    indices = torch.empty((B, Hkv, NB, width), dtype=torch.int32, device=key.device)
    counts = torch.empty((B, Hkv, NB), dtype=torch.int32, device=key.device)
    for c0 in range(0, NB, step):  # host-known sizes: no device read
        c1 = min(NB, c0 + step)
        bs, bo = block_start[:, c0:c1], block_ok[:, c0:c1]
        if kern is not None:
            pages, chosen = _kernel_pages(kern, qb[:, :, c0:c1], kmin, kmax, ok, last[:, c0:c1],
                                          lengths[:, :, c0:c1], n_pre or pattern.top_k // page, flag)
            if n_pre:
                pos_c, cnt_c = _refine(qb[:, :, c0:c1], key, k_start, pages, chosen, page, lo[:, c0:c1], hi[:, c0:c1],
                                       n_keys, width, pattern.top_k, bs, pattern.sinks, pattern.window, flag)
            else:
                pos_c, cnt_c = expand_pages(pages, chosen, page, lo[:, c0:c1], hi[:, c0:c1], n_keys, width)
            _finish_chunk(indices[:, :, c0:c1], counts[:, :, c0:c1], pos_c, cnt_c, lo[:, c0:c1], hi[:, c0:c1], bo,
                          n_keys, k_start, pattern.top_k)
            continue
        cand_pages = ok[:, :, None, :] & ((p_idx + 1) * page - 1 <= hi[:, None, c0:c1, None]) & bo[:, None, :, None]
        if O:
            qo, qo_ok = _obs_windows(ext, ext_ok, q_pos0, bs, O)  # (B, Hq, c, O, D), (B, c, O)
            if c0 == 0:
                qo = torch.cat([qo0, qo[:, :, 1:]], 2)
                qo_ok = torch.cat([ok0, qo_ok[:, 1:]], 1)
            qo = qo.view(B, Hkv, G, c1 - c0, O, D).transpose(2, 3)
            qo_ok = qo_ok & bo[..., None]
            scores = obs_page_scores(qo, qo_ok, kmin, kmax, ok, cand_pages)
        else:
            scores = quest_scores(qb[:, :, c0:c1], kmin, kmax, ok, cand_pages)  # (B, Hkv, c1 - c0, P)
        if n_pre and O:
            pages, chosen = top_pages(scores, cand_pages, n_pre)
            pos_c, cnt_c = _refine_obs(qo, qo_ok, key, k_start, pages, chosen, page, lo[:, c0:c1], hi[:, c0:c1],
                                       n_keys, width, pattern.top_k, bs, pattern.sinks, pattern.window)
        elif n_pre:
            pages, chosen = top_pages(scores, cand_pages, n_pre)
            pos_c, cnt_c = _refine(qb[:, :, c0:c1], key, k_start, pages, chosen, page, lo[:, c0:c1], hi[:, c0:c1],
                                   n_keys, width, pattern.top_k, bs, pattern.sinks, pattern.window)
        else:
            pages, chosen = top_pages(scores, cand_pages, pattern.top_k // page)
            pos_c, cnt_c = expand_pages(pages, chosen, page, lo[:, c0:c1], hi[:, c0:c1], n_keys, width)
        _finish_chunk(indices[:, :, c0:c1], counts[:, :, c0:c1], pos_c, cnt_c, lo[:, c0:c1], hi[:, c0:c1], bo, n_keys,
                      k_start, pattern.top_k)
    return TokenLayout(indices=indices, counts=counts, query_block=pattern.query_block, first_block=first, weights=None)


def _kernel_page_layout(kern, pattern, qb, key, query_dtype, kmin, kmax, ok, last, lengths, lo, hi, block_start,
                        block_ok, n_keys, k_start, page: int, width: int, step: int, n_pre: int, first, flag):
    """``quest_layout`` through the kernels (pages of a power of two): page bounds, page top-k, with ``n_pre`` the
    refinement's slots (``_refined_slots``), and the chosen keys packed into the layout (``select_triton.page_layout``),
    chunk by chunk of ``step`` blocks (one chunk: the kernel's outputs are the layout)."""
    from ..layouts.token_layout import TokenLayout

    B, H, NB = qb.shape[:3]
    indices = counts = None
    for c0 in range(0, NB, step):  # host-known sizes: no device read
        c1 = min(NB, c0 + step)
        pages = _kernel_page_ids(kern, qb[:, :, c0:c1], kmin, kmax, ok, last[:, c0:c1], lengths[:, :, c0:c1],
                                 n_pre or pattern.top_k // page, flag)
        slots = None
        if n_pre:
            qk = qb[:, :, c0:c1].to(query_dtype) if query_dtype == key.dtype else qb[:, :, c0:c1]  # exact: queries
            slots = _refined_slots(kern, qk, key, k_start, pages, page, n_keys, pattern.top_k, block_start[:, c0:c1],
                                   pattern.sinks, pattern.window, flag)
        idx, cnt = kern.page_layout(pages, page, lo[:, c0:c1], hi[:, c0:c1], block_ok[:, c0:c1], n_keys, k_start,
                                    pattern.top_k, width, slots=slots)
        if c1 - c0 == NB:
            indices, counts = idx, cnt
            break
        if indices is None:
            indices = torch.empty((B, H, NB, width), dtype=torch.int32, device=qb.device)
            counts = torch.empty((B, H, NB), dtype=torch.int32, device=qb.device)
        indices[:, :, c0:c1].copy_(idx)
        counts[:, :, c0:c1].copy_(cnt)
    return TokenLayout(indices=indices, counts=counts, query_block=pattern.query_block, first_block=first, weights=None)


def _finish_chunk(indices, counts, pos, cnt, lo, hi, block_ok, n_keys, k_start, top_k: int) -> None:
    """Write a chunk of blocks' layout: ``indices (B, Hkv, C, width)`` int32 key tensor indices (-1 past the count) and
    ``counts (B, Hkv, C)`` int32 (views into the whole layout), from the chosen candidate positions ``pos (B, Hkv, C,
    width)`` ascending (-1 after) and ``cnt (B, Hkv, C)``; a block with at most ``top_k`` candidates in ``[lo, hi]``
    ``(B, C)`` takes all of them. Chunk by chunk, so no temporary spans every block (the layout of a per-query
    selection at 128K is gigabytes)."""
    width = indices.shape[-1]
    n_cand = (torch.minimum(hi, n_keys[:, None] - 1) - lo + 1).clamp_min(0) * block_ok  # (B, C)
    all_pos = lo[..., None] + torch.arange(width, device=lo.device)  # (B, C, width)
    all_ok = torch.arange(width, device=lo.device) < n_cand[..., None]
    take_all = (n_cand <= top_k)[:, None, :, None]
    pos = torch.where(take_all, torch.where(all_ok, all_pos, -1)[:, None], pos)
    indices.copy_(torch.where(pos >= 0, pos + k_start[:, None, None, None], -1))
    counts.copy_(torch.where(take_all[..., 0], n_cand[:, None], cnt))
