"""Block-sparse attention forward in Triton over a ``BlockLayout`` (design §5).

One program handles one query tile of ``ROWS = BLOCK_M // PACK`` query rows for ``PACK`` query heads
of one KV group (GQA packing: the packed heads share every K/V tile load), and walks the layout's
*full* key tiles (no element mask) in one loop and its *partial* tiles (element rule evaluated in
registers) in a second loop; the mask is a constexpr flag of the shared tile step, so neither loop
holds a run-time branch. With ``SPLIT`` the tile list is cut into ``num_splits`` ranges (split-KV,
flash-decoding); each split writes a partial result (its normalised output and log-sum-exp, sink left out)
and the last split program of each tile to finish merges them and adds the sink logit once
(``_combine_last``, arrival counters from ``split_counters``), or ``combine_splits`` does in a second launch.

Pattern ids (``PATTERN`` constexpr) and their run-time parameters ``P0..P3``: ``pattern_codes``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...layouts.block_layout import full_tiles_contiguous
from ..launch_buffers import placeholder, selection_args, split_counters
from ..memory_order import new_output
from ..pattern_codes import BIGBIRD_RANDOM_SHIFT, DECODE_PATTERNS, bigbird_code_draws
from .fitting import launch
from .rules import LOG2E, _floordiv, _key_runs, _pattern_rule, _softcap
from .tma import kv_descriptor, tma_ok

__all__ = [
    "bigbird_rule_table", "check_bigbird_rule_tiles", "check_sel_fast", "combine_splits", "layout_forward", "mask_bytes",
]

#: bigbird decode launches carry ``window_blocks + _BB_SHIFT * random_blocks`` in ``P1`` (``pattern_codes``).
_BB_SHIFT = tl.constexpr(BIGBIRD_RANDOM_SHIFT)

#: ``dilated`` with at most this many scales compiles its scale loop unrolled (one kernel variant per
#: scale count); more scales loop at run time.
MAX_UNROLLED_SCALES = 8


@triton.jit
def _fwd_tile(
    acc, l_i, m_i, q, K, V, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn,
    qpos, k_start, k_end, Skv, scale_log2, softcap, P0, P1, P2, P3, kv_row0, extra_ok,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, IS_FULL: tl.constexpr,
    EVEN_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr, USE_TMA: tl.constexpr,
    HEAD_DIM: tl.constexpr, SCALES: tl.constexpr, HAS_EXTRA: tl.constexpr,
):
    """One key tile ``n`` of the online softmax: acc (BLOCK_M, D) fp32, l_i/m_i (BLOCK_M,) in log2 units.

    With ``USE_TMA`` K and V are 2-D tensor descriptors over ``(B * Hkv * Skv, D)``; rows past this
    head's ``Skv`` (only in the last tile) are masked like any key past the end. ``HAS_EXTRA``: a
    partial tile's element rule is also ANDed with ``extra_ok (BLOCK_M, BLOCK_N)`` (bigbird's rule, ``_bigbird_ok``)."""
    kidx = n.to(tl.int64) * BLOCK_N + offs_n  # (BLOCK_N,)
    kin = kidx < Skv
    if USE_TMA:
        row = (kv_row0 + n * BLOCK_N).to(tl.int32)
        kt = tl.trans(K.load([row, 0]))  # (D, BLOCK_N)
        vt = V.load([row, 0])  # (BLOCK_N, D)
    elif EVEN_N:
        kt = tl.load(K + kidx[None, :] * stride_kn + offs_d[:, None])  # (D, BLOCK_N)
        vt = tl.load(V + kidx[:, None] * stride_vn + offs_d[None, :])  # (BLOCK_N, D)
    else:
        kt = tl.load(K + kidx[None, :] * stride_kn + offs_d[:, None], mask=kin[None, :], other=0.0)
        vt = tl.load(V + kidx[:, None] * stride_vn + offs_d[None, :], mask=kin[:, None], other=0.0)
    s = tl.dot(q, kt)
    if HAS_SOFTCAP:
        s = _softcap(s * (scale_log2 / 1.4426950408889634), softcap) * 1.4426950408889634
    else:
        s = s * scale_log2
    if IS_FULL:
        if not EVEN_N:
            s = tl.where(kin[None, :], s, float("-inf"))
    else:  # int32 positions (lengths < 2**31; ``qpos`` int32 too): half the registers of int64 masks
        kpos = offs_n + (n * BLOCK_N - k_start).to(tl.int32)
        k_ok = (kpos >= 0) & (kidx < k_end) & kin
        ok = _pattern_rule(qpos[:, None], kpos[None, :], P0, P1, P2, P3, PATTERN, CAUSAL, SCALES) & k_ok[None, :]
        if HAS_EXTRA:
            ok = ok & extra_ok
        s = tl.where(ok, s, float("-inf"))
    if HAS_KMASK:
        km = tl.load(kmask_row + kidx, mask=kin, other=0)
        s = tl.where(km[None, :] != 0, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if IS_FULL and EVEN_N and not HAS_KMASK:
        m_safe = m_new  # every score of a full tile is finite
    else:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])  # accumulate in the MMA
    return acc, l_i, m_new


@triton.jit
def _keys_far(k_ok, kpos, q_min, P0, P1, PATTERN: tl.constexpr):
    """Whether every valid key position of ``kpos`` (1-D, valid where ``k_ok``) lies behind the window
    of the earliest row ``q_min`` (hence of every row, and causal) and, for streaming, past the sinks."""
    kp_hi = tl.max(tl.where(k_ok, kpos, -(1 << 30)), 0)
    far = q_min - kp_hi >= P0
    if PATTERN == 2:
        far = far & (tl.min(tl.where(k_ok, kpos, 1 << 30), 0) >= P1)
    return far


@triton.jit
def _selection_loop(
    acc, l_i, m_i, q, Kb, Vb, kmask_row, offs_n, offs_d, stride_kn, stride_vn, q_ok, qidx, qpos,
    k_start, k_end, Skv, scale_log2, softcap, P0, P1, P2, P3, b64, hkv,
    SEL_IDX, SEL_CNT, SEL_W, fb, stride_sib, stride_sih, stride_sin, stride_scb, stride_sch, stride_scn,
    stride_swb, stride_swh, stride_swn, NB, QB, SEL_K, c_lo, c_hi,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_KMASK: tl.constexpr, HAS_SELW: tl.constexpr, SEL_FAST: tl.constexpr, SEL_PREFETCH: tl.constexpr,
    SEL_LEAN: tl.constexpr, SEL_SCAN: tl.constexpr,
):
    """Token-layout keys (learned top-k) of the selection blocks this tile's rows belong to.

    Row r uses block ``qpos // QB - first_block[b]``; a selected key counts only where the static
    rule does not already allow it, it is valid, and it is causal (design §5, ``TokenLayout``).
    Slots ``[c_lo, c_hi)`` of each block's list are handled here (a split's share in split-KV mode).
    With ``SEL_FAST`` (causal sliding_window / streaming static parts) a tile whose valid keys all
    lie behind every row's window, past the sinks and before every row needs only the 1-D row and
    key masks: the (BLOCK_M, BLOCK_N) rule is evaluated for the other tiles alone. ``SEL_FAST == 2``
    first scans all slots of the block (``SEL_SCAN`` at a time): when they are all far, the tiles
    skip their own check (two reductions and the CTA barriers they cost).
    With ``SEL_PREFETCH`` the next tile's key indices are loaded one iteration ahead into registers
    (a loop-carried vector). Loaded inside the iteration that uses them, Triton's pipeliner (sm_90,
    3 stages) keeps two K/V buffers and waits for every copy in flight at the top of each iteration,
    so the gathered rows were not fetched while the previous tile computed; with the index one
    iteration ahead the K/V copies run two tiles ahead behind a partial wait, as in the
    contiguous-tile loops (seen in triton 3.9's sm_90 compile; the token prefill is faster with it on
    the H100, docs/history.md). Split-KV decode leaves it off by default (``layout_forward``: register
    spills; docs/decode.md).
    With ``SEL_LEAN`` the K and V tiles are loaded row-major through one index vector without a
    mask (invalid slots read key row 0 and are masked in the scores), and a far tile's key mask is
    an additive bias: fewer integer and predicate instructions per gathered tile (sm_90 SASS of the
    prefill loop: 1260 instead of 1600 per iteration; the contiguous window loop has 420).
    """
    sb_row = _floordiv(qpos, QB) - fb  # (BLOCK_M,); fb: the row's first block, loaded at the kernel's start
    # The (BLOCK_M, BLOCK_N) mask arithmetic runs on int32 positions (half the registers of int64;
    # positions stay far below 2**31): row / key validity is folded into 1-D vectors first.
    qpos32 = qpos.to(tl.int32)
    k_start32 = k_start.to(tl.int32)
    k_lo = tl.maximum(k_start, 0).to(tl.int32)
    k_hi = tl.minimum(k_end, Skv).to(tl.int32)
    sb_lo = tl.min(tl.where(q_ok, sb_row, 1 << 30), 0)
    sb_hi = tl.max(tl.where(q_ok, sb_row, -(1 << 30)), 0)
    sb_lo = tl.maximum(sb_lo, 0)
    sb_hi = tl.minimum(sb_hi, NB - 1)
    for sb in range(sb_lo, sb_hi + 1):
        sbl = sb  # block offsets stay far below 2**31 (NB * K entries)
        cnt = tl.load(SEL_CNT + b64 * stride_scb + hkv * stride_sch + sbl * stride_scn)
        hi = tl.minimum(cnt, c_hi)
        row_in = sb_row == sb
        q_min = tl.min(tl.where(row_in & q_ok, qpos32, 1 << 30), 0)  # earliest row of this block in the tile
        rows_all_in = tl.min(tl.where(q_ok & ~row_in, 0, 1), 0) == 1  # rows past Sq are never stored
        idx_row = SEL_IDX + b64 * stride_sib + hkv * stride_sih + sbl * stride_sin
        if SEL_FAST == 2:  # one check for all slots of the block (no per-tile reductions when it holds)
            offs_b = tl.arange(0, SEL_SCAN)
            blk_hi = tl.full([], -(1 << 30), tl.int32)
            blk_lo = tl.full([], 1 << 30, tl.int32)
            for c0 in range(c_lo, hi, SEL_SCAN):
                sl = c0 + offs_b
                kk = tl.load(idx_row + sl, mask=sl < SEL_K, other=-1).to(tl.int32)
                okb = (sl < hi) & (kk >= k_lo) & (kk < k_hi)
                kpb = kk - k_start32
                blk_hi = tl.maximum(blk_hi, tl.max(tl.where(okb, kpb, -(1 << 30)), 0))
                blk_lo = tl.minimum(blk_lo, tl.min(tl.where(okb, kpb, 1 << 30), 0))
            block_far = q_min - blk_hi >= P0
            if PATTERN == 2:
                block_far = block_far & (blk_lo >= P1)
        if SEL_PREFETCH:
            # Bounded by the list's length SEL_K, not by the count: a mask constant over aligned runs of
            # slots lets the index loads vectorise (slots past the count are masked through s_ok).
            kidx_next = tl.load(idx_row + c_lo + offs_n, mask=c_lo + offs_n < SEL_K, other=-1).to(tl.int32)
        for c in range(c_lo, hi, BLOCK_N):
            slot = c + offs_n
            s_ok = slot < hi
            if SEL_PREFETCH:
                kidx = kidx_next
                nxt = slot + BLOCK_N
                kidx_next = tl.load(idx_row + nxt, mask=nxt < SEL_K, other=-1).to(tl.int32)
            else:
                kidx = tl.load(idx_row + slot, mask=s_ok, other=-1).to(tl.int32)
            k_ok = s_ok & (kidx >= k_lo) & (kidx < k_hi)
            ksafe = tl.where(k_ok, kidx, 0)
            koff = ksafe.to(tl.int64)
            if SEL_LEAN:  # row-major K and V tiles share one index layout; invalid slots read row 0, unmasked
                kt = tl.trans(tl.load(Kb + koff[:, None] * stride_kn + offs_d[None, :]))
                vt = tl.load(Vb + koff[:, None] * stride_vn + offs_d[None, :])
            else:
                kt = tl.load(Kb + koff[None, :] * stride_kn + offs_d[:, None], mask=k_ok[None, :], other=0.0)
                vt = tl.load(Vb + koff[:, None] * stride_vn + offs_d[None, :], mask=k_ok[:, None], other=0.0)
            s = tl.dot(q, kt)
            if HAS_SOFTCAP:
                s = _softcap(s * (scale_log2 / 1.4426950408889634), softcap) * 1.4426950408889634
            else:
                s = s * scale_log2
            if HAS_SELW:
                w = tl.load(SEL_W + b64 * stride_swb + hkv * stride_swh + sbl * stride_swn + slot, mask=s_ok, other=0.0).to(tl.float32)
                k_ok = k_ok & (w > 0)
                s = s + tl.log2(tl.where(w > 0, w, 1.0))[None, :]
            if HAS_KMASK:
                km = tl.load(kmask_row + koff, mask=k_ok, other=0)
                k_ok = k_ok & (km != 0)
            kpos = ksafe - k_start32
            if SEL_FAST:
                if SEL_FAST == 2:
                    far = block_far
                    if not block_far:
                        far = _keys_far(k_ok, kpos, q_min, P0, P1, PATTERN)
                else:
                    far = _keys_far(k_ok, kpos, q_min, P0, P1, PATTERN)
                if far:
                    if SEL_LEAN:  # an additive key bias; the row mask only where rows of other blocks share the tile
                        bias = tl.where(k_ok, 0.0, float("-inf"))
                        if rows_all_in:
                            s = s + bias[None, :]
                        else:
                            s = tl.where(row_in[:, None], s + bias[None, :], float("-inf"))
                    else:
                        s = tl.where(row_in[:, None] & k_ok[None, :], s, float("-inf"))
                else:
                    static = _pattern_rule(qpos32[:, None], kpos[None, :], P0, P1, P2, P3, PATTERN, CAUSAL)
                    ok = row_in[:, None] & k_ok[None, :] & (kpos[None, :] <= qpos32[:, None]) & ~static
                    s = tl.where(ok, s, float("-inf"))
            else:
                static = _pattern_rule(qpos32[:, None], kpos[None, :], P0, P1, P2, P3, PATTERN, CAUSAL)
                ok = row_in[:, None] & k_ok[None, :] & (kpos[None, :] <= qpos32[:, None]) & ~static
                s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])
            m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _struct_runs(qlo, qhi, k_start, k_end, P0, P1, P2, PATTERN: tl.constexpr, BLOCK_N: tl.constexpr):
    """Causal key-tile runs of the queries at key indices ``qlo..qhi`` of a decode step:
    ``(s_lo, s_hi, n_lo, f_lo, f_hi, n_hi)`` with sink tiles ``[s_lo, s_hi)`` (streaming's sinks,
    bigbird's global blocks), the window run ``[n_lo, n_hi)`` and its full (unmasked) middle ``[f_lo,
    f_hi)``, every full tile inside ``[k_start, k_end)``. dense (0) / sliding_window (1) / streaming (2)
    / block_diagonal (3) take the structured kernels' key runs (``rules._key_runs``; block_diagonal from
    the block of ``qlo``); bigbird (4) runs from ``window_blocks`` blocks before the block of ``qlo``, full
    from those before the block of ``qhi``; dilated (5) runs over its widest scale's reach, full over its
    first scale (a window of ``P0``); l2_aligned (6) runs over the blocks of its window (anchors before the
    run: ``_anchor_slot``). All from the row geometry: no layout."""
    if PATTERN == 4:
        a_lo, a_hi, w_lo, w_hi = _key_runs(qlo, qhi, k_start, k_end, P0, 0, True)
        wb = P1 % _BB_SHIFT
        a_lo = tl.maximum(k_start, k_start + (_floordiv(qlo - k_start, P0) - wb) * P0)
        w_lo = tl.maximum(k_start, k_start + (_floordiv(qhi - k_start, P0) - wb) * P0)
    elif PATTERN == 5:
        a_lo, a_hi, w_lo, w_hi = _key_runs(qlo, qhi, k_start, k_end, P0, 1, True)
        reach = (tl.zeros([], tl.int64) + P0) << (P1 - 1)  # int64: window * 2**(scales - 1)
        a_lo = tl.maximum(k_start, qlo - reach + 1)
    elif PATTERN == 6:
        a_lo, a_hi, w_lo, w_hi = _key_runs(qlo, qhi, k_start, k_end, P0, 0, True)
        a_lo = tl.maximum(k_start, k_start + (_floordiv(qlo - k_start, P0) - P1 + 1) * P0)
        w_lo = tl.maximum(k_start, k_start + (_floordiv(qhi - k_start, P0) - P1 + 1) * P0)
    else:
        a_lo, a_hi, w_lo, w_hi = _key_runs(qlo, qhi, k_start, k_end, P0, PATTERN, True)
    a_hi = tl.maximum(a_hi, a_lo)
    n_lo = a_lo // BLOCK_N
    n_hi = tl.maximum((a_hi + BLOCK_N - 1) // BLOCK_N, n_lo)
    f_lo = tl.minimum(tl.maximum((w_lo + BLOCK_N - 1) // BLOCK_N, n_lo), n_hi)
    f_hi = tl.minimum(tl.maximum(w_hi // BLOCK_N, f_lo), n_hi)
    s_lo = n_lo
    s_hi = n_lo
    if PATTERN == 2 or PATTERN == 4:
        if PATTERN == 2:
            s_end = tl.minimum(tl.minimum(k_start + P1, k_end), qhi + 1)
        else:
            s_end = tl.minimum(tl.minimum(k_start + P2 * P0, k_end), qhi + 1)
        s_lo = tl.minimum(k_start // BLOCK_N, n_lo)
        s_hi = tl.maximum(tl.minimum((tl.maximum(s_end, k_start) + BLOCK_N - 1) // BLOCK_N, n_lo), s_lo)
    return s_lo, s_hi, n_lo, f_lo, f_hi, n_hi


@triton.jit
def _mix31(x):
    """``patterns._mix`` (a 31-bit integer hash) on an int64 scalar; intermediates stay below 2**62."""
    x = x & 2147483647
    x = (x * 1103515245 + 12345) & 2147483647
    x = x ^ (x >> 13)
    x = (x * 1664525 + 12345) & 2147483647
    x = x ^ (x >> 13)
    x = (x * 22695477 + 12345) & 2147483647
    x = x ^ (x >> 13)
    return x


@triton.jit
def _bigbird_draws(qb, hkv, seed, wb, g, R: tl.constexpr, RP: tl.constexpr):
    """The random key blocks of causal bigbird's query block ``qb`` and KV head ``hkv``: ``(RP,)`` int64,
    -1 past ``R`` or where there are fewer candidates; the draws of ``patterns._bigbird_random_table``
    (Floyd's sampling of ``R`` of the candidates ``g .. qb - wb - 1`` from the hash of ``seed``, the
    layer's seed of ``pattern_codes.decode_pattern_code``)."""
    ar = tl.arange(0, RP)
    count = tl.maximum(qb - wb - g, 0).to(tl.int64)
    base = _mix31(_mix31(tl.zeros([], tl.int64) + seed) + hkv.to(tl.int64) * 1000003 + qb.to(tl.int64) * 9176)
    table = tl.full([RP], -1, tl.int64)
    for j in tl.static_range(R):
        t = count - R + j
        x = _mix31(base + (j + 1) * 7777) % tl.maximum(t + 1, 1)
        seen = tl.sum(tl.where((ar < j) & (table == x), 1, 0), 0) > 0
        table = tl.where(ar == j, tl.where(seen, t, x), table)
    table = tl.where(count <= R, tl.where(ar < count, ar.to(tl.int64), -1), table)
    table = tl.where(ar < R, table, -1)
    return tl.where(table >= 0, table + g, -1)


@triton.jit
def _block_tiles(kb, k_start, kcap, P0, BLOCK_N: tl.constexpr):
    """Key tiles ``[lo, hi)`` holding key block ``kb`` (blocks of ``P0`` from ``k_start``) below ``kcap``."""
    lo = (k_start + kb * P0) // BLOCK_N
    hi = (tl.minimum(k_start + (kb + 1) * P0, kcap) + BLOCK_N - 1) // BLOCK_N
    return lo, hi


@triton.jit
def _random_slot(e, tpb, draws_lo, draws_hi, two_blocks, k_start, kcap, P0, s_lo, s_hi, n_lo, n_hi,
                 R: tl.constexpr, RP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Slot ``e`` of bigbird's random tiles: ``tpb`` slots per drawn block, the first query block's ``R``
    draws, then the second's (when the step's rows span two). ``(tile, live)``: a slot is dead past its
    block's tiles, on a global or window-run tile, or on a tile of an earlier draw (each tile once)."""
    ar = tl.arange(0, RP)
    ent = e // tpb
    j = e - ent * tpb
    is_hi = ent >= R
    jj = tl.where(is_hi, ent - R, ent)
    kb_lo = tl.sum(tl.where(ar == jj, draws_lo, 0), 0)
    kb_hi = tl.sum(tl.where(ar == jj, draws_hi, 0), 0)
    kb = tl.where(is_hi, tl.where(two_blocks, kb_hi, -1), kb_lo)
    lo, hi = _block_tiles(kb, k_start, kcap, P0, BLOCK_N)
    tile = lo + j
    live = (kb >= 0) & (tile < hi) & ((tile < s_lo) | (tile >= s_hi)) & ((tile < n_lo) | (tile >= n_hi))
    lo_v, hi_v = _block_tiles(draws_lo, k_start, kcap, P0, BLOCK_N)
    earlier = (draws_lo >= 0) & (ar < tl.where(is_hi, R, jj)) & (lo_v <= tile) & (tile < hi_v)
    lo_v, hi_v = _block_tiles(draws_hi, k_start, kcap, P0, BLOCK_N)
    earlier_hi = (draws_hi >= 0) & (ar < jj) & (lo_v <= tile) & (tile < hi_v) & is_hi & two_blocks
    dup = tl.sum(tl.where(earlier | earlier_hi, 1, 0), 0) > 0
    return tile, live & ~dup


@triton.jit
def _bigbird_ok(qpos, n, offs_n, k_start, P0, wb, g, qb_lo, qb_hi, draws_lo, draws_hi, BLOCK_N: tl.constexpr):
    """bigbird's rule on key tile ``n`` (``BLOCK_N <= P0``: it holds keys of at most two blocks) for rows at
    positions ``qpos (BLOCK_M,)`` in query blocks ``qb_lo`` or ``qb_hi``: window, global or a drawn block of
    the row's query block (``draws_lo`` / ``draws_hi``, vectors of ``_bigbird_draws``). ``(BLOCK_M, BLOCK_N)``
    bool; causality and key validity are ``_fwd_tile``'s."""
    kb0 = _floordiv(n * BLOCK_N - k_start, P0)
    lo0 = tl.sum(tl.where(draws_lo == kb0, 1, 0), 0) > 0
    lo1 = tl.sum(tl.where(draws_lo == kb0 + 1, 1, 0), 0) > 0
    hi0 = tl.sum(tl.where(draws_hi == kb0, 1, 0), 0) > 0
    hi1 = tl.sum(tl.where(draws_hi == kb0 + 1, 1, 0), 0) > 0
    return _bigbird_tile_rule(qpos, n, offs_n, k_start, P0, wb, g, qb_lo, qb_hi, lo0, lo1, hi0, hi1, BLOCK_N)


@triton.jit
def _bigbird_tile_rows(qlo, qhi, k_start, P0, bb_head, BB_NQB, BB_RANDOM: tl.constexpr):
    """``(qb_lo, qb_hi, row_lo, row_hi)`` of a tile whose rows sit at positions ``qlo .. qhi``: their (at most two)
    query blocks and those blocks' rows in bigbird's random table (``BB_NQB`` query blocks of ``BB_RANDOM`` draws
    from ``bb_head``, the KV head's first; ``_bigbird_ok_table``). A query block before the row's first key (left
    padding) has no valid key: any row of the table serves it."""
    qb_lo = _floordiv(qlo - k_start, P0)
    qb_hi = _floordiv(qhi - k_start, P0)
    row_lo = bb_head + tl.minimum(tl.maximum(qb_lo, 0), BB_NQB - 1) * BB_RANDOM
    row_hi = bb_head + tl.minimum(tl.maximum(qb_hi, 0), BB_NQB - 1) * BB_RANDOM
    return qb_lo, qb_hi, row_lo, row_hi


@triton.jit
def _bigbird_ok_table(qpos, n, offs_n, k_start, P0, wb, g, qb_lo, qb_hi, row_lo, row_hi, BBT,
                      R: tl.constexpr, BLOCK_N: tl.constexpr):
    """``_bigbird_ok`` with the draws read from the random table ``BBT`` (rows ``row_lo`` / ``row_hi`` of the two
    query blocks, ``R`` entries each) as scalars: no cross-thread reduction inside the tile loop."""
    kb0 = _floordiv(n * BLOCK_N - k_start, P0)
    lo0 = kb0 != kb0
    lo1 = lo0
    hi0 = lo0
    hi1 = lo0
    for j in tl.static_range(R):
        d_lo = tl.load(BBT + row_lo + j)
        d_hi = tl.load(BBT + row_hi + j)
        lo0 = lo0 | (d_lo == kb0)
        lo1 = lo1 | (d_lo == kb0 + 1)
        hi0 = hi0 | (d_hi == kb0)
        hi1 = hi1 | (d_hi == kb0 + 1)
    return _bigbird_tile_rule(qpos, n, offs_n, k_start, P0, wb, g, qb_lo, qb_hi, lo0, lo1, hi0, hi1, BLOCK_N)


@triton.jit
def _bigbird_tile_rule(qpos, n, offs_n, k_start, P0, wb, g, qb_lo, qb_hi, lo0, lo1, hi0, hi1, BLOCK_N: tl.constexpr):
    """bigbird's rule on key tile ``n`` given whether its first key block ``kb0`` and ``kb0 + 1`` are drawn for
    query block ``qb_lo`` (``lo0``, ``lo1``) and ``qb_hi`` (``hi0``, ``hi1``): window, global or drawn."""
    # Block indices without a division per element (integer division is slow on the GPU): a tile's keys lie in
    # kb0 or kb0 + 1, its rows in qb_lo or qb_hi (``BLOCK_N``, rows per tile <= ``P0``).
    kp0 = n * BLOCK_N - k_start
    kb0 = _floordiv(kp0, P0)
    second = (kp0 - kb0 * P0).to(tl.int32) + offs_n >= P0  # (BLOCK_N,)
    kb = kb0.to(tl.int32) + second.to(tl.int32)
    qb = tl.where(qpos >= (qb_hi * P0).to(tl.int32), qb_hi.to(tl.int32), qb_lo.to(tl.int32))  # (BLOCK_M,)
    win = (kb[None, :] >= qb[:, None] - wb) & (kb[None, :] <= qb[:, None])
    r_lo = tl.where(second, lo1, lo0)
    r_hi = tl.where(second, hi1, hi0)
    rnd = ((qb == qb_lo)[:, None] & r_lo[None, :]) | ((qb == qb_hi)[:, None] & r_hi[None, :])
    return win | (kb < g)[None, :] | rnd


@triton.jit
def _anchor_slot(e, tps, k_start, kcap, P2, P3, n_lo, BLOCK_N: tl.constexpr):
    """Slot ``e`` of l2_aligned's anchor tiles before the window run ``[n_lo, ...)``: ``tps`` slots per
    segment of ``P2`` keys, whose first ``P3`` keys are anchors. ``(tile, live)``: a slot is dead past its
    anchors' tiles, at or past ``n_lo``, or on the previous segment's last tile (each tile once)."""
    i = e // tps
    j = e - i * tps
    seg_lo = k_start + i * P2
    lo = seg_lo // BLOCK_N
    hi = (tl.minimum(seg_lo + P3, kcap) + BLOCK_N - 1) // BLOCK_N
    prev_hi = tl.where(i > 0, (tl.minimum(seg_lo - P2 + P3, kcap) + BLOCK_N - 1) // BLOCK_N, 0)
    tile = lo + j
    return tile, (tile < hi) & (tile >= prev_hi) & (tile < n_lo)


#: Integer arguments of ``_attn_fwd`` that change from one decode step to the next (lengths, split
#: sizes, strides of a key mask, layout widths): passed as plain run-time values, so Triton does not
#: compile a new variant when their divisibility by 16 (or equality to 1) changes. The q / k / v strides
#: stay specialised: a growing cache's batch and head strides are multiples of its row stride (``D`` or
#: ``H * D``: multiples of 16 at the head dims models use), so their class does not change from step to
#: step, and knowing them 16-divisible lets Triton load gathered K / V rows 16 bytes at a time (as declared
#: run-time values they cost the token-layout prefill and decode about half their speed: docs/benchmarks.md,
#: "The Triton kernels' stride specialisation").
ATTN_FWD_RUNTIME_ARGS = (
    "stride_nb", "stride_nh", "stride_nm", "stride_fb", "stride_fh", "stride_fm", "stride_pb", "stride_ph", "stride_pm",
    "stride_kmb", "stride_sib", "stride_sih", "stride_sin", "stride_scb", "stride_sch", "stride_scn",
    "stride_swb", "stride_swh", "stride_swn", "NB", "QB", "SEL_K", "Sq", "Skv", "tiles_per_split",
    "P3",  # a bigbird decode step's hash seed, which differs per layer
    "stride_bbh", "BB_NQB",  # bigbird's random table over straddling tiles: its width grows with the length
)


@triton.jit(do_not_specialize=ATTN_FWD_RUNTIME_ARGS)
def _attn_fwd(
    Q, K, V, O, LSE, SINK, KMASK, QSTART, KSTART, KEND,
    FNUM, FIDX, PNUM, PIDX,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om, stride_os, stride_lb, stride_lh, stride_lm, stride_ls,
    stride_nb, stride_nh, stride_nm, stride_fb, stride_fh, stride_fm, stride_pb, stride_ph, stride_pm,
    stride_kmb, geo_stride,
    SEL_IDX, SEL_CNT, SEL_W, FIRST_BLOCK, stride_sib, stride_sih, stride_sin, stride_scb, stride_sch, stride_scn,
    stride_swb, stride_swh, stride_swn, NB, QB, SEL_K,
    Sq, Skv, Hkv, G, scale_log2, softcap, P0, P1, P2, P3, tiles_per_split, BBT, stride_bbh, BB_NQB,
    OUT_F, LSE_F, SEM, stride_fob, stride_foh, stride_fom, stride_flb, stride_flh, stride_flm,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, PACK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SINK: tl.constexpr, HAS_KMASK: tl.constexpr, SPLIT: tl.constexpr,
    LAYOUT_B: tl.constexpr, LAYOUT_H: tl.constexpr, USE_TMA: tl.constexpr, FULL_CONTIG: tl.constexpr,
    HAS_SEL: tl.constexpr, HAS_SELW: tl.constexpr, HEADS_FIRST: tl.constexpr,
    FUSE_COMBINE: tl.constexpr = False, BLOCK_S: tl.constexpr = 2, SEL_FAST: tl.constexpr = False,
    SEL_PREFETCH: tl.constexpr = False, SEL_LEAN: tl.constexpr = False, SEL_SCAN: tl.constexpr = 16,
    DIL_SCALES: tl.constexpr = 0, STRUCT: tl.constexpr = False, MERGE_ROWS: tl.constexpr = True,
    BB_RANDOM: tl.constexpr = 0, BB_SLOTS: tl.constexpr = 1, BB_RULE: tl.constexpr = False,
):
    ROWS: tl.constexpr = BLOCK_M // PACK
    # Decode tiles of bigbird / l2_aligned also walk slots past the window run (random / anchor tiles).
    SLOTS: tl.constexpr = STRUCT and (PATTERN == 4 or PATTERN == 6)
    if HEADS_FIRST:  # heads fastest: the cache-unfriendly program order, kept for the L2 study
        pid_m = tl.program_id(1)
        pid_bh = tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    n_packs = G // PACK
    b = pid_bh // (Hkv * n_packs)
    hkv = (pid_bh // n_packs) % Hkv
    pack = pid_bh % n_packs

    offs_r = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    head = hkv * G + pack * PACK + offs_r // ROWS  # (BLOCK_M,) query head of each row
    qi = pid_m * ROWS + offs_r % ROWS  # (BLOCK_M,) query index
    q_ok = qi < Sq

    g = b.to(tl.int64) * geo_stride
    q_start = tl.load(QSTART + g)
    k_start = tl.load(KSTART + g)
    k_end = tl.load(KEND + g)
    qidx = q_start + qi
    qpos = qidx - k_start
    qpos32 = qpos.to(tl.int32)

    b64 = b.to(tl.int64)
    if HAS_SEL:  # issued with the geometry loads: one round trip less before the first gathered tile
        fb = tl.load(FIRST_BLOCK + b64)
    else:
        fb = 0
    q_ptrs = Q + b64 * stride_qb + head.to(tl.int64)[:, None] * stride_qh + qi.to(tl.int64)[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=q_ok[:, None], other=0.0)
    kv_row0 = (b64 * Hkv + hkv) * Skv
    if USE_TMA:
        Kb = K
        Vb = V
    else:
        Kb = K + b64 * stride_kb + hkv.to(tl.int64) * stride_kh
        Vb = V + b64 * stride_vb + hkv.to(tl.int64) * stride_vh
    kmask_row = KMASK + b64 * stride_kmb

    if STRUCT:
        # Tile runs by arithmetic (``_struct_runs``): full tiles [f_lo, f_hi), partial tiles the sinks
        # [s_lo, s_hi), the left edge [n_lo, f_lo) and the right edge [f_hi, n_hi), in this order.
        qlo = q_start + pid_m * ROWS
        qhi = q_start + tl.minimum(pid_m * ROWS + ROWS, Sq) - 1
        s_lo, s_hi, n_lo, f_lo_t, f_hi_t, n_hi = _struct_runs(qlo, qhi, k_start, k_end, P0, P1, P2, PATTERN, BLOCK_N)
        n_full = f_hi_t - f_lo_t
        n_sink = s_hi - s_lo
        n_left = f_lo_t - n_lo
        n_edge = n_sink + n_left + (n_hi - f_hi_t)
        n_part = n_edge
        kcap = tl.minimum(k_end, qhi + 1)
        if PATTERN == 4:  # bigbird: the random blocks of the (at most two) query blocks of these rows
            wb = P1 % _BB_SHIFT
            qb_lo = _floordiv(qlo - k_start, P0)
            qb_hi = _floordiv(qhi - k_start, P0)
            draws_lo = _bigbird_draws(qb_lo, hkv, P3, wb, P2, BB_RANDOM, BB_SLOTS)
            draws_hi = _bigbird_draws(qb_hi, hkv, P3, wb, P2, BB_RANDOM, BB_SLOTS)
            tpb = (P0 + BLOCK_N - 1) // BLOCK_N + 1
            n_part = n_edge + 2 * BB_RANDOM * tpb
        if PATTERN == 6:  # l2_aligned: the anchors of the segments that start before the window run
            tps = (P3 + BLOCK_N - 1) // BLOCK_N + 1
            n_seg = tl.where(P3 > 0, tl.maximum(n_lo * BLOCK_N - k_start + P2 - 1, 0) // P2, 0)
            n_part = n_edge + n_seg * tps
        fidx = FIDX
        pidx = PIDX
    else:
        if BB_RULE:  # bigbird over listed tiles that straddle its blocks: its rule in the partial tiles
            wb = P1 % _BB_SHIFT
            qb_lo, qb_hi, row_lo, row_hi = _bigbird_tile_rows(
                q_start + pid_m * ROWS, q_start + tl.minimum(pid_m * ROWS + ROWS, Sq) - 1, k_start, P0,
                hkv.to(tl.int64) * stride_bbh, BB_NQB, BB_RANDOM)
        lb = b64 * LAYOUT_B
        lh = hkv.to(tl.int64) * LAYOUT_H
        n_full = tl.load(FNUM + lb * stride_nb + lh * stride_nh + pid_m * stride_nm)
        n_part = tl.load(PNUM + lb * stride_nb + lh * stride_nh + pid_m * stride_nm)
        fidx = FIDX + lb * stride_fb + lh * stride_fh + pid_m.to(tl.int64) * stride_fm
        pidx = PIDX + lb * stride_pb + lh * stride_ph + pid_m.to(tl.int64) * stride_pm

    if SPLIT:
        t_lo = pid_s * tiles_per_split
        t_hi = t_lo + tiles_per_split
        f_lo = tl.minimum(t_lo, n_full)
        f_hi = tl.minimum(t_hi, n_full)
        p_lo = tl.minimum(tl.maximum(t_lo - n_full, 0), n_part)
        p_hi = tl.minimum(tl.maximum(t_hi - n_full, 0), n_part)
    else:
        f_lo = 0
        f_hi = n_full
        p_lo = 0
        p_hi = n_part

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Tile indices are loaded one iteration ahead (as the selection loop's SEL_PREFETCH does): an index
    # loaded in the iteration that uses it holds the next tiles' K/V copies behind its own round trip.
    if STRUCT:
        n_first = f_lo_t
    elif FULL_CONTIG:
        n_first = tl.load(fidx)  # full tiles form one run: no index load inside the loop
    else:
        n_next = tl.load(fidx + f_lo, mask=f_lo < f_hi, other=0)
    for t in range(f_lo, f_hi):
        if STRUCT or FULL_CONTIG:
            n = n_first + t
        else:
            n = n_next
            n_next = tl.load(fidx + t + 1, mask=t + 1 < f_hi, other=0)
        acc, l_i, m_i = _fwd_tile(
            acc, l_i, m_i, q, Kb, Vb, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn,
            qpos32, k_start, k_end, Skv, scale_log2, softcap, P0, P1, P2, P3, kv_row0, q_ok,
            PATTERN, CAUSAL, BLOCK_N, True, EVEN_N, HAS_SOFTCAP, HAS_KMASK, USE_TMA, HEAD_DIM, DIL_SCALES, False,
        )
    if not STRUCT:
        n_next = tl.load(pidx + p_lo, mask=p_lo < p_hi, other=0)
    for t in range(p_lo, p_hi):
        if STRUCT:
            n = tl.where(t < n_sink, s_lo + t, tl.where(t < n_sink + n_left, n_lo + (t - n_sink), f_hi_t + (t - n_sink - n_left)))
        else:
            n = n_next
            n_next = tl.load(pidx + t + 1, mask=t + 1 < p_hi, other=0)
        if SLOTS:
            if PATTERN == 4:
                n_x, live = _random_slot(t - n_edge, tpb, draws_lo, draws_hi, qb_hi != qb_lo, k_start, kcap, P0, s_lo,
                                         s_hi, n_lo, n_hi, BB_RANDOM, BB_SLOTS, BLOCK_N)
            else:
                n_x, live = _anchor_slot(t - n_edge, tps, k_start, kcap, P2, P3, n_lo, BLOCK_N)
            n = tl.where(t < n_edge, n, n_x)
            if (t < n_edge) | live:
                if PATTERN == 4:
                    extra = _bigbird_ok(qpos32, n, offs_n, k_start, P0, wb, P2, qb_lo, qb_hi, draws_lo, draws_hi, BLOCK_N)
                else:
                    extra = q_ok
                acc, l_i, m_i = _fwd_tile(
                    acc, l_i, m_i, q, Kb, Vb, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn,
                    qpos32, k_start, k_end, Skv, scale_log2, softcap, P0, P1, P2, P3, kv_row0, extra,
                    PATTERN, CAUSAL, BLOCK_N, False, False, HAS_SOFTCAP, HAS_KMASK, USE_TMA, HEAD_DIM, DIL_SCALES,
                    PATTERN == 4,
                )
        elif BB_RULE:
            extra = _bigbird_ok_table(qpos32, n, offs_n, k_start, P0, wb, P2, qb_lo, qb_hi, row_lo, row_hi, BBT,
                                      BB_RANDOM, BLOCK_N)
            acc, l_i, m_i = _fwd_tile(
                acc, l_i, m_i, q, Kb, Vb, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn,
                qpos32, k_start, k_end, Skv, scale_log2, softcap, P0, P1, P2, P3, kv_row0, extra,
                PATTERN, CAUSAL, BLOCK_N, False, False, HAS_SOFTCAP, HAS_KMASK, USE_TMA, HEAD_DIM, DIL_SCALES, True,
            )
        else:
            acc, l_i, m_i = _fwd_tile(
                acc, l_i, m_i, q, Kb, Vb, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn,
                qpos32, k_start, k_end, Skv, scale_log2, softcap, P0, P1, P2, P3, kv_row0, q_ok,
                PATTERN, CAUSAL, BLOCK_N, False, False, HAS_SOFTCAP, HAS_KMASK, USE_TMA, HEAD_DIM, DIL_SCALES, False,
            )
    if HAS_SEL:
        if SPLIT:
            c_lo = tl.maximum(t_lo - n_full - n_part, 0) * BLOCK_N
            c_hi = tl.maximum(t_hi - n_full - n_part, 0) * BLOCK_N
        else:
            c_lo = 0
            c_hi = 1 << 30
        acc, l_i, m_i = _selection_loop(
            acc, l_i, m_i, q, Kb, Vb, kmask_row, offs_n, offs_d, stride_kn, stride_vn, q_ok, qidx, qpos,
            k_start, k_end, Skv, scale_log2, softcap, P0, P1, P2, P3, b64, hkv.to(tl.int64),
            SEL_IDX, SEL_CNT, SEL_W, fb, stride_sib, stride_sih, stride_sin, stride_scb, stride_sch,
            stride_scn, stride_swb, stride_swh, stride_swn, NB, QB, SEL_K, c_lo, c_hi,
            PATTERN, CAUSAL, BLOCK_N, HAS_SOFTCAP, HAS_KMASK, HAS_SELW, SEL_FAST, SEL_PREFETCH, SEL_LEAN,
            SEL_SCAN,
        )

    if HAS_SINK and not SPLIT:
        sink = tl.load(SINK + head).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_f)
        l_i = l_i * alpha + tl.exp2(sink - m_f)
        acc = acc * alpha[:, None]
        m_i = m_f
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))

    h64 = head.to(tl.int64)
    qi64 = qi.to(tl.int64)
    s64 = pid_s.to(tl.int64)
    o_ptrs = O + b64 * stride_ob + h64[:, None] * stride_oh + qi64[:, None] * stride_om + s64 * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=q_ok[:, None])
    l_ptrs = LSE + b64 * stride_lb + h64 * stride_lh + qi64 * stride_lm + s64 * stride_ls
    tl.store(l_ptrs, lse, mask=q_ok)
    if FUSE_COMBINE:
        if HEADS_FIRST:
            sem_idx = pid_bh * tl.num_programs(1) + pid_m
        else:
            sem_idx = pid_bh * tl.num_programs(0) + pid_m
        _combine_last(
            O, LSE, OUT_F, LSE_F, SINK, SEM, sem_idx, b64, hkv * G + pack * PACK, pid_m * ROWS, Sq, tl.num_programs(2),
            h64, qi64, q_ok, stride_ob, stride_oh, stride_om, stride_os, stride_lb, stride_lh, stride_lm, stride_ls,
            stride_fob, stride_foh, stride_fom, stride_flb, stride_flh, stride_flm,
            HAS_SINK, BLOCK_M, ROWS, BLOCK_S, HEAD_DIM, MERGE_ROWS,
        )


@triton.jit
def _merge_row(lse_p, o_p, SINK, h, HAS_SINK: tl.constexpr):
    """One row's split merge: ``lse_p (BLOCK_S,)`` partial log-sum-exps (-inf for absent splits) and ``o_p
    (BLOCK_S, D)`` normalised partial outputs -> ``(out (D,), lse)``; head ``h``'s sink logit joins once."""
    m = tl.max(lse_p, 0)
    if HAS_SINK:
        sink = tl.load(SINK + h).to(tl.float32)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_p - m_safe)
    den = tl.sum(w, 0)
    if HAS_SINK:
        den = den + tl.exp(sink - m_safe)
    has = den > 0
    den_safe = tl.where(has, den, 1.0)
    out = tl.sum(o_p * w[:, None], 0) / den_safe
    lse = tl.where(has, m_safe + tl.log(den_safe), float("-inf"))
    return out, lse


