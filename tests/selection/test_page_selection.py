"""The query-aware training-free selection (sparse_k.selection.page_selection) against its definition, decode
against recompute, the layout contract, and the GPU path without host synchronisation."""

import warnings

import pytest
import sparse_k
import torch
from sparse_k.selection.page_selection import quest_layout  # noqa: F401  (the module under test)
from helpers import layout_sets
from sparse_k.selection.selectors import build_selection


def _inputs(B, Hq, Hkv, S, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, S, D, generator=g, dtype=dtype) for h in (Hq, Hkv, Hkv))


def _round_robin(per_head, n):
    """Pages chosen per query head, merged: rank r = 0, 1, ...: the pages some head ranks r-th (each head's
    ranking best first, ties to the earlier page), not yet taken, by summed score (ties to the earlier page)."""
    ranked = [sorted(h, key=lambda pg: (-h[pg], pg)) for h in per_head]
    total = {pg: sum(h[pg] for h in per_head) for pg in per_head[0]}
    taken = []
    for r in range(len(total)):
        new = {order[r] for order in ranked} - set(taken)
        taken += sorted(new, key=lambda pg: (-total[pg], pg))
    return taken[:n]


def _brute_force(pattern, q, k, geometry, page, Sq, Skv, reduce="sum"):
    """{(b, h, block): sorted key tensor indices} from the module docstring's definition, in float64 loops."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    page = min(page, pattern.top_k)
    qs, ks, ke = (x.expand(B).tolist() for x in (geometry.q_start, geometry.k_start, geometry.k_end))
    out = {}
    for b in range(B):
        n_keys = ke[b] - ks[b]
        qpos = [qs[b] - ks[b] + i for i in range(Sq)]
        for blk in sorted({p // pattern.query_block for p in qpos if p >= 0}):
            b0 = blk * pattern.query_block
            hi = b0 - pattern.window
            cand = [p for p in range(pattern.sinks, hi + 1) if p < n_keys]
            qi = b0 + ks[b] - qs[b]
            for h in range(Hkv):
                if not cand:
                    out[(b, h, blk)] = []
                    continue
                if len(cand) <= pattern.top_k:
                    out[(b, h, blk)] = [p + ks[b] for p in cand]
                    continue
                per_head = [{} for _ in range(G)]
                for pg in range(0, (n_keys + page - 1) // page):
                    members = [p for p in range(pg * page, (pg + 1) * page) if pattern.sinks <= p < n_keys]
                    if not members or (pg + 1) * page - 1 > hi:  # whole pages of candidates only
                        continue
                    kk = k[b, h, [p + ks[b] for p in members]].double()
                    kmin, kmax = kk.min(0).values, kk.max(0).values
                    for g in range(G):
                        qv = q[b, h * G + g, qi].double()
                        per_head[g][pg] = float(torch.maximum(qv * kmin, qv * kmax).sum())
                n_sel = pattern.top_k // page
                if reduce == "rank":
                    best = _round_robin(per_head, n_sel)
                else:
                    red = sum if reduce == "sum" else max
                    scores = {pg: red(hd[pg] for hd in per_head) for pg in per_head[0]}
                    best = sorted(scores, key=lambda pg: -scores[pg])[:n_sel]
                out[(b, h, blk)] = sorted(p + ks[b] for pg in best for p in range(pg * page, (pg + 1) * page)
                                          if p in cand)
    return out


def _check_layout(lay, pattern, geometry, Sq, Skv, B):
    """Ascending, inside each block's candidates and the row's valid keys, at most top_k."""
    sets = layout_sets(lay, geometry, Sq, B)
    ks, ke = geometry.k_start.expand(B).tolist(), geometry.k_end.expand(B).tolist()
    for (b, h, blk), idx in sets.items():
        assert idx == sorted(set(idx)), f"{(b, h, blk)} not strictly ascending"
        hi = blk * pattern.query_block - pattern.window
        assert all(pattern.sinks <= i - ks[b] <= hi and i < ke[b] for i in idx)
        assert len(idx) <= pattern.top_k
    return sets


def _quiet_build(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_selection(*args, layer_idx=0, **kw)


@pytest.mark.parametrize("B,Hq,Hkv,S,pad,page,top_k,chunk,reduce", [
    (2, 4, 2, 203, 17, 4, 12, None, "sum"),   # GQA, left padding, pages smaller than the budget
    (1, 3, 3, 97, 0, 8, 16, None, "sum"),     # MHA, odd length
    (2, 6, 2, 151, 9, 16, 10, None, "sum"),   # a page larger than top_k shrinks to top_k
    (2, 4, 2, 203, 17, 4, 12, 700, "sum"),    # query blocks scored in chunks of 1-2 blocks
    (2, 4, 2, 203, 17, 4, 12, None, "max"),
    (2, 6, 2, 203, 17, 4, 28, None, "rank"),  # pages chosen per query head (3 per KV head), merged
    (1, 3, 3, 97, 0, 8, 16, None, "rank"),    # MHA: one head per group, the plain ranking
    (2, 8, 2, 181, 9, 2, 14, 900, "rank"),    # 4 heads per group, 7 pages: unequal shares, chunks
])
def test_selection_matches_definition(B, Hq, Hkv, S, pad, page, top_k, chunk, reduce, monkeypatch):
    import sparse_k.selection.page_selection as ps

    if chunk is not None:
        monkeypatch.setattr(ps, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(ps, "HEAD_REDUCE", reduce)

    pattern = sparse_k.SparseK(sinks=3, window=19, top_k=top_k, query_block=16)
    q, k, v = _inputs(B, Hq, Hkv, S, 8, seed=S + page)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :pad] = False
    geo = sparse_k.row_geometry(B, S, S, mask)
    old, ps.DEFAULT_PAGE = ps.DEFAULT_PAGE, page
    try:
        lay = _quiet_build(pattern, q, k, v, geo)
        want = _brute_force(pattern, q, k, geo, page, S, S, reduce)
    finally:
        ps.DEFAULT_PAGE = old
    got = _check_layout(lay, pattern, geo, S, S, B)
    assert got == want
    assert lay.weights is None and lay.indices.dtype == torch.int32
    assert any(len(x) > 0 for x in got.values())


def test_partly_candidate_page_is_never_chosen(monkeypatch):
    """The page holding a block's last candidate ``b0 - window`` and window keys after it is not a candidate
    page: a large window key in it must not win the page (which would bring one key for a page of the
    budget); every block with enough whole candidate pages gets exactly ``top_k`` keys."""
    import sparse_k.selection.page_selection as ps

    monkeypatch.setattr(ps, "DEFAULT_PAGE", 8)
    pattern = sparse_k.SparseK(sinks=0, window=16, top_k=16, query_block=16)
    S = 97
    q, k, v = _inputs(1, 2, 1, S, 4, seed=7)
    q = q.abs()
    b0 = (S - 1) // 16 * 16  # the last block: its last candidate b0 - 16 starts a page
    k[0, 0, b0 - 15] = 50.0  # a window key of that page, aligned with every query
    geo = sparse_k.row_geometry(1, S, S)
    lay = _quiet_build(pattern, q, k, v, geo)
    sets = _check_layout(lay, pattern, geo, S, S, 1)
    for (_, _, blk), idx in sets.items():
        hi = blk * 16 - pattern.window
        if (hi + 1) // 8 >= pattern.top_k // 8 and hi + 1 > pattern.top_k:  # enough whole pages, more than top_k keys
            assert len(idx) == pattern.top_k, (blk, idx)
            assert all(i // 8 * 8 + 7 <= hi for i in idx), (blk, idx)
    assert sets[(0, 0, b0 // 16)][-1] < b0 - 16


def test_dsa_without_indexer_uses_the_same_selection():
    q, k, v = _inputs(1, 4, 2, 130, 8, seed=5)
    geo = sparse_k.row_geometry(1, 130, 130)
    a = _quiet_build(sparse_k.SparseK(sinks=2, window=20, top_k=32, query_block=8), q, k, v, geo)
    b = _quiet_build(sparse_k.DSA(sinks=2, window=20, top_k=32, query_block=8), q, k, v, geo)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.counts, b.counts)


@pytest.mark.parametrize("prefill,reduce,refine,obs", [(37, "sum", 0, 0), (48, "sum", 0, 0), (37, "rank", 0, 0),
                                                       (37, "sum", 2, 0), (37, "sum", 0, 5), (48, "sum", 0, 12),
                                                       (37, "sum", 2, 12), (43, "sum", 100, 3)])
def test_decode_equals_recompute(prefill, reduce, refine, obs, monkeypatch):
    """A prefill then one token per call, the memo carrying each block's first query (``OBS``: the ring of the last
    queries and the block's observation window), padded row 1; a decode call inside the block of the call before it
    returns that call's layout (one selection per block)."""
    import sparse_k.selection.page_selection as ps
    import sparse_k.selection.selectors as sel

    monkeypatch.setattr(ps, "HEAD_REDUCE", reduce)
    monkeypatch.setattr(ps, "REFINE", refine)
    monkeypatch.setattr(ps, "OBS", obs)

    computed = []
    quest = sel.quest_layout
    monkeypatch.setattr(sel, "quest_layout", lambda *a, **kw: computed.append(a[1].shape[2]) or quest(*a, **kw))
    pattern = sparse_k.SparseK(sinks=2, window=9, top_k=16, query_block=8)
    B, S = 2, 121
    q, k, v = _inputs(B, 4, 2, S, 6, seed=prefill)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :5] = False
    full_geo = sparse_k.row_geometry(B, S, S, mask)
    want = layout_sets(_quiet_build(pattern, q, k, v, full_geo), full_geo, S, B)
    memo, seen = {}, {}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for t0, t1 in [(0, prefill)] + [(t, t + 1) for t in range(prefill, S)]:
            geo = sparse_k.row_geometry(B, t1 - t0, t1, mask[:, :t1])
            lay = build_selection(pattern, q[:, :, t0:t1], k[:, :, :t1], v[:, :, :t1], geo, layer_idx=0, memo=memo)
            if lay is None:
                continue
            for key, idx in layout_sets(lay, geo, t1 - t0, B).items():
                assert idx == want[key], f"step {t1}, {key}"
                seen[key] = idx
    assert not any("first query was not seen" in str(w.message) for w in rec)
    assert seen.keys() == want.keys()
    block_pairs = {(p // 8, (p - 5) // 8) for p in range(prefill, S)}  # (row 0, row 1) blocks of the decode calls
    decode_selections = sum(1 for sq in computed if sq == 1)
    assert 0 < decode_selections <= len(block_pairs) < S - prefill


def test_decode_without_memo_warns_once():
    from sparse_k.warn import _WARNED

    pattern = sparse_k.SparseK(sinks=2, window=9, top_k=16, query_block=8)
    q, k, v = _inputs(1, 2, 1, 60, 4, seed=3)
    geo = sparse_k.row_geometry(1, 1, 60)
    for key in [w for w in _WARNED if "first query was not seen" in w]:
        _WARNED.discard(key)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(2):
            build_selection(pattern, q[:, :, 59:], k, v, geo, layer_idx=0)
    assert sum("first query was not seen" in str(w.message) for w in rec) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_selection_has_no_host_sync():
    pattern = sparse_k.SparseK(sinks=4, window=64, top_k=128, query_block=32)
    q, k, v = (t.cuda().to(torch.bfloat16) for t in _inputs(2, 8, 2, 1000, 64, seed=1, dtype=torch.float32))
    mask = torch.ones(2, 1000, dtype=torch.bool, device="cuda")
    mask[1, :13] = False
    geo = sparse_k.row_geometry(2, 1000, 1000, mask)  # padded: offsets only on the device
    memo = {}
    _quiet_build(pattern, q, k, v, geo, memo=memo)  # warm-up (first-call work may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lay = build_selection(pattern, q, k, v, geo, layer_idx=0, memo=memo)
        geo1 = sparse_k.row_geometry(2, 1, 1000, mask)
        build_selection(pattern, q[:, :, -1:], k, v, geo1, layer_idx=0, memo=memo)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    cpu_geo = sparse_k.row_geometry(2, 1000, 1000, mask.cpu())
    cpu = layout_sets(_quiet_build(pattern, q.float().cpu(), k.float().cpu(), v.float().cpu(), cpu_geo), cpu_geo, 1000, 2)
    gpu_lay = sparse_k.TokenLayout(lay.indices.cpu(), lay.counts.cpu(), lay.query_block, lay.first_block.cpu())
    got = _check_layout(gpu_lay, pattern, cpu_geo, 1000, 1000, 2)
    # Matmuls on the GPU and the CPU round differently: near-tied pages may swap, rarely.
    assert sum(got[key] == cpu[key] for key in cpu) >= 0.9 * len(cpu)


@pytest.mark.parametrize("chunk", [8, 13])
def test_sparsek_prefix_scan_matches_definition(chunk, monkeypatch):
    """The trained-scorer path for long rows (prefix top-k scan over a grid of ``chunk`` positions) selects
    exactly the definition's top-k, with its SparseK weights, padded rows included."""
    import math

    import sparse_k.selection.selectors as sel
    from selection_reference import (
        assert_same_selection,
        brute_force_topk,
        layout_selection,
    )
    from sparse_k.selection.scorers import SparseKScorer

    monkeypatch.setattr(sel, "PREFIX_CHUNK", chunk)
    pattern = sparse_k.SparseK(sinks=3, window=13, top_k=6, query_block=8)
    B, Hq, Hkv, S = 2, 4, 2, 157
    q, k, v = _inputs(B, Hq, Hkv, S, 6, seed=11 + chunk)
    v = v.round(decimals=1)  # ties between scores
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :9] = False
    geo = sparse_k.row_geometry(B, S, S, mask)
    scorer = SparseKScorer(Hkv, 6, key_norm_term=False).double()
    with torch.no_grad():
        scorer.weight.copy_(torch.randn(scorer.weight.shape, generator=torch.Generator().manual_seed(chunk), dtype=torch.float64))
        scorer.pos_weight.zero_()
        scorer.log_gain.fill_(math.log(50.0))  # a sharp projection: the support stays near top_k
    called = []
    orig = sel._prefix_topk_layout
    monkeypatch.setattr(sel, "_prefix_topk_layout", lambda *a, **kw: called.append(1) or orig(*a, **kw))
    lay = build_selection(pattern, q, k, v, geo, layer_idx=0, selector=scorer)
    assert called
    u = scorer(v, geo.k_positions(S).expand(B, S), k).detach()
    want = brute_force_topk(pattern, u, geo, S, S, B, Hkv, weighted=True)
    assert_same_selection(layout_selection(lay, geo, S, B, Hkv), want, atol=1e-9)
    _check_layout(lay, pattern, geo, S, S, B)
    lay.weights.sum().backward()
    grad = scorer.weight.grad
    assert grad is not None and bool(torch.isfinite(grad).all())
    fractional = (lay.weights > 0) & (lay.weights < 1)  # only these carry a gradient (SparseK's Jacobian)
    assert float(grad.abs().sum()) > 0 or not bool(fractional.any())


def test_dsa_page_preselection_matches_definition(monkeypatch):
    """Pages ranked by an upper bound of the indexer score (checked against every candidate), then the
    exact top-k inside the chosen pages; one selection shared by the KV heads."""
    import math

    import sparse_k.selection.selectors as sel
    from sparse_k.selection.scorers import LightningIndexer

    page, factor = 4, 2
    monkeypatch.setattr(sel, "DSA_PRESELECT", True)
    monkeypatch.setattr(sel, "PRESELECT_PAGE", page)
    monkeypatch.setattr(sel, "PRESELECT_FACTOR", factor)
    pattern = sparse_k.DSA(sinks=3, window=6, top_k=5, query_block=8, indexer_heads=3, indexer_dim=4)
    B, Hq, Hkv, S = 2, 4, 2, 141
    q, k, v = _inputs(B, Hq, Hkv, S, 6, seed=21)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :7] = False
    geo = sparse_k.row_geometry(B, S, S, mask)
    idx = LightningIndexer(Hq, Hkv, 6, indexer_heads=3, indexer_dim=4).double()
    with torch.no_grad():
        idx.w_proj.weight.normal_()  # head weights of both signs
    lay = build_selection(pattern, q, k, v, geo, layer_idx=0, selector=idx)
    with torch.no_grad():
        qi, w = idx.index_queries(q)
        ki = idx.index_keys(k)
    n_pre = factor * -(-pattern.top_k // page)
    ks, ke = geo.k_start.tolist(), geo.k_end.tolist()
    want = {}
    for b in range(B):
        n = ke[b] - ks[b]
        for blk in range(0, (n - 1) // pattern.query_block + 1):
            b0 = blk * pattern.query_block
            cand = list(range(pattern.sinks, min(b0 - pattern.window, n - 1) + 1))
            t = b0 + ks[b]
            sc = {p: float(idx.scores(qi[b:b + 1, t:t + 1], w[b:b + 1, t:t + 1], ki[b:b + 1, p + ks[b]][:, None])) for p in cand}
            bound = {}
            for pg in sorted({p // page for p in cand}):
                members = [p for p in range(pg * page, (pg + 1) * page) if pattern.sinks <= p < n]
                kk = ki[b, [p + ks[b] for p in members]]
                kmin, kmax = kk.min(0).values, kk.max(0).values
                tot = 0.0
                for h in range(3):
                    qh, wh = qi[b, t, h], float(w[b, t, h])
                    ub = float((qh.clamp_min(0) * kmax + qh.clamp_max(0) * kmin).sum())
                    lb = float((qh.clamp_min(0) * kmin + qh.clamp_max(0) * kmax).sum())
                    tot += wh * max(0.0, ub if wh >= 0 else lb) / math.sqrt(4)
                bound[pg] = tot
                assert all(sc[p] <= tot + 1e-9 for p in members if p in sc)
            pages = sorted(bound, key=lambda pg: -bound[pg])[:n_pre]
            inside = [p for p in cand if p // page in pages]
            top = sorted(sorted(inside, key=lambda p: -sc[p])[: pattern.top_k])
            for h in range(Hkv):
                want[(b, h, blk)] = [p + ks[b] for p in top]
    got = _check_layout(lay, pattern, geo, S, S, B)
    assert got == want
    assert int(lay.counts.max()) == pattern.top_k


def test_fused_top_indices_equals_stable_sort():
    """The int64-key topk (the CUDA path) against the stable sort, with ties, -inf, +-0 and negatives."""
    from sparse_k.selection.selectors import _top_indices

    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 7, 301, generator=g).round(decimals=1)  # many exact ties
    x[0, :, ::3] = float("-inf")
    x[1, 0, :5] = torch.tensor([0.0, -0.0, 0.0, -0.0, 0.0])
    for K in (1, 17, 301):
        assert torch.equal(_top_indices(x, K, fused=True), _top_indices(x, K, fused=False))


@pytest.mark.parametrize("use_sparse_cache", [False, True])
def test_generate_equals_recompute_through_transformers(use_sparse_cache):
    """Greedy generation with the training-free default (DynamicCache: the memo on the attention module;
    SparseCache: the memo on the SelectionLayer) gives the logits of recomputing every prefix."""
    from helpers import sparse_tiny_llama
    from hf_sparse_attention import SparseCache

    model = sparse_tiny_llama("sparse_k", {"sinks": 2, "window": 8, "top_k": 8, "query_block": 4}, random_selectors=False)
    seq = torch.randint(1, 50, (2, 30), generator=torch.Generator().manual_seed(2))
    kw = {"past_key_values": SparseCache(model)} if use_sparse_cache else {}
    with warnings.catch_warnings(record=True) as rec, torch.no_grad():
        warnings.simplefilter("always")
        out = model.generate(seq, attention_mask=torch.ones_like(seq), max_new_tokens=30, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)
        again = torch.stack([model(out.sequences[:, :t], use_cache=False).logits[:, -1] for t in range(30, 60)])
    assert not any("first query was not seen" in str(w.message) for w in rec)
    torch.testing.assert_close(torch.stack(out.logits), again, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n_chunks,Z,M", [(1, 8, 4), (5, 4, 10), (7, 16, 6), (13, 3, 3)])
def test_prefix_best_lists_matches_sequential_definition(n_chunks, Z, M):
    """The parallel prefix scan gives, for every chunk c, the M best positions of [0, c * Z) with ties to the
    earlier position and -inf scores never chosen: the definition, computed by a stable sort per prefix."""
    from sparse_k.selection.selectors import _prefix_best_lists

    gen = torch.Generator().manual_seed(1000 * n_chunks + 10 * Z + M)
    B, H, n = 2, 3, n_chunks * Z + 2
    u = torch.randint(0, 5, (B, H, n), generator=gen).float()  # many ties
    u[torch.rand(B, H, n, generator=gen) < 0.2] = float("-inf")
    L = _prefix_best_lists(u, n_chunks, Z, M)
    assert L.shape == (B, H, n_chunks, M)
    for b in range(B):
        for h in range(H):
            for c in range(n_chunks):
                prefix = u[b, h, : c * Z]
                order = torch.sort(prefix, descending=True, stable=True).indices[:M]
                want = sorted(int(i) for i in order if prefix[i] > float("-inf"))
                got = [int(x) for x in L[b, h, c] if x >= 0]
                assert got == want, (b, h, c)
                valid = L[b, h, c][L[b, h, c] >= 0]
                assert bool((valid[1:] > valid[:-1]).all())


def test_decode_reuse_never_crosses_a_new_prompt():
    """Two generations of the same shape through one memo: the second prompt's prefill drops the first's
    reused layout, so its decode steps select from its own keys (equal to a recompute)."""
    pattern = sparse_k.SparseK(sinks=2, window=9, top_k=16, query_block=8)
    B, S = 1, 92
    memo = {}
    for seed, prefill in ((1, 84), (2, 88)):  # the second's first decode call is in the first's last block (11)
        q, k, v = _inputs(B, 4, 2, S, 6, seed=100 + seed)
        want = layout_sets(_quiet_build(pattern, q, k, v, sparse_k.row_geometry(B, S, S)), sparse_k.row_geometry(B, S, S), S, B)
        for t0, t1 in [(0, prefill)] + [(t, t + 1) for t in range(prefill, S)]:
            geo = sparse_k.row_geometry(B, t1 - t0, t1)
            lay = _quiet_build(pattern, q[:, :, t0:t1], k[:, :, :t1], v[:, :, :t1], geo, memo=memo)
            for key, idx in layout_sets(lay, geo, t1 - t0, B).items():
                assert idx == want[key], f"generation {seed}, step {t1}, {key}"


@pytest.mark.parametrize("refine,normaliser", [(2, "full"), (100, "full"), (2, "static")])
def test_refine_matches_definition(refine, normaliser, refine_logits, monkeypatch):
    """``REFINE = F``: the ``F * top_k // page`` best pages (the Quest bound), then the ``top_k`` keys among them
    with the largest attention probability of the block's first query (softmax over its sinks, window and the
    preselected keys, per query head, summed over the KV head's query heads; ``REFINE_NORMALISER = "static"``: each
    head's exponentials over the sum over its sinks and window alone); left padding included."""
    import sparse_k.selection.page_selection as ps

    monkeypatch.setattr(ps, "REFINE", refine)
    monkeypatch.setattr(ps, "REFINE_NORMALISER", normaliser)
    monkeypatch.setattr(ps, "DEFAULT_PAGE", 4)
    monkeypatch.setattr(ps, "CHUNK_ELEMENTS", 3000)  # several chunks of blocks
    pattern = sparse_k.SparseK(sinks=3, window=12, top_k=8, query_block=8)
    B, Hq, Hkv, S, D, page = 2, 4, 2, 121, 6, 4
    q, k, v = _inputs(B, Hq, Hkv, S, D, seed=refine)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :9] = False
    geo = sparse_k.row_geometry(B, S, S, mask)
    lay = _quiet_build(pattern, q, k, v, geo)
    got = _check_layout(lay, pattern, geo, S, S, B)
    monkeypatch.setattr(ps, "REFINE", 0)
    pages_only = layout_sets(_quiet_build(pattern, q, k, v, geo), geo, S, B)
    n_pre = refine * (pattern.top_k // page)
    G = Hq // Hkv
    ks = geo.k_start.tolist()
    for (b, h, blk), idx in got.items():
        b0 = blk * pattern.query_block
        hi = b0 - pattern.window
        n = S - ks[b]
        cand = [p for p in range(pattern.sinks, min(hi, n - 1) + 1)]
        if len(cand) <= pattern.top_k:
            assert idx == [p + ks[b] for p in cand]
            continue
        bound = {}
        for pg in range((hi + 1) // page):
            members = [p for p in range(pg * page, (pg + 1) * page) if p >= pattern.sinks]
            if not members or (pg + 1) * page - 1 > hi:
                continue
            kk = k[b, h, [p + ks[b] for p in members]]
            bound[pg] = sum(float(torch.maximum(q[b, h * G + g, b0 + ks[b]] * kk.min(0).values,
                                                q[b, h * G + g, b0 + ks[b]] * kk.max(0).values).sum()) for g in range(G))
        pre = sorted(bound, key=lambda pg: (-bound[pg], pg))[:n_pre]
        keys = [p for pg in sorted(pre) for p in range(pg * page, (pg + 1) * page) if p >= pattern.sinks]
        static = list(range(pattern.sinks)) + list(range(hi + 1, b0 + 1))  # the block query's sinks and window
        kk = k[b, h, [p + ks[b] for p in keys + static]]
        logits = [kk @ q[b, h * G + g, b0 + ks[b]] / D ** 0.5 for g in range(G)]
        norm = [torch.logsumexp(x[len(keys):] if normaliser == "static" else x, 0) for x in logits]
        prob = sum(torch.exp(x - n) for x, n in zip(logits, norm))[: len(keys)]
        order = torch.sort(prob, descending=True, stable=True).indices[: pattern.top_k]
        assert idx == sorted(keys[i] + ks[b] for i in order.tolist()), (b, h, blk)
        if refine == 1:
            assert idx == pages_only[(b, h, blk)]


@pytest.mark.parametrize("obs,refine,qb", [(5, 0, 8), (12, 0, 4), (1, 0, 8), (6, 2, 8), (20, 100, 8)])
def test_observation_window_matches_definition(obs, refine, qb, monkeypatch):
    """``OBS = n``: the queries at positions ``[b0 - n + 1, b0]`` (valid positions only) score the pages: per query and
    query head the softmax over the candidate pages of the Quest bound / sqrt(D), summed; ``REFINE = F``: the
    ``F * top_k // page`` best pages, then the keys with the largest summed attention probability of those queries,
    each over its causal sinks and window keys (up to its own position) and the preselected keys. Left padding."""
    import sparse_k.selection.page_selection as ps

    monkeypatch.setattr(ps, "OBS", obs)
    monkeypatch.setattr(ps, "REFINE", refine)
    monkeypatch.setattr(ps, "DEFAULT_PAGE", 4)
    monkeypatch.setattr(ps, "CHUNK_ELEMENTS", 5000)  # several chunks of blocks
    pattern = sparse_k.SparseK(sinks=3, window=12, top_k=8, query_block=qb)
    B, Hq, Hkv, S, D, page = 2, 4, 2, 117, 6, 4
    q, k, v = _inputs(B, Hq, Hkv, S, D, seed=obs + refine)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :9] = False
    geo = sparse_k.row_geometry(B, S, S, mask)
    got = _check_layout(_quiet_build(pattern, q, k, v, geo), pattern, geo, S, S, B)
    G = Hq // Hkv
    ks = geo.k_start.tolist()
    checked = 0
    for (b, h, blk), idx in got.items():
        b0 = blk * qb
        hi = b0 - pattern.window
        n = S - ks[b]
        cand = list(range(pattern.sinks, min(hi, n - 1) + 1))
        if len(cand) <= pattern.top_k:
            assert idx == [p + ks[b] for p in cand]
            continue
        obs_pos = [j for j in range(b0 - obs + 1, b0 + 1) if j >= 0]
        pages = [pg for pg in range((hi + 1) // page) if (pg + 1) * page - 1 <= hi
                 and any(p >= pattern.sinks for p in range(pg * page, (pg + 1) * page))]
        score = {pg: 0.0 for pg in pages}
        for j in obs_pos:
            for g in range(G):
                qv = q[b, h * G + g, j + ks[b]]
                bound = []
                for pg in pages:
                    kk = k[b, h, [p + ks[b] for p in range(pg * page, (pg + 1) * page) if p >= pattern.sinks]]
                    bound.append(float(torch.maximum(qv * kk.min(0).values, qv * kk.max(0).values).sum()))
                for pg, pr in zip(pages, torch.softmax(torch.tensor(bound, dtype=torch.float64) / D ** 0.5, 0).tolist()):
                    score[pg] += pr
        n_sel = (refine or 1) * (pattern.top_k // page)
        best = sorted(pages, key=lambda pg: (-score[pg], pg))[:n_sel]
        keys = [p for pg in sorted(best) for p in range(pg * page, (pg + 1) * page) if p >= pattern.sinks]
        if refine:
            prob = torch.zeros(len(keys), dtype=torch.float64)
            for j in obs_pos:
                static = list(range(pattern.sinks)) + [p for p in range(max(hi + 1, pattern.sinks), j + 1)]
                kk = k[b, h, [p + ks[b] for p in keys + static]]
                for g in range(G):
                    prob += torch.softmax(kk @ q[b, h * G + g, j + ks[b]] / D ** 0.5, 0)[: len(keys)]
            order = torch.sort(prob, descending=True, stable=True).indices[: pattern.top_k]
            keys = sorted(keys[i] for i in order.tolist())
        assert idx == [p + ks[b] for p in keys], (b, h, blk)
        checked += 1
    assert checked > 10


@pytest.mark.parametrize("qb,refine,obs,normaliser", [(1, 8, 0, "full"), (2, 6, 0, "full"), (1, 0, 3, "full"),
                                                      (1, 8, 0, "static")])
def test_per_query_selection_decode_equals_recompute(qb, refine, obs, normaliser, refine_logits, monkeypatch):
    """Query blocks of 1-2 (every query, or every pair, selects its own keys) with ``REFINE`` (either normaliser): a
    prefill then one token per call through the memo gives the recompute's selection; padded row 1."""
    import sparse_k.selection.page_selection as ps

    monkeypatch.setattr(ps, "REFINE", refine)
    monkeypatch.setattr(ps, "REFINE_NORMALISER", normaliser)
    monkeypatch.setattr(ps, "OBS", obs)
    monkeypatch.setattr(ps, "DEFAULT_PAGE", 4)
    pattern = sparse_k.SparseK(sinks=2, window=9, top_k=8, query_block=qb)
    B, S, prefill = 2, 90, 41
    q, k, v = _inputs(B, 4, 2, S, 6, seed=qb * 10 + refine)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :5] = False
    full_geo = sparse_k.row_geometry(B, S, S, mask)
    want = layout_sets(_quiet_build(pattern, q, k, v, full_geo), full_geo, S, B)
    memo = {}
    for t0, t1 in [(0, prefill)] + [(t, t + 1) for t in range(prefill, S)]:
        geo = sparse_k.row_geometry(B, t1 - t0, t1, mask[:, :t1])
        lay = _quiet_build(pattern, q[:, :, t0:t1], k[:, :, :t1], v[:, :, :t1], geo, memo=memo)
        if lay is None:
            continue
        for key, idx in layout_sets(lay, geo, t1 - t0, B).items():
            assert idx == want[key], f"step {t1}, {key}"


@pytest.mark.parametrize("name", ["sparse_k", "dsa"])
def test_pattern_refine_is_the_two_stage_selection(name, monkeypatch):
    """``refine=F`` on the pattern selects what the module's ``REFINE = F`` does (and differs from pages only here);
    negative or non-integer values are refused by name; the field survives ``to_dict``."""
    import sparse_k.selection.page_selection as ps

    monkeypatch.setattr(ps, "DEFAULT_PAGE", 4)
    base = sparse_k.get_pattern(name, sinks=3, window=12, top_k=8, query_block=1)
    B, Hq, Hkv, S, D = 2, 4, 2, 97, 6
    q, k, v = _inputs(B, Hq, Hkv, S, D, seed=len(name))
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :7] = False
    geo = sparse_k.row_geometry(B, S, S, mask)
    by_field = layout_sets(_quiet_build(base.replace(refine=3), q, k, v, geo), geo, S, B)
    monkeypatch.setattr(ps, "REFINE", 3)
    by_module = layout_sets(_quiet_build(base, q, k, v, geo), geo, S, B)
    monkeypatch.setattr(ps, "REFINE", 0)
    pages_only = layout_sets(_quiet_build(base, q, k, v, geo), geo, S, B)
    assert by_field == by_module
    assert by_field != pages_only
    assert sparse_k.pattern_from_dict(base.replace(refine=3).to_dict()).refine == 3
    for bad in (-1, 1.5, True):
        with pytest.raises((ValueError, TypeError), match="refine"):
            sparse_k.get_pattern(name, refine=bad)


@pytest.mark.parametrize("qb", [1, 8, 64])
def test_block_queries_from_host_offsets_equal_the_device_path(qb):
    """``block_queries`` with host-known offsets shared by every row (strided slice of the queries, ring written by
    slices) gives the block queries and leaves the memo exactly as the device path does, over a generation's calls
    (prefill, decode steps, a draft cut back into an earlier block, a new prompt)."""
    from sparse_k.layouts.geometry import row_geometry
    from sparse_k.selection import page_selection
    from sparse_k.selection.selectors import block_candidates
    from sparse_k.layouts.patterns import get_pattern

    pattern = get_pattern("sparse_k", sinks=2, window=8, top_k=16, query_block=qb)
    B, Hq, Hkv, D = 2, 6, 2, 8
    seq = torch.randn(B, Hq, 300, D)
    by_device, by_host = {}, {}
    for p, Sq in [(0, 70), (70, 1), (71, 1), (72, 9), (75, 3), (60, 40), (0, 3), (3, 140)]:
        geo = row_geometry(B, Sq, p + Sq, device="cpu")
        first, block_start, block_ok, _, _ = block_candidates(pattern, geo, B, Sq, p + Sq)
        q = seq[:, :, p:p + Sq]
        q_pos0 = geo.q_positions(Sq).expand(B, Sq)[:, 0]
        args = (q_pos0, block_start, None, qb, by_device, first, block_ok, Hq // Hkv)
        want = page_selection.block_queries(q, *args)
        got = page_selection.block_queries(q, q_pos0, block_start, geo.host_offsets(), qb, by_host, first, block_ok,
                                           Hq // Hkv)
        assert torch.equal(got, want), (p, Sq)
        for name in ("blocks", "block", "q"):
            assert torch.equal(by_host[name], by_device[name]), (p, Sq, name)


def test_refine_normaliser_is_checked(monkeypatch):
    """An unknown ``REFINE_NORMALISER`` is a ValueError naming it and the allowed values (not a silent default)."""
    import sparse_k.selection.page_selection as ps

    monkeypatch.setattr(ps, "REFINE", 2)
    monkeypatch.setattr(ps, "REFINE_NORMALISER", "pool")
    q, k, v = _inputs(1, 2, 1, 80, 6, seed=3)
    with pytest.raises(ValueError, match=r"REFINE_NORMALISER must be 'full' or 'static', got 'pool'"):
        _quiet_build(sparse_k.SparseK(sinks=2, window=8, top_k=8, query_block=4), q, k, v, sparse_k.row_geometry(1, 80, 80))
