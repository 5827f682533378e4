"""The cache protocol between a cache layer and the Transformers adapter (``sparse_k.integrations.cache_protocol``):
a minimal fake layer announced on the module drives ``attention_forward``; an unannounced key tensor
or a collected layer is ignored; ``SparseCache``'s layers offer the protocol's methods."""

from __future__ import annotations

import gc
import inspect
import types

import pytest
import torch

from sparse_k import SparseK, Streaming, sparse_attention
from sparse_k.integrations import cache_protocol
from sparse_k.integrations.cache_protocol import announce, announced_layer
from sparse_k.integrations.transformers_adapter import attention_forward


class _FakeSelectionLayer:
    """Implements ``SelectionCacheLayer``: refuses masks with a False entry, attends to sinks + window only."""

    def __init__(self):
        self.calls = []

    def check_key_mask(self, key_mask):
        if key_mask is not None and not bool(key_mask.all()):
            raise ValueError("fake layer: padded")

    def attend(self, query, key, value, pattern, key_mask, run, *, selector, layer_idx):
        self.calls.append((pattern, key_mask, selector, layer_idx))
        return run(query, key, value, pattern.static_part(), None, None, key_mask)


class _Module(torch.nn.Module):
    def __init__(self, sparse, layer_idx=1):
        super().__init__()
        self.config = types.SimpleNamespace(sparse_attention=sparse)
        self.layer_idx = layer_idx


def _qkv(seed, B=2, Hq=4, Hkv=2, S=11, D=8, Sq=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq or S, D, generator=g, dtype=torch.float64)
    return q, torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64), torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)


def test_announced_layer_runs_the_learned_attention():
    """The fake layer gets the call (pattern, selector, layer index, a 2-D mask) and its ``run`` applies the
    adapter's scale; the output is its sinks + window attention."""
    params = {"pattern": "sparse_k", "sinks": 2, "window": 3, "top_k": 2, "query_block": 4}
    module, fake = _Module(params), _FakeSelectionLayer()
    module._sparse_k_selector = selector = object()
    q, k, v = _qkv(0, Sq=3)
    announce(module, fake, k)
    out, weights = attention_forward(module, q, k, v, torch.ones(2, 11, dtype=torch.bool), scaling=0.3)
    pattern = SparseK(sinks=2, window=3, top_k=2, query_block=4)
    assert weights is None and len(fake.calls) == 1
    got_pattern, got_mask, got_selector, got_layer = fake.calls[0]
    assert got_pattern == pattern and got_selector is selector and got_layer == 1
    assert got_mask.shape == (2, 11) and bool(got_mask.all())
    want = sparse_attention(q, k, v, pattern.static_part(), scale=0.3, layer_idx=1)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-12, rtol=0)
    assert not torch.equal(out, sparse_attention(q, k, v, pattern.static_part(), layer_idx=1).transpose(1, 2))


def test_other_key_tensors_and_collected_layers_are_not_found():
    """Only the very tensor announced finds the layer (equal values do not); a collected layer or key is gone."""
    module, fake = _Module({"pattern": "sparse_k", "sinks": 2, "window": 3, "top_k": 2, "query_block": 4}), _FakeSelectionLayer()
    q, k, v = _qkv(1, Sq=1)
    assert announced_layer(module, k) is None
    announce(module, fake, k)
    assert announced_layer(module, k) is fake and announced_layer(module, k.clone()) is None
    assert announced_layer(object(), k) is None  # no __dict__ entry: nothing announced
    attention_forward(module, q, k.clone(), v, None)  # the adapter selects on its own
    assert fake.calls == []
    announce(module, _FakeSelectionLayer(), k)
    gc.collect()
    assert announced_layer(module, k) is None
    announce(module, fake, k.clone())
    gc.collect()
    assert announced_layer(module, k) is None and module.__dict__[cache_protocol.ANNOUNCE_ATTR][1]() is None


def test_announced_layer_may_refuse_the_key_mask():
    """A static pattern's padded call asks the announced layer, which raises; an unannounced one runs."""
    module, fake = _Module({"pattern": "streaming", "sinks": 1, "window": 4}), _FakeSelectionLayer()
    q, k, v = _qkv(2)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :3] = False
    announce(module, fake, k)
    with pytest.raises(ValueError, match="fake layer: padded"):
        attention_forward(module, q, k, v, mask)
    out, _ = attention_forward(module, q, k.clone(), v, mask)
    want = sparse_attention(q, k, v, Streaming(sinks=1, window=4), attention_mask=mask, layer_idx=1)
    assert torch.isfinite(out[0]).all()
    torch.testing.assert_close(out[0], want.transpose(1, 2)[0], atol=1e-12, rtol=0)
    attention_forward(module, q, k, v, torch.ones(2, 11, dtype=torch.bool))  # unpadded: accepted
    assert fake.calls == []  # a static pattern never hands its attention to the layer


def test_sparse_cache_layers_offer_the_protocol():
    """``SparseCache``'s layers have every method of the protocol they implement, with the same parameters."""
    pytest.importorskip("transformers")
    from hf_sparse_attention.cache import BoundedLayer, SelectionLayer

    for cls, protocol in ((BoundedLayer, cache_protocol.CacheLayer), (SelectionLayer, cache_protocol.SelectionCacheLayer)):
        names = [n for n in dir(protocol) if not n.startswith("_") and callable(getattr(protocol, n))]
        assert "check_key_mask" in names
        for name in names:
            want = list(inspect.signature(getattr(protocol, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls.__name__, name)
    assert "attend" in dir(cache_protocol.SelectionCacheLayer) and "attend" not in dir(cache_protocol.CacheLayer)
