"""The Hopper CUDA structured forward (``sparse_k.attention.cuda.structured``) against the exact float64 reference.

GPU tests (``gpu`` marker) need an sm_90 device and nvcc; they build the extension on first use.
Tolerance: relative Frobenius error; bf16 operands with P rounded to 16 bits before P V give
1e-3..1e-2 (2e-3 measured on the H100), fp16 about 8x less; a wrong tile, mask or layout gives O(1).
"""

import time

import pytest
import torch
from helpers import (
    STRUCTURED_CUDA_FWD_CASES,
    VIEW_LAYOUTS,
    bshd_views,
    nan_bshd,
    needs_sm90,
    rel_err,
    structured_case_id,
    structured_pattern,
)
from sparse_k import reference_attention, row_geometry
from sparse_k.attention.cuda import structured as cs

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("case", STRUCTURED_CUDA_FWD_CASES, ids=structured_case_id)
def test_matches_reference(case, D):
    """Poisoned outputs, fresh random inputs, both head dims."""
    B, Hq, Hkv, S, dtype, pid, window, sinks = case
    seed = time.time_ns() % 2**31
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, device="cuda", dtype=dtype, generator=g) for h in (Hq, Hkv, Hkv))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, Hq, S), float("nan"), device="cuda")
    scale = D ** -0.5
    cs._launch(q, k, v, out, lse, pid, window, sinks, scale)
    geo = row_geometry(B, S, S, None, device="cuda")
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), structured_pattern(pid, window, sinks), geo, scale=scale)
    assert not out.isnan().any() and not lse.isnan().any(), seed
    assert rel_err(out, ref) < TOL[dtype], seed
    assert float((lse.double() - ref_lse).abs().max()) < 1e-3, seed


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("layout", VIEW_LAYOUTS)
@pytest.mark.parametrize("case", STRUCTURED_CUDA_FWD_CASES, ids=structured_case_id)
def test_strided_views_match_reference(case, layout, D):
    """q, k, v as transposed views of (B, S, H, D) storage (own tensors, or slices of one fused QKV
    projection), read in place; the output written into a NaN-poisoned (B, S, H, D)-ordered view; the
    public forward returns that order (so a Transformers layer's transpose back is contiguous)."""
    B, Hq, Hkv, S, dtype, pid, window, sinks = case
    seed = time.time_ns() % 2**31
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, _ = bshd_views(B, Hq, Hkv, S, dtype, g, layout, D)
    assert not q.is_contiguous() and cs.cuda_structured_ok(q, k, v, pattern_id=pid)
    scale = D ** -0.5
    geo = row_geometry(B, S, S, None, device="cuda")
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), structured_pattern(pid, window, sinks), geo,
                                       scale=scale)
    out = nan_bshd(B, Hq, S, dtype, D)
    lse = torch.full((B, Hq, S), float("nan"), device="cuda")
    cs._launch(q, k, v, out, lse, pid, window, sinks, scale)
    assert not out.isnan().any() and not lse.isnan().any(), seed
    assert rel_err(out, ref) < TOL[dtype], seed
    assert float((lse.double() - ref_lse).abs().max()) < 1e-3, seed
    out2, lse2 = cs.cuda_structured_forward(q, k, v, pattern_id=pid, window=window, sinks=sinks, scale=scale)
    assert out2.transpose(1, 2).is_contiguous()
    assert torch.equal(out2, out) and torch.equal(lse2, lse), seed  # one kernel, one order of operations


