"""Incremental learned selection for decoding: the SparseK decode state, SparseCache's SelectionLayer
(eviction for sparse_k, cached indexer keys for dsa) and the synchronisation-free build path."""

import warnings

import pytest
import sparse_k
import torch
from helpers import sparse_tiny_llama
from sparse_k.selection.decode_selection import SparseKDecodeState
from sparse_k.selection.scorers import LightningIndexer, SparseKScorer
from sparse_k.selection.selectors import build_selection, selection_from_scores, training_free_scores


def _random_scorer(hkv, d, seed):
    scorer = SparseKScorer(hkv, d)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prm in scorer.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g, dtype=prm.dtype))
        scorer.log_gain.fill_(0.0)  # gain 1: many fractional SparseK weights, a large support
    return scorer.double()


def _recomputed(pattern, k, v, pos, selector):
    """Selection of the block of query position ``pos`` from scratch (build_selection on the prefix)."""
    B, H, _, D = k.shape
    q = torch.zeros(B, H, 1, D, dtype=k.dtype)
    geo = sparse_k.row_geometry(B, 1, pos + 1)
    with torch.no_grad():
        if selector is None:  # the key-norm score the unweighted state is tested with
            return selection_from_scores(pattern, training_free_scores(k[:, :, : pos + 1])[:, :, None], geo, 1, pos + 1)
        lay = build_selection(pattern, q, k[:, :, : pos + 1], v[:, :, : pos + 1], geo, layer_idx=0, selector=selector)
    return lay


