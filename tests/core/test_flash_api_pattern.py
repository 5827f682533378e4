"""``flash_api`` with ``pattern=``: the pattern keeps its own causality unless ``causal=True`` asks for a causal one
(FlashAttention's default ``causal=False`` changes nothing)."""

import sparse_k
import torch


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 19, h, 8, generator=g) for h in (4, 2, 2)]  # (B, S, H, D), GQA 2


def _ref(q, k, v, pattern):
    """The exact reference (float64) in ``(B, S, H, D)``."""
    out = sparse_k.sparse_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), pattern, backend="reference")
    return out.transpose(1, 2)


def test_causal_true_makes_a_bidirectional_pattern_causal():
    q, k, v = _inputs(0)
    two_way = {"pattern": "sliding_window", "window": 5, "causal": False}
    out = sparse_k.flash_attn_func(q, k, v, causal=True, pattern=two_way, backend="torch")
    want = _ref(q, k, v, sparse_k.SlidingWindow(window=5, causal=True))
    assert (out - want).abs().max() < 1e-5
    kept = sparse_k.flash_attn_func(q, k, v, pattern=two_way, backend="torch")  # causal=False: the pattern's own
    assert (kept - _ref(q, k, v, sparse_k.SlidingWindow(window=5, causal=False))).abs().max() < 1e-5
    assert (kept - out).abs().max() > 1e-2


def test_a_causal_pattern_stays_causal_under_the_default():
    q, k, v = _inputs(1)
    out = sparse_k.flash_attn_func(q, k, v, pattern=sparse_k.Streaming(sinks=2, window=6), backend="torch")
    assert (out - _ref(q, k, v, sparse_k.Streaming(sinks=2, window=6))).abs().max() < 1e-5
