"""Pattern configurations: validation, defaults, dict round trips and the element rules of design §4."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from helpers import BIDIRECTIONAL, FIXED, random_pattern

import sparse_k as sk


def test_available_patterns_lists_every_pattern_of_the_design():
    assert sk.available_patterns() == [
        "dense", "sliding_window", "streaming", "block_diagonal", "bigbird", "dilated", "l2_aligned", "sparse_k", "dsa",
    ]


@pytest.mark.parametrize("name", sk.available_patterns())
def test_defaults_build_and_round_trip_through_dict(name):
    p = sk.get_pattern(name)
    assert p.name == name and p.causal is True
    assert sk.pattern_from_dict(p.to_dict()) == p
    assert hash(p) == hash(sk.pattern_from_dict(p.to_dict()))


@pytest.mark.parametrize(
    "name, kwargs, exc, words",
    [
        ("sliding_window", {"window": 0}, ValueError, "window"),
        ("sliding_window", {"window": -3}, ValueError, ">= 1"),
        ("sliding_window", {"window": 2.5}, TypeError, "window"),
        ("sliding_window", {"window": True}, TypeError, "window"),
        ("streaming", {"sinks": -1}, ValueError, "sinks"),
        ("streaming", {"causal": False}, ValueError, "bidirectional"),
        ("block_diagonal", {"block": 0}, ValueError, "block"),
        ("bigbird", {"random_blocks": -1}, ValueError, "random_blocks"),
        ("dilated", {"scales": 0}, ValueError, "scales"),
        ("dilated", {"scales": 31}, ValueError, "scales"),
        ("l2_aligned", {"segment": 64, "anchor": 65}, ValueError, "anchor"),
        ("sparse_k", {"top_k": -1}, ValueError, "top_k"),
        ("dsa", {"indexer_heads": 0}, ValueError, "indexer_heads"),
        ("sliding_window", {"windw": 3}, ValueError, "windw"),
    ],
)
def test_bad_parameters_name_the_value(name, kwargs, exc, words):
    with pytest.raises(exc, match=words):
        sk.get_pattern(name, **kwargs)


def _int_fields(name):
    """``{field: its default}`` of pattern ``name``'s integer parameters (a default of ``segment``: 256)."""
    p = sk.get_pattern(name)
    ints = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name != "causal"}
    return {k: 256 if v is None else v for k, v in ints.items()}


@pytest.mark.parametrize("name", sk.available_patterns())
@pytest.mark.parametrize("numpy_int", [np.int64, np.int32, np.uint16])
def test_numpy_integer_parameters_are_stored_as_python_ints(name, numpy_int):
    """Every integer parameter takes a numpy integer (as ``configure`` and ``flash_attn_func``'s ``window_size`` do) and
    keeps it as the Python int it holds: the pattern equals (and hashes as) the one built from ints, and its dict is
    JSON."""
    ints = _int_fields(name)
    p = sk.get_pattern(name, **{k: numpy_int(v) for k, v in ints.items()})
    assert p == sk.get_pattern(name, **ints) and hash(p) == hash(sk.get_pattern(name, **ints))
    assert all(type(getattr(p, k)) is int for k in ints)
    assert sk.pattern_from_dict(json.loads(json.dumps(p.to_dict()))) == p
    for k in list(ints)[:1]:  # replace() too
        assert type(p.replace(**{k: numpy_int(1)}).to_dict()[k]) is int


@pytest.mark.parametrize("value", [np.bool_(True), np.float64(3.0), torch.tensor(3)])
def test_integer_parameters_refuse_numpy_bools_floats_and_tensors(value):
    with pytest.raises(TypeError, match=rf"sliding_window: `window` must be an int, got {type(value).__name__}"):
        sk.SlidingWindow(window=value)


def test_resolve_l2_segment_takes_numpy_integers():
    p = sk.get_pattern("l2_aligned")
    r = sk.resolve_l2_segment(p, kv_bytes_per_token=np.int64(4096), l2_bytes=50 * 2**20)
    assert r == sk.resolve_l2_segment(p, kv_bytes_per_token=4096, l2_bytes=50 * 2**20) and type(r.segment) is int


