"""Block-sparse attention backward in Triton (dQ, dK, dV, and the sink-logit gradient).

FlashAttention-2 scheme without atomics:

* ``_attn_bwd_dkdv``: one program per (key tile, batch row, KV head); it walks the query tiles that
  visit its key tile (the *transposed* layout, full and partial tiles in separate loops) for every
  query head of the KV group, so dK/dV of a GQA group are summed in registers.
* ``_attn_bwd_dq``: one program per (query tile, batch row, query head) over the forward layout.

A bigbird layout over tiles that straddle its blocks (``BB_RULE``: its code's parameters, e.g. a left-padded
batch) evaluates bigbird's rule in the partial tiles, as the forward does (``fwd._bigbird_ok_table``).

Both recompute ``P = exp(S - lse)`` from the forward's LSE (which includes the sink logit, so the
sink's share of the denominator is already accounted for), with ``delta = rowsum(dO * O)``.
The sink gradient is ``dsink_h = -sum_i exp(sink_h - lse_i) * delta_i`` (computed with torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...layouts.block_layout import transposed_layout
from ..launch_buffers import selection_args
from ..pattern_codes import BIGBIRD_RANDOM_SHIFT
from .fitting import launch
from .fwd import _BB_SHIFT, _bigbird_ok_table, _bigbird_tile_rows, bigbird_rule_table, check_bigbird_rule_tiles
from .rules import LOG2E, _floordiv, _pattern_rule, _softcap

__all__ = ["bwd_preprocess", "layout_backward"]


@triton.jit
def _bwd_prep(
    O, DO, LSE, DELTA, LSE2, stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm, Hq, Sq, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """``delta = rowsum(dO * O)`` and ``lse2 = lse * log2(e)`` (``+inf`` where ``lse = -inf``) of
    ``BLOCK`` rows of one (batch row, head), written contiguously ``(B, Hq, Sq)``."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    rows = pid_m.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < Sq
    offs_d = tl.arange(0, HEAD_DIM)
    o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dom + offs_d[None, :], mask=ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + rows * stride_lm, mask=ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    dst = pid_bh.to(tl.int64) * Sq + rows
    tl.store(DELTA + dst, delta, mask=ok)
    tl.store(LSE2 + dst, lse2, mask=ok)


