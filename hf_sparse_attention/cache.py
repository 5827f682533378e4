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
  the token and its position). Needs the model's rotary frequencies (Llama-style ``rotate_half`` RoPE, probed when
  the cache is built: another convention raises ValueError); a layer without RoPE (NoPE) keeps its keys as they are.

Learned layers (``sparse_k``, ``dsa``) get a ``SelectionLayer``, which the attention function
finds through ``sparse_k.integrations.cache_protocol`` (the layer announces the key tensor it just
returned) and which keeps the layer's decode state between steps
(``sparse_k.selection.cache_state.CachedSelection``; the layer stores the kept keys and values):

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
  high for a later query); the layer keeps the memo of the last blocks' first queries (``sparse_k.selection.block_ring``), so a
  decode step selects exactly as the recompute does.

Limitations: batches without padding (a padded row would count its padding as sinks; a padded batch
raises ``ValueError``); no
``crop`` (assisted decoding) on layers that dropped keys; the configuration of its construction (``check_pattern``:
a layer reconfigured to a pattern that may need dropped keys, or a learned layer to another pattern, raises
``ValueError``); a model switched to one of Transformers' dense implementations (``sdpa``, ``eager``...) raises
``ValueError`` at a bounded layer's first update (``BoundedLayer.check_implementation``).
"""

from __future__ import annotations

import sys
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from sparse_k.integrations.cache_protocol import announce
from sparse_k.integrations.config import validate_sparse_config
from sparse_k.integrations.transformers_adapter import WithinWindow, config_window, layer_pattern, translation_invariant
from sparse_k.layouts.patterns import SlidingWindow, Streaming
from sparse_k.selection.cache_state import CachedSelection

__all__ = ["BoundedLayer", "SelectionLayer", "SparseCache", "bounded_keep"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(keys: torch.Tensor, inv_freq: torch.Tensor, shift: int) -> torch.Tensor:
    """Move RoPE-rotated ``keys (B, H, n, D)`` by ``shift`` positions (``rotate_half`` convention, every one of the
    ``D`` dimensions rotated: ``inv_freq`` has ``D / 2`` entries)."""
    if 2 * inv_freq.shape[-1] != keys.shape[-1]:
        raise ValueError(
            f"SparseCache(mode='rolling') re-rotates whole keys, but this model's rotary embedding covers "
            f"{2 * inv_freq.shape[-1]} of the keys' {keys.shape[-1]} dimensions (partial rotary or MLA); "
            "use mode='original' (cache_positions='original')"
        )
    angle = shift * inv_freq.to(device=keys.device, dtype=torch.float64)
    angle = torch.cat((angle, angle))
    cos, sin = angle.cos().to(keys.dtype), angle.sin().to(keys.dtype)
    return keys * cos + _rotate_half(keys) * sin


class _KeptKeysLayer(CacheLayerMixin):
    """A cache layer that keeps a subset of the keys seen: ``cumulative_length`` counts every key,
    ``keys`` holds the kept ones, and the next update's key tensor starts at slot 0."""

    _module = None

    def _announce(self, keys: torch.Tensor) -> None:
        """Tell the attention module that this update returned ``keys`` (the adapter then finds this layer:
        ``sparse_k.integrations.cache_protocol``)."""
        module = self._module() if self._module is not None else None
        if module is not None:
            announce(module, self, keys)

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