@pytest.mark.parametrize(
    "name, kwargs, words",
    [
        ("sliding_window", {"window": 2**63}, "`window` must be <= 4611686018427387904"),
        ("sliding_window", {"window": 10**30}, "`window` must be <="),
        ("block_diagonal", {"block": 2**63}, "`block` must be <="),
        ("streaming", {"sinks": 2**63}, r"`sinks` must be <= 9223372036854775807"),
        ("bigbird", {"random_blocks": 10**6}, "`random_blocks` must be <= 4096"),
        ("bigbird", {"block": 2**40, "global_blocks": 2**30}, r"block \* global_blocks"),
        ("bigbird", {"block": 2**40, "window_blocks": 2**30}, r"block \* \(window_blocks \+ 1\)"),
        ("dilated", {"window": 2**40, "scales": 30}, r"window \* 2\*\*\(scales - 1\)"),
        ("l2_aligned", {"block": 2**40, "window_blocks": 2**30}, r"block \* window_blocks"),
        ("sparse_k", {"top_k": 2**40, "refine": 2**30}, r"refine \* top_k"),
        ("dsa", {"query_block": 2**62 + 1}, "`query_block` must be <="),
    ],
)
def test_int_parameters_have_an_upper_bound(name, kwargs, words):
    """Past int64 a value wrapped (window=2**63 selected other keys than dense; block=2**63 split the PyTorch path
    from the reference), and bigbird's draws cost random_blocks squared (10**6 hung)."""
    with pytest.raises(ValueError, match=words):
        sk.get_pattern(name, **kwargs)


@pytest.mark.parametrize("name, kwargs", [
    ("sliding_window", {"window": 2**62}), ("block_diagonal", {"block": 2**62}), ("streaming", {"sinks": 2**63 - 1}),
    ("bigbird", {"block": 16, "random_blocks": 4096, "window_blocks": 2**40}), ("dilated", {"window": 2**33, "scales": 30}),
])
def test_largest_int_parameters_select_what_the_sequence_allows(name, kwargs):
    """At the bounds a window / block past the sequence is dense causal attention, on both exact paths."""
    q, k, v = (torch.randn(1, h, 20, 8, dtype=torch.float64) for h in (2, 1, 1))
    p = sk.get_pattern(name, **kwargs)
    dense = sk.sparse_attention(q, k, v, "dense", backend="reference")
    for backend in ("reference", "torch"):
        assert (sk.sparse_attention(q, k, v, p, backend=backend) - dense).abs().max() < 1e-12, (p, backend)


def test_learned_patterns_refuse_selector_and_point_to_selector_path():
    """``selector=`` was a field nothing read: a file named there was silently ignored."""
    for make in (lambda: sk.DSA(selector="/nonexistent"), lambda: sk.get_pattern("sparse_k", selector="w.safetensors"),
                 lambda: sk.pattern_from_dict({"pattern": "dsa", "selector": "w.safetensors"})):
        with pytest.raises(TypeError, match="selector_path"):
            make()
    assert sk.get_pattern("sparse_k", selector=None) == sk.SparseK()  # a config written with "selector": null loads
    assert "selector" not in sk.DSA().to_dict()


def test_unknown_pattern_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown pattern 'swa'.*sliding_window"):
        sk.get_pattern("swa")
    with pytest.raises(TypeError, match="pattern must be"):
        sk.get_pattern(3)


def _brute(p, i, j):
    """Design §4 written out for one (i, j) pair, independently of the vectorised rules."""
    if p.causal and j > i:
        return False
    d = i - j
    if isinstance(p, sk.Dense):
        return True
    if isinstance(p, sk.SlidingWindow):
        return d < p.window if p.causal else abs(d) <= p.window
    if isinstance(p, (sk.Streaming,)):
        return j < p.sinks or d < p.window
    if isinstance(p, sk.BlockDiagonal):
        return i // p.block == j // p.block
    if isinstance(p, sk.Dilated):
        return any(abs(d) % (1 << s) == 0 and abs(d) < p.window * (1 << s) for s in range(p.scales))
    if isinstance(p, sk.L2Aligned):
        return i // p.block - p.window_blocks < j // p.block or j % p.segment < p.anchor
    raise AssertionError(p)


@pytest.mark.parametrize("name", ["dense", "sliding_window", "streaming", "block_diagonal", "dilated", "l2_aligned"])
@pytest.mark.parametrize("causal", [True, False])
def test_element_rule_matches_the_design_table(name, causal):
    if not causal and name not in BIDIRECTIONAL:
        pytest.skip("no bidirectional version")
    for _ in range(5):
        p = random_pattern(name, causal=causal, max_len=64)
        i = torch.arange(70).view(-1, 1)
        j = torch.arange(70).view(1, -1)
        got = p.allowed(i, j, kv_len=70)
        want = torch.tensor([[_brute(p, a, b) for b in range(70)] for a in range(70)])
        assert torch.equal(got, want), p


def test_bidirectional_sliding_window_matches_transformers():
    masking_utils = pytest.importorskip("transformers.masking_utils")
    fn = masking_utils.sliding_window_bidirectional_overlay(5)
    p = sk.SlidingWindow(window=5, causal=False)
    for i in range(20):
        for j in range(20):
            assert bool(p.allowed(torch.tensor(i), torch.tensor(j))) == bool(fn(0, 0, i, j))


