"""The SparseK operator: Euclidean projection onto the capped simplex (design §6).

For scores ``u`` (one row of candidates) and a budget ``k``, SparseK returns

    p = argmin ||p - u||^2  subject to  0 <= p_j <= 1,  sum_j p_j = k,

whose solution is ``p_j = clip(u_j - tau, 0, 1)`` with the threshold ``tau`` chosen so that the sum
is ``k`` (Lou et al., "Sparser is Faster and Less is More", arXiv 2406.16747). With ``k = 1`` and no
upper cap binding it is sparsemax. Rows with at most ``k`` candidates take every candidate with
``p = 1`` (the sum is then ``min(k, candidates)``).

Forward (exact, sort-based): ``f(t) = sum_j clip(u_j - t, 0, 1)`` is continuous, non-increasing and
linear between the breakpoints ``{u_j} U {u_j - 1}``. We sort the breakpoints, evaluate ``f`` at
all of them with prefix sums and ``searchsorted`` (``O(n log n)`` per row, batched), find the
segment where ``f`` crosses ``k`` and solve the linear equation on it with the segment's active
set: ``tau = (sum_{j in F} u_j - (k - |ones|)) / |F|`` where ``F`` are the fractional entries.

Backward: on the fractional set ``F`` (``0 < p_j < 1``), ``dp_i/du_j = [i in F] (delta_ij - [j in F]/|F|)``;
entries at 0 or 1 have zero gradient. So ``grad_u = 1_F * (g - mean_F(g))``.

A Triton version of the same operator (``sparsek_triton``: threshold search plus an exact solve on
the segment, float64 search arithmetic) runs with ``sparsek(..., backend="triton")``.
"""

from __future__ import annotations

import torch

from .kernel_module import KernelModule, interpreter_on
from .sparsek_budget import key_budget, require

__all__ = ["SparseKFunction", "sparsek", "sparsek_threshold"]

_BACKENDS = ("auto", "torch", "triton")

#: Whether ``backend="auto"`` takes the Triton kernel for CUDA tensors. On: the kernel is several times
#: faster than the PyTorch path, forward and backward, with identical outputs
#: (``scripts/benchmark_kernels.py --section sparsek``; docs/benchmarks.md, SparseK operator kernel).
AUTO_TRITON_ON_CUDA = True