#: Transformers' own attention implementations (also behind ``"paged|"``): they attend every key a cache returns and
#: know nothing of the pattern, so over a ``BoundedLayer`` they would run neither dense attention nor the pattern.
_DENSE_IMPLEMENTATIONS = frozenset(
    {"eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention"}
)


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
        self.check_implementation()
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
        self._announce(keys)
        return keys, values

    def check_implementation(self) -> None:
        """Raise ``ValueError`` when the attention module runs one of Transformers' dense implementations (the model was
        switched back to ``sdpa`` / ``eager`` for a dense baseline): it would attend whatever this layer kept, a dense
        prompt and then a window, neither dense attention nor the pattern. Nothing is checked without the module."""
        module = self._module() if self._module is not None else None
        impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if isinstance(impl, str) and impl.removeprefix("paged|") in _DENSE_IMPLEMENTATIONS:
            raise ValueError(
                f"SparseCache: this model runs attn_implementation={impl!r}, which attends every key the cache returns, "
                f"but this layer keeps only {self.sinks} sinks and the last {self.window - 1} keys; run the model with "
                "attn_implementation='sparse_k' (model.set_attn_implementation('sparse_k')), or use the default "
                "DynamicCache for a dense baseline"
            )

    def check_pattern(self, pattern, layer_idx: int) -> None:
        """Raise ``ValueError`` when ``pattern`` (what the layer runs now) may attend a key this layer dropped: it must
        be a streaming / sliding-window rule with at most ``sinks`` sinks and a window of at most ``window`` (the model
        was reconfigured after the cache was built)."""
        keep = bounded_keep(pattern)
        if keep is None or keep[0] > self.sinks or keep[1] > self.window:
            raise ValueError(
                f"SparseCache: layer {layer_idx} was built for a pattern that keeps {self.sinks} sinks and a window of "
                f"{self.window} keys (it dropped the rest), but the layer now runs {pattern!r}, which may attend the "
                "dropped keys; build a new SparseCache(model) after changing the configuration"
            )

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


class SelectionLayer(_KeptKeysLayer):
    """Cache layer of a learned-selection attention layer (module docstring): stores the kept keys and
    values; the selection state and what to evict live in ``selection``
    (``sparse_k.selection.cache_state.CachedSelection``). A ``SelectionCacheLayer`` of
    ``sparse_k.integrations.cache_protocol``."""

    is_sliding = False
    is_compileable = False

    def __init__(self, pattern, module: torch.nn.Module, evict: bool = True):
        super().__init__()
        self.selection = CachedSelection(pattern, evict)
        self._module = weakref.ref(module)
        self.cumulative_length = 0
        self._new_tokens = 0

    @property
    def memo(self) -> dict:
        """The training-free selection's memo of the current block (``selection.memo``)."""
        return self.selection.memo

    @property
    def is_croppable(self) -> bool:
        """Whether ``crop`` can cut this layer back (Transformers 5.24+ asks before assisted / prompt-lookup decoding):
        until it evicts keys (a trained SparseK scorer with ``evict=True``)."""
        return not self.selection.evicted

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
        self._announce(self.keys)
        return self.keys, self.values

    def reset(self) -> None:
        self.keys = self.values = None
        self.selection.reset()
        self.is_initialized = False
        self.cumulative_length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.selection.reorder(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Transformers' convention: ``-n`` drops the last ``n`` tokens; a positive value (Transformers before 5.18)
        is the number of tokens to keep. Raises ``ValueError`` once keys were evicted, or where the cut lands inside a
        query block whose first query the selection no longer holds (``CachedSelection.crop``)."""
        seen = self.cumulative_length
        length = seen + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove
        if tokens_to_remove == 0 or length >= seen:
            return
        if length < 0:
            raise ValueError(f"SparseCache: cannot drop {-tokens_to_remove} tokens from a layer that holds {seen}")
        self.selection.crop(length, seen)
        self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]
        self.cumulative_length = length

    # -- attention ------------------------------------------------------------------------------------

    def check_pattern(self, pattern, layer_idx: int) -> None:
        """Raise ``ValueError`` when the layer now runs another pattern than the one this cache layer was built for (the
        model was reconfigured after the cache was built: its decode state and evictions belong to the old one)."""
        if pattern != self.selection.pattern:
            raise ValueError(
                f"SparseCache: layer {layer_idx} runs {pattern!r}, its cache was built for {self.selection.pattern!r}; "
                "build a new SparseCache(model) after changing the configuration"
            )

    def attend(self, query, key, value, pattern, key_mask, run, *, selector, layer_idx: int):
        """Attention of this call's queries over the slots ``key``/``value`` that ``update`` returned.

        ``run(q, k, v, pattern, selection, q_start, key_mask)`` runs ``sparse_attention`` with the
        layer's other arguments. Returns ``(B, Hq, Sq, D)``.
        """
        self.check_key_mask(key_mask)
        out, kept = self.selection.attend(query, key, value, pattern, run, selector=selector, layer_idx=layer_idx,
                                          seen=self.cumulative_length, new_tokens=self._new_tokens)
        if kept is not None:
            self.keys, self.values = kept
        return out


def bounded_keep(pattern) -> tuple[int, int] | None:
    """``(sinks, window)`` a ``BoundedLayer`` must keep for ``pattern``, or None when its rule does not
    survive the compression (see the module docstring)."""
    if isinstance(pattern, Streaming):
        return pattern.sinks, pattern.window
    if isinstance(pattern, SlidingWindow) and pattern.causal:
        return 0, pattern.window
    if isinstance(pattern, WithinWindow) and translation_invariant(pattern.base):
        return 0, pattern.window
    return None


def _text_model_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    get_text = getattr(config, "get_text_config", None)
    return get_text() if get_text is not None else config


def _model_windows(config, n_layers):
    """Per layer, the model's own sliding window (None: global; ``config_window``, the rule the adapter reads when a
    model passes no window) and layer type (None without ``config.layer_types``)."""
    types = getattr(config, "layer_types", None)
    windows = [config_window(config, i) for i in range(n_layers)]
    return windows, ([None] * n_layers if types is None else list(types))


def _check_attention_only(config) -> None:
    """``ValueError`` for a model with layers that are not plain attention (Mamba, linear attention, hybrids): the
    layer Transformers' own cache gives them carries recurrent state that ``SparseCache`` does not keep."""
    plain = ("DynamicLayer", "DynamicSlidingWindowLayer")
    for i, layer in enumerate(DynamicCache(config=config).layers):
        if type(layer).__name__ not in plain:
            raise ValueError(
                f"SparseCache: layer {i} of this {getattr(config, 'model_type', 'model')} model is not a plain attention "
                f"layer (Transformers caches it as {type(layer).__name__}); SparseCache takes attention-only models: "
                "use the model's own cache (the default DynamicCache) with attn_implementation='sparse_k'"
            )


