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


def test_cpu_backward_stays_on_triton():
    from sparse_k.cuda_dispatch import try_cuda_structured_backward

    q, k, v = torch.randn(1, 4, 40, 128), torch.randn(1, 2, 40, 128), torch.randn(1, 2, 40, 128)
    geo = row_geometry(1, 40, 40, None)
    assert try_cuda_structured_backward(q, q, k, v, q, torch.zeros(1, 4, 40), geo, pattern_id=1, params=(16, 0, 0, 0),
                                        causal=True, scale=0.1) is None
