"""Structured backward for dense, sliding-window and streaming patterns (tile ranges by arithmetic).

The companion of ``triton_structured`` for the gradients, in the FlashAttention-2 scheme without
atomics and with *separate* tile shapes for the two kernels:

* ``_st_dkdv``: one program per (key tile of ``BLOCK_N1`` keys, batch row, KV head); for every query
  head of the KV group it walks the query tiles (``BLOCK_M1`` rows) that see its keys — one masked
  loop over both edges (the causal diagonal / keys before ``k_start`` and the window end), one
  unmasked loop over the full run — so dK/dV of a GQA group are summed in registers.
* ``_st_dq``: one program per (query tile of ``BLOCK_M2`` rows, batch row, query head) over the
  forward's key ranges (``BLOCK_N2`` keys per tile): one masked loop over the sink tiles and both
  window edges, one unmasked loop over the full tiles.

Two loops rather than one per run: compiled for sm_90 (triton 3.9, 64x64 tiles, 4 warps) the
three-loop dK/dV kernel needed a 3688-byte stack frame of spills, the two-loop one 504 bytes (dQ:
512 -> 112).

For a key tile with valid keys ``kl..kh`` (key-index space) the queries (``q_start + i``) that see
some key, and those that see every key, are:

==================  ===========================  =====================================
 pattern             queries of some key          queries of every key
==================  ===========================  =====================================
 dense, causal       [kl, end)                    [kh, end)
 dense, bidir.       all                          all
 window W, causal    [kl, kh + W - 1]             [kh, kl + W - 1]
 window W, bidir.    [kl - W, kh + W]             [kh - W, kl + W]
==================  ===========================  =====================================

A ``streaming`` key tile holding sink keys is seen by every later query: its whole range is masked.
Both kernels recompute ``P = exp(S - lse)`` from the forward's LSE (sink included) with
``delta = rowsum(dO * O)``, like ``triton_bwd``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_fwd import LOG2E, _pattern_rule, _softcap

__all__ = ["structured_backward"]


@triton.jit
def _cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, Qh, DOh, LSEh, DELTAh, m, offs_m, offs_d, stride_qm, stride_dom, stride_lm,
    kidx, keyok, q_start, k_start, k_end, Sq, scale_log2, softcap, P0, P1,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr,
):
    """Query tile ``m`` against the program's key tile: ``dv += P^T dO``, ``dk += dS^T Q`` (unscaled)."""
    qi = offs_m.to(tl.int64) + m * BLOCK_M
    if MASKED:
        q_ok = qi < Sq
        q = tl.load(Qh + qi[:, None] * stride_qm + offs_d[None, :], mask=q_ok[:, None], other=0.0)
        do = tl.load(DOh + qi[:, None] * stride_dom + offs_d[None, :], mask=q_ok[:, None], other=0.0)
        lse = tl.load(LSEh + qi * stride_lm, mask=q_ok, other=float("inf"))
        delta = tl.load(DELTAh + qi * stride_lm, mask=q_ok, other=0.0)
    else:
        q = tl.load(Qh + qi[:, None] * stride_qm + offs_d[None, :])
        do = tl.load(DOh + qi[:, None] * stride_dom + offs_d[None, :])
        lse = tl.load(LSEh + qi * stride_lm)
        delta = tl.load(DELTAh + qi * stride_lm)
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    sT = tl.dot(k, tl.trans(q))  # (BLOCK_N, BLOCK_M)
    if HAS_SOFTCAP:
        sT = _softcap(sT * (scale_log2 / 1.4426950408889634), softcap)
        tT = sT / softcap
        sT = sT * 1.4426950408889634
        pT = tl.exp2(sT - lse[None, :])
    else:
        pT = tl.exp2(sT * scale_log2 - lse[None, :])
    if MASKED:
        qidx = q_start + qi
        ok = _pattern_rule(qidx[None, :] - k_start, kidx[:, None] - k_start, P0, P1, 0, 0, PATTERN, CAUSAL)
        ok = ok & (kidx[:, None] < k_end)
        pT = tl.where(ok, pT, 0.0)
    if HAS_KMASK:
        pT = tl.where(keyok[:, None], pT, 0.0)
    dv = tl.dot(pT.to(do.dtype), do, dv)
    dpT = tl.dot(v, tl.trans(do))
    dsT = pT * (dpT - delta[None, :])
    if HAS_SOFTCAP:
        dsT = dsT * (1.0 - tT * tT)
    dk = tl.dot(dsT.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _st_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, KMASK, QSTART, KSTART, KEND,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_lb, stride_lh, stride_lm,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_kmb, geo_stride,
    Sq, Skv, Hkv, G, scale, scale_log2, softcap, P0, P1,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    hkv = (pid_bh % Hkv).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kidx = offs_n.to(tl.int64) + pid_n * BLOCK_N
    kin = kidx < Skv
    k = tl.load(K + b * stride_kb + hkv * stride_kh + kidx[:, None] * stride_kn + offs_d[None, :], mask=kin[:, None], other=0.0)
    v = tl.load(V + b * stride_vb + hkv * stride_vh + kidx[:, None] * stride_vn + offs_d[None, :], mask=kin[:, None], other=0.0)
    if HAS_KMASK:
        keyok = tl.load(KMASK + b * stride_kmb + kidx, mask=kin, other=0) != 0
    else:
        keyok = kin
    gb = b * geo_stride
    q_start = tl.load(QSTART + gb)
    k_start = tl.load(KSTART + gb)
    k_end = tl.load(KEND + gb)

    # Query ranges (key-index space) of this key tile, table in the module docstring.
    t_lo = pid_n * BLOCK_N
    t_hi = t_lo + BLOCK_N - 1
    kl = tl.maximum(t_lo, k_start)
    kh = tl.minimum(t_hi, k_end - 1)
    whole = (t_lo >= k_start) & (t_hi < k_end)  # every key of the tile valid
    big = Sq + q_start + 1  # past the last query
    if CAUSAL:
        a_lo = kl
        f_lo = kh
    else:
        a_lo = q_start
        f_lo = q_start
    a_hi = big
    f_hi = big
    if PATTERN != 0:
        if CAUSAL:
            a_hi = kh + P0  # exclusive: kh + W - 1 inclusive
            f_hi = kl + P0
        else:
            a_lo = kl - P0
            f_lo = kh - P0
            a_hi = kh + P0 + 1
            f_hi = kl + P0 + 1
        if PATTERN == 2:
            if kl < k_start + P1:  # holds sink keys: every later query sees them
                a_hi = big
                f_hi = f_lo
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

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    n_left = fm_lo - m_lo
    n_mask = n_left + m_hi - fm_hi
    for gi in range(0, G):
        head = hkv * G + gi
        Qh = Q + b * stride_qb + head * stride_qh
        DOh = DO + b * stride_dob + head * stride_doh
        LSEh = LSE + b * stride_lb + head * stride_lh
        DELTAh = DELTA + b * stride_lb + head * stride_lh
        for t in range(0, n_mask):
            m = tl.where(t < n_left, m_lo + t, fm_hi + t - n_left)
            dk, dv = _dkdv_tile(
                dk, dv, k, v, Qh, DOh, LSEh, DELTAh, m, offs_m, offs_d, stride_qm, stride_dom, stride_lm,
                kidx, keyok, q_start, k_start, k_end, Sq, scale_log2, softcap, P0, P1,
                PATTERN, CAUSAL, BLOCK_M, True, HAS_SOFTCAP, HAS_KMASK,
            )
        for m in range(fm_lo, fm_hi):
            dk, dv = _dkdv_tile(
                dk, dv, k, v, Qh, DOh, LSEh, DELTAh, m, offs_m, offs_d, stride_qm, stride_dom, stride_lm,
                kidx, keyok, q_start, k_start, k_end, Sq, scale_log2, softcap, P0, P1,
                PATTERN, CAUSAL, BLOCK_M, False, HAS_SOFTCAP, HAS_KMASK,
            )
    dk = dk * scale
    tl.store(DK + b * stride_dkb + hkv * stride_dkh + kidx[:, None] * stride_dkn + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kin[:, None])
    tl.store(DV + b * stride_dvb + hkv * stride_dvh + kidx[:, None] * stride_dvn + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kin[:, None])


@triton.jit
def _dq_tile(
    dq, q, do, lse, delta, Kb, Vb, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn,
    qpos, k_start, k_end, scale_log2, softcap, P0, P1,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr,
):
    kidx = offs_n.to(tl.int64) + n * BLOCK_N
    if MASKED:
        kin = (kidx >= k_start) & (kidx < k_end)
        k = tl.load(Kb + kidx[:, None] * stride_kn + offs_d[None, :], mask=kin[:, None], other=0.0)
        v = tl.load(Vb + kidx[:, None] * stride_vn + offs_d[None, :], mask=kin[:, None], other=0.0)
    else:
        k = tl.load(Kb + kidx[:, None] * stride_kn + offs_d[None, :])
        v = tl.load(Vb + kidx[:, None] * stride_vn + offs_d[None, :])
    s = tl.dot(q, tl.trans(k))
    if HAS_SOFTCAP:
        s = _softcap(s * (scale_log2 / 1.4426950408889634), softcap)
        t = s / softcap
        p = tl.exp2(s * 1.4426950408889634 - lse[:, None])
    else:
        p = tl.exp2(s * scale_log2 - lse[:, None])
    if MASKED:
        ok = _pattern_rule(qpos[:, None], (kidx - k_start)[None, :], P0, P1, 0, 0, PATTERN, CAUSAL)
        ok = ok & (kidx[None, :] < k_end)
        p = tl.where(ok, p, 0.0)
    if HAS_KMASK:
        km = tl.load(kmask_row + kidx, mask=kidx < k_end, other=0)
        p = tl.where(km[None, :] != 0, p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _st_dq(
    Q, K, V, DO, LSE, DELTA, DQ, KMASK, QSTART, KSTART, KEND,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_lb, stride_lh, stride_lm, stride_dqb, stride_dqh, stride_dqm,
    stride_kmb, geo_stride,
    Sq, Skv, Hq, G, scale, scale_log2, softcap, P0, P1,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    head = (pid_bh % Hq).to(tl.int64)
    hkv = head // G
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    qi = offs_m.to(tl.int64) + pid_m * BLOCK_M
    q_ok = qi < Sq
    q = tl.load(Q + b * stride_qb + head * stride_qh + qi[:, None] * stride_qm + offs_d[None, :], mask=q_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + head * stride_doh + qi[:, None] * stride_dom + offs_d[None, :], mask=q_ok[:, None], other=0.0)
    lse = tl.load(LSE + b * stride_lb + head * stride_lh + qi * stride_lm, mask=q_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(DELTA + b * stride_lb + head * stride_lh + qi * stride_lm, mask=q_ok, other=0.0)
    gb = b * geo_stride
    q_start = tl.load(QSTART + gb)
    k_start = tl.load(KSTART + gb)
    k_end = tl.load(KEND + gb)
    qpos = q_start + qi - k_start
    qlo = q_start + pid_m * BLOCK_M
    qhi = q_start + tl.minimum(pid_m * BLOCK_M + BLOCK_M, Sq) - 1
    a_lo = k_start
    w_lo = k_start
    if CAUSAL:
        a_hi = tl.minimum(k_end, qhi + 1)
        w_hi = tl.minimum(k_end, qlo + 1)
    else:
        a_hi = k_end
        w_hi = k_end
    if PATTERN != 0:
        if CAUSAL:
            a_lo = tl.maximum(k_start, qlo - P0 + 1)
            w_lo = tl.maximum(k_start, qhi - P0 + 1)
        else:
            a_lo = tl.maximum(k_start, qlo - P0)
            w_lo = tl.maximum(k_start, qhi - P0)
            a_hi = tl.minimum(k_end, qhi + P0 + 1)
            w_hi = tl.minimum(k_end, qlo + P0 + 1)
    a_hi = tl.maximum(a_hi, a_lo)
    n_lo = a_lo // BLOCK_N
    n_hi = tl.maximum(_cdiv(a_hi, BLOCK_N), n_lo)
    f_lo = tl.minimum(tl.maximum(_cdiv(w_lo, BLOCK_N), n_lo), n_hi)
    f_hi = tl.minimum(tl.maximum(w_hi // BLOCK_N, f_lo), n_hi)
    Kb = K + b * stride_kb + hkv * stride_kh
    Vb = V + b * stride_vb + hkv * stride_vh
    kmask_row = KMASK + b * stride_kmb

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    s_lo = n_lo
    s_hi = n_lo
    if PATTERN == 2:
        s_end = tl.minimum(tl.minimum(k_start + P1, k_end), qhi + 1)
        s_lo = tl.minimum(k_start // BLOCK_N, n_lo)
        s_hi = tl.maximum(tl.minimum(_cdiv(tl.maximum(s_end, k_start), BLOCK_N), n_lo), s_lo)
    c0 = s_hi - s_lo
    c1 = f_lo - n_lo
    for t in range(0, c0 + c1 + n_hi - f_hi):
        n = tl.where(t < c0 + c1, n_lo + t - c0, f_hi + t - c0 - c1)
        n = tl.where(t < c0, s_lo + t, n)
        dq = _dq_tile(
            dq, q, do, lse, delta, Kb, Vb, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn,
            qpos, k_start, k_end, scale_log2, softcap, P0, P1, PATTERN, CAUSAL, BLOCK_N, True, HAS_SOFTCAP, HAS_KMASK,
        )
    for n in range(f_lo, f_hi):
        dq = _dq_tile(
            dq, q, do, lse, delta, Kb, Vb, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn,
            qpos, k_start, k_end, scale_log2, softcap, P0, P1, PATTERN, CAUSAL, BLOCK_N, False, HAS_SOFTCAP, HAS_KMASK,
        )
    dq = dq * scale
    tl.store(DQ + b * stride_dqb + head * stride_dqh + qi[:, None] * stride_dqm + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=q_ok[:, None])


def bwd_config(head_dim: int, device_type: str):
    """``(BLOCK_N1, BLOCK_M1, warps1, stages1, BLOCK_M2, BLOCK_N2, warps2, stages2)`` of the two kernels."""
    if device_type != "cuda":
        return 16, 16, 4, 1, 16, 16, 4, 1
    if head_dim <= 64:
        return 128, 64, 8, 2, 128, 64, 8, 2
    if head_dim <= 128:
        return 128, 64, 8, 2, 128, 64, 8, 2
    return 64, 32, 4, 1, 64, 32, 4, 1


def structured_backward(
    do, q, k, v, out, lse, geometry, *, pattern_id, params, causal, scale, softcap=None, sink_logits=None,
    key_mask=None, config=None,
):
    """Gradients of the structured forward: ``dq, dk, dv`` (input dtypes) and ``dsink (Hq,)`` or None.

    ``config``: ``bwd_config``'s tuple (tile sizes, warps and stages of the dK/dV and dQ kernels).
    """
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    dev = q.device
    do = do.contiguous() if do.stride(-1) != 1 else do
    delta = (do.float() * out.float()).sum(-1).contiguous()
    lse = lse.contiguous()
    geo = geometry
    kmask = key_mask.to(torch.uint8) if key_mask is not None else torch.empty(1, 1, device=dev, dtype=torch.uint8)
    dq = torch.empty_like(q)
    dk = torch.empty(k.shape, device=dev, dtype=k.dtype)
    dv = torch.empty(v.shape, device=dev, dtype=v.dtype)
    bn1, bm1, w1, s1, bm2, bn2, w2, s2 = config if config is not None else bwd_config(D, dev.type)
    flags = dict(PATTERN=pattern_id, CAUSAL=bool(causal), HEAD_DIM=D, HAS_SOFTCAP=softcap is not None, HAS_KMASK=key_mask is not None)
    P0, P1 = int(params[0]), int(params[1])
    geo_stride = int(geo.q_start.shape[0] > 1)
    _st_dkdv[(triton.cdiv(Skv, bn1), B * Hkv)](
        q, k, v, do, lse, delta, dk, dv, kmask, geo.q_start, geo.k_start, geo.k_end,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2), kmask.stride(0), geo_stride,
        Sq, Skv, Hkv, G, scale, scale * LOG2E, float(softcap or 1.0), P0, P1,
        BLOCK_M=bm1, BLOCK_N=bn1, num_warps=w1, num_stages=s1, **flags,
    )
    _st_dq[(triton.cdiv(Sq, bm2), B * Hq)](
        q, k, v, do, lse, delta, dq, kmask, geo.q_start, geo.k_start, geo.k_end,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2), kmask.stride(0), geo_stride,
        Sq, Skv, Hq, G, scale, scale * LOG2E, float(softcap or 1.0), P0, P1,
        BLOCK_M=bm2, BLOCK_N=bn2, num_warps=w2, num_stages=s2, **flags,
    )
    dsink = None
    if sink_logits is not None:
        p_sink = torch.exp(sink_logits.float().view(1, Hq, 1) - lse)
        dsink = -(p_sink * delta).sum((0, 2))
    return dq, dk, dv, dsink
