"""configure() and config.sparse_attention refuse settings that would run silently wrong, naming the value."""

import copy

import hf_sparse_attention
import pytest
import torch
from helpers import tiny_llama
from sparse_k.integrations.config import validate_sparse_config


@pytest.mark.parametrize("name,params", [("dense", {}), ("bigbird", {"block": 4}), ("sliding_window", {"window": 3})])
def test_bidirectional_pattern_refused(name, params):
    model = tiny_llama(layers=2)
    with pytest.raises(ValueError, match="causal"):
        hf_sparse_attention.configure(model, name, causal=False, **params)
    with pytest.raises(ValueError, match="causal"):
        hf_sparse_attention.configure(model, "streaming", layers={1: {"pattern": name, "causal": False, **params}})
    with pytest.raises(ValueError, match="causal"):
        validate_sparse_config({"pattern": name, "causal": False, **params})


def test_config_set_by_hand_never_sees_the_future():
    """Written straight on the config (as from_pretrained of a saved config would), a bidirectional
    pattern must not make the causal LM look at later tokens."""
    model = tiny_llama(layers=2)
    hf_sparse_attention.configure(model, "dense")
    model.config.sparse_attention = {"pattern": "dense", "causal": False}
    ids = torch.randint(0, 50, (1, 12))
    with pytest.raises(ValueError, match="causal"):
        model(ids)


def test_full_attention_layers_only_must_be_bool():
    model = tiny_llama(layers=2)
    with pytest.raises(TypeError, match="full_attention_layers_only"):
        hf_sparse_attention.configure(model, "streaming", sinks=2, window=4, full_attention_layers_only="no")
    assert validate_sparse_config({"pattern": "dense", "full_attention_layers_only": None})["full_attention_layers_only"] is False


def test_layers_and_dense_layers_types_named():
    model = tiny_llama(layers=2)
    with pytest.raises(TypeError, match="layers"):
        hf_sparse_attention.configure(model, "dense", layers=[1])
    with pytest.raises(TypeError, match="layer indices"):
        hf_sparse_attention.configure(model, "dense", layers={1.5: "dense"})
    with pytest.raises(TypeError, match="dense_layers"):
        hf_sparse_attention.configure(model, "dense", dense_layers=0)
    # A valid call still works and round-trips the layer key as a string.
    cfg = hf_sparse_attention.configure(copy.deepcopy(model), "dense", layers={1: "sliding_window"})
    assert cfg["layers"] == {"1": "sliding_window"}


def test_layer_keys_and_dense_layers_accept_index_likes():
    """numpy integers as layer keys and a range as dense_layers are layer indices too."""
    import numpy as np

    model = tiny_llama(layers=2)
    cfg = hf_sparse_attention.configure(copy.deepcopy(model), "dense", layers={np.int64(1): "sliding_window"},
                                        dense_layers=range(1))
    assert cfg["layers"] == {"1": "sliding_window"} and cfg["dense_layers"] == [0]
    cfg = hf_sparse_attention.configure(copy.deepcopy(model), "dense", dense_layers=np.array([1, 0]))
    assert cfg["dense_layers"] == [1, 0] and all(type(i) is int for i in cfg["dense_layers"])
    with pytest.raises(TypeError, match="layer indices"):
        hf_sparse_attention.configure(model, "dense", layers={True: "dense"})
    with pytest.raises(TypeError, match="dense_layers"):
        hf_sparse_attention.configure(model, "dense", dense_layers="0")


def test_numpy_integer_parameters_are_written_as_python_ints(tmp_path):
    """configure() takes numpy integers as pattern parameters, at the top level and per layer, as the pattern classes
    do, and writes them as Python ints: the config stays JSON-friendly and round-trips through save_pretrained."""
    import json

    import numpy as np
    import sparse_k

    model = tiny_llama(layers=2)
    cfg = hf_sparse_attention.configure(model, "streaming", sinks=np.int32(1), window=np.int64(3),
                                        layers={1: {"pattern": "sliding_window", "window": np.uint8(5)}})
    assert cfg == {"pattern": "streaming", "sinks": 1, "window": 3, "layers": {"1": {"pattern": "sliding_window",
                                                                                      "window": 5}}}
    assert type(cfg["window"]) is int and type(cfg["layers"]["1"]["window"]) is int
    assert json.loads(json.dumps(model.config.sparse_attention)) == model.config.sparse_attention
    cfg = hf_sparse_attention.configure(model, sparse_k.Streaming(sinks=np.int64(2), window=np.int64(4)))
    assert cfg["sinks"] == 2 and type(cfg["sinks"]) is int
    model.save_pretrained(tmp_path / "saved")
    with pytest.raises(TypeError, match=r"sliding_window: `window` must be an int, got bool"):
        hf_sparse_attention.configure(model, "sliding_window", window=np.bool_(True))


