"""build_selection (SparseK scorer, DSA indexer, training-free fallback) and the selector files."""

import warnings

import pytest
import sparse_k
import torch
from helpers import sparse_tiny_llama, tiny_llama
from selection_reference import (
    assert_same_selection,
    brute_force_topk,
    layout_selection,
)
from sparse_k.selection.scorers import LightningIndexer, SparseKScorer
from sparse_k.selection.selectors import build_selection, training_free_scores


def _inputs(B, Hq, Hkv, Sq, Skv, D, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, Skv, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, Skv, D, generator=g, dtype=dtype)
    return q, k, v


def _random_scorer(num_kv_heads, head_dim, seed=0):
    scorer = SparseKScorer(num_kv_heads, head_dim)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prm in scorer.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g))
    return scorer


@pytest.mark.parametrize("B,Hq,Hkv,S,pad", [(2, 4, 2, 203, 17), (1, 3, 3, 97, 0)])
def test_sparsek_selection_matches_definition(B, Hq, Hkv, S, pad):
    pattern = sparse_k.SparseK(sinks=3, window=19, top_k=11, query_block=16)
    q, k, v = _inputs(B, Hq, Hkv, S, S, 8, seed=S, dtype=torch.float64)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :pad] = False  # left padding on row 0
    geo = sparse_k.row_geometry(B, S, S, mask)
    scorer = SparseKScorer(Hkv, 8)
    with torch.no_grad():
        scorer.pos_weight.fill_(0.7)
        scorer.weight.normal_()
    lay = build_selection(pattern, q, k, v, geo, layer_idx=0, selector=scorer)
    u = scorer(v, geo.k_positions(S).expand(B, S), k).detach()
    want = brute_force_topk(pattern, u, geo, S, S, B, Hkv, weighted=True)
    # float64 throughout: the prefix-sum threshold and the textbook operator differ by rounding only.
    assert_same_selection(layout_selection(lay, geo, S, B, Hkv), want, atol=1e-9)
    assert lay.indices.dtype == torch.int32 and lay.counts.dtype == torch.int32
    assert int(lay.counts.max()) == pattern.top_k
    assert bool((lay.weights > 0).sum(-1).eq(lay.counts.long()).all())  # kept weights are positive


def test_fallback_is_the_page_selection_and_warns_once():
    """Without a selector: the query-aware page selection (its definition: tests/selection/test_page_selection.py),
    unweighted, with one warning that names the trained alternative."""
    from sparse_k.warn import _WARNED

    pattern = sparse_k.SparseK(sinks=2, window=8, top_k=5, query_block=8)
    q, k, v = _inputs(2, 2, 1, 61, 61, 4, seed=3)
    geo = sparse_k.row_geometry(2, 61, 61)
    _WARNED.discard("sparse_k: training-free selection")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        lay = build_selection(pattern, q, k, v, geo, layer_idx=5)
        build_selection(pattern, q, k, v, geo, layer_idx=5)
    msgs = [str(w.message) for w in rec if "training-free" in str(w.message)]
    assert len(msgs) == 1 and "trained selectors do better" in msgs[0]
    assert "query_block=1, refine=8" in msgs[0]  # the training-free setting that retrieves
    assert lay.weights is None and int(lay.counts.max()) > 0

    per_query = sparse_k.SparseK(sinks=2, window=8, top_k=5, query_block=1, refine=8)
    _WARNED.discard("sparse_k: training-free selection")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        build_selection(per_query, q, k, v, geo, layer_idx=5)
    msgs = [str(w.message) for w in rec if "training-free" in str(w.message)]
    assert len(msgs) == 1 and "refine=8 selects per query" not in msgs[0]  # already the per-query setting


