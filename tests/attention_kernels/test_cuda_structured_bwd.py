"""The Hopper CUDA structured backward (``sparse_k.attention.cuda.structured_bwd``) against float64 autograd,
at both head dims it takes (64 and 128).

GPU tests (``gpu`` marker) need an sm_90 device and nvcc; they build the extension on first use.
The backward gets the exact forward's output (rounded to the input dtype) and natural-log LSE, and
its gradients are compared with those of the float64 reference by relative Frobenius error. Tolerance:
bf16 operands (P and dS rounded to 16 bits before their matrix products) give about 1e-2 on the
gradients, fp16 about 8x less; a wrong tile, mask or layout gives O(1).
"""

import time

import pytest
import torch
from helpers import (
    STRUCTURED_CUDA_CASES,
    VIEW_LAYOUTS,
    bshd_views,
    nan_bshd,
    needs_sm90,
    rel_err,
    structured_case_id,
    structured_pattern,
)
from sparse_k import reference_attention, row_geometry
from sparse_k.attention.cuda import structured_bwd as cb

TOL = {torch.bfloat16: 4e-2, torch.float16: 1e-2}


def _case_inputs(B, Hq, Hkv, S, dtype, seed, D=128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(B, h, S, D, device="cuda", dtype=dtype, generator=g) for h in (Hq, Hkv, Hkv, Hq))
    return q, k, v, do


def _stats(do, out, lse):
    """``(delta, lse2)`` the CUDA backward reads, from the Triton preparation pass (as ``dispatch`` does)."""
    from sparse_k.attention.triton.bwd import bwd_preprocess

    return bwd_preprocess(do, out, lse)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("case", STRUCTURED_CUDA_CASES, ids=structured_case_id)
def test_matches_reference(case, D):
    """Fresh random inputs; dK/dV poisoned with NaN before the kernel writes them."""
    B, Hq, Hkv, S, dtype, pid, window, sinks = case
    seed = time.time_ns() % 2**31
    q, k, v, do = _case_inputs(B, Hq, Hkv, S, dtype, seed, D)
    scale = D ** -0.5
    geo = row_geometry(B, S, S, None, device="cuda")
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference_attention(*leaves, structured_pattern(pid, window, sinks), geo, scale=scale)
    refs = torch.autograd.grad(ref, leaves, do.double())
    out = ref.detach().to(dtype).contiguous()
    lse = ref_lse.detach().float().contiguous()
    dk = torch.full_like(k, float("nan"))
    dv = torch.full_like(v, float("nan"))
    dq_acc = cb._launch(do, q, k, v, out, lse, dk, dv, pid, window, sinks, scale, _stats(do, out, lse))
    dq = dq_acc[:, :, :S].to(dtype)
    if dq_acc.shape[2] > S:  # padded rows see no key: nothing is added there
        assert float(dq_acc[:, :, S:].abs().max()) == 0.0, seed
    for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), refs):
        assert not a.isnan().any(), (name, seed)
        assert rel_err(a, b) < TOL[dtype], (name, rel_err(a, b), seed)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("layout", VIEW_LAYOUTS)
@pytest.mark.parametrize("case", STRUCTURED_CUDA_CASES, ids=structured_case_id)
def test_strided_views_match_reference(case, layout, D):
    """q, k, v, dO as transposed views of (B, S, H, D) storage (own tensors, or slices of fused
    projections), read in place; dK / dV written into NaN-poisoned (B, S, H, D)-ordered views; the
    public backward returns gradients laid out like dense inputs (the order autograd hands back to a
    Transformers layer's projections without a copy)."""
    B, Hq, Hkv, S, dtype, pid, window, sinks = case
    seed = time.time_ns() % 2**31
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = bshd_views(B, Hq, Hkv, S, dtype, g, layout, D)
    scale = D ** -0.5
    geo = row_geometry(B, S, S, None, device="cuda")
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference_attention(*leaves, structured_pattern(pid, window, sinks), geo, scale=scale)
    refs = torch.autograd.grad(ref, leaves, do.double())
    out = ref.detach().to(dtype).transpose(1, 2).contiguous().transpose(1, 2)
    lse = ref_lse.detach().float().contiguous()
    assert cb.cuda_structured_bwd_ok(do, q, k, v, out, lse, pattern_id=pid)
    dk, dv = nan_bshd(B, Hkv, S, dtype, D), nan_bshd(B, Hkv, S, dtype, D)
    dq_acc = cb._launch(do, q, k, v, out, lse, dk, dv, pid, window, sinks, scale, _stats(do, out, lse))
    for name, a, b in zip(("dq", "dk", "dv"), (dq_acc[:, :, :S], dk, dv), refs):
        assert not a.isnan().any(), (name, seed)
        assert rel_err(a, b) < TOL[dtype], (name, rel_err(a, b), seed)
    grads = cb.cuda_structured_backward(do, q, k, v, out, lse, pattern_id=pid, window=window, sinks=sinks, scale=scale,
                                        stats=_stats(do, out, lse))
    for name, a, t, b in zip(("dq", "dk", "dv"), grads, (q, k, v), refs):
        assert a.shape == t.shape and a.dtype == t.dtype and a.transpose(1, 2).is_contiguous(), name
        assert rel_err(a, b) < TOL[dtype], (name, rel_err(a, b), seed)


@pytest.mark.gpu
@needs_sm90
def test_public_backward_and_contract():
    B, Hq, Hkv, S = 1, 4, 2, 300
    q, k, v, do = _case_inputs(B, Hq, Hkv, S, torch.bfloat16, 3)
    geo = row_geometry(B, S, S, None, device="cuda")
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference_attention(*leaves, structured_pattern(2, 100, 4), geo, scale=0.1)
    refs = torch.autograd.grad(ref, leaves, do.double())
    out, lse = ref.detach().to(q.dtype), ref_lse.detach().float()
    assert cb.cuda_structured_bwd_ok(do, q, k, v, out, lse, pattern_id=2)
    assert not cb.cuda_structured_bwd_ok(do, q, k, v, out, lse, pattern_id=3)
    assert not cb.cuda_structured_bwd_ok(do, q, k, v, out, lse, pattern_id=2, softcap=30.0)
    assert not cb.cuda_structured_bwd_ok(do.transpose(2, 3).contiguous().transpose(2, 3), q, k, v, out, lse, pattern_id=2)
    grads = cb.cuda_structured_backward(do, q, k, v, out, lse, pattern_id=2, window=100, sinks=4, scale=0.1,
                                        stats=_stats(do, out, lse))
    for a, t, b in zip(grads, (q, k, v), refs):
        assert a.dtype == t.dtype and a.shape == t.shape and a.is_contiguous()
        assert rel_err(a, b) < TOL[torch.bfloat16]
    with pytest.raises(ValueError, match="window"):
        cb.cuda_structured_backward(do, q, k, v, out, lse, pattern_id=1, window=0, scale=0.1, stats=None)
    with pytest.raises(ValueError, match="pattern_id=3"):  # block_diagonal: forward only
        cb.cuda_structured_backward(do, q, k, v, out, lse, pattern_id=3, window=64, scale=0.1, stats=None)
    with pytest.raises(ValueError, match="contract"):  # head dim 32
        cb.cuda_structured_backward(do[..., :32], q[..., :32], k[..., :32], v[..., :32], out[..., :32], lse,
                                    pattern_id=1, window=8, scale=0.1, stats=None)
