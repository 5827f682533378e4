"""The Triton SparseK kernels (``sparse_k.selection.sparsek_triton``) against the PyTorch sort-based path.

Without CUDA the kernels run under Triton's interpreter, set up by ``tests/triton_interp.py``:
if triton was imported before this module could set ``TRITON_INTERPRET=1`` (e.g. through
``import sparse_k``), ``test_interpreter_suite_in_subprocess`` runs this file in a fresh interpreter
with the variable set and the kernel tests here are skipped. With CUDA they run compiled.

Tolerances: both paths solve for ``tau`` in float64 and round ``p`` to float32, so on ordinary data
they agree to a few float32 ulps; 1e-5 is the bound. Sums of ``n`` float32-rounded weights carry up
to ``n * 2**-25`` rounding. Every kernel output is poisoned (NaN, or -1 for integers) before the
launch, so an entry the kernel does not write fails the comparison.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_interp import (
    ON_GPU,
    KERNEL_TEST,
    import_kernels,
    run_file_interpreted,
)

HAVE_TRITON, IN_PROCESS, _kernels = import_kernels("selection.sparsek_triton")
if HAVE_TRITON:
    (triton_sparsek,) = _kernels

from sparse_k.selection.sparsek import sparsek, sparsek_threshold

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")

_SUBPROCESS_ONLY = KERNEL_TEST  # not collected where IN_PROCESS is False (conftest): the subprocess runs them
_N_KERNEL_TESTS = 16  # tests below marked _SUBPROCESS_ONLY, parametrisations included

DEV = "cuda" if ON_GPU else "cpu"
LENGTHS = [1, 7, 33, 1000, 4097]


@pytest.mark.skipif(IN_PROCESS, reason="the kernels run in this process")
def test_interpreter_suite_in_subprocess():
    """Run this file under a fresh interpreter with ``TRITON_INTERPRET=1`` set before triton loads."""
    run_file_interpreted(__file__, _N_KERNEL_TESTS, "-k", "not sm90", timeout=600)


@pytest.fixture(autouse=True)
def _interpret_and_poison(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")

    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)

    monkeypatch.setattr(triton_sparsek, "_empty", poisoned)


def _budgets(n: int) -> torch.Tensor:
    """One row per budget: 0, 1, a k inside (0, n), n and above n."""
    return torch.tensor([0, 1, max(1, n // 3), n, n + 5], device=DEV)


def _check(u, k, mask=None, ref_u=None, atol=1e-5, every_tau=False):
    """Kernel forward vs the PyTorch path (on ``ref_u`` if given): p, constraints, tau, search length.
    ``tau`` is compared where it is unique, or (``every_tau``) also where ``f = k`` on an interval."""
    p, tau, iters = triton_sparsek.sparsek_forward(u, k, mask)
    ref_u = u if ref_u is None else ref_u
    ref = sparsek(ref_u, k, mask, backend="torch")
    assert p.dtype == torch.float32 and not p.isnan().any()
    torch.testing.assert_close(p.double(), ref.double(), atol=atol, rtol=0)
    assert bool(((p >= 0) & (p <= 1)).all())
    if mask is not None:
        assert bool((p[~mask.expand(u.shape)] == 0).all())
    ref_tau, k_eff = sparsek_threshold(ref_u, k, mask)
    n = u.shape[-1]
    torch.testing.assert_close(p.double().sum(-1), k_eff.double(), atol=n * 2.0 ** -25 + 1e-9, rtol=0)
    cand = mask.expand(u.shape) if mask is not None else torch.ones_like(u, dtype=torch.bool)
    # tau is unique where the row has a fractional entry or is all ones / all zeros.
    unique = ((p > 0) & (p < 1)).any(-1) | (k_eff == 0) | (k_eff == cand.sum(-1)) | every_tau
    assert torch.equal(torch.isinf(tau), k_eff == 0)
    fin = unique & (k_eff > 0)
    torch.testing.assert_close(tau[fin], ref_tau[fin], atol=atol, rtol=0)
    assert int(iters.min()) >= 0 and int(iters.max()) <= 48, iters
    return p, tau


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("n", LENGTHS)
def test_forward_lengths_and_budgets(n):
    """Gaussian scores of random spread, every budget case (0, 1, inside, n, above n) as one row each."""
    g = torch.Generator().manual_seed(n)
    k = _budgets(n)
    u = (torch.randn(len(k), n, generator=g) * (0.2 + 4 * torch.rand(len(k), 1, generator=g))).to(DEV)
    p, tau = _check(u, k)
    assert bool((p[0] == 0).all())
    # All in: tau = float32(min u - 1), as the PyTorch path; that rounding can leave the smallest
    # weight an ulp below 1.
    torch.testing.assert_close(p[3:], torch.ones_like(p[3:]), atol=2.0 ** -23, rtol=0)
    assert float(tau[3]) == float(u[3].min() - 1)


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("n", [33, 1000])
def test_forward_masks(n):
    """Masks with holes, an all-False row, fewer candidates than the budget, per-row budgets,
    non-finite scores off the mask, a mask broadcast over the rows of a head."""
    g = torch.Generator().manual_seed(100 + n)
    u = torch.randn(2, 4, n, generator=g) * 2
    mask = torch.rand(2, 4, n, generator=g) < 0.6
    mask[0, 0] = False
    mask[1, 1] = False
    mask[1, 1, : n // 4] = True
    u[~mask] = torch.tensor([float("nan"), float("inf"), -1e30])[torch.randint(0, 3, (int((~mask).sum()),), generator=g)]
    k = torch.randint(0, n // 2, (2, 4), generator=g)
    k[1, 1] = n // 4 + 3
    _check(u.to(DEV), k.to(DEV), mask.to(DEV))
    shared = (torch.rand(2, 1, n, generator=g) < 0.5).to(DEV)
    _check(torch.randn(2, 3, n, generator=g).to(DEV), 5, shared)


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("n", [7, 33, 1000])
def test_forward_integer_ties(n):
    """Integer-valued scores: many ties, breakpoints u_i - 1 that coincide with other u_j, rows with
    k ones and no fractional entry (tau: the right end of the interval where f = k, as the PyTorch
    path, whose float32 sums are exact on integers)."""
    g = torch.Generator().manual_seed(200 + n)
    u = torch.randint(-3, 4, (12, n), generator=g).float()
    k = torch.randint(0, n + 2, (12,), generator=g)
    k[:3] = torch.tensor([1, max(1, n // 2), n - 1])
    # Rows 3, 4: values 3 apart, k = how many reach 3 (resp. 0): f = k on [0, 2] (resp. [-3, -1]).
    u[3:5] = 3 * torch.randint(-1, 2, (2, n), generator=g).float()
    u[3:5, 0] = torch.tensor([3.0, 0.0])
    u[3:5, -1] = -3.0
    k[3:5] = torch.stack([(u[3] >= 3).sum(), (u[4] >= 0).sum()])
    p, tau = _check(u.to(DEV), k.to(DEV), every_tau=True)
    assert tau[3:5].tolist() == [2.0, -1.0] and bool(((p[3:5] == 0) | (p[3:5] == 1)).all())


@_SUBPROCESS_ONLY
def test_forward_breakpoint_grid():
    """96 short rows on a half-integer grid (ties, u_i - 1 == u_j, solutions at breakpoints, flat
    intervals) with random masks and budgets; every tau against the float64 PyTorch path."""
    g = torch.Generator().manual_seed(600)
    u = (torch.randint(-4, 5, (96, 12), generator=g) * 0.5).to(DEV)
    mask = (torch.rand(96, 12, generator=g) < 0.8).to(DEV)
    k = torch.randint(0, 14, (96,), generator=g).to(DEV)
    _check(u, k, mask, ref_u=u.double(), every_tau=True)


@_SUBPROCESS_ONLY
def test_forward_large_magnitude():
    """Spread 1e3, and offsets 1e4 / 1e5 on unit spread (both implementations search in float64;
    the reference is the PyTorch path on the float64 copy of the same float32 values)."""
    g = torch.Generator().manual_seed(300)
    n = 1000
    k = torch.tensor([1, 30, 500, 999])
    spread = torch.randn(4, n, generator=g) * 1e3
    _check(spread.to(DEV), k.to(DEV))
    for off in (1e4, 1e5):
        u = (torch.randn(4, n, generator=g) + off).to(DEV)
        _check(u, k.to(DEV), ref_u=u.double())


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("n", [7, 1000, 4097])
def test_backward_matches_autograd(n):
    """``sparsek(..., backend="triton")`` gradients vs the PyTorch path's autograd, with a mask and ties."""
    g = torch.Generator().manual_seed(400 + n)
    u = torch.randn(2, 2, n, generator=g) * 1.5
    u[1, 1] = torch.randint(-2, 3, (n,), generator=g).float()
    mask = torch.rand(2, 2, n, generator=g) < 0.8
    k = torch.randint(1, max(2, n // 2), (2, 2), generator=g)
    w = torch.randn(2, 2, n, generator=g).to(DEV)
    grads = []
    for backend in ("triton", "torch"):
        x = u.to(DEV).clone().requires_grad_()
        p = sparsek(x, k.to(DEV), mask.to(DEV), backend=backend)
        (p * w).sum().backward()
        grads.append(x.grad)
    assert not grads[0].isnan().any() and float(grads[0].abs().max()) > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=0)


@_SUBPROCESS_ONLY
def test_low_precision_inputs_and_dispatch():
    """fp16/bf16/float64 inputs are computed in float32 and returned in their dtype; bad inputs."""
    g = torch.Generator().manual_seed(500)
    u = torch.randn(3, 37, generator=g).to(DEV) * 2
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        p = sparsek(u.to(dt), 9, backend="triton")
        assert p.dtype == dt
        ref = sparsek(u.to(dt).float(), 9, backend="torch")
        torch.testing.assert_close(p.float(), ref, atol=torch.finfo(dt).eps if dt != torch.float64 else 1e-5, rtol=0)
    with pytest.raises(ValueError, match="k"):
        triton_sparsek.sparsek_forward(u, -1)
    with pytest.raises(TypeError, match="mask"):
        triton_sparsek.sparsek_forward(u, 1, torch.ones(3, 37, device=DEV))
    with pytest.raises(ValueError, match=r"\(3, 5\)"):
        triton_sparsek.sparsek_forward(u, 1, torch.ones(3, 5, dtype=torch.bool, device=DEV))
    with pytest.raises(ValueError, match="48"):
        triton_sparsek.sparsek_forward(u, 1, block=48)
    with pytest.raises(TypeError, match="frac"):
        triton_sparsek.sparsek_backward(u, torch.zeros(3, 37, dtype=torch.bool, device=DEV))
    with pytest.raises(ValueError, match=r"\(3, 36\)"):
        triton_sparsek.sparsek_backward(u, torch.zeros(3, 36, dtype=torch.uint8, device=DEV))


def test_backend_argument(monkeypatch):
    """Runs in every process: the backend names and the CPU-without-interpreter error."""
    u = torch.randn(2, 10)
    for bad in ("cuda", 3, None):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            sparsek(u, 2, backend=bad)
    torch.testing.assert_close(sparsek(u, 2, backend="auto"), sparsek(u, 2, backend="torch"), atol=0, rtol=0)
    if not ON_GPU:
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            sparsek(u, 2, backend="triton")


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sparse_k.selection import sparsek_triton as ts
fwd = {"U": "*fp32", "M": "*u8", "K": "*i64", "P": "*fp32", "TAU": "*fp64", "FRAC": "*u8", "ITERS": "*i32",
       "n": "i32", "stride_u": "i32", "stride_m": "i32", "stride_p": "i32", "stride_f": "i32", "max_iters": "i32",
       "HAS_MASK": "constexpr", "WRITE_FRAC": "constexpr", "BLOCK": "constexpr"}
bwd = {"G": "*fp32", "FRAC": "*u8", "GU": "*fp32", "n": "i32", "stride_g": "i32", "stride_f": "i32",
       "stride_gu": "i32", "BLOCK": "constexpr"}
for fn, sig, const in ((ts._sparsek_fwd_kernel, fwd, {"HAS_MASK": True, "WRITE_FRAC": True, "BLOCK": 1024}),
                       (ts._sparsek_bwd_kernel, bwd, {"BLOCK": 1024})):
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
    assert "cubin" in k.asm, list(k.asm)
print("compiled")
"""


def test_kernels_compile_for_sm90(tmp_path):
    """The compiled frontend (loop-carried types, float64, the search loop) accepts the kernels:
    compiled to an sm_90 cubin without a GPU, in a fresh process with the interpreter off."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300,
                         cwd=str(Path(__file__).resolve().parents[2]))
    assert res.returncode == 0 and "compiled" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU or not HAVE_TRITON, reason="needs CUDA and triton")
