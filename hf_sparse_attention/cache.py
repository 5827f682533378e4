"""Bounded KV cache for generation with streaming / sliding-window patterns (design §8).

``SparseCache(model)`` gives every layer whose pattern (``config.sparse_attention``, after the
model's own sliding window) is ``streaming``, ``sliding_window`` or restricted to a model window a
``BoundedLayer`` that keeps only ``sinks + window - 1`` keys after each step: the first ``sinks``
keys and the last ``window - 1``. Every other layer (dense, block patterns, learned selection,
which may still need any older key) keeps a ``DynamicLayer``. Pass it to ``model.generate(...,
past_key_values=SparseCache(model))``; memory stays flat at any length.

Why attention over the kept keys is exact: the kept tensor is ``[sinks | last window-1 | new]``.
Both the queries and the window keys moved left by the same number of dropped slots, so
``i - window < j`` holds on tensor indices exactly when it holds on positions, and the sinks stay
at indices ``0 .. sinks-1``. So the layer's pattern runs unchanged on the kept tensor (the mask
function reports ``kv_offset = 0`` and the kept length).

Position modes:

* ``"original"``: keys keep the RoPE phase of their original position; generation equals
  recomputing the whole prefix with the same pattern, token for token.
* ``"rolling"`` (StreamingLLM): positions are assigned within the cache: once keys are dropped,
  the sink keys are re-rotated to sit right before the kept window (their phase becomes
  ``first_window_position - sinks + s``), so the query sees the cache as one contiguous sequence.
  A decode step equals recomputing the cache content ``[sinks, window, new token]`` as a fresh
  sequence at positions ``0 .. n-1`` (exactly so for the first layer, whose keys depend only on
  the token and its position). Needs the model's rotary frequencies (Llama-style ``rotate_half`` RoPE).

Limitations: batches without padding (a padded row would count its padding as sinks); no
``crop`` (assisted decoding).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from sparse_k.patterns import SlidingWindow, Streaming
from sparse_k.config import validate_sparse_config
from sparse_k.transformers_adapter import WithinWindow, _translation_invariant, layer_pattern

__all__ = ["BoundedLayer", "SparseCache", "bounded_keep"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(keys: torch.Tensor, inv_freq: torch.Tensor, shift: int) -> torch.Tensor:
    """Move RoPE-rotated ``keys (B, H, n, D)`` by ``shift`` positions (``rotate_half`` convention)."""
    angle = shift * inv_freq.to(device=keys.device, dtype=torch.float64)
    angle = torch.cat((angle, angle))
    cos, sin = angle.cos().to(keys.dtype), angle.sin().to(keys.dtype)
    return keys * cos + _rotate_half(keys) * sin


class BoundedLayer(CacheLayerMixin):
    """Keeps the first ``sinks`` keys and the last ``window - 1`` keys of one attention layer.

    ``update`` returns ``[kept | new]`` for this step's attention and then drops what no future
    query can attend. ``get_seq_length`` is the number of tokens seen (positions keep counting).
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, sinks: int, window: int, mode: str = "original", inv_freq: torch.Tensor | None = None):
        super().__init__()
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"BoundedLayer: `sinks` must be an int >= 0, got {sinks!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"BoundedLayer: `window` must be an int >= 1, got {window!r}")
        if mode not in ("original", "rolling"):
            raise ValueError(f"BoundedLayer: `mode` must be 'original' or 'rolling', got {mode!r}")
        if mode == "rolling" and sinks > 0 and inv_freq is None:
            raise ValueError("BoundedLayer: the 'rolling' mode re-rotates sink keys and needs the model's `inv_freq`")
        self.sinks, self.window, self.mode, self.inv_freq = sinks, window, mode, inv_freq
        self.cumulative_length = 0
        self.sink_keys: torch.Tensor | None = None  # sinks at their original phase (rolling mode)

    @property
    def capacity(self) -> int:
        """Keys kept between steps: ``sinks + window - 1``."""
        return self.sinks + self.window - 1

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key/value_states (B, H, q, D)``; return all keys this step's queries may use."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        n = keys.shape[-2]
        if n <= self.capacity:
            self.keys, self.values = keys, values
        else:
            tail = self.window - 1
            kept_k = [keys[:, :, : self.sinks], keys[:, :, n - tail :]]
            kept_v = [values[:, :, : self.sinks], values[:, :, n - tail :]]
            if self.mode == "rolling" and self.sinks:
                if self.sink_keys is None:
                    self.sink_keys = keys[:, :, : self.sinks].clone()
                first_window_pos = self.cumulative_length - tail
                kept_k[0] = rotate_keys(self.sink_keys, self.inv_freq, first_window_pos - self.sinks)
            self.keys = torch.cat(kept_k, dim=-2)
            self.values = torch.cat(kept_v, dim=-2)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The key tensor of the next update: kept keys + the new ones, from slot 0."""
        kept = self.keys.shape[-2] if self.is_initialized else 0
        return kept + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.sink_keys = None
        self.is_initialized = False
        self.cumulative_length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.sink_keys is not None:
            self.sink_keys = self.sink_keys.index_select(0, beam_idx.to(self.sink_keys.device))

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a bounded SparseCache cannot be cropped (it no longer holds the dropped keys)")


def bounded_keep(pattern) -> tuple[int, int] | None:
    """``(sinks, window)`` a ``BoundedLayer`` must keep for ``pattern``, or None when its rule does not
    survive the compression (see the module docstring)."""
    if isinstance(pattern, Streaming):
        return pattern.sinks, pattern.window
    if isinstance(pattern, SlidingWindow) and pattern.causal:
        return 0, pattern.window
    if isinstance(pattern, WithinWindow) and _translation_invariant(pattern.base):
        return 0, pattern.window
    return None


def _text_model_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    get_text = getattr(config, "get_text_config", None)
    return get_text() if get_text is not None else config


def _model_windows(config, n_layers):
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None:
        return [window] * n_layers, [None] * n_layers
    return [window if t == "sliding_attention" else None for t in types], list(types)


def _inv_freq(model, layer_type):
    for module in model.modules():
        if module.__class__.__name__.endswith("RotaryEmbedding"):
            if layer_type is not None and hasattr(module, f"{layer_type}_inv_freq"):
                return getattr(module, f"{layer_type}_inv_freq")
            if hasattr(module, "inv_freq"):
                return module.inv_freq
    return None


class SparseCache(Cache):
    """A cache whose streaming / sliding-window layers keep only what their pattern can still use.

    Args:
        model: the Transformers model (its config, and for ``"rolling"`` its rotary embedding).
        mode: ``"original"`` or ``"rolling"``; default ``config.sparse_attention["cache_positions"]``.
    ``bounded_layers`` lists the layers with a ``BoundedLayer``; the others keep a Transformers layer
    (``DynamicSlidingWindowLayer`` under a model window, else a growing ``DynamicLayer``).
    Batches must be unpadded (see the module docstring).
    """

    def __init__(self, model, mode: str | None = None):
        config = _text_model_config(model)
        mode = mode or validate_sparse_config(getattr(config, "sparse_attention", None))["cache_positions"]
        if mode not in ("original", "rolling"):
            raise ValueError(f"SparseCache: `mode` must be 'original' or 'rolling', got {mode!r}")
        n_layers = config.num_hidden_layers
        windows, types = _model_windows(config, n_layers)
        layers, self.bounded_layers = [], []
        for i in range(n_layers):
            pattern = layer_pattern(config, i, windows[i])
            keep = bounded_keep(pattern)
            if keep is None:
                # A model window still bounds what is kept (absolute slots; the adapter re-aligns them).
                local = isinstance(pattern, WithinWindow)
                layers.append(DynamicSlidingWindowLayer(sliding_window=pattern.window) if local else DynamicLayer())
                continue
            inv_freq = None
            if mode == "rolling" and keep[0] > 0:
                if not isinstance(model, torch.nn.Module):
                    raise TypeError("SparseCache(mode='rolling') needs the model (for its rotary frequencies), not a config")
                inv_freq = _inv_freq(model, types[i])
                if inv_freq is None:
                    raise ValueError("SparseCache(mode='rolling') found no rotary embedding (`inv_freq`) in the model")
            layers.append(BoundedLayer(keep[0], keep[1], mode, inv_freq))
            self.bounded_layers.append(i)
        self.mode = mode
        super().__init__(layers=layers)

    def cached_lengths(self) -> list[int]:
        """Keys held per layer now."""
        return [layer.keys.shape[-2] if layer.is_initialized else 0 for layer in self.layers]

    def nbytes(self) -> int:
        """Bytes of the cached key and value tensors of all layers."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        return total
