"""What a cache layer offers the Transformers adapter, and how the adapter finds it for a call.

Transformers passes the attention function the key/value tensors its cache returned, not the cache:
``past_key_values.update(...)`` runs inside the attention module, then ``attention_forward(module,
query, key, value, ...)`` gets the result. A cache layer that keeps state the attention needs (the
learned layers' decode state, or a refusal of padded batches) therefore *announces* itself on the
module after each update, together with the key tensor it returned:

* ``announce(module, layer, keys)``: the layer (``CacheLayer``) just returned ``keys`` to ``module``;
* ``announced_layer(module, key)``: that layer when ``key`` is the very tensor it announced, else None
  (another cache, or no update this call).

Both references are weak (the module keeps neither the layer nor its keys alive); they are stored in
the module's ``__dict__`` under ``ANNOUNCE_ATTR`` and read nowhere else. A ``SelectionCacheLayer``
(one for a learned pattern) also runs that layer's attention (``attend``): the adapter hands it a
``run`` callback that calls ``sparse_attention`` with the layer's other arguments.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

import torch

__all__ = ["ANNOUNCE_ATTR", "CacheLayer", "RunAttention", "SelectionCacheLayer", "announce", "announced_layer"]

#: Attribute of an attention module holding ``(weakref(layer), weakref(keys))`` of the last announcement.
ANNOUNCE_ATTR = "_sparse_k_cache_layer"

#: ``run(query, key, value, pattern, selection, q_start, key_mask) -> (B, Hq, Sq, D)``: ``sparse_attention``
#: with the layer's scale, softcap, sink logits, layer index and backend.
RunAttention = Callable[..., torch.Tensor]


class CacheLayer(Protocol):
    """A cache layer the adapter consults for every call whose key tensor it returned."""

    def check_key_mask(self, key_mask: torch.Tensor | None) -> None:
        """Raise ``ValueError`` when the layer cannot serve ``key_mask`` (``(B, L)`` bool, True = key
        takes part), e.g. a padded batch for a layer that drops keys."""

    # Optional: ``check_pattern(pattern, layer_idx)``, called for every eager call whose key tensor the layer returned,
    # raises ``ValueError`` when the layer cannot serve ``pattern`` (it kept what another pattern needs).


class SelectionCacheLayer(CacheLayer, Protocol):
    """A cache layer of a learned-selection layer (``pattern.learned and pattern.top_k > 0``): it runs the
    call's attention over the slots it returned and keeps the selection state between calls."""

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pattern, key_mask: torch.Tensor | None,
               run: RunAttention, *, selector, layer_idx: int) -> torch.Tensor:
        """Attention of ``query (B, Hq, Sq, D)`` over ``key/value (B, Hkv, Skv, D)`` (the tensors the layer
        returned) under ``pattern``; ``selector`` is the module's trained selector or None. Returns
        ``(B, Hq, Sq, D)``."""


def announce(module: torch.nn.Module, layer: CacheLayer, keys: torch.Tensor) -> None:
    """Record that ``layer`` returned ``keys`` to ``module``'s attention (call it at the end of each update)."""
    module.__dict__[ANNOUNCE_ATTR] = (weakref.ref(layer), weakref.ref(keys))


def announced_layer(module, key: torch.Tensor) -> CacheLayer | None:
    """The layer announced on ``module`` when ``key`` is the tensor it announced (and both are alive), else None."""
    refs = getattr(module, "__dict__", {}).get(ANNOUNCE_ATTR)
    if refs is None:
        return None
    layer, keys = refs[0](), refs[1]()
    return layer if layer is not None and keys is key else None
