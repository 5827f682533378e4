"""The selection's per-row work in Triton, skipped for rows whose flag is off: top-k and page-bound scores.

A compiled decode step (CUDA graphs) replays the same kernels every step, but a learned selection only
changes at a query block's first step (``selection_state``). These kernels take a per-row device flag
``flag (R,)`` (bool; None: every row) and return at once in a row whose flag is off, leaving its output
unwritten (the caller keeps that row's previous selection with ``torch.where``): the step launches the
same kernels every time and they cost nothing inside a block. No host read.

* ``topk_rows(x (..., n), k, mask=None, flag=None, lengths=None) -> (..., k)`` int32: for every row, the indices of
  the top-``k`` set that ``page_selection.top_mask`` returns (ties to the earlier index) among the
  *valid* entries (``mask``, or without one the entries above ``-inf``), ascending, ``-1`` after them:
  ``front_pack(top_mask(where(valid, x, -inf), k) & valid, k, arange(n), -1)`` exactly. One program per
  row: a radix select over the order-preserving integer image of the float32 scores (four passes of
  8-bit digits, ``tl.histogram``) finds the ``k``-th largest key ``T`` and how many entries equal to
  ``T`` are taken (the earliest ones); a last pass writes the chosen indices in index order (a scan). A row
  within one chunk (``block``; by default up to ``TOPK_ONE_CHUNK_MAX`` entries) is read once into registers, a
  longer one chunk by chunk in every pass;
  ``lengths`` cuts rows short (a causal row's tail of ``-inf`` is then never read).
* ``page_bound_scores(q (B, H, C, G, D), kmin, kmax (B, H, P, D), ok (B, 1, P), last (B, C), flag)
  -> (B, H, C, P)`` float32: the training-free default's page score (``page_selection.quest_scores``,
  ``HEAD_REDUCE = "sum"``) ``sum_g relu(q_g) . kmax + min(q_g, 0) . kmin`` of the candidate pages
  (``ok`` and ``p <= last``), ``-inf`` elsewhere, as ``(sum_g relu(q_g)) . kmax + (sum_g min(q_g, 0)) . kmin``:
  two ``tl.dot`` of a tile of ``PAGE_BOUND_ROWS`` blocks with ``BLOCK_P`` pages on the tensor cores in TF32x3 (about
  float32's rounding); a program keeps its blocks' query sums for a run of page tiles and writes the tiles past its
  blocks' last candidate page as ``-inf`` without reading them. The sums round differently from the PyTorch GEMM,
  which is why a GPU computes every call of a generation (prefill included) with these kernels; a block's row of the
  MMA depends only on its own query, so decode (one block) equals recompute bit for bit.
* ``index_scores(q (B, T, H, d), w (B, T, H), ik (B, S, G * d), cand (B, T, S), flag) -> (B, T, G, S)``
  float32: the DSA indexer scores (``LightningIndexer.scores``) ``sum_h w_h relu(q_h . k / sqrt(d))``
  over the ``H / G`` indexer heads of each of ``G`` key groups (``G = 1``: a shared indexer; ``G = Hkv``
  per KV head), ``-inf`` off the candidates. One program per (row, tile of keys).
* ``refine_scores(q (B, H, C, G, D), key (B, H, S, D), idx, ok (B, 1|H, C, W), sidx, sok (B, 1|H, C, Ws))
  -> (B, H, C, W)`` float32: the refinement score of ``page_selection.refine_probabilities``, each preselected
  key's share of the softmax of the block query over its static keys (``sidx``) and the preselected keys (``idx``),
  per query head, summed over the ``G`` heads; 0 where ``ok`` is False. A row's preselected keys are split over
  programs of ``REFINE_SPLIT`` keys: a first kernel keeps each query head's running max and sum of ``exp`` over a
  split (the first split also over the static keys), a second combines the row's splits into the log-normaliser and
  writes the probabilities of its split. The keys are read where they lie (any float dtype, any strides:
  Transformers' views), in tiles of ``BLOCK_N`` gathered rows; float32 products and sums (no ``tl.dot``). Used for
  lists that are not pages (a trained SparseK pool).
* ``refine_page_scores(q (B, H, C, G, D), key, pages (B, H, C, n), page, block_start (B, C), n_keys, k_start (B,),
  sinks, window) -> (B, H, C, n * page)`` float32: the same score for the training-free selection, whose pools are
  pages and whose static keys are the sinks and the window, in page-slot order. A program takes a tile of
  ``PAGE_REFINE_ROWS // G`` consecutive blocks of one KV head and a split of ``PAGE_REFINE_SPLIT`` key positions, and
  walks the split's key tiles that any of its blocks reads (sinks, window, or a listed page: a pointer per block into
  its ascending page list; from one such tile it jumps to the next), scoring each against all the tile's queries
  with one ``tl.dot`` (the keys are read once per tile of blocks instead of once per block); a first kernel keeps
  the running max and sum, a second merges the splits in order and writes the probabilities (-inf at a slot that
  holds no candidate key, so ``topk_rows`` needs no mask). Both take ``static_norm``: the normaliser over the static
  keys alone (``page_selection.REFINE_NORMALISER``), when the first kernel walks the sinks and window only. Products
  in the keys' half precision when the queries have it (exact), else TF32x3 (about float32); sums in float32; a
  block's arithmetic does not depend on the other blocks of its tile, so decode equals recompute.

* ``page_summaries(key (B, H, S, D), k_start, k_end, page, sinks, n_pages) -> kmin, kmax (B, H, n_pages, D), ok
  (B, 1, n_pages)``: ``page_selection.page_summaries`` (the channel-wise min / max of each page's valid keys) in one
  launch, reading the keys where they lie (any float dtype, any strides). Exact.
* ``page_layout(pages (B, H, C, n), page, lo, hi, block_ok (B, C), n_keys, k_start, top_k, width) -> indices (B, H, C,
  width), counts (B, H, C)`` int32: the token layout of the chosen pages (``page_selection.expand_pages`` and
  ``_finish_chunk``: a block with at most ``top_k`` candidates takes all of them, else the keys of its pages inside
  its candidate range, packed in order; with ``slots``, the refinement's chosen page slots). One program a row. Exact.

Each launcher is a ``torch.library`` custom op (``sparse_k::select_topk``, ``sparse_k::page_bound_scores``,
``sparse_k::index_scores``, ``sparse_k::refine_scores``, ``sparse_k::refine_page_scores``, ``sparse_k::page_summaries``,
``sparse_k::page_layout``) with a fake, so ``torch.compile`` traces it as one opaque call; an eager call on real
tensors runs the implementation directly (``_launch``: the op's dispatch costs more host time than the launch). Output
buffers come from ``_empty`` (uninitialised; the tests poison it). Runs on CUDA, or on the CPU under
``TRITON_INTERPRET=1`` (float32 arithmetic only, which the interpreter computes exactly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from .._ops import add_op_namespace_prefix
from ..layouts.patterns import _check_bool

__all__ = ["index_scores", "page_bound_scores", "page_layout", "page_summaries", "refine_page_scores", "refine_scores",
           "topk_rows"]


#: Preselected keys per program of ``refine_scores`` (a row's keys are split over ``cdiv(W, REFINE_SPLIT)`` programs, so
#: a decode step, one row per KV head, still fills the GPU; a function of ``W`` alone, so a row's arithmetic is the same
#: in prefill and decode). A multiple of the tile sizes (``block_n``).
REFINE_SPLIT = 512

#: ``refine_page_scores``: key positions per program (a split; absolute ranges, so a block sums its keys in the same
#: order in prefill and decode), keys per tile (at least a page), and MMA rows per tile (blocks x query heads).
PAGE_REFINE_SPLIT = 2048
PAGE_REFINE_BLOCK_N = 32
PAGE_REFINE_ROWS = 64

#: ``topk_rows``: rows up to this many entries are read once into registers (one program a row), longer ones in chunks
#: of 1,024 (8 warps either way up to 4,096 entries; 16 above). The kernel takes up to 8,192 in one chunk (``block=``),
#: but at the page top-k's 8,192 pages (128K per-query prefill) that is slower on an H100 than the chunks (one 16-warp
#: program a multiprocessor; ``scripts/bench_page_stage.py --topk-block 8192``, docs/selection.md), so rows past 1,024
#: go in chunks.
TOPK_ONE_CHUNK_MAX = 1024
TOPK_BLOCK_MAX = 8192

#: ``page_bound_scores``: blocks per program (the rows of its MMA tile; a decode step's one block pads it), its warps,
#: and about how many programs a launch has: a program takes a run of page tiles (its queries loaded once) when there
#: are enough tiles of blocks to fill the GPU, one page tile when there are few (a decode step). A row's arithmetic is
#: that of its MMA tile alone, whatever the run, so decode equals recompute (a decode step's one block pads the same
#: tile). 64 rows and 8 warps read the page summaries a quarter as often as 16 rows and take 128 KB of shared memory a
#: program; the fastest of the tiles ``scripts/bench_page_stage.py`` sweeps on an H100 (docs/selection.md).
PAGE_BOUND_ROWS = 64
PAGE_BOUND_WARPS = 8
PAGE_BOUND_PROGRAMS = 2048

#: ``page_summaries``: pages per program.
PAGE_SUMMARY_PAGES = 16


@triton.jit
def _ordered(x):
    """Order-preserving image of float32 ``x`` as int64 in ``[0, 2**32)`` (``-0.0`` and ``+0.0`` equal; the key
    of ``page_selection.top_indices`` plus ``2**31``)."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where(b == -2147483648, 0, b)  # -0.0 -> +0.0
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return b.to(tl.int64) + 2147483648


