"""When the structured forward hands a call to the Hopper CUDA kernel (``sparse_k.cuda_dispatch``).

CPU tests of the rules; the kernel itself is tested on the GPU in ``test_cuda_structured.py``."""

import pytest
import torch
from helpers import needs_sm90, rel_err
from sparse_k import cuda_dispatch, row_geometry
from sparse_k.cuda_dispatch import (
    cuda_enabled,
    cuda_structured_applies,
    plain_geometry,
    try_cuda_structured,
)


def test_env_switch(monkeypatch):
    monkeypatch.delenv(cuda_dispatch.CUDA_ENV, raising=False)
    assert cuda_enabled()
    monkeypatch.setenv(cuda_dispatch.CUDA_ENV, "0")
    assert not cuda_enabled()
    monkeypatch.setenv(cuda_dispatch.CUDA_ENV, "1")
    assert cuda_enabled()
    monkeypatch.setenv(cuda_dispatch.CUDA_ENV, "yes")
    with pytest.raises(ValueError, match="SPARSE_K_CUDA='yes'"):
        cuda_enabled()


@pytest.mark.parametrize(
    "q_len, kv_len, mask_row, expected",
    [
        (37, 37, None, True),  # plain self-attention
        (5, 37, None, False),  # chunked prefill: queries bottom-right, q_start = 32
        (37, 37, [0, 0] + [1] * 35, False),  # left padding: k_start = 2 for row 1
        (37, 37, [1] * 37, False),  # any mask: offsets known on the device only, not read (no sync)
    ],
)
def test_plain_geometry(q_len, kv_len, mask_row, expected):
    mask = None
    if mask_row is not None:
        mask = torch.ones(2, kv_len, dtype=torch.long)
        mask[1] = torch.tensor(mask_row)
    geo = row_geometry(2, q_len, kv_len, mask)
    assert plain_geometry(geo, q_len, kv_len) is expected


def test_custom_op_geometry_without_host_offsets_is_not_plain():
    from types import SimpleNamespace

    z = torch.zeros(1, dtype=torch.long)
    assert not plain_geometry(SimpleNamespace(q_start=z, k_start=z, k_end=z + 8), 8, 8)


def test_cpu_calls_stay_on_triton():
    q, k, v = torch.randn(1, 4, 40, 128), torch.randn(1, 2, 40, 128), torch.randn(1, 2, 40, 128)
    geo = row_geometry(1, 40, 40, None)
    assert not cuda_structured_applies(q, k, v, geo, pattern_id=1, causal=True)
    assert try_cuda_structured(q, k, v, geo, pattern_id=1, params=(16, 0, 0, 0), causal=True, scale=0.1) is None


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("name, kw", [("sliding_window", {"window": 300}), ("streaming", {"window": 300, "sinks": 64}),
                                      ("dense", {})])
def test_block_attn_dispatches_to_cuda_and_matches_triton(name, kw):
    """Plain causal bf16 self-attention goes to the CUDA kernel; its output matches the Triton kernel's
    (same inputs) and the float64 reference. bf16 operands: 1e-3..1e-2 relative (design §10)."""
    from sparse_k import (
        build_block_layout,
        get_pattern,
        reference_attention,
        triton_fwd,
    )
    from sparse_k.ops import block_attn

    S, D = 1001, 128
    q = torch.randn(1, 8, S, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    p = get_pattern(name, **kw)
    geo = row_geometry(1, S, S, None, device="cuda")
    lay = build_block_layout(p, S, S, geo, block_q=128, block_k=128, num_kv_heads=2)
    pid, _ = triton_fwd.pattern_code(p)
    assert cuda_structured_applies(q, k, v, geo, pattern_id=pid, causal=True)
    out, lse = block_attn(q, k, v, lay, scale=D ** -0.5)
    out_t, lse_t = triton_fwd.attention_forward(q, k, v, lay, scale=D ** -0.5, cuda_structured=False)
    ref, _ = reference_attention(q.double(), k.double(), v.double(), p, geo, scale=D ** -0.5)
    assert rel_err(out, ref) < 2e-2 and rel_err(out, out_t) < 2e-2
    torch.testing.assert_close(lse, lse_t, rtol=0, atol=2e-2)


@pytest.mark.gpu
@needs_sm90
def test_autograd_path_uses_cuda_forward_and_backward(monkeypatch):
    """Through the custom op with gradients (the training path) the plain geometry reaches the dispatch
    of both passes: the CUDA forward and the CUDA backward run; gradients match the float64 reference's."""
    from sparse_k import build_block_layout, get_pattern, reference_attention
    from sparse_k.ops import block_attn

    S, D = 777, 128
    p = get_pattern("streaming", window=200, sinks=32)
    geo = row_geometry(1, S, S, None, device="cuda")
    lay = build_block_layout(p, S, S, geo, block_q=64, block_k=64, num_kv_heads=2)
    leaves = [torch.randn(1, h, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2)]
    do = torch.randn(1, 8, S, D, device="cuda", dtype=torch.bfloat16)
    taken = []
    real = cuda_dispatch.try_cuda_structured
    monkeypatch.setattr(cuda_dispatch, "try_cuda_structured", lambda *a, **kw: taken.append(real(*a, **kw)) or taken[-1])
    taken_bwd = []
    real_bwd = cuda_dispatch.try_cuda_structured_backward
    monkeypatch.setattr(cuda_dispatch, "try_cuda_structured_backward",
                        lambda *a, **kw: taken_bwd.append(real_bwd(*a, **kw)) or taken_bwd[-1])
    out, _ = block_attn(*leaves, lay, scale=D ** -0.5, need_grad=True)
    assert len(taken) == 1 and taken[0] is not None  # the CUDA kernel ran the forward
    grads = torch.autograd.grad(out, leaves, do)
    assert len(taken_bwd) == 1 and taken_bwd[0] is not None  # and the backward
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref, _ = reference_attention(*ref_leaves, p, geo, scale=D ** -0.5)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())
    assert rel_err(out, ref) < 2e-2
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 2e-2


