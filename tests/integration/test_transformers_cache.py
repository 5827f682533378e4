"""Bounded ``SparseCache``: flat memory for streaming generation, in both position modes (design §8)."""

from __future__ import annotations

import warnings

import psutil
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hf_sparse_attention
from hf_sparse_attention import SparseCache
from hf_sparse_attention.cache import BoundedLayer
from sparse_k.selection import block_ring
from tiny_models import VOCAB, model_windows, one_thread, tiny_model  # noqa: F401

transformers = pytest.importorskip("transformers")


class CacheProbe(transformers.LogitsProcessor):
    """Records the cache's kept lengths and tensor bytes at every generation step (scores unchanged)."""

    def __init__(self, cache, rss_at: int):
        self.cache, self.rss_at = cache, rss_at
        self.lengths, self.nbytes, self.rss = [], [], []

    def __call__(self, input_ids, scores):
        self.lengths.append(max(self.cache.cached_lengths()))
        self.nbytes.append(self.cache.nbytes())
        if len(self.lengths) in (self.rss_at, 0) or len(self.lengths) % 1000 == 0:
            self.rss.append(psutil.Process().memory_info().rss)
        return scores


@pytest.mark.slow
def test_original_positions_4000_tokens_flat_and_equal_to_recompute():
    model = tiny_model("llama", seed=11)
    hf_sparse_attention.configure(model, "streaming", sinks=4, window=256)
    model.set_attn_implementation("sparse_k")
    ids = torch.randint(1, VOCAB, (1, 8))
    cache = SparseCache(model)
    assert cache.bounded_layers == [0, 1]
    probe = CacheProbe(cache, rss_at=600)
    new = 4000
    with torch.no_grad():
        gen = model.generate(
            ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
            logits_processor=transformers.LogitsProcessorList([probe]),
        )
        # One causal forward over the generated text gives the logits that recomputing the whole
        # prefix at each step would give (logits at t depend on tokens <= t only).
        recompute = model(gen[:, : 8 + 300], use_cache=False).logits.argmax(-1)
    assert gen.shape[1] == 8 + new
    assert torch.equal(gen[0, 8 : 8 + 300], recompute[0, 7 : 7 + 300])
    assert max(probe.lengths) <= 260
    warm = probe.nbytes[300]
    assert all(b == warm for b in probe.nbytes[300:])
    assert (probe.rss[-1] - probe.rss[0]) / probe.rss[0] < 0.05


def test_rolling_positions_equal_in_cache_recompute():
    """One layer: a step's logits equal a fresh dense forward over ``[sinks, window, token]`` at positions 0..n-1."""
    sinks, window, prompt, new = 2, 8, 6, 30
    model = tiny_model("llama", seed=12, layers=1)
    hf_sparse_attention.configure(model, "streaming", sinks=sinks, window=window, cache_positions="rolling")
    model.set_attn_implementation("sparse_k")
    ids = torch.randint(1, VOCAB, (1, prompt))
    cache = SparseCache(model)
    assert cache.mode == "rolling"
    with torch.no_grad():
        out = model.generate(
            ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
            return_dict_in_generate=True, output_logits=True,
        )
    seq = out.sequences[0]
    model.set_attn_implementation("sdpa")
    worst = 0.0
    with torch.no_grad():
        for k, logits in enumerate(out.logits):
            t = prompt - 1 + k  # index of the token fed at this step
            in_cache = torch.cat([seq[:sinks], seq[max(sinks, t - window + 1) : t + 1]])
            fresh = model(in_cache[None], use_cache=False).logits[0, -1]
            worst = max(worst, float((fresh - logits[0]).abs().max()))
    assert worst < 1e-4
    # Rolling differs from original positions once keys are dropped.
    hf_sparse_attention.configure(model, "streaming", sinks=sinks, window=window, cache_positions="original")
    model.set_attn_implementation("sparse_k")
    with torch.no_grad():
        orig = model.generate(
            ids, past_key_values=SparseCache(model), max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=0, return_dict_in_generate=True, output_logits=True,
        )
    assert float((orig.logits[-1] - out.logits[-1]).abs().max()) > 1e-3


