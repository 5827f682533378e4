"""GPU tests of the Triton kernels: bf16/fp16, real head dims, larger shapes (``gpu`` marker).

Tolerance: relative Frobenius error against the float64 reference. bf16 operands (P is rounded to
bf16 before the PV product, as in every flash kernel) give 1e-3..1e-2; a wrong tile or mask gives
O(0.1..1). fp16 carries 3 more mantissa bits, hence the tighter bound.
"""

import pytest
import torch

import sparse_k
from sparse_k import get_pattern, reference_attention, row_geometry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or sparse_k.triton_backend is None, reason="needs CUDA and triton"),
]

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _inputs(B, Hq, Hkv, Sq, Skv, D, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    return mk(B, Hq, Sq, D), mk(B, Hkv, Skv, D), mk(B, Hkv, Skv, D)


PATTERNS = [
    get_pattern("dense"),
    get_pattern("dense", causal=False),
    get_pattern("sliding_window", window=300),
    get_pattern("sliding_window", window=200, causal=False),
    get_pattern("streaming", sinks=7, window=256),
    get_pattern("block_diagonal", block=100),
    get_pattern("dilated", window=64, scales=3),
    get_pattern("l2_aligned", block=64, window_blocks=3, segment=256, anchor=16),
    get_pattern("bigbird", block=64, window_blocks=1, global_blocks=1, random_blocks=2),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: f"{p.name}-{'c' if p.causal else 'b'}")
def test_forward_backward_patterns(pattern, dtype):
    B, Hq, Hkv, S, D = 2, 8, 2, 640 if pattern.name == "bigbird" else 777, 128
    q, k, v = _inputs(B, Hq, Hkv, S, S, D, dtype, seed=hash(pattern) % 1000)
    for t in (q, k, v):
        t.requires_grad_()
    sink = torch.randn(Hq, device="cuda", requires_grad=True)
    out = sparse_k.sparse_attention(q, k, v, pattern, backend="triton", sink_logits=sink)
    geo = row_geometry(B, S, S, None, device="cuda")
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    sd = sink.detach().double().requires_grad_()
    ref, _ = reference_attention(qd, kd, vd, pattern, geo, scale=D ** -0.5, sink_logits=sd)
    assert rel(out, ref) < TOL[dtype]
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sink), do)
    refs = torch.autograd.grad(ref, (qd, kd, vd, sd), do.double())
    for name, a, b in zip("qkvs", grads, refs):
        assert rel(a, b) < 2 * TOL[dtype], name


@pytest.mark.parametrize("D", [64, 256])
def test_head_dims_softcap_padding(D):
    B, Hq, Hkv, S = 2, 8, 2, 333
    q, k, v = _inputs(B, Hq, Hkv, S, S, D, torch.bfloat16, seed=D)
    mask = torch.ones(B, S, dtype=torch.bool, device="cuda")
    mask[0, :37] = False
    mask[1, 100:140] = False  # a hole: travels as a key mask
    p = get_pattern("streaming", sinks=4, window=100)
    for t in (q, k, v):
        t.requires_grad_()
    out = sparse_k.sparse_attention(q, k, v, p, backend="triton", softcap=20.0, attention_mask=mask)
    ref = sparse_k.sparse_attention(*(t.detach().double().requires_grad_() for t in (q, k, v)), p, backend="reference", softcap=20.0, attention_mask=mask)
    assert rel(out, ref) < TOL[torch.bfloat16]
    do = torch.randn_like(out)
    g1 = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = sparse_k.sparse_attention(qd, kd, vd, p, backend="reference", softcap=20.0, attention_mask=mask)
    g2 = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    for a, b in zip(g1, g2):
        assert rel(a, b) < 2 * TOL[torch.bfloat16]


def test_large_window_matches_torch_path():
    S, D = 32768, 128
    q, k, v = _inputs(1, 32, 8, S, S, D, torch.bfloat16, seed=3)
    p = get_pattern("sliding_window", window=4096)
    out = sparse_k.sparse_attention(q, k, v, p, backend="triton")
    for q0 in (0, S - 200):
        ref = sparse_k.sparse_attention(q[:, :, q0 : q0 + 200], k, v, p, backend="torch", q_start=q0)
        assert rel(out[:, :, q0 : q0 + 200], ref) < TOL[torch.bfloat16]


def _compiled_variants(fn) -> int:
    return sum(len(c[0]) for c in fn.device_caches.values())


