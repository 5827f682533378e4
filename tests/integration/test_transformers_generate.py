"""Prefill, chunked prefill, decode and ``generate`` with ``attn_implementation="sparse_k"``.

Cached generation must equal recomputing the whole prefix each step with the same pattern, token
for token; a StaticCache must equal a DynamicCache; chunked prefill must equal one prefill.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_sparse_attention
from hf_sparse_attention.selectors import attach_selectors, create_selectors
from tiny_models import FIXED_PATTERNS, VOCAB, one_thread, tiny_model  # noqa: F401

transformers = pytest.importorskip("transformers")

GEN_PATTERNS = {
    "streaming": {"sinks": 3, "window": 9},
    "sliding_window": {"window": 10},
    "bigbird": FIXED_PATTERNS["bigbird"],
    "block_diagonal": {"block": 12},
}


def _setup(family, name, params, seed=0):
    model = tiny_model(family, seed=seed)
    hf_sparse_attention.configure(model, name, **params)
    model.set_attn_implementation("sparse_k")
    return model


def _recompute_greedy(model, ids, steps):
    seq = ids
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    return seq


@pytest.mark.parametrize("name", list(GEN_PATTERNS))
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_generate_equals_recompute(family, name):
    model = _setup(family, name, GEN_PATTERNS[name], seed=5)
    ids = torch.randint(1, VOCAB, (1, 13))
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    ref = _recompute_greedy(model, ids, 32)
    assert torch.equal(gen, ref)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma3"])
def test_static_cache_equals_dynamic_cache(family):
    model = _setup(family, "streaming", {"sinks": 2, "window": 8}, seed=6)
    ids = torch.randint(1, VOCAB, (2, 17))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in row 1
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        dyn = model.generate(ids, **kw)
        static = model.generate(ids, cache_implementation="static", **kw)
        single = model.generate(ids[1:, 5:], **{**kw, "attention_mask": None})
    assert torch.equal(dyn, static)
    assert torch.equal(dyn[1, 5:], single[0])


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_chunked_prefill_and_multi_token_decode(family, cache_kind):
    model = _setup(family, "bigbird", FIXED_PATTERNS["bigbird"], seed=7)
    ids = torch.randint(1, VOCAB, (2, 47))
    with torch.no_grad():
        full = model(ids).logits
        if cache_kind == "static":
            cache = transformers.StaticCache(config=model.config, max_cache_len=64)
        else:
            cache = transformers.DynamicCache(config=model.config)
        parts = []
        for lo, hi in ((0, 20), (20, 21), (21, 33), (33, 47)):
            out = model(ids[:, lo:hi], past_key_values=cache, use_cache=True)
            parts.append(out.logits)
    chunked = torch.cat(parts, 1)
    assert (chunked - full).abs().max() < 1e-4


def test_sampling_generate_runs_with_padding():
    model = _setup("llama", "streaming", {"sinks": 2, "window": 6}, seed=8)
    ids = torch.randint(1, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=True, top_k=5, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    assert out.shape == (2, 21)
    assert bool(((out[:, 9:] >= 0) & (out[:, 9:] < VOCAB)).all())


@pytest.mark.parametrize("name", ["sparse_k", "dsa"])
def test_learned_pattern_generate_equals_recompute(name):
    """Training-free selection (no trained selector): decode selects per query block exactly as recompute."""
    params = {"sinks": 2, "window": 8, "top_k": 4, "query_block": 4}
    model = _setup("llama", name, params, seed=5)
    ids = torch.randint(1, VOCAB, (1, 13))
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(gen, _recompute_greedy(model, ids, 24))
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=8)
    with torch.no_grad():
        static_only = model(gen).logits
    hf_sparse_attention.configure(model, name, **params)
    with torch.no_grad():
        learned = model(gen).logits
    assert (learned - static_only).abs().max() > 1e-2


LEARNED_PARAMS = {"sinks": 2, "window": 8, "top_k": 4, "query_block": 4}


def _beam_setup(name, trained, seed):
    model = _setup("llama", name, LEARNED_PARAMS if name in ("sparse_k", "dsa") else GEN_PATTERNS[name], seed=seed)
    if trained:  # random selectors, weights large enough that their choices differ from the training-free ones
        torch.manual_seed(seed)
        selectors = create_selectors(model)
        for sel in selectors.values():
            for w in sel.parameters():
                torch.nn.init.normal_(w, std=0.5)
        attach_selectors(model, selectors)
    return model


@pytest.mark.parametrize("cache", ["dynamic", "static", "sparse"])
@pytest.mark.parametrize("name,trained", [("streaming", False), ("bigbird", False), ("sparse_k", False), ("dsa", False),
                                          ("sparse_k", True), ("dsa", True)])
def test_beam_search_with_cache_equals_beam_search_recomputed(name, trained, cache):
    """``num_beams`` reorders the cache's rows between steps (``reorder_cache``); the selection's memo of a query
    block's first query must follow them (blocks of 4 queries span several decode steps), so the beams equal those
    of a search that recomputes every prefix."""
    for seed in range(2):
        model = _beam_setup(name, trained, seed)
        ids = torch.randint(1, VOCAB, (2, 13))
        kw = dict(max_new_tokens=14, min_new_tokens=14, do_sample=False, pad_token_id=0, num_beams=3)
        extra = {"dynamic": {}, "static": {"cache_implementation": "static"},
                 "sparse": {"past_key_values": hf_sparse_attention.SparseCache(model)}}[cache]
        with torch.no_grad():
            cached = model.generate(ids, **extra, **kw)
            recomputed = model.generate(ids, use_cache=False, **kw)
        assert torch.equal(cached, recomputed), (seed, cached, recomputed)


@pytest.mark.parametrize("name,trained,cache", [("sliding_window", False, "dynamic"), ("bigbird", False, "dynamic"),
                                                ("sparse_k", False, "dynamic"), ("dsa", False, "dynamic"),
                                                ("dsa", True, "dynamic"), ("sparse_k", False, "sparse"),
                                                ("dsa", False, "sparse"), ("dsa", True, "sparse")])
def test_prompt_lookup_decoding_equals_recompute(name, trained, cache):
    """Prompt-lookup (assisted) decoding drafts tokens and crops the cache where the model rejects them; the tokens
    must be those of recomputing every prefix. Learned layers with query blocks of 4: a rejected draft that started a
    block sends the next call back into the block before it, whose first query the memo's ring still holds (by its
    host mirror too: no call warns of a missing first query). A SparseCache whose learned layers evicted nothing can
    be cropped (``is_croppable``: Transformers 5.24+ refused it before the first draft)."""
    from sparse_k.warn import _WARNED

    missing = ("first query was not seen", "first query the indexer has not seen")
    for seed in range(2):
        model = _beam_setup(name, trained, seed)
        model.generation_config.eos_token_id = None  # min_new_tokens would mask it, the recomputation would not
        ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed)).repeat(1, 4)
        extra = {"past_key_values": hf_sparse_attention.SparseCache(model)} if cache == "sparse" else {}
        _WARNED.difference_update({w for w in _WARNED if any(m in w for m in missing)})
        with torch.no_grad(), warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            drafted = model.generate(ids, prompt_lookup_num_tokens=5, max_new_tokens=30, min_new_tokens=30,
                                     do_sample=False, pad_token_id=0, **extra)
        assert not [str(w.message) for w in rec if any(m in str(w.message) for m in missing)], seed
        assert torch.equal(drafted, _recompute_greedy(model, ids, 30)), seed


def test_sparse_cache_that_evicted_is_not_croppable():
    """A learned layer of a SparseCache reports ``is_croppable`` until it evicts keys (trained SparseK scorer), so
    assisted decoding on Transformers 5.24+ is refused up front rather than failing at the first crop."""
    model = _beam_setup("sparse_k", True, 0)
    cache = hf_sparse_attention.SparseCache(model)
    assert cache.selection_layers and all(cache.layers[i].is_croppable for i in cache.selection_layers)
    with torch.no_grad():
        model(torch.randint(1, VOCAB, (1, 40)), past_key_values=cache, use_cache=True)
    assert any(cache.layers[i].selection.evicted for i in cache.selection_layers)
    assert not any(cache.layers[i].is_croppable for i in cache.selection_layers if cache.layers[i].selection.evicted)