def sparsek_threshold(u: torch.Tensor, k, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The threshold ``tau`` of every row (no autograd).

    Args:
        u: ``(..., n)`` float scores. k: int or integer tensor broadcastable to ``u.shape[:-1]``.
        mask: optional ``(..., n)`` bool, True = candidate (non-candidates get ``p = 0``).
    Returns:
        ``tau (...,)`` in float64 and the effective budget ``k_eff = min(k, candidates)`` (int64).
        Rows with ``k_eff == candidates`` return ``tau = min(u) - 1`` over candidates (every
        candidate at 1); rows without candidates or with ``k == 0`` return ``+inf``.
    """
    lead, n = u.shape[:-1], u.shape[-1]
    dev = u.device
    kk = key_budget(k, lead, dev)
    if mask is None:
        mask = torch.ones_like(u, dtype=torch.bool)
    n_c = mask.sum(-1)
    k_eff = torch.minimum(kk, n_c)
    big = torch.finfo(u.dtype).max
    u_min = torch.where(mask, u, torch.full_like(u, big)).amin(-1)
    u_min = torch.where(n_c > 0, u_min, torch.zeros_like(u_min))
    # Non-candidates sit 2 below every candidate: for any tau above min(u) - 1 they contribute 0,
    # and rows that need a smaller tau (k_eff == n_c) are answered directly below.
    # The search runs in float64: float32 prefix sums pick the wrong segment once the scores carry a
    # large common offset (u = randn + 1e4 put row sums 4e-3 off).
    x = torch.where(mask, u, (u_min - 2).unsqueeze(-1).expand_as(u)).detach().double()
    s = torch.sort(x, dim=-1).values.contiguous()  # ascending (..., n)
    prefix = torch.nn.functional.pad(torch.cumsum(s, -1), (1, 0))  # (..., n+1)
    bp, _ = torch.sort(torch.cat([s, s - 1], -1), dim=-1)  # (..., 2n) breakpoints ascending

    def f_at(t):
        i1 = torch.searchsorted(s, (t + 1).contiguous(), side="left")  # values < t + 1
        i0 = torch.searchsorted(s, t.contiguous(), side="right")  # values <= t
        frac_sum = prefix.gather(-1, i1) - prefix.gather(-1, i0)
        return (n - i1).to(s.dtype) + frac_sum - (i1 - i0).to(s.dtype) * t

    fb = f_at(bp)  # (..., 2n) non-increasing
    kf = k_eff.to(s.dtype).unsqueeze(-1)
    # Last breakpoint with f >= k; tau lies between it and the next breakpoint.
    lo_i = ((fb >= kf).sum(-1, keepdim=True) - 1).clamp(0, 2 * n - 1)
    hi_i = (lo_i + 1).clamp_max(2 * n - 1)
    t_lo, t_hi = bp.gather(-1, lo_i), bp.gather(-1, hi_i)
    mid = 0.5 * (t_lo + t_hi)
    # Active set on that segment (fixed inside it): ones have u >= t + 1, fractions t < u < t + 1.
    # The final solve sums the fractional entries directly in float64 (no prefix-sum cancellation),
    # so tau does not depend on how many non-candidates a row carries (decode equals recompute).
    xd, midd = x.double(), mid.double()
    frac = mask & (xd > midd) & (xd < midd + 1)
    n_frac = frac.sum(-1).double()
    ones = (mask & (xd >= midd + 1)).sum(-1).double()
    frac_sum = torch.where(frac, xd, torch.zeros_like(xd)).sum(-1)
    tau = torch.where(n_frac > 0, (frac_sum - (k_eff.double() - ones)) / n_frac.clamp_min(1), t_lo.squeeze(-1).double())
    all_in = k_eff == n_c
    inf = torch.full_like(tau, float("inf"))
    tau = torch.where(all_in, (u_min - 1).to(tau.dtype), tau)
    tau = torch.where(k_eff == 0, inf, tau)
    return tau, k_eff


class SparseKFunction(torch.autograd.Function):
    """``p = clip(u - tau(u), 0, 1)`` with the exact Jacobian of the capped-simplex projection."""

    @staticmethod
    def forward(ctx, u, k, mask):
        tau, _ = sparsek_threshold(u, k, mask)
        p = (u.double() - tau.unsqueeze(-1)).clamp(0, 1).to(u.dtype)
        if mask is not None:
            p = torch.where(mask, p, torch.zeros_like(p))
        frac = (p > 0) & (p < 1)
        ctx.save_for_backward(frac)
        return p

    @staticmethod
    def backward(ctx, grad_p):
        (frac,) = ctx.saved_tensors
        g = torch.where(frac, grad_p, torch.zeros_like(grad_p))
        cnt = frac.sum(-1, keepdim=True).clamp_min(1).to(g.dtype)
        grad_u = torch.where(frac, g - g.sum(-1, keepdim=True) / cnt, torch.zeros_like(g))
        return grad_u, None, None


_TRITON = KernelModule(".sparsek_triton", "_sparsek_fwd_kernel")


def _triton_kernels(u: torch.Tensor, backend: str):
    """The ``sparsek_triton`` module if ``backend`` selects it for ``u``, else None."""
    if backend == "torch" or (backend == "auto" and not (AUTO_TRITON_ON_CUDA and u.is_cuda and u.dtype != torch.float64)):
        return None
    try:
        mod = _TRITON.module if _TRITON.module is not None else _TRITON.load()
    except ImportError as e:
        if backend == "auto":
            return None
        raise RuntimeError(f"sparsek: backend='triton' needs triton ({e})") from None
    if u.is_cuda:
        return mod
    if not interpreter_on() or not _TRITON.interpreted():
        raise RuntimeError(
            f"sparsek: backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before sparsek_triton is "
            f"imported for tensors on the CPU; got a tensor on {u.device}"
        )
    return mod


def sparsek(u: torch.Tensor, k, mask: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """SparseK weights ``p (..., n)``: the projection of ``u`` onto ``{0 <= p <= 1, sum p = min(k, n_c)}``.

    Args:
        u: ``(..., n)`` float16/bfloat16/float32/float64 scores (computed in float32 at least).
        k: budget, an int or an integer tensor broadcastable to ``u.shape[:-1]``.
        mask: optional ``(..., n)`` bool candidate mask, broadcast to ``u`` (ValueError where it does not);
            ``p = 0`` outside it.
        backend: ``"torch"`` (the sort-based path above), ``"triton"`` (``sparsek_triton``: CUDA
            tensors, or CPU tensors under ``TRITON_INTERPRET=1``; computes in float32, float64
            inputs included) or ``"auto"``: the Triton kernel for CUDA tensors other than float64
            (``AUTO_TRITON_ON_CUDA``), else the PyTorch path.
    Returns:
        ``p`` in ``u.dtype``, differentiable in ``u`` (exact Jacobian, fractional entries only).
        The support can exceed ``k`` (fractional entries); callers that need exactly ``k`` keys
        keep the ``k`` largest ``p_j`` (``build_selection`` does).
    """
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise ValueError(f"sparsek: `backend` must be one of {', '.join(map(repr, _BACKENDS))}, got {backend!r}")
    if not isinstance(u, torch.Tensor) or not u.dtype.is_floating_point:
        raise TypeError(f"sparsek: `u` must be a floating-point tensor, got {getattr(u, 'dtype', type(u).__name__)}")
    if u.dim() < 1 or u.shape[-1] == 0:
        raise ValueError(f"sparsek: `u` must have a non-empty last dimension, got shape {tuple(u.shape)}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError("sparsek: `mask` must be a bool tensor (True = candidate)")
        if mask.shape != u.shape:
            try:
                mask = mask.expand(u.shape)
            except RuntimeError:
                raise ValueError(
                    f"sparsek: `mask` of shape {tuple(mask.shape)} does not broadcast to `u`'s shape {tuple(u.shape)}"
                ) from None
    require(torch.isfinite(torch.where(mask, u, torch.zeros_like(u)) if mask is not None else u).all(),
            "sparsek: candidate scores `u` must be finite")
    kernels = _triton_kernels(u, backend)
    if kernels is not None:
        return kernels.sparsek_triton(u.float(), k, mask).to(u.dtype)
    work = u if u.dtype == torch.float64 else u.float()
    return SparseKFunction.apply(work, k, mask).to(u.dtype)
