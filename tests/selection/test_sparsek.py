"""The SparseK operator (capped-simplex projection): forward against a sort-based reference, gradcheck."""

import itertools

import pytest
import torch
from sparse_k.selection.sparsek import sparsek, sparsek_threshold


def sort_reference(u: torch.Tensor, k: int) -> torch.Tensor:
    """Textbook sort-based projection of one row (float64): try every (#ones a, #nonzero b) pair of
    the descending order and keep the tau whose clip reproduces that split and sums to k."""
    n = u.numel()
    if k >= n:
        return torch.ones_like(u)
    if k == 0:
        return torch.zeros_like(u)
    z = torch.sort(u, descending=True).values
    if z[k - 1] - z[k] >= 1:  # exactly k ones, no fractional entry: any tau in [z_k, z_{k-1} - 1]
        return (u - z[k]).clamp(0, 1)
    for a, b in itertools.product(range(k + 1), range(1, n + 1)):
        if b <= a:
            continue
        tau = (z[a:b].sum() - (k - a)) / (b - a)
        ones_ok = a == 0 or z[a - 1] - tau >= 1
        frac_ok = bool(((z[a:b] - tau) > 0).all() and ((z[a:b] - tau) < 1).all())
        zero_ok = b == n or z[b] - tau <= 0
        if ones_ok and frac_ok and zero_ok:
            return (u - tau).clamp(0, 1)
    raise AssertionError("no consistent split found")


@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (13, 1), (33, 12), (64, 63), (5, 9), (40, 0)])
def test_matches_sort_reference_and_constraints(n, k):
    g = torch.Generator().manual_seed(1000 * n + k)
    u = torch.randn(6, n, generator=g, dtype=torch.float64) * float(torch.rand((), generator=g) * 4 + 0.2)
    p = sparsek(u, k)
    for row in range(u.shape[0]):
        ref = sort_reference(u[row], k)
        # float64 sums of <= 64 terms: error ~1e-15; 1e-12 leaves room for the prefix-sum form.
        torch.testing.assert_close(p[row], ref, atol=1e-12, rtol=0)
    assert bool(((p >= 0) & (p <= 1)).all())
    torch.testing.assert_close(p.sum(-1), torch.full((6,), float(min(k, n)), dtype=torch.float64), atol=1e-10, rtol=0)


def test_mask_and_per_row_budget():
    g = torch.Generator().manual_seed(7)
    u = torch.randn(3, 4, 50, generator=g) * 3
    mask = torch.rand(3, 4, 50, generator=g) < 0.6
    mask[0, 0] = False  # a row without candidates
    mask[1, 1, :5] = True
    mask[1, 1, 5:] = False  # fewer candidates than the budget
    k = torch.randint(1, 20, (3, 4), generator=g)
    p = sparsek(u, k, mask)
    assert bool((p[~mask] == 0).all())
    want = torch.minimum(k, mask.sum(-1)).float()
    # float32 sums of <= 50 terms in [0, 1]: 1e-4 is ~100 ulps of the largest sum.
    torch.testing.assert_close(p.sum(-1), want, atol=1e-4, rtol=0)
    torch.testing.assert_close(p[1, 1, :5], torch.ones(5))
    for b, h in [(1, 2), (2, 3), (0, 1)]:
        ref = sort_reference(u[b, h][mask[b, h]].double(), int(k[b, h]))
        torch.testing.assert_close(p[b, h][mask[b, h]].double(), ref, atol=1e-5, rtol=0)


def test_low_precision_inputs_follow_float32():
    g = torch.Generator().manual_seed(3)
    u = torch.randn(4, 37, generator=g) * 2
    for dt in (torch.float16, torch.bfloat16):
        p = sparsek(u.to(dt), 9)
        assert p.dtype == dt
        ref = sparsek(u.to(dt).float(), 9)
        # The projection runs in float32 on the rounded scores; only the output rounding differs.
        torch.testing.assert_close(p.float(), ref, atol=torch.finfo(dt).eps, rtol=0)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(11)
    u = (torch.randn(2, 3, 19, generator=g, dtype=torch.float64) * 2).requires_grad_()
    mask = torch.rand(2, 3, 19, generator=g) < 0.8
    k = torch.randint(1, 10, (2, 3), generator=g)
    # tau comes from prefix sums (absolute rounding ~1e-14); a central difference with eps 1e-6 turns
    # that into ~1e-8 noise, so atol 1e-6 is 100x the noise and far below any wrong Jacobian entry
    # (entries are 0, 1 or multiples of 1/|F| with |F| <= 19).
    assert torch.autograd.gradcheck(lambda x: sparsek(x, k, mask), (u,), eps=1e-6, atol=1e-6)