def test_mixed_cache_keeps_dense_layers_whole():
    model = tiny_model("llama", seed=13)
    hf_sparse_attention.configure(model, "sliding_window", window=7, dense_layers=[1])
    model.set_attn_implementation("sparse_k")
    ids = torch.randint(1, VOCAB, (1, 9))
    cache = SparseCache(model)
    assert cache.bounded_layers == [0]
    kw = dict(max_new_tokens=25, min_new_tokens=25, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        bounded = model.generate(ids, past_key_values=cache, **kw)
        dynamic = model.generate(ids, **kw)
    assert torch.equal(bounded, dynamic)
    assert cache.cached_lengths() == [6, 9 + 25 - 1]


def test_bounded_layer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="window"):
        BoundedLayer(2, 0)
    with pytest.raises(ValueError, match="mode"):
        BoundedLayer(2, 4, mode="shifted")
    with pytest.raises(ValueError, match="inv_freq"):
        BoundedLayer(2, 4, mode="rolling")
    layer = BoundedLayer(1, 3)
    layer.update(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
    assert layer.keys.shape[-2] == 3 and layer.get_seq_length() == 5
    with pytest.raises(ValueError, match="cropped"):
        layer.crop(1)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_long_prompt_then_generate_equals_dynamic_cache(family):
    """A prompt longer than the kept keys (prefill on all of it, then eviction), model windows included."""
    model = tiny_model(family, seed=14)
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=8)
    model.set_attn_implementation("sparse_k")
    ids = torch.randint(1, VOCAB, (2, 40))
    cache = SparseCache(model)
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        bounded = model.generate(ids, past_key_values=cache, **kw)
        dynamic = model.generate(ids, **kw)
    assert torch.equal(bounded, dynamic)
    windows = model_windows(model)
    for i, kept in enumerate(cache.cached_lengths()):
        # A model-window layer keeps its window (sinks inside it need absolute positions); others sinks + window - 1.
        assert kept <= (windows[i] - 1 if windows[i] is not None else 2 + 8 - 1), (i, kept)


