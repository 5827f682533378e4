"""SparseK with ``refine = F`` (``sparse_k.selection.selectors._refined_layout``): a trained scorer keeps a pool of the
``F * top_k`` candidates with the largest score ``u``, and each query block keeps the ``top_k`` keys of its pool with
the largest attention probability of the block's first query. Checked against a float64 loop definition (GQA, a
left-padded row, odd lengths, the exact path and the prefix scan, chunks of blocks; the refinement's logits gathered
and from one matmul), decode against recompute (through the memo, query blocks of 1 and 4), and a DSA indexer that
ignores ``refine`` with a warning."""

from __future__ import annotations

import warnings

import pytest
import sparse_k
import torch
from helpers import layout_sets
from sparse_k.selection import selectors
from sparse_k.selection.scorers import LightningIndexer, SparseKScorer
from sparse_k.selection.selectors import build_selection


def _inputs(B, Hq, Hkv, S, D, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, S, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv))


def _scorer(Hkv, D, seed):
    torch.manual_seed(seed)
    scorer = SparseKScorer(Hkv, D, key_norm_term=False)
    with torch.no_grad():
        scorer.pos_weight.normal_()
    return scorer


def _build(pattern, q, k, v, geo, scorer, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_selection(pattern, q, k, v, geo, layer_idx=0, selector=scorer, **kw)


def _definition(pattern, q, k, v, scorer, geo, b, h, blk):
    """The block's refined selection (sorted key tensor indices) from the module docstring, in float64 loops."""
    B, Hq, S, D = q.shape
    G = Hq // k.shape[1]
    ks = int(geo.k_start.expand(B)[b])
    n = S - ks
    b0 = blk * pattern.query_block
    hi = b0 - pattern.window
    cand = list(range(pattern.sinks, min(hi, n - 1) + 1))
    if len(cand) <= pattern.top_k:
        return [p + ks for p in cand]
    with torch.no_grad():
        u = scorer(v[b : b + 1, :, ks:], torch.arange(n)[None])[0, h]  # positions 0 .. n - 1
    pool = sorted(sorted(cand, key=lambda p: (-float(u[p]), p))[: pattern.refine * pattern.top_k])
    static = list(range(min(pattern.sinks, n))) + list(range(max(hi + 1, pattern.sinks), b0 + 1))
    kk = k[b, h, [p + ks for p in pool + static]]
    qq = q[b, h * G : (h + 1) * G, b0 + ks]  # the block's first query, per query head of the group
    prob = torch.softmax(qq @ kk.T / D**0.5, -1).sum(0)[: len(pool)]
    order = torch.sort(prob, descending=True, stable=True).indices[: pattern.top_k]
    return sorted(pool[i] + ks for i in order.tolist())


@pytest.mark.parametrize("qb,refine,prefix_chunk,chunk_elements", [
    (1, 2, None, None),    # every query its own block
    (4, 3, None, None),    # blocks of 4 queries, the exact path
    (4, 2, 8, None),       # the prefix scan (long rows: more than 2 * pool + PREFIX_CHUNK candidates)
    (3, 2, None, 1500),    # blocks refined in chunks of a few blocks
])
def test_refined_selection_matches_definition(qb, refine, prefix_chunk, chunk_elements, refine_logits, monkeypatch):
    if prefix_chunk is not None:
        monkeypatch.setattr(selectors, "PREFIX_CHUNK", prefix_chunk)
    if chunk_elements is not None:
        monkeypatch.setattr(selectors, "_CHUNK_ELEMENTS", chunk_elements)
    pattern = sparse_k.SparseK(sinks=3, window=7, top_k=5, query_block=qb, refine=refine)
    B, Hq, Hkv, S, D = 2, 6, 2, 97, 8
    q, k, v = _inputs(B, Hq, Hkv, S, D, seed=qb * 10 + refine)
    scorer = _scorer(Hkv, D, seed=refine)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :11] = False
    geo = sparse_k.row_geometry(B, S, S, mask)
    lay = _build(pattern, q, k, v, geo, scorer)
    assert lay.weights is None and lay.indices.shape[-1] == pattern.top_k
    got = layout_sets(lay, geo, S, B)
    refined = 0
    for (b, h, blk), idx in got.items():
        want = _definition(pattern, q, k, v, scorer, geo, b, h, blk)
        assert idx == want, (b, h, blk)
        refined += len(idx) == pattern.top_k
    assert refined > 20
    plain = layout_sets(_build(pattern.replace(refine=0), q, k, v, geo, scorer), geo, S, B)
    assert sum(plain[key] != got[key] for key in got) > 10  # the refinement changes the selection


@pytest.mark.parametrize("qb", [1, 4])
def test_refined_decode_equals_recompute(qb, refine_logits):
    """A prefill, then one token per call with the memo of the block's first query: the recompute's selection."""
    pattern = sparse_k.SparseK(sinks=2, window=6, top_k=4, query_block=qb, refine=2)
    B, S, prefill = 2, 70, 29
    q, k, v = _inputs(B, 4, 2, S, 6, seed=qb)
    scorer = _scorer(2, 6, seed=qb)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :5] = False
    full_geo = sparse_k.row_geometry(B, S, S, mask)
    want = layout_sets(_build(pattern, q, k, v, full_geo, scorer), full_geo, S, B)
    memo, checked = {}, 0
    for t0, t1 in [(0, prefill)] + [(t, t + 1) for t in range(prefill, S)]:
        geo = sparse_k.row_geometry(B, t1 - t0, t1, mask[:, :t1])
        lay = _build(pattern, q[:, :, t0:t1], k[:, :, :t1], v[:, :, :t1], geo, scorer, memo=memo)
        if lay is None:
            continue
        for key, idx in layout_sets(lay, geo, t1 - t0, B).items():
            assert idx == want[key], f"step {t1}, {key}"
            checked += 1
    assert checked > 50


def test_refine_with_a_dsa_indexer_warns():
    """A DSA indexer does not use ``refine``: the call says so (once) and selects as without it."""
    from sparse_k.warn import _WARNED

    _WARNED.discard("dsa: refine with a selector")
    pattern = sparse_k.DSA(sinks=2, window=8, top_k=8, query_block=4)
    q, k, v = (t.float() for t in _inputs(1, 4, 2, 60, 8, seed=5))
    geo = sparse_k.row_geometry(1, 60, 60, None)
    indexer = LightningIndexer(4, 2, 8, indexer_heads=2, indexer_dim=8)
    with pytest.warns(UserWarning, match="refine=2 applies to the training-free selection and to trained sparse_k"):
        got = build_selection(pattern.replace(refine=2), q, k, v, geo, layer_idx=0, selector=indexer)
    want = build_selection(pattern, q, k, v, geo, layer_idx=0, selector=indexer)
    assert torch.equal(got.indices, want.indices) and torch.equal(got.counts, want.counts)