def test_layer_given_twice_is_refused_and_mixed_keys_run():
    """``layers={0: ..., "0": ...}`` names one layer twice: one setting used to override the other without a word.
    A config written by hand with int and str layer keys runs (its cache key used to fail to sort)."""
    model = tiny_llama(layers=3)
    with pytest.raises(ValueError, match="names layer 0 twice"):
        hf_sparse_attention.configure(model, "streaming", sinks=1, window=4, layers={0: "dense", "0": "sliding_window"})
    with pytest.raises(ValueError, match="names layer 1 twice"):
        validate_sparse_config({"pattern": "dense", "layers": {1: "dense", "1": "streaming"}})
    hf_sparse_attention.configure(model, "streaming", sinks=1, window=4)
    ids = torch.randint(0, 50, (1, 10))
    with torch.no_grad():
        want = model(ids).logits
        model.config.sparse_attention = {"pattern": "streaming", "sinks": 1, "window": 4,
                                         "layers": {0: "dense", "1": {"pattern": "sliding_window", "window": 3}}}
        mixed = model(ids).logits
        model.config.sparse_attention = {"pattern": "streaming", "sinks": 1, "window": 4,
                                         "layers": {"0": "dense", "1": {"pattern": "sliding_window", "window": 3}}}
        assert torch.equal(mixed, model(ids).logits) and not torch.equal(mixed, want)


def test_selector_path_is_stored_as_a_string_and_round_trips(tmp_path):
    """A ``pathlib.Path`` selector_path is kept as its string, so ``save_pretrained`` can write the config;
    a value that is no path is refused by name."""
    model = tiny_llama(layers=2)
    cfg = hf_sparse_attention.configure(model, "sparse_k", selector_path=tmp_path / "missing.safetensors")
    assert cfg["selector_path"] == str(tmp_path / "missing.safetensors")
    model.save_pretrained(tmp_path / "saved")
    loaded = type(model).from_pretrained(tmp_path / "saved")
    assert loaded.config.sparse_attention["selector_path"] == str(tmp_path / "missing.safetensors")
    with pytest.raises(TypeError, match="selector_path"):
        hf_sparse_attention.configure(model, "sparse_k", selector_path=3)
    with pytest.raises(TypeError, match="selector_path"):
        validate_sparse_config({"pattern": "sparse_k", "selector_path": ["a.safetensors"]})


def test_selector_is_no_pattern_parameter_and_points_to_selector_path():
    """``configure(model, "dsa", selector=...)`` was accepted and never read: the file was silently ignored."""
    model = tiny_llama(layers=2)
    with pytest.raises(TypeError, match=r"`selector` is not a pattern parameter .*selector_path"):
        hf_sparse_attention.configure(model, "dsa", selector="/nonexistent")
    with pytest.raises(TypeError, match="selector_path"):
        hf_sparse_attention.configure(model, "streaming", layers={1: {"pattern": "sparse_k", "selector": "w.safetensors"}})
    assert getattr(model.config, "sparse_attention", None) is None  # nothing was written


def test_reload_without_sparse_k_warns_once(tmp_path):
    """A model saved with sparse attention and reloaded by a plain from_pretrained silently ran sdpa; an explicit
    attn_implementation (sparse_k, or sdpa as a dense baseline) stays quiet."""
    import warnings

    from sparse_k import warn

    model = tiny_llama(layers=2)
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=4)
    model.save_pretrained(tmp_path)
    warn._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for impl in ("sparse_k", "sdpa"):
            assert type(model).from_pretrained(tmp_path, attn_implementation=impl).config._attn_implementation == impl
        assert not [w for w in caught if "sparse_attention" in str(w.message)]
        plain = type(model).from_pretrained(tmp_path)
        type(model).from_pretrained(tmp_path)
    assert plain.config._attn_implementation == "sdpa"
    said = [str(w.message) for w in caught if "sparse_attention" in str(w.message)]
    assert len(said) == 1 and 'attn_implementation="sparse_k"' in said[0], said
    plain.set_attn_implementation("sparse_k")
    assert plain.config._attn_implementation == "sparse_k"


def test_pattern_object_is_stored_as_its_name_and_parameters(tmp_path):
    """``configure(model, sk.Streaming(sinks=1, window=3))`` (also in ``layers``) stores the pattern's plain dict, the
    same attention as ``configure(model, "streaming", sinks=1, window=3)``; ``params`` override its parameters.
    A pattern that is neither a name nor a Pattern is refused by type."""
    import sparse_k

    ids = torch.randint(0, 50, (1, 12))
    model = tiny_llama(layers=2)
    hf_sparse_attention.configure(model, "streaming", sinks=1, window=3)
    want = model(ids).logits
    cfg = hf_sparse_attention.configure(model, sparse_k.Streaming(sinks=1, window=3))
    assert cfg["pattern"] == "streaming" and sparse_k.pattern_from_dict(cfg) == sparse_k.Streaming(sinks=1, window=3)
    assert torch.equal(model(ids).logits, want)
    cfg = hf_sparse_attention.configure(model, sparse_k.Streaming(sinks=1, window=5), window=3)
    assert sparse_k.pattern_from_dict(cfg) == sparse_k.Streaming(sinks=1, window=3)
    cfg = hf_sparse_attention.configure(model, "dense", layers={1: sparse_k.SlidingWindow(window=3)})
    assert cfg["layers"] == {"1": {"pattern": "sliding_window", "causal": True, "window": 3}}
    model.save_pretrained(tmp_path / "saved")
    with pytest.raises(TypeError, match=r"pattern must be a pattern name .* or a sparse_k Pattern, got int 3"):
        hf_sparse_attention.configure(model, 3)