@pytest.mark.parametrize("dense_layers", [[], [0]])
def test_padded_batch_is_refused_not_answered_wrong(dense_layers):
    """A left-padded batch used to give its padded row a wrong continuation silently (the padding
    became the row's sinks); now the first forward raises. Unpadded rows still generate as alone."""
    model = tiny_model("llama", seed=11)
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=6, dense_layers=dense_layers)
    torch.manual_seed(0)
    long, short = torch.randint(1, VOCAB, (1, 12)), torch.randint(1, VOCAB, (1, 8))
    ids = torch.cat([long, torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad(), pytest.raises(ValueError, match="SparseCache supports unpadded batches only"):
        model.generate(ids, attention_mask=mask, past_key_values=SparseCache(model), max_new_tokens=10,
                       do_sample=False, pad_token_id=0)
    both = torch.cat([long[:, :8], short])
    with torch.no_grad():
        gen = model.generate(both, attention_mask=torch.ones_like(both), past_key_values=SparseCache(model),
                             max_new_tokens=10, do_sample=False, pad_token_id=0)
        alone = model.generate(short, past_key_values=SparseCache(model), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(gen[1], alone[0])


def test_padded_batch_is_refused_by_learned_layers():
    model = tiny_model("llama", seed=12)
    hf_sparse_attention.configure(model, "sparse_k", sinks=2, window=4, top_k=3, query_block=4)
    ids = torch.randint(1, VOCAB, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad(), pytest.raises(ValueError, match="SparseCache supports unpadded batches only"):
        model.generate(ids, attention_mask=mask, past_key_values=SparseCache(model), max_new_tokens=3,
                       do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_bounded_cache_under_a_dense_implementation_is_refused(implementation):
    """A model switched back to a dense implementation (a dense baseline) keeps its ``sparse_attention``; a SparseCache
    would still drop its keys, giving a dense prompt and a windowed continuation, neither dense nor the pattern. The
    first forward raises instead; under ``"sparse_k"`` the same call runs."""
    model = tiny_model("llama", seed=14)
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=4)
    ids = torch.randint(1, VOCAB, (1, 10))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    model.set_attn_implementation(implementation)
    with torch.no_grad(), pytest.raises(ValueError, match=f"attn_implementation='{implementation}'"):
        model.generate(ids, past_key_values=SparseCache(model), **kw)
    model.set_attn_implementation("sparse_k")
    with torch.no_grad():
        assert torch.equal(model.generate(ids, past_key_values=SparseCache(model), **kw), model.generate(ids, **kw))


def test_cache_built_for_another_pattern_is_refused_not_answered_wrong():
    """A SparseCache keeps what the pattern of its construction needs. Reconfiguring the model afterwards to a pattern
    that reaches the dropped keys used to attend over the kept ones only, without a word; now the next forward raises.
    A narrower streaming / sliding-window rule still runs on the kept keys and equals the DynamicCache."""
    model = tiny_model("llama", seed=13)
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=6)
    ids = torch.randint(1, VOCAB, (1, 12))
    nxt = torch.randint(1, VOCAB, (1, 1))
    for wider in ({"pattern": "sliding_window", "window": 100}, {"pattern": "streaming", "sinks": 3, "window": 6},
                  {"pattern": "dense"}, {"pattern": "sparse_k", "sinks": 2, "window": 4, "top_k": 4, "query_block": 4}):
        hf_sparse_attention.configure(model, "streaming", sinks=2, window=6)
        cache = SparseCache(model)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            hf_sparse_attention.configure(model, **wider)
            with pytest.raises(ValueError, match="build a new SparseCache"):
                model(nxt, past_key_values=cache, use_cache=True)
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=6)
    caches = [SparseCache(model), transformers.DynamicCache(config=model.config)]
    outs = []
    with torch.no_grad():
        for cache in caches:
            hf_sparse_attention.configure(model, "streaming", sinks=2, window=6)
            model(ids, past_key_values=cache, use_cache=True)
            hf_sparse_attention.configure(model, "sliding_window", window=4)
            outs.append(model(nxt, past_key_values=cache, use_cache=True).logits)
    assert (outs[0] - outs[1]).abs().max() < 1e-5
    # A learned layer's cache keeps its decode state for its own pattern.
    hf_sparse_attention.configure(model, "sparse_k", sinks=2, window=4, top_k=3, query_block=4)
    cache = SparseCache(model)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the training-free selection's one-time warning
        model(ids, past_key_values=cache, use_cache=True)
        hf_sparse_attention.configure(model, "streaming", sinks=2, window=4)
        with pytest.raises(ValueError, match="build a new SparseCache"):
            model(nxt, past_key_values=cache, use_cache=True)


def test_beam_reorder_drops_the_reused_decode_layout():
    """A training-free layer reuses its decode layout inside a query block; a beam reorder permutes the rows,
    so the layout of the old order must not be reused (the memo's block queries are permuted in place)."""
    model = tiny_model("llama", seed=21)
    hf_sparse_attention.configure(model, "sparse_k", sinks=2, window=8, top_k=16, query_block=16)
    ids = torch.randint(1, VOCAB, (2, 60))
    cache = SparseCache(model)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the training-free selection's one-time warning (maybe already given)
        out = model(ids, past_key_values=cache, use_cache=True)
        model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    memos = [layer.memo for layer in cache.layers if hasattr(layer, "memo")]
    assert memos and all("layout" in m for m in memos)
    block = [m["block"].clone() for m in memos]
    cache.reorder_cache(torch.tensor([1, 0]))
    assert all("layout" not in m and "layout_key" not in m for m in memos)
    assert all(torch.equal(m["block"], b.flip(0)) for m, b in zip(memos, block))


@pytest.mark.parametrize("name", ["sparse_k", "dsa"])
def test_learned_layers_crop_like_transformers_and_refuse_a_lost_block_start(name):
    """``cache.crop(-n)`` (Transformers' convention: drop the last n tokens; positive = tokens to keep, before 5.18)
    rolls a learned SparseCache layer back like a DynamicCache, also into a block before the latest (the memo keeps
    the last blocks' first queries: ``block_ring``); a cut inside a block older than the memo keeps raises instead of
    continuing that block without its first query."""
    model = tiny_model("llama", seed=5)
    hf_sparse_attention.configure(model, name, sinks=2, window=8, top_k=4, query_block=4)
    model.set_attn_implementation("sparse_k")
    ids = torch.randint(1, VOCAB, (1, 26))
    with torch.no_grad():
        # to a block start (twice), inside the latest block, inside the block before it (block 5: position 20 started
        # it; the drafts also started block 6)
        for drop, keep in ((-6, 20), (20, 20), (-1, 25), (-5, 21)):
            cache = SparseCache(model, evict=False)
            model(ids[:, :20], past_key_values=cache)
            model(ids[:, 20:], past_key_values=cache)  # draft tokens 20-25 (blocks 5 and 6)
            cache.crop(drop)
            assert cache.get_seq_length() == keep
            out = model(ids[:, keep:keep + 1], past_key_values=cache).logits[:, -1]
            ref = model(ids[:, :keep + 1], use_cache=False).logits[:, -1]
            assert (out - ref).abs().max() < 1e-5, (drop, (out - ref).abs().max())
        kept = block_ring.ring_blocks(4)
        long_ids = torch.randint(1, VOCAB, (1, 4 * (kept + 1) + 2))  # the latest block is kept + 1 blocks after block 0
        cache = SparseCache(model, evict=False)
        model(long_ids, past_key_values=cache)
        with pytest.raises(ValueError, match="inside query block 0"):
            cache.crop(1 - long_ids.shape[1])  # to one token: block 0's first query left the memo


def test_hybrid_models_are_refused_by_name():
    """A model with Mamba / linear-attention layers: SparseCache refuses it at construction, naming the layer and the
    cache layer Transformers gives it (the recurrent state SparseCache does not keep), instead of failing in generate."""
    import model_families as mf

    try:
        model = mf.build("qwen3_next", "sparse_k")
    except Exception as exc:  # noqa: BLE001 - an older transformers without the model, or without its tiny config
        pytest.skip(f"qwen3_next not buildable here: {exc}")
    kinds = [type(layer).__name__ for layer in transformers.DynamicCache(config=model.config).layers]
    if all(k in ("DynamicLayer", "DynamicSlidingWindowLayer") for k in kinds):
        pytest.skip(f"this transformers caches qwen3_next's layers as {kinds}: nothing to refuse")
    with pytest.raises(ValueError, match=r"layer 0 of this qwen3_next model is not a plain attention layer"):
        SparseCache(model)


def test_rolling_positions_refuse_partial_rotary_keys():
    """``mode="rolling"`` re-rotates whole keys: a model whose rotary embedding covers part of the head (phi) gets a
    ValueError naming both sizes at the first re-rotation, not a shape error."""
    import model_families as mf

    model = mf.build("phi", "sparse_k")
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=5, cache_positions="rolling")
    ids, _ = mf._inputs()
    with torch.no_grad(), pytest.raises(ValueError, match=r"covers 8 of the keys' 16 dimensions"):
        model.generate(ids, past_key_values=SparseCache(model), max_new_tokens=4, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("model_type", ["cohere", "helium"])
def test_rolling_positions_refuse_other_rotation_conventions(model_type):
    """``mode="rolling"`` re-rotates sink keys the ``rotate_half`` way; a model that rotates interleaved dimension pairs
    is refused when the cache is built (its own ``apply_rotary_pos_emb`` is probed), instead of generating with keys
    rotated the wrong way; ``mode="original"`` re-rotates nothing and still works."""
    import model_families as mf

    model = mf.build(model_type, "sparse_k")
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=5, cache_positions="rolling")
    with pytest.raises(ValueError, match=rf"layer 0 of this {model_type} model rotates its keys otherwise"):
        SparseCache(model)
    assert SparseCache(model, mode="original").mode == "original"


@pytest.mark.parametrize("model_type", ["llama", "gemma3", "qwen2", "mistral"])
def test_rolling_positions_accept_rotate_half_models(model_type):
    """The rotation probe passes where ``rotate_keys`` is the model's own convention (one rotary embedding per layer
    type for gemma3)."""
    import model_families as mf

    model = mf.build(model_type, "sparse_k")
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=5, cache_positions="rolling")
    assert SparseCache(model).mode == "rolling"