def test_bigbird_random_blocks_are_deterministic_distinct_and_outside_window_and_globals():
    p = sk.BigBird(block=16, window_blocks=1, global_blocks=2, random_blocks=3, seed=5)
    t1 = p.random_table(layer_idx=3, num_kv_heads=4, num_q_blocks=40)
    t2 = p.random_table(layer_idx=3, num_kv_heads=4, num_q_blocks=40)
    assert torch.equal(t1, t2)
    assert not torch.equal(t1, p.random_table(layer_idx=4, num_kv_heads=4, num_q_blocks=40))
    for h in range(4):
        for qb in range(40):
            picks = [x for x in t1[h, qb].tolist() if x >= 0]
            cands = [kb for kb in range(2, qb - 1)]  # not global (kb<2), not window (qb-1..qb)
            assert len(set(picks)) == len(picks) == min(3, len(cands))
            assert set(picks) <= set(cands)
    # Decode equals recompute: the table for a prefix of query blocks is a prefix of the table
    # (the cache relies on it: it builds for more query blocks and slices).
    from sparse_k.layouts.patterns import _bigbird_random_table

    assert torch.equal(p.random_table(3, 4, 10), t1[:, :10])
    assert torch.equal(_bigbird_random_table(p, 3, 4, 10, None, None), t1[:, :10])
    assert torch.equal(_bigbird_random_table(p, 3, 4, 40, None, None), t1)
    b = sk.BigBird(block=16, window_blocks=1, global_blocks=2, random_blocks=3, seed=5, causal=False)
    assert torch.equal(b.random_table(3, 4, 7, num_k_blocks=40), _bigbird_random_table(b, 3, 4, 7, 40, None))
    assert torch.equal(b.random_table(3, 4, 40), _bigbird_random_table(b, 3, 4, 40, None, None))


def test_bigbird_random_table_inside_a_compiled_graph_is_not_cached():
    """A table made inside a torch.compile trace may live in a CUDA graph's pool (reduce-overhead), which
    the next replay overwrites: it is computed there (the same values) and never enters the global cache."""
    from sparse_k.layouts import patterns

    p = sk.BigBird(block=16, window_blocks=1, global_blocks=2, random_blocks=3, seed=11)
    patterns._RANDOM_TABLES.clear()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: p.random_table(2, 4, 9) + x, backend="eager", fullgraph=True)
    out = compiled(torch.zeros((), dtype=torch.int64))
    assert patterns._RANDOM_TABLES == {}
    assert torch.equal(out, p.random_table(2, 4, 9))  # eager: cached, same values
    assert len(patterns._RANDOM_TABLES) == 1


def test_l2_aligned_default_anchor_longer_than_the_segment_is_named():
    """``L2Aligned(block=4, segment=10)`` keeps the default anchor of 64, longer than its segment (the anchors are the
    first ``anchor`` keys of each segment): the error names the anchor, the default and what is allowed."""
    with pytest.raises(ValueError, match=r"l2_aligned: `anchor` \(64; the default is 64\) must be in \[0, segment\] = \[0, 10\]"):
        sk.L2Aligned(block=4, segment=10)
    with pytest.raises(ValueError, match=r"`anchor` \(65; the default is 64\) must be in \[0, segment\] = \[0, 64\]"):
        sk.L2Aligned(segment=64, anchor=65)
    assert sk.L2Aligned(block=4, segment=10, anchor=10).allowed(torch.tensor(99), torch.arange(100)).all()


def test_l2_segment_is_resolved_once_and_stored():
    p = sk.get_pattern("l2_aligned")
    assert p.segment is None
    r = sk.resolve_l2_segment(p, kv_bytes_per_token=2 * 8 * 128 * 2, l2_bytes=50 * 2**20)
    assert r.segment % r.block == 0 and r.segment * 2 * 8 * 128 * 2 <= 25 * 2**20
    assert sk.pattern_from_dict(r.to_dict()).segment == r.segment
    with pytest.raises(ValueError, match="segment"):
        p.allowed(torch.tensor(3), torch.tensor(1))


@pytest.mark.parametrize("name", FIXED)
def test_key_intervals_cover_every_allowed_key(name):
    for _ in range(5):
        p = random_pattern(name, max_len=96)
        q_lo = torch.arange(0, 96, 7)
        q_hi = q_lo + 6
        lo, hi = p.key_intervals(q_lo, q_hi, layer_idx=1, num_kv_heads=2, kv_len=200)
        for h in range(lo.shape[0]):
            for t in range(len(q_lo)):
                covered = torch.zeros(200, dtype=torch.bool)
                for a, b in zip(lo[h, t].tolist(), hi[h, t].tolist()):
                    if a <= b:
                        covered[max(a, 0) : min(b, 199) + 1] = True
                q = torch.arange(int(q_lo[t]), int(q_hi[t]) + 1).view(-1, 1)
                allowed = p.allowed(q, torch.arange(200).view(1, -1), 1, h, 200).any(0)
                assert not (allowed & ~covered).any(), (p, h, t)