class _RotaryLookup:
    """The rotary embedding of each layer type of ``model``, for one cache build: ``model.modules()`` is scanned once
    (at the first lookup) for the modules whose class name ends in ``RotaryEmbedding``, and each layer type's answer is
    kept, so building the cache costs one pass over the modules, not one per rolling layer."""

    def __init__(self, model: torch.nn.Module):
        self._model, self._rotaries, self._by_type = model, None, {}

    def __call__(self, layer_type: str | None) -> tuple[torch.Tensor | None, torch.nn.Module | None]:
        """``(inv_freq (D/2,), rotary module)`` of ``layer_type``'s rotary embedding: the first rotary module with a
        ``{layer_type}_inv_freq`` (one embedding for several layer types, gemma3) or an ``inv_freq``;
        ``(None, None)`` without one."""
        if layer_type not in self._by_type:
            if self._rotaries is None:
                self._rotaries = [m for m in self._model.modules() if m.__class__.__name__.endswith("RotaryEmbedding")]
            self._by_type[layer_type] = self._find(layer_type)
        return self._by_type[layer_type]

    def _find(self, layer_type):
        for module in self._rotaries:
            if layer_type is not None and hasattr(module, f"{layer_type}_inv_freq"):
                return getattr(module, f"{layer_type}_inv_freq"), module
            if hasattr(module, "inv_freq"):
                return module.inv_freq, module
        return None, None


def _rotates_keys(attention) -> bool:
    """False for an attention module that applies no rotary embedding (NoPE layers: ``use_rope`` off, as smollm3 and
    llama4 mark them; exaone4's global layers, ``sliding_window`` set on a layer that is not sliding)."""
    if not getattr(attention, "use_rope", True):
        return False
    return not (getattr(attention, "is_sliding", None) is False and getattr(attention, "sliding_window", None) is not None)


