"""Structured backward for dense, sliding-window, streaming and block-diagonal patterns (tile ranges by
arithmetic).

The companion of ``triton.structured`` for the gradients, in the FlashAttention-2 scheme with
*separate* tile shapes for the two kernels:

* ``_st_dkdv``: one program per (key tile of ``BLOCK_N1`` keys, batch row, KV head); it walks the
  query tiles (``BLOCK_M1`` rows) that see its keys for every query head of the KV group, so dK/dV
  of a GQA group are summed in registers. Two loops, each over (query head, query tile) pairs
  flattened into one index: one masked loop over both edges (the causal diagonal / keys before
  ``k_start`` and the window end), one unmasked loop over the full run — the software pipeline
  fills and drains twice per program, not twice per head.
* ``_st_dq``: one program per (query tile of ``BLOCK_M2`` rows, batch row, query head) over the
  forward's key ranges (``BLOCK_N2`` keys per tile): one masked loop over the sink tiles and both
  window edges, one unmasked loop over the full tiles.
* With ``atomic_dq`` the dK/dV kernel also adds each tile's ``dS Q``-side product ``dS K`` into a
  float32 dQ buffer with atomic adds and ``_st_dq`` does not run: five matrix products per tile pair
  instead of seven (``Q K^T`` and ``dO V^T`` are not recomputed for dQ), at the price of the atomics.

Positions and in-tile indices are int32 (a query or key index, and an index times a row stride, stay
below 2**31; ``index64`` switches the offsets to int64 when they do not): int64 index tensors doubled
the registers of the masked tiles and made the kernels spill. Full tiles (every row and key inside
the tensors) load Q/dO (dK/dV kernel) and K/V (dQ kernel) through TMA descriptors on Hopper; masked
tiles use masked pointer loads.

For a key tile with valid keys ``kl..kh`` (key-index space) the queries (``q_start + i``) that see
some key, and those that see every key, are:

==================  ===========================  =====================================
 pattern             queries of some key          queries of every key
==================  ===========================  =====================================
 dense, causal       [kl, end)                    [kh, end)
 dense, bidir.       all                          all
 window W, causal    [kl, kh + W - 1]             [kh, kl + W - 1]
 window W, bidir.    [kl - W, kh + W]             [kh - W, kl + W]
 block B, causal     [kl, end(kh))                [kh, end(kl))
 block B, bidir.     [start(kl), end(kh))         [start(kh), end(kl))
==================  ===========================  =====================================

(``start(j)`` / ``end(j)``: the first index of the block holding position ``j`` / of the next block;
``rules._query_runs`` computes the table.)
A ``streaming`` key tile holding sink keys is seen by every later query: its whole range is masked.
Both kernels recompute ``P = exp2(S * scale * log2(e) - lse2)`` from ``bwd_preprocess``'s
``lse2 = lse * log2(e)`` (sink included; ``+inf`` for rows that see no key) and
``delta = rowsum(dO * O)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bwd import bwd_preprocess
from .fitting import launch
from .rules import LOG2E, _key_runs, _pattern_rule, _query_runs, _softcap
from .tma import kv_descriptor, tma_ok

__all__ = ["structured_backward", "bwd_config"]


@triton.jit
def _cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, Qd, DOd, DQd, Qh, DOh, LSEh, DELTAh, DQh, qrow0, m, offs_m, offs_d, stride_qm, stride_dom, stride_dqm,
    kpos, kval, qpos0, Sq, scale, scale_log2, softcap, P0, P1,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr, USE_TMA: tl.constexpr, INDEX64: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
):
    """Query tile ``m`` of one head against the program's key tile: ``dv += P^T dO``, ``dk += dS^T Q``
    (unscaled); with ``ATOMIC_DQ`` also ``dQ += dS K * scale`` by atomic adds (1: per element, 2: TMA
    reduce-add of the whole tile)."""
    qi = offs_m + m * BLOCK_M  # (BLOCK_M,) int32 query indices
    if INDEX64:
        qo = qi.to(tl.int64)
    else:
        qo = qi
    q_ok = qi < Sq
    if MASKED:
        q = tl.load(Qh + qo[:, None] * stride_qm + offs_d[None, :], mask=q_ok[:, None], other=0.0)
        do = tl.load(DOh + qo[:, None] * stride_dom + offs_d[None, :], mask=q_ok[:, None], other=0.0)
        lse2 = tl.load(LSEh + qi, mask=q_ok, other=float("inf"))
        delta = tl.load(DELTAh + qi, mask=q_ok, other=0.0)
    else:  # a full tile lies inside [0, Sq)
        if USE_TMA:
            row = (qrow0 + m * BLOCK_M).to(tl.int32)
            q = Qd.load([row, 0])
            do = DOd.load([row, 0])
        else:
            q = tl.load(Qh + qo[:, None] * stride_qm + offs_d[None, :])
            do = tl.load(DOh + qo[:, None] * stride_dom + offs_d[None, :])
        lse2 = tl.load(LSEh + qi)
        delta = tl.load(DELTAh + qi)
    sT = tl.dot(k, tl.trans(q))  # (BLOCK_N, BLOCK_M)
    if HAS_SOFTCAP:
        sT = _softcap(sT * (scale_log2 / 1.4426950408889634), softcap)
        tT = sT / softcap
        pT = tl.exp2(sT * 1.4426950408889634 - lse2[None, :])
    else:
        pT = tl.exp2(sT * scale_log2 - lse2[None, :])
    if MASKED:
        ok = _pattern_rule(qpos0 + qi[None, :], kpos[:, None], P0, P1, 0, 0, PATTERN, CAUSAL) & kval[:, None]
        pT = tl.where(ok, pT, 0.0)
    elif HAS_KMASK:
        pT = tl.where(kval[:, None], pT, 0.0)
    dv = tl.dot(pT.to(do.dtype), do, dv)
    dpT = tl.dot(v, tl.trans(do))
    dsT = pT * (dpT - delta[None, :])
    if HAS_SOFTCAP:
        dsT = dsT * (1.0 - tT * tT)
    dk = tl.dot(dsT.to(q.dtype), q, dk)
    if ATOMIC_DQ == 1:
        dq_c = tl.dot(tl.trans(dsT.to(k.dtype)), k) * scale  # (BLOCK_M, D)
        tl.atomic_add(DQh + qo[:, None] * stride_dqm + offs_d[None, :], dq_c, mask=q_ok[:, None], sem="relaxed")
    elif ATOMIC_DQ == 2:  # TMA reduce-add; rows past Sq add exact zeros (their P is 0)
        dq_c = tl.dot(tl.trans(dsT.to(k.dtype)), k) * scale
        DQd.atomic_add([(qrow0 + m * BLOCK_M).to(tl.int32), 0], dq_c)
    return dk, dv


@triton.jit
def _st_dkdv(
    Q, K, V, DO, LSE2, DELTA, DK, DV, DQ32, Qd, DOd, Kd, Vd, DQd, KMASK, QSTART, KSTART, KEND,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqm, stride_kmb, geo_stride,
    Sq, Skv, Hq, Hkv, G, scale, scale_log2, softcap, P0, P1,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr, USE_TMA: tl.constexpr,
    INDEX64: tl.constexpr, ATOMIC_DQ: tl.constexpr, KV_TMA: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    hkv = (pid_bh % Hkv).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kidx = offs_n + pid_n * BLOCK_N  # (BLOCK_N,) int32 key indices
    if INDEX64:
        ko = kidx.to(tl.int64)
    else:
        ko = kidx
    kin = kidx < Skv
    if KV_TMA:  # every key tile inside [0, Skv): K/V straight to shared memory
        kv_row = ((b * Hkv + hkv) * Skv + pid_n * BLOCK_N).to(tl.int32)
        k = Kd.load([kv_row, 0])
        v = Vd.load([kv_row, 0])
    else:
        k = tl.load(K + b * stride_kb + hkv * stride_kh + ko[:, None] * stride_kn + offs_d[None, :], mask=kin[:, None], other=0.0)
        v = tl.load(V + b * stride_vb + hkv * stride_vh + ko[:, None] * stride_vn + offs_d[None, :], mask=kin[:, None], other=0.0)
    gb = b * geo_stride
    q_start = tl.load(QSTART + gb)
    k_start = tl.load(KSTART + gb)
    k_end = tl.load(KEND + gb)
    kpos = kidx - k_start.to(tl.int32)  # positions (design §3), int32
    kval = (kpos >= 0) & (kpos < (k_end - k_start).to(tl.int32))
    if HAS_KMASK:
        kval = kval & (tl.load(KMASK + b * stride_kmb + ko, mask=kin, other=0) != 0)
    qpos0 = (q_start - k_start).to(tl.int32)

    # Query ranges (key-index space) of this key tile, table in the module docstring.
    t_lo = pid_n * BLOCK_N
    t_hi = t_lo + BLOCK_N - 1
    kl = tl.maximum(t_lo, k_start)
    kh = tl.minimum(t_hi, k_end - 1)
    whole = (t_lo >= k_start) & (t_hi < k_end)  # every key of the tile valid
    big = Sq + q_start + 1  # past the last query
    a_lo, a_hi, f_lo, f_hi = _query_runs(kl, kh, k_start, q_start, big, P0, P1, PATTERN, CAUSAL)
    if kl > kh:
        a_hi = a_lo
    if not whole:
        f_hi = f_lo
    # to query-tile indices (query tensor index i = key index - q_start), clipped to [0, NQ)
    NQ = _cdiv(Sq, BLOCK_M)
    NQ_FULL = Sq // BLOCK_M  # full tiles must hold Sq rows only (unmasked loads)
    i_lo = tl.maximum(a_lo - q_start, 0)
    i_hi = tl.minimum(a_hi - q_start, Sq)
    m_lo = i_lo // BLOCK_M
    m_hi = tl.maximum(_cdiv(tl.maximum(i_hi, 0), BLOCK_M), m_lo)
    m_hi = tl.minimum(m_hi, NQ)
    m_lo = tl.minimum(m_lo, m_hi)
    fi_lo = tl.maximum(f_lo - q_start, 0)
    fi_hi = tl.minimum(f_hi - q_start, Sq)
    fm_lo = tl.minimum(tl.maximum(_cdiv(fi_lo, BLOCK_M), m_lo), m_hi)
    fm_hi = tl.minimum(tl.maximum(tl.maximum(fi_hi, 0) // BLOCK_M, fm_lo), tl.minimum(m_hi, NQ_FULL))
    fm_hi = tl.maximum(fm_hi, fm_lo)
    m_lo = m_lo.to(tl.int32)
    fm_lo = fm_lo.to(tl.int32)
    fm_hi = fm_hi.to(tl.int32)
    m_hi = m_hi.to(tl.int32)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    n_left = fm_lo - m_lo
    n_mask = n_left + m_hi - fm_hi
    n_full = fm_hi - fm_lo
    nm = tl.maximum(n_mask, 1)
    nf = tl.maximum(n_full, 1)
    # masked tiles of every query head of the group: step t -> (head gi, tile)
    for t in range(0, G * n_mask):
        gi = t // nm
        tt = t - gi * nm
        m = tl.where(tt < n_left, m_lo + tt, fm_hi + tt - n_left)
        head = hkv * G + gi
        dk, dv = _dkdv_tile(
            dk, dv, k, v, Qd, DOd, DQd, Q + b * stride_qb + head * stride_qh, DO + b * stride_dob + head * stride_doh,
            LSE2 + (b * Hq + head) * Sq, DELTA + (b * Hq + head) * Sq, DQ32 + b * stride_dqb + head * stride_dqh,
            (b * Hq + head) * Sq, m, offs_m, offs_d, stride_qm, stride_dom, stride_dqm,
            kpos, kval, qpos0, Sq, scale, scale_log2, softcap, P0, P1,
            PATTERN, CAUSAL, BLOCK_M, True, HAS_SOFTCAP, HAS_KMASK, USE_TMA, INDEX64, ATOMIC_DQ,
        )
    for t in range(0, G * n_full):
        gi = t // nf
        m = fm_lo + t - gi * nf
        head = hkv * G + gi
        dk, dv = _dkdv_tile(
            dk, dv, k, v, Qd, DOd, DQd, Q + b * stride_qb + head * stride_qh, DO + b * stride_dob + head * stride_doh,
            LSE2 + (b * Hq + head) * Sq, DELTA + (b * Hq + head) * Sq, DQ32 + b * stride_dqb + head * stride_dqh,
            (b * Hq + head) * Sq, m, offs_m, offs_d, stride_qm, stride_dom, stride_dqm,
            kpos, kval, qpos0, Sq, scale, scale_log2, softcap, P0, P1,
            PATTERN, CAUSAL, BLOCK_M, False, HAS_SOFTCAP, HAS_KMASK, USE_TMA, INDEX64, ATOMIC_DQ,
        )
    dk = dk * scale
    tl.store(DK + b * stride_dkb + hkv * stride_dkh + ko[:, None] * stride_dkn + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kin[:, None])
    tl.store(DV + b * stride_dvb + hkv * stride_dvh + ko[:, None] * stride_dvn + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kin[:, None])


@triton.jit
def _dq_tile(
    dq, q, do, lse2, delta, Kd, Vd, Kb, Vb, kv_row0, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn,
    qpos, k_start32, kend_rel, scale_log2, softcap, P0, P1,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr, USE_TMA: tl.constexpr, INDEX64: tl.constexpr,
):
    kidx = offs_n + n * BLOCK_N  # (BLOCK_N,) int32 key indices
    kpos = kidx - k_start32
    if INDEX64:
        ko = kidx.to(tl.int64)
    else:
        ko = kidx
    if MASKED:
        kin = (kpos >= 0) & (kpos < kend_rel)
        k = tl.load(Kb + ko[:, None] * stride_kn + offs_d[None, :], mask=kin[:, None], other=0.0)
        v = tl.load(Vb + ko[:, None] * stride_vn + offs_d[None, :], mask=kin[:, None], other=0.0)
    elif USE_TMA:  # a full tile lies inside [k_start, k_end)
        row = (kv_row0 + n * BLOCK_N).to(tl.int32)
        k = Kd.load([row, 0])
        v = Vd.load([row, 0])
    else:
        k = tl.load(Kb + ko[:, None] * stride_kn + offs_d[None, :])
        v = tl.load(Vb + ko[:, None] * stride_vn + offs_d[None, :])
    s = tl.dot(q, tl.trans(k))
    if HAS_SOFTCAP:
        s = _softcap(s * (scale_log2 / 1.4426950408889634), softcap)
        t = s / softcap
        p = tl.exp2(s * 1.4426950408889634 - lse2[:, None])
    else:
        p = tl.exp2(s * scale_log2 - lse2[:, None])
    if MASKED:
        ok = _pattern_rule(qpos[:, None], kpos[None, :], P0, P1, 0, 0, PATTERN, CAUSAL)
        ok = ok & (kpos[None, :] < kend_rel)
        p = tl.where(ok, p, 0.0)
    if HAS_KMASK:
        km = tl.load(kmask_row + ko, mask=(kpos >= 0) & (kpos < kend_rel), other=0)
        p = tl.where(km[None, :] != 0, p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _st_dq(
    Q, K, V, Kd, Vd, DO, LSE2, DELTA, DQ, KMASK, QSTART, KSTART, KEND,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm, stride_kmb, geo_stride,
    Sq, Skv, Hq, Hkv, G, scale, scale_log2, softcap, P0, P1,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr, USE_TMA: tl.constexpr,
    INDEX64: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    head = (pid_bh % Hq).to(tl.int64)
    hkv = head // G
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    qi = offs_m + pid_m * BLOCK_M  # int32
    if INDEX64:
        qo = qi.to(tl.int64)
    else:
        qo = qi
    q_ok = qi < Sq
    q = tl.load(Q + b * stride_qb + head * stride_qh + qo[:, None] * stride_qm + offs_d[None, :], mask=q_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + head * stride_doh + qo[:, None] * stride_dom + offs_d[None, :], mask=q_ok[:, None], other=0.0)
    row0 = (b * Hq + head) * Sq
    lse2 = tl.load(LSE2 + row0 + qi, mask=q_ok, other=float("inf"))
    delta = tl.load(DELTA + row0 + qi, mask=q_ok, other=0.0)
    gb = b * geo_stride
    q_start = tl.load(QSTART + gb)
    k_start = tl.load(KSTART + gb)
    k_end = tl.load(KEND + gb)
    k_start32 = k_start.to(tl.int32)
    kend_rel = (k_end - k_start).to(tl.int32)
    qpos = qi + (q_start - k_start).to(tl.int32)
    qlo = q_start + pid_m * BLOCK_M
    qhi = q_start + tl.minimum(pid_m * BLOCK_M + BLOCK_M, Sq) - 1
    a_lo, a_hi, w_lo, w_hi = _key_runs(qlo, qhi, k_start, k_end, P0, PATTERN, CAUSAL)
    n_lo = a_lo // BLOCK_N
    n_hi = tl.maximum(_cdiv(a_hi, BLOCK_N), n_lo)
    f_lo = tl.minimum(tl.maximum(_cdiv(w_lo, BLOCK_N), n_lo), n_hi)
    f_hi = tl.minimum(tl.maximum(w_hi // BLOCK_N, f_lo), n_hi)
    Kb = K + b * stride_kb + hkv * stride_kh
    Vb = V + b * stride_vb + hkv * stride_vh
    kv_row0 = (b * Hkv + hkv) * Skv
    kmask_row = KMASK + b * stride_kmb

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    s_lo = n_lo
    s_hi = n_lo
    if PATTERN == 2:
        s_end = tl.minimum(tl.minimum(k_start + P1, k_end), qhi + 1)
        s_lo = tl.minimum(k_start // BLOCK_N, n_lo)
        s_hi = tl.maximum(tl.minimum(_cdiv(tl.maximum(s_end, k_start), BLOCK_N), n_lo), s_lo)
    c0 = (s_hi - s_lo).to(tl.int32)
    c1 = (f_lo - n_lo).to(tl.int32)
    s_lo = s_lo.to(tl.int32)
    n_lo = n_lo.to(tl.int32)
    f_lo = f_lo.to(tl.int32)
    f_hi = f_hi.to(tl.int32)
    n_hi = n_hi.to(tl.int32)
    for t in range(0, c0 + c1 + n_hi - f_hi):
        n = tl.where(t < c0 + c1, n_lo + t - c0, f_hi + t - c0 - c1)
        n = tl.where(t < c0, s_lo + t, n)
        dq = _dq_tile(
            dq, q, do, lse2, delta, Kd, Vd, Kb, Vb, kv_row0, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn,
            qpos, k_start32, kend_rel, scale_log2, softcap, P0, P1,
            PATTERN, CAUSAL, BLOCK_N, True, HAS_SOFTCAP, HAS_KMASK, USE_TMA, INDEX64,
        )
    for n in range(f_lo, f_hi):
        dq = _dq_tile(
            dq, q, do, lse2, delta, Kd, Vd, Kb, Vb, kv_row0, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn,
            qpos, k_start32, kend_rel, scale_log2, softcap, P0, P1,
            PATTERN, CAUSAL, BLOCK_N, False, HAS_SOFTCAP, HAS_KMASK, USE_TMA, INDEX64,
        )
    dq = dq * scale
    tl.store(DQ + b * stride_dqb + head * stride_dqh + qo[:, None] * stride_dqm + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=q_ok[:, None])


def bwd_config(head_dim: int, device_type: str):
    """``(BLOCK_N1, BLOCK_M1, warps1, stages1, BLOCK_M2, BLOCK_N2, warps2, stages2)`` of the two kernels."""
    if device_type != "cuda":
        return 16, 16, 4, 1, 16, 16, 4, 1
    if head_dim <= 128:  # 3 stages timed faster than 2 on the H100 (docs/history.md, Triton tuning)
        return 128, 64, 8, 3, 128, 64, 8, 3
    return 64, 32, 4, 1, 64, 32, 4, 1


def _needs_int64(*pairs) -> bool:
    """Whether an index times its row stride can reach 2**31 (``pairs``: (rows, row stride))."""
    return any((rows + 256) * max(stride, 1) >= 2**31 for rows, stride in pairs)


def structured_backward(
    do, q, k, v, out, lse, geometry, *, pattern_id, params, causal, scale, softcap=None, sink_logits=None,
    key_mask=None, config=None, use_tma=False, kv_tma=None, dq_tma=False, atomic_dq=False, index64=None, prep=None,
):
    """Gradients of the structured forward: ``dq, dk, dv`` (input dtypes) and ``dsink (Hq,)`` or None.

    Args:
        do, q, out: ``(B, Hq, Sq, D)``; k, v: ``(B, Hkv, Skv, D)`` (unit last stride); lse ``(B, Hq, Sq)``
            float32 from the forward (natural log, sink included).
        config: ``bwd_config``'s tuple (tile sizes, warps and stages of the dK/dV and dQ kernels).
        use_tma: TMA loads in the dK/dV kernel (its K/V tile, and Q/dO of the full tiles); ``None``: on
            Hopper when Q/dO/K/V are contiguous. Off by default, the configuration timed fastest as a
            whole on the H100 (``scripts/benchmark_kernels.py --section tune_structured_bwd``; numbers in
            docs/history.md): TMA speeds up the dK/dV kernel and slows down the dQ kernel, so
            ``use_tma=None`` with ``dq_tma=False`` may be faster still (not timed as a whole).
        kv_tma: the dK/dV kernel's own K/V tile by TMA straight into shared memory (``None``: as
            ``use_tma``; only when ``Skv`` is a multiple of ``BLOCK_N1``). With pointer loads for Q/dO this
            compiles for sm_90 with a smaller spill stack (untimed).
        dq_tma: TMA loads of K/V in the dQ kernel's full tiles (only with ``use_tma``).
        atomic_dq: dQ by float32 atomic adds from the dK/dV kernel (``_st_dq`` does not run): True per
            element, ``"tma"`` by TMA reduce-adds of whole tiles (with ``use_tma``; else per element).
        index64: int64 in-tile offsets (default: only where an index times a stride reaches 2**31).
        prep: ``bwd_preprocess(do, out, lse)``'s ``(delta, lse2)`` if already computed.
    """
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    dev = q.device
    do = do.contiguous() if do.stride(-1) != 1 else do
    delta, lse2 = prep if prep is not None else bwd_preprocess(do, out, lse)
    geo = geometry
    kmask = key_mask.to(torch.uint8) if key_mask is not None else torch.empty(1, 1, device=dev, dtype=torch.uint8)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    bn1, bm1, w1, s1, bm2, bn2, w2, s2 = config if config is not None else bwd_config(D, dev.type)
    if use_tma is None:
        use_tma = tma_ok(q, do) and tma_ok(k, v)
    use_tma = bool(use_tma) and tma_ok(q, do) and tma_ok(k, v)
    if index64 is None:
        index64 = _needs_int64((Sq, q.stride(2)), (Sq, do.stride(2)), (Skv, k.stride(2)), (Skv, v.stride(2)),
                               (Sq, Hq * D), (Skv, D))
    flags = dict(PATTERN=pattern_id, CAUSAL=bool(causal), HEAD_DIM=D, HAS_SOFTCAP=softcap is not None,
                 HAS_KMASK=key_mask is not None, INDEX64=bool(index64))
    dq_tma = bool(use_tma) and bool(dq_tma)
    P0, P1 = int(params[0]), int(params[1])
    geo_stride = int(geo.q_start.shape[0] > 1)
    if atomic_dq:
        dq_acc = torch.zeros(B, Hq, Sq, D, device=dev, dtype=torch.float32)
    else:
        dq_acc = torch.empty(1, 1, 1, 1, device=dev, dtype=torch.float32)
    atomic_mode = 0
    if atomic_dq:
        atomic_mode = 2 if (atomic_dq == "tma" and use_tma) else 1
    dqd = kv_descriptor(dq_acc, bm1) if atomic_mode == 2 else dq_acc
    qd, dod = (kv_descriptor(q, bm1), kv_descriptor(do, bm1)) if use_tma else (q, do)
    kv_tma = bool(use_tma if kv_tma is None else kv_tma) and Skv % bn1 == 0 and tma_ok(k, v)
    kd1, vd1 = (kv_descriptor(k, bn1), kv_descriptor(v, bn1)) if kv_tma else (k, v)
    launch(
        _st_dkdv, (triton.cdiv(Skv, bn1), B * Hkv),
        q, k, v, do, lse2, delta, dk, dv, dq_acc, qd, dod, kd1, vd1, dqd, kmask, geo.q_start, geo.k_start, geo.k_end,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2), dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        dq_acc.stride(0), dq_acc.stride(1), dq_acc.stride(2), kmask.stride(0), geo_stride,
        Sq, Skv, Hq, Hkv, G, scale, scale * LOG2E, float(softcap or 1.0), P0, P1,
        BLOCK_M=bm1, BLOCK_N=bn1, ATOMIC_DQ=atomic_mode, KV_TMA=kv_tma, USE_TMA=bool(use_tma), num_warps=w1,
        num_stages=s1, **flags,
    )
    if atomic_dq:
        dq = torch.empty_like(q).copy_(dq_acc)
    else:
        dq = torch.empty_like(q)
        kd, vd = (kv_descriptor(k, bn2), kv_descriptor(v, bn2)) if dq_tma else (k, v)
        launch(
            _st_dq, (triton.cdiv(Sq, bm2), B * Hq),
            q, k, v, kd, vd, do, lse2, delta, dq, kmask, geo.q_start, geo.k_start, geo.k_end,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            do.stride(0), do.stride(1), do.stride(2), dq.stride(0), dq.stride(1), dq.stride(2), kmask.stride(0), geo_stride,
            Sq, Skv, Hq, Hkv, G, scale, scale * LOG2E, float(softcap or 1.0), P0, P1,
            BLOCK_M=bm2, BLOCK_N=bn2, USE_TMA=dq_tma, num_warps=w2, num_stages=s2, **flags,
        )
    dsink = None
    if sink_logits is not None:
        p_sink = torch.exp(sink_logits.float().view(1, Hq, 1) - lse)
        dsink = -(p_sink * delta).sum((0, 2))
    return dq, dk, dv, dsink