@pytest.mark.parametrize("model_type, nope_layer", [("smollm3", 1), ("exaone4", 1)])
def test_rolling_positions_leave_nope_layers_unrotated(model_type, nope_layer):
    """A layer without rotary embedding (smollm3's ``no_rope_layers``, exaone4's global layers) has no phase to move:
    its bounded layer keeps the original mode in a rolling cache instead of rotating sink keys that were never
    rotated; the layers with RoPE roll."""
    import model_families as mf

    model = mf.build(model_type, "sparse_k")
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=5, cache_positions="rolling")
    cache = SparseCache(model)
    assert cache.layers[nope_layer].mode == "original"
    tiny = tiny_model("llama", seed=0)
    hf_sparse_attention.configure(tiny, "streaming", sinks=2, window=5, cache_positions="rolling")
    assert all(layer.mode == "rolling" for layer in SparseCache(tiny).layers)


def test_moshi_window_is_not_the_cache_window():
    """moshi's config carries sliding_window but its layers attend globally (the attention function runs the user's
    pattern without a model window): SparseCache keeps what that pattern needs, so generation equals recomputation."""
    import model_families as mf

    model = mf.build("moshi", "sparse_k")
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=5)
    model.generation_config.eos_token_id = None
    ids, _ = mf._inputs()
    with torch.no_grad():
        out = model.generate(ids, past_key_values=SparseCache(model), max_new_tokens=12, min_new_tokens=12,
                             do_sample=False, pad_token_id=0)
    seq = ids
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_cache_windows_are_the_adapter_windows():
    """SparseCache sizes each layer by the window the adapter reads when a model passes none (one rule,
    ``config_window``): none for moshi (global despite its window) or use_sliding_window=False without layer types;
    with layer types, the window on the sliding layers only (there the model passes it, use_sliding_window or not)."""
    from types import SimpleNamespace

    from hf_sparse_attention.cache import _model_windows
    from sparse_k.integrations.transformers_adapter import _own_window

    types = ["sliding_attention", "full_attention", "sliding_attention"]
    cases = [
        (SimpleNamespace(model_type="moshi", sliding_window=5), [None] * 3),
        (SimpleNamespace(model_type="moshi", sliding_window=5, layer_types=types), [None] * 3),
        (SimpleNamespace(model_type="qwen2", sliding_window=5, use_sliding_window=False), [None] * 3),
        (SimpleNamespace(model_type="qwen2", sliding_window=5, use_sliding_window=True), [5] * 3),
        (SimpleNamespace(model_type="mistral", sliding_window=None), [None] * 3),
        (SimpleNamespace(model_type="gemma3", sliding_window=5, layer_types=types), [5, None, 5]),
        (SimpleNamespace(model_type="qwen2", sliding_window=5, use_sliding_window=False, layer_types=types), [5, None, 5]),
    ]
    module = torch.nn.Module()  # no window of its own: the adapter falls back to the config
    for cfg, want in cases:
        windows, _ = _model_windows(cfg, 3)
        assert windows == [_own_window(module, cfg, i) for i in range(3)] == want, cfg