@pytest.mark.gpu
@needs_sm90
def test_public_forward_and_contract():
    q = torch.randn(1, 4, 300, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.bfloat16)
    assert cs.cuda_structured_ok(q, k, v, pattern_id=2)
    out, lse = cs.cuda_structured_forward(q, k, v, pattern_id=2, window=100, sinks=4, scale=0.1)
    geo = row_geometry(1, 300, 300, None, device="cuda")
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), structured_pattern(2, 100, 4), geo, scale=0.1)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert float((lse.double() - ref_lse).abs().max()) < 1e-3
    q64, k64, v64 = (t[..., :64].contiguous() for t in (q, k, v))
    q96, k96, v96 = (t[..., :96].contiguous() for t in (q, k, v))
    assert cs.cuda_structured_ok(q64, k64, v64, pattern_id=1)
    assert not cs.cuda_structured_ok(q96, k96, v96, pattern_id=1)
    assert not cs.cuda_structured_ok(q[..., :64].contiguous(), k, v, pattern_id=1)  # head dims differ
    assert out.is_contiguous()  # contiguous inputs: contiguous output, as before
    padded = torch.randn(1, 4, 300, 132, device="cuda", dtype=torch.bfloat16)[..., :128]  # rows of 264 bytes
    assert not cs.cuda_structured_ok(padded, k, v, pattern_id=1)
    assert not cs.cuda_structured_ok(q, k[:, :1].expand(1, 2, 300, 128), v, pattern_id=1)  # head stride 0
    assert not cs.cuda_structured_ok(q, k, v, pattern_id=1, causal=False)
    assert cs.cuda_structured_ok(q, k, v, pattern_id=3)  # block_diagonal
    assert not cs.cuda_structured_ok(q, k, v, pattern_id=4)  # bigbird: layout path


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("order", ["static", "snake", "head_snake"])
@pytest.mark.parametrize("pid,window,sinks", [(0, 0, 0), (1, 700, 0), (2, 500, 9), (3, 384, 0)])
def test_work_orders_match_reference(monkeypatch, order, pid, window, sinks):
    """Each work order forced (``SPARSE_K_WORK_ORDER``) on a shape where it reorders: one KV head's work tiles span
    more than two grids (head_snake reverses a block inside a head; snake too), an odd length; poisoned outputs."""
    monkeypatch.setenv("SPARSE_K_WORK_ORDER", order)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    Hq, Hkv = 8, 1
    S = 128 * (2 * sms // Hq + 2) + 77
    seed = time.time_ns() % 2**31
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, h, S, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (Hq, Hkv, Hkv))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((1, Hq, S), float("nan"), device="cuda")
    cs._launch(q, k, v, out, lse, pid, window, sinks, 0.1)
    geo = row_geometry(1, S, S, None, device="cuda")
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), structured_pattern(pid, window, sinks), geo,
                                       scale=0.1)
    assert not out.isnan().any() and not lse.isnan().any(), seed
    assert rel_err(out, ref) < TOL[torch.bfloat16], seed
    assert float((lse.double() - ref_lse).abs().max()) < 1e-3, seed


@pytest.mark.gpu
@needs_sm90
def test_bad_work_order_is_refused(monkeypatch):
    monkeypatch.setenv("SPARSE_K_WORK_ORDER", "fastest")
    q = torch.randn(1, 4, 300, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="SPARSE_K_WORK_ORDER=fastest"):
        cs.cuda_structured_forward(q, k, k, pattern_id=1, window=100, scale=0.1)


def test_argument_errors():
    """Bad arguments raise ValueError naming the value, before any build or device work."""
    q = torch.zeros(1, 2, 8, 128)
    with pytest.raises(ValueError, match="pattern_id=4"):
        cs.cuda_structured_forward(q, q, q, pattern_id=4, scale=1.0)
    with pytest.raises(ValueError, match="window=0"):
        cs.cuda_structured_forward(q, q, q, pattern_id=1, window=0, scale=1.0)
    with pytest.raises(ValueError, match="sinks=-1"):
        cs.cuda_structured_forward(q, q, q, pattern_id=2, window=4, sinks=-1, scale=1.0)
    with pytest.raises(ValueError, match="scale=0"):
        cs.cuda_structured_forward(q, q, q, pattern_id=1, window=4, scale=0)
    with pytest.raises(ValueError, match="outside the kernel's contract"):
        cs.cuda_structured_forward(q, q, q, pattern_id=1, window=4, scale=1.0)  # CPU tensors
    assert not cs.cuda_structured_ok(q, q, q, pattern_id=1)
