"""bigbird without block tiles: a left-padded batch, a chunk that starts inside a block, a block that is no tile
size. Such calls run the Triton layout kernels over tiles no wider than the block, which straddle its
blocks, with bigbird's rule evaluated in the partial tiles (``plan.bigbird_rule_tiles``, the launch on bigbird's
``decode_pattern_code``), instead of the PyTorch path, and so does their backward; each case is checked against the
exact float64 reference (gradients too), and a direct launch writes every element of a NaN-poisoned output.

Without CUDA the kernels run under Triton's interpreter (``tests/triton_interp.py``; fp32, 16x16 tiles); with CUDA
the same tests run compiled (fp32 ``tl.dot`` is TF32 there: ``TOL32``), plus a bf16 test at D=128 (``gpu``).
"""

import dataclasses
import warnings

import pytest
import torch
from triton_interp import KERNEL_TEST, ON_GPU, import_kernels, run_file_interpreted

HAVE_TRITON, IN_PROCESS, _kernels = import_kernels("attention.triton.fwd")

import sparse_k
from sparse_k import build_block_layout, get_pattern, reference_attention, row_geometry
from sparse_k.attention import dispatch, plan
from sparse_k.attention.pattern_codes import bigbird_code_draws, decode_pattern_code
from sparse_k.attention.plan import bigbird_rule_tiles

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
_SUBPROCESS_ONLY = KERNEL_TEST

DEV = "cuda" if ON_GPU else "cpu"
TOL32 = 2e-3 if ON_GPU else 1e-5