@pytest.mark.parametrize("weighted,quantise", [(True, False), (True, True), (False, False)])
def test_decode_state_equals_recompute_at_every_step(weighted, quantise):
    """Position by position, the incremental state's selection (indices and SparseK weights) equals
    build_selection from scratch; ``quantise`` rounds the values so many scores tie exactly."""
    pattern = sparse_k.SparseK(sinks=3, window=11, top_k=7, query_block=5)
    B, H, S, D = 2, 2, 140, 4
    g = torch.Generator().manual_seed(7)
    k = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    if quantise:
        v = v.round()
    scorer = _random_scorer(H, D, seed=3) if weighted else None
    if scorer is not None and quantise:
        with torch.no_grad():
            scorer.pos_weight.zero_()
            scorer.key_norm_weight.zero_()
    state = SparseKDecodeState(pattern, weighted=weighted)
    merged = []

    def scores(lo, hi):
        merged.append(hi - lo + 1)
        with torch.no_grad():
            if scorer is None:
                return training_free_scores(k[:, :, lo : hi + 1])
            return scorer(v[:, :, lo : hi + 1], torch.arange(lo, hi + 1)[None], k[:, :, lo : hi + 1])

    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for pos in range(S):
            state.advance(pos // pattern.query_block, scores)
            want = _recomputed(pattern, k, v, pos, scorer)
            if want is None:
                assert state.positions is None
                continue
            n = want.indices.shape[2] - 1  # the last block of the prefix holds the query
            c = want.counts[:, :, n].long()
            assert torch.equal(state.counts, c)
            for b in range(B):
                for h in range(H):
                    got = state.positions[b, h, : c[b, h]]
                    assert torch.equal(got, want.indices[b, h, n, : c[b, h]].long()), (pos, b, h)
                    if weighted:
                        # The float64 threshold sums the fractional entries in another order: rounding only.
                        torch.testing.assert_close(state.weights[b, h, : c[b, h]], want.weights[b, h, n, : c[b, h]],
                                                   atol=1e-12, rtol=0)
            checked += 1
    assert checked > 100
    assert max(merged) <= pattern.query_block  # one block of new candidates per advance (after the first)
    assert state.sup_u.shape[-1] < S - pattern.window - pattern.sinks  # the support was pruned


def _step_logits(model, seq, prefill, cache):
    with torch.no_grad():
        out = model(seq[:, :prefill], past_key_values=cache, use_cache=True)
        logits, lengths = [out.logits[:, -1]], []
        for t in range(prefill, seq.shape[1]):
            out = model(seq[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            if hasattr(cache, "cached_lengths"):
                lengths.append(cache.cached_lengths())
    return torch.stack(logits), lengths


@pytest.mark.parametrize("kind,logits", [("trained", None), ("refined", "gathered"), ("refined", "matmul"),
                                         ("refined_per_query", "gathered"), ("refined_per_query", "matmul"),
                                         ("training_free", None)])
def test_sparse_cache_evicts_and_equals_recompute(kind, logits, monkeypatch):
    """sparse_k through the Transformers integration: SparseCache with eviction == without eviction ==
    recomputing the prefix at every step, and the evicting cache stays bounded (trained scorer; with ``refine`` the
    cache keeps the scorer's pool of ``refine * top_k`` keys, and a block's refinement reads its first query, kept
    across calls; the training-free default keeps every key and still equals the recompute)."""
    from hf_sparse_attention import SparseCache
    from sparse_k.selection import page_selection

    if logits is not None:  # both ways the refinement computes its logits (page_selection._dense_refine)
        monkeypatch.setattr(page_selection, "_dense_refine", lambda *a: logits == "matmul")
    params = {"sinks": 2, "window": 8, "top_k": 5, "query_block": 4}
    if kind.startswith("refined"):
        params.update(top_k=3, refine=2, query_block=1 if kind == "refined_per_query" else 4)
    model = sparse_tiny_llama("sparse_k", params, random_selectors=kind != "training_free")
    seq = torch.randint(1, 50, (2, 70), generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        evicting, lengths = _step_logits(model, seq, 13, SparseCache(model))
        keeping, _ = _step_logits(model, seq, 13, SparseCache(model, evict=False))
        with torch.no_grad():
            recomputed = torch.stack([model(seq[:, :t], use_cache=False).logits[:, -1] for t in range(13, 71)])
    # float32 forwards of different lengths and slot orders: summation order only.
    torch.testing.assert_close(keeping, recomputed, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(evicting, keeping, atol=1e-4, rtol=1e-4)
    if kind == "training_free":  # the query-aware training-free selection evicts nothing
        assert lengths[-1] == [70] * len(lengths[-1])
        return
    kept = params["top_k"] * params.get("refine", 1)
    bound = params["sinks"] + kept + params["window"] + params["query_block"] - 2
    assert max(max(x) for x in lengths[20:]) <= bound
    assert min(min(x) for x in lengths[20:]) >= params["sinks"] + kept + params["window"] - 1


@pytest.mark.parametrize("beam_idx", [[1, 0], [1, 1]])
def test_beam_reorder_of_an_evicting_cache_equals_running_the_reordered_rows(beam_idx):
    """sparse_k with a trained scorer: after keys were evicted, ``reorder_cache(beam_idx)`` permutes the kept
    keys, their positions and the running selection together; the next steps equal a cache that ran the
    reordered rows from the start (a permutation, and one row duplicated)."""
    from hf_sparse_attention import SparseCache

    params = {"sinks": 2, "window": 8, "top_k": 5, "query_block": 4}
    model = sparse_tiny_llama("sparse_k", params, random_selectors=True)
    seq = torch.randint(1, 50, (2, 45), generator=torch.Generator().manual_seed(6))
    rows = torch.tensor(beam_idx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = SparseCache(model)
        _step_logits(model, seq[:, :30], 13, cache)
        assert any(layer.selection.evicted for layer in cache.layers)
        cache.reorder_cache(rows)
        after = []
        with torch.no_grad():
            for t in range(30, 45):
                after.append(model(seq[rows, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
        want, _ = _step_logits(model, seq[rows], 13, SparseCache(model))
    torch.testing.assert_close(torch.stack(after), want[-15:], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want[-1, 0], want[-1, 1]) or beam_idx == [1, 1]


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_dsa_cache_keeps_indexer_keys(monkeypatch, per_kv_head):
    """dsa with SparseCache: decode computes indexer keys of the new token only, logits == recompute
    (shared and per-KV-head indexers)."""
    from hf_sparse_attention import SparseCache

    params = {"sinks": 2, "window": 8, "top_k": 5, "query_block": 1}
    model = sparse_tiny_llama("dsa", params, per_kv_head=per_kv_head)
    seq = torch.randint(1, 50, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        recomputed = torch.stack([model(seq[:, :t], use_cache=False).logits[:, -1] for t in range(11, 41)])
    seen = []
    original = LightningIndexer.index_keys

    def counting(self, key):
        seen.append(key.shape[2])
        return original(self, key)

    monkeypatch.setattr(LightningIndexer, "index_keys", counting)
    cached, _ = _step_logits(model, seq, 11, SparseCache(model))
    torch.testing.assert_close(cached, recomputed, atol=1e-4, rtol=1e-4)
    n_layers = 3
    assert seen[:n_layers] == [11] * n_layers and set(seen[n_layers:]) == {1}


def test_dsa_padded_decode_equals_recompute():
    """dsa with ``query_block > 1`` on a left-padded batch (DynamicCache): the rows are at different places in
    their blocks (one starts a block while the other is inside one, which takes its block's first query from
    the indexer's memo); every step's logits equal recomputing each row's unpadded prefix."""
    from transformers import DynamicCache

    params = {"sinks": 2, "window": 6, "top_k": 4, "query_block": 4}
    model = sparse_tiny_llama("dsa", params)
    S, P, pad = 30, 13, 3
    seq = torch.randint(1, 50, (2, S), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(2, S, dtype=torch.long)
    mask[0, :pad] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        cache, got = DynamicCache(), []
        model(seq[:, :P], attention_mask=mask[:, :P], position_ids=position_ids[:, :P], past_key_values=cache, use_cache=True)
        for t in range(P, S):
            out = model(seq[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=position_ids[:, t : t + 1],
                        past_key_values=cache, use_cache=True)
            got.append(out.logits[:, -1])
        # Recomputed after the decode: a full forward rewrites the indexer's memo of block queries.
        want = [torch.stack([model(seq[r : r + 1, start : t + 1], use_cache=False).logits[0, -1] for r, start in ((0, pad), (1, 0))])
                for t in range(P, S)]
    torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=1e-4, rtol=1e-4)


def test_build_without_host_offsets_equals_host_build(monkeypatch):
    """The build path sized from bounds (offsets only on the device, as for a padded batch on a GPU)
    selects exactly what the host-sized build selects; only empty trailing blocks/slots differ."""
    from sparse_k.layouts.geometry import RowGeometry

    pattern = sparse_k.SparseK(sinks=3, window=9, top_k=6, query_block=8)
    B, Hq, Hkv, S, D = 2, 4, 2, 75, 8
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hq, Hkv, Hkv))
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :6] = False
    scorer = _random_scorer(Hkv, D, seed=1).float()
    indexer = LightningIndexer(Hq, Hkv, D, indexer_heads=2, indexer_dim=4)
    for pat, sel in ((pattern, scorer), (sparse_k.DSA(sinks=3, window=9, top_k=6, query_block=8), indexer)):
        for Sq in (S, 1, 13):
            geo = sparse_k.row_geometry(B, Sq, S, mask)
            with torch.no_grad():
                indexer._block_memo = None
                host = build_selection(pat, q[:, :, S - Sq :], k, v, geo, layer_idx=0, selector=sel)
                monkeypatch.setattr(RowGeometry, "host_offsets", lambda self: None)
                indexer._block_memo = None
                blind = build_selection(pat, q[:, :, S - Sq :], k, v, geo, layer_idx=0, selector=sel)
                monkeypatch.undo()
            nb, kk = host.indices.shape[2:]
            assert blind.indices.shape[2] >= nb and blind.indices.shape[3] >= kk
            assert torch.equal(blind.counts[:, :, :nb], host.counts) and not bool(blind.counts[:, :, nb:].any())
            assert torch.equal(blind.first_block, host.first_block)
            ok = torch.arange(kk) < host.counts[..., None]
            assert torch.equal(torch.where(ok, blind.indices[:, :, :nb, :kk], -1), torch.where(ok, host.indices, -1))
            if host.weights is not None:
                torch.testing.assert_close(torch.where(ok, blind.weights[:, :, :nb, :kk], 0.0),
                                           torch.where(ok, host.weights, 0.0), atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("masked", [False, True])
def test_build_selection_does_not_synchronise_on_the_gpu(masked):
    """Top-k over scores into the token layout with no host synchronisation
    (torch.cuda.set_sync_debug_mode('error') raises on any), prefill and decode, SparseK and DSA."""
    dev = torch.device("cuda")
    B, Hq, Hkv, S, D = 2, 8, 2, 1000, 64
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, generator=g, device=dev, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    mask = torch.ones(B, S, dtype=torch.bool, device=dev)
    mask[1, :37] = False
    cases = [(sparse_k.SparseK(sinks=4, window=64, top_k=64, query_block=64), SparseKScorer(Hkv, D).to(dev)),
             (sparse_k.SparseK(sinks=4, window=64, top_k=64, query_block=64), None),
             (sparse_k.DSA(sinks=4, window=64, top_k=64, query_block=1), LightningIndexer(Hq, Hkv, D).to(dev)),
             (sparse_k.DSA(sinks=4, window=64, top_k=64, query_block=1),
              LightningIndexer(Hq, Hkv, D, indexer_heads=2, per_kv_head=True).to(dev))]
    for pattern, sel in cases:
        for Sq in (S, 1):
            geo = sparse_k.row_geometry(B, Sq, S, mask if masked else None, device=dev)
            warnings.simplefilter("ignore")
            build_selection(pattern, q[:, :, S - Sq :], k, v, geo, layer_idx=0, selector=sel)  # warm-up
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.no_grad():
                    lay = build_selection(pattern, q[:, :, S - Sq :], k, v, geo, layer_idx=0, selector=sel)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert lay is not None and lay.indices.is_cuda