def bwd_preprocess(do, out, lse):
    """One pass over ``dO`` and ``O``: ``delta = rowsum(dO * O)`` float32 ``(B, Hq, Sq)`` and
    ``lse2 = lse * log2(e)`` (``+inf`` for rows that see no key, so that ``exp2(s - lse2) = 0``), both
    contiguous. (The float32 copies of ``torch``'s ``(do.float() * out.float()).sum(-1)`` moved ~14
    bytes per element, this kernel 4.)"""
    B, Hq, Sq, D = out.shape
    delta = torch.empty(B, Hq, Sq, device=out.device, dtype=torch.float32)
    lse2 = torch.empty_like(delta)
    block = max(16, min(128, 8192 // D))
    _bwd_prep[(triton.cdiv(Sq, block), B * Hq)](
        out, do, lse, delta, lse2, out.stride(0), out.stride(1), out.stride(2), do.stride(0), do.stride(1), do.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2), Hq, Sq, BLOCK=block, HEAD_DIM=D, num_warps=4,
    )
    return delta, lse2


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, Qh, DOh, LSEh, DELTAh, m, offs_m, offs_d, stride_qm, stride_dom, stride_lm,
    kidx, kin, keyok, q_start, k_start, k_end, Sq, scale_log2, softcap, P0, P1, P2, P3,
    n, offs_n, BBT, bb_head, BB_NQB,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_FULL: tl.constexpr,
    EVEN_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr, BB_RULE: tl.constexpr,
    BB_RANDOM: tl.constexpr,
):
    """dK, dV of key tile ``n`` (keys ``kidx``) from query tile ``m``; with ``BB_RULE`` the tile is a partial one
    of a bigbird layout whose rule the kernel evaluates (the draws in ``BBT`` from row ``bb_head``)."""
    qi = m.to(tl.int64) * BLOCK_M + offs_m  # (BLOCK_M,)
    q_ok = qi < Sq
    q = tl.load(Qh + qi[:, None] * stride_qm + offs_d[None, :], mask=q_ok[:, None], other=0.0)
    do = tl.load(DOh + qi[:, None] * stride_dom + offs_d[None, :], mask=q_ok[:, None], other=0.0)
    lse = tl.load(LSEh + qi * stride_lm, mask=q_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(DELTAh + qi * stride_lm, mask=q_ok, other=0.0)
    sT = tl.dot(k, tl.trans(q))  # (BLOCK_N, BLOCK_M)
    if HAS_SOFTCAP:
        sT = _softcap(sT * (scale_log2 / 1.4426950408889634), softcap)
        tT = sT / softcap
        sT = sT * 1.4426950408889634
    else:
        sT = sT * scale_log2
    pT = tl.exp2(sT - lse[None, :])
    if IS_FULL:
        if not EVEN_N:
            pT = tl.where(kin[:, None], pT, 0.0)
    else:
        # int32 positions (lengths < 2**31): half the registers of int64 masks
        qpos = (q_start - k_start + qi).to(tl.int32)
        kpos = (kidx - k_start).to(tl.int32)
        k_ok = (kpos >= 0) & (kidx < k_end) & kin
        ok = _pattern_rule(qpos[None, :], kpos[:, None], P0, P1, P2, P3, PATTERN, CAUSAL) & k_ok[:, None]
        if BB_RULE:
            qb_lo, qb_hi, row_lo, row_hi = _bigbird_tile_rows(
                q_start + m * BLOCK_M, q_start + tl.minimum(m * BLOCK_M + BLOCK_M, Sq) - 1, k_start, P0, bb_head,
                BB_NQB, BB_RANDOM)
            extra = _bigbird_ok_table(qpos, n, offs_n, k_start, P0, P1 % _BB_SHIFT, P2, qb_lo, qb_hi, row_lo, row_hi,
                                      BBT, BB_RANDOM, BLOCK_N)  # (BLOCK_M, BLOCK_N)
            ok = ok & (tl.trans(extra.to(tl.int8)) != 0)
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
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, KMASK, QSTART, KSTART, KEND, FNUM, FIDX, PNUM, PIDX,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_lb, stride_lh, stride_lm,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_nb, stride_nh, stride_nm, stride_fb, stride_fh, stride_fm, stride_pb, stride_ph, stride_pm,
    stride_kmb, geo_stride,
    Sq, Skv, Hkv, G, scale, scale_log2, softcap, P0, P1, P2, P3, BBT, stride_bbh, BB_NQB,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, EVEN_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr,
    LAYOUT_B: tl.constexpr, LAYOUT_H: tl.constexpr, BB_RULE: tl.constexpr, BB_RANDOM: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    hkv = (pid_bh % Hkv).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kidx = pid_n.to(tl.int64) * BLOCK_N + offs_n
    kin = kidx < Skv
    k = tl.load(K + b * stride_kb + hkv * stride_kh + kidx[:, None] * stride_kn + offs_d[None, :], mask=kin[:, None], other=0.0)
    v = tl.load(V + b * stride_vb + hkv * stride_vh + kidx[:, None] * stride_vn + offs_d[None, :], mask=kin[:, None], other=0.0)
    if HAS_KMASK:
        keyok = tl.load(KMASK + b * stride_kmb + kidx, mask=kin, other=0) != 0
    else:
        keyok = kin
    g = b * geo_stride
    q_start = tl.load(QSTART + g)
    k_start = tl.load(KSTART + g)
    k_end = tl.load(KEND + g)

    lb = b * LAYOUT_B
    lh = hkv * LAYOUT_H
    n_full = tl.load(FNUM + lb * stride_nb + lh * stride_nh + pid_n * stride_nm)
    n_part = tl.load(PNUM + lb * stride_nb + lh * stride_nh + pid_n * stride_nm)
    fidx = FIDX + lb * stride_fb + lh * stride_fh + pid_n.to(tl.int64) * stride_fm
    pidx = PIDX + lb * stride_pb + lh * stride_ph + pid_n.to(tl.int64) * stride_pm

    bb_head = hkv * stride_bbh
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for gi in range(0, G):
        head = hkv * G + gi
        Qh = Q + b * stride_qb + head * stride_qh
        DOh = DO + b * stride_dob + head * stride_doh
        LSEh = LSE + b * stride_lb + head * stride_lh
        DELTAh = DELTA + b * stride_lb + head * stride_lh
        for t in range(0, n_full):
            m = tl.load(fidx + t)
            dk, dv = _dkdv_tile(
                dk, dv, k, v, Qh, DOh, LSEh, DELTAh, m, offs_m, offs_d, stride_qm, stride_dom, stride_lm,
                kidx, kin, keyok, q_start, k_start, k_end, Sq, scale_log2, softcap, P0, P1, P2, P3,
                pid_n, offs_n, BBT, bb_head, BB_NQB,
                PATTERN, CAUSAL, BLOCK_M, BLOCK_N, True, EVEN_N, HAS_SOFTCAP, HAS_KMASK, False, BB_RANDOM,
            )
        for t in range(0, n_part):
            m = tl.load(pidx + t)
            dk, dv = _dkdv_tile(
                dk, dv, k, v, Qh, DOh, LSEh, DELTAh, m, offs_m, offs_d, stride_qm, stride_dom, stride_lm,
                kidx, kin, keyok, q_start, k_start, k_end, Sq, scale_log2, softcap, P0, P1, P2, P3,
                pid_n, offs_n, BBT, bb_head, BB_NQB,
                PATTERN, CAUSAL, BLOCK_M, BLOCK_N, False, False, HAS_SOFTCAP, HAS_KMASK, BB_RULE, BB_RANDOM,
            )
    dk = dk * scale
    tl.store(DK + b * stride_dkb + hkv * stride_dkh + kidx[:, None] * stride_dkn + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kin[:, None])
    tl.store(DV + b * stride_dvb + hkv * stride_dvh + kidx[:, None] * stride_dvn + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kin[:, None])


@triton.jit
def _dq_tile(
    dq, q, do, lse, delta, Kb, Vb, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn,
    qidx, q_start, k_start, k_end, Skv, scale_log2, softcap, P0, P1, P2, P3,
    BBT, qb_lo, qb_hi, row_lo, row_hi,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, IS_FULL: tl.constexpr,
    EVEN_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr, BB_RULE: tl.constexpr,
    BB_RANDOM: tl.constexpr,
):
    """dQ of the program's query rows from key tile ``n``; with ``BB_RULE`` the tile is a partial one of a bigbird
    layout whose rule the kernel evaluates (the rows' query blocks ``qb_lo`` / ``qb_hi``, their draws in ``BBT``)."""
    kidx = n.to(tl.int64) * BLOCK_N + offs_n
    kin = kidx < Skv
    k = tl.load(Kb + kidx[:, None] * stride_kn + offs_d[None, :], mask=kin[:, None], other=0.0)
    v = tl.load(Vb + kidx[:, None] * stride_vn + offs_d[None, :], mask=kin[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k))
    if HAS_SOFTCAP:
        s = _softcap(s * (scale_log2 / 1.4426950408889634), softcap)
        t = s / softcap
        s = s * 1.4426950408889634
    else:
        s = s * scale_log2
    p = tl.exp2(s - lse[:, None])
    if IS_FULL:
        if not EVEN_N:
            p = tl.where(kin[None, :], p, 0.0)
    else:
        # int32 positions (lengths < 2**31): half the registers of int64 masks
        kpos = (kidx - k_start).to(tl.int32)
        k_ok = (kpos >= 0) & (kidx < k_end) & kin
        qpos = (qidx - k_start).to(tl.int32)
        ok = _pattern_rule(qpos[:, None], kpos[None, :], P0, P1, P2, P3, PATTERN, CAUSAL)
        if BB_RULE:
            ok = ok & _bigbird_ok_table(qpos, n, offs_n, k_start, P0, P1 % _BB_SHIFT, P2, qb_lo, qb_hi, row_lo,
                                        row_hi, BBT, BB_RANDOM, BLOCK_N)
        p = tl.where(ok & k_ok[None, :], p, 0.0)
    if HAS_KMASK:
        km = tl.load(kmask_row + kidx, mask=kin, other=0)
        p = tl.where(km[None, :] != 0, p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _dq_selection(
    dq, q, do, lse, delta, Kb, Vb, kmask_row, offs_n, offs_d, stride_kn, stride_vn, q_ok, qidx,
    k_start, k_end, Skv, scale, scale_log2, softcap, P0, P1, P2, P3, b, hkv,
    SEL_IDX, SEL_CNT, SEL_W, FIRST_BLOCK, stride_sib, stride_sih, stride_sin, stride_scb, stride_sch, stride_scn,
    stride_swb, stride_swh, stride_swn, NB, QB,
    DK32, DV32, DW32, stride_akb, stride_akh, stride_akn, stride_awb, stride_awh, stride_awn,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_SELW: tl.constexpr,
):
    """Selected keys (token layout): dQ in registers; dK, dV and the weight gradient by atomic adds
    into float32 buffers (a key may be selected by many query blocks). ``d w = d logit / w``."""
    qpos = qidx - k_start
    fb = tl.load(FIRST_BLOCK + b)
    sb_row = _floordiv(qpos, QB) - fb
    sb_lo = tl.maximum(tl.min(tl.where(q_ok, sb_row, 1 << 30), 0), 0)
    sb_hi = tl.minimum(tl.max(tl.where(q_ok, sb_row, -(1 << 30)), 0), NB - 1)
    for sb in range(sb_lo, sb_hi + 1):
        cnt = tl.load(SEL_CNT + b * stride_scb + hkv * stride_sch + sb * stride_scn)
        row_in = sb_row == sb
        for c in range(0, cnt, BLOCK_N):
            slot = c + offs_n
            s_ok = slot < cnt
            kidx = tl.load(SEL_IDX + b * stride_sib + hkv * stride_sih + sb * stride_sin + slot, mask=s_ok, other=-1).to(tl.int64)
            k_ok = s_ok & (kidx >= k_start) & (kidx < k_end) & (kidx >= 0) & (kidx < Skv)
            ksafe = tl.where(k_ok, kidx, 0)
            k = tl.load(Kb + ksafe[:, None] * stride_kn + offs_d[None, :], mask=k_ok[:, None], other=0.0)
            v = tl.load(Vb + ksafe[:, None] * stride_vn + offs_d[None, :], mask=k_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k))
            if HAS_SOFTCAP:
                s = _softcap(s * (scale_log2 / 1.4426950408889634), softcap)
                t = s / softcap
                s = s * 1.4426950408889634
            else:
                s = s * scale_log2
            if HAS_SELW:
                w = tl.load(SEL_W + b * stride_swb + hkv * stride_swh + sb * stride_swn + slot, mask=s_ok, other=0.0).to(tl.float32)
                k_ok = k_ok & (w > 0)
                s = s + tl.log2(tl.where(w > 0, w, 1.0))[None, :]
            if HAS_KMASK:
                km = tl.load(kmask_row + ksafe, mask=k_ok, other=0)
                k_ok = k_ok & (km != 0)
            static = _pattern_rule(qpos[:, None], (ksafe - k_start)[None, :], P0, P1, P2, P3, PATTERN, CAUSAL)
            ok = row_in[:, None] & k_ok[None, :] & (ksafe[None, :] <= qidx[:, None]) & ~static
            p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v))
            dlogit = p * (dp - delta[:, None])
            if HAS_SELW:
                dw = tl.sum(dlogit, 0) / tl.where(w > 0, w, 1.0)
                tl.atomic_add(DW32 + b * stride_awb + hkv * stride_awh + sb * stride_awn + slot, dw, mask=k_ok)
            if HAS_SOFTCAP:
                ds = dlogit * (1.0 - t * t)
            else:
                ds = dlogit
            dq = tl.dot(ds.to(k.dtype), k, dq)
            dv_c = tl.dot(tl.trans(p.to(do.dtype)), do)  # (BLOCK_N, D)
            dk_c = tl.dot(tl.trans(ds.to(q.dtype)), q) * scale
            a_ptr = b * stride_akb + hkv * stride_akh + ksafe[:, None] * stride_akn + offs_d[None, :]
            tl.atomic_add(DK32 + a_ptr, dk_c, mask=k_ok[:, None])
            tl.atomic_add(DV32 + a_ptr, dv_c, mask=k_ok[:, None])
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, KMASK, QSTART, KSTART, KEND, FNUM, FIDX, PNUM, PIDX,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_lb, stride_lh, stride_lm, stride_dqb, stride_dqh, stride_dqm,
    stride_nb, stride_nh, stride_nm, stride_fb, stride_fh, stride_fm, stride_pb, stride_ph, stride_pm,
    stride_kmb, geo_stride,
    SEL_IDX, SEL_CNT, SEL_W, FIRST_BLOCK, stride_sib, stride_sih, stride_sin, stride_scb, stride_sch, stride_scn,
    stride_swb, stride_swh, stride_swn, NB, QB,
    DK32, DV32, DW32, stride_akb, stride_akh, stride_akn, stride_awb, stride_awh, stride_awn,
    Sq, Skv, Hq, G, scale, scale_log2, softcap, P0, P1, P2, P3, BBT, stride_bbh, BB_NQB,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, EVEN_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr,
    LAYOUT_B: tl.constexpr, LAYOUT_H: tl.constexpr, HAS_SEL: tl.constexpr, HAS_SELW: tl.constexpr,
    BB_RULE: tl.constexpr, BB_RANDOM: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    head = (pid_bh % Hq).to(tl.int64)
    hkv = head // G
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    qi = pid_m.to(tl.int64) * BLOCK_M + offs_m
    q_ok = qi < Sq
    q = tl.load(Q + b * stride_qb + head * stride_qh + qi[:, None] * stride_qm + offs_d[None, :], mask=q_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + head * stride_doh + qi[:, None] * stride_dom + offs_d[None, :], mask=q_ok[:, None], other=0.0)
    lse = tl.load(LSE + b * stride_lb + head * stride_lh + qi * stride_lm, mask=q_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(DELTA + b * stride_lb + head * stride_lh + qi * stride_lm, mask=q_ok, other=0.0)
    g = b * geo_stride
    q_start = tl.load(QSTART + g)
    k_start = tl.load(KSTART + g)
    k_end = tl.load(KEND + g)
    qidx = q_start + qi
    Kb = K + b * stride_kb + hkv * stride_kh
    Vb = V + b * stride_vb + hkv * stride_vh
    kmask_row = KMASK + b * stride_kmb

    lb = b * LAYOUT_B
    lh = hkv * LAYOUT_H
    n_full = tl.load(FNUM + lb * stride_nb + lh * stride_nh + pid_m * stride_nm)
    n_part = tl.load(PNUM + lb * stride_nb + lh * stride_nh + pid_m * stride_nm)
    fidx = FIDX + lb * stride_fb + lh * stride_fh + pid_m.to(tl.int64) * stride_fm
    pidx = PIDX + lb * stride_pb + lh * stride_ph + pid_m.to(tl.int64) * stride_pm
    if BB_RULE:  # bigbird's rule: the (at most two) query blocks of these rows and their rows of the random table
        qb_lo, qb_hi, row_lo, row_hi = _bigbird_tile_rows(
            q_start + pid_m * BLOCK_M, q_start + tl.minimum(pid_m * BLOCK_M + BLOCK_M, Sq) - 1, k_start, P0,
            hkv * stride_bbh, BB_NQB, BB_RANDOM)
    else:
        qb_lo = 0
        qb_hi = 0
        row_lo = 0
        row_hi = 0
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for t in range(0, n_full):
        n = tl.load(fidx + t)
        dq = _dq_tile(
            dq, q, do, lse, delta, Kb, Vb, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn,
            qidx, q_start, k_start, k_end, Skv, scale_log2, softcap, P0, P1, P2, P3,
            BBT, qb_lo, qb_hi, row_lo, row_hi,
            PATTERN, CAUSAL, BLOCK_N, True, EVEN_N, HAS_SOFTCAP, HAS_KMASK, False, BB_RANDOM,
        )
    for t in range(0, n_part):
        n = tl.load(pidx + t)
        dq = _dq_tile(
            dq, q, do, lse, delta, Kb, Vb, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn,
            qidx, q_start, k_start, k_end, Skv, scale_log2, softcap, P0, P1, P2, P3,
            BBT, qb_lo, qb_hi, row_lo, row_hi,
            PATTERN, CAUSAL, BLOCK_N, False, False, HAS_SOFTCAP, HAS_KMASK, BB_RULE, BB_RANDOM,
        )
    if HAS_SEL:
        dq = _dq_selection(
            dq, q, do, lse, delta, Kb, Vb, kmask_row, offs_n, offs_d, stride_kn, stride_vn, q_ok, qidx,
            k_start, k_end, Skv, scale, scale_log2, softcap, P0, P1, P2, P3, b, hkv,
            SEL_IDX, SEL_CNT, SEL_W, FIRST_BLOCK, stride_sib, stride_sih, stride_sin, stride_scb, stride_sch,
            stride_scn, stride_swb, stride_swh, stride_swn, NB, QB,
            DK32, DV32, DW32, stride_akb, stride_akh, stride_akn, stride_awb, stride_awh, stride_awn,
            PATTERN, CAUSAL, BLOCK_N, HEAD_DIM, HAS_SOFTCAP, HAS_KMASK, HAS_SELW,
        )
    dq = dq * scale
    tl.store(DQ + b * stride_dqb + head * stride_dqh + qi[:, None] * stride_dqm + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=q_ok[:, None])


def layout_backward(
    do, q, k, v, out, lse, layout, *, pattern_id, params, causal, scale, softcap=None, sink_logits=None,
    key_mask=None, num_warps=None, num_stages=None, selection=None, prep=None,
):
    """Gradients of the layout-path forward (Triton; ``dispatch.attention_backward`` decides when it runs).

    Args:
        do, q, out: ``(B, Hq, Sq, D)``; k, v: ``(B, Hkv, Skv, D)`` (unit last stride); lse: ``(B, Hq, Sq)``
        float32 from the forward. ``layout``: a ``BlockLayout`` with ``block_q = BLOCK_M`` and
        ``block_k = BLOCK_N`` (one query head per tile).
        ``pattern_id, params, causal``: the pattern as the kernels see it (``pattern_codes.pattern_code``).
        ``selection``: the forward's ``TokenLayout``, if any.
        ``prep``: ``bwd_preprocess(do, out, lse)``'s ``(delta, lse2)`` if already computed.
    Returns: ``dq, dk, dv`` (input dtypes), ``dsink (Hq,)`` float32 or None, and ``dweights`` (like
    ``selection.weights``, float32) or None.
    """
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    dev = q.device
    params = tuple(params)
    geo = layout.geometry
    delta, _ = prep if prep is not None else bwd_preprocess(do, out, lse)  # (B, Hq, Sq) float32
    bm, bn = layout.block_q, layout.block_k
    NQ, NK = layout.num_q_blocks, layout.num_k_blocks
    kmask = key_mask.to(torch.uint8) if key_mask is not None else torch.empty(1, 1, device=dev, dtype=torch.uint8)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if num_warps is None:
        num_warps = 4 if bm * bn <= 64 * 64 or D > 128 else 8
    if num_stages is None:
        num_stages = 1 if D > 128 else 2
    common = dict(
        PATTERN=pattern_id, CAUSAL=bool(causal), BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=D,
        EVEN_N=(Skv % bn == 0), HAS_SOFTCAP=softcap is not None, HAS_KMASK=key_mask is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    # bigbird with its code over tiles that straddle its blocks (e.g. a left-padded batch): its rule in the kernel
    bb_rule = pattern_id == 4 and int(params[0]) > 0
    bb_random = int(params[1]) // BIGBIRD_RANDOM_SHIFT if bb_rule else 0
    bb_table, bb_stride, bb_nqb = delta, 0, 1  # (a placeholder: not read)
    if bb_rule:
        check_bigbird_rule_tiles(params, bm, bn)
        if bb_random:
            bb_table, bb_stride, bb_nqb = bigbird_rule_table(params, Hkv, Sq, Skv, dev)
    common.update(BB_RULE=bb_rule, BB_RANDOM=bb_random)
    fnum, fidx, pnum, pidx = transposed_layout(layout)
    lay_b, lay_h = int(pnum.shape[0] > 1), int(pnum.shape[1] > 1)
    launch(
        _attn_bwd_dkdv, (NK, B * Hkv),
        q, k, v, do, lse, delta, dk, dv, kmask, geo.q_start, geo.k_start, geo.k_end, fnum, fidx, pnum, pidx,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        pnum.stride(0), pnum.stride(1), pnum.stride(2), fidx.stride(0), fidx.stride(1), fidx.stride(2),
        pidx.stride(0), pidx.stride(1), pidx.stride(2), kmask.stride(0), int(geo.rows > 1),
        Sq, Skv, Hkv, G, scale, scale * LOG2E, float(softcap or 1.0), *params, bb_table, bb_stride, bb_nqb,
        LAYOUT_B=lay_b, LAYOUT_H=lay_h, **common,
    )
    fnum, fidx, pnum, pidx = layout.full_kv_num_blocks, layout.full_kv_indices, layout.kv_num_blocks, layout.kv_indices
    if fnum.stride() != pnum.stride():
        fnum, pnum = fnum.contiguous(), pnum.contiguous()
    lay_b, lay_h = int(pnum.shape[0] > 1), int(pnum.shape[1] > 1)
    sel_args = selection_args(selection, dev)
    if selection is not None:
        dk32 = torch.zeros(k.shape, device=dev, dtype=torch.float32)
        dv32 = torch.zeros(v.shape, device=dev, dtype=torch.float32)
        dw32 = torch.zeros(selection.indices.shape, device=dev, dtype=torch.float32)
    else:
        dk32 = dv32 = dw32 = torch.zeros(1, 1, 1, 1, device=dev, dtype=torch.float32)
    launch(
        _attn_bwd_dq, (NQ, B * Hq),
        q, k, v, do, lse, delta, dq, kmask, geo.q_start, geo.k_start, geo.k_end, fnum, fidx, pnum, pidx,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        pnum.stride(0), pnum.stride(1), pnum.stride(2), fidx.stride(0), fidx.stride(1), fidx.stride(2),
        pidx.stride(0), pidx.stride(1), pidx.stride(2), kmask.stride(0), int(geo.rows > 1), *sel_args,
        dk32, dv32, dw32, dk32.stride(0), dk32.stride(1), dk32.stride(2), dw32.stride(0), dw32.stride(1), dw32.stride(2),
        Sq, Skv, Hq, G, scale, scale * LOG2E, float(softcap or 1.0), *params, bb_table, bb_stride, bb_nqb,
        LAYOUT_B=lay_b, LAYOUT_H=lay_h, HAS_SEL=selection is not None,
        HAS_SELW=selection is not None and selection.weights is not None, **common,
    )
    dweights = None
    if selection is not None:
        dk = (dk.float() + dk32).to(k.dtype)
        dv = (dv.float() + dv32).to(v.dtype)
        if selection.weights is not None:
            dweights = dw32
    dsink = None
    if sink_logits is not None:
        p_sink = torch.exp(sink_logits.float().view(1, Hq, 1) - lse)
        dsink = -(p_sink * delta).sum((0, 2))
    return dq, dk, dv, dsink, dweights
