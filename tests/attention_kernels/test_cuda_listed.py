"""The Hopper CUDA listed forward (``cuda.structured.cuda_listed_forward``): bigbird over a block layout of
128 x 128 tiles, against the exact float64 reference.

GPU tests (``gpu`` marker) need an sm_90 device and nvcc; they build the extension on first use.
Tolerances as tests/attention_kernels/test_cuda_structured.py: bf16 operands with P rounded to 16 bits
before P V give 1e-3..1e-2 relative error, fp16 about 8x less; a wrong tile list or mask gives O(1).
"""

import time

import pytest
import torch
from helpers import bshd_views, nan_bshd, needs_sm90, rel_err
from sparse_k import BigBird, build_block_layout, reference_attention, row_geometry, sparse_attention
from sparse_k.attention import plan
from sparse_k.attention.cuda import structured as cs
from sparse_k.attention.ops import block_attn

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}

#: (B, Hq, Hkv, S, dtype, block, window_blocks, global_blocks, random_blocks, layer): odd lengths, GQA and
#: MHA, three query heads a KV head, blocks of one and two tiles, no window, more random blocks than candidates
#: early on.
CASES = [
    (1, 4, 2, 1000, torch.bfloat16, 128, 1, 1, 2, 0),
    (2, 6, 2, 1000, torch.bfloat16, 128, 1, 1, 2, 4),
    (2, 8, 2, 777, torch.float16, 256, 1, 2, 3, 3),
    (1, 8, 8, 3001, torch.bfloat16, 128, 2, 2, 3, 5),
    (1, 4, 1, 129, torch.float16, 128, 0, 1, 1, 1),
    (1, 4, 4, 2048, torch.bfloat16, 384, 1, 0, 2, 2),
]


def _case_id(case) -> str:
    B, Hq, Hkv, S, dtype, block, w, g, r, layer = case
    return f"B{B}-Hq{Hq}-Hkv{Hkv}-S{S}-{str(dtype)[6:]}-b{block}-w{w}-g{g}-r{r}-L{layer}"


def _inputs(case, layout_kind="bhsd", D=128):
    B, Hq, Hkv, S, dtype, block, w, g, r, layer = case
    seed = time.time_ns() % 2**31
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if layout_kind == "bhsd":
        q, k, v = (torch.randn(B, h, S, D, device="cuda", dtype=dtype, generator=gen) for h in (Hq, Hkv, Hkv))
    else:
        q, k, v, _ = bshd_views(B, Hq, Hkv, S, dtype, gen, layout_kind, D)
    p = BigBird(block=block, window_blocks=w, global_blocks=g, random_blocks=r, seed=seed % 1000)
    return q, k, v, p, seed


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_listed_matches_reference(case, D):
    """Poisoned outputs, fresh random inputs and random-block seeds, both head dims; block_attn plans the listed
    kernel and returns what the kernel wrote."""
    B, Hq, Hkv, S, dtype, block, w, g, r, layer = case
    q, k, v, p, seed = _inputs(case, D=D)
    geo = row_geometry(B, S, S, None, device="cuda")
    lay = build_block_layout(p, S, S, geo, block_q=128, block_k=128, layer_idx=layer, num_kv_heads=Hkv)
    scale = D ** -0.5
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, Hq, S), float("nan"), device="cuda")
    cs._launch_listed(q, k, v, lay, out, lse, scale)
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), p, geo, scale=scale, layer_idx=layer)
    assert not out.isnan().any() and not lse.isnan().any(), seed
    assert rel_err(out, ref) < TOL[dtype], seed
    assert float((lse.double() - ref_lse).abs().max()) < 1e-3, seed
    with plan.recording() as seen:
        out2, lse2 = block_attn(q, k, v, lay, scale=scale)
    assert [x.kernel for x in seen] == ["cuda_sm90_listed"], seen
    assert torch.equal(out2, out) and torch.equal(lse2, lse), seed  # one kernel, one order of operations


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("view", ["bshd", "qkv"])
def test_sparse_attention_takes_the_listed_kernel(view, D):
    """Through the public API on (B, S, H, D) views, as a Transformers layer passes them: inference runs the
    listed kernel on 128x128 tiles and matches the reference; with gradients another path runs (the listed
    kernel has no backward) and gives the same forward."""
    case = (1, 8, 2, 1500, torch.bfloat16, 128, 1, 2, 3, 4)
    q, k, v, p, seed = _inputs(case, view, D)
    S = q.shape[2]
    geo = row_geometry(1, S, S, None, device="cuda")
    ref, _ = reference_attention(q.double(), k.double(), v.double(), p, geo, scale=D ** -0.5, layer_idx=4)
    with plan.recording() as seen:
        out = sparse_attention(q, k, v, p, layer_idx=4)
    assert [x.kernel for x in seen] == ["cuda_sm90_listed"], seen
    assert rel_err(out, ref) < TOL[torch.bfloat16], seed
    qg = q.detach().clone().requires_grad_(True)
    with plan.recording() as seen:
        out_g = sparse_attention(qg, k, v, p, layer_idx=4)
        out_g.float().sum().backward()
    assert "cuda_sm90_listed" not in [x.kernel for x in seen] and qg.grad.isfinite().all(), seen
    assert rel_err(out_g.detach(), ref) < TOL[torch.bfloat16], seed