def _view(shape, strides, dtype=torch.bfloat16, offset=0):
    n = offset + 1 + sum((m - 1) * st for m, st in zip(shape, strides))
    return torch.empty(n + 64, dtype=dtype)[offset:].as_strided(shape, strides)


@pytest.mark.parametrize(
    "shape, strides, dtype, offset, expected",
    [
        ((2, 8, 37, 128), (8 * 37 * 128, 37 * 128, 128, 1), torch.bfloat16, 0, True),  # contiguous
        ((2, 8, 37, 128), (37 * 8 * 128, 128, 8 * 128, 1), torch.bfloat16, 0, True),  # transposed (B, S, H, D)
        ((2, 2, 37, 128), (37 * 12 * 128, 128, 12 * 128, 1), torch.float16, 8 * 128, True),  # slice of fused QKV
        ((1, 1, 37, 128), (3, 5, 128, 1), torch.bfloat16, 0, True),  # size-1 dimensions: any stride
        ((1, 4, 1, 128), (7, 128, 9, 1), torch.bfloat16, 0, True),
        ((2, 8, 37, 128), (37 * 8 * 136, 136, 8 * 136, 1), torch.bfloat16, 0, True),  # padded rows, 272 bytes
        ((2, 8, 37, 128), (37 * 8 * 132, 132, 8 * 132, 1), torch.bfloat16, 0, False),  # rows of 264 bytes
        ((2, 8, 37, 128), (37 * 8 * 132, 132, 8 * 132, 1), torch.float32, 0, True),  # 528 bytes
        ((2, 8, 37, 128), (8 * 37 * 128, 0, 128, 1), torch.bfloat16, 0, False),  # expanded heads
        ((2, 8, 37, 128), (8 * 37 * 128, 37 * 128, 1, 37), torch.bfloat16, 0, False),  # head dim not innermost
        ((2, 8, 37, 128), (8 * 37 * 128, 37 * 128, 128, 1), torch.bfloat16, 4, False),  # data 8 bytes off
        ((2, 8, 37, 128), (2**39, 37 * 128, 128, 1), torch.bfloat16, 0, False),  # batch stride of 2**40 bytes
    ],
)
def test_tma_view_rule(shape, strides, dtype, offset, expected):
    """The stride rule of the CUDA kernels' inputs, on CPU tensors (it reads strides and the data pointer
    only); ``tensors_ok`` applies it after the device checks."""
    from sparse_k.cuda_contract import tma_view_ok

    if strides[0] >= 2**39:  # no storage that large: a meta tensor has the strides (and data pointer 0)
        t = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
    else:
        t = _view(shape, strides, dtype, offset)
    assert t.data_ptr() % 16 == (8 if offset == 4 else 0)
    assert tma_view_ok(t) is expected