@pytest.mark.skipif(IN_PROCESS, reason="the kernels run in this process")
def test_interpreter_suite_in_subprocess():
    run_file_interpreted(__file__, 20)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _rand(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(device=DEV, dtype=dtype)


def _rel(a, b):
    """Relative error of ``a`` against the reference ``b`` (whose rows without a valid key, queries inside the left
    padding, may hold NaN: compared as 0, what the kernel writes there); a NaN in ``a`` fails every bound."""
    a, b = a.detach().double(), b.detach().double().nan_to_num()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _bigbird(block, window_blocks=1, global_blocks=1, random_blocks=2, seed=3):
    return get_pattern("bigbird", block=block, window_blocks=window_blocks, global_blocks=global_blocks,
                       random_blocks=random_blocks, seed=seed)


# name: (pattern, Sq, Skv, left padding per row, q_start (None: bottom-right), layer). Lengths of 9 to 14 blocks:
# most rows then leave most key blocks out (a short sequence would allow nearly every key and hide a wrong rule).
CASES = {
    "left_padded": (_bigbird(16), 157, 173, (0, 5), None, 2),
    "left_padded_long_pad": (_bigbird(16, random_blocks=3), 181, 181, (13, 29), None, 0),
    "chunk_inside_a_block": (_bigbird(16, window_blocks=2, global_blocks=2), 97, 211, (0, 0), 107, 5),
    "block_24_aligned": (_bigbird(24), 216, 216, (0, 0), None, 1),
    "block_32_no_window_no_global": (_bigbird(32, window_blocks=0, global_blocks=0, random_blocks=3), 290, 290,
                                     (3, 0), None, 7),
    "no_random_blocks": (_bigbird(16, random_blocks=0), 145, 145, (7, 2), None, 0),
}


def _inputs(case, gen, dtype=torch.float32, B=2, Hq=4, Hkv=2, D=16):
    p, Sq, Skv, pads, q_start, layer = CASES[case]
    q, k, v = _rand(B, Hq, Sq, D, gen=gen, dtype=dtype), _rand(B, Hkv, Skv, D, gen=gen, dtype=dtype), \
        _rand(B, Hkv, Skv, D, gen=gen, dtype=dtype)
    mask = torch.ones(B, Skv, dtype=torch.bool, device=DEV)
    for b, pad in enumerate(pads):
        mask[b, :pad] = False
    kw = dict(attention_mask=mask, layer_idx=layer)
    if q_start is not None:
        kw["q_start"] = q_start
    return p, q, k, v, kw


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("case", list(CASES))
def test_bigbird_without_block_tiles_runs_the_kernel(case):
    """No fallback (warnings are errors; the recorded launch is the Triton layout kernel), exact results."""
    gen = torch.Generator().manual_seed(len(case) * 31)
    p, q, k, v, kw = _inputs(case, gen)
    sinks = _rand(q.shape[1], gen=gen) if "padded" in case else None
    with warnings.catch_warnings(), plan.recording() as seen:
        warnings.simplefilter("error", UserWarning)
        out = sparse_k.sparse_attention(q, k, v, p, backend="triton", sink_logits=sinks, **kw)
    assert [x.kernel for x in seen] == ["triton_layout"]
    ref = sparse_k.sparse_attention(q.double(), k.double(), v.double(), p, backend="reference",
                                    sink_logits=None if sinks is None else sinks.double(), **kw)
    assert _rel(out, ref) < TOL32


def _straddling_layout(p, Sq, Skv, geo, Hkv, layer_idx, device_type=DEV):
    bq, bk = bigbird_rule_tiles(p.block, device_type)
    layout = build_block_layout(p, Sq, Skv, geo, block_q=bq, block_k=bk, layer_idx=layer_idx, num_kv_heads=Hkv)
    return dataclasses.replace(layout, pattern=decode_pattern_code(p, layer_idx))


@_SUBPROCESS_ONLY
def test_straddling_tiles_write_every_output_element():
    """A direct launch over a NaN-poisoned output, GQA 3, odd lengths, sink logits: every element written, the
    log-sum-exp too (-inf exactly on the rows with no valid key: queries inside the left padding)."""
    gen = torch.Generator().manual_seed(11)
    p = _bigbird(16, window_blocks=1, global_blocks=1, random_blocks=3, seed=9)
    B, Hq, Hkv, Sq, Skv, D = 2, 6, 2, 143, 199, 16
    q, k, v = _rand(B, Hq, Sq, D, gen=gen), _rand(B, Hkv, Skv, D, gen=gen), _rand(B, Hkv, Skv, D, gen=gen)
    sinks = _rand(Hq, gen=gen)
    mask = torch.ones(B, Skv, dtype=torch.bool, device=DEV)
    mask[1, :21] = False
    geo = row_geometry(B, Sq, Skv, mask, device=DEV)
    layout = _straddling_layout(p, Sq, Skv, geo, Hkv, layer_idx=4)
    out = torch.full((B, Hq, Sq, D), float("nan"), device=DEV)
    o, lse = dispatch.attention_forward(q, k, v, layout, scale=D ** -0.5, sink_logits=sinks, key_mask=mask, out=out)
    ro, rl = reference_attention(q.double(), k.double(), v.double(), p, geo, scale=D ** -0.5,
                                 sink_logits=sinks.double(), key_mask=mask, layer_idx=4)
    assert o.data_ptr() == out.data_ptr() and not o.isnan().any() and not lse.isnan().any()
    assert _rel(o, ro) < TOL32
    torch.testing.assert_close(lse.double(), rl, atol=1e-4 if not ON_GPU else 5e-3, rtol=1e-4)


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("case", list(CASES))
def test_bigbird_gradients_without_block_tiles_run_the_kernels(case):
    """With gradients the same calls run the layout kernels both ways (no fallback: warnings are errors, the
    recorded launches are the Triton layout forward and backward), the backward evaluating the rule in the partial
    tiles too: gradients of q, k, v and the sink logits against the float64 reference."""
    gen = torch.Generator().manual_seed(len(case) * 17)
    p, q, k, v, kw = _inputs(case, gen)
    _assert_kernel_gradients(p, q, k, v, _rand(q.shape[1], gen=gen), kw, gen, TOL32, case)


def _assert_kernel_gradients(p, q, k, v, sinks, kw, gen, tol, what):
    """One forward + backward of bigbird ``p`` on the layout kernels (no fallback, no warning), its output within
    ``tol`` and its gradients of ``q, k, v, sinks`` within ``2 * tol`` of the float64 reference, none NaN."""
    leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
    with warnings.catch_warnings(), plan.recording() as seen:
        warnings.simplefilter("error", UserWarning)
        out = sparse_k.sparse_attention(q, k, v, p, backend="triton", sink_logits=sinks, **kw)
        do = torch.randn(out.shape, generator=gen).to(DEV, out.dtype)
        grads = torch.autograd.grad(out, leaves, do)
    assert [x.kernel for x in seen] == ["triton_layout", "triton_layout_bwd"], seen
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = sparse_k.sparse_attention(*ref_leaves[:3], p, backend="reference", sink_logits=ref_leaves[3], **kw)
    # the reference's rows without a valid key (queries inside the left padding) are NaN: no gradient flows there
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.double().masked_fill(ref.isnan(), 0.0))
    assert _rel(out, ref) < tol
    for name, g, gr in zip(("dq", "dk", "dv", "dsink"), grads, ref_grads):
        assert not g.isnan().any() and _rel(g, gr) < 2 * tol, (what, name, _rel(g, gr))


def test_straddling_tiles_stay_inside_one_block_pair():
    for block in (16, 24, 32, 48, 64, 96, 128, 256):
        for device_type in ("cpu", "cuda"):
            bq, bk = bigbird_rule_tiles(block, device_type)
            assert 16 <= bq <= block and 16 <= bk <= block, (block, device_type, bq, bk)
            assert bq & (bq - 1) == 0 and bk & (bk - 1) == 0  # tl.arange sizes
            assert bq <= (64 if device_type == "cuda" else 16) and bk <= (64 if device_type == "cuda" else 16)


