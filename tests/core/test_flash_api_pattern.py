"""``flash_api`` with ``pattern=``: the pattern keeps its own causality unless ``causal=True`` asks for a causal one
(FlashAttention's default ``causal=False`` changes nothing). ``flash_attn_with_kvcache`` checks its cache lengths and
new keys with errors that name the value."""

import numpy as np
import pytest
import sparse_k
import torch
from sparse_k.flash_api import _cache_lengths


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


def _cache_inputs():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 1, 4, 8, generator=g)  # (B, Sq, Hq, D)
    kc, vc = (torch.randn(2, 16, 2, 8, generator=g) for _ in range(2))  # 16 slots
    return q, kc, vc


@pytest.mark.parametrize("lens, exc, words", [
    (17, ValueError, r"`cache_seqlens` must lie in \[0, 16\] \(a cache of 16 slots\), got 17"),
    (-1, ValueError, r"must lie in \[0, 16\] .*got -1"),
    (torch.tensor([3, 17]), ValueError, r"must lie in \[0, 16\] .*got \[3, 17\]"),
    (torch.tensor([3.0, 4.0]), TypeError, "`cache_seqlens` must hold integers, got dtype torch.float32"),
    (torch.tensor([3]), ValueError, r"`cache_seqlens` must have shape \(2,\) .*got \(1,\)"),
    (np.array([3, 4]), TypeError, r"`cache_seqlens` must be an int or an integer tensor of shape \(2,\), got ndarray"),
    (True, TypeError, "got a bool"),
])
def test_kvcache_lengths_are_checked(lens, exc, words):
    """Lengths past the cache read keys that are not there (RuntimeError or a wrong answer); a float or numpy array
    failed with a raw RuntimeError / AttributeError."""
    q, kc, vc = _cache_inputs()
    with pytest.raises(exc, match=words):
        sparse_k.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)


def test_kvcache_new_keys_must_fit_and_match_the_cache():
    q, kc, vc = _cache_inputs()
    kn, vn = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
    with pytest.raises(ValueError, match=r"must lie in \[0, 15\] \(a cache of 16 slots, 1 of them for the new keys\)"):
        sparse_k.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=16)
    with pytest.raises(TypeError, match=r"`k` \(torch.float64 on cpu\) must have the dtype and device of its cache"):
        sparse_k.flash_attn_with_kvcache(q, kc, vc, kn.double(), vn.double(), cache_seqlens=3)
    with pytest.raises(ValueError, match=r"`v` must have shape .*\(2, 1, 2, 8\)"):
        sparse_k.flash_attn_with_kvcache(q, kc, vc, kn, vn[:, :, :1], cache_seqlens=3)
    with pytest.raises(ValueError, match="k and v must be given together"):
        sparse_k.flash_attn_with_kvcache(q, kc, vc, kn, None, cache_seqlens=3)


def test_kvcache_lengths_at_the_bounds_match_the_reference():
    """0 and the full cache (an int, numpy integer or tensor) are accepted and attend to exactly those keys."""
    q, kc, vc = _cache_inputs()
    for lens in (16, np.int64(16), torch.tensor([16, 5], dtype=torch.int32), torch.tensor([0, 9])):
        out = sparse_k.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, backend="torch")
        for b, n in enumerate(torch.as_tensor(lens).expand(2).tolist()):
            if n == 0:  # no key: FlashAttention's zeros
                assert out[b].abs().max() == 0
                continue
            want = _ref(q[b : b + 1], kc[b : b + 1, :n], vc[b : b + 1, :n], sparse_k.Dense(causal=True))
            assert (out[b : b + 1] - want).abs().max() < 1e-5


@pytest.mark.gpu
def test_kvcache_lengths_on_cuda_are_not_read_without_new_keys():
    """A CUDA tensor is checked for dtype and shape only: its values stay on the device (no host synchronisation)."""
    lens = torch.tensor([3, 99], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _cache_lengths(lens, 2, 16, 0, lens.device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.dtype == torch.int64 and out.device == lens.device
    with pytest.raises(ValueError, match="got \\[3, 99\\]"):  # with new keys written the values are checked
        _cache_lengths(lens, 2, 16, 1, lens.device)


def _flash_calls():
    """``{name: call(**kwargs)}`` of the three FlashAttention-style functions on small CPU inputs."""
    q, k, v = _inputs(3)
    cu = torch.tensor([0, 19], dtype=torch.int32)
    qc, kc, vc = _cache_inputs()
    return {
        "flash_attn_func": lambda **kw: sparse_k.flash_attn_func(q, k, v, backend="torch", **kw),
        "flash_attn_varlen_func": lambda **kw: sparse_k.flash_api.flash_attn_varlen_func(
            q[0], k[0], v[0], cu, cu, 19, 19, backend="torch", **kw),
        "flash_attn_with_kvcache": lambda **kw: sparse_k.flash_attn_with_kvcache(qc, kc, vc, cache_seqlens=5,
                                                                                 backend="torch", **kw),
    }


@pytest.mark.parametrize("fn", ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"])
@pytest.mark.parametrize("window", [(2.7, 0), (2.0, 0), (True, 0), (2, False), ("2", 0)])
def test_window_size_entries_must_be_integers(fn, window):
    """``int()`` truncated a float (2.7 ran as window 2) and took a bool or a digit string."""
    with pytest.raises(TypeError, match=r"`window_size` entries must be integers \(-1: unbounded\), got "):
        _flash_calls()[fn](causal=True, window_size=window)


def test_window_size_takes_numpy_integers():
    q, k, v = _inputs(4)
    out = sparse_k.flash_attn_func(q, k, v, causal=True, window_size=(np.int64(3), 0), backend="torch")
    assert (out - _ref(q, k, v, sparse_k.SlidingWindow(window=4))).abs().max() < 1e-5


@pytest.mark.parametrize("fn, flag", [("flash_attn_func", "return_attn_probs"),
                                      ("flash_attn_varlen_func", "return_attn_probs"),
                                      ("flash_attn_with_kvcache", "return_softmax_lse")])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_return_flags_must_be_bools(fn, flag, value):
    with pytest.raises(TypeError, match=rf"`{flag}` must be a bool, got {type(value).__name__}"):
        _flash_calls()[fn](**{flag: value})


@pytest.mark.parametrize("fn", ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"])
@pytest.mark.parametrize("value", ["no", 0, None, np.bool_(True)])
def test_causal_must_be_a_bool(fn, value):
    """``bool(causal)`` ran ``causal="no"`` as causal and ``causal=None`` as bidirectional."""
    with pytest.raises(TypeError, match=rf"{fn}: `causal` must be a bool, got {type(value).__name__}"):
        _flash_calls()[fn](causal=value)


def test_with_kvcache_checks_causal_before_writing_the_cache():
    q, kc, vc = _cache_inputs()
    k_new, v_new = torch.ones_like(kc[:, :1]), torch.ones_like(vc[:, :1])
    before = kc.clone()
    with pytest.raises(TypeError, match="`causal` must be a bool"):
        sparse_k.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=2, causal="yes", backend="torch")
    assert torch.equal(kc, before)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_sparse_attention_return_lse_must_be_a_bool(value):
    q, k, v = (t.transpose(1, 2) for t in _inputs(5))
    with pytest.raises(TypeError, match=rf"`return_lse` must be a bool, got {type(value).__name__}"):
        sparse_k.sparse_attention(q, k, v, "dense", return_lse=value)
