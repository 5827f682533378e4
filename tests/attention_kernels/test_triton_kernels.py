"""The Triton kernels against the exact reference: every pattern, forward and backward.

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, fp32/fp16, tiny
shapes, 16x16 tiles); with CUDA the same tests run compiled. ``tests/triton_interp.py`` sets the
interpreter up for the kernel imports (and for each test, an autouse fixture, without leaking it to
other modules) or, when triton was imported earlier in the session, runs this file in a fresh
interpreter (``test_interpreter_suite_in_subprocess``) and every other test here is skipped.

Tolerances: fp32 under the interpreter is exact float32 arithmetic (errors ~1e-6); compiled fp32
``tl.dot`` uses tf32 (~3e-4 relative, design §10), hence ``TOL32``; fp16 operands ~1e-3.
"""

import warnings

import pytest
import torch
from triton_interp import (
    ON_GPU,
    KERNEL_TEST,
    import_kernels,
    run_file_interpreted,
)

HAVE_TRITON, IN_PROCESS, _kernels = import_kernels("attention.triton.fwd", "attention.triton.bwd", "attention.triton.structured", "attention.triton.structured_bwd")
if HAVE_TRITON:
    triton_fwd, triton_bwd, triton_structured, triton_structured_bwd = _kernels

import sparse_k
from sparse_k import build_block_layout, get_pattern, reference_attention, row_geometry
from sparse_k.layouts import block_layout
from sparse_k.attention import dispatch
from sparse_k.attention.pattern_codes import pattern_code
from helpers import random_token_layout

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")

_SUBPROCESS_ONLY = KERNEL_TEST  # not collected where IN_PROCESS is False (conftest): the subprocess runs them


@pytest.mark.skipif(IN_PROCESS, reason="the kernels run in this process")
def test_interpreter_suite_in_subprocess():
    """Run this file under a fresh interpreter with ``TRITON_INTERPRET=1`` set before triton loads."""
    run_file_interpreted(__file__, 30)  # every kernel test ran there


