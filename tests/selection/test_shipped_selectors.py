"""Shipped selectors (``hf_sparse_attention.shipped``): attached only to the layers of the model they were trained
on (its ``k_proj`` fingerprint), for their own pattern, never over a user's selector, and off on request."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import hf_sparse_attention  # noqa: F401 - registers the provider
from hf_sparse_attention import shipped
from hf_sparse_attention.selectors import load_selectors
from sparse_k import get_pattern
from sparse_k.integrations import transformers_adapter as adapter
from sparse_k.selection.scorers import LightningIndexer, SparseKScorer

ENTRY = shipped.SHIPPED[0]


class _Attention(nn.Module):
    """What the provider reads of an attention module: ``k_proj`` and the model ``config``."""

    def __init__(self, layer_idx: int, *, matching: bool, sparse_attention: dict | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        out_f, in_f = ENTRY.k_proj_shape
        self.k_proj = nn.Linear(in_f, out_f, bias=False)
        if matching:
            with torch.no_grad():
                ref = shipped._fingerprint(ENTRY, layer_idx)
                self.k_proj.weight[: ref.shape[0], : ref.shape[1]] = ref + 1e-3 * ref.abs().mean() * torch.randn_like(ref)
        self.config = type("Config", (), {"sparse_attention": sparse_attention or {}})()


def _pattern(**kw):
    return get_pattern(ENTRY.kind, **kw)


def test_the_shipped_files_hold_a_selector_for_every_layer():
    """A DSA indexer (query block 1) and a SparseK scorer (query block 64) per layer of SmolLM2-135M."""
    assert [e.kind for e in shipped.SHIPPED] == ["dsa", "sparse_k"]
    for entry, cls, qb in zip(shipped.SHIPPED, (LightningIndexer, SparseKScorer), (1, 64)):
        sels = load_selectors(entry.path(entry.selectors))
        assert sorted(sels) == list(range(30)) and all(isinstance(s, cls) for s in sels.values())
        assert entry.trained_pattern["query_block"] == qb and entry.fingerprint == ENTRY.fingerprint


@pytest.mark.parametrize("layer", [0, 17, 29])
def test_matching_weights_get_the_layers_selector(layer):
    mod = _Attention(layer, matching=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = shipped.shipped_selector(mod, layer, _pattern(query_block=1))
    want = load_selectors(ENTRY.path(ENTRY.selectors))[layer]
    assert got is not None
    for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items()):
        assert torch.equal(a, b), name


def test_other_weights_other_patterns_and_no_layer_get_nothing():
    assert shipped.shipped_selector(_Attention(3, matching=False), 3, _pattern()) is None  # same shape, other values
    assert shipped.shipped_selector(_Attention(3, matching=True), 3, get_pattern("streaming")) is None
    assert shipped.shipped_selector(_Attention(3, matching=True), None, _pattern()) is None
    small = nn.Module()
    small.k_proj = nn.Linear(8, 4, bias=False)
    assert shipped.shipped_selector(small, 3, _pattern()) is None
    assert shipped.shipped_selector(_Attention(30, matching=False), 30, _pattern()) is None  # no such layer


def test_warns_when_the_pattern_differs_from_the_trained_one():
    from sparse_k.warn import _WARNED

    _WARNED.clear()
    with pytest.warns(UserWarning, match="trained and measured with query_block=1; this model runs query_block=64"):
        assert shipped.shipped_selector(_Attention(5, matching=True), 5, _pattern(query_block=64)) is not None


def test_adapter_attaches_drops_and_never_replaces_a_users_selector():
    assert shipped.shipped_selector in adapter.SELECTOR_PROVIDERS
    mod = _Attention(2, matching=True)
    p = _pattern(query_block=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sel = adapter._layer_selector(mod, 2, p)
        assert sel is not None and mod._sparse_k_selector is sel
        assert adapter._layer_selector(mod, 2, p) is sel  # asked once per pattern
        mod.config.sparse_attention = {"shipped_selectors": False}
        assert adapter._layer_selector(mod, 2, p) is None and "_sparse_k_selector" not in mod.__dict__
        mod.config.sparse_attention = {}
        assert adapter._layer_selector(mod, 2, p) is not None
        other = adapter._layer_selector(mod, 2, get_pattern("sparse_k"))  # a dsa selector is not kept for sparse_k
        assert isinstance(other, SparseKScorer) and adapter._layer_selector(mod, 2, p) is sel
        users = LightningIndexer(9, 3, 64)
        object.__setattr__(mod, "_sparse_k_selector", users)
        assert adapter._layer_selector(mod, 2, p) is users
        assert adapter._layer_selector(_Attention(2, matching=False), 2, p) is None


def test_shipped_selectors_is_a_checked_config_key():
    from sparse_k.integrations.config import validate_sparse_config

    assert validate_sparse_config({"pattern": "dsa", "shipped_selectors": False})["shipped_selectors"] is False
    with pytest.raises(TypeError, match="shipped_selectors"):
        validate_sparse_config({"pattern": "dsa", "shipped_selectors": "no"})


def test_learned_selection_is_reported_per_pattern():
    """The main job's report line: dsa and sparse_k on the shipped model are trained, both elsewhere are not."""
    from hf_sparse_attention.evaluation.cli import TRAINING_FREE, learned_selection
    from hf_sparse_attention.evaluation.variants import make_variants

    class _Model(nn.Module):
        def __init__(self, matching):
            super().__init__()
            self.layers = nn.ModuleList(_Attention(i, matching=matching) for i in range(2))

    variants = make_variants(["sparse_k", "dsa", "streaming"], 256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert learned_selection(_Model(True), variants) == "trained selectors"
        assert learned_selection(_Model(False), variants) == TRAINING_FREE
        assert learned_selection(_Model(True), make_variants(["dsa"], 256)) == "trained selectors"