def _check_rotation_convention(attention, rotary, inv_freq, layer_type, layer_idx: int) -> None:
    """Refuse the rolling mode when ``rotate_keys`` does not move this model's keys: the attention module's own
    ``apply_rotary_pos_emb`` (its modeling file's) rotates one probe key to two positions with the model's rotary
    embedding, and ``rotate_keys`` must carry the first onto the second (models that pair interleaved dimensions,
    cohere and helium say, do not follow ``rotate_half``). Nothing is checked where the modeling file has no such
    function or its rotary embedding takes other arguments."""
    apply = getattr(sys.modules.get(type(attention).__module__), "apply_rotary_pos_emb", None)
    if apply is None or rotary is None:
        return
    shift, dim = 7, 2 * inv_freq.shape[-1]
    probe = torch.randn(1, 1, 1, dim, generator=torch.Generator().manual_seed(0)).to(inv_freq.device).expand(1, 1, 2, dim)
    pos = torch.tensor([[3, 3 + shift]], device=inv_freq.device)
    try:
        with torch.no_grad():
            try:  # one rotary embedding per layer type (gemma3) takes the type
                cos, sin = rotary(probe, pos, layer_type) if layer_type is not None else rotary(probe, pos)
            except TypeError:
                cos, sin = rotary(probe, pos)
            _, k = apply(probe, probe, cos, sin)
    except Exception:  # noqa: BLE001 - another rotary / apply signature: nothing to compare with
        return
    if k.shape != probe.shape:
        return
    moved = rotate_keys(k[:, :, :1].double(), inv_freq, shift)
    if not torch.allclose(moved.float(), k[:, :, 1:].float(), atol=1e-4, rtol=1e-4):
        raise ValueError(
            f"SparseCache(mode='rolling') re-rotates sink keys with the rotate_half convention, but layer {layer_idx} "
            f"of this {type(attention).__module__.rsplit('.', 1)[-1].removeprefix('modeling_')} model rotates its "
            "keys otherwise (interleaved dimension pairs, say); use mode='original' (cache_positions='original')"
        )


def _rolling_inv_freq(rotary_lookup: _RotaryLookup | None, attention, layer_type, layer_idx: int,
                      probed: set) -> torch.Tensor:
    """``inv_freq`` of the rotary embedding that re-rotates a rolling layer's sink keys, from ``rotary_lookup`` (the
    cache build's ``_RotaryLookup`` of the model; None when the cache was given a config). ``attention``: the layer's
    attention module (None when unknown); its rotation convention is checked (``_check_rotation_convention``) once per
    attention class and layer type, the pairs in ``probed`` (updated here): the same modeling file's
    ``apply_rotary_pos_emb`` with the same rotary embedding gives the same answer."""
    if rotary_lookup is None:
        raise TypeError("SparseCache(mode='rolling') needs the model (for its rotary frequencies), not a config")
    inv_freq, rotary = rotary_lookup(layer_type)
    if inv_freq is None:
        raise ValueError("SparseCache(mode='rolling') found no rotary embedding (`inv_freq`) in the model")
    if attention is not None and (type(attention), layer_type) not in probed:
        _check_rotation_convention(attention, rotary, inv_freq, layer_type, layer_idx)
        probed.add((type(attention), layer_type))
    return inv_freq


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
        _check_attention_only(config)
        windows, types = _model_windows(config, n_layers)
        modules = {}
        if isinstance(model, torch.nn.Module):
            from .selectors import attention_modules

            modules = attention_modules(model)
        layers, self.bounded_layers, self.selection_layers = [], [], []
        probed = set()  # (attention class, layer type) pairs whose rotation convention was checked
        rotary_lookup = _RotaryLookup(model) if isinstance(model, torch.nn.Module) else None
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
            layer_mode = mode if i not in modules or _rotates_keys(modules[i]) else "original"  # NoPE: nothing to re-rotate
            if layer_mode == "rolling" and keep[0] > 0:
                inv_freq = _rolling_inv_freq(rotary_lookup, modules.get(i), types[i], i, probed)
            layers.append(BoundedLayer(keep[0], keep[1], layer_mode, inv_freq, modules.get(i)))
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