def test_backward_acts_on_fractional_entries_only():
    g = torch.Generator().manual_seed(5)
    u = (torch.randn(40, generator=g, dtype=torch.float64) * 4).requires_grad_()
    p = sparsek(u, 6)
    w = torch.randn(40, generator=g, dtype=torch.float64)
    (p * w).sum().backward()
    frac = (p > 0) & (p < 1)
    assert int(frac.sum()) >= 1
    assert bool((u.grad[~frac] == 0).all())
    assert abs(float(u.grad.sum())) < 1e-12  # the sum constraint: gradients on F sum to zero
    want = w[frac] - w[frac].mean()
    torch.testing.assert_close(u.grad[frac], want)


def test_threshold_and_bad_inputs():
    u = torch.tensor([[3.0, 1.0, 0.2, -1.0]])
    tau, k_eff = sparsek_threshold(u, 2)
    p = (u - tau[:, None]).clamp(0, 1)
    assert float(p.sum()) == pytest.approx(2.0)
    assert int(k_eff) == 2
    with pytest.raises(ValueError, match="k"):
        sparsek(u, -1)
    with pytest.raises(TypeError, match="k"):
        sparsek(u, 2.5)
    with pytest.raises(TypeError, match="floating"):
        sparsek(torch.ones(3, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="finite"):
        sparsek(torch.tensor([1.0, float("nan")]), 1)
    with pytest.raises(TypeError, match="mask"):
        sparsek(u, 1, torch.ones(1, 4))


def test_mask_of_another_shape_is_named():
    """A candidate mask that does not broadcast to ``u`` names both shapes (not a RuntimeError of ``expand``); one
    that broadcasts (a row shared by every block) runs as its expansion."""
    u = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"`mask` of shape \(3, 4\) does not broadcast to `u`'s shape \(3, 5\)"):
        sparsek(u, 2, torch.ones(3, 4, dtype=torch.bool))
    row = torch.tensor([True, False, True, True, False])
    torch.testing.assert_close(sparsek(u, 2, row), sparsek(u, 2, row.expand(3, 5)))


def test_sparsemax_special_case():
    """k = 1 with no cap binding is sparsemax: compare with its closed form."""
    g = torch.Generator().manual_seed(2)
    u = torch.randn(8, 30, generator=g, dtype=torch.float64) * 0.3
    p = sparsek(u, 1)
    z = torch.sort(u, -1, descending=True).values
    r = torch.arange(1, 31, dtype=torch.float64)
    support = 1 + r * z > z.cumsum(-1)
    kz = support.sum(-1, keepdim=True)
    tau = (z.cumsum(-1).gather(-1, kz - 1) - 1) / kz
    torch.testing.assert_close(p, (u - tau).clamp_min(0), atol=1e-12, rtol=0)


def test_float32_scores_with_a_large_common_offset():
    """A common offset does not move the projection: float32 scores around 1e4 and 1e5 give the
    weights of the offset-free float64 scores (to float32 resolution of the offset) and sums equal
    to k (the threshold search runs in float64)."""
    g = torch.Generator().manual_seed(11)
    base = torch.randn(4, 1000, generator=g, dtype=torch.float64)
    for off in (1e4, 1e5):
        u = (base + off).float()
        ref = sparsek(u.double() - off, 30)
        p = sparsek(u, 30)
        assert torch.allclose(p.sum(-1).double(), torch.full((4,), 30.0, dtype=torch.float64), atol=1e-3)
        torch.testing.assert_close(p.double(), ref, atol=1e-5, rtol=0)