@triton.jit
def _row_keys(x_row, m_row, idx, n, HAS_MASK: tl.constexpr):
    """Chunk ``idx`` of a row: the ordered keys (invalid entries at the key of ``-inf``), validity, in-bounds."""
    inb = idx < n
    x = tl.load(x_row + idx, mask=inb, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        valid = inb & (tl.load(m_row + idx, mask=inb, other=0) != 0)
    else:
        valid = inb & (x > float("-inf"))
    return _ordered(tl.where(valid, x, float("-inf"))), valid, inb


@triton.jit
def _next_digit(hist, need, prefix, bins):
    """One radix step: the digit of the ``need``-th largest among the entries matching ``prefix`` (``hist (256,)``
    their digit counts), the entries still to take below it, and the longer prefix."""
    ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # (256,) matching entries with digit >= bin
    digit = tl.max(tl.where(ge >= need, bins, 0), 0)
    need -= tl.sum(tl.where(bins > digit, hist, 0), 0)
    return need, (prefix << 8) | digit.to(tl.int64)


@triton.jit
def _topk_kernel(X, M, FLAG, LEN, OUT, n, k, stride_x, stride_m, stride_o,
                 HAS_MASK: tl.constexpr, HAS_FLAG: tl.constexpr, HAS_LEN: tl.constexpr, ONE_CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if HAS_FLAG:
        if tl.load(FLAG + row) == 0:
            return
    x_row = X + row * stride_x
    m_row = M + row * stride_m
    o_row = OUT + row * stride_o
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    zero = tl.program_id(0) * 0
    n_row = zero + n
    if HAS_LEN:  # the row's entries past its length are not read (as if absent)
        n_row = tl.minimum(n_row, tl.maximum(tl.load(LEN + row).to(tl.int32), 0))
    k_eff = tl.minimum(zero + k, n_row)  # the top-k set over every entry (invalid ones at -inf), as top_mask
    need = k_eff  # entries still to take among those matching the prefix
    prefix = zero.to(tl.int64)  # the high digits of T found so far
    if ONE_CHUNK:  # the whole row in registers: one read
        key1, valid1, inb1 = _row_keys(x_row, m_row, offs, n_row, HAS_MASK)
        for p in tl.static_range(4):  # 8-bit digits, most significant first
            shift = 24 - 8 * p
            match = inb1 & ((key1 >> (shift + 8)) == prefix)
            hist = tl.histogram(((key1 >> shift) & 255).to(tl.int32), 256, mask=match)
            need, prefix = _next_digit(hist, need, prefix, bins)
        eq = inb1 & (key1 == prefix)
        sel = (inb1 & (key1 > prefix)) | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
        put = sel & valid1
        tl.store(o_row + tl.cumsum(put.to(tl.int32), 0) - 1, offs, mask=put)
        written = tl.sum(put.to(tl.int32), 0)
    else:
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.zeros([256], tl.int32)
            for start in range(0, n_row, BLOCK):
                key, valid, inb = _row_keys(x_row, m_row, start + offs, n_row, HAS_MASK)
                match = inb & ((key >> (shift + 8)) == prefix)
                hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
            need, prefix = _next_digit(hist, need, prefix, bins)
        # Every key > T is taken, and the first `need` keys == T (ties to the earlier index); only valid ones are written.
        taken = zero
        written = zero
        eq_seen = zero
        start = zero
        while (start < n_row) & (taken < k_eff):
            idx = start + offs
            key, valid, inb = _row_keys(x_row, m_row, idx, n_row, HAS_MASK)
            eq = inb & (key == prefix)
            sel = (inb & (key > prefix)) | (eq & (eq_seen + tl.cumsum(eq.to(tl.int32), 0) <= need))
            put = sel & valid
            pos = written + tl.cumsum(put.to(tl.int32), 0) - 1
            tl.store(o_row + pos, idx, mask=put)
            written += tl.sum(put.to(tl.int32), 0)
            taken += tl.sum(sel.to(tl.int32), 0)
            eq_seen += tl.sum(eq.to(tl.int32), 0)
            start += BLOCK
    ko = tl.arange(0, BLOCK_K)
    for s in range(0, k, BLOCK_K):
        j = s + ko
        tl.store(o_row + j, tl.full([BLOCK_K], -1, tl.int32), mask=(j >= written) & (j < k))


@triton.jit
def _row_bhc(row, H, C):
    """``(b, h, c)`` of a program's row ``(b * H + h) * C + c``."""
    return row // C // H, row // C % H, row % C


@triton.jit
def _block_tile(FLAG, H, C, HAS_FLAG: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr):
    """A program's tile of ``BLOCK_C`` consecutive blocks of one ``(b, h)`` (program id 0 over ``B * H *
    cdiv(C, BLOCK_C)``): ``b, h``, the first block ``c0``, and per row ``c * BLOCK_G + g`` (``BLOCK_G`` rows a block,
    vectors of ``BLOCK_C * BLOCK_G`` made from the row index itself: no layout conversion where they meet MMA rows)
    its block ``cc``, the block's row ``(b * H + h) * C + cc`` and whether the block is computed (inside ``C``, flag
    on)."""
    n_ct = tl.cdiv(C, BLOCK_C)
    tile = tl.program_id(0).to(tl.int64)
    b, h, c0 = tile // n_ct // H, tile // n_ct % H, tile % n_ct * BLOCK_C
    if BLOCK_G == 1:
        cc = c0 + tl.arange(0, BLOCK_C)
    else:
        cc = c0 + tl.arange(0, BLOCK_C * BLOCK_G) // BLOCK_G
    rows = (b * H + h) * C + cc
    live = cc < C
    if HAS_FLAG:
        live = live & (tl.load(FLAG + rows, mask=live, other=0) != 0)
    return b, h, c0, cc, rows, live


@triton.jit
def _page_bound_kernel(Q, KMIN, KMAX, OK, LAST, FLAG, OUT, H, C, G, D, P, TILES,
                       sq_b, sq_h, sq_c, sq_g, sk_b, sk_h, sk_p, sok_b, sl_b, so_r,
                       HAS_FLAG: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    b, h, _, cc, rows, live = _block_tile(FLAG, H, C, HAS_FLAG, BLOCK_C, 1)
    if HAS_FLAG:
        if tl.max(live.to(tl.int32)) == 0:
            return
    d = tl.arange(0, BLOCK_D)
    din = d < D
    q_pos = tl.zeros([BLOCK_C, BLOCK_D], tl.float32)  # sum_g relu(q_g): the bound sums over the heads
    q_neg = tl.zeros([BLOCK_C, BLOCK_D], tl.float32)  # sum_g min(q_g, 0)
    q_rows = Q + b * sq_b + h * sq_h + cc[:, None] * sq_c + d[None, :]
    for g in range(0, G):
        q = tl.load(q_rows + g * sq_g, mask=live[:, None] & din[None, :], other=0.0)
        q_pos += tl.maximum(q, 0.0)
        q_neg += tl.minimum(q, 0.0)
    last = tl.load(LAST + b * sl_b + cc, mask=live, other=-1)
    top = tl.max(last, 0)  # the tile's last candidate page: tiles past it are -inf without a read or a product
    o_rows = OUT + rows[:, None] * so_r
    for t in range(0, TILES):  # a run of TILES page tiles: the queries are loaded once for all of them
        p0 = (tl.program_id(1).to(tl.int64) * TILES + t) * BLOCK_P
        p = p0 + tl.arange(0, BLOCK_P)
        pin = p < P
        if p0 <= top:
            page_ok = pin & (tl.load(OK + b * sok_b + p, mask=pin, other=0) != 0)  # (BLOCK_P,)
            koff = b * sk_b + h * sk_h + p[:, None] * sk_p + d[None, :]
            kmask = page_ok[:, None] & din[None, :]
            kmax = tl.load(KMAX + koff, mask=kmask, other=0.0)  # (BLOCK_P, BLOCK_D)
            kmin = tl.load(KMIN + koff, mask=kmask, other=0.0)
            acc = tl.dot(q_pos, tl.trans(kmax), input_precision="tf32x3")
            acc = tl.dot(q_neg, tl.trans(kmin), acc, input_precision="tf32x3")
            cand = page_ok[None, :] & (p[None, :] <= last[:, None])
            tl.store(o_rows + p[None, :], tl.where(cand, acc, float("-inf")), mask=live[:, None] & pin[None, :])
        else:
            tl.store(o_rows + p[None, :], tl.full([BLOCK_C, BLOCK_P], float("-inf"), tl.float32),
                     mask=live[:, None] & pin[None, :])


@triton.jit
def _index_score_kernel(Q, W, IK, CAND, FLAG, OUT, T, G, HG, S, DI, scale,
                        sq_b, sq_t, sq_h, sw_b, sw_t, sk_b, sk_s, sc_b, sc_t, so_r,
                        HAS_FLAG: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (b * T + t) * G + g
    if HAS_FLAG:
        if tl.load(FLAG + row) == 0:
            return
    g = row % G
    t = row // G % T
    b = row // G // T
    s = tl.program_id(1).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sin = s < S
    din = d < DI
    cand = sin & (tl.load(CAND + b * sc_b + t * sc_t + s, mask=sin, other=0) != 0)
    k = tl.load(IK + b * sk_b + s[:, None] * sk_s + g * DI + d[None, :], mask=cand[:, None] & din[None, :], other=0.0)
    acc = tl.zeros([BLOCK_S], tl.float32)
    for i in range(0, HG):
        h = g * HG + i
        q = tl.load(Q + b * sq_b + t * sq_t + h * sq_h + d, mask=din, other=0.0)  # (BLOCK_D,)
        wh = tl.load(W + b * sw_b + t * sw_t + h)
        acc += wh * tl.maximum(tl.sum(k * q[None, :], 1) * scale, 0.0)
    tl.store(OUT + row * so_r + s, tl.where(cand, acc, float("-inf")), mask=sin)


@triton.jit
def _refine_logits(q, K_row, I_row, OK_row, start, n, sk_s, d, din, scale, BLOCK_N: tl.constexpr):
    """Logits ``(BLOCK_G, BLOCK_N)`` of the row's queries ``q (BLOCK_G, BLOCK_D)`` with the keys listed at ``[start, start
    + BLOCK_N)`` (tensor indices ``I_row``, valid where ``OK_row``), ``-inf`` off the valid ones; and that validity.
    Float32 products summed over the head dimension (no ``tl.dot``: the few query heads of a KV head would pad an MMA
    tile, and float32 ``tl.dot`` rounds through TF32)."""
    j = start + tl.arange(0, BLOCK_N)
    jin = j < n
    valid = jin & (tl.load(OK_row + j, mask=jin, other=0) != 0)
    ki = tl.load(I_row + j, mask=valid, other=0).to(tl.int64)
    k = tl.load(K_row + ki[:, None] * sk_s + d[None, :], mask=valid[:, None] & din[None, :], other=0.0).to(tl.float32)
    logits = tl.sum(q[:, None, :] * k[None, :, :], 2) * scale
    return tl.where(valid[None, :], logits, float("-inf")), valid


@triton.jit
def _online_lse(m, l, logits):
    """Running max ``m`` and sum ``l`` (``(BLOCK_G,)``) of ``exp`` over the tiles of ``logits`` seen so far."""
    m_new = tl.maximum(m, tl.max(logits, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(logits - m_safe[:, None]), 1)
    return m_new, l


@triton.jit
def _refine_split(Q, K, IDX, OK, H, C, G, D, W, sq_b, sq_h, sq_c, sq_g, sk_b, sk_h, si_b, si_h, si_c,
                  SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """What a refinement program ``(row, split)`` reads: its row ``(b * H + h) * C + c`` and ``(b, h, c)``, its
    ``(BLOCK_G, BLOCK_D)`` block queries, the head-dimension offsets and mask, the row's keys, preselected-key list and
    validity, and the split's preselected-key range ``[lo, hi)``."""
    row = tl.program_id(0).to(tl.int64)
    b, h, c = _row_bhc(row, H, C)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b * sq_b + h * sq_h + c * sq_c + g[:, None] * sq_g + d[None, :], mask=(g < G)[:, None] & (d < D)[None, :],
                other=0.0)
    lo = tl.program_id(1) * SPLIT
    lists = b * si_b + h * si_h + c * si_c
    return row, b, h, c, q, d, d < D, K + b * sk_b + h * sk_h, IDX + lists, OK + lists, lo, tl.minimum(W, lo + SPLIT)


@triton.jit
def _refine_partial_kernel(Q, K, IDX, OK, SIDX, SOK, FLAG, PM, PL, H, C, G, D, W, WS, NS, scale,
                           sq_b, sq_h, sq_c, sq_g, sk_b, sk_h, sk_s, si_b, si_h, si_c, ss_b, ss_h, ss_c,
                           HAS_FLAG: tl.constexpr, SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, STATIC_NORM: tl.constexpr):
    """Split ``s`` of a row: the running max and sum of ``exp(logit)`` per query head over the preselected keys
    ``[s * SPLIT, (s + 1) * SPLIT)`` (split 0: and the static keys; ``STATIC_NORM``: the static keys alone), into
    ``PM, PL (R, NS, BLOCK_G)``."""
    row, b, h, c, q, d, din, K_row, I_row, OK_row, lo, hi = _refine_split(
        Q, K, IDX, OK, H, C, G, D, W, sq_b, sq_h, sq_c, sq_g, sk_b, sk_h, si_b, si_h, si_c, SPLIT, BLOCK_G, BLOCK_D)
    if HAS_FLAG:  # a row the caller keeps: nothing to compute (its queries were read for nothing)
        if tl.load(FLAG + row) == 0:
            return
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    if lo == 0:
        statics = b * ss_b + h * ss_h + c * ss_c
        for start in range(0, WS, BLOCK_N):
            logits, _ = _refine_logits(q, K_row, SIDX + statics, SOK + statics, start, WS, sk_s, d, din, scale, BLOCK_N)
            m, l = _online_lse(m, l, logits)
    if not STATIC_NORM:
        for start in range(lo, hi, BLOCK_N):
            logits, _ = _refine_logits(q, K_row, I_row, OK_row, start, hi, sk_s, d, din, scale, BLOCK_N)
            m, l = _online_lse(m, l, logits)
    part = (row * NS + tl.program_id(1)) * BLOCK_G + tl.arange(0, BLOCK_G)
    tl.store(PM + part, m)
    tl.store(PL + part, l)


@triton.jit
def _refine_prob_kernel(Q, K, IDX, OK, FLAG, PM, PL, OUT, H, C, G, D, W, NS, scale,
                        sq_b, sq_h, sq_c, sq_g, sk_b, sk_h, sk_s, si_b, si_h, si_c, so_r,
                        HAS_FLAG: tl.constexpr, SPLIT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Split ``s`` of a row: the log-normaliser of every query head from the row's partials, then the summed
    probabilities of the preselected keys ``[s * SPLIT, (s + 1) * SPLIT)``."""
    row, b, h, c, q, d, din, K_row, I_row, OK_row, lo, hi = _refine_split(
        Q, K, IDX, OK, H, C, G, D, W, sq_b, sq_h, sq_c, sq_g, sk_b, sk_h, si_b, si_h, si_c, SPLIT, BLOCK_G, BLOCK_D)
    if HAS_FLAG:  # a row the caller keeps: nothing to compute (its queries were read for nothing)
        if tl.load(FLAG + row) == 0:
            return
    si = tl.arange(0, BLOCK_S)
    g = tl.arange(0, BLOCK_G)
    part = (row * NS + si[:, None]) * BLOCK_G + g[None, :]
    pm = tl.load(PM + part, mask=(si < NS)[:, None], other=float("-inf"))  # (BLOCK_S, BLOCK_G)
    pl = tl.load(PL + part, mask=(si < NS)[:, None], other=0.0)
    m = tl.max(pm, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(pl * tl.exp(pm - m_safe[None, :]), 0)
    lse = tl.where((l > 0) & (g < G), m + tl.log(l), float("-inf"))
    o_row = OUT + row * so_r
    for start in range(lo, hi, BLOCK_N):
        logits, valid = _refine_logits(q, K_row, I_row, OK_row, start, hi, sk_s, d, din, scale, BLOCK_N)
        live = (lse > float("-inf"))[:, None] & valid[None, :]
        p = tl.where(live, tl.exp(logits - tl.where(live, lse[:, None], 0.0)), 0.0)
        j = start + tl.arange(0, BLOCK_N)
        tl.store(o_row + j, tl.sum(p, 0), mask=j < hi)


@triton.jit
def _load_rows(ptr, row_ok, d, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The tile ``ptr (R, BLOCK_D)`` where ``row_ok (R,)`` and the column ``d < D``, else 0. When ``D == BLOCK_D`` the
    mask is constant along the head dimension, so the loads vectorise (16 bytes a thread instead of one element)."""
    if D == BLOCK_D:
        return tl.load(ptr, mask=row_ok[:, None], other=0.0)
    return tl.load(ptr, mask=row_ok[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _page_tile(Q, PAGES, BS, NK, FLAG, H, C, G, NPG, sq_b, sq_h, sq_c, sq_g, window, lo,
               HAS_FLAG: tl.constexpr, PAGE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr,
               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, POOL: tl.constexpr = True):
    """What a program ``(tile, split)`` of ``refine_page_scores`` reads, per MMA row ``c * BLOCK_G + g`` (block ``c``
    of the tile, query head ``g``): ``b, h``, the rows' block rows ``(b * H + h) * C + c``, whether the block is
    computed (in the call, flag on), its last candidate ``hi``, its last key read ``top`` (-1 when not computed), the
    index into its ascending page list of its first page at or past the split's start ``lo`` (``ptr``; without
    ``POOL``, ``NPG``: past every listed page, so a walk sees the static keys alone), the key count
    of ``b``, whether the row is a real query head, and the block queries ``(BLOCK_C * BLOCK_G, BLOCK_D)`` (zero past
    ``C`` and ``G``)."""
    BM: tl.constexpr = BLOCK_C * BLOCK_G
    b, h, _, cc, rows, live = _block_tile(FLAG, H, C, HAS_FLAG, BLOCK_C, BLOCK_G)
    mg = tl.arange(0, BM) % BLOCK_G
    bs = tl.load(BS + b * C + cc, mask=cc < C, other=0)
    nk = tl.load(NK + b)
    top = tl.where(live, tl.minimum(bs, nk - 1), -1)
    if POOL:
        ptr = _pages_below(PAGES, rows, live, lo // PAGE, NPG, BM, BLOCK_L)
    else:
        ptr = tl.zeros([BM], tl.int32) + NPG
    d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + b * sq_b + h * sq_h + cc[:, None] * sq_c + mg[:, None] * sq_g + d[None, :], (cc < C) & (mg < G),
                   d, D, BLOCK_D)
    return b, h, rows, live, bs - window, top, ptr, nk, mg < G, q, d


@triton.jit
def _pages_below(PAGES, rows, live, limit, NPG, BLOCK_C: tl.constexpr, BLOCK_L: tl.constexpr):
    """Per block ``(BLOCK_C,)``: how many of its listed pages are below page ``limit`` (where a split starting at page
    ``limit`` begins in the block's ascending list)."""
    ptr = tl.zeros([BLOCK_C], tl.int32)
    j = tl.arange(0, BLOCK_L)
    for j0 in range(0, NPG, BLOCK_L):
        jj = j0 + j
        lst = tl.load(PAGES + rows[:, None] * NPG + jj[None, :], mask=live[:, None] & (jj < NPG)[None, :], other=-1)
        ptr += tl.sum(((lst >= 0) & (lst < limit)).to(tl.int32), 1)
    return ptr


@triton.jit
def _tile_pages(PAGES, rows, live, ptr, t0, NPG, PAGE: tl.constexpr, NP: tl.constexpr):
    """Which of the ``NP`` pages of key tile ``[t0, t0 + NP * PAGE)`` each row's block lists, as a bit mask ``(R,)``
    (bit ``i``: page ``t0 // PAGE + i``), and how many. ``ptr`` is the index of the block's first listed page at or
    past the tile (its list is ascending), so the tile's listed pages are the next ``NP`` entries at most."""
    p0 = t0 // PAGE
    bits = tl.zeros_like(ptr)
    count = tl.zeros_like(ptr)
    for j in tl.static_range(NP):
        lst = tl.load(PAGES + rows * NPG + ptr + j, mask=live & (ptr + j < NPG), other=-1)
        inside = (lst >= p0) & (lst < p0 + NP)
        bits = bits | tl.where(inside, 1 << tl.where(inside, lst - p0, 0), 0)
        count += inside.to(tl.int32)
    return bits, count


@triton.jit
def _tile_pool(bits, t0, hi, nk, sinks, live, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(R, BLOCK_N)``: the keys of ``[t0, t0 + BLOCK_N)`` in a row's pool (a listed page, inside ``[sinks, hi]``,
    below ``nk``)."""
    p = t0 + tl.arange(0, BLOCK_N)
    listed = ((bits[:, None] >> (tl.arange(0, BLOCK_N) // PAGE)[None, :]) & 1) != 0
    return listed & live[:, None] & (p[None, :] < nk) & (p[None, :] >= sinks) & (p[None, :] <= hi[:, None])


@triton.jit
def _tile_static(t0, hi, top, nk, sinks, live, BLOCK_N: tl.constexpr):
    """``(R, BLOCK_N)``: the static keys of ``[t0, t0 + BLOCK_N)`` a row reads (sinks; the window ``(hi, top]``)."""
    p = t0 + tl.arange(0, BLOCK_N)
    return live[:, None] & (p[None, :] < nk) & ((p[None, :] < sinks)
                                                | ((p[None, :] > hi[:, None]) & (p[None, :] <= top[:, None])))


@triton.jit
def _next_tile(PAGES, rows, live, ptr, nxt, hi, top, nk, sinks, NPG, STATIC: tl.constexpr, PAGE: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The first key tile at or after position ``nxt`` (a multiple of ``BLOCK_N``) that a row reads: its next listed
    page (at ``ptr``, at or past ``nxt``), and with ``STATIC`` its sinks and window; tiles in between are skipped
    (nothing there changes a row's sums). A position past every row's keys when there is none."""
    far = 2147483647
    lst = tl.load(PAGES + rows * NPG + ptr, mask=live & (ptr < NPG), other=-1)
    cand = tl.where(lst >= 0, lst * PAGE, far)
    if STATIC:
        cand = tl.minimum(cand, tl.where(live & (nxt < sinks) & (nxt < nk), nxt, far))
        win = tl.maximum(hi + 1, nxt)
        cand = tl.minimum(cand, tl.where(live & (win <= top), win, far))
    return (tl.min(cand, 0) // BLOCK_N * BLOCK_N).to(tl.int32)


@triton.jit
def _page_logits(q, K_bh, t0, ks, nk, sk_s, d, member, scale, F32: tl.constexpr, BLOCK_N: tl.constexpr,
                 D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Logits ``(R, BLOCK_N)`` of the block queries ``q (R, BLOCK_D)`` with the keys at positions ``[t0, t0 +
    BLOCK_N)`` (tensor index ``+ ks``) on the tensor cores, ``-inf`` where ``member (R, BLOCK_N)`` is False."""
    p = t0 + tl.arange(0, BLOCK_N)
    k = _load_rows(K_bh + (p + ks)[:, None] * sk_s + d[None, :], p < nk, d, D, BLOCK_D).to(q.dtype)
    if F32:  # float32 queries: three TF32 products (about float32's rounding, on the tensor cores)
        s = tl.dot(q, tl.trans(k), input_precision="tf32x3")
    else:
        s = tl.dot(q, tl.trans(k))
    return tl.where(member, s * scale, float("-inf"))


@triton.jit
def _refine_pages_partial_kernel(Q, K, PAGES, BS, NK, KST, FLAG, PM, PL, H, C, G, NPG, NS, sinks, window, scale,
                                 sq_b, sq_h, sq_c, sq_g, sk_b, sk_h, sk_s,
                                 HAS_FLAG: tl.constexpr, F32: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
                                 BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, NP: tl.constexpr,
                                 STATIC_NORM: tl.constexpr):
    """Split ``s`` (key positions ``[s * SPLIT, (s + 1) * SPLIT)``) of a tile of ``BLOCK_C`` blocks: each query head's
    running max and sum of ``exp(logit)`` over the block's static and pool keys there (``STATIC_NORM``: its static
    keys alone), into ``PM, PL (R, NS, BLOCK_G)``."""
    lo = tl.program_id(1) * SPLIT
    b, h, rows, live, hi, top, ptr, nk, _, q, d = _page_tile(Q, PAGES, BS, NK, FLAG, H, C, G, NPG, sq_b, sq_h, sq_c,
                                                             sq_g, window, lo, HAS_FLAG, PAGE, BLOCK_C, BLOCK_G, D,
                                                             BLOCK_D, BLOCK_L, not STATIC_NORM)
    ks = tl.load(KST + b)
    K_bh = K + b * sk_b + h * sk_h
    end = tl.minimum(lo + SPLIT, tl.max(top, 0) + 1)  # a block before its sinks end has no pool to score
    m = tl.full([BLOCK_C * BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_C * BLOCK_G], tl.float32)
    t0 = _next_tile(PAGES, rows, live, ptr, lo, hi, top, nk, sinks, NPG, True, PAGE, BLOCK_N)
    while t0 < end:
        bits, count = _tile_pages(PAGES, rows, live, ptr, t0, NPG, PAGE, NP)
        member = _tile_pool(bits, t0, hi, nk, sinks, live, PAGE, BLOCK_N) | _tile_static(t0, hi, top, nk, sinks, live,
                                                                                         BLOCK_N)
        m, l = _online_lse(m, l, _page_logits(q, K_bh, t0, ks, nk, sk_s, d, member, scale, F32, BLOCK_N, D,
                                                              BLOCK_D))
        ptr += count
        t0 = _next_tile(PAGES, rows, live, ptr, t0 + BLOCK_N, hi, top, nk, sinks, NPG, True, PAGE, BLOCK_N)
    mr = tl.arange(0, BLOCK_C * BLOCK_G)
    part = (rows * NS + tl.program_id(1)) * BLOCK_G + mr % BLOCK_G
    tl.store(PM + part, m, mask=live)
    tl.store(PL + part, l, mask=live)


@triton.jit
def _refine_pages_prob_kernel(Q, K, PAGES, BS, NK, KST, FLAG, PM, PL, OUT, H, C, G, NPG, NS, sinks, window, scale,
                              sq_b, sq_h, sq_c, sq_g, sk_b, sk_h, sk_s,
                              HAS_FLAG: tl.constexpr, F32: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
                              BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                              D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, NP: tl.constexpr):
    """Split ``s`` of a tile: the log-normaliser of every query head from the block's partials (merged in split order,
    so the trailing empty splits of a longer key tensor change nothing), then the summed probabilities of the pool keys
    in ``[s * SPLIT, (s + 1) * SPLIT)`` written at their slots (-inf at a listed page's other keys; split 0 also
    writes -inf at the slots past the block's listed pages)."""
    BM: tl.constexpr = BLOCK_C * BLOCK_G
    lo = tl.program_id(1) * SPLIT
    b, h, rows, live, hi, top, ptr, nk, head, q, d = _page_tile(Q, PAGES, BS, NK, FLAG, H, C, G, NPG, sq_b, sq_h,
                                                                sq_c, sq_g, window, lo, HAS_FLAG, PAGE, BLOCK_C,
                                                                BLOCK_G, D, BLOCK_D, BLOCK_L)
    mr = tl.arange(0, BM)
    part = rows * NS * BLOCK_G + mr % BLOCK_G
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    for s in range(0, NS):
        pm = tl.load(PM + part + s * BLOCK_G, mask=live, other=float("-inf"))
        pl = tl.load(PL + part + s * BLOCK_G, mask=live, other=0.0)
        m_new = tl.maximum(m, pm)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp(m - m_safe) + pl * tl.exp(pm - m_safe)
        m = m_new
    lse = tl.where(live & (l > 0) & head, m + tl.log(l), float("-inf"))
    live_lse = lse > float("-inf")
    lse_safe = tl.where(live_lse, lse, 0.0)
    ks = tl.load(KST + b)
    K_bh = K + b * sk_b + h * sk_h
    W = NPG * PAGE
    end = tl.minimum(lo + SPLIT, tl.max(top, 0) + 1)  # a block before its sinks end has no pool to score
    o = tl.arange(0, BLOCK_N) % PAGE
    page_of = tl.arange(0, BLOCK_N) // PAGE
    _, _, _, _, rows_b, live_b = _block_tile(FLAG, H, C, HAS_FLAG, BLOCK_C, 1)  # per block: where its slots are written
    hi_b = tl.max(tl.reshape(hi, (BLOCK_C, BLOCK_G)), 1)
    t0 = _next_tile(PAGES, rows, live, ptr, lo, hi, top, nk, sinks, NPG, False, PAGE, BLOCK_N)
    while t0 < end:
        bits, count = _tile_pages(PAGES, rows, live, ptr, t0, NPG, PAGE, NP)
        pool = _tile_pool(bits, t0, hi, nk, sinks, live, PAGE, BLOCK_N)
        logits = _page_logits(q, K_bh, t0, ks, nk, sk_s, d, pool, scale, F32, BLOCK_N, D, BLOCK_D)
        p = tl.where(live_lse[:, None], tl.exp(logits - lse_safe[:, None]), 0.0)
        prob = tl.sum(tl.reshape(p, (BLOCK_C, BLOCK_G, BLOCK_N)), 1)  # (BLOCK_C, BLOCK_N): summed over the heads
        # per block (its rows agree): the listed pages, their rank in the list, and the pool keys
        bits_c = tl.max(tl.reshape(bits, (BLOCK_C, BLOCK_G)), 1)
        ptr_c = tl.max(tl.reshape(ptr, (BLOCK_C, BLOCK_G)), 1)
        listed_c = ((bits_c[:, None] >> page_of[None, :]) & 1) != 0
        pos = t0 + tl.arange(0, BLOCK_N)
        pool_c = listed_c & (pos[None, :] < nk) & (pos[None, :] >= sinks) & (pos[None, :] <= hi_b[:, None])
        rank = tl.zeros([BLOCK_C, BLOCK_N], tl.int32)
        for j in tl.static_range(NP):
            rank += ((bits_c[:, None] >> j) & 1) * (j < page_of[None, :]).to(tl.int32)
        slot = (ptr_c[:, None] + rank) * PAGE + o[None, :]
        tl.store(OUT + rows_b[:, None] * W + slot, tl.where(pool_c, prob, float("-inf")), mask=listed_c)
        ptr += count
        t0 = _next_tile(PAGES, rows, live, ptr, t0 + BLOCK_N, hi, top, nk, sinks, NPG, False, PAGE, BLOCK_N)
    if tl.program_id(1) == 0:  # the slots past each block's listed pages
        count_b = _pages_below(PAGES, rows_b, live_b, 2147483647, NPG, BLOCK_C, BLOCK_L) * PAGE
        w = tl.arange(0, BLOCK_L)
        for w0 in range(0, W, BLOCK_L):
            ww = w0 + w
            tl.store(OUT + rows_b[:, None] * W + ww[None, :], tl.full([BLOCK_C, BLOCK_L], float("-inf"), tl.float32),
                     mask=live_b[:, None] & (ww[None, :] < W) & (ww[None, :] >= count_b[:, None]))


@triton.jit
def _page_summary_kernel(K, KST, KEND, KMIN, KMAX, OK, H, S, D, P, sinks, sk_b, sk_h, sk_s, sk_d, s_ks, s_ke, so_b,
                         so_h, so_p, PAGE: tl.constexpr, BLOCK_PG: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program: ``BLOCK_PG`` pages of one ``(b, h)``; min / max over each page's valid keys, one key row per page at
    a time (``PAGE`` steps). The ``h == 0`` programs write ``OK``."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    pg = tl.program_id(1).to(tl.int64) * BLOCK_PG + tl.arange(0, BLOCK_PG)
    d = tl.arange(0, BLOCK_D)
    din = d < D
    ks = tl.load(KST + b * s_ks)
    ke = tl.minimum(tl.load(KEND + b * s_ke), S)
    kmin = tl.full([BLOCK_PG, BLOCK_D], float("inf"), tl.float32)
    kmax = tl.full([BLOCK_PG, BLOCK_D], float("-inf"), tl.float32)
    found = tl.zeros([BLOCK_PG], tl.int32)
    k_bh = K + b * sk_b + h * sk_h
    for o in range(PAGE):
        pos = pg * PAGE + o
        idx = ks + pos
        ok = (pg < P) & (pos >= sinks) & (idx < ke)
        k = tl.load(k_bh + idx[:, None] * sk_s + d[None, :] * sk_d, mask=ok[:, None] & din[None, :], other=0.0)
        k = k.to(tl.float32)
        kmin = tl.where(ok[:, None], tl.minimum(kmin, k, propagate_nan=tl.PropagateNan.ALL), kmin)
        kmax = tl.where(ok[:, None], tl.maximum(kmax, k, propagate_nan=tl.PropagateNan.ALL), kmax)
        found = found | ok.to(tl.int32)
    out = b * so_b + h * so_h + pg[:, None] * so_p + d[None, :]
    live = (pg < P)[:, None] & din[None, :]
    tl.store(KMIN + out, kmin, mask=live)
    tl.store(KMAX + out, kmax, mask=live)
    if h == 0:
        tl.store(OK + b * P + pg, found.to(tl.int8), mask=pg < P)


@triton.jit
def _page_layout_kernel(PAGES, SLOTS, LO, HI, BOK, NK, KST, IDX, CNT, H, C, NPG, K, W, top_k, sp_r, ss_r, sg_b, sg_c,
                        s_nk, s_ks, si_r, HAS_SLOTS: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_W: tl.constexpr):
    """A program: one row ``(b, h, c)``. A block with at most ``top_k`` candidates takes all of them; else the keys
    of its listed pages inside its candidate range, packed in order (a scan of the per-slot flags), or with ``SLOTS``
    the keys at the row's chosen page slots (ascending, -1 after: already packed)."""
    row = tl.program_id(0).to(tl.int64)
    b, _, c = _row_bhc(row, H, C)
    lo = tl.load(LO + b * sg_b + c * sg_c)
    hi = tl.load(HI + b * sg_b + c * sg_c)
    live = tl.load(BOK + b * sg_b + c * sg_c).to(tl.int64)
    nk = tl.load(NK + b * s_nk)
    kst = tl.load(KST + b * s_ks)
    n_cand = tl.maximum(tl.minimum(hi, nk - 1) - lo + 1, 0) * live
    out = IDX + row * si_r
    if n_cand <= top_k:
        for w0 in range(0, W, BLOCK_W):
            s = w0 + tl.arange(0, BLOCK_W)
            tl.store(out + s, tl.where(s < n_cand, lo + s + kst, -1).to(tl.int32), mask=s < W)
        tl.store(CNT + row, n_cand.to(tl.int32))
    else:
        n = tl.arange(0, BLOCK_N)
        if HAS_SLOTS:
            slot = tl.load(SLOTS + row * ss_r + n, mask=n < K, other=-1).to(tl.int64)
            ok = slot >= 0
            pg = tl.load(PAGES + row * sp_r + slot // PAGE, mask=ok, other=0).to(tl.int64)
            pos = pg * PAGE + slot % PAGE
            count = tl.minimum(tl.sum(ok.to(tl.int32), 0), W)
            tl.store(out + n, (pos + kst).to(tl.int32), mask=ok & (n < W))
        else:
            j = n // PAGE
            pg = tl.load(PAGES + row * sp_r + j, mask=j < NPG, other=-1).to(tl.int64)
            pos = pg * PAGE + n % PAGE
            ok = (pg >= 0) & (pos >= lo) & (pos <= hi) & (pos < nk)
            oki = ok.to(tl.int32)
            dest = tl.cumsum(oki, 0) - oki
            count = tl.sum(oki, 0)
            tl.store(out + dest, (pos + kst).to(tl.int32), mask=ok & (dest < W))
        for w0 in range(0, W, BLOCK_W):
            s = w0 + tl.arange(0, BLOCK_W)
            tl.store(out + s, tl.full([BLOCK_W], -1, tl.int32), mask=(s >= count) & (s < W))
        tl.store(CNT + row, count)


def _empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Every output buffer of the launchers (uninitialised; the tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _bytes_of(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8 for a kernel: its own bytes (no copy), or a conversion while ``torch.compile`` traces
    (Inductor cannot lower a bool bitcast)."""
    return mask.to(torch.uint8) if torch.compiler.is_compiling() else mask.view(torch.uint8)


def _launch(op, impl, *args):
    """``op(*args)``, a launcher's ``torch.library`` custom op (what ``torch.compile`` and fake tensors see: one opaque
    call with a fake), or in an eager call on real tensors its implementation ``impl(*args)`` directly: the op's
    dispatch costs more host time than a small launch (about a tenth of a millisecond), which adds up over the
    selection's launches in every layer of a forward."""
    if torch.compiler.is_compiling() or any(isinstance(a, torch.Tensor) and is_fake(a) for a in args):
        return op(*args)
    return impl(*args)


def _flag_arg(flag: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    """The flag as a contiguous uint8 row vector for the kernel (a conversion: Inductor cannot lower a bool bitcast)."""
    return fallback if flag is None else flag.reshape(-1).to(torch.uint8).contiguous()


def _select_topk_impl(x: torch.Tensor, mask: torch.Tensor | None, flag: torch.Tensor | None, lengths: torch.Tensor | None,
                      k: int, block: int) -> torch.Tensor:
    R, n = x.shape
    out = _empty((R, k), torch.int32, x.device)
    if R > 0 and k > 0:
        m = x if mask is None else mask
        _topk_kernel[(R,)](x, m, _flag_arg(flag, x), x if lengths is None else lengths, out, n, k, x.stride(0),
                           m.stride(0), out.stride(0), HAS_MASK=mask is not None, HAS_FLAG=flag is not None,
                           HAS_LEN=lengths is not None, ONE_CHUNK=block >= n, BLOCK=block,
                           BLOCK_K=min(1024, triton.next_power_of_2(k)), num_warps=16 if block > 4096 else 8)
    return out


_select_topk = torch.library.custom_op(add_op_namespace_prefix("select_topk"),
                                       mutates_args=())(_select_topk_impl)


@_select_topk.register_fake
def _(x, mask, flag, lengths, k, block):
    return x.new_empty((x.shape[0], k), dtype=torch.int32)


def topk_rows(x: torch.Tensor, k: int, mask: torch.Tensor | None = None, flag: torch.Tensor | None = None, *,
              lengths: torch.Tensor | None = None, block: int | None = None) -> torch.Tensor:
    """The top-``k`` valid entries of every row, packed ascending (module docstring).

    Args:
        x: ``(..., n)`` float16/bfloat16/float32 scores (compared as float32).
        k: entries per row, ``>= 0`` (more than a row's valid entries: all of them, ``-1`` after).
        mask: optional ``(..., n)`` bool (broadcastable), True = valid; default: the entries above ``-inf``.
        flag: optional ``(...)`` bool (broadcastable); rows where it is False are not computed (their output
            is left as allocated).
        lengths: optional ``(...)`` integer (broadcastable): a row's entries from its length on are neither read
            nor chosen, as if the row ended there (a causal row's tail of ``-inf``: the same result, half the reads).
        block: entries per chunk (power of two, 16 to ``TOPK_BLOCK_MAX``; a row within one chunk is read once into
            registers; default: the whole row up to ``TOPK_ONE_CHUNK_MAX`` entries, else chunks of 1024 read five
            times).
    Returns:
        ``(..., k)`` int32 indices in ``[0, n)``, ascending, ``-1`` past each row's count.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"topk_rows: `x` must be a float16/bfloat16/float32 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"topk_rows: `x` must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"topk_rows: `k` must be an int >= 0, got {k!r}")
    n = x.shape[-1]
    if block is None:
        n2 = max(16, triton.next_power_of_2(n))
        block = n2 if n2 <= TOPK_ONE_CHUNK_MAX else 1024
    elif isinstance(block, bool) or not isinstance(block, int) or not 16 <= block <= TOPK_BLOCK_MAX \
            or block & (block - 1):
        raise ValueError(f"topk_rows: `block` must be a power of two in [16, {TOPK_BLOCK_MAX}], got {block!r}")
    lead = x.shape[:-1]
    x2 = x.to(torch.float32).reshape(-1, n).contiguous()
    m2 = _row_mask(mask, x.shape, "topk_rows").reshape(-1, n) if mask is not None else None
    f2 = _row_flag(flag, lead, "topk_rows")
    n2 = _row_lengths(lengths, lead, "topk_rows")
    return _launch(_select_topk, _select_topk_impl, x2, m2, f2, n2, k, block).view(*lead, k)


def _row_mask(mask: torch.Tensor, shape, who: str) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"{who}: `mask` must be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
    try:
        return mask.expand(shape).to(torch.uint8).contiguous()
    except RuntimeError:
        raise ValueError(f"{who}: `mask` shape {tuple(mask.shape)} does not broadcast to {tuple(shape)}") from None


def _row_lengths(lengths: torch.Tensor | None, lead, who: str) -> torch.Tensor | None:
    if lengths is None:
        return None
    if not isinstance(lengths, torch.Tensor) or lengths.dtype.is_floating_point or lengths.dtype == torch.bool \
            or lengths.is_complex():
        raise ValueError(f"{who}: `lengths` must be an integer tensor, got {getattr(lengths, 'dtype', type(lengths).__name__)}")
    try:
        if lengths.dtype == torch.int32:  # (already in the kernel's type: no conversion)
            return lengths.expand(lead).reshape(-1).contiguous()
        return lengths.expand(lead).reshape(-1).clamp(0, 2**31 - 1).to(torch.int32).contiguous()
    except RuntimeError:
        raise ValueError(f"{who}: `lengths` shape {tuple(lengths.shape)} does not broadcast to the rows {tuple(lead)}") from None


def _row_flag(flag: torch.Tensor | None, lead, who: str) -> torch.Tensor | None:
    if flag is None:
        return None
    if not isinstance(flag, torch.Tensor) or flag.dtype != torch.bool:
        raise ValueError(f"{who}: `flag` must be a bool tensor, got {getattr(flag, 'dtype', type(flag).__name__)}")
    try:
        return flag.expand(lead).reshape(-1).to(torch.uint8).contiguous()
    except RuntimeError:
        raise ValueError(f"{who}: `flag` shape {tuple(flag.shape)} does not broadcast to the rows {tuple(lead)}") from None


def _page_bound_scores_impl(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, ok: torch.Tensor, last: torch.Tensor,
                            flag: torch.Tensor | None, block_p: int) -> torch.Tensor:
    B, H, C, G, D = q.shape
    P = kmin.shape[2]
    out = _empty((B, H, C, P), torch.float32, q.device)
    if B * H * C > 0:
        row_tiles = B * H * triton.cdiv(C, PAGE_BOUND_ROWS)
        page_tiles = triton.cdiv(P, block_p)
        runs = max(1, min(page_tiles, triton.cdiv(PAGE_BOUND_PROGRAMS, row_tiles)))  # programs along the pages
        tiles = triton.cdiv(page_tiles, runs)
        _page_bound_kernel[(row_tiles, triton.cdiv(page_tiles, tiles))](
            q, kmin, kmax, ok, last, _flag_arg(flag, ok), out, H, C, G, D, P, tiles,
            q.stride(0), q.stride(1), q.stride(2), q.stride(3), kmin.stride(0), kmin.stride(1), kmin.stride(2),
            ok.stride(0), last.stride(0), P, HAS_FLAG=flag is not None, BLOCK_C=PAGE_BOUND_ROWS, BLOCK_P=block_p,
            BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=PAGE_BOUND_WARPS)
    return out


_page_bound_scores = torch.library.custom_op(add_op_namespace_prefix("page_bound_scores"),
                                             mutates_args=())(_page_bound_scores_impl)


@_page_bound_scores.register_fake
def _(q, kmin, kmax, ok, last, flag, block_p):
    B, H, C = q.shape[:3]
    return q.new_empty((B, H, C, kmin.shape[2]), dtype=torch.float32)


def page_bound_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, ok: torch.Tensor, last: torch.Tensor,
                      flag: torch.Tensor | None = None, *, block_p: int = 64) -> torch.Tensor:
    """Page scores of the training-free default, ``-inf`` off the candidate pages (module docstring).

    Args:
        q: ``(B, H, C, G, D)`` the first query of ``C`` blocks, the ``G`` query heads of each of ``H`` KV heads.
        kmin, kmax: ``(B, H, P, D)`` float32 page summaries (``page_selection.page_summaries``).
        ok: ``(B, 1, P)`` bool, the page holds a key. last: ``(B, C)`` int64, each block's last candidate page
            (``-1``: none).
        flag: optional ``(B, H, C)`` bool (broadcastable); rows where it is False are left unwritten.
    Returns:
        ``(B, H, C, P)`` float32.
    """
    if q.dim() != 5 or kmin.dim() != 4 or kmin.shape != kmax.shape or kmin.shape[:2] != q.shape[:2] \
            or kmin.shape[3] != q.shape[4]:
        raise ValueError(f"page_bound_scores: q (B, H, C, G, D) and kmin/kmax (B, H, P, D) do not match: "
                         f"{tuple(q.shape)}, {tuple(kmin.shape)}, {tuple(kmax.shape)}")
    if kmin.dtype != torch.float32 or kmax.dtype != torch.float32:
        raise ValueError(f"page_bound_scores: kmin/kmax must be float32, got {kmin.dtype}/{kmax.dtype}")
    B, H, C = q.shape[:3]
    P = kmin.shape[2]
    if tuple(ok.shape) != (B, 1, P) or ok.dtype != torch.bool:
        raise ValueError(f"page_bound_scores: `ok` must be bool ({B}, 1, {P}), got {ok.dtype} {tuple(ok.shape)}")
    if tuple(last.shape) != (B, C) or last.dtype != torch.int64:
        raise ValueError(f"page_bound_scores: `last` must be int64 ({B}, {C}), got {last.dtype} {tuple(last.shape)}")
    if isinstance(block_p, bool) or not isinstance(block_p, int) or not 16 <= block_p <= 1024 or block_p & (block_p - 1):
        raise ValueError(f"page_bound_scores: `block_p` must be a power of two in [16, 1024], got {block_p!r}")
    if kmin.stride() != kmax.stride() or kmin.stride(-1) != 1:  # the state's buffers (or slices of them) pass as they are
        kmin, kmax = kmin.contiguous(), kmax.contiguous()
    okc = _bytes_of(ok[:, 0].contiguous())
    if q.dtype != torch.float32 or q.stride(-1) != 1:  # (the kernel reads any strides with a contiguous last dim)
        q = q.to(torch.float32).contiguous()
    return _launch(_page_bound_scores, _page_bound_scores_impl, q, kmin, kmax, okc, last.contiguous(),
                   _row_flag(flag, (B, H, C), "page_bound_scores"), block_p)


def _index_scores_impl(q: torch.Tensor, w: torch.Tensor, ik: torch.Tensor, cand: torch.Tensor, flag: torch.Tensor | None,
                       groups: int, block_s: int) -> torch.Tensor:
    B, T, Hi, dI = q.shape
    S = ik.shape[1]
    out = _empty((B, T, groups, S), torch.float32, q.device)
    if B * T * groups > 0:
        _index_score_kernel[(B * T * groups, triton.cdiv(S, block_s))](
            q, w, ik, cand, _flag_arg(flag, cand), out, T, groups, Hi // groups, S, dI, dI ** -0.5,
            q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1), ik.stride(0), ik.stride(1),
            cand.stride(0), cand.stride(1), S, HAS_FLAG=flag is not None, BLOCK_S=block_s,
            BLOCK_D=triton.next_power_of_2(dI), num_warps=4)
    return out


_index_scores = torch.library.custom_op(add_op_namespace_prefix("index_scores"),
                                        mutates_args=())(_index_scores_impl)


@_index_scores.register_fake
def _(q, w, ik, cand, flag, groups, block_s):
    B, T = q.shape[:2]
    return q.new_empty((B, T, groups, ik.shape[1]), dtype=torch.float32)


def index_scores(q: torch.Tensor, w: torch.Tensor, ik: torch.Tensor, cand: torch.Tensor, groups: int,
                 flag: torch.Tensor | None = None, *, block_s: int = 128) -> torch.Tensor:
    """DSA indexer scores, ``-inf`` off the candidates (module docstring).

    Args:
        q: ``(B, T, Hi, d)`` indexer queries; w: ``(B, T, Hi)`` head weights; ik: ``(B, S, groups * d)`` float32
            indexer keys; cand: ``(B, T, S)`` bool candidates; groups: key groups (1, or ``Hkv`` per KV head),
            each scored with ``Hi // groups`` consecutive heads.
        flag: optional ``(B, T, groups)`` bool (broadcastable); rows where it is False are left unwritten.
    Returns:
        ``(B, T, groups, S)`` float32.
    """
    if q.dim() != 4 or w.shape != q.shape[:3] or ik.dim() != 3 or ik.shape[0] != q.shape[0]:
        raise ValueError(f"index_scores: q (B, T, Hi, d), w (B, T, Hi), ik (B, S, groups * d) do not match: "
                         f"{tuple(q.shape)}, {tuple(w.shape)}, {tuple(ik.shape)}")
    B, T, Hi, dI = q.shape
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or Hi % groups or ik.shape[2] != groups * dI:
        raise ValueError(f"index_scores: `groups` ({groups!r}) must divide the {Hi} heads and give key width "
                         f"{ik.shape[2]} = groups * {dI}")
    if ik.dtype != torch.float32:
        raise ValueError(f"index_scores: `ik` must be float32, got {ik.dtype}")
    if cand.dtype != torch.bool or tuple(cand.shape) != (B, T, ik.shape[1]):
        raise ValueError(f"index_scores: `cand` must be bool ({B}, {T}, {ik.shape[1]}), got {cand.dtype} {tuple(cand.shape)}")
    if isinstance(block_s, bool) or not isinstance(block_s, int) or not 16 <= block_s <= 1024 or block_s & (block_s - 1):
        raise ValueError(f"index_scores: `block_s` must be a power of two in [16, 1024], got {block_s!r}")
    ik = ik if ik.stride(-1) == 1 else ik.contiguous()
    return _launch(_index_scores, _index_scores_impl, q.to(torch.float32).contiguous(),
                   w.to(torch.float32).contiguous(), ik, cand.to(torch.uint8).contiguous(),
                   _row_flag(flag, (B, T, groups), "index_scores"), groups, block_s)


def _refine_scores_impl(q: torch.Tensor, key: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor, sidx: torch.Tensor,
                        sok: torch.Tensor, flag: torch.Tensor | None, block_n: int, static_norm: bool) -> torch.Tensor:
    B, H, C, G, D = q.shape
    W, WS = idx.shape[-1], sidx.shape[-1]
    block_g, block_d = triton.next_power_of_2(G), max(16, triton.next_power_of_2(D))
    R, NS = B * H * C, triton.cdiv(W, REFINE_SPLIT)
    out = _empty((B, H, C, W), torch.float32, q.device)
    if R > 0 and W > 0:
        pm, pl = (_empty((R, NS, block_g), torch.float32, q.device) for _ in range(2))
        f = _flag_arg(flag, ok)
        common = dict(HAS_FLAG=flag is not None, SPLIT=REFINE_SPLIT, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
                      num_warps=8)
        qs = (q.stride(0), q.stride(1), q.stride(2), q.stride(3), key.stride(0), key.stride(1), key.stride(2),
              idx.stride(0), idx.stride(1), idx.stride(2))
        _refine_partial_kernel[(R, NS)](q, key, idx, ok, sidx, sok, f, pm, pl, H, C, G, D, W, WS, NS, D ** -0.5, *qs,
                                        sidx.stride(0), sidx.stride(1), sidx.stride(2), STATIC_NORM=static_norm,
                                        **common)
        _refine_prob_kernel[(R, NS)](q, key, idx, ok, f, pm, pl, out, H, C, G, D, W, NS, D ** -0.5, *qs, W,
                                     BLOCK_S=max(2, triton.next_power_of_2(NS)), **common)
    return out


_refine_scores = torch.library.custom_op(add_op_namespace_prefix("refine_scores"),
                                         mutates_args=())(_refine_scores_impl)


@_refine_scores.register_fake
def _(q, key, idx, ok, sidx, sok, flag, block_n, static_norm):
    B, H, C = q.shape[:3]
    return q.new_empty((B, H, C, idx.shape[-1]), dtype=torch.float32)


def refine_scores(q: torch.Tensor, key: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor, sidx: torch.Tensor,
                  sok: torch.Tensor, flag: torch.Tensor | None = None, *, block_n: int | None = None,
                  static_norm: bool = False) -> torch.Tensor:
    """The refinement score of preselected keys (module docstring; ``page_selection.refine_probabilities``).

    Args:
        q: ``(B, H, C, G, D)`` the first query of ``C`` blocks, the ``G`` query heads of each of ``H`` KV heads.
        key: ``(B, H, S, D)`` float16/bfloat16/float32 keys, any strides with a unit last one (else copied).
        idx, ok: ``(B, 1|H, C, W)`` int tensor indices of the preselected keys into ``key``'s dim 2, and bool validity.
        sidx, sok: ``(B, 1|H, C, Ws)`` the same for each block's static keys (sinks and window).
        flag: optional ``(B, H, C)`` bool (broadcastable); rows where it is False are left unwritten.
        block_n: keys per tile (power of two, 16 to 256; default: a ``(G, block_n, D)`` product of about 8K floats).
        static_norm: each query head's softmax normalised over the static keys alone (no pass over the preselected
            keys for the normaliser).
    Returns:
        ``(B, H, C, W)`` float32, 0 where ``ok`` is False.
    """
    _check_bool("refine_scores", "static_norm", static_norm)
    if q.dim() != 5 or key.dim() != 4 or key.shape[:2] != q.shape[:2] or key.shape[3] != q.shape[4]:
        raise ValueError(f"refine_scores: q (B, H, C, G, D) and key (B, H, S, D) do not match: {tuple(q.shape)}, "
                         f"{tuple(key.shape)}")
    if key.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"refine_scores: `key` must be float16/bfloat16/float32, got {key.dtype}")
    if block_n is not None and (isinstance(block_n, bool) or not isinstance(block_n, int) or not 16 <= block_n <= 256
                                or block_n & (block_n - 1)):
        raise ValueError(f"refine_scores: `block_n` must be a power of two in [16, 256], got {block_n!r}")
    B, H, C = q.shape[:3]
    lists = []
    for name_i, name_m, i, m in (("idx", "ok", idx, ok), ("sidx", "sok", sidx, sok)):
        if i.dim() != 4 or i.shape[0] != B or i.shape[1] not in (1, H) or i.shape[2] != C or i.dtype.is_floating_point:
            raise ValueError(f"refine_scores: `{name_i}` must be an integer (B, 1|H, C, n) = ({B}, 1|{H}, {C}, n) tensor, "
                             f"got {i.dtype} {tuple(i.shape)}")
        if m.dtype != torch.bool:
            raise ValueError(f"refine_scores: `{name_m}` must be bool, got {m.dtype}")
        try:
            m = m.expand(i.shape)
        except RuntimeError:
            raise ValueError(f"refine_scores: `{name_m}` shape {tuple(m.shape)} does not broadcast to {tuple(i.shape)}") from None
        lists += [i.expand(B, H, C, i.shape[3]).to(torch.int32).contiguous(),
                  m.expand(B, H, C, i.shape[3]).to(torch.uint8).contiguous()]
    key = key if key.stride(-1) == 1 else key.contiguous()
    if block_n is None:  # the (G, block_n, D) product of a tile: about 8K floats (64 registers a thread at 8 warps)
        block_n = max(16, min(64, 8192 // (triton.next_power_of_2(q.shape[3]) * max(16, triton.next_power_of_2(q.shape[4])))))
    return _launch(_refine_scores, _refine_scores_impl, q.to(torch.float32).contiguous(), key, *lists,
                   _row_flag(flag, (B, H, C), "refine_scores"), block_n, static_norm)


def _refine_page_scores_impl(q: torch.Tensor, key: torch.Tensor, pages: torch.Tensor, block_start: torch.Tensor,
                             n_keys: torch.Tensor, k_start: torch.Tensor, flag: torch.Tensor | None, page: int, sinks: int,
                             window: int, static_norm: bool) -> torch.Tensor:
    B, H, C, G, D = q.shape
    NPG = pages.shape[-1]
    out = _empty((B, H, C, NPG * page), torch.float32, q.device)
    if B * H * C > 0 and NPG > 0:
        block_g = triton.next_power_of_2(G)
        block_c = max(1, PAGE_REFINE_ROWS // block_g)
        block_n = max(page, min(PAGE_REFINE_BLOCK_N, 16 * page))  # at most 16 pages a tile (a 16-bit mask)
        if PAGE_REFINE_SPLIT % block_n:  # a split must hold whole key tiles
            raise ValueError(f"refine_page_scores: PAGE_REFINE_SPLIT ({PAGE_REFINE_SPLIT}) must be a multiple of the "
                             f"key tile ({block_n})")
        NS = triton.cdiv(key.shape[2], PAGE_REFINE_SPLIT)
        pm, pl = (_empty((B * H * C, NS, block_g), torch.float32, q.device) for _ in range(2))
        f = _flag_arg(flag, pages)
        grid = (B * H * triton.cdiv(C, block_c), NS)
        args = (H, C, G, NPG, NS, sinks, window, D ** -0.5, q.stride(0), q.stride(1), q.stride(2), q.stride(3),
                key.stride(0), key.stride(1), key.stride(2))
        common = dict(HAS_FLAG=flag is not None, F32=q.dtype == torch.float32, PAGE=page, SPLIT=PAGE_REFINE_SPLIT,
                      BLOCK_C=block_c, BLOCK_G=block_g, BLOCK_N=block_n, D=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
                      BLOCK_L=min(128, max(16, triton.next_power_of_2(NPG))), NP=block_n // page, num_warps=4)
        _refine_pages_partial_kernel[grid](q, key, pages, block_start, n_keys, k_start, f, pm, pl, *args,
                                           STATIC_NORM=static_norm, **common)
        _refine_pages_prob_kernel[grid](q, key, pages, block_start, n_keys, k_start, f, pm, pl, out, *args, **common)
    return out


_refine_page_scores = torch.library.custom_op(add_op_namespace_prefix("refine_page_scores"),
                                              mutates_args=())(_refine_page_scores_impl)


@_refine_page_scores.register_fake
def _(q, key, pages, block_start, n_keys, k_start, flag, page, sinks, window, static_norm):
    B, H, C = q.shape[:3]
    return q.new_empty((B, H, C, pages.shape[-1] * page), dtype=torch.float32)


def refine_page_scores(q: torch.Tensor, key: torch.Tensor, pages: torch.Tensor, page: int, block_start: torch.Tensor,
                       n_keys: torch.Tensor, k_start: torch.Tensor, sinks: int, window: int,
                       flag: torch.Tensor | None = None, *, static_norm: bool = False) -> torch.Tensor:
    """The refinement score of the keys of preselected pages, computed per tile of blocks on the tensor cores (module
    docstring): ``refine_scores`` for the training-free selection's pools, in page-slot order.

    Args:
        q: ``(B, H, C, G, D)`` the first query of ``C`` blocks, the ``G`` query heads of each of ``H`` KV heads: in the
            keys' float16/bfloat16 (exact products, float32 sums), else float32 (TF32x3 products, about float32).
        key: ``(B, H, S, D)`` float16/bfloat16/float32 keys, any strides with a unit last one (else copied).
        pages: ``(B, H, C, n)`` integer page indices (position ``// page``) of each block's preselected pages,
            ascending, ``-1`` after; every listed page at or below the block's last candidate page.
        page: keys per page, a power of two up to ``PAGE_REFINE_SPLIT``.
        block_start: ``(B, C)`` int64 position of each block's first query. n_keys, k_start: ``(B,)`` int64 keys of a
            row and the tensor index of its position 0 (left padding).
        sinks, window: the static keys (positions ``< sinks``, and ``(block_start - window, block_start]``); the
            candidates are ``[sinks, block_start - window]``.
        flag: optional ``(B, H, C)`` bool (broadcastable); rows where it is False are left unwritten.
        static_norm: each query head's softmax normalised over the static keys alone (the first pass then walks the
            sinks and window, not the pool).
    Returns:
        ``(B, H, C, n * page)`` float32: at slot ``j * page + o`` the summed probability of key ``pages[..., j] * page +
        o`` when it is a candidate below ``n_keys`` (as ``refine_scores`` of ``page_selection.expand_pages``' keys with
        ``static_positions``' keys), else -inf (no key: ``topk_rows`` without a mask passes over it).
    """
    _check_bool("refine_page_scores", "static_norm", static_norm)
    if q.dim() != 5 or key.dim() != 4 or key.shape[:2] != q.shape[:2] or key.shape[3] != q.shape[4]:
        raise ValueError(f"refine_page_scores: q (B, H, C, G, D) and key (B, H, S, D) do not match: {tuple(q.shape)}, "
                         f"{tuple(key.shape)}")
    if key.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"refine_page_scores: `key` must be float16/bfloat16/float32, got {key.dtype}")
    B, H, C = q.shape[:3]
    if pages.dim() != 4 or tuple(pages.shape[:3]) != (B, H, C) or pages.dtype.is_floating_point:
        raise ValueError(f"refine_page_scores: `pages` must be an integer ({B}, {H}, {C}, n) tensor, got {pages.dtype} "
                         f"{tuple(pages.shape)}")
    if isinstance(page, bool) or not isinstance(page, int) or not 1 <= page <= PAGE_REFINE_SPLIT or page & (page - 1):
        raise ValueError(f"refine_page_scores: `page` must be a power of two in [1, {PAGE_REFINE_SPLIT}], got {page!r}")
    for name, t, shape in (("block_start", block_start, (B, C)), ("n_keys", n_keys, (B,)), ("k_start", k_start, (B,))):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != shape:
            raise ValueError(f"refine_page_scores: `{name}` must be int64 {shape}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    for name, v in (("sinks", sinks), ("window", window)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"refine_page_scores: `{name}` must be an int >= 0, got {v!r}")
    key = key if key.stride(-1) == 1 else key.contiguous()
    low = key.dtype != torch.float32 and q.dtype == key.dtype
    return _launch(_refine_page_scores, _refine_page_scores_impl,
                   q.contiguous() if low else q.to(torch.float32).contiguous(), key, pages.to(torch.int32).contiguous(),
                   block_start.contiguous(), n_keys.contiguous(), k_start.contiguous(),
                   _row_flag(flag, (B, H, C), "refine_page_scores"), page, sinks, window, static_norm)


def _page_summaries_impl(key: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, page: int, sinks: int,
                         n_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, S, D = key.shape
    kmin = _empty((B, H, n_pages, D), torch.float32, key.device)
    kmax = _empty((B, H, n_pages, D), torch.float32, key.device)
    ok = _empty((B, n_pages), torch.int8, key.device)
    if B * H * n_pages > 0:
        _page_summary_kernel[(B * H, triton.cdiv(n_pages, PAGE_SUMMARY_PAGES))](
            key, k_start, k_end, kmin, kmax, ok, H, S, D, n_pages, sinks, key.stride(0), key.stride(1), key.stride(2),
            key.stride(3), k_start.stride(0), k_end.stride(0), kmin.stride(0), kmin.stride(1), kmin.stride(2), PAGE=page,
            BLOCK_PG=PAGE_SUMMARY_PAGES, BLOCK_D=max(16, triton.next_power_of_2(D)))
    return kmin, kmax, ok


_page_summaries = torch.library.custom_op(add_op_namespace_prefix("page_summaries"),
                                          mutates_args=())(_page_summaries_impl)


@_page_summaries.register_fake
def _(key, k_start, k_end, page, sinks, n_pages):
    B, H, _, D = key.shape
    return (key.new_empty((B, H, n_pages, D), dtype=torch.float32),
            key.new_empty((B, H, n_pages, D), dtype=torch.float32), key.new_empty((B, n_pages), dtype=torch.int8))


def page_summaries(key: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, page: int, sinks: int,
                   n_pages: int):
    """``page_selection.page_summaries`` in one launch (module docstring): ``kmin, kmax (B, H, n_pages, D)`` float32
    and ``ok (B, 1, n_pages)`` bool.

    Args:
        key: ``(B, H, S, D)`` float16/bfloat16/float32, any strides (read where it lies).
        k_start, k_end: ``(B,)`` or ``(1,)`` int64, each row's valid key range (tensor indices).
        page: keys per page (>= 1); sinks: positions below it are in no page's summary; n_pages: pages summarised.
    """
    if not isinstance(key, torch.Tensor) or key.dim() != 4 or key.dtype not in (torch.float16, torch.bfloat16,
                                                                                  torch.float32):
        raise ValueError(f"page_summaries: `key` must be a (B, H, S, D) float16/bfloat16/float32 tensor, got "
                         f"{getattr(key, 'dtype', type(key).__name__)} {tuple(getattr(key, 'shape', ()))}")
    B = key.shape[0]
    for name, t in (("k_start", k_start), ("k_end", k_end)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1 or t.shape[0] not in (1, B):
            raise ValueError(f"page_summaries: `{name}` must be an int64 tensor of shape ({B},) or (1,), got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    for name, v, low in (("page", page, 1), ("sinks", sinks, 0), ("n_pages", n_pages, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"page_summaries: `{name}` must be an int >= {low}, got {v!r}")
    kmin, kmax, ok = _launch(_page_summaries, _page_summaries_impl, key, k_start.expand(B), k_end.expand(B), page,
                             sinks, n_pages)
    ok = ok != 0 if torch.compiler.is_compiling() else ok.view(torch.bool)  # (no bool bitcast in Inductor)
    return kmin, kmax, ok[:, None]


def _page_layout_impl(pages: torch.Tensor, slots: torch.Tensor | None, lo: torch.Tensor, hi: torch.Tensor,
                      block_ok: torch.Tensor, n_keys: torch.Tensor, k_start: torch.Tensor, page: int, top_k: int,
                      width: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, C, n = pages.shape
    indices = _empty((B, H, C, width), torch.int32, pages.device)
    counts = _empty((B, H, C), torch.int32, pages.device)
    if B * H * C > 0:
        K = 0 if slots is None else slots.shape[-1]
        span = triton.next_power_of_2(max(1, K)) if slots is not None else triton.next_power_of_2(max(1, n)) * page
        _page_layout_kernel[(B * H * C,)](
            pages, pages if slots is None else slots, lo, hi, block_ok, n_keys, k_start, indices, counts, H, C, n, K,
            width, top_k, pages.stride(2), 0 if slots is None else slots.stride(2), lo.stride(0), lo.stride(1),
            n_keys.stride(0), k_start.stride(0), indices.stride(2), HAS_SLOTS=slots is not None, PAGE=page,
            BLOCK_N=span, BLOCK_W=min(1024, triton.next_power_of_2(max(1, width))))
    return indices, counts


_page_layout = torch.library.custom_op(add_op_namespace_prefix("page_layout"),
                                       mutates_args=())(_page_layout_impl)


@_page_layout.register_fake
def _(pages, slots, lo, hi, block_ok, n_keys, k_start, page, top_k, width):
    B, H, C, _ = pages.shape
    return pages.new_empty((B, H, C, width), dtype=torch.int32), pages.new_empty((B, H, C), dtype=torch.int32)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t (B, H, C, n)`` with contiguous rows laid out as ``(b * H + h) * C + c`` (one stride), else a copy."""
    B, H, C, _ = t.shape
    if t.stride(-1) != 1 or t.stride(1) != C * t.stride(2) or t.stride(0) != H * t.stride(1):
        return t.contiguous()
    return t


def page_layout(pages: torch.Tensor, page: int, lo: torch.Tensor, hi: torch.Tensor, block_ok: torch.Tensor,
                n_keys: torch.Tensor, k_start: torch.Tensor, top_k: int, width: int, *,
                slots: torch.Tensor | None = None):
    """The token layout of chosen pages (module docstring): ``indices (B, H, C, width)`` int32 key tensor indices
    (ascending, ``-1`` past the count) and ``counts (B, H, C)`` int32.

    Args:
        pages: ``(B, H, C, n)`` integer page ids per block, ascending, ``-1`` after (``topk_rows``' output).
        page: keys per page (a power of two). lo, hi: ``(B, C)`` int64 each block's candidate positions (inclusive).
        block_ok: ``(B, C)`` bool, the block is in the call. n_keys, k_start: ``(B,)`` or ``(1,)`` int64.
        top_k: a block with at most this many candidates takes all of them. width: the layout's ``K`` (at least
            every block's count).
        slots: optional ``(B, H, C, k)`` integer: the chosen slots of the pages' keys (slot ``j * page + o``: key
            ``o`` of the row's ``j``-th page; ascending, ``-1`` after, every one a candidate: the refinement's
            ``topk_rows`` of ``refine_page_scores``); without it every key of the pages inside ``[lo, hi]`` and below
            ``n_keys``.
    """
    if not isinstance(pages, torch.Tensor) or pages.dim() != 4 or pages.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_layout: `pages` must be a (B, H, C, n) int32/int64 tensor, got "
                         f"{getattr(pages, 'dtype', type(pages).__name__)} {tuple(getattr(pages, 'shape', ()))}")
    B, H, C, _ = pages.shape
    if isinstance(page, bool) or not isinstance(page, int) or page < 1 or page & (page - 1):
        raise ValueError(f"page_layout: `page` must be a power of two, got {page!r}")
    for name, t in (("lo", lo), ("hi", hi), ("block_ok", block_ok)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (B, C):
            raise ValueError(f"page_layout: `{name}` must have shape ({B}, {C}), got {tuple(getattr(t, 'shape', ()))}")
    if lo.dtype != torch.int64 or hi.dtype != torch.int64 or block_ok.dtype != torch.bool:
        raise ValueError(f"page_layout: `lo`/`hi` must be int64 and `block_ok` bool, got {lo.dtype}/{hi.dtype}/"
                         f"{block_ok.dtype}")
    for name, t in (("n_keys", n_keys), ("k_start", k_start)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1 or t.shape[0] not in (1, B):
            raise ValueError(f"page_layout: `{name}` must be an int64 tensor of shape ({B},) or (1,)")
    for name, v in (("top_k", top_k), ("width", width)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"page_layout: `{name}` must be an int >= 0, got {v!r}")
    if slots is not None:
        if not isinstance(slots, torch.Tensor) or slots.dim() != 4 or tuple(slots.shape[:3]) != (B, H, C) \
                or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"page_layout: `slots` must be a ({B}, {H}, {C}, k) int32/int64 tensor, got "
                             f"{getattr(slots, 'dtype', type(slots).__name__)} {tuple(getattr(slots, 'shape', ()))}")
        slots = _rows_contiguous(slots)
    pages = _rows_contiguous(pages)
    if lo.stride() != hi.stride() or lo.stride() != block_ok.stride():
        lo, hi, block_ok = lo.contiguous(), hi.contiguous(), block_ok.contiguous()
    return _launch(_page_layout, _page_layout_impl, pages, slots, lo, hi, _bytes_of(block_ok), n_keys.expand(B),
                   k_start.expand(B), page, top_k, width)
