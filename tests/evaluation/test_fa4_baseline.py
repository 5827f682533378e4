"""hf_sparse_attention.evaluation.fa4_baseline: the FA4 call standing for each pattern computes that pattern.

FA4 itself needs a Hopper GPU and its CuTe DSL wheels; here a stand-in with FA4's documented semantics
(``(B, S, H, D)`` tensors, GQA by head groups, key ``j`` of query ``i`` kept for ``i - left <= j <= i + right``,
``causal`` forcing ``right = 0``) takes its place, so the tests check what the benchmark relies on: the window
translation, the layout transposes, and that gradients come back in our ``(B, H, S, D)`` order.
"""

from __future__ import annotations

import pytest
import torch

from hf_sparse_attention.evaluation import fa4_baseline
from sparse_k import get_pattern, reference_attention, row_geometry


def fa4_like(q, k, v, softmax_scale=None, causal=False, window_size=(None, None)):
    """FA4's ``flash_attn_func`` semantics in plain PyTorch: ``(out (B, S, Hq, D), lse (B, Hq, S))``."""
    B, S, Hq, D = q.shape
    group = Hq // k.shape[2]
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(S).view(-1, 1)
    j = torch.arange(k.shape[1]).view(1, -1)
    ok = torch.ones(S, k.shape[1], dtype=torch.bool)
    if left is not None:
        ok &= j >= i - left
    if right is not None:
        ok &= j <= i + right
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(group, 1)
    vh = v.transpose(1, 2).repeat_interleave(group, 1)
    scores = (qh @ kh.transpose(-1, -2)) * softmax_scale
    scores = scores.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return (scores.softmax(-1) @ vh).transpose(1, 2), lse


def _inputs(S=150, D=16, Hq=4, Hkv=2, grad=False):
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    return [torch.randn(1, h, S, D, generator=g, dtype=torch.float64, requires_grad=grad) for h in (Hq, Hkv, Hkv)]


@pytest.mark.parametrize("pattern", [
    get_pattern("dense"), get_pattern("sliding_window", window=40), get_pattern("sliding_window", window=1),
])
def test_fa4_forward_computes_the_pattern(pattern):
    q, k, v = _inputs()
    window_size, same = fa4_baseline.fa4_counterpart(pattern)
    assert same is pattern
    out, call = fa4_baseline.fa4_forward(fa4_like, q, k, v, scale=0.3, window_size=window_size)
    ref, _ = reference_attention(q, k, v, pattern, row_geometry(1, 150, 150, None), scale=0.3)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(call()[0].transpose(1, 2), out, rtol=0, atol=0)  # the timed call is the same launch


def test_streaming_is_compared_with_fa4_sliding_window_of_the_same_window():
    streaming = get_pattern("streaming", window=40, sinks=8)
    window_size, fa4_pattern = fa4_baseline.fa4_counterpart(streaming)
    assert fa4_pattern == get_pattern("sliding_window", window=40)
    q, k, v = _inputs()
    out, _ = fa4_baseline.fa4_forward(fa4_like, q, k, v, scale=0.3, window_size=window_size)
    geo = row_geometry(1, 150, 150, None)
    sliding, _ = reference_attention(q, k, v, fa4_pattern, geo, scale=0.3)
    with_sinks, _ = reference_attention(q, k, v, streaming, geo, scale=0.3)
    torch.testing.assert_close(out, sliding, rtol=1e-10, atol=1e-10)
    assert (out - with_sinks).abs().max() > 1e-3  # not streaming itself: the row says so (``fa4_runs``)


@pytest.mark.parametrize("pattern", [
    get_pattern("block_diagonal", block=32), get_pattern("dilated", window=16, scales=2),
    get_pattern("bigbird", block=16), get_pattern("sliding_window", window=40, causal=False),
])
def test_patterns_fa4_cannot_express_have_no_counterpart(pattern):
    assert fa4_baseline.fa4_counterpart(pattern) is None


def test_fa4_gradients_come_back_in_our_layout():
    pattern = get_pattern("sliding_window", window=33)
    q, k, v = _inputs(S=97, grad=True)
    ref, _ = reference_attention(q, k, v, pattern, row_geometry(1, 97, 97, None), scale=0.25)
    do = torch.randn_like(ref)
    ours = torch.autograd.grad(ref, (q, k, v), do)
    window_size, _ = fa4_baseline.fa4_counterpart(pattern)
    grads, call = fa4_baseline.fa4_backward(fa4_like, q, k, v, do, scale=0.25, window_size=window_size)
    for got, want in zip(grads, ours):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert all(torch.equal(a.transpose(1, 2), b) for a, b in zip(call(), grads))
    assert q.grad is None  # FA4 ran on copies: the inputs' own gradients are untouched


def test_a_missing_fa4_is_a_sentence_not_an_exception(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_flash_attn(name, *args, **kwargs):
        if name.startswith("flash_attn"):
            raise ModuleNotFoundError("No module named 'flash_attn'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(fa4_baseline, "_FA4", None)
    monkeypatch.setattr(builtins, "__import__", no_flash_attn)
    reason = fa4_baseline.load_fa4()
    assert isinstance(reason, str) and reason.startswith("FA4 not importable") and "flash_attn" in reason
