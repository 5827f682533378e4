"""Block layouts: to_dense() equals the design §4 mask element by element, building is
proportional to the visited tiles, caching, and FlexAttention BlockMask interop."""

import warnings

import pytest
import torch
from helpers import BIDIRECTIONAL, FIXED, left_padding_mask, random_pattern
from hypothesis import given, settings
from hypothesis import strategies as st

import sparse_k as sk
from sparse_k.attention.reference import pattern_mask


def _check(p, B, Sq, Skv, bq, bk, mask, q_start=None, Hkv=2, layer=1):
    g = sk.row_geometry(B, Sq, Skv, mask, q_start)
    lay = sk.build_block_layout(p, Sq, Skv, g, block_q=bq, block_k=bk, layer_idx=layer, num_kv_heads=Hkv, cache=False)
    want, _ = pattern_mask(p, g, Sq, Skv, num_kv_heads=Hkv, layer_idx=layer)
    got = lay.to_dense()
    assert got.shape == want.shape
    assert torch.equal(got, want), (p, B, Sq, Skv, bq, bk)
    return lay


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(FIXED + ["sparse_k"]),
    seed=st.integers(0, 10_000),
    sq=st.integers(1, 150),
    extra_kv=st.integers(0, 80),
    bq=st.sampled_from([1, 8, 16, 32, 64]),
    bk=st.sampled_from([4, 16, 32, 64]),
    padded=st.booleans(),
)
def test_to_dense_equals_the_pattern_mask(name, seed, sq, extra_kv, bq, bk, padded):
    rng = torch.Generator().manual_seed(seed)
    p = random_pattern(name, rng, max_len=sq + extra_kv)
    skv = sq + extra_kv
    mask = left_padding_mask(3, skv, rng) if padded else None
    _check(p, 3 if padded else 1, sq, skv, bq, bk, mask)


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(BIDIRECTIONAL), seed=st.integers(0, 10_000), s=st.integers(1, 120), bq=st.sampled_from([8, 16, 32]))
def test_to_dense_bidirectional(name, seed, s, bq):
    rng = torch.Generator().manual_seed(seed)
    _check(random_pattern(name, rng, causal=False, max_len=s), 1, s, s, bq, bq, None)


@pytest.mark.parametrize("name", FIXED)
def test_odd_lengths_and_explicit_query_start(name):
    p = random_pattern(name, torch.Generator().manual_seed(1), max_len=200)
    for sq, skv in [(1, 1), (63, 63), (113, 203), (1, 1000), (16, 4097)]:
        _check(p, 1, sq, skv, 32, 64, None)
    # A static cache: 150 slots, 90 valid keys, the last 7 queries sit at positions 83..89.
    mask = torch.zeros(2, 150, dtype=torch.bool)
    mask[:, :90] = True
    _check(p, 2, 7, 150, 16, 16, mask, q_start=83)


def test_full_tiles_exist_and_skip_nothing():
    g = sk.row_geometry(1, 1024, 1024)
    lay = sk.build_block_layout(sk.SlidingWindow(window=256), 1024, 1024, g, block_q=64, block_k=64)
    # Each query tile sees 3 full tiles in the window interior plus partial edge/diagonal tiles.
    assert int(lay.full_kv_num_blocks.min()) >= 0 and int(lay.full_kv_num_blocks[..., 8:].min()) == 3
    assert int(lay.kv_num_blocks.max()) == 2


def test_build_cost_is_proportional_to_visited_tiles():
    S = 131072
    g = sk.row_geometry(1, S, S)
    lay = sk.build_block_layout(sk.Streaming(sinks=4, window=1024), S, S, g, block_q=128, block_k=128, cache=False)
    nq = S // 128
    assert lay.kv_indices.numel() + lay.full_kv_indices.numel() <= nq * 16  # ~11 tiles per row, not nq
    assert lay.allowed_tiles() <= nq * 11


def test_layouts_are_cached_by_everything_they_depend_on():
    sk.clear_layout_cache()
    g = sk.row_geometry(1, 100, 100)
    a = sk.build_block_layout(sk.SlidingWindow(window=10), 100, 100, g, block_q=16, block_k=16)
    assert sk.build_block_layout(sk.SlidingWindow(window=10), 100, 100, g, block_q=16, block_k=16) is a
    assert sk.build_block_layout(sk.SlidingWindow(window=11), 100, 100, g, block_q=16, block_k=16) is not a
    bb = sk.BigBird(block=16, seed=1)
    l0 = sk.build_block_layout(bb, 200, 200, g, block_q=16, block_k=16, layer_idx=0, num_kv_heads=2)
    l1 = sk.build_block_layout(bb, 200, 200, g, block_q=16, block_k=16, layer_idx=1, num_kv_heads=2)
    assert l0 is not l1 and not torch.equal(l0.to_dense(), l1.to_dense())


