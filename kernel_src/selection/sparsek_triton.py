"""The SparseK operator in Triton: exact forward (threshold search) and backward, one program per row.

Same operator and conventions as ``sparsek.sparsek`` / ``sparsek.sparsek_threshold`` (read those
docstrings): ``p = clip(u - tau, 0, 1)`` on the candidates, ``sum p = k_eff = min(k, candidates)``,
``p = 0`` off the mask; ``tau = +inf`` when ``k_eff == 0``; ``tau = float32(min(u) - 1)`` when
``k_eff == candidates`` (every candidate at 1); when ``f(t) = sum clip(u_j - t, 0, 1)`` equals ``k``
on a whole interval (no fractional entry), ``tau`` is its right end (the smallest selected ``u``
minus 1), as in the sort-based path.

Forward, per row (the row is read in chunks of ``BLOCK``, so any length works):

0. a row with budget ``k = 0`` writes ``p = 0`` (and ``tau = +inf``, no search) without reading its scores: a
   decode step inside a query block runs the operator with budget 0 for its rows (``selectors._stepped_select``);
1. one pass for the candidate count, ``min u``, ``max u`` and ``sum u`` (the first trial point);
2. a safeguarded Newton search on ``f``, one pass per trial point ``t``. The breakpoints of ``f``
   are ``{u_j} U {u_j - 1}``; a pass returns the active set of the segment ``[lo_t, hi_t]`` of ``t``
   (the breakpoints around it: ones ``u_j - 1 > t``, fractional ``u_j > t >= u_j - 1``), and the
   exact solution on that segment ``c = (sum_F u_j - (k - n_ones)) / |F|``. If ``c`` lies in the
   segment (short of its right end) it is ``tau`` (exact: the segment's linear equation); if the
   segment has no fractional entry and ``n_ones == k`` (``f = k`` on it), ``tau`` is its right end.
   Otherwise the bracket, whose ends are always breakpoints, shrinks to the side of ``c`` by the
   whole segment (to the right when ``c`` is the right end, where a flat interval may start, so
   ``tau`` is the right end of the solution set), and the next trial is
   ``c`` (the Newton step) if it lies in the new bracket and the bracket at least halved, else the
   bracket's midpoint. Every pass removes at least one segment and every second pass halves the
   bracket, so the search ends after ``O(log)`` passes on ordinary data (``iters`` reports them);
3. one pass writing ``p`` (and the fractional set for the backward).

Arithmetic: scores are loaded as float32 and the search runs in float64 (exact conversion, sums
without cancellation, ``u - 1`` exact), as the sort-based path's final solve; ``p`` is computed
in float64 and rounded to float32, like that path.

Backward: ``grad_u = 1_F * (g - mean_F(g))`` with ``F = {0 < p < 1}`` (one pass for the sum and
count over ``F``, one to write).

Verified under Triton's interpreter (``TRITON_INTERPRET=1``) only; not yet run compiled on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sparsek_budget import key_budget

__all__ = ["MAX_ITERS", "sparsek_forward", "sparsek_backward", "sparsek_triton"]

#: Cap on the search passes per row (far above the ``O(log)`` needed; reached only if rounding
#: kept a candidate out of every segment, then ``tau`` is the bracket's left end).
MAX_ITERS = 400


@triton.jit
def _load_row(u_row, m_row, idx, n, HAS_MASK: tl.constexpr):
    """Chunk ``idx`` of a row: scores (float32, 0 off the candidates) and the candidate flags."""
    ok = idx < n
    x = tl.load(u_row + idx, mask=ok, other=0.0).to(tl.float32)
    if HAS_MASK:
        ok = ok & (tl.load(m_row + idx, mask=ok, other=0) != 0)
    return tl.where(ok, x, 0.0), ok


@triton.jit
def _segment_pass(u_row, m_row, n, t, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """The segment of trial point ``t``: ``(n_ones, |F|, sum_F u, lo_t, hi_t)`` with ``lo_t`` the
    largest breakpoint ``<= t`` and ``hi_t`` the smallest ``> t`` (``-inf`` / ``+inf`` if none)."""
    offs = tl.arange(0, BLOCK)
    ones = tl.zeros([BLOCK], tl.int32)
    cnt = tl.zeros([BLOCK], tl.int32)
    acc = tl.zeros([BLOCK], tl.float64)
    seg_lo = tl.full([BLOCK], float("-inf"), tl.float64)
    seg_hi = tl.full([BLOCK], float("inf"), tl.float64)
    for start in range(0, n, BLOCK):
        x32, ok = _load_row(u_row, m_row, start + offs, n, HAS_MASK)
        x = x32.to(tl.float64)
        xm1 = x - 1.0
        is_one = ok & (xm1 > t)
        is_frac = ok & (x > t) & (xm1 <= t)
        ones += is_one.to(tl.int32)
        cnt += is_frac.to(tl.int32)
        acc += tl.where(is_frac, x, 0.0)
        below = tl.where(x <= t, x, tl.where(xm1 <= t, xm1, float("-inf")))
        above = tl.where(xm1 > t, xm1, tl.where(x > t, x, float("inf")))
        seg_lo = tl.maximum(seg_lo, tl.where(ok, below, float("-inf")))
        seg_hi = tl.minimum(seg_hi, tl.where(ok, above, float("inf")))
    return tl.sum(ones, 0), tl.sum(cnt, 0), tl.sum(acc, 0), tl.max(seg_lo, 0), tl.min(seg_hi, 0)


@triton.jit
def _sparsek_fwd_kernel(
    U, M, K, P, TAU, FRAC, ITERS, n, stride_u, stride_m, stride_p, stride_f, max_iters,
    HAS_MASK: tl.constexpr, WRITE_FRAC: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    u_row = U + row * stride_u
    m_row = M + row * stride_m
    p_row = P + row * stride_p
    f_row = FRAC + row * stride_f
    offs = tl.arange(0, BLOCK)
    if tl.load(K + row) == 0:  # p = 0, tau = +inf without reading the row (a decode step inside a SparseK block)
        for start in range(0, n, BLOCK):
            idx = start + offs
            tl.store(p_row + idx, tl.zeros([BLOCK], tl.float32), mask=idx < n)
            if WRITE_FRAC:
                tl.store(f_row + idx, tl.zeros([BLOCK], tl.int8), mask=idx < n)
        tl.store(TAU + row, tl.full([], float("inf"), tl.float64))
        tl.store(ITERS + row, tl.program_id(0) * 0)
        return

    cnt = tl.zeros([BLOCK], tl.int32)
    mn = tl.full([BLOCK], float("inf"), tl.float32)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    tot = tl.zeros([BLOCK], tl.float64)
    for start in range(0, n, BLOCK):
        x, ok = _load_row(u_row, m_row, start + offs, n, HAS_MASK)
        cnt += ok.to(tl.int32)
        mn = tl.minimum(mn, tl.where(ok, x, float("inf")))
        mx = tl.maximum(mx, tl.where(ok, x, float("-inf")))
        tot += x.to(tl.float64)
    n_c = tl.sum(cnt, 0).to(tl.int64)
    u_min = tl.where(n_c > 0, tl.min(mn, 0), 0.0)
    u_max = tl.where(n_c > 0, tl.max(mx, 0), 0.0)
    k_eff = tl.minimum(tl.load(K + row), n_c)
    kf = k_eff.to(tl.float64)

    # Bracket [lo, hi] around tau, both ends breakpoints: f(min u - 1) = n_c > k > 0 = f(max u).
    lo = u_min.to(tl.float64) - 1.0
    hi = u_max.to(tl.float64)
    scale = tl.maximum(tl.abs(lo), tl.abs(hi)) + 1.0
    t = (tl.sum(tot, 0) - kf) / tl.maximum(n_c.to(tl.float64), 1.0)
    t = tl.where((t > lo) & (t < hi), t, 0.5 * (lo + hi))
    tau = tl.where(k_eff == 0, float("inf"), (u_min - 1.0).to(tl.float64))
    done = (k_eff == 0) | (k_eff == n_c)
    it = tl.program_id(0) * 0
    while (done == 0) & (it < max_iters):
        n_ones, n_frac, s_frac, s_lo, s_hi = _segment_pass(u_row, m_row, n, t, HAS_MASK, BLOCK)
        nf = n_frac.to(tl.float64)
        c = (s_frac - (kf - n_ones.to(tl.float64))) / tl.maximum(nf, 1.0)
        # Rounding of c: (|F| + 1) terms of size <= scale in float64.
        tol = 4.5e-16 * (nf + 1.0) * scale
        # A solution at the segment's right end may continue as a flat interval to its right: go on.
        right = tl.where(n_frac > 0, c >= s_hi - tol, n_ones.to(tl.int64) > k_eff)
        inside = (n_frac > 0) & (c >= s_lo - tol) & (right == 0)
        flat = (n_frac == 0) & (n_ones.to(tl.int64) == k_eff)
        new_lo = tl.where(right, s_hi, lo)
        new_hi = tl.where(right, hi, s_lo)
        found = inside | flat
        collapsed = (found == 0) & (new_lo >= new_hi)
        tau = tl.where(inside, tl.minimum(tl.maximum(c, s_lo), s_hi), tl.where(flat, s_hi, tau))
        tau = tl.where(collapsed, new_lo, tau)
        done = found | collapsed
        newton = (n_frac > 0) & (c > new_lo) & (c < new_hi) & (new_hi - new_lo <= 0.5 * (hi - lo))
        t = tl.where(newton, c, 0.5 * (new_lo + new_hi))
        t = tl.where(t < new_hi, t, new_lo)
        lo = new_lo
        hi = new_hi
        it += 1
    tau = tl.where(done, tau, lo)
    tl.store(TAU + row, tau)
    tl.store(ITERS + row, it)

    for start in range(0, n, BLOCK):
        idx = start + offs
        x, ok = _load_row(u_row, m_row, idx, n, HAS_MASK)
        p = tl.minimum(tl.maximum(x.to(tl.float64) - tau, 0.0), 1.0).to(tl.float32)
        p = tl.where(ok, p, 0.0)
        tl.store(p_row + idx, p, mask=idx < n)
        if WRITE_FRAC:
            tl.store(f_row + idx, ((p > 0.0) & (p < 1.0)).to(tl.int8), mask=idx < n)


@triton.jit
def _sparsek_bwd_kernel(G, FRAC, GU, n, stride_g, stride_f, stride_gu, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g_row = G + row * stride_g
    f_row = FRAC + row * stride_f
    gu_row = GU + row * stride_gu
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    cnt = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        idx = start + offs
        inb = idx < n
        fr = inb & (tl.load(f_row + idx, mask=inb, other=0) != 0)
        g = tl.load(g_row + idx, mask=inb, other=0.0).to(tl.float32)
        acc += tl.where(fr, g, 0.0)
        cnt += fr.to(tl.int32)
    mean = tl.sum(acc, 0) / tl.maximum(tl.sum(cnt, 0), 1).to(tl.float32)
    for start in range(0, n, BLOCK):
        idx = start + offs
        inb = idx < n
        fr = inb & (tl.load(f_row + idx, mask=inb, other=0) != 0)
        g = tl.load(g_row + idx, mask=inb, other=0.0).to(tl.float32)
        tl.store(gu_row + idx, tl.where(fr, g - mean, 0.0), mask=inb)


def _empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Every output buffer of the launchers (uninitialised; the tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _block(n: int, block: int | None) -> int:
    if block is None:
        return min(1024, max(16, triton.next_power_of_2(n)))
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"sparsek_triton: `block` must be a power of two >= 16, got {block!r}")
    return block


def sparsek_forward(u: torch.Tensor, k, mask: torch.Tensor | None = None, *, need_frac: bool = False,
                    block: int | None = None):
    """The SparseK forward in Triton (no autograd).

    Args:
        u: ``(..., n)`` float scores on CUDA (or on the CPU under ``TRITON_INTERPRET=1``); computed
            in float32 (other float dtypes are converted; finiteness is checked by ``sparsek``).
        k: int or integer tensor broadcastable to ``u.shape[:-1]``, every entry ``>= 0``.
        mask: optional ``(..., n)`` bool (broadcastable), True = candidate.
        need_frac: also return the fractional set ``(..., n)`` uint8 (1 where ``0 < p < 1``).
        block: chunk length (power of two >= 16; default ``min(1024, next_pow2(n))``, at least 16).
    Returns:
        ``(p, tau, iters)``: ``p (..., n)`` float32, ``tau (...,)`` float64 (conventions: module
        docstring), ``iters (...,)`` int32 search passes per row; plus ``frac`` when ``need_frac``.
    """
    if not isinstance(u, torch.Tensor) or not u.dtype.is_floating_point:
        raise TypeError(f"sparsek_forward: `u` must be a floating-point tensor, got {getattr(u, 'dtype', type(u).__name__)}")
    if u.dim() < 1 or u.shape[-1] == 0:
        raise ValueError(f"sparsek_forward: `u` must have a non-empty last dimension, got shape {tuple(u.shape)}")
    lead, n = u.shape[:-1], u.shape[-1]
    kk = key_budget(k, lead, u.device).reshape(-1).contiguous()
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"sparsek_forward: `mask` must be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
        try:
            mask = mask.expand(u.shape)
        except RuntimeError:
            raise ValueError(f"sparsek_forward: `mask` shape {tuple(mask.shape)} does not broadcast to {tuple(u.shape)}") from None
    u2 = u.detach().to(torch.float32).reshape(-1, n).contiguous()
    R = u2.shape[0]
    # A conversion, not a bitcast view: Inductor cannot lower ``view(torch.uint8)`` of a bool tensor.
    m2 = mask.reshape(R, n).to(torch.uint8).contiguous() if mask is not None else u2
    p = _empty((R, n), torch.float32, u.device)
    tau = _empty((R,), torch.float64, u.device)
    iters = _empty((R,), torch.int32, u.device)
    frac = _empty((R, n), torch.uint8, u.device) if need_frac else p
    if R > 0:
        _sparsek_fwd_kernel[(R,)](
            u2, m2, kk, p, tau, frac, iters, n, u2.stride(0), m2.stride(0), p.stride(0), frac.stride(0), MAX_ITERS,
            HAS_MASK=mask is not None, WRITE_FRAC=need_frac, BLOCK=_block(n, block), num_warps=4,
        )
    out = (p.view(u.shape), tau.view(lead), iters.view(lead))
    return out + (frac.view(u.shape),) if need_frac else out


def sparsek_backward(grad_p: torch.Tensor, frac: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """``grad_u (..., n)`` float32 ``= 1_F * (g - mean_F(g))`` from ``grad_p (..., n)`` and the uint8
    fractional set ``frac (..., n)`` of ``sparsek_forward(..., need_frac=True)``."""
    if not isinstance(grad_p, torch.Tensor) or not grad_p.dtype.is_floating_point:
        raise TypeError(f"sparsek_backward: `grad_p` must be a floating-point tensor, got {getattr(grad_p, 'dtype', type(grad_p).__name__)}")
    if not isinstance(frac, torch.Tensor) or frac.dtype != torch.uint8:
        raise TypeError(f"sparsek_backward: `frac` must be a uint8 tensor, got {getattr(frac, 'dtype', type(frac).__name__)}")
    if frac.shape != grad_p.shape:
        raise ValueError(f"sparsek_backward: `frac` shape {tuple(frac.shape)} differs from `grad_p` shape {tuple(grad_p.shape)}")
    n = grad_p.shape[-1]
    g2 = grad_p.to(torch.float32).reshape(-1, n).contiguous()
    f2 = frac.reshape(-1, n).contiguous()
    gu = _empty(g2.shape, torch.float32, g2.device)
    if g2.shape[0] > 0 and n > 0:
        _sparsek_bwd_kernel[(g2.shape[0],)](g2, f2, gu, n, g2.stride(0), f2.stride(0), gu.stride(0),
                                           BLOCK=_block(n, block), num_warps=4)
    return gu.view(grad_p.shape)


class _SparseKTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, k, mask):
        p, _, _, frac = sparsek_forward(u, k, mask, need_frac=True)
        ctx.save_for_backward(frac)
        return p

    @staticmethod
    def backward(ctx, grad_p):
        (frac,) = ctx.saved_tensors
        return sparsek_backward(grad_p, frac), None, None


def sparsek_triton(u: torch.Tensor, k, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``p (..., n)`` float32 from ``u (..., n)``, differentiable in ``u`` (the kernels above)."""
    return _SparseKTriton.apply(u, k, mask)
