"""Structured forward for dense, sliding-window, streaming and block-diagonal patterns: tile ranges by
arithmetic.

For these patterns the key tiles a query tile visits form at most two runs (the sink tiles of
``streaming``, then one contiguous window), and inside the window run the *full* tiles (no element
mask) are the middle of the run. So instead of walking a ``BlockLayout``'s index lists, each program
computes from its row geometry (design §3) three ranges and runs one loop per range, the element
mask a constexpr flag of each loop (no run-time branch inside a pipelined loop)::

    sink tiles       [s_lo, s_hi)   masked   (streaming only, tiles before the window run)
    left edge        [n_lo, f_lo)   masked   (window edge, or keys before k_start)
    full             [f_lo, f_hi)   unmasked (every valid row may see every key of the tile)
    right edge       [f_hi, n_hi)   masked   (causal diagonal, k_end, bidirectional window edge)

For query tile ``m`` with valid query indices ``qlo..qhi`` (key-index space, ``q_start + i``) the
window run covers the keys some row may see and the full run the keys every row may see:

==================  ===========================  =====================================
 pattern             keys of some row             keys of every row
==================  ===========================  =====================================
 dense, causal       [k_start, qhi]               [k_start, qlo]
 dense, bidir.       [k_start, k_end)             [k_start, k_end)
 window W, causal    [qlo - W + 1, qhi]           [qhi - W + 1, qlo]
 window W, bidir.    [qlo - W, qhi + W]           [qhi - W, qlo + W]
 block B, causal     [start(qlo), qhi]            [start(qhi), qlo]
 block B, bidir.     [start(qlo), end(qhi))       [start(qhi), end(qlo))
==================  ===========================  =====================================

each clipped to ``[k_start, k_end)`` (``start(i)`` / ``end(i)``: the first key index of the block that holds
query ``i``'s position / of the next block; ``rules._key_runs`` computes the table); ``streaming`` adds the
sink keys ``[k_start, k_start + sinks)`` as tiles before the window run. A tile outside these ranges holds no allowed pair, a tile
inside the full run holds only allowed pairs, and every other visited tile applies the exact
element rule in registers, so the result equals the layout path for any geometry.

One pipelined loop per run, so the software pipeline fills and drains up to four times per program.
Alternatives that were timed slower or no faster on the H100 and removed (numbers in docs/history.md):
two loops over concatenated runs, the fully visible sink tiles in a loop of their own or at the head
of the full loop, the sink tiles and the left edge in one loop, Triton's automatic warp
specialisation of the full loop, a persistent grid, pointer loads instead of TMA, and one-warpgroup
programs. The sink tile and the left edge in one two-step loop with an affine tile index does not
fit: every loop gets its own pipeline buffers, and five loops at 128x128, 3 stages, D=128 need
427 KB of shared memory (232 KB exist). The two warpgroups of a program cannot overlap softmax with
the other's MMAs here: every loop iteration holds six CTA-wide barriers (one after the Q K^T wait,
two around each of the K and V TMA issues), on which ncu puts a third of the stall cycles.

Program order (``ORDER`` constexpr) over the ``(query tile, batch x query head)`` grid:
0 query tiles fastest, ascending; 1 query tiles fastest, longest first (dense causal: the last
query tiles carry the most keys); 2 heads fastest (concurrent programs read different K/V heads —
the cache-unfriendly order, kept for the L2 study); 3 the query heads of one KV group adjacent,
then query tiles (concurrent programs share K/V tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..memory_order import new_output
from .fitting import launch
from .rules import LOG2E, _key_runs, _pattern_rule, _softcap
from .tma import kv_descriptor, tma_ok

__all__ = ["structured_forward"]


@triton.jit
def _cdiv(a, b):
    # Ceiling division for a >= 0 (all callers clamp to k_start >= 0 first).
    return (a + b - 1) // b


@triton.jit
def _st_tile(
    acc, l_i, m_i, q, K, V, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn, kv_row0,
    qpos, k_start, k_end, scale_log2, softcap, P0, P1,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr, USE_TMA: tl.constexpr,
):
    """One key tile ``n`` of the online softmax (log2 units). ``MASKED``: apply the element rule and
    key validity; otherwise every (row, key) pair of the tile is allowed and valid."""
    kidx = offs_n.to(tl.int64) + n * BLOCK_N  # (BLOCK_N,) key tensor indices
    if USE_TMA:
        row = (kv_row0 + n * BLOCK_N).to(tl.int32)
        kt = tl.trans(K.load([row, 0]))  # (D, BLOCK_N)
        vt = V.load([row, 0])  # (BLOCK_N, D)
    elif MASKED:
        kin = (kidx >= k_start) & (kidx < k_end)
        kt = tl.load(K + kidx[None, :] * stride_kn + offs_d[:, None], mask=kin[None, :], other=0.0)
        vt = tl.load(V + kidx[:, None] * stride_vn + offs_d[None, :], mask=kin[:, None], other=0.0)
    else:
        kt = tl.load(K + kidx[None, :] * stride_kn + offs_d[:, None])
        vt = tl.load(V + kidx[:, None] * stride_vn + offs_d[None, :])
    s = tl.dot(q, kt)
    if HAS_SOFTCAP:
        s = _softcap(s * (scale_log2 / 1.4426950408889634), softcap) * 1.4426950408889634
    if MASKED or HAS_KMASK:
        if not HAS_SOFTCAP:
            s = s * scale_log2
        ok = offs_n[None, :] == offs_n[None, :]
        if MASKED:  # positions in int32 (lengths < 2**31): half the registers of int64 masks
            kpos = offs_n + (n * BLOCK_N - k_start).to(tl.int32)
            ok = _pattern_rule(qpos[:, None], kpos[None, :], P0, P1, 0, 0, PATTERN, CAUSAL)
            ok = ok & (kpos[None, :] < (k_end - k_start).to(tl.int32))
        if HAS_KMASK:
            km = tl.load(kmask_row + kidx, mask=kidx < k_end, other=0)
            ok = ok & (km[None, :] != 0)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
    elif HAS_SOFTCAP:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
        p = tl.exp2(s - m_new[:, None])
    else:
        # scale > 0, so max(s) * scale == max(s * scale); the scaling fuses into one FMA per score
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        m_safe = m_new
        p = tl.exp2(s * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _st_run(
    acc, l_i, m_i, q, K, V, kmask_row, lo, hi, offs_n, offs_d, stride_kn, stride_vn, kv_row0,
    qpos, k_start, k_end, scale_log2, softcap, P0, P1,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_KMASK: tl.constexpr, USE_TMA: tl.constexpr,
):
    """The key tiles ``[lo, hi)`` in one pipelined loop (``MASKED`` as in ``_st_tile``)."""
    for n in range(lo, hi):
        acc, l_i, m_i = _st_tile(
            acc, l_i, m_i, q, K, V, kmask_row, n, offs_n, offs_d, stride_kn, stride_vn, kv_row0,
            qpos, k_start, k_end, scale_log2, softcap, P0, P1,
            PATTERN, CAUSAL, BLOCK_N, MASKED, HAS_SOFTCAP, HAS_KMASK, USE_TMA,
        )
    return acc, l_i, m_i


@triton.jit
def _st_fwd(
    Q, K, V, O, LSE, SINK, KMASK, QSTART, KSTART, KEND,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm, stride_kmb, geo_stride,
    B, Sq, Skv, Hq, Hkv, NQ, scale_log2, softcap, P0, P1,
    PATTERN: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, HAS_KMASK: tl.constexpr,
    USE_TMA: tl.constexpr, ORDER: tl.constexpr,
):
    G = Hq // Hkv
    if ORDER == 0:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
    elif ORDER == 1:
        pid_m = NQ - 1 - tl.program_id(0)
        pid_bh = tl.program_id(1)
    elif ORDER == 2:
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
    else:  # the G query heads of a KV group on consecutive programs, then query tiles
        lin = tl.program_id(0) + tl.program_id(1) * NQ
        g = lin % G
        rest = lin // G
        pid_m = rest % NQ
        pid_bh = (rest // NQ) * G + g
    b = pid_bh // Hq
    h = pid_bh % Hq
    hkv = h // G

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    qi = pid_m * BLOCK_M + offs_m
    q_ok = qi < Sq

    gb = b.to(tl.int64) * geo_stride
    q_start = tl.load(QSTART + gb)
    k_start = tl.load(KSTART + gb)
    k_end = tl.load(KEND + gb)
    qidx = q_start + qi
    qpos = (qidx - k_start).to(tl.int32)
    qlo = q_start + pid_m * BLOCK_M  # first and last valid query of the tile, key-index space
    qhi = q_start + tl.minimum(pid_m * BLOCK_M + BLOCK_M, Sq) - 1

    # Window run [a_lo, a_hi) and full run [w_lo, w_hi) in key indices (table in the module docstring).
    a_lo, a_hi, w_lo, w_hi = _key_runs(qlo, qhi, k_start, k_end, P0, PATTERN, CAUSAL)
    n_lo = a_lo // BLOCK_N
    n_hi = tl.maximum(_cdiv(a_hi, BLOCK_N), n_lo)
    f_lo = tl.minimum(tl.maximum(_cdiv(w_lo, BLOCK_N), n_lo), n_hi)
    f_hi = tl.minimum(tl.maximum(w_hi // BLOCK_N, f_lo), n_hi)

    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    q_ptrs = Q + b64 * stride_qb + h64 * stride_qh + qi.to(tl.int64)[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=q_ok[:, None], other=0.0)
    kv_row0 = (b64 * Hkv + hkv) * Skv
    if USE_TMA:
        Kb = K
        Vb = V
    else:
        Kb = K + b64 * stride_kb + hkv.to(tl.int64) * stride_kh
        Vb = V + b64 * stride_vb + hkv.to(tl.int64) * stride_vh
    kmask_row = KMASK + b64 * stride_kmb

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # streaming: the sink tiles [s_lo, s_hi) before the window run
    s_lo = n_lo
    s_hi = n_lo
    if PATTERN == 2:
        s_end = tl.minimum(tl.minimum(k_start + P1, k_end), qhi + 1)  # some row sees the sink keys below
        s_lo = tl.minimum(k_start // BLOCK_N, n_lo)
        s_hi = tl.maximum(tl.minimum(_cdiv(tl.maximum(s_end, k_start), BLOCK_N), n_lo), s_lo)
    # one loop per run (module docstring): sink tiles, left edge, full tiles (no element mask), right edge
    acc, l_i, m_i = _st_run(
        acc, l_i, m_i, q, Kb, Vb, kmask_row, s_lo, s_hi, offs_n, offs_d, stride_kn, stride_vn, kv_row0, qpos, k_start, k_end,
        scale_log2, softcap, P0, P1, PATTERN, CAUSAL, BLOCK_N, True, HAS_SOFTCAP, HAS_KMASK, USE_TMA,
    )
    acc, l_i, m_i = _st_run(
        acc, l_i, m_i, q, Kb, Vb, kmask_row, n_lo, f_lo, offs_n, offs_d, stride_kn, stride_vn, kv_row0, qpos, k_start, k_end,
        scale_log2, softcap, P0, P1, PATTERN, CAUSAL, BLOCK_N, True, HAS_SOFTCAP, HAS_KMASK, USE_TMA,
    )
    acc, l_i, m_i = _st_run(
        acc, l_i, m_i, q, Kb, Vb, kmask_row, f_lo, f_hi, offs_n, offs_d, stride_kn, stride_vn, kv_row0, qpos, k_start, k_end,
        scale_log2, softcap, P0, P1, PATTERN, CAUSAL, BLOCK_N, False, HAS_SOFTCAP, HAS_KMASK, USE_TMA,
    )
    acc, l_i, m_i = _st_run(
        acc, l_i, m_i, q, Kb, Vb, kmask_row, f_hi, n_hi, offs_n, offs_d, stride_kn, stride_vn, kv_row0, qpos, k_start, k_end,
        scale_log2, softcap, P0, P1, PATTERN, CAUSAL, BLOCK_N, True, HAS_SOFTCAP, HAS_KMASK, USE_TMA,
    )

    if HAS_SINK:
        sink = tl.load(SINK + h).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_f)
        l_i = l_i * alpha + tl.exp2(sink - m_f)
        acc = acc * alpha[:, None]
        m_i = m_f
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    qi64 = qi.to(tl.int64)
    o_ptrs = O + b64 * stride_ob + h64 * stride_oh + qi64[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=q_ok[:, None])
    tl.store(LSE + b64 * stride_lb + h64 * stride_lh + qi64 * stride_lm, lse, mask=q_ok)


def structured_forward(
    q, k, v, geometry, *, pattern_id, params, causal, scale, block_m, block_n, softcap=None, sink_logits=None,
    key_mask=None, out=None, num_warps=None, num_stages=None, use_tma=None, order=None,
):
    """Launch the structured forward.

    Args:
        q: ``(B, Hq, Sq, D)``; k, v: ``(B, Hkv, Skv, D)`` (unit last stride).
        geometry: a ``RowGeometry`` (or namespace with ``q_start``/``k_start``/``k_end`` int64 ``(B,)`` or ``(1,)``).
        pattern_id, params: from ``pattern_codes.pattern_code`` (``P0`` = window, ``P1`` = sinks).
        order: program order (module docstring); default 1 (longest first) for dense causal, else 3 (the
            query heads of a KV group adjacent: on the H100 at long lengths slightly faster than 0 for
            sliding_window and streaming).
    Returns: ``out (B, Hq, Sq, D)`` in q's dtype and memory order (``memory_order.new_output``) and
    ``lse (B, Hq, Sq)`` float32 (natural log, sink included).
    """
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    dev = q.device
    NQ = triton.cdiv(Sq, block_m)
    if out is None:
        out = new_output(q)
    lse = torch.empty(B, Hq, Sq, device=dev, dtype=torch.float32)
    sink = sink_logits if sink_logits is not None else lse
    kmask = key_mask.to(torch.uint8) if key_mask is not None else torch.empty(1, 1, device=dev, dtype=torch.uint8)
    if num_warps is None:
        num_warps = 8 if block_m * block_n >= 128 * 128 and D == 128 else 4
    if num_stages is None:
        num_stages = 3 if D <= 128 else 2
    if use_tma is None:
        use_tma = tma_ok(k, v)
    if order is None:
        order = 1 if (pattern_id == 0 and causal) else 3
    grid = (NQ, B * Hq) if order != 2 else (B * Hq, NQ)
    k_arg, v_arg = (kv_descriptor(k, block_n), kv_descriptor(v, block_n)) if use_tma else (k, v)
    geo = geometry
    launch(
        _st_fwd, grid,
        q, k_arg, v_arg, out, lse, sink, kmask, geo.q_start, geo.k_start, geo.k_end,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        kmask.stride(0), int(geo.q_start.shape[0] > 1),
        B, Sq, Skv, Hq, Hkv, NQ, scale * LOG2E, float(softcap or 1.0), int(params[0]), int(params[1]),
        PATTERN=pattern_id, CAUSAL=bool(causal), BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D,
        HAS_SOFTCAP=softcap is not None, HAS_SINK=sink_logits is not None, HAS_KMASK=key_mask is not None,
        USE_TMA=bool(use_tma), ORDER=int(order),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, lse
