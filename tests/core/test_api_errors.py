"""Bad input gets a clear ValueError/TypeError that names the offending value and what is allowed."""

import pytest
import torch
from helpers import random_qkv

import sparse_k as sk


def _qkv():
    return random_qkv(2, 4, 2, 8, 8, 16)


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, r"`q` must be 4-D .*\(4, 8, 16\)"),
        (lambda q, k, v: (q, k[:, :, :5], v), ValueError, "must agree in"),
        (lambda q, k, v: (q, k[..., :8], v), ValueError, "head dims differ: 16 vs 8"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch sizes differ"),
        (lambda q, k, v: (q.to(torch.int32), k, v), TypeError, "float16, bfloat16, float32 or float64, got torch.int32"),
        (lambda q, k, v: (q.half(), k, v), TypeError, "must share a dtype"),
        (lambda q, k, v: (q.to("meta"), k, v), ValueError, "one device"),
        (lambda q, k, v: (q.numpy(), k, v), TypeError, "must be a torch.Tensor"),
    ],
)
def test_bad_tensors(make, exc, words):
    q, k, v = make(*_qkv())
    with pytest.raises(exc, match=words):
        sk.sparse_attention(q, k, v, "dense")


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"pattern": "swa"}, ValueError, "unknown pattern 'swa'; available: dense, sliding_window"),
        ({"pattern": sk.SlidingWindow} , TypeError, "pattern must be"),
        ({"attention_mask": torch.ones(2, 7, dtype=torch.bool)}, ValueError, r"\(B, Skv\) = \(2, 8\), got shape \(2, 7\)"),
        ({"attention_mask": torch.ones(2, 1, 8, 8, dtype=torch.bool)}, ValueError, "must be 2-D"),
        ({"attention_mask": torch.ones(2, 8)}, TypeError, "bool or integer"),
        ({"sink_logits": torch.zeros(2)}, ValueError, r"shape \(4,\)"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"scale": 0}, ValueError, "scale"),
        ({"layer_idx": -1}, ValueError, "layer_idx"),
        ({"backend": "cuda"}, ValueError, "unknown backend 'cuda'"),
        ({"causal": "yes"}, TypeError, "causal"),
        ({"pattern": "streaming", "causal": False}, ValueError, "no bidirectional version"),
        ({"cu_seqlens_q": torch.tensor([0, 8])}, ValueError, "both cu_seqlens_q and cu_seqlens_k"),
        ({"q_start": torch.zeros(3, dtype=torch.long)}, ValueError, "q_start"),
        ({"selection": "top"}, TypeError, "TokenLayout"),
        ({"scale": float("nan")}, ValueError, "`scale` must be a positive finite number or None, got nan"),
        ({"scale": float("inf")}, ValueError, "`scale` must be a positive finite number"),
        ({"softcap": float("nan")}, ValueError, "`softcap` must be a positive finite number or None, got nan"),
        ({"softcap": float("inf")}, ValueError, "`softcap` must be a positive finite number"),
        ({"q_start": 1000}, ValueError, r"`q_start` .* must lie in \[-Sq, Skv - Sq\] = \[-8, 0\] .*got 1000"),
        ({"q_start": -9}, ValueError, r"= \[-8, 0\] .*got -9"),
    ],
)
def test_bad_options(kwargs, exc, words):
    q, k, v = _qkv()
    pattern = kwargs.pop("pattern", "sliding_window")
    with pytest.raises(exc, match=words):
        sk.sparse_attention(q, k, v, pattern, **kwargs)


def test_numpy_scale_and_softcap_are_numbers():
    """A numpy float32 (a real number, not a Python float) is a scale / softcap like its float value, not refused
    as "not a positive finite number"."""
    np = pytest.importorskip("numpy")
    q, k, v = _qkv()
    want = sk.sparse_attention(q, k, v, "dense", scale=0.5, softcap=3.0)
    got = sk.sparse_attention(q, k, v, "dense", scale=np.float32(0.5), softcap=np.float32(3.0))
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="`scale` must be a positive finite number or None"):
        sk.sparse_attention(q, k, v, "dense", scale=np.float32(-0.5))


def test_non_positive_window_is_rejected_through_the_api():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="`window` must be >= 1, got 0"):
        sk.sparse_attention(q, k, v, {"pattern": "sliding_window", "window": 0})


def test_zero_head_dim_is_a_value_error():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="head dims must be >= 1, got D=0"):
        sk.sparse_attention(q[..., :0], k[..., :0], v[..., :0], "dense")
    with pytest.raises(ValueError, match="head dims must be >= 1, got D=16 for q and k, 0 for v"):
        sk.sparse_attention(q, k, v[..., :0], "dense")


def test_q_start_inside_the_range_is_accepted():
    """The bounds themselves: the queries end at the last key, or (Sq > Skv) start before key 0 as bottom-right does."""
    q, k, v = random_qkv(1, 2, 1, 4, 8, 8, dtype=torch.float64)
    for q_start in (0, 4, torch.tensor([4])):
        out = sk.sparse_attention(q, k, v, "dense", q_start=q_start, backend="reference")
        ref = sk.sparse_attention(q, k[:, :, : int(q_start) + 4], v[:, :, : int(q_start) + 4], "dense", backend="reference")
        assert (out - ref).abs().max() < 1e-12
    assert sk.sparse_attention(q, k[:, :, :2], v[:, :, :2], "dense", q_start=-4).shape == q.shape