def test_bounded_compiles_over_30_lengths():
    """30 different sequence lengths compile a bounded number of forward variants (Triton's
    divisibility-by-16 specialisation of the sizes; the layout path also ``Skv % BLOCK_N``), never one
    per length: the structured kernel (sliding_window) and the layout kernel (dilated)."""
    from sparse_k.attention.triton import fwd as triton_fwd, structured as triton_structured

    g = torch.Generator().manual_seed(0)
    lengths = sorted(set(torch.randint(600, 6000, (40,), generator=g).tolist()))[:30]
    for p, kernel in ((get_pattern("sliding_window", window=512), triton_structured._st_fwd),
                      (get_pattern("dilated", window=64, scales=2), triton_fwd._attn_fwd)):
        before = _compiled_variants(kernel)
        for S in lengths:
            q, k, v = _inputs(1, 4, 2, S, S, 128, torch.bfloat16, seed=S)
            sparse_k.sparse_attention(q, k, v, p, backend="triton")
        added = _compiled_variants(kernel) - before
        print(f"{p.name}: compiled forward variants for {len(lengths)} lengths: {added}")
        assert added <= 8 and _compiled_variants(kernel) >= 1


def test_token_layout_bf16_forward_backward():
    """Learned top-k selection fused with sinks + window, bf16: outputs and all gradients (weights too)."""
    B, Hq, Hkv, S, D, QB, K = 1, 8, 2, 700, 128, 64, 96
    q, k, v = _inputs(B, Hq, Hkv, S, S, D, torch.bfloat16, seed=5)
    p = get_pattern("sparse_k", sinks=4, window=100, top_k=K, query_block=QB)
    NB = -(-S // QB)
    g = torch.Generator(device="cuda").manual_seed(1)
    scores = torch.rand(B, Hkv, NB, S, device="cuda", generator=g)
    idx = scores.topk(K, -1).indices.sort(-1).values.to(torch.int32)
    cnt = torch.full((B, Hkv, NB), K, dtype=torch.int32, device="cuda")
    w = torch.rand(B, Hkv, NB, K, device="cuda", generator=g).requires_grad_()
    sel = sparse_k.TokenLayout(idx, cnt, QB, torch.zeros(B, dtype=torch.int64, device="cuda"), w)
    for t in (q, k, v):
        t.requires_grad_()
    out = sparse_k.sparse_attention(q, k, v, p, backend="triton", selection=sel)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, w), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, w)]
    sel_ref = sparse_k.TokenLayout(idx, cnt, QB, sel.first_block, leaves[3])
    ref = sparse_k.sparse_attention(*leaves[:3], p, backend="reference", selection=sel_ref)
    refs = torch.autograd.grad(ref, leaves, do.double())
    assert rel(out, ref) < TOL[torch.bfloat16]
    for name, a, b in zip(("dq", "dk", "dv", "dw"), grads, refs):
        assert rel(a, b) < 2 * TOL[torch.bfloat16], name


@pytest.mark.parametrize("S", [901, 1024])  # 1024: whole key tiles, so the dK/dV kernel's K/V may come by TMA
@pytest.mark.parametrize("pattern", [get_pattern("sliding_window", window=300), get_pattern("streaming", sinks=130, window=256),
                                     get_pattern("dense", causal=False)], ids=lambda p: p.name)