def test_a_window_of_zero_or_less_is_no_window():
    """qwen2_moe stores ``sliding_window=0`` when ``use_sliding_window`` is False, and a window <= 0 means "no window"
    to Transformers' flash-attention path (``window_size=(w - 1, w - 1)``, negative: unlimited). So a window <= 0 (or
    None) on a layer marked ``"sliding_attention"`` is a global layer, for ``config_window``, for ``SparseCache``'s
    layers and for the module's own ``sliding_window`` the adapter reads; never a window of 0 keys (or an error)."""
    from types import SimpleNamespace

    from hf_sparse_attention.cache import _model_windows
    from sparse_k.integrations.transformers_adapter import _own_window, config_window

    types = ["sliding_attention", "full_attention", "sliding_attention"]
    cases = [
        (SimpleNamespace(model_type="qwen2_moe", sliding_window=0, use_sliding_window=False, layer_types=types), [None] * 3),
        (SimpleNamespace(model_type="qwen2_moe", sliding_window=0, use_sliding_window=True), [None] * 3),
        (SimpleNamespace(model_type="mistral", sliding_window=0), [None] * 3),
        (SimpleNamespace(model_type="mistral", sliding_window=-1), [None] * 3),
        (SimpleNamespace(model_type="gemma3", sliding_window=None, layer_types=types), [None] * 3),
        (SimpleNamespace(model_type="gemma3", sliding_window=-4, layer_types=types), [None] * 3),
    ]
    module = torch.nn.Module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cfg, want in cases:
            windows, _ = _model_windows(cfg, 3)
            assert windows == [config_window(cfg, i) for i in range(3)] == [_own_window(module, cfg, i) for i in range(3)]
            assert windows == want, cfg
            assert config_window(cfg, None) is None, cfg