def test_output_follows_query_order():
    """Outputs of the forward kernels take q's memory order: (B, S, H, D) storage for transposed
    queries (so a Transformers layer's transpose back is free), contiguous otherwise and where both
    orders are one (H = 1 or S = 1)."""
    from sparse_k.memory_order import new_output, sequence_major

    bshd = torch.empty(2, 37, 8, 128, dtype=torch.float16).transpose(1, 2)
    out = new_output(bshd)
    assert sequence_major(bshd) and out.shape == bshd.shape and out.dtype == bshd.dtype
    assert out.transpose(1, 2).is_contiguous() and not out.is_contiguous()
    assert new_output(bshd, 64).shape == (2, 8, 37, 64)
    for q in (torch.empty(2, 8, 37, 128), torch.empty(2, 37, 1, 128).transpose(1, 2),
              torch.empty(2, 1, 8, 128).transpose(1, 2)):
        assert not sequence_major(q) and new_output(q).is_contiguous()


def test_cpu_backward_stays_on_triton():
    from sparse_k.cuda_dispatch import try_cuda_structured_backward

    q, k, v = torch.randn(1, 4, 40, 128), torch.randn(1, 2, 40, 128), torch.randn(1, 2, 40, 128)
    geo = row_geometry(1, 40, 40, None)
    assert try_cuda_structured_backward(q, q, k, v, q, torch.zeros(1, 4, 40), geo, pattern_id=1, params=(16, 0, 0, 0),
                                        causal=True, scale=0.1) is None


def _spy(monkeypatch, name):
    """Record what ``cuda_dispatch.<name>`` returns (None: the call stayed on Triton)."""
    taken = []
    real = getattr(cuda_dispatch, name)
    monkeypatch.setattr(cuda_dispatch, name, lambda *a, **kw: taken.append(real(*a, **kw)) or taken[-1])
    return taken


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_api_bshd_reaches_cuda_without_copies(monkeypatch, dtype):
    """``flash_attn_func`` on (B, S, H, D) tensors: the CUDA forward takes the transposed views as they
    are, and the (B, S, H, D) output it returns is contiguous (written in that order, no copy)."""
    from sparse_k import get_pattern, reference_attention
    from sparse_k.flash_api import flash_attn_func

    B, S, Hq, Hkv, W = 2, 1001, 8, 2, 300
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(B, S, h, 128, device="cuda", dtype=dtype, generator=g) for h in (Hq, Hkv, Hkv))
    taken = _spy(monkeypatch, "try_cuda_structured")
    out = flash_attn_func(q, k, v, causal=True, window_size=(W - 1, 0))
    assert len(taken) == 1 and taken[0] is not None, "the CUDA kernel did not take the call"
    assert out.shape == q.shape and out.is_contiguous() and taken[0][0].data_ptr() == out.data_ptr()
    geo = row_geometry(B, S, S, None, device="cuda")
    ref, _ = reference_attention(*(t.transpose(1, 2).double() for t in (q, k, v)),
                                 get_pattern("sliding_window", window=W), geo, scale=128 ** -0.5)
    assert rel_err(out.transpose(1, 2), ref) < (2e-2 if dtype == torch.bfloat16 else 4e-3)


@pytest.mark.gpu
@needs_sm90
def test_transposed_training_path_uses_cuda_both_ways(monkeypatch):
    """A Transformers-style call with gradients (leaves (B, S, H, D), the attention gets their
    transposed views): the CUDA forward and backward both run, the output is in (B, S, H, D) order,
    and the leaves' gradients match the float64 reference's."""
    from sparse_k import get_pattern, reference_attention, sparse_attention

    B, S, Hq, Hkv, D = 1, 777, 8, 2, 128
    p = get_pattern("streaming", window=200, sinks=32)
    g = torch.Generator(device="cuda").manual_seed(11)
    leaves = [torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
              for h in (Hq, Hkv, Hkv)]
    do = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    fwd = _spy(monkeypatch, "try_cuda_structured")
    bwd = _spy(monkeypatch, "try_cuda_structured_backward")
    out = sparse_attention(*(t.transpose(1, 2) for t in leaves), p, backend="triton")
    assert len(fwd) == 1 and fwd[0] is not None
    assert out.transpose(1, 2).is_contiguous()  # the adapter's transpose(1, 2).contiguous() copies nothing
    grads = torch.autograd.grad(out.transpose(1, 2), leaves, do)
    assert len(bwd) == 1 and bwd[0] is not None
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    geo = row_geometry(B, S, S, None, device="cuda")
    ref, _ = reference_attention(*(t.transpose(1, 2) for t in ref_leaves), p, geo, scale=D ** -0.5)
    ref_grads = torch.autograd.grad(ref.transpose(1, 2), ref_leaves, do.double())
    assert rel_err(out.transpose(1, 2), ref.transpose(1, 2)) < 2e-2
    for gr, r in zip(grads, ref_grads):
        assert gr.is_contiguous() and rel_err(gr, r) < 2e-2