DEV = "cuda" if ON_GPU else "cpu"
TOL32 = 2e-3 if ON_GPU else 1e-5
# LSE, absolute: exact fp32 under the interpreter; on a GPU fp32 tl.dot runs TF32 (operands rounded to
# 10-bit mantissas, <= 2^-10 relative per product), and sum_i |q_i k_i| * scale is about 2.5 for these
# randn inputs at D=16, so a logit (and the LSE) may be off by up to ~2.5e-3 (measured on an H100: 2e-3).
LSE_ATOL = 5e-3 if ON_GPU else 1e-4
TOL16 = 4e-3


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def triton_attn(*args, **kwargs):
    """``sparse_attention(backend="triton")`` that fails if the backend fell back to the PyTorch path."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        return sparse_k.sparse_attention(*args, backend="triton", **kwargs)


def rand(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=DEV, dtype=dtype)


PATTERNS = {
    "dense": get_pattern("dense"),
    "dense_bidir": get_pattern("dense", causal=False),
    "sliding_window": get_pattern("sliding_window", window=11),
    "sliding_window_bidir": get_pattern("sliding_window", window=9, causal=False),
    "streaming": get_pattern("streaming", sinks=3, window=10),
    "block_diagonal": get_pattern("block_diagonal", block=7),
    "block_diagonal_bidir": get_pattern("block_diagonal", block=12, causal=False),
    "dilated": get_pattern("dilated", window=4, scales=3),
    "dilated_bidir": get_pattern("dilated", window=3, scales=2, causal=False),
    "dilated_many_scales": get_pattern("dilated", window=1, scales=10),  # > MAX_UNROLLED_SCALES: run-time loop
    "l2_aligned": get_pattern("l2_aligned", block=8, window_blocks=2, segment=24, anchor=5),
    "bigbird": get_pattern("bigbird", block=16, window_blocks=1, global_blocks=1, random_blocks=1, seed=3),
    "sparse_k_static": get_pattern("sparse_k", sinks=2, window=9, top_k=4, query_block=16),
}


def _layout(p, Sq, Skv, geo, Hkv, bq=16, bk=16):
    return build_block_layout(p, Sq, Skv, geo, block_q=bq, block_k=bk, num_kv_heads=Hkv)


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("name", list(PATTERNS))
def test_forward_every_pattern(name):
    """fp32, GQA 4, odd lengths (bigbird: aligned lengths), sink logits on odd cases, softcap on even ones."""
    p = PATTERNS[name]
    g = torch.Generator().manual_seed(hash(name) % 10_000)
    B, Hq, Hkv, D = 2, 4, 1, 16
    Sq, Skv = (48, 64) if name == "bigbird" else (37, 53)
    q, k, v = rand(B, Hq, Sq, D, gen=g), rand(B, Hkv, Skv, D, gen=g), rand(B, Hkv, Skv, D, gen=g)
    sink = rand(Hq, gen=g) if len(name) % 2 else None
    softcap = None if len(name) % 2 else 4.0
    geo = row_geometry(B, Sq, Skv, None, device=DEV)
    lay = _layout(p, Sq, Skv, geo, Hkv)
    out = torch.full((B, Hq, Sq, D), float("nan"), device=DEV)
    o, lse = dispatch.attention_forward(q, k, v, lay, scale=D ** -0.5, softcap=softcap, sink_logits=sink, out=out)
    ro, rl = reference_attention(q, k, v, p, geo, scale=D ** -0.5, softcap=softcap, sink_logits=sink)
    assert o.data_ptr() == out.data_ptr() and not o.isnan().any()
    assert rel(o, ro) < TOL32
    finite = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite].double(), rl[finite], atol=LSE_ATOL, rtol=1e-4)


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("name", ["dense", "sliding_window_bidir", "streaming", "dilated", "l2_aligned", "bigbird", "block_diagonal"])
def test_backward_every_pattern(name):
    """dq, dk, dv and the sink-logit gradient through the custom op's autograd."""
    p = PATTERNS[name]
    g = torch.Generator().manual_seed(7 + len(name))
    B, Hq, Hkv, D = 1, 4, 2, 16
    Sq, Skv = (32, 48) if name == "bigbird" else (29, 45)
    q, k, v = (t.requires_grad_() for t in (rand(B, Hq, Sq, D, gen=g), rand(B, Hkv, Skv, D, gen=g), rand(B, Hkv, Skv, D, gen=g)))
    sink = rand(Hq, gen=g).requires_grad_()
    out = triton_attn(q, k, v, p, sink_logits=sink, softcap=3.0 if name == "dense" else None)
    do = rand(*out.shape, gen=g)
    grads = torch.autograd.grad(out, (q, k, v, sink), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
    ref = sparse_k.sparse_attention(*leaves[:3], p, backend="reference", sink_logits=leaves[3], softcap=3.0 if name == "dense" else None)
    refs = torch.autograd.grad(ref, leaves, do.double())
    assert rel(out, ref) < TOL32
    for a, b in zip(grads, refs):
        assert rel(a, b) < 5 * TOL32


@_SUBPROCESS_ONLY
def test_fp16_forward_backward():
    p = PATTERNS["streaming"]
    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, S, D = 1, 2, 1, 33, 16
    q, k, v = (rand(B, h, S, D, dtype=torch.float16, gen=g).requires_grad_() for h in (Hq, Hkv, Hkv))
    out = triton_attn(q, k, v, p)
    do = rand(*out.shape, dtype=torch.float16, gen=g)
    grads = torch.autograd.grad(out, (q, k, v), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = sparse_k.sparse_attention(*leaves, p, backend="reference")
    refs = torch.autograd.grad(ref, leaves, do.double())
    assert rel(out, ref) < TOL16
    for a, b in zip(grads, refs):
        assert rel(a, b) < 3 * TOL16


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("name", ["streaming", "block_diagonal", "dilated"])
def test_transposed_views_without_copies(name, monkeypatch):
    """What a Transformers layer passes: q, k, v transposed views of (B, S, H, D) leaves (streaming,
    block_diagonal: the structured kernels; dilated: the layout path). The output comes back in (B, S, H, D) order
    (so the adapter's ``transpose(1, 2).contiguous()`` copies nothing), the backward receives the
    strided dO itself, and the leaves' gradients are contiguous and match the float64 reference's."""
    from sparse_k.attention import ops

    p = PATTERNS[name]
    g = torch.Generator().manual_seed(13 + len(name))
    B, Hq, Hkv, S, D = 2, 4, 2, 29, 16
    leaves = [rand(B, S, h, D, gen=g).requires_grad_() for h in (Hq, Hkv, Hkv)]
    do = rand(B, S, Hq, D, gen=g)
    seen = []
    real_bwd = ops.block_attn_bwd
    monkeypatch.setattr(ops, "block_attn_bwd", lambda d, *a: seen.append(d.data_ptr()) or real_bwd(d, *a))
    out = triton_attn(*(t.transpose(1, 2) for t in leaves), p)
    assert out.transpose(1, 2).is_contiguous()
    grads = torch.autograd.grad(out.transpose(1, 2), leaves, do)
    assert seen == [do.data_ptr()]  # dO reached the kernels as the view it is
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = sparse_k.sparse_attention(*(t.transpose(1, 2) for t in ref_leaves), p, backend="reference")
    refs = torch.autograd.grad(ref.transpose(1, 2), ref_leaves, do.double())
    assert rel(out, ref) < TOL32
    for a, b in zip(grads, refs):
        assert a.is_contiguous() and rel(a, b) < 5 * TOL32


@_SUBPROCESS_ONLY
def test_dispatch_runs_what_the_plan_names():
    """``dispatch`` launches the kernel ``plan`` names for the launch (recorded by ``plan.recording``,
    equal to ``plan_forward`` / ``plan_backward`` asked directly), and every one matches the reference:
    structured, layout and split-KV forwards, structured and layout-path backwards."""
    from sparse_k.attention import plan

    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, S, D = 1, 4, 2, 37, 16
    q, k, v, do = (rand(B, h, S, D, gen=g) for h in (Hq, Hkv, Hkv, Hq))
    geo = row_geometry(B, S, S, None, device=DEV)
    cases = [("sliding_window", 1, 1, "triton_structured", "triton_structured_bwd"),
             ("dilated", 1, 1, "triton_layout", "triton_layout_bwd"), ("streaming", 2, 3, "triton_split_kv", None)]
    for name, pack, splits, kernel, bwd_kernel in cases:
        p = PATTERNS[name]
        lay = _layout(p, S, S, geo, Hkv, bq=16 // pack)
        with plan.recording() as seen:
            o, lse = dispatch.attention_forward(q, k, v, lay, scale=D ** -0.5, pack=pack, num_splits=splits)
        launch = plan.Launch(q, k, v, geo, pattern_code(p)[0], p.causal, pack=pack, num_splits=splits)
        assert [x.kernel for x in seen] == [kernel] and seen == [plan.plan_forward(launch)], (name, seen)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ro, _ = reference_attention(*leaves, p, geo, scale=D ** -0.5)
        assert rel(o, ro) < TOL32, name
        if bwd_kernel is None:
            continue
        with plan.recording() as seen:
            grads = dispatch.attention_backward(do, q, k, v, o, lse, lay, scale=D ** -0.5)[:3]
        assert [x.kernel for x in seen] == [bwd_kernel] and seen == [plan.plan_backward(launch, do, o, lse)], name
        for a, b in zip(grads, torch.autograd.grad(ro, leaves, do)):
            assert rel(a, b) < 5 * TOL32, name


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("pack", [2, 4])
def test_gqa_packing(pack):
    """Several query heads of one KV group share a tile (BLOCK_M = pack * block_q)."""
    p = PATTERNS["sliding_window"]
    g = torch.Generator().manual_seed(pack)
    B, Hq, Hkv, Sq, Skv, D = 1, 8, 2, 21, 40, 16
    q, k, v = rand(B, Hq, Sq, D, gen=g), rand(B, Hkv, Skv, D, gen=g), rand(B, Hkv, Skv, D, gen=g)
    geo = row_geometry(B, Sq, Skv, None, device=DEV)
    lay = _layout(p, Sq, Skv, geo, Hkv, bq=16 // pack)
    o, _ = dispatch.attention_forward(q, k, v, lay, scale=D ** -0.5, pack=pack)
    ro, _ = reference_attention(q, k, v, p, geo, scale=D ** -0.5)
    assert rel(o, ro) < TOL32


@_SUBPROCESS_ONLY
def test_left_padding_and_key_holes():
    """Positions restart at each row's first valid key; holes inside travel as a key mask (fwd + bwd)."""
    g = torch.Generator().manual_seed(11)
    B, Hq, Hkv, S, D = 2, 2, 1, 40, 16
    mask = torch.ones(B, S, dtype=torch.bool, device=DEV)
    mask[0, :9] = False
    mask[1, 17:20] = False
    p = PATTERNS["l2_aligned"]
    q, k, v = (rand(B, h, S, D, gen=g).requires_grad_() for h in (Hq, Hkv, Hkv))
    out = triton_attn(q, k, v, p, attention_mask=mask)
    do = rand(*out.shape, gen=g)
    grads = torch.autograd.grad(out, (q, k, v), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = sparse_k.sparse_attention(*leaves, p, backend="reference", attention_mask=mask)
    refs = torch.autograd.grad(ref, leaves, do.double())
    assert not out.isnan().any()
    assert rel(out, ref) < TOL32
    for a, b in zip(grads, refs):
        assert rel(a, b) < 5 * TOL32


@_SUBPROCESS_ONLY
def test_packed_sequences_and_flash_varlen():
    g = torch.Generator().manual_seed(2)
    Hq, Hkv, D = 2, 1, 16
    cu = torch.tensor([0, 17, 18, 49], dtype=torch.int32, device=DEV)
    q, k, v = rand(49, Hq, D, gen=g), rand(49, Hkv, D, gen=g), rand(49, Hkv, D, gen=g)
    out = sparse_k.flash_api.flash_attn_varlen_func(q, k, v, cu, cu, 31, 31, causal=True, window_size=(9, 0), backend="triton")
    for s in range(3):
        a, b = int(cu[s]), int(cu[s + 1])
        ref = sparse_k.flash_attn_func(q[None, a:b], k[None, a:b], v[None, a:b], causal=True, window_size=(9, 0), backend="reference")
        assert rel(out[a:b], ref[0]) < TOL32


@_SUBPROCESS_ONLY
def test_flash_attn_func_window_and_kvcache():
    g = torch.Generator().manual_seed(3)
    B, S, Hq, Hkv, D = 2, 30, 4, 2, 16
    q, k, v = rand(B, S, Hq, D, gen=g), rand(B, S, Hkv, D, gen=g), rand(B, S, Hkv, D, gen=g)
    for causal, win in ((True, (6, 0)), (False, (5, 5)), (True, (-1, -1))):
        o = sparse_k.flash_attn_func(q, k, v, causal=causal, window_size=win, softcap=8.0, backend="triton")
        r = sparse_k.flash_attn_func(q, k, v, causal=causal, window_size=win, softcap=8.0, backend="reference")
        assert o.shape == (B, S, Hq, D) and rel(o, r) < TOL32
    with pytest.raises(ValueError, match="symmetric"):
        sparse_k.flash_attn_func(q, k, v, causal=False, window_size=(3, 1))
    kc, vc = rand(B, 48, Hkv, D, gen=g), rand(B, 48, Hkv, D, gen=g)
    kc2, vc2 = kc.clone(), vc.clone()
    qn, kn, vn = rand(B, 2, Hq, D, gen=g), rand(B, 2, Hkv, D, gen=g), rand(B, 2, Hkv, D, gen=g)
    lens = torch.tensor([10, 33], device=DEV)
    o = sparse_k.flash_attn_with_kvcache(qn, kc, vc, kn, vn, cache_seqlens=lens, causal=True, window_size=(7, 0), backend="triton")
    r = sparse_k.flash_attn_with_kvcache(qn, kc2, vc2, kn, vn, cache_seqlens=lens, causal=True, window_size=(7, 0), backend="reference")
    assert torch.equal(kc[0, 10:12], kn[0]) and torch.equal(vc[1, 33:35], vn[1])
    assert rel(o, r) < TOL32


@_SUBPROCESS_ONLY
def test_tma_descriptors_and_contiguous_runs():
    """The TMA path (2-D descriptors over B*Hkv*Skv rows) and the index-free full-tile loop agree."""
    g = torch.Generator().manual_seed(4)
    for Skv in (64, 53):  # the second spills the last tile into the next head's rows: must be masked
        B, Hq, Hkv, D = 2, 2, 2, 16
        q, k, v = rand(B, Hq, Skv, D, gen=g), rand(B, Hkv, Skv, D, gen=g), rand(B, Hkv, Skv, D, gen=g)
        p = PATTERNS["sliding_window"]
        geo = row_geometry(B, Skv, Skv, None, device=DEV)
        lay = _layout(p, Skv, Skv, geo, Hkv)
        assert block_layout.full_tiles_contiguous(lay)
        ro, _ = reference_attention(q, k, v, p, geo, scale=D ** -0.5)
        for tma, contig in ((True, True), (False, False)):
            o, _ = dispatch.attention_forward(q, k, v, lay, scale=D ** -0.5, use_tma=tma, full_contig=contig)
            assert rel(o, ro) < TOL32


@_SUBPROCESS_ONLY
def test_why_unsupported(monkeypatch):
    from sparse_k.attention.backends import AttentionCall
    from sparse_k.attention.triton.backend import why_unsupported

    q = torch.randn(1, 2, 8, 24, device=DEV)
    geo = row_geometry(1, 8, 8, None, device=DEV)
    call = AttentionCall(q=q, k=q[:, :1], v=q[:, :1], pattern=PATTERNS["dense"], geometry=geo, selection=None, sink_logits=None)
    assert "head dim 24" in why_unsupported(call)
    q = torch.randn(1, 2, 8, 16, dtype=torch.float64, device=DEV)
    call.q, call.k, call.v = q, q[:, :1], q[:, :1]
    assert "float64" in why_unsupported(call)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not ON_GPU:
        call.q, call.k, call.v = q.float(), q[:, :1].float(), q[:, :1].float()
        assert "cpu" in why_unsupported(call)


@_SUBPROCESS_ONLY
def test_pattern_without_kernel_rule_falls_back():
    """A model's own window around streaming (``WithinWindow``, Gemma 2's local layers) has no kernel rule:
    the backend refuses it by name and the call runs exactly on the PyTorch path (no KeyError)."""
    from sparse_k import Streaming
    from sparse_k.integrations.transformers_adapter import WithinWindow

    p = WithinWindow(base=Streaming(sinks=2, window=5), window=10)
    g = torch.Generator().manual_seed(18)
    q, k, v = rand(1, 2, 29, 16, gen=g), rand(1, 1, 29, 16, gen=g), rand(1, 1, 29, 16, gen=g)
    with pytest.warns(UserWarning, match="within_window"):
        out = sparse_k.sparse_attention(q, k, v, p, backend="triton")
    ref = sparse_k.sparse_attention(q, k, v, p, backend="reference")
    assert rel(out, ref) < TOL32


@_SUBPROCESS_ONLY
def test_custom_op_registration():
    """``sparse_k::block_attn_fwd`` has a fake (meta) implementation and autograd: opcheck's schema, fake-tensor
    and autograd-registration tests (the last needs inputs that require grad)."""
    from sparse_k.attention import ops

    p = PATTERNS["streaming"]
    g = torch.Generator().manual_seed(9)
    q, k, v = (rand(1, h, 20, 16, gen=g).requires_grad_() for h in (2, 1, 1))
    geo = row_geometry(1, 20, 20, None, device=DEV)
    lay = _layout(p, 20, 20, geo, 1)
    pid, params = pattern_code(p)
    args = (q, k, v, *ops.layout_args(lay, need_transposed=True), geo.q_start, geo.k_start, geo.k_end, None, None,
            pid, True, list(params), 16, 16, 1, 1, 0.25, 0.0, True)
    torch.library.opcheck(ops.block_attn_fwd, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@_SUBPROCESS_ONLY
def test_custom_op_fake_follows_query_order():
    """The fake of ``sparse_k::block_attn_fwd`` allocates its output by the kernels' rule
    (``memory_order.new_output``): for transposed (B, S, H, D) inputs a (B, S, H, D)-ordered output,
    which opcheck's fake-tensor test compares with the kernel's strides."""
    from sparse_k.attention import ops

    p = PATTERNS["streaming"]
    g = torch.Generator().manual_seed(19)
    q, k, v = (rand(1, 20, h, 16, gen=g).transpose(1, 2) for h in (4, 2, 2))
    geo = row_geometry(1, 20, 20, None, device=DEV)
    lay = _layout(p, 20, 20, geo, 2)
    pid, params = pattern_code(p)
    args = (q, k, v, *ops.layout_args(lay, need_transposed=True), geo.q_start, geo.k_start, geo.k_end, None, None,
            pid, True, list(params), 16, 16, 1, 1, 0.25, 0.0, True)
    assert ops.block_attn_fwd(*args)[0].transpose(1, 2).is_contiguous()
    torch.library.opcheck(ops.block_attn_fwd, args, test_utils=("test_schema", "test_faketensor"))


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_token_layout_forward_backward_with_weight_grad(softcap):
    """Learned top-k keys fused with the sinks + window layout: outputs, dq/dk/dv, sink and weight gradients."""
    g = torch.Generator().manual_seed(21 if softcap is None else 22)
    B, Hq, Hkv, Sq, Skv, D, QB = 2, 4, 2, 37, 53, 16, 8
    p = get_pattern("sparse_k", sinks=2, window=7, top_k=12, query_block=QB)
    geo = row_geometry(B, Sq, Skv, None, device=DEV)
    sel = random_token_layout(B, Hkv, Sq, Skv, QB, 12, geo, g, device=DEV)
    sel.weights.requires_grad_()
    q, k, v = (t.requires_grad_() for t in (rand(B, Hq, Sq, D, gen=g), rand(B, Hkv, Skv, D, gen=g), rand(B, Hkv, Skv, D, gen=g)))
    sink = rand(Hq, gen=g).requires_grad_()
    out = triton_attn(q, k, v, p, selection=sel, sink_logits=sink, softcap=softcap)
    do = rand(*out.shape, gen=g)
    grads = torch.autograd.grad(out, (q, k, v, sink, sel.weights), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sink, sel.weights)]
    sel_ref = sparse_k.TokenLayout(sel.indices, sel.counts, QB, sel.first_block, leaves[4])
    ref = sparse_k.sparse_attention(*leaves[:3], p, backend="reference", selection=sel_ref, sink_logits=leaves[3], softcap=softcap)
    refs = torch.autograd.grad(ref, leaves, do.double())
    assert rel(out, ref) < TOL32
    for name, a, b in zip(("dq", "dk", "dv", "dsink", "dweights"), grads, refs):
        assert rel(a, b) < 5 * TOL32, name


@_SUBPROCESS_ONLY
def test_token_layout_weight_grad_with_frozen_qkv():
    """A trained SparseK scorer on a frozen model: only the selection weights carry a gradient (q, k, v
    of the first layer do not). The output must still take part in autograd and the weight gradient
    equal the float64 reference (the no-gradient fast path once dropped it)."""
    g = torch.Generator().manual_seed(24)
    B, Hq, Hkv, Sq, Skv, D, QB = 1, 4, 2, 29, 41, 16, 8
    p = get_pattern("sparse_k", sinks=2, window=7, top_k=10, query_block=QB)
    geo = row_geometry(B, Sq, Skv, None, device=DEV)
    sel = random_token_layout(B, Hkv, Sq, Skv, QB, 10, geo, g, device=DEV)
    sel.weights.requires_grad_()
    q, k, v = rand(B, Hq, Sq, D, gen=g), rand(B, Hkv, Skv, D, gen=g), rand(B, Hkv, Skv, D, gen=g)
    out = triton_attn(q, k, v, p, selection=sel)
    assert out.requires_grad
    do = rand(*out.shape, gen=g)
    (grad,) = torch.autograd.grad(out, sel.weights, do)
    w64 = sel.weights.detach().double().requires_grad_()
    sel_ref = sparse_k.TokenLayout(sel.indices, sel.counts, QB, sel.first_block, w64)
    ref = sparse_k.sparse_attention(q.double(), k.double(), v.double(), p, backend="reference", selection=sel_ref)
    (ref_grad,) = torch.autograd.grad(ref, w64, do.double())
    assert rel(out, ref) < TOL32
    assert rel(grad, ref_grad) < 5 * TOL32


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("pack", [1, 2])
def test_token_layout_far_tiles_skip_the_element_rule(pack):
    """Selected-key tiles wholly behind every row's window take the 1-D-mask path, the others the
    element rule: both in one launch (far keys first, then sinks / window / future keys), and lists of
    far keys only (the block-wide check, ``sel_fast=2``); against the reference and against the
    per-tile check and the launch without the shortcut."""
    g = torch.Generator().manual_seed(40 + pack)
    B, Hq, Hkv, S, D, QB, K = 1, 4, 2, 80, 16, 32, 32
    p = get_pattern("streaming", sinks=2, window=6)
    pl = get_pattern("sparse_k", sinks=2, window=6, top_k=K, query_block=QB)
    idx = torch.empty(B, Hkv, S // QB + 1, K, dtype=torch.int32)
    idx_far = torch.zeros_like(idx)  # far keys only: every tile of the block is far (the block-wide check holds)
    cnt_far = torch.zeros(idx.shape[:3], dtype=torch.int32)
    for h in range(Hkv):
        for n in range(idx.shape[2]):
            far = torch.arange(2, max(2, n * QB - 6 + 1))
            far = far[torch.randperm(len(far), generator=g)[:16]]
            rest = torch.tensor([j for j in range(S) if j not in set(far.tolist())])
            near = rest[torch.randperm(len(rest), generator=g)[: K - len(far)]]
            idx[0, h, n] = torch.cat([far, near]).int()
            idx_far[0, h, n, : len(far)] = far.int()
            cnt_far[0, h, n] = len(far)
    cnt = torch.full(idx.shape[:3], K, dtype=torch.int32)
    first = torch.zeros(B, dtype=torch.int64, device=DEV)
    q, k, v = rand(B, Hq, S, D, gen=g), rand(B, Hkv, S, D, gen=g), rand(B, Hkv, S, D, gen=g)
    geo = row_geometry(B, S, S, None, device=DEV)
    lay = _layout(p, S, S, geo, Hkv, bq=16 // pack)
    for sel in (sparse_k.TokenLayout(idx.to(DEV), cnt.to(DEV), QB, first),
                sparse_k.TokenLayout(idx_far.to(DEV), cnt_far.to(DEV), QB, first)):
        ref = sparse_k.sparse_attention(q, k, v, pl, backend="reference", selection=sel)
        outs = []
        for fast in (2, 1, 0):
            out = torch.full_like(q, float("nan"))
            dispatch.attention_forward(q, k, v, lay, scale=D ** -0.5, pack=pack, selection=sel, sel_fast=fast, out=out)
            assert rel(out, ref) < TOL32, fast
            outs.append(out)
        for out in outs[1:]:
            assert rel(out, outs[0]) < TOL32


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("q_len,splits,pack,dtype", [(37, 1, 2, torch.float32), (1, 3, 4, torch.float32), (3, 2, 2, torch.float16)])
def test_token_layout_index_prefetch(q_len, splits, pack, dtype):
    """Selected-key indices loaded one tile ahead (``sel_prefetch``) and the unmasked row-major
    gathers with the additive far-tile bias (``sel_lean``), each against the load inside the
    iteration, the masked gathers and the float64 reference: prefill (odd lengths, GQA packing,
    rows of two selection blocks in one tile) and split-KV decode with the fused merge; counts that
    are not multiples of the tile, zero weights, the look-ahead past the count and past the list's
    length. Outputs poisoned with NaN first."""
    g = torch.Generator().manual_seed(60 + q_len)
    B, Hq, Hkv, Skv, D, QB, K = 2, 8, 2, 71, 16, 4, 45  # QB 4: rows of two selection blocks share a tile
    p = get_pattern("sparse_k", sinks=2, window=5, top_k=K, query_block=QB)
    geo = row_geometry(B, q_len, Skv, None, device=DEV)
    sel = random_token_layout(B, Hkv, q_len, Skv, QB, K, geo, g, device=DEV)
    q, k, v = (rand(*s, gen=g, dtype=dtype) for s in ((B, Hq, q_len, D), (B, Hkv, Skv, D), (B, Hkv, Skv, D)))
    lay = _layout(p, q_len, Skv, geo, Hkv, bq=16 // pack)
    ref = sparse_k.sparse_attention(q.double(), k.double(), v.double(), p, backend="reference", selection=sel)
    tol = TOL32 if dtype == torch.float32 else TOL16
    outs = []
    for prefetch, lean, fast in ((True, True, 2), (False, False, 0), (True, False, 1), (True, True, 0)):
        out = torch.full_like(q, float("nan"))
        dispatch.attention_forward(q, k, v, lay, scale=D ** -0.5, pack=pack, num_splits=splits, selection=sel,
                                   sel_prefetch=prefetch, sel_lean=lean, sel_fast=fast, out=out)
        assert rel(out, ref) < tol, (prefetch, lean, fast)
        outs.append(out)
    for out in outs[1:]:
        assert rel(out, outs[0]) < tol


@pytest.mark.parametrize("bad", [3, -1, "2"])
def test_sel_fast_rejects_unknown_values(bad):
    """``sel_fast`` takes None, 0 / False, 1 / True or 2; anything else is a ValueError naming it."""
    q = torch.zeros(1, 1, 1, 16)
    with pytest.raises(ValueError, match="sel_fast"):
        dispatch.attention_forward(q, q, q, None, scale=1.0, sel_fast=bad)


STRUCTURED_CASES = {
    # name: (pattern, Sq, Skv, left padding of row 1, key holes)
    "dense_square": (get_pattern("dense"), 45, 45, 0, False),
    "dense_chunk": (get_pattern("dense"), 19, 61, 7, False),
    "dense_bidir_holes": (get_pattern("dense", causal=False), 33, 50, 5, True),
    "window_lt_tile": (get_pattern("sliding_window", window=5), 47, 47, 3, False),
    "window_gt_tile": (get_pattern("sliding_window", window=37), 71, 83, 9, True),
    "window_bidir": (get_pattern("sliding_window", window=20, causal=False), 50, 66, 11, False),
    "streaming_sinks_span_tiles": (get_pattern("streaming", sinks=21, window=18), 80, 80, 6, False),
    "streaming_window_reaches_sinks": (get_pattern("streaming", sinks=3, window=40), 29, 64, 0, True),
    "streaming_sink_tile_and_edge": (get_pattern("streaming", sinks=5, window=32), 97, 97, 4, False),
    "q_longer_than_k": (get_pattern("sliding_window", window=12), 40, 30, 0, False),
    "block_causal_holes": (get_pattern("block_diagonal", block=24), 70, 70, 5, True),
    "block_bidir": (get_pattern("block_diagonal", block=16, causal=False), 45, 60, 3, False),
    "block_chunk": (get_pattern("block_diagonal", block=20), 19, 61, 7, False),
    "block_shorter_than_tile": (get_pattern("block_diagonal", block=5), 40, 40, 2, False),
}


STRUCTURED_SHAPE = (2, 4, 2, 16)  # B, Hq, Hkv, D of the STRUCTURED_CASES tests


def _structured_inputs(name, seed):
    """``(q, k, v, geometry, key_mask, generator)`` of a ``STRUCTURED_CASES`` entry: shapes
    ``STRUCTURED_SHAPE``, row 1 left-padded, key holes in row 0 when the case has them (then passed
    as ``key_mask`` too, else ``key_mask`` is None); ``generator`` continues the seeded stream."""
    _, Sq, Skv, pad, holes = STRUCTURED_CASES[name]
    B, Hq, Hkv, D = STRUCTURED_SHAPE
    g = torch.Generator().manual_seed(seed)
    q, k, v = rand(B, Hq, Sq, D, gen=g), rand(B, Hkv, Skv, D, gen=g), rand(B, Hkv, Skv, D, gen=g)
    mask = torch.ones(B, Skv, dtype=torch.bool, device=DEV)
    mask[1, :pad] = False
    if holes:
        mask[0, Skv // 2 : Skv // 2 + 4] = False
    geo = row_geometry(B, Sq, Skv, mask, device=DEV)
    return q, k, v, geo, (mask if holes else None), g


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("name", list(STRUCTURED_CASES))
def test_structured_tile_ranges(name):
    """The arithmetic tile ranges (sink / left edge / full / right edge) give the exact reference for
    bottom-right chunks, left padding, key holes, bidirectional windows, windows shorter and longer
    than a tile, sinks over several tiles, every program order; the layout path agrees."""
    p, Sq, Skv, _, _ = STRUCTURED_CASES[name]
    B, Hq, Hkv, D = STRUCTURED_SHAPE
    q, k, v, geo, key_mask, g = _structured_inputs(name, seed=len(name) * 31)
    sink = rand(Hq, gen=g) if Sq % 2 else None
    softcap = 5.0 if "bidir" in name else None
    ro, rl = reference_attention(q, k, v, p, geo, scale=D ** -0.5, sink_logits=sink, softcap=softcap, key_mask=key_mask)
    pid, params = pattern_code(p)
    for order in range(4):
        out = torch.full((B, Hq, Sq, D), float("nan"), device=DEV)
        o, lse = triton_structured.structured_forward(
            q, k, v, geo, pattern_id=pid, params=params, causal=p.causal, scale=D ** -0.5, block_m=16, block_n=16,
            softcap=softcap, sink_logits=sink, key_mask=key_mask, out=out, order=order,
        )
        assert not o.isnan().any(), order
        assert rel(o, ro) < TOL32, order
        finite = torch.isfinite(rl)
        assert torch.equal(torch.isfinite(lse), finite)
        assert torch.allclose(lse[finite].double(), rl[finite], atol=LSE_ATOL, rtol=1e-4)
    lay = _layout(p, Sq, Skv, geo, Hkv)
    o_lay, _ = dispatch.attention_forward(q, k, v, lay, scale=D ** -0.5, sink_logits=sink, softcap=softcap,
                                          key_mask=key_mask, structured=False)
    assert rel(o_lay, ro) < TOL32


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("name", ["dense_chunk", "dense_bidir_holes", "window_gt_tile", "window_bidir",
                                  "streaming_sinks_span_tiles", "q_longer_than_k", "block_causal_holes", "block_bidir",
                                  "block_chunk"])
def test_structured_backward(name):
    """dq, dk, dv and dsink of the structured backward (own query/key tile shapes per kernel, ranges by
    arithmetic) against float64 autograd of the reference, for the forward cases above."""
    p, Sq, Skv, _, _ = STRUCTURED_CASES[name]
    B, Hq, Hkv, D = STRUCTURED_SHAPE
    q, k, v, geo, key_mask, g = _structured_inputs(name, seed=len(name) * 17)
    sink = rand(Hq, gen=g)
    softcap = 5.0 if "bidir" in name else None
    leaves = [t.double().requires_grad_() for t in (q, k, v, sink)]
    ro, _ = reference_attention(*leaves[:3], p, geo, scale=D ** -0.5, sink_logits=leaves[3], softcap=softcap, key_mask=key_mask)
    do = rand(*ro.shape, gen=g)
    refs = torch.autograd.grad(ro, leaves, do.double())
    pid, params = pattern_code(p)
    o, lse = triton_structured.structured_forward(
        q, k, v, geo, pattern_id=pid, params=params, causal=p.causal, scale=D ** -0.5, block_m=16, block_n=16,
        softcap=softcap, sink_logits=sink, key_mask=key_mask,
    )
    variants = (  # (tile config, atomic dQ, int64 offsets)
        ((16, 16, 4, 1, 16, 16, 4, 1), False, False), ((32, 16, 4, 1, 16, 32, 4, 1), False, False),
        ((16, 16, 4, 1, 16, 16, 4, 1), True, False), ((32, 16, 4, 1, 16, 32, 4, 1), False, True),
    )
    for config, atomic, index64 in variants:
        grads = triton_structured_bwd.structured_backward(
            do, q, k, v, o, lse, geo, pattern_id=pid, params=params, causal=p.causal, scale=D ** -0.5,
            softcap=softcap, sink_logits=sink, key_mask=key_mask, config=config, atomic_dq=atomic, index64=index64,
        )
        for label, a, b in zip(("dq", "dk", "dv", "dsink"), grads, refs):
            assert not a.isnan().any(), (label, config, atomic, index64)
            assert rel(a, b) < 5 * TOL32, (label, config, atomic, index64)


def test_selection_prefill_config():
    """Inference prefill with a token layout: BLOCK_M = rows * pack = 128 at D=128 and 64 with the largest
    power-of-two pack (<= 4) dividing the group; other head dims and the CPU keep the prefill tiles."""
    from sparse_k.attention.plan import selection_prefill_config, tile_config

    for group, pack in ((1, 1), (2, 2), (3, 1), (4, 4), (6, 2), (8, 4), (12, 4)):
        for d in (128, 64):
            assert selection_prefill_config(group, "cuda", d) == (128 // pack, pack, 64), (group, d)
    for d in (96, 256):
        assert selection_prefill_config(4, "cuda", d) == (tile_config(d, "cuda", False)[0], 1, tile_config(d, "cuda", False)[1])
    assert selection_prefill_config(4, "cpu", 128)[1] == 1


@pytest.mark.parametrize("group,query_block,want", [
    (3, 1, (16, 1, 64)), (3, 2, (16, 1, 64)), (3, 4, (16, 1, 64)), (3, 8, (32, 1, 64)), (3, 17, (64, 1, 64)),
    (3, 63, (64, 1, 64)), (3, 64, (128, 1, 64)), (3, 128, (128, 1, 64)), (3, None, (128, 1, 64)), (4, 1, (4, 4, 64)),
    (4, 4, (16, 4, 64)), (4, 5, (16, 4, 64)), (4, 32, (16, 4, 64)), (2, 1, (8, 2, 64)), (2, 16, (32, 2, 64)),
    (8, 1, (4, 4, 64)), (1, 48, (64, 1, 64)),
])
def test_selection_prefill_config_short_blocks(group, query_block, want):
    """Selection blocks shorter than ``SMALL_BLOCK_MAX`` queries: ``BLOCK_M`` (rows times the heads packed as before)
    is four blocks' rows rounded up to a power of two, within [16, 64], so a per-query layout's tile walks 16 key
    lists, not 128; longer blocks (and an unknown one) keep the 128-row tiles; the CPU keeps its tiles."""
    from sparse_k.attention.plan import SMALL_BLOCK_MAX, selection_prefill_config, tile_config

    assert SMALL_BLOCK_MAX == 64
    for d in (128, 64):
        assert selection_prefill_config(group, "cuda", d, query_block) == want
    cpu_m, cpu_n = tile_config(128, "cpu", False)
    assert selection_prefill_config(group, "cpu", 128, query_block) == (cpu_m, 1, cpu_n)
    assert selection_prefill_config(group, "cuda", 96, query_block)[0] == tile_config(96, "cuda", False)[0]


@_SUBPROCESS_ONLY
def test_bwd_preprocess_delta_and_lse2():
    """``delta = rowsum(dO * O)`` in float32 and ``lse2 = lse * log2(e)`` (+inf where lse = -inf) from
    a strided output view, odd length, fp16 inputs; written contiguously."""
    g = torch.Generator().manual_seed(3)
    B, Hq, Sq, D = 2, 3, 37, 16
    out = rand(B, Sq, Hq, D, dtype=torch.float16, gen=g).transpose(1, 2)  # (B, Hq, Sq, D) view, row stride Hq * D
    do = rand(B, Hq, Sq, D, dtype=torch.float16, gen=g)
    lse = rand(B, Hq, Sq, gen=g)
    lse[1, 2, :5] = float("-inf")
    delta, lse2 = triton_bwd.bwd_preprocess(do, out, lse)
    ref = (do.double() * out.double()).sum(-1)
    assert delta.dtype == torch.float32 and delta.is_contiguous() and lse2.is_contiguous()
    assert rel(delta, ref) < 1e-6
    assert torch.isposinf(lse2[1, 2, :5]).all()
    fin = torch.isfinite(lse)
    assert torch.allclose(lse2[fin].double(), lse[fin].double() / torch.log(torch.tensor(2.0, dtype=torch.float64)), rtol=1e-6)


@_SUBPROCESS_ONLY
def test_bigbird_tiles_dividing_the_block():
    """Bigbird on tiles smaller than its block (as ``bigbird_tiles`` picks for blocks of 128 on the GPU):
    every tile lies in one block pair, so the layout path's whole-tile rule stays exact."""
    p = get_pattern("bigbird", block=32, window_blocks=1, global_blocks=1, random_blocks=1)
    g = torch.Generator().manual_seed(11)
    B, Hq, Hkv, S, D = 1, 4, 2, 96, 16
    q, k, v = rand(B, Hq, S, D, gen=g), rand(B, Hkv, S, D, gen=g), rand(B, Hkv, S, D, gen=g)
    geo = row_geometry(B, S, S, None, device=DEV)
    out = torch.full((B, Hq, S, D), float("nan"), device=DEV)
    o, _ = dispatch.attention_forward(q, k, v, _layout(p, S, S, geo, Hkv), scale=D ** -0.5, out=out)
    ro, _ = reference_attention(q, k, v, p, geo, scale=D ** -0.5)
    assert not o.isnan().any()
    assert rel(o, ro) < TOL32


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("name", ["sliding_window", "bigbird"])
def test_forward_with_fewer_stages_when_shared_memory_does_not_fit(name, monkeypatch):
    """Both forward launchers (structured tiles, layout path) go through ``fitting.launch``: a kernel
    that Triton refuses above one stage (as float32 inputs can be on an H100) still gives the
    reference's result."""
    from triton.runtime.errors import OutOfResources
    from sparse_k.attention.triton import fitting

    stages = []

    class OneStage:
        def __init__(self, kernel):
            self.kernel, self.__name__ = kernel, "one_stage_" + name

        def __getitem__(self, grid):
            def run(*args, num_stages, **options):
                stages.append(num_stages)
                if num_stages > 1:
                    raise OutOfResources(245760, 232448, "shared memory")
                return self.kernel[grid](*args, num_stages=num_stages, **options)

            return run

    monkeypatch.setattr(fitting, "_FITTED", {})
    monkeypatch.setattr(triton_structured, "_st_fwd", OneStage(triton_structured._st_fwd))
    monkeypatch.setattr(triton_fwd, "_attn_fwd", OneStage(triton_fwd._attn_fwd))
    p = PATTERNS[name]
    g = torch.Generator().manual_seed(11)
    B, Hq, Hkv, D = 1, 4, 2, 16
    Sq, Skv = (48, 64) if name == "bigbird" else (37, 53)
    q, k, v = rand(B, Hq, Sq, D, gen=g), rand(B, Hkv, Skv, D, gen=g), rand(B, Hkv, Skv, D, gen=g)
    geo = row_geometry(B, Sq, Skv, None, device=DEV)
    out = torch.full((B, Hq, Sq, D), float("nan"), device=DEV)
    with pytest.warns(UserWarning, match="pipeline stage"):
        o, _ = dispatch.attention_forward(q, k, v, _layout(p, Sq, Skv, geo, Hkv), scale=D ** -0.5, out=out, cuda=False)
    ro, _ = reference_attention(q, k, v, p, geo, scale=D ** -0.5)
    assert stages[0] > 1 and stages[-1] == 1
    assert not o.isnan().any() and rel(o, ro) < TOL32