def test_qwen2_moe_sliding_layer_without_a_window_runs_globally():
    """A qwen2_moe config whose ``layer_types`` mark a sliding layer while ``use_sliding_window`` is False carries
    ``sliding_window=0``, and that layer's module keeps ``sliding_window = 0``: sparse_k runs it as a global layer
    (equal to the same weights with every layer ``"full_attention"``), with and without ``SparseCache``."""
    import model_families as mf

    def build(layer_types):
        cfg = mf.tiny_config("qwen2_moe")
        cfg.num_hidden_layers, cfg.use_sliding_window, cfg.sliding_window, cfg.layer_types = 2, False, 0, layer_types
        hf_sparse_attention.configure(cfg, "streaming", sinks=2, window=6)
        torch.manual_seed(0)
        return mf.model_class("qwen2_moe")._from_config(cfg, attn_implementation="sparse_k").eval()

    marked, full = build(["sliding_attention", "full_attention"]), build(["full_attention", "full_attention"])
    assert marked.model.layers[0].self_attn.sliding_window == 0
    ids = torch.randint(3, 60, (1, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = full(ids, use_cache=False).logits
        assert torch.equal(marked(ids, use_cache=False).logits, want)
        cache = SparseCache(marked)
        assert cache.bounded_layers == [0, 1]
        assert torch.equal(marked(ids, past_key_values=cache).logits, want)


def test_rotation_probe_runs_once_per_attention_class_and_layer_type(monkeypatch):
    """``mode="rolling"`` probes the model's ``apply_rotary_pos_emb`` once per (attention class, layer type), not once
    per bounded layer: of four gemma3 layers, the two global ones re-rotate sink keys (the sliding ones keep no sink
    past their window): one probe; every layer still rolls."""
    import hf_sparse_attention.cache as cache_module
    import model_families as mf

    probes, probe = [], cache_module._check_rotation_convention

    def counted(attention, rotary, inv_freq, layer_type, layer_idx):
        probes.append((type(attention).__name__, layer_type))
        probe(attention, rotary, inv_freq, layer_type, layer_idx)

    monkeypatch.setattr(cache_module, "_check_rotation_convention", counted)
    cfg = mf.tiny_config("gemma3")
    text = cfg.get_text_config()
    text.num_hidden_layers, text.layer_types = 4, ["sliding_attention", "full_attention"] * 2
    model = mf.model_class("gemma3")._from_config(cfg, attn_implementation="sparse_k").eval()
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=5, cache_positions="rolling")
    cache = SparseCache(model)
    assert cache.bounded_layers == [0, 1, 2, 3] and all(layer.mode == "rolling" for layer in cache.layers)
    assert [layer.inv_freq is not None for layer in cache.layers] == [False, True, False, True]
    assert probes == [("Gemma3Attention", "full_attention")]


def test_rolling_cache_scans_the_model_for_rotary_embeddings_once(monkeypatch):
    """``mode="rolling"`` finds the rotary frequencies of every rolling layer with one pass over ``model.modules()``
    (and one to find the attention modules), however many layers roll: 2 scans for 2 layers and for 6 (a scan per
    rolling layer made the build O(layers x modules)). Each layer still gets the model's ``inv_freq``."""
    def scans_to_build(layers):
        model = tiny_model("llama", layers=layers)
        hf_sparse_attention.configure(model, "streaming", sinks=2, window=5, cache_positions="rolling")
        calls, modules = [], model.modules
        monkeypatch.setattr(model, "modules", lambda: calls.append(1) or modules())
        cache = SparseCache(model)
        inv_freq = model.model.rotary_emb.inv_freq
        assert cache.bounded_layers == list(range(layers))
        assert all(layer.mode == "rolling" and layer.inv_freq is inv_freq for layer in cache.layers)
        return len(calls)

    assert scans_to_build(2) == scans_to_build(6) == 2


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) any ATen op returns while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("cache_kind", ["sparse", "dynamic"])
@pytest.mark.parametrize("name, params", [("streaming", {"sinks": 2, "window": 6}), ("block_diagonal", {"block": 8})])
def test_decode_under_a_wider_model_window_allocates_no_tensor_of_the_length(cache_kind, name, params, monkeypatch):
    """A model window (24) wider than the pattern's rule keeps the pattern inside it (``WithinWindow``), which needs
    absolute slots (sinks, blocks) while the cache holds the window's keys only: a decode step at 600+ tokens must not
    rebuild the dropped slots (K/V padded back to the length, a temporary that grows with the sequence, per layer
    and step). The largest tensor of every decode step's attention call stays a few model windows of keys, and
    each step's logits still equal recomputing the prefix."""
    model = tiny_model("mistral", seed=3)
    hf_sparse_attention.configure(model, name, **params)
    model.set_attn_implementation("sparse_k")
    cfg = model.config
    key_elements = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)  # one key of K
    attention, largest = transformers.AttentionInterface._global_mapping["sparse_k"], []

    def tracked(module, query, *args, **kwargs):
        tracker = _LargestTensor()
        with tracker:
            out = attention(module, query, *args, **kwargs)
        if query.shape[2] == 1:
            largest.append(tracker.numel)
        return out

    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, "sparse_k", tracked)
    ids = torch.randint(1, VOCAB, (1, 600), generator=torch.Generator().manual_seed(0))
    cache = SparseCache(model) if cache_kind == "sparse" else transformers.DynamicCache(config=cfg)
    steps = 64
    with torch.no_grad():
        gen = model.generate(ids, past_key_values=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    assert len(largest) == (steps - 1) * cfg.num_hidden_layers
    bound = 8 * cfg.sliding_window * key_elements  # 192 keys of K, against the 600 to 664 of a padded copy
    assert max(largest) <= bound, f"largest temporary {max(largest)} elements = {max(largest) / key_elements:.0f} keys"
    monkeypatch.undo()
    with torch.no_grad():  # one causal forward over the generated tokens: every prefix recomputed at once
        recomputed = model(gen.sequences[:, :-1], use_cache=False).logits[0, ids.shape[1] - 1 :]
    assert (torch.cat(gen.logits) - recomputed).abs().max() < 1e-4