@pytest.mark.gpu
@needs_sm90
def test_listed_output_in_query_order():
    """The output of (B, S, H, D)-ordered queries comes back in that order, written through the NaN-poisoned view."""
    case = (2, 4, 2, 640, torch.float16, 128, 1, 1, 1, 0)
    q, k, v, p, seed = _inputs(case, "bshd")
    B, Hq, S = q.shape[:3]
    geo = row_geometry(B, S, S, None, device="cuda")
    lay = build_block_layout(p, S, S, geo, block_q=128, block_k=128, num_kv_heads=2)
    out = nan_bshd(B, Hq, S, torch.float16)
    lse = torch.full((B, Hq, S), float("nan"), device="cuda")
    cs._launch_listed(q, k, v, lay, out, lse, 0.1)
    ref, _ = reference_attention(q.double(), k.double(), v.double(), p, geo, scale=0.1)
    assert not out.isnan().any() and rel_err(out, ref) < TOL[torch.float16], seed
    out2, _ = cs.cuda_listed_forward(q, k, v, lay, scale=0.1)
    assert out2.transpose(1, 2).is_contiguous() and torch.equal(out2, out), seed


def test_listed_argument_errors():
    """Bad arguments raise ValueError naming the value, before any build or device work."""
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    p = BigBird(block=128)
    geo = row_geometry(1, 256, 256, None)
    lay = build_block_layout(p, 256, 256, geo, block_q=128, block_k=128, num_kv_heads=2)
    with pytest.raises(ValueError, match="scale=0"):
        cs.cuda_listed_forward(q, q, q, lay, scale=0)
    with pytest.raises(ValueError, match="outside the kernel's contract"):
        cs.cuda_listed_forward(q, q, q, lay, scale=1.0)  # CPU tensors


@pytest.mark.gpu
@needs_sm90
def test_compiled_bigbird_matches_the_reference():
    """Inside ``torch.compile`` bigbird keeps the Triton layout kernel's tiles (``plan.bigbird_cuda`` is False in a
    trace) and computes the same attention as eager (which takes the listed kernel)."""
    case = (1, 8, 2, 1024, torch.bfloat16, 128, 1, 1, 2, 2)
    q, k, v, p, seed = _inputs(case)
    geo = row_geometry(1, 1024, 1024, None, device="cuda")
    ref, _ = reference_attention(q.double(), k.double(), v.double(), p, geo, scale=128 ** -0.5, layer_idx=2)
    compiled = torch.compile(lambda a, b, c: sparse_attention(a, b, c, p, layer_idx=2))
    assert rel_err(compiled(q, k, v), ref) < TOL[torch.bfloat16], seed
    assert rel_err(sparse_attention(q, k, v, p, layer_idx=2), ref) < TOL[torch.bfloat16], seed