def test_selection_must_belong_to_the_pattern():
    """A selection changed a non-learned pattern's output without a word, and one built for another query_block or
    top_k was taken as is."""
    q, k, v = random_qkv(1, 2, 1, 40, 40, 16)
    built_for = sk.SparseK(sinks=2, window=8, top_k=6, query_block=16)
    sel = sk.build_selection(built_for, q, k, v, sk.row_geometry(1, 40, 40), layer_idx=0)
    assert sk.sparse_attention(q, k, v, built_for, selection=sel).shape == q.shape
    with pytest.raises(ValueError, match="only for the learned patterns sparse_k and dsa, got pattern 'sliding_window'"):
        sk.sparse_attention(q, k, v, sk.SlidingWindow(window=8), selection=sel)
    with pytest.raises(ValueError, match="query_block=16, the pattern query_block=8"):
        sk.sparse_attention(q, k, v, built_for.replace(query_block=8), selection=sel)
    with pytest.raises(ValueError, match="holds 6 keys per block .*top_k=4"):
        sk.sparse_attention(q, k, v, built_for.replace(top_k=4), selection=sel)
    # One block shared by every query of the call (what SparseCache passes) may be longer than the pattern's.
    one = sk.TokenLayout(sel.indices[:, :, 1:2], sel.counts[:, :, 1:2], 1 << 30, torch.zeros(1, dtype=torch.int64))
    assert sk.sparse_attention(q[:, :, 16:32], k[:, :, :32], v[:, :, :32], built_for, selection=one).shape == (1, 2, 16, 16)


def test_packed_sequences_need_batch_one_and_matching_offsets():
    q, k, v = _qkv()
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="B == 1"):
        sk.sparse_attention(q, k, v, "dense", cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="rise from 0 to 8"):
        sk.sparse_attention(q[:1], k[:1], v[:1], "dense", cu_seqlens_q=torch.tensor([0, 9]), cu_seqlens_k=cu)
    empty = torch.tensor([], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"`cu_seqlens_q` must hold N \+ 1 >= 2 offsets .*got \[\]"):
        sk.sparse_attention(q[:1], k[:1], v[:1], "dense", cu_seqlens_q=empty, cu_seqlens_k=empty)


def test_learned_pattern_without_selection_warns_once():
    q, k, v = _qkv()
    sk.warn._WARNED.clear()
    with pytest.warns(UserWarning, match="without a selection"):
        sk.sparse_attention(q, k, v, sk.SparseK(sinks=2, window=4, top_k=3), backend="torch")


def test_reference_refuses_a_dense_mask_it_cannot_hold():
    """At 40K tokens the reference used to be killed by the OS (no Python error): now a ValueError
    up front, from expanded inputs that take no memory."""
    S = 40_000
    q = torch.zeros(1, 1, 1, 64).expand(1, 32, S, 64)
    kv = torch.zeros(1, 1, 1, 64).expand(1, 8, S, 64)
    with pytest.raises(ValueError, match=r"1 x 32 x 40000 x 40000 = 51,200,000,000 entries \(409.6 GB each\).*backend='torch'"):
        sk.sparse_attention(q, kv, kv, "streaming", backend="reference")
    limit = sk.attention.reference.REFERENCE_MAX_ENTRIES
    sk.attention.reference.check_reference_size(1, 1, 1 << 14, limit >> 14)  # at the limit: accepted
    with pytest.raises(ValueError, match="over its limit"):
        sk.attention.reference.check_reference_size(1, 1, 1 << 14, (limit >> 14) + 1)
    small = torch.randn(1, 2, 5, 8)
    out = sk.sparse_attention(small, small, small, "dense", backend="reference")
    assert out.shape == small.shape


@pytest.mark.parametrize(
    "kwargs,exc,words",
    [
        ({"block_q": 0}, ValueError, "`block_q` must be >= 1, got 0"),
        ({"block_k": -16}, ValueError, "`block_k` must be >= 1, got -16"),
        ({"block_q": 64.0}, TypeError, "`block_q` must be an int, got float (64.0)"),
        ({"block_k": True}, TypeError, "`block_k` must be an int, got bool (True)"),
        ({"pattern": "sliding_window"}, TypeError, "`pattern` must be a Pattern"),
        ({"pattern": {"pattern": "streaming"}}, TypeError, "got dict"),
    ],
)
def test_build_block_layout_names_a_bad_argument(kwargs, exc, words):
    """The public layout builder names a bad block size or a pattern given by name (not a ZeroDivisionError or an
    AttributeError from inside the build)."""
    args = {"pattern": sk.SlidingWindow(window=4), "block_q": 16, "block_k": 16, **kwargs}
    pattern = args.pop("pattern")
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(")", r"\)")):
        sk.build_block_layout(pattern, 32, 32, sk.row_geometry(1, 32, 32), **args)


def test_q_start_of_the_wrong_shape_names_the_batch_size():
    """The allowed shapes are said once: ``(1,)`` for batch 1, ``(B,) or (1,)`` otherwise, with the batch size."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^`q_start` must be an int or an int tensor of shape \(1,\) \(batch size 1\), "
                                         r"got shape \(2,\)$"):
        sk.sparse_attention(q[:1], k[:1], v[:1], "dense", q_start=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=r"^`q_start` must be an int or an int tensor of shape \(2,\) or \(1,\) "
                                         r"\(batch size 2\), got shape \(3,\)$"):
        sk.sparse_attention(q, k, v, "dense", q_start=torch.zeros(3, dtype=torch.long))