@pytest.mark.parametrize("name", FIXED)
def test_block_mask_round_trip_and_flex_attention_agree_with_reference(name):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(0)
    p = random_pattern(name, torch.Generator().manual_seed(7), max_len=96)
    B, Hq, Hkv, S, D = 2, 4, 2, 96, 16
    mask = left_padding_mask(B, S, torch.Generator().manual_seed(3))
    g = sk.row_geometry(B, S, S, mask)
    lay = sk.build_block_layout(p, S, S, g, block_q=16, block_k=16, layer_idx=0, num_kv_heads=Hkv)
    bm = lay.to_block_mask(B, Hq)
    back = sk.BlockLayout.from_block_mask(bm, lay.pattern, g, num_kv_heads=Hkv)
    dense = lay.to_dense().expand(B, Hkv, S, S)
    assert torch.equal(back.to_dense().expand(B, Hkv, S, S), dense)
    q, k, v = torch.randn(B, Hq, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    ref = sk.sparse_attention(q, k, v, p, attention_mask=mask, backend="reference")
    rows = dense.any(-1).repeat_interleave(Hq // Hkv, 1)  # flex leaves fully-masked rows undefined
    assert torch.allclose(out[rows], ref[rows], atol=1e-5)


def test_a_layout_built_inside_a_compiled_graph_is_not_cached():
    """Its tensors may live in a CUDA graph's pool (mode="reduce-overhead") that the next replay overwrites: a layout
    built while tracing stays out of the cache; the same call made eagerly is cached."""
    from sparse_k.layouts import block_layout

    p = sk.get_pattern("bigbird", block=16, random_blocks=2)
    geo = sk.row_geometry(1, 70, 70, None)
    block_layout.clear_layout_cache()
    torch._dynamo.reset()
    build = lambda: sk.build_block_layout(p, 70, 70, geo, block_q=16, block_k=16, num_kv_heads=2).kv_num_blocks + 0
    out = torch.compile(build, backend="eager")()
    assert len(block_layout._CACHE) == 0
    assert torch.equal(out, build())
    assert len(block_layout._CACHE) == 1  # the eager call's


def test_after_last_true_is_one_past_each_rows_last_true_for_any_leading_shape():
    from sparse_k.layouts.geometry import after_last_true

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    mask = torch.rand(3, 2, 37, generator=g) < 0.3
    mask[1, 0] = False
    expected = torch.tensor([[max([j + 1 for j in range(37) if row[j]], default=0) for row in plane] for plane in mask])
    assert torch.equal(after_last_true(mask), expected)
    key_mask = mask[:2, 1].clone()
    key_mask[:, 0] = True  # rows with a valid key: row_geometry's k_end is their one past the last
    assert torch.equal(sk.row_geometry(2, 37, 37, key_mask).k_end, after_last_true(key_mask))


@pytest.mark.parametrize("args, kwargs, exc, words", [
    ((0, 8, 8), {}, ValueError, r"row_geometry: `batch` must be an int >= 1, got 0"),
    ((1, -1, 8), {}, ValueError, r"row_geometry: `q_len` must be an int >= 0, got -1"),
    ((1, 8, -2), {}, ValueError, r"row_geometry: `kv_len` must be an int >= 0, got -2"),
    ((True, 8, 8), {}, TypeError, r"row_geometry: `batch` must be an int >= 1, got bool"),
    ((2, 8.0, 8), {}, TypeError, r"row_geometry: `q_len` must be an int >= 0, got float"),
    ((2, 8, 8), {"attention_mask": torch.ones(3, 8, dtype=torch.bool)}, ValueError,
     r"`attention_mask` must have shape \(B, kv_len\) = \(2, 8\) or \(1, 8\), got \(3, 8\)"),
    ((2, 8, 8), {"attention_mask": torch.ones(2, 7, dtype=torch.bool)}, ValueError, r"\(2, 8\) or \(1, 8\), got \(2, 7\)"),
    ((2, 8, 8), {"attention_mask": torch.ones(2, 1, 8, dtype=torch.bool)}, ValueError, r"got \(2, 1, 8\)"),
    ((2, 8, 8), {"attention_mask": torch.ones(2, 8)}, TypeError,
     r"`attention_mask` must be a bool or integer tensor \(True/1: the key takes part\), got dtype torch.float32"),
    ((2, 8, 8), {"attention_mask": [[1] * 8] * 2}, TypeError, r"must be a bool or integer tensor .*got list"),
])
def test_row_geometry_refuses_bad_sizes_and_masks(args, kwargs, exc, words):
    """An empty batch, a negative length or a mask of another batch or length built a geometry without complaint;
    a float mask was read as ``!= 0``."""
    with pytest.raises(exc, match=words):
        sk.row_geometry(*args, **kwargs)


def test_row_geometry_takes_shared_and_integer_masks():
    mask = torch.ones(1, 8, dtype=torch.int64)
    mask[0, :2] = 0
    geo = sk.row_geometry(3, 8, 8, mask)
    assert geo.k_start.tolist() == [2] and sk.row_geometry(1, 0, 8).q_start.tolist() == [8]
