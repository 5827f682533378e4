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

Learned layers (``sparse_k``, ``dsa``) get a ``SelectionLayer``, which the attention function
recognises (the key tensor it receives is the one the layer just returned) and which keeps the
layer's decode state between steps:

* ``sparse_k``: the running selection (``sparse_k.selection.decode_selection.SparseKDecodeState``): when a new
  query block starts, only its new candidates are scored and merged (no re-sort of all candidates).
  With ``evict=True`` (default) the keys that can never be selected again are dropped: the layer
  keeps the sinks, the current block's ``top_k`` selection and the keys from the current block's
  first candidate-to-be onwards, at most ``sinks + top_k + window + query_block - 2`` keys between
  steps (``query_block - 1`` more than ``sinks + window + top_k``: the keys that left the window
  since the block started wait for the next block's selection). Each kept key keeps its original
  RoPE phase and position (both position modes); generation equals the non-evicting run, which
  equals recomputing the prefix, token for token.
* ``dsa``: nothing is evicted (design §7: every key stays a candidate); the indexer keys of the
  cached tokens are kept, so a decode step computes them for its new tokens only.
* either pattern without a trained selector (the query-aware training-free default,
  ``sparse_k.selection.page_selection``): nothing is evicted (a page that scores low for one block may score
  high for a later query); the layer keeps the memo of the current block's first query, so a
  decode step selects exactly as the recompute does.

Limitations: batches without padding (a padded row would count its padding as sinks; a padded batch
raises ``ValueError``); no
``crop`` (assisted decoding) on layers that dropped keys.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from sparse_k.integrations.config import validate_sparse_config
from sparse_k.selection.decode_selection import SparseKDecodeState
from sparse_k.layouts.patterns import DSA, SlidingWindow, SparseK, Streaming
from sparse_k.selection.selectors import build_selection
from sparse_k.layouts.token_layout import TokenLayout
from sparse_k.integrations.transformers_adapter import CACHE_LAYER_ATTR, WithinWindow, _translation_invariant, layer_pattern

__all__ = ["BoundedLayer", "SelectionLayer", "SparseCache", "bounded_keep"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(keys: torch.Tensor, inv_freq: torch.Tensor, shift: int) -> torch.Tensor:
    """Move RoPE-rotated ``keys (B, H, n, D)`` by ``shift`` positions (``rotate_half`` convention)."""
    angle = shift * inv_freq.to(device=keys.device, dtype=torch.float64)
    angle = torch.cat((angle, angle))
    cos, sin = angle.cos().to(keys.dtype), angle.sin().to(keys.dtype)
    return keys * cos + _rotate_half(keys) * sin


class _KeptKeysLayer(CacheLayerMixin):
    """A cache layer that keeps a subset of the keys seen: ``cumulative_length`` counts every key,
    ``keys`` holds the kept ones, and the next update's key tensor starts at slot 0."""

    _module = None
    _returned = None

    def _mark_returned(self, keys: torch.Tensor) -> None:
        """Remember ``keys`` as this update's result and tell the attention module (the adapter finds
        this layer through ``CACHE_LAYER_ATTR`` and ``owns``)."""
        self._returned = weakref.ref(keys)
        module = self._module() if self._module is not None else None
        if module is not None:
            module.__dict__[CACHE_LAYER_ATTR] = weakref.ref(self)

    def owns(self, key: torch.Tensor) -> bool:
        """True when ``key`` is the tensor this layer's last ``update`` returned."""
        return self._returned is not None and self._returned() is key

    def check_key_mask(self, key_mask: torch.Tensor | None) -> None:
        """Raise ``ValueError`` when ``key_mask`` (``(B, L)`` bool) marks padding: the kept slots of a
        padded row would hold its padding as sinks and drop real keys."""
        if key_mask is not None and not bool(key_mask.all()):
            raise ValueError(
                "SparseCache supports unpadded batches only: this batch is padded (its attention_mask has zeros), and a "
                "padded row would keep its padding as sinks and drop real keys. Generate the rows one at a time "
                "(unpadded), or use the default DynamicCache, which handles padding (memory grows with the length)"
            )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.is_initialized = True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The key tensor of the next update: kept keys + the new ones, from slot 0."""
        kept = self.keys.shape[-2] if self.is_initialized else 0
        return kept + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1


class BoundedLayer(_KeptKeysLayer):
    """Keeps the first ``sinks`` keys and the last ``window - 1`` keys of one attention layer.

    ``update`` returns ``[kept | new]`` for this step's attention and then drops what no future
    query can attend. ``get_seq_length`` is the number of tokens seen (positions keep counting).
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, sinks: int, window: int, mode: str = "original", inv_freq: torch.Tensor | None = None,
                 module: torch.nn.Module | None = None):
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
        self._module = None if module is None else weakref.ref(module)
        self.cumulative_length = 0
        self.sink_keys: torch.Tensor | None = None  # sinks at their original phase (rolling mode)

    @property
    def capacity(self) -> int:
        """Keys kept between steps: ``sinks + window - 1``."""
        return self.sinks + self.window - 1

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
        self._mark_returned(keys)
        return keys, values

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


_BIG = torch.iinfo(torch.int64).max
#: ``TokenLayout.query_block`` of the one-block layouts a ``SelectionLayer`` hands to attention: every
#: query of the call is in block 0.
_ONE_BLOCK = 1 << 30


class SelectionLayer(_KeptKeysLayer):
    """Cache layer of a learned-selection attention layer (module docstring).

    Slots of ``keys``/``values``: a *front* of ``F`` slots (the sinks and the current selection, at
    positions ``front_pos (B, Hkv, F)``, ascending; empty slots at ``_BIG``), then the *tail*: the
    contiguous positions ``tail_start ..`` up to the newest token. Before anything is evicted
    ``F == 0`` and ``tail_start == 0`` (slot = position).
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, pattern, module: torch.nn.Module, evict: bool = True):
        super().__init__()
        if not isinstance(pattern, (SparseK, DSA)):
            raise TypeError(f"SelectionLayer needs a sparse_k or dsa pattern, got {type(pattern).__name__}")
        self.pattern, self.evict = pattern, bool(evict) and isinstance(pattern, SparseK)
        self._module = weakref.ref(module)
        self.cumulative_length = 0
        self.front_pos: torch.Tensor | None = None
        self.tail_start = 0
        self.state: SparseKDecodeState | None = None
        self.index_keys: torch.Tensor | None = None
        self.memo: dict = {}  # training-free selection: the current block's first query (sparse_k.selection.page_selection)
        self._index_owner = None
        self._new_tokens = 0

    # -- Transformers cache-layer interface ------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append this step's keys/values; return every kept slot (the attention function then runs
        ``attend`` on them and, with eviction, drops what no later query can use)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.cumulative_length += key_states.shape[-2]
        self._new_tokens = key_states.shape[-2]
        self._mark_returned(self.keys)
        return self.keys, self.values

    def reset(self) -> None:
        self.keys = self.values = self.front_pos = self.state = self.index_keys = None
        self.memo = {}
        self.is_initialized = False
        self.cumulative_length, self.tail_start = 0, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        pick = lambda t: None if t is None else t.index_select(0, beam_idx.to(t.device))
        self.front_pos, self.index_keys = pick(self.front_pos), pick(self.index_keys)
        for name in ("block", "q"):
            if name in self.memo:  # buffers written in place (sparse_k.selection.step_state)
                self.memo[name].copy_(pick(self.memo[name]))
        for name in ("layout_key", "layout"):  # the reused decode layout belongs to the old row order
            self.memo.pop(name, None)
        if self.state is not None:
            for name in ("sup_u", "sup_pos", "positions", "counts", "weights"):
                setattr(self.state, name, pick(getattr(self.state, name)))

    def crop(self, tokens_to_remove: int) -> None:
        if self.front_pos is not None:
            raise ValueError("a SparseCache layer that evicted keys cannot be cropped")
        if tokens_to_remove <= 0:
            return
        self.keys, self.values = self.keys[:, :, :-tokens_to_remove], self.values[:, :, :-tokens_to_remove]
        self.cumulative_length -= tokens_to_remove
        self.state = None  # rebuilt from scratch at the next call
        if self.index_keys is not None:
            self.index_keys = self.index_keys[:, : self.cumulative_length]

    # -- attention ----------------------------------------------------------------------------------

    def attend(self, query, key, value, pattern, key_mask, run, *, selector, layer_idx: int):
        """Attention of this call's queries over the slots ``key``/``value`` that ``update`` returned.

        ``run(q, k, v, pattern, selection, q_start, key_mask)`` runs ``sparse_attention`` with the
        layer's other arguments. Returns ``(B, Hq, Sq, D)``.
        """
        self.check_key_mask(key_mask)
        if pattern != self.pattern:
            raise ValueError(f"SparseCache: layer {layer_idx} runs {pattern!r}, its cache was built for {self.pattern!r}")
        if isinstance(pattern, DSA) or selector is None:
            if self.front_pos is not None:
                raise ValueError(f"SparseCache: layer {layer_idx} evicted keys under a trained selector, which is gone now")
            return self._attend_dsa(query, key, value, run, selector, layer_idx)
        if self.state is None:
            geo_sel = build_selection(pattern, query, key, value, _geometry(query, key), layer_idx=layer_idx, selector=selector)
            out = run(query, key, value, pattern if geo_sel is not None else pattern.static_part(), geo_sel, None, None)
            self.state = SparseKDecodeState(pattern, weighted=True)
        else:
            out = self._attend_blocks(query, key, value, run, selector)
        self._after_call(key, value, selector)
        return out

    def _attend_dsa(self, query, key, value, run, selector, layer_idx):
        """Selection from scratch each call (``dsa``, and the training-free default of both patterns),
        with the layer's memo of the current block's first query (training-free) or its cached indexer keys."""
        index_keys = None
        if selector is not None and isinstance(self.pattern, DSA):
            old = key.shape[2] - self._new_tokens
            fresh = self._index_owner is selector and self.index_keys is not None and self.index_keys.shape[1] == old
            with torch.no_grad():
                if fresh:  # indexer keys of the new tokens only
                    self.index_keys = torch.cat([self.index_keys, selector.index_keys(key[:, :, old:])], 1)
                else:
                    self.index_keys = selector.index_keys(key)
            self._index_owner = selector
            index_keys = self.index_keys
        sel = build_selection(self.pattern, query, key, value, _geometry(query, key), layer_idx=layer_idx, selector=selector,
                              index_keys=index_keys, memo=self.memo if selector is None else None)
        return run(query, key, value, self.pattern if sel is not None else self.pattern.static_part(), sel, None, None)

    def _slots(self, pos: torch.Tensor) -> torch.Tensor:
        """Slot index of key positions ``pos (B, Hkv, n)`` (-1 stays -1)."""
        F = 0 if self.front_pos is None else self.front_pos.shape[-1]
        idx = F + pos - self.tail_start
        if F:
            front = torch.searchsorted(self.front_pos, pos.contiguous())
            idx = torch.where(pos >= self.tail_start, idx, front)
        return torch.where(pos >= 0, idx, torch.full_like(idx, -1))

    def _scores(self, key, value, selector):
        def scores(lo: int, hi: int) -> torch.Tensor:
            F = 0 if self.front_pos is None else self.front_pos.shape[-1]
            i0 = F + lo - self.tail_start
            k, v = key[:, :, i0 : i0 + hi - lo + 1], value[:, :, i0 : i0 + hi - lo + 1]
            with torch.no_grad():
                return selector(v, torch.arange(lo, hi + 1, device=k.device)[None], k)

        return scores

    def _attend_blocks(self, query, key, value, run, selector):
        B, _, Sq, _ = query.shape
        Skv, bq = key.shape[2], self.pattern.query_block
        q0 = self.cumulative_length - Sq  # position of the call's first query
        scores = self._scores(key, value, selector)
        outs, t = [], 0
        while t < Sq:
            blk = (q0 + t) // bq
            t1 = min(Sq, (blk + 1) * bq - q0)
            self.state.advance(blk, scores)
            st = self.state
            if st.positions is None:  # no candidate yet: sinks + window
                outs.append(run(query[:, :, t:t1], key, value, self.pattern.static_part(), None, Skv - Sq + t, None))
            else:
                lay = TokenLayout(
                    indices=self._slots(st.positions)[:, :, None].to(torch.int32),
                    counts=st.counts[:, :, None].to(torch.int32), query_block=_ONE_BLOCK,
                    first_block=torch.zeros(B, dtype=torch.int64, device=key.device),
                    weights=None if st.weights is None else st.weights[:, :, None],
                )
                outs.append(run(query[:, :, t:t1], key, value, self.pattern, lay, Skv - Sq + t, None))
            t = t1
        return torch.cat(outs, 2)

    def _after_call(self, key, value, selector):
        """Advance the state to the next query's block; with eviction, keep only what it can use."""
        p = self.pattern
        nxt = self.cumulative_length // p.query_block
        self.state.advance(nxt, self._scores(key, value, selector))
        new_tail = nxt * p.query_block - p.window + 1
        if not self.evict or new_tail <= p.sinks or self.state.positions is None:
            return
        B, H = key.shape[:2]
        dev = key.device
        sinks = torch.arange(p.sinks, device=dev).expand(B, H, p.sinks)
        sel = torch.where(self.state.positions >= 0, self.state.positions, torch.full_like(self.state.positions, _BIG))
        front = torch.cat([sinks, sel], -1)
        idx = self._slots(torch.where(front == _BIG, torch.full_like(front, -1), front))
        ok = idx >= 0
        g = idx.clamp_min(0)[..., None]
        fk = torch.where(ok[..., None], key.gather(2, g.expand(-1, -1, -1, key.shape[-1])), torch.zeros((), dtype=key.dtype, device=dev))
        fv = torch.where(ok[..., None], value.gather(2, g.expand(-1, -1, -1, value.shape[-1])), torch.zeros((), dtype=value.dtype, device=dev))
        t0 = (0 if self.front_pos is None else self.front_pos.shape[-1]) + new_tail - self.tail_start
        self.keys = torch.cat([fk, key[:, :, t0:]], 2)
        self.values = torch.cat([fv, value[:, :, t0:]], 2)
        self.front_pos, self.tail_start = front, new_tail


def _geometry(query, key):
    from sparse_k.layouts.geometry import row_geometry

    return row_geometry(query.shape[0], query.shape[2], key.shape[2], device=query.device)


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
        evict: ``sparse_k`` layers drop the keys that can never be selected again (module docstring).
    ``bounded_layers`` lists the layers with a ``BoundedLayer``, ``selection_layers`` those with a
    ``SelectionLayer`` (learned patterns; needs the model, not just its config); the others keep a
    Transformers layer (``DynamicSlidingWindowLayer`` under a model window, else a ``DynamicLayer``).
    Batches must be unpadded: a padded batch raises ``ValueError`` at its first forward (when built
    from the model; from a config alone the attention modules are unknown and padding goes unchecked).
    """

    def __init__(self, model, mode: str | None = None, evict: bool = True):
        config = _text_model_config(model)
        mode = mode or validate_sparse_config(getattr(config, "sparse_attention", None))["cache_positions"]
        if mode not in ("original", "rolling"):
            raise ValueError(f"SparseCache: `mode` must be 'original' or 'rolling', got {mode!r}")
        n_layers = config.num_hidden_layers
        windows, types = _model_windows(config, n_layers)
        modules = {}
        if isinstance(model, torch.nn.Module):
            from .selectors import attention_modules

            modules = attention_modules(model)
        layers, self.bounded_layers, self.selection_layers = [], [], []
        for i in range(n_layers):
            pattern = layer_pattern(config, i, windows[i])
            if pattern.learned and i in modules:
                layers.append(SelectionLayer(pattern, modules[i], evict))
                self.selection_layers.append(i)
                continue
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
            layers.append(BoundedLayer(keep[0], keep[1], mode, inv_freq, modules.get(i)))
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