def test_blocks_the_kernel_rule_cannot_take_keep_the_fallback():
    """Blocks under 16 or more than 16 random blocks have no code for the kernel's rule: still the PyTorch path."""
    gen = torch.Generator().manual_seed(4)
    for p in (_bigbird(8), _bigbird(16, random_blocks=17)):
        assert decode_pattern_code(p, 0) is None
        q, k, v = _rand(1, 2, 40, 16, gen=gen), _rand(1, 1, 40, 16, gen=gen), _rand(1, 1, 40, 16, gen=gen)
        mask = torch.ones(1, 40, dtype=torch.bool, device=DEV)
        mask[0, :3] = False
        with plan.recording() as seen, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sparse_k.sparse_attention(q, k, v, p, backend="triton", attention_mask=mask)
        assert [x.kernel for x in seen] == ["torch"], (p, seen)


@_SUBPROCESS_ONLY
def test_tiles_wider_than_the_block_are_refused():
    geo = row_geometry(1, 40, 40, None, device=DEV)
    p = _bigbird(16)
    layout = build_block_layout(p, 40, 40, geo, block_q=32, block_k=16, num_kv_heads=1)
    layout = dataclasses.replace(layout, pattern=decode_pattern_code(p, 0))
    q = _rand(1, 1, 40, 16, gen=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="at most its block"):
        dispatch.attention_forward(q, q, q, layout, scale=0.25)


def test_the_listed_cuda_kernel_refuses_a_layout_that_carries_the_rule():
    from sparse_k.attention.cuda.contract import listed_call_ok

    p = _bigbird(128)
    q = torch.zeros(1, 8, 256, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    geo = row_geometry(1, 256, 256, None)
    layout = build_block_layout(p, 256, 256, geo, block_q=128, block_k=128, num_kv_heads=2)
    with_rule = dataclasses.replace(layout, pattern=decode_pattern_code(p, 0))
    assert listed_call_ok(q, k, k, layout, pattern_id=4)  # the device aside, the contract holds for block tiles
    assert not listed_call_ok(q, k, k, with_rule, pattern_id=4)


def _padded_bigbird_batch(gen, dtype):
    """The GPU tests' bigbird (blocks of 128; 1 window, 2 global, 3 random) and batch: B=2, Hq=8, Hkv=2, S=1000,
    D=128 in ``dtype``, the second row's first 77 keys masked. Returns ``(pattern, q, k, v, attention_mask)``."""
    p = get_pattern("bigbird", block=128, window_blocks=1, global_blocks=2, random_blocks=3)
    B, Hq, Hkv, S, D = 2, 8, 2, 1000, 128
    q, k, v = (_rand(B, h, S, D, gen=gen, dtype=dtype) for h in (Hq, Hkv, Hkv))
    mask = torch.ones(B, S, dtype=torch.bool, device=DEV)
    mask[1, :77] = False
    return p, q, k, v, mask


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_padded_bigbird_prefill_on_the_gpu(dtype):
    """bf16 / fp16 at D=128 with the GPU's 64x64 tiles: a left-padded batch and a chunk inside a block, against the
    float32 reference (tolerance: bf16 / fp16 operand rounding, as the other kernel tests)."""
    gen = torch.Generator().manual_seed(2)
    p, q, k, v, mask = _padded_bigbird_batch(gen, dtype)
    S = q.shape[2]
    for kw in (dict(attention_mask=mask, layer_idx=3), dict(q_start=S - 300, layer_idx=1)):
        qq = q if "attention_mask" in kw else q[:, :, -300:]
        with warnings.catch_warnings(), plan.recording() as seen:
            warnings.simplefilter("error", UserWarning)
            out = sparse_k.sparse_attention(qq, k, v, p, backend="triton", **kw)
        assert [x.kernel for x in seen] == ["triton_layout"]
        ref = sparse_k.sparse_attention(qq.float(), k.float(), v.float(), p, backend="reference", **kw)
        assert _rel(out, ref) < (2e-2 if dtype == torch.bfloat16 else 4e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_padded_bigbird_gradients_on_the_gpu(dtype):
    """Training on a left-padded batch, bf16 / fp16 at D=128 with the GPU's 64x64 tiles: the layout kernels both
    ways, gradients of q, k, v and the sink logits against the float64 reference (twice the forward's tolerance,
    as the other backward tests)."""
    gen = torch.Generator().manual_seed(6)
    p, q, k, v, mask = _padded_bigbird_batch(gen, dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    _assert_kernel_gradients(p, q, k, v, _rand(q.shape[1], gen=gen), dict(attention_mask=mask, layer_idx=2), gen, tol,
                             dtype)


@pytest.mark.parametrize("layer", [0, 3, 29])
def test_the_kernel_table_of_a_code_is_the_pattern_random_table(layer):
    """The straddling-tile launch reads the draws of bigbird's code (``bigbird_code_draws``): the same blocks as
    ``BigBird.random_table`` of that layer, whatever prefix was cached before."""
    p = _bigbird(32, window_blocks=2, global_blocks=1, random_blocks=4, seed=7)
    code = decode_pattern_code(p, layer)
    for n_qb in (5, 70, 12):
        table = bigbird_code_draws(code.params, 3, n_qb, "cpu")
        assert table.dtype == torch.int32 and table.shape == (3, n_qb, 4)
        assert torch.equal(table.long(), p.random_table(layer, 3, n_qb))