@triton.jit
def _combine_last(
    OP, LP, O, LSE, SINK, SEM, sem_idx, b64, head0, qi0, Sq, num_splits, h64, qi64, q_ok,
    stride_pb, stride_ph, stride_pm, stride_ps, stride_qb, stride_qh, stride_qm, stride_qs,
    stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm,
    HAS_SINK: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
    MERGE_ROWS: tl.constexpr = True,
):
    """Split-KV merge without a second launch: the last split program of a tile merges its rows.

    Every split program of the tile has written its partial rows; the barrier orders them before
    this program's arrival on the tile's counter (``atomic_add``, acquire-release at GPU scope); the
    program that arrives last resets the counter to 0 (so the next launch finds it zeroed) and reads
    the partials past L1 (``.cg``). The tile's row ``r`` is query head ``head0 + r // ROWS`` at query
    index ``qi0 + r % ROWS``; rows past ``Sq`` are skipped. Each row's ``num_splits`` partials are loaded
    at once (``(BLOCK_S, HEAD_DIM)``, as ``_combine`` does): one round trip per row, not one per split
    (a decode step at B=1 has 33 splits and one valid row per packed head). The sink joins once.
    ``MERGE_ROWS=False``: the former merge (all rows at once, ``(BLOCK_M,)`` vectors ``h64``, ``qi64``, ``q_ok``, one
    split a loop iteration), kept for A/B timing (``scripts/tune_decode.py --part static``).
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(SEM + sem_idx, 1)
    if arrived == num_splits - 1:
        tl.atomic_xchg(SEM + sem_idx, 0)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, HEAD_DIM)
        s_ok = offs_s < num_splits
        if not MERGE_ROWS:
            row_l = LP + b64 * stride_qb + h64 * stride_qh + qi64 * stride_qm
            lse_p = tl.load(row_l[:, None] + offs_s[None, :] * stride_qs, mask=q_ok[:, None] & s_ok[None, :],
                            other=float("-inf"), cache_modifier=".cg")
            m = tl.max(lse_p, 1)
            if HAS_SINK:
                sink = tl.load(SINK + h64).to(tl.float32)
                m = tl.maximum(m, sink)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            w = tl.exp(lse_p - m_safe[:, None])  # (BLOCK_M, BLOCK_S)
            den = tl.sum(w, 1)
            if HAS_SINK:
                den = den + tl.exp(sink - m_safe)
            row_o = OP + b64 * stride_pb + h64 * stride_ph + qi64 * stride_pm
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            for sp in range(0, num_splits):
                w_s = tl.sum(tl.where(offs_s[None, :] == sp, w, 0.0), 1)
                o_p = tl.load(row_o[:, None] + sp * stride_ps + offs_d[None, :], mask=q_ok[:, None], other=0.0,
                              cache_modifier=".cg")
                acc += o_p * w_s[:, None]
            has = den > 0
            den_safe = tl.where(has, den, 1.0)
            out = acc / den_safe[:, None]
            lse = tl.where(has, m_safe + tl.log(den_safe), float("-inf"))
            o_ptrs = O + b64 * stride_ob + h64[:, None] * stride_oh + qi64[:, None] * stride_om + offs_d[None, :]
            tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=q_ok[:, None])
            tl.store(LSE + b64 * stride_lb + h64 * stride_lh + qi64 * stride_lm, lse, mask=q_ok)
        else:
            for r in range(0, BLOCK_M):
                qi = qi0 + r % ROWS
                if qi < Sq:
                    h = (head0 + r // ROWS).to(tl.int64)
                    q64 = qi.to(tl.int64)
                    row_l = LP + b64 * stride_qb + h * stride_qh + q64 * stride_qm
                    row_o = OP + b64 * stride_pb + h * stride_ph + q64 * stride_pm
                    lse_p = tl.load(row_l + offs_s * stride_qs, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
                    o_p = tl.load(row_o + offs_s[:, None] * stride_ps + offs_d[None, :], mask=s_ok[:, None], other=0.0,
                                  cache_modifier=".cg")
                    out, lse = _merge_row(lse_p, o_p, SINK, h, HAS_SINK)
                    tl.store(O + b64 * stride_ob + h * stride_oh + q64 * stride_om + offs_d, out.to(O.dtype.element_ty))
                    tl.store(LSE + b64 * stride_lb + h * stride_lh + q64 * stride_lm, lse)


@triton.jit(do_not_specialize=("Sq", "num_splits"))
def _combine(
    OP, LP, O, LSE, SINK,
    stride_pb, stride_ph, stride_pm, stride_ps, stride_qb, stride_qh, stride_qm, stride_qs,
    stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm,
    Hq, Sq, num_splits,
    HEAD_DIM: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Merge ``num_splits`` partial results of one (b, h, i) row; the sink joins once here."""
    pid = tl.program_id(0)
    b = (pid // (Hq * Sq)).to(tl.int64)
    h = ((pid // Sq) % Hq).to(tl.int64)
    i = (pid % Sq).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    lse_p = tl.load(LP + b * stride_qb + h * stride_qh + i * stride_qm + offs_s * stride_qs, mask=s_ok, other=float("-inf"))
    o_p = tl.load(
        OP + b * stride_pb + h * stride_ph + i * stride_pm + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_ok[:, None], other=0.0,
    )
    out, lse = _merge_row(lse_p, o_p, SINK, h, HAS_SINK)
    tl.store(O + b * stride_ob + h * stride_oh + i * stride_om + offs_d, out.to(O.dtype.element_ty))
    tl.store(LSE + b * stride_lb + h * stride_lh + i * stride_lm, lse)


def _layout_axis_flags(t: torch.Tensor) -> tuple[int, int]:
    return int(t.shape[0] > 1), int(t.shape[1] > 1)


def check_sel_fast(sel_fast) -> None:
    """ValueError naming ``sel_fast`` unless it is one of the values ``layout_forward`` takes."""
    if sel_fast not in (None, False, True, 0, 1, 2):
        raise ValueError(f"sel_fast={sel_fast!r}: allowed are None (default), 0 / False, 1 / True and 2")


def mask_bytes(key_mask: torch.Tensor) -> torch.Tensor:
    """``key_mask (B, Skv)`` as the uint8 rows the kernels read (unit stride along the keys, any row
    stride, 0 for a broadcast row). A bool mask is reinterpreted in place, not copied: a decode step
    launches no conversion kernel per layer."""
    if key_mask.stride(-1) != 1:
        key_mask = key_mask.contiguous()
    return key_mask.view(torch.uint8) if key_mask.dtype == torch.bool else key_mask.to(torch.uint8)


def layout_forward(
    q, k, v, layout, *, pattern_id, params, causal, scale, softcap=None, sink_logits=None, key_mask=None, pack=1,
    num_splits=1, out=None, selection=None, num_warps=None, num_stages=None, use_tma=None, full_contig=None,
    order=None, fuse_combine=None, sel_fast=None, sel_prefetch=None, sel_lean=True, merge_rows=True,
):
    """Launch the Triton forward over a block layout (plus an optional token layout, split-KV with
    ``num_splits > 1``). ``dispatch.attention_forward`` decides when this kernel runs (``plan``).

    Args:
        q: ``(B, Hq, Sq, D)`` (any strides with unit last stride); k, v: ``(B, Hkv, Skv, D)`` likewise.
        layout: a ``BlockLayout`` with ``block_q == BLOCK_M // pack`` and ``block_k == BLOCK_N``.
        pack: query heads per program (divides ``Hq // Hkv``); ``BLOCK_M = pack * layout.block_q``.
        num_splits: split-KV factor (decode); results are merged by ``combine_splits``.
        out: optional ``(B, Hq, Sq, D)`` output view to write into (e.g. a ``(B, S, H, D)`` tensor's transpose).
        pattern_id, params, causal: the pattern as the kernels see it (``pattern_codes.pattern_code``).
        order: program order, see ``triton.structured`` (the layout path knows 0, query tiles fastest,
            and 2, heads fastest).
        fuse_combine: with ``num_splits > 1``, merge the splits in the last split program of each tile
            (one launch, a per-stream counter buffer, ``split_counters``) instead of a second kernel
            (``combine_splits``); default on (off inside a CUDA-graph capture on a stream that has no
            counters yet).
        sel_fast: skip the element rule on selected-key tiles that lie wholly behind every row's window
            (causal sliding_window / streaming static parts; see ``_selection_loop``): ``1`` (or True)
            checks each tile, ``2`` first checks all of a block's slots at once and each tile only when
            that fails, ``0`` (or False) never. Default: 2 without splits, 0 for split-KV decode (the
            faster setting of each on the H100: ``scripts/tune_decode.py``; docs/history.md).
        sel_prefetch: load the key indices of the next selected tile one iteration ahead, into
            registers (see ``_selection_loop``); ``False`` keeps the index load inside the iteration
            that uses it. Default: on without splits (the token prefill), off for split-KV decode: there
            the loop-carried index vector pushes the kernel past 255 registers (sm_90, triton 3.6, D=128,
            BLOCK_M=16, 64-key tiles, SparseK weights: 1,680 bytes of spill stack and about 700 local loads
            and stores a thread; without it 104 bytes, and none with 32-key tiles), while a decode program
            walks only a few tiles (``scripts/tune_decode.py --part static`` times both).
        merge_rows: the fused split merge (``_combine_last``) merges row by row, each row's splits in one load;
            ``False`` runs the former merge (one split a loop iteration), kept for A/B timing.
        sel_lean: gathered K and V tiles loaded row-major through one index vector, without a mask
            (slots past the count or outside the row's keys read key row 0, whose scores are masked
            and whose probabilities are 0, as for the out-of-window keys of a partial block tile).
    Returns: ``out (B, Hq, Sq, D)`` in q's dtype and memory order (``memory_order.new_output``) and
    ``lse (B, Hq, Sq)`` float32 (natural log, sink included).
    """
    check_sel_fast(sel_fast)
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if G % pack:
        raise ValueError(f"pack ({pack}) must divide the group size Hq // Hkv = {G}")
    block_m = layout.block_q * pack
    block_n = layout.block_k
    pid, is_causal = pattern_id, causal
    geo = layout.geometry
    dev = q.device
    NQ = -(-Sq // layout.block_q)  # plain ints: triton.cdiv is a JIT function, slow to call from Python
    fnum, fidx, pnum, pidx = layout.full_kv_num_blocks, layout.full_kv_indices, layout.kv_num_blocks, layout.kv_indices
    if fnum.stride() != pnum.stride():
        pnum = pnum.contiguous()
        fnum = fnum.contiguous()
    lay_b, lay_h = _layout_axis_flags(pnum)
    if out is None:
        out = new_output(q)
    lse = torch.empty(B, Hq, Sq, device=dev, dtype=torch.float32)
    sink = sink_logits if sink_logits is not None else lse
    kmask = mask_bytes(key_mask) if key_mask is not None else placeholder(dev, torch.uint8, 2)
    struct = bool(getattr(layout, "structured_decode", False))
    if struct:  # a ``decode_layout.DecodeLayout``: the kernel computes the tile runs (no index lists)
        if pid not in DECODE_PATTERNS or not is_causal:
            raise ValueError(f"a DecodeLayout runs a causal pattern with an id in {DECODE_PATTERNS}, got pattern id "
                             f"{pid} (causal={bool(is_causal)})")
        if pid == 4 and params[0] < 16:
            raise ValueError(f"a bigbird DecodeLayout runs on its decode code (block >= 16, the layer's seed: "
                             f"pattern_codes.decode_pattern_code), got params {tuple(params)}")
        max_tiles = int(layout.max_tiles)
        lay_b = lay_h = 0
    else:
        max_tiles = fidx.shape[-1] + pidx.shape[-1]
    if selection is not None:
        max_tiles += -(-selection.indices.shape[-1] // block_n)
    # bigbird with its code (``decode_pattern_code``: P0 its block) evaluates its rule in the kernel: over the
    # computed tiles of a decode step, or over listed tiles no wider than its block that straddle its blocks
    # (rows off the blocks, e.g. a left-padded batch); its prefill code (P0 = 0) runs aligned block tiles.
    bb_rule = pid == 4 and int(params[0]) > 0
    if bb_rule and not struct:
        check_bigbird_rule_tiles(params, layout.block_q, block_n)
    bb_random = int(params[1]) // BIGBIRD_RANDOM_SHIFT if bb_rule else 0  # random blocks drawn per query block
    bb_table, bb_stride, bb_nqb = lse, 0, 1  # (a placeholder: not read)
    if bb_rule and not struct and bb_random:  # listed tiles read the draws from bigbird's random table
        bb_table, bb_stride, bb_nqb = bigbird_rule_table(params, Hkv, Sq, Skv, dev)
    split = num_splits > 1
    tiles_per_split = -(-max_tiles // num_splits) if split else max_tiles
    if split:
        o_w = torch.empty(B, Hq, Sq, num_splits, D, device=dev, dtype=torch.float32)
        l_w = torch.empty(B, Hq, Sq, num_splits, device=dev, dtype=torch.float32)
        o_strides = (o_w.stride(0), o_w.stride(1), o_w.stride(2), o_w.stride(3))
        l_strides = (l_w.stride(0), l_w.stride(1), l_w.stride(2), l_w.stride(3))
    else:
        o_w, l_w = out, lse
        o_strides = (out.stride(0), out.stride(1), out.stride(2), 0)
        l_strides = (lse.stride(0), lse.stride(1), lse.stride(2), 0)
    # Defaults from the benchmark's tune section (docs/history.md, Triton tuning): D=128 with 128x128
    # tiles, 8 warps, 2 stages; D=64 with 128x128, 4 warps, 3 stages.
    if num_warps is None:
        num_warps = 4 if block_m * block_n <= 64 * 64 or D != 128 else 8
    if num_stages is None:
        num_stages = 2 if D > 128 or (block_m * block_n >= 128 * 128 and D > 64) else 3
    if order not in (None, 0, 2):
        raise ValueError(f"order={order!r}: the layout path runs order 0 (query tiles fastest) or 2 (heads fastest)")
    heads_first = order == 2
    grid = (NQ, B * Hkv * (G // pack), num_splits)
    if heads_first:
        grid = (grid[1], grid[0], num_splits)
    if use_tma is None:  # decode: descriptor set-up costs more than it saves; selections gather rows
        use_tma = tma_ok(k, v) and not split and pack == 1 and selection is None
    sel_args = selection_args(selection, dev)
    sel_k = selection.indices.shape[-1] if selection is not None else 1
    fast = 0
    if selection is not None and bool(is_causal) and pid in (1, 2):
        fast = int(2 if sel_fast is None and not split else (sel_fast or 0))
    if struct:
        full_contig = False
    elif full_contig is None:
        full_contig = full_tiles_contiguous(layout)
    k_arg, v_arg = (kv_descriptor(k, block_n), kv_descriptor(v, block_n)) if use_tma else (k, v)
    sem = split_counters(dev, grid[0] * grid[1]) if split and fuse_combine is not False else None
    fuse = sem is not None
    if not fuse:
        sem = lse
    launch(
        _attn_fwd, grid,
        q, k_arg, v_arg, o_w, l_w, sink, kmask, geo.q_start, geo.k_start, geo.k_end,
        fnum, fidx, pnum, pidx,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        *o_strides[:3], o_strides[3], *l_strides[:3], l_strides[3],
        pnum.stride(0), pnum.stride(1), pnum.stride(2), fidx.stride(0), fidx.stride(1), fidx.stride(2),
        pidx.stride(0), pidx.stride(1), pidx.stride(2),
        kmask.stride(0), int(geo.rows > 1), *sel_args, sel_k,
        Sq, Skv, Hkv, G, scale * LOG2E, float(softcap or 1.0), *params, tiles_per_split,
        bb_table, bb_stride, bb_nqb,
        out, lse, sem, out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        PATTERN=pid, CAUSAL=bool(is_causal), PACK=pack, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D,
        EVEN_N=struct or (Skv % block_n == 0), HAS_SOFTCAP=softcap is not None, HAS_SINK=sink_logits is not None,
        HAS_KMASK=key_mask is not None, SPLIT=split, LAYOUT_B=lay_b, LAYOUT_H=lay_h, USE_TMA=use_tma,
        FULL_CONTIG=bool(full_contig), HAS_SEL=selection is not None,
        HAS_SELW=selection is not None and selection.weights is not None, HEADS_FIRST=heads_first,
        FUSE_COMBINE=fuse, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        SEL_FAST=fast, SEL_SCAN=max(16, min(2048, triton.next_power_of_2(sel_k))),
        SEL_PREFETCH=bool(not split if sel_prefetch is None else sel_prefetch) and selection is not None,
        SEL_LEAN=bool(sel_lean) and selection is not None,
        DIL_SCALES=int(params[1]) if pid == 5 and params[1] <= MAX_UNROLLED_SCALES else 0, STRUCT=struct,
        BB_RANDOM=bb_random, BB_SLOTS=max(1, triton.next_power_of_2(bb_random)), BB_RULE=bb_rule and not struct,
        MERGE_ROWS=bool(merge_rows),
        num_warps=num_warps, num_stages=num_stages,
    )
    if split and not fuse:
        combine_splits(o_w, l_w, out, lse, sink_logits)
    return out, lse


def check_bigbird_rule_tiles(params, block_q: int, block_k: int) -> None:
    """ValueError unless ``block_q x block_k`` tiles can carry bigbird's rule (its code ``params``): a tile then
    spans at most two of its blocks each way (``_bigbird_tile_rule``)."""
    if block_q > params[0] or block_k > params[0]:
        raise ValueError(f"bigbird's rule in the kernel needs tiles of at most its block ({params[0]}), got "
                         f"{block_q}x{block_k}")


def bigbird_rule_table(params, Hkv: int, Sq: int, Skv: int, device):
    """``(table, row stride, query blocks)``: bigbird's random draws (its code ``params``) as the kernels over
    listed tiles read them (``_bigbird_ok_table``), rows for every query block a row of ``Sq`` queries over ``Skv``
    keys may sit in."""
    nqb = -(-(Skv + Sq) // int(params[0])) + 1
    table = bigbird_code_draws(params, Hkv, nqb, device)
    return table, table.stride(0), nqb


def combine_splits(o_part, lse_part, out, lse, sink_logits=None):
    """Merge split-KV partials ``o_part (B, Hq, Sq, S, D)`` fp32, ``lse_part (B, Hq, Sq, S)`` into ``out``/``lse``."""
    B, Hq, Sq, S, D = o_part.shape
    sink = sink_logits if sink_logits is not None else lse
    _combine[(B * Hq * Sq,)](
        o_part, lse_part, out, lse, sink,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2), lse_part.stride(3),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        Hq, Sq, S, HEAD_DIM=D, HAS_SINK=sink_logits is not None, BLOCK_S=max(2, triton.next_power_of_2(S)),
        num_warps=4,
    )
    return out, lse


def check_head_dim(d: int) -> bool:
    return d in (16, 32, 64, 128, 256)