def test_dsa_selection_matches_definition_and_is_shared_by_heads():
    pattern = sparse_k.DSA(sinks=2, window=10, top_k=7, query_block=8, indexer_heads=3, indexer_dim=4)
    q, k, v = _inputs(2, 4, 2, 75, 75, 6, seed=9)
    geo = sparse_k.row_geometry(2, 75, 75)
    idx = LightningIndexer(4, 2, 6, indexer_heads=3, indexer_dim=4)
    lay = build_selection(pattern, q, k, v, geo, layer_idx=0, selector=idx)
    assert lay.weights is None
    torch.testing.assert_close(lay.indices[:, 0], lay.indices[:, 1])
    scores = idx(q, k).detach()  # (B, T, S): block n uses its first query t = n * query_block
    per_block = scores[:, :: pattern.query_block][:, None]  # (B, 1, NB, S)
    want = brute_force_topk(pattern, per_block, geo, 75, 75, 2, 2, weighted=False)
    assert_same_selection(layout_selection(lay, geo, 75, 2, 2), want)


def _random_per_head_indexer(Hq, Hkv, D, heads=2, dim=4, seed=0):
    idx = LightningIndexer(Hq, Hkv, D, indexer_heads=heads, indexer_dim=dim, per_kv_head=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prm in idx.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g))
    return idx


