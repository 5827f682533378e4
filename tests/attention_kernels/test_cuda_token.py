"""The Hopper CUDA token-layout forward (``sparse_k.attention.cuda.token``) against the exact float64 reference, at
both head dims it takes (64 and 128).

GPU tests (``gpu`` marker) need an sm_90 device and nvcc; they build the extension on first use.
Tolerance: relative Frobenius error, as ``test_cuda_structured``: bf16 operands with P rounded to 16
bits before P V give 1e-3..1e-2, fp16 about 8x less; a wrong gathered row, mask or bias gives O(1).
The selections are random (unsorted, distinct) key lists over all positions, so they hold keys inside
the window, non-causal keys and keys past the count, which the kernel must drop.
"""

import time

import pytest
import sparse_k
import torch
from helpers import VIEW_LAYOUTS, bshd_views, nan_bshd, needs_sm90, random_slots, rel_err
from sparse_k import get_pattern, reference_attention, row_geometry
from sparse_k.attention import plan
from sparse_k.attention.cuda import token as ct

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _selection(B, Hkv, S, QB, K, weights, g, full=False):
    """Random distinct keys per (row, KV head, block); counts in [0, K] (all K with ``full``); weights
    in [0, 1) with about a tenth exactly 0 (ignored slots)."""
    NB = -(-S // QB)
    idx, cnt, w = random_slots(B, Hkv, NB, S, K, weights, g, full)
    return sparse_k.TokenLayout(idx, cnt, QB, torch.zeros(B, dtype=torch.int64, device="cuda"), w)


CASES = [  # B, Hq, Hkv, S, dtype, sinks, window, QB, K, weights
    (1, 4, 1, 1000, torch.bfloat16, 0, 256, 128, 200, False),
    (2, 6, 2, 1000, torch.bfloat16, 0, 256, 128, 200, True),
    (2, 8, 2, 3001, torch.float16, 64, 512, 256, 300, True),
    (1, 8, 2, 1500, torch.bfloat16, 4, 100, 128, 128, True),
    (1, 2, 1, 77, torch.float16, 0, 16, 128, 40, False),
    (1, 8, 1, 2100, torch.bfloat16, 130, 300, 384, 700, False),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-S{c[3]}-{str(c[4])[6:]}-s{c[5]}-W{c[6]}-QB{c[7]}-K{c[8]}-w{int(c[9])}")
def test_matches_reference(case, D):
    """Poisoned outputs, fresh random inputs, both static parts (sinks 0: pattern streaming with no
    sinks, as the learned pattern's static part), GQA, odd S, weights with zeros."""
    B, Hq, Hkv, S, dtype, sinks, window, QB, K, weights = case
    seed = time.time_ns() % 2**31
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, device="cuda", dtype=dtype, generator=g) for h in (Hq, Hkv, Hkv))
    sel = _selection(B, Hkv, S, QB, K, weights, g)
    p = get_pattern("sparse_k", sinks=sinks, window=window, top_k=K, query_block=QB)
    scale = D ** -0.5
    geo = row_geometry(B, S, S, None, device="cuda")
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), p, geo, scale=scale, selection=sel)
    for pid in ((1, 2) if sinks == 0 else (2,)):  # sinks 0: sliding_window and streaming are the same rule
        out = torch.full_like(q, float("nan"))
        lse = torch.full((B, Hq, S), float("nan"), device="cuda")
        ct._launch(q, k, v, out, lse, sel, pid, window, sinks, scale)
        assert not out.isnan().any() and not lse.isnan().any(), seed
        assert rel_err(out, ref) < TOL[dtype], (seed, pid)
        assert float((lse.double() - ref_lse).abs().max()) < 1e-3, (seed, pid)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("layout", VIEW_LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-S{c[3]}-{str(c[4])[6:]}-K{c[8]}")
def test_strided_views_match_reference(case, layout, D):
    """q, k, v as transposed views of (B, S, H, D) storage (own tensors, or slices of one fused QKV
    projection): window tiles through the 4-D TMA maps, selected rows gathered by their row stride;
    the output written into a NaN-poisoned (B, S, H, D)-ordered view."""
    B, Hq, Hkv, S, dtype, sinks, window, QB, K, weights = case
    seed = time.time_ns() % 2**31
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, _ = bshd_views(B, Hq, Hkv, S, dtype, g, layout, D)
    sel = _selection(B, Hkv, S, QB, K, weights, g)
    pid = 2
    assert ct.cuda_token_ok(q, k, v, sel, pattern_id=pid)
    p = get_pattern("sparse_k", sinks=sinks, window=window, top_k=K, query_block=QB)
    scale = D ** -0.5
    geo = row_geometry(B, S, S, None, device="cuda")
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), p, geo, scale=scale, selection=sel)
    out = nan_bshd(B, Hq, S, dtype, D)
    lse = torch.full((B, Hq, S), float("nan"), device="cuda")
    ct._launch(q, k, v, out, lse, sel, pid, window, sinks, scale)
    assert not out.isnan().any() and not lse.isnan().any(), seed
    assert rel_err(out, ref) < TOL[dtype], seed
    assert float((lse.double() - ref_lse).abs().max()) < 1e-3, seed
    out2, _ = ct.cuda_token_forward(q, k, v, sel, pattern_id=pid, window=window, sinks=sinks, scale=scale)
    assert out2.transpose(1, 2).is_contiguous() and torch.equal(out2, out), seed


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [128, 64])
def test_dispatch_takes_token_prefill(D):
    """``sparse_attention`` (Triton backend, plain prefill) runs the CUDA token kernel and matches the
    reference; a query_block of 64 and a padded batch stay on the Triton path."""
    B, Hq, Hkv, S, QB, K = 1, 8, 2, 1300, 128, 256
    seed = time.time_ns() % 2**31
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for h in (Hq, Hkv, Hkv))
    sel = _selection(B, Hkv, S, QB, K, True, g, full=True)
    p = get_pattern("sparse_k", sinks=4, window=200, top_k=K, query_block=QB)
    with plan.recording() as seen:
        out = sparse_k.sparse_attention(q, k, v, p, backend="triton", selection=sel)
    assert [x.kernel for x in seen] == ["cuda_sm90_token"], f"the CUDA token kernel did not take the call: {seen}"
    geo = row_geometry(B, S, S, None, device="cuda")
    ref, _ = reference_attention(q.double(), k.double(), v.double(), p, geo, scale=D ** -0.5, selection=sel)
    assert rel_err(out, ref) < TOL[torch.bfloat16], seed
    assert not ct.cuda_token_ok(q, k, v, sparse_k.TokenLayout(sel.indices, sel.counts, 64, sel.first_block),
                                pattern_id=2)
    assert not ct.cuda_token_ok(q, k, v, sel, pattern_id=2, plain_geometry=False)
    assert not ct.cuda_token_ok(q, k, v, sel, pattern_id=0)
    with pytest.raises(ValueError, match="window"):
        ct.cuda_token_forward(q, k, v, sel, pattern_id=2, window=0, scale=0.1)