def test_cuda_matches_torch():
    """Compiled kernels at a realistic shape (3 x 64 rows of 4096 candidates), fp32, forward and
    backward against the PyTorch path on the same GPU (no timing)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 4096
    u = torch.randn(3, 64, n, device="cuda", generator=g) * 2
    u[2] = torch.randint(-4, 5, (64, n), device="cuda", generator=g).float()
    mask = torch.rand(3, 64, n, device="cuda", generator=g) < 0.9
    mask[0, 0] = False
    k = torch.randint(0, 300, (3, 64), device="cuda", generator=g)
    k[1, :4] = torch.tensor([0, 1, n, n + 1])
    p, tau = _check(u, k, mask)
    assert p.shape == (3, 64, n) and tau.shape == (3, 64)
    w = torch.randn(3, 64, n, device="cuda", generator=g)
    grads = []
    for backend in ("triton", "torch"):
        x = u.clone().requires_grad_()
        (sparsek(x, k, mask, backend=backend) * w).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_auto_backend_takes_the_kernel_on_cuda(monkeypatch):
    """``backend="auto"`` runs the Triton kernel for CUDA float32/bfloat16 scores (``AUTO_TRITON_ON_CUDA``,
    timed faster on the H100) and the PyTorch path for float64."""
    calls = []
    real = triton_sparsek.sparsek_forward
    monkeypatch.setattr(triton_sparsek, "sparsek_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    u = torch.randn(4, 300, device="cuda")
    torch.testing.assert_close(sparsek(u, 17), sparsek(u, 17, backend="torch"), atol=1e-5, rtol=0)
    assert len(calls) == 1
    sparsek(u.double(), 17)
    assert len(calls) == 1