@pytest.mark.parametrize("B,Hq,Hkv,S,qb,pad", [(2, 6, 3, 75, 8, 11), (1, 2, 2, 41, 1, 0)])
def test_per_kv_head_dsa_selection_matches_definition(B, Hq, Hkv, S, qb, pad):
    """Every KV head selects by its own indexer: scores from its group's queries and its own keys."""
    pattern = sparse_k.DSA(sinks=2, window=10, top_k=7, query_block=qb, indexer_heads=2, indexer_dim=4)
    q, k, v = _inputs(B, Hq, Hkv, S, S, 6, seed=S, dtype=torch.float64)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :pad] = False
    geo = sparse_k.row_geometry(B, S, S, mask)
    idx = _random_per_head_indexer(Hq, Hkv, 6, seed=S)
    lay = build_selection(pattern, q, k, v, geo, layer_idx=0, selector=idx)
    assert lay.weights is None and lay.indices.shape[1] == Hkv
    # Definition, head by head: KV head g's score is a shared indexer over g's query group and key g only.
    G = Hq // Hkv
    want_scores = torch.zeros(B, Hkv, S, S, dtype=torch.float64)
    prm = {n: t.detach().double() for n, t in idx.named_parameters()}
    for g in range(Hkv):
        qg = q[:, g * G : (g + 1) * G].transpose(1, 2).flatten(2)  # (B, T, G*D)
        kg = k[:, g] @ prm["k_weight"][g].T  # (B, S, d_I)
        qi = (qg @ prm["q_weight"][g].T).unflatten(-1, (2, 4))  # (B, T, H_I, d_I)
        w = qg @ prm["w_weight"][g].T + prm["w_bias"][g]  # (B, T, H_I)
        dots = torch.relu(torch.einsum("bthd,bsd->bths", qi, kg) / 2.0)  # sqrt(d_I) = 2
        want_scores[:, g] = torch.einsum("bth,bths->bts", w, dots)
    torch.testing.assert_close(idx(q, k).detach().permute(0, 2, 1, 3), want_scores, atol=1e-10, rtol=1e-10)
    qpos = geo.q_positions(S).expand(B, S)
    per_block = []
    for b in range(B):  # block n uses the scores of its first query (by position)
        first = [int((qpos[b] == blk * qb).nonzero()[0]) if bool((qpos[b] == blk * qb).any()) else 0
                 for blk in sorted({int(p) // qb for p in qpos[b].clamp_min(0).tolist()})]
        per_block.append(want_scores[b][:, first])
    n = max(x.shape[1] for x in per_block)
    per_block = torch.stack([torch.nn.functional.pad(x, (0, 0, 0, n - x.shape[1])) for x in per_block])
    want = brute_force_topk(pattern, per_block, geo, S, S, B, Hkv, weighted=False)
    assert_same_selection(layout_selection(lay, geo, S, B, Hkv), want)


def test_per_kv_head_decode_equals_recompute_with_memo():
    pattern = sparse_k.DSA(sinks=2, window=9, top_k=6, query_block=8, indexer_heads=3, indexer_dim=4)
    _decode_vs_recompute(pattern, _random_per_head_indexer(4, 2, 6, heads=3, seed=5), seed=6)


@pytest.mark.parametrize("dim", [8, 4])
def test_init_from_attention_scores_are_the_group_mean_logits(dim):
    """After init_from_attention the per-KV-head score is scale * (group-mean query . key) on the kept
    rotary pairs (all pairs when indexer_dim == head_dim), and the kept pairs carry the most energy."""
    B, Hq, Hkv, T, D, scale = 2, 6, 2, 23, 8, 0.37
    q, k, _ = _inputs(B, Hq, Hkv, T, T, D, seed=31, dtype=torch.float64)
    k[..., 1] *= 5.0  # pair (1, 5) dominates the energy of every head
    k[..., 5] *= 5.0
    idx = LightningIndexer(Hq, Hkv, D, indexer_heads=3, indexer_dim=dim, per_kv_head=True)
    dims = idx.init_from_attention(q, k, scale)
    assert dims.shape == (Hkv, dim)
    assert all(1 in d.tolist() and 5 in d.tolist() for d in dims)
    G = Hq // Hkv
    qm = q.view(B, Hkv, G, T, D).mean(2)
    want = torch.stack([scale * torch.einsum("btd,bsd->bts", qm[:, g][..., dims[g]], k[:, g][..., dims[g]])
                        for g in range(Hkv)], 2)  # (B, T, Hkv, S)
    torch.testing.assert_close(idx(q, k).detach(), want, atol=1e-5, rtol=1e-5)  # float32 parameters
    if dim == D:
        full = scale * torch.einsum("bgtd,bgsd->btgs", qm, k)
        torch.testing.assert_close(idx(q, k).detach(), full, atol=1e-5, rtol=1e-5)


def test_per_kv_head_indexer_errors_and_file_round_trip(tmp_path):
    from hf_sparse_attention.selectors import (
        create_selectors,
        load_selectors,
        save_selectors,
    )

    q, k, _ = _inputs(1, 4, 2, 9, 9, 6, seed=1)
    with pytest.raises(ValueError, match="per_kv_head"):
        LightningIndexer(4, 2, 6).init_from_attention(q, k, 0.5)
    with pytest.raises(ValueError, match="indexer_dim"):
        LightningIndexer(4, 2, 6, indexer_dim=3, per_kv_head=True).init_from_attention(q, k, 0.5)
    with pytest.raises(ValueError, match="indexer_heads"):
        LightningIndexer(4, 2, 6, indexer_heads=1, per_kv_head=True).init_from_attention(q, k, 0.5)
    with pytest.raises(ValueError, match="multiple"):
        LightningIndexer(5, 2, 6, per_kv_head=True)
    with pytest.raises(ValueError, match="index_keys"):
        build_selection(sparse_k.DSA(sinks=1, window=2, top_k=2, query_block=1), q, k, k, sparse_k.row_geometry(1, 9, 9),
                        layer_idx=0, selector=LightningIndexer(4, 2, 6, per_kv_head=True), index_keys=torch.zeros(1, 9, 32))
    model = tiny_llama()
    sels = create_selectors(model, sparse_k.DSA(indexer_heads=2, indexer_dim=4), per_kv_head=True)
    back = load_selectors(save_selectors(sels, str(tmp_path)))
    assert back[0].per_kv_head and back[0].key_width == 4 * back[0].num_kv_heads
    for i in sels:
        assert all(torch.equal(a, b) for a, b in zip(sels[i].parameters(), back[i].parameters()))


def _decode_vs_recompute(pattern, selector, B=2, Hq=4, Hkv=2, S=90, D=6, prefill=37, pad=5, seed=0):
    memo = {} if selector is None else None
    q, k, v = _inputs(B, Hq, Hkv, S, S, D, seed=seed)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :pad] = False
    full_geo = sparse_k.row_geometry(B, S, S, mask)
    with torch.no_grad():
        full = build_selection(pattern, q, k, v, full_geo, layer_idx=0, selector=selector)
    want = layout_selection(full, full_geo, S, B, Hkv)
    steps = [(0, prefill)] + [(t, t + 1) for t in range(prefill, S)]
    seen = {}
    for t0, t1 in steps:
        geo = sparse_k.row_geometry(B, t1 - t0, t1, mask[:, :t1])
        with torch.no_grad():
            lay = build_selection(pattern, q[:, :, t0:t1], k[:, :, :t1], v[:, :, :t1], geo, layer_idx=0, selector=selector,
                                  memo=memo)
        got = layout_selection(lay, geo, t1 - t0, B, Hkv)
        for key, val in got.items():
            assert val[0] == want[key][0], f"step {t1}, {key}: {val[0]} != {want[key][0]}"
            if val[1] is not None:
                torch.testing.assert_close(torch.tensor(val[1]), torch.tensor(want[key][1]), atol=1e-6, rtol=0)
            seen[key] = val
    assert seen.keys() == want.keys()


def test_decode_equals_recompute_sparsek():
    pattern = sparse_k.SparseK(sinks=2, window=9, top_k=6, query_block=8)
    _decode_vs_recompute(pattern, _random_scorer(2, 6), seed=1)


def test_decode_equals_recompute_fallback():
    pattern = sparse_k.SparseK(sinks=1, window=7, top_k=5, query_block=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _decode_vs_recompute(pattern, None, seed=2)


def test_decode_equals_recompute_dsa_with_memo():
    pattern = sparse_k.DSA(sinks=2, window=9, top_k=6, query_block=8, indexer_heads=2, indexer_dim=4)
    _decode_vs_recompute(pattern, LightningIndexer(4, 2, 6, indexer_heads=2, indexer_dim=4), seed=3)


def test_dsa_memo_check_reads_nothing_from_the_device():
    """A DSA call that starts inside a query block checks the indexer's memo on the host (``block_ring``'s mirror):
    no device read in ``_dsa_block_queries``; it warns only where the memo lacks the block (a fresh indexer, or a draft
    cut back past the ring)."""
    from helpers import host_reads
    from sparse_k.selection import block_ring
    from sparse_k.warn import _WARNED

    qb = 8
    pattern = sparse_k.DSA(sinks=2, window=9, top_k=6, query_block=qb, indexer_heads=2, indexer_dim=4)
    B, S = 2, 45 + qb * block_ring.ring_blocks(qb)
    q, k, v = _inputs(B, 4, 2, S, S, 6, seed=7)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :3] = False

    def call(indexer, t0, t1):
        geo = sparse_k.row_geometry(B, t1 - t0, t1, mask[:, :t1])
        with torch.no_grad():
            build_selection(pattern, q[:, :, t0:t1], k[:, :, :t1], v[:, :, :t1], geo, layer_idx=0, selector=indexer)

    def warned(indexer, t0, t1):
        for key in [w for w in _WARNED if w.startswith("dsa: a call starts inside")]:
            _WARNED.discard(key)
        with warnings.catch_warnings(record=True) as rec, host_reads() as hits:
            warnings.simplefilter("always")
            call(indexer, t0, t1)
        assert not [h for h in hits if "_dsa_block_queries" in h], hits
        return any("dsa: a call starts inside" in str(w.message) for w in rec)

    indexer = LightningIndexer(4, 2, 6, indexer_heads=2, indexer_dim=4)
    call(indexer, 0, 37)  # prefill: rows at positions 0-36 and 0-33, both end inside a block
    assert not warned(indexer, 37, 38)
    assert not warned(indexer, 38, 45)  # a draft of 7 tokens from inside the block
    fresh = LightningIndexer(4, 2, 6, indexer_heads=2, indexer_dim=4)
    fresh.load_state_dict(indexer.state_dict())
    assert warned(fresh, 38, 39)  # this indexer saw no earlier call
    call(indexer, 45, S)  # the ring moves past the blocks of position 37
    assert warned(indexer, 37, 38)  # cut back into a block the ring no longer holds


@pytest.mark.parametrize("Sq", [150, 1])
def test_torch_path_equals_reference_and_gradients_reach_scorer(Sq):
    pattern = sparse_k.SparseK(sinks=3, window=21, top_k=13, query_block=16)
    B, Hq, Hkv, Skv, D = 2, 4, 2, 150, 8
    q, k, v = _inputs(B, Hq, Hkv, Sq, Skv, D, seed=Sq, dtype=torch.float64)
    geo = sparse_k.row_geometry(B, Sq, Skv)
    grads, outs = {}, {}
    for backend in ("reference", "torch"):
        scorer = SparseKScorer(Hkv, D)
        torch.manual_seed(0)
        with torch.no_grad():
            for prm in scorer.parameters():
                prm.copy_(torch.randn_like(prm) * 0.5)
        sel = build_selection(pattern, q, k, v, geo, layer_idx=0, selector=scorer)
        out = sparse_k.sparse_attention(q, k, v, pattern, selection=sel, backend=backend)
        out.square().sum().backward()
        outs[backend] = out.detach()
        grads[backend] = {n: p.grad.clone() for n, p in scorer.named_parameters()}
    # Both paths run in float64: differences are summation order only.
    torch.testing.assert_close(outs["torch"], outs["reference"], atol=1e-10, rtol=1e-10)
    for name in grads["reference"]:
        torch.testing.assert_close(grads["torch"][name], grads["reference"][name], atol=1e-8, rtol=1e-8)
    assert float(grads["torch"]["weight"].abs().sum()) > 0
    assert float(grads["torch"]["log_gain"].abs().sum()) > 0


def test_no_selection_cases_and_bad_inputs():
    q, k, v = _inputs(1, 2, 1, 20, 20, 4, seed=4)
    geo = sparse_k.row_geometry(1, 20, 20)
    assert build_selection(sparse_k.Streaming(sinks=2, window=4), q, k, v, geo, layer_idx=0) is None
    assert build_selection(sparse_k.SparseK(window=64), q, k, v, geo, layer_idx=0) is None  # no candidate yet
    assert build_selection(sparse_k.SparseK(top_k=0, window=2), q, k, v, geo, layer_idx=0) is None
    with pytest.raises(TypeError, match="LightningIndexer"):
        build_selection(sparse_k.DSA(window=2), q, k, v, geo, layer_idx=0, selector=SparseKScorer(1, 4))
    with pytest.raises(ValueError, match="layer_idx"):
        build_selection(sparse_k.SparseK(window=2), q, k, v, geo, layer_idx=-1)
    with pytest.raises(ValueError, match="multiple"):
        build_selection(sparse_k.SparseK(window=2), q[:, :1].expand(1, 3, 20, 4), k.expand(1, 2, 20, 4),
                        v.expand(1, 2, 20, 4), geo, layer_idx=0)
    with pytest.raises(TypeError, match="RowGeometry"):
        build_selection(sparse_k.SparseK(window=2), q, k, v, None, layer_idx=0)
    with pytest.raises(ValueError, match="value"):
        SparseKScorer(2, 4, key_norm_term=False)(v, geo.k_positions(20))
    with pytest.raises(ValueError, match="key"):
        SparseKScorer(1, 4)(v, geo.k_positions(20))


def test_untrained_scorer_ranks_by_small_key_norm():
    pattern = sparse_k.SparseK(sinks=2, window=8, top_k=5, query_block=8)
    q, k, v = _inputs(2, 4, 2, 77, 77, 6, seed=8)
    geo = sparse_k.row_geometry(2, 77, 77)
    by_norm = sparse_k.selection.selectors.selection_from_scores(pattern, training_free_scores(k)[:, :, None], geo, 77, 77)
    scored = build_selection(pattern, q, k, v, geo, layer_idx=0, selector=SparseKScorer(2, 6))
    assert torch.equal(by_norm.indices, scored.indices)


def test_attach_save_load_outside_state_dict(tmp_path):
    from hf_sparse_attention.selectors import (
        SELECTOR_FILE,
        attach_selectors,
        create_selectors,
        get_selectors,
        load_selectors,
        load_selectors_for_model,
        save_selectors,
    )

    model = tiny_llama()
    keys_before = set(model.state_dict())
    n_params = sum(1 for _ in model.parameters())
    sels = create_selectors(model, sparse_k.SparseK())
    assert sorted(sels) == [0, 1, 2]
    attach_selectors(model, sels)
    assert set(model.state_dict()) == keys_before
    assert sum(1 for _ in model.parameters()) == n_params
    assert get_selectors(model)[1] is sels[1]
    path = save_selectors(model, str(tmp_path))
    assert path.endswith(SELECTOR_FILE)
    back = load_selectors(str(tmp_path))
    for i in sels:
        for (n1, p1), (n2, p2) in zip(sels[i].named_parameters(), back[i].named_parameters()):
            assert n1 == n2 and torch.equal(p1, p2)

    fresh = tiny_llama()
    fresh.config.sparse_attention = {"pattern": "sparse_k", "selector_path": path}
    assert load_selectors_for_model(fresh)
    assert torch.equal(get_selectors(fresh)[2].weight, sels[2].weight)

    # configure(model, ..., selector_path=...) loads and attaches them at once.
    from hf_sparse_attention import configure

    third = tiny_llama()
    configure(third, "sparse_k", selector_path=path)
    assert torch.equal(get_selectors(third)[1].weight, sels[1].weight)


def test_loading_without_or_with_bad_selectors_never_fails(tmp_path):
    from hf_sparse_attention.selectors import (
        create_selectors,
        get_selectors,
        load_selectors_for_model,
        save_selectors,
    )

    model = tiny_llama()
    model.config.sparse_attention = {"pattern": "sparse_k", "selector_path": str(tmp_path / "missing.safetensors")}
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert load_selectors_for_model(model) is False
    model.config.sparse_attention = {"pattern": "sparse_k"}
    assert load_selectors_for_model(model) is False  # no key, no default file: silently nothing
    other = create_selectors(model, sparse_k.SparseK())
    other[0] = SparseKScorer(2, 4)  # wrong head_dim for this model (8)
    bad = save_selectors(other, str(tmp_path / "bad.safetensors"))
    model.config.sparse_attention = {"pattern": "sparse_k", "selector_path": bad}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert load_selectors_for_model(model) is False
    assert any("do not match" in str(w.message) for w in rec)
    assert get_selectors(model) == {}
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    model.config.sparse_attention = {"pattern": "sparse_k", "selector_path": str(tmp_path / "garbage.safetensors")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_selectors_for_model(model) is False


def test_block_chunking_does_not_change_the_selection(monkeypatch):
    import sparse_k.selection.selectors as selectors_mod

    pattern = sparse_k.SparseK(sinks=2, window=8, top_k=6, query_block=8)
    q, k, v = _inputs(2, 2, 2, 130, 130, 4, seed=21)
    geo = sparse_k.row_geometry(2, 130, 130)
    scorer = _random_scorer(2, 4)
    whole = build_selection(pattern, q, k, v, geo, layer_idx=0, selector=scorer)
    monkeypatch.setattr(selectors_mod, "_CHUNK_ELEMENTS", 2 * 2 * 130 * 3)  # 3 blocks per chunk
    chunked = build_selection(pattern, q, k, v, geo, layer_idx=0, selector=scorer)
    assert torch.equal(whole.indices, chunked.indices) and torch.equal(whole.counts, chunked.counts)
    torch.testing.assert_close(whole.weights, chunked.weights, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["sparse_k", "dsa", "dsa-per-kv-head"])
def test_generate_with_attached_selectors_equals_recompute(name):
    """Through the Transformers integration: cached decoding with trained-like (random) selectors
    gives the logits of recomputing the whole prefix at every step (DSA relies on its block memo)."""
    model = sparse_tiny_llama(name[:3] if name.startswith("dsa") else name,
                              {"sinks": 2, "window": 8, "top_k": 4, "query_block": 4}, per_kv_head=name.endswith("head"))
    seq = torch.randint(1, 50, (1, 29), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(seq[:, :11], use_cache=True)
        cache, cached = out.past_key_values, [out.logits[:, -1]]
        for t in range(11, 29):
            out = model(seq[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            cached.append(out.logits[:, -1])
        recomputed = [model(seq[:, :t], use_cache=False).logits[:, -1] for t in range(11, 30)]
    # float32 forward passes of different lengths: only summation order differs.
    torch.testing.assert_close(torch.stack(cached), torch.stack(recomputed), atol=1e-4, rtol=1e-4)