def test_structured_forward_and_backward_bf16(pattern, S):
    """The structured forward at its inference tiles (128x128, TMA) with left padding and a key hole,
    and the structured backward at its GPU tile shapes (default, atomic dQ, TMA reduce-add dQ, TMA loads),
    against float64 autograd of the reference."""
    from sparse_k.attention.triton import structured_bwd as triton_structured_bwd
    from sparse_k.attention.pattern_codes import pattern_code

    B, Hq, Hkv, D = 2, 8, 2, 128
    q, k, v = _inputs(B, Hq, Hkv, S, S, D, torch.bfloat16, seed=len(pattern.name))
    mask = torch.ones(B, S, dtype=torch.bool, device="cuda")
    mask[1, :45] = False
    mask[0, 400:410] = False
    sink = torch.randn(Hq, device="cuda")
    out = sparse_k.sparse_attention(q, k, v, pattern, backend="triton", attention_mask=mask, sink_logits=sink)
    geo = row_geometry(B, S, S, mask, device="cuda")
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
    ref, _ = reference_attention(*leaves[:3], pattern, geo, scale=D ** -0.5, sink_logits=leaves[3], key_mask=mask)
    assert rel(out, ref) < TOL[torch.bfloat16]
    do = torch.randn_like(out)
    refs = torch.autograd.grad(ref, leaves, do.double())
    pid, params = pattern_code(pattern)
    from sparse_k.attention.triton.structured import structured_forward

    o, lse = structured_forward(q, k, v, geo, pattern_id=pid, params=params, causal=pattern.causal, scale=D ** -0.5,
                                block_m=64, block_n=64, sink_logits=sink, key_mask=mask)
    variants = (dict(), dict(atomic_dq=True), dict(use_tma=None, atomic_dq="tma"), dict(use_tma=None, dq_tma=True),
                dict(kv_tma=True))
    for kw in variants:
        grads = triton_structured_bwd.structured_backward(do, q, k, v, o, lse, geo, pattern_id=pid, params=params,
                                                          causal=pattern.causal, scale=D ** -0.5, sink_logits=sink,
                                                          key_mask=mask, **kw)
        for name, a, b in zip(("dq", "dk", "dv", "dsink"), grads, refs):
            assert rel(a, b) < 2 * TOL[torch.bfloat16], (name, kw)


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("QB,Hq,bm", [(64, 8, 128), (1, 8, 16), (1, 6, 16), (3, 12, 32), (16, 6, 64)])
def test_token_layout_inference_packed_bf16(QB, Hq, bm, fast, D):
    """Inference prefill with a token layout: the backend packs the GQA group (128x64 tiles, 3 stages; selection
    blocks shorter than ``SMALL_BLOCK_MAX`` queries: tiles of 16-64 rows, e.g. per-query selection); with left
    padding, sinks and window, against the float64 reference, with and without the far-tile shortcut (``sel_fast``)."""
    from sparse_k.attention import dispatch
    from sparse_k.attention.plan import selection_prefill_config

    B, Hkv, S, K = 2, 2, 1100, 160
    q, k, v = _inputs(B, Hq, Hkv, S, S, D, torch.bfloat16, seed=9)
    mask = torch.ones(B, S, dtype=torch.bool, device="cuda")
    mask[1, :37] = False
    p = get_pattern("sparse_k", sinks=4, window=100, top_k=K, query_block=QB)
    geo = row_geometry(B, S, S, mask, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(2)
    NB = -(-S // QB) + 1
    idx = torch.rand(B, Hkv, NB, S, device="cuda", generator=g).topk(K, -1).indices.to(torch.int32)  # unsorted
    cnt = torch.randint(K // 2, K + 1, (B, Hkv, NB), device="cuda", generator=g, dtype=torch.int32)
    first = torch.div(geo.q_positions(S)[:, 0], QB, rounding_mode="floor").expand(B).contiguous()
    sel = sparse_k.TokenLayout(idx, cnt, QB, first)
    ref = sparse_k.sparse_attention(q.double(), k.double(), v.double(), p, backend="reference", selection=sel,
                                    attention_mask=mask)
    valid = mask[:, None, :, None].expand_as(ref)  # rows of padding positions are unconstrained
    if not fast:
        out = sparse_k.sparse_attention(q, k, v, p, backend="triton", selection=sel, attention_mask=mask)
        assert rel(out[valid], ref[valid]) < TOL[torch.bfloat16]
    rows, pack, bn = selection_prefill_config(Hq // Hkv, "cuda", D, QB)
    assert (rows * pack, bn) == (bm, 64)
    lay = sparse_k.build_block_layout(p, S, S, geo, block_q=rows, block_k=bn, num_kv_heads=Hkv)
    out = torch.full_like(q, float("nan"))
    dispatch.attention_forward(q, k, v, lay, scale=D ** -0.5, pack=pack, selection=sel, key_mask=mask, out=out,
                               sel_fast=fast)
    assert not out.isnan().any()
    assert rel(out[valid], ref[valid]) < TOL[torch.bfloat16]


def test_bigbird_block128_prefill_on_64_tiles():
    """Bigbird with blocks of 128 runs 64x64 tiles at prefill (``bigbird_tiles``), bf16 vs float64."""
    from sparse_k.attention.plan import bigbird_tiles

    p = get_pattern("bigbird", block=128, window_blocks=1, global_blocks=2, random_blocks=3)
    B, Hq, Hkv, S, D = 1, 8, 2, 1280, 128
    assert bigbird_tiles(p.block, D, "cuda", False, S) == (64, 64)
    q, k, v = _inputs(B, Hq, Hkv, S, S, D, torch.bfloat16, seed=128)
    out = sparse_k.sparse_attention(q, k, v, p, backend="triton")
    geo = row_geometry(B, S, S, None, device="cuda")
    ref, _ = reference_attention(q.double(), k.double(), v.double(), p, geo, scale=D ** -0.5)
    assert rel(out, ref) < TOL[torch.bfloat16]
