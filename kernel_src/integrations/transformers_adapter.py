"""Transformers-compatible attention function (torch only; also the hub kernel's entry point).

``attention_forward(module, query, key, value, key_mask, ...)`` has the signature of Transformers'
``AttentionInterface`` functions: ``query (B, Hq, Sq, D)``, ``key/value (B, Hkv, Skv, D)`` (after
RoPE and the cache update) in, ``(attn_output (B, Sq, Hq, D), None)`` out.

What the layer runs:

* its pattern: ``sparse_k.integrations.config.pattern_for_layer(config.sparse_attention, layer_idx)``;
* restricted to the model's own locality: a layer called with ``sliding_window=W`` never attends
  beyond ``i - W < j``, a chunked layer (``config.layer_types[i] == "chunked_attention"``, Llama 4)
  never beyond its chunk; with ``full_attention_layers_only`` such layers keep only their own rule;
* with the model's ``scaling``, ``softcap`` and ``s_aux`` sink logits (gpt-oss).

The key mask (Transformers' 2-D convention, True = key takes part) describes *absolute cache
slots* ``0 .. L-1`` (what ``hf_sparse_attention``'s mask function returns):

* ``L == Skv``: the key tensor holds slots ``0 .. Skv-1`` (prefill, DynamicCache); a ``uint8``
  mask of this width (``STATIC_SLOTS_DTYPE``, a StaticCache) also says that the queries are the
  last ``Sq`` valid slots of each row (``q_start`` computed on the device: nothing is read on the
  host, shapes stay static, so the step can be captured in a CUDA graph);
* ``L < Skv``: a StaticCache whose first ``L`` slots are written; K/V are sliced to ``L``
  (a view, no copy) and the queries are the last ``Sq`` of them;
* ``L > Skv``: a sliding-window cache dropped the first ``L - Skv`` slots. Patterns whose rule
  depends only on ``i - j`` use the tail of the mask; a pattern inside the model's own window or
  chunk (sinks, blocks) reads the kept keys at their absolute slots (``FromSlot``) when no row is
  padded; otherwise K/V are padded back at the front so that positions stay absolute (never
  attended: the window excludes them).

A cache layer that announced ``key`` on the module (``sparse_k.integrations.cache_protocol``, e.g.
``hf_sparse_attention.SparseCache``'s) is consulted: it may refuse the key mask, and for a learned
pattern it runs the call's attention (``SelectionCacheLayer.attend``, with its own decode state).

A 4-D mask (a caller's own ``attention_mask``, which Transformers passes through) is reduced to key validity,
once per mask tensor (every layer gets the same one); one that carries more than the causal rule over those keys
(packed documents, a custom block mask) raises ``ValueError`` rather than being ignored.
Packed batches come as ``cu_seq_lens_q/k`` kwargs (``DataCollatorWithFlattening``), or are found
from ``position_ids`` that restart at 0 inside one row without a mask.
"""

from __future__ import annotations

import copy
import json
import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..api import sparse_attention
from ..layouts.geometry import after_last_true, row_geometry
from ..layouts.patterns import Dense, Dilated, Pattern, SlidingWindow, Streaming
from ..selection.beam_rows import realign, remember
from ..selection.step_state import new_state_dict
from ..warn import warn_once
from .cache_protocol import announced_layer
from .config import pattern_for_layer, validate_sparse_config

__all__ = ["SELECTOR_PROVIDERS", "FromSlot", "WithinChunk", "WithinWindow", "attention_forward", "config_window",
           "layer_pattern", "restrict_pattern", "translation_invariant"]

#: Attribute of an attention module holding the training-free selection's decode memo (``sparse_k.selection.page_selection``).
SELECTION_MEMO_ATTR = "_sparse_k_selection_memo"
#: Attribute of an attention module holding its selection state over a static cache (``sparse_k.selection.selection_state``).
SELECTION_STATE_ATTR = "_sparse_k_selection_state"

#: ``provider(module, layer_idx, pattern) -> selector | None``, asked in an eager call of a layer that has no
#: attached selector (``hf_sparse_attention.shipped`` registers the selectors the package ships for known models).
#: What a provider gives is attached like a user's selector, so compiled steps read it the same way.
SELECTOR_PROVIDERS: list = []
_SELECTOR_ATTR = "_sparse_k_selector"
_PROVIDED_ATTR = "_sparse_k_selector_provided"  # (pattern asked for, selector given) of the last provider call


class _OnBase:
    """What the patterns built on a static ``base`` pattern share: the check of ``base``, and its per-head and per-layer
    dependence."""

    def _check_base(self):
        if not isinstance(self.base, Pattern) or self.base.learned:
            raise TypeError(f"{self.name}: `base` must be a static Pattern, got {self.base!r}")

    @property
    def per_head(self):
        return self.base.per_head

    @property
    def uses_layer(self):
        return self.base.uses_layer


@dataclass(frozen=True)
class _Restricted(_OnBase, Pattern):
    """A static ``base`` pattern intersected with a model's own locality rule (``limit``, an int >= 1)."""

    base: Pattern = Dense()

    #: Name of the int field that holds the limit (``window`` or ``chunk``).
    limit_field: ClassVar[str] = ""

    def _validate(self):
        self._check_base()
        limit = getattr(self, self.limit_field)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"{self.name}: `{self.limit_field}` must be an int >= 1, got {limit!r}")


@dataclass(frozen=True)
class WithinWindow(_Restricted):
    """``base`` restricted to the causal window ``i - window < j`` (a model's own sliding window)."""

    name: ClassVar[str] = "within_window"
    limit_field: ClassVar[str] = "window"
    window: int = 1

    def _rule(self, qpos, kpos, layer_idx, kv_head, kv_len):
        return self.base._rule(qpos, kpos, layer_idx, kv_head, kv_len) & (qpos - kpos < self.window)

    def _intervals(self, q_lo, q_hi, layer_idx, num_kv_heads, kv_len):
        lo, hi = self.base._intervals(q_lo, q_hi, layer_idx, num_kv_heads, kv_len)
        lo = torch.maximum(lo, (q_lo - self.window + 1).unsqueeze(-1).expand_as(lo))
        return lo, hi

    def _tile_full(self, q_lo, q_hi, k_lo, k_hi, layer_idx, num_kv_heads, kv_len):
        return self.base._tile_full(q_lo, q_hi, k_lo, k_hi, layer_idx, num_kv_heads, kv_len) & (
            q_hi - k_lo < self.window
        )


@dataclass(frozen=True)
class WithinChunk(_Restricted):
    """``base`` restricted to the query's chunk ``i // chunk == j // chunk`` (Llama 4 chunked attention)."""

    name: ClassVar[str] = "within_chunk"
    limit_field: ClassVar[str] = "chunk"
    chunk: int = 1

    def _chunk(self, x):
        return torch.div(x, self.chunk, rounding_mode="floor")

    def _rule(self, qpos, kpos, layer_idx, kv_head, kv_len):
        return self.base._rule(qpos, kpos, layer_idx, kv_head, kv_len) & (self._chunk(qpos) == self._chunk(kpos))

    def _intervals(self, q_lo, q_hi, layer_idx, num_kv_heads, kv_len):
        lo, hi = self.base._intervals(q_lo, q_hi, layer_idx, num_kv_heads, kv_len)
        lo = torch.maximum(lo, (self._chunk(q_lo) * self.chunk).unsqueeze(-1).expand_as(lo))
        return lo, hi

    def _tile_full(self, q_lo, q_hi, k_lo, k_hi, layer_idx, num_kv_heads, kv_len):
        same = (self._chunk(q_lo) == self._chunk(q_hi)) & (self._chunk(k_lo) == self._chunk(k_hi)) & (
            self._chunk(q_lo) == self._chunk(k_lo)
        )
        return self.base._tile_full(q_lo, q_hi, k_lo, k_hi, layer_idx, num_kv_heads, kv_len) & same


@dataclass(frozen=True)
class FromSlot(_OnBase, Pattern):
    """``base`` on a key tensor whose index 0 holds cache slot ``start`` (a sliding cache dropped the slots before it).

    Positions are counted from the first kept slot; the rule, intervals and full tiles of ``base`` are read at
    ``position + start``, so its absolute parts (sinks, blocks, chunks) land where they would on the whole tensor,
    and nothing is rebuilt for the dropped slots. ``kv_len`` (the kept length) reaches ``base`` as ``kv_len + start``.
    """

    name: ClassVar[str] = "from_slot"

    base: Pattern = Dense()
    start: int = 0

    def _validate(self):
        self._check_base()
        if self.causal != self.base.causal:
            raise ValueError(f"{self.name}: `causal` ({self.causal}) must be the base's ({self.base.causal})")
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"{self.name}: `start` must be an int >= 0, got {self.start!r}")

    def _kv_len(self, kv_len):
        return None if kv_len is None else kv_len + self.start

    def _rule(self, qpos, kpos, layer_idx, kv_head, kv_len):
        return self.base._rule(qpos + self.start, kpos + self.start, layer_idx, kv_head, self._kv_len(kv_len))

    def _intervals(self, q_lo, q_hi, layer_idx, num_kv_heads, kv_len):
        lo, hi = self.base._intervals(q_lo + self.start, q_hi + self.start, layer_idx, num_kv_heads,
                                      self._kv_len(kv_len))
        return lo - self.start, hi - self.start

    def _tile_full(self, q_lo, q_hi, k_lo, k_hi, layer_idx, num_kv_heads, kv_len):
        s = self.start
        return self.base._tile_full(q_lo + s, q_hi + s, k_lo + s, k_hi + s, layer_idx, num_kv_heads,
                                    self._kv_len(kv_len))


def restrict_pattern(pattern: Pattern, *, window: int | None = None, chunk: int | None = None) -> Pattern:
    """``pattern`` intersected with a causal sliding window and/or a chunk rule (the model's own locality).

    Learned patterns keep their static part only (their selection lies outside their own window and
    is not combined with a model's local rule). Common cases collapse to plain patterns, so fast
    backends still apply: dense -> ``SlidingWindow(window)``, ``SlidingWindow(w)`` ->
    ``SlidingWindow(min(w, window))``, ``Streaming(s, w)`` with ``w >= window`` -> ``SlidingWindow(window)``.
    """
    if pattern.learned:
        if window is not None or chunk is not None:
            warn_once(
                f"pattern {pattern.name!r} on a layer with the model's own local attention: the learned selection is "
                "not used there; the layer runs sinks + window within the model's rule"
            )
        pattern = pattern.static_part()
    if not pattern.causal:
        raise ValueError("the Transformers integration runs causal patterns only")
    if window is not None:
        if isinstance(pattern, Dense):
            pattern = SlidingWindow(window=window)
        elif isinstance(pattern, SlidingWindow):
            pattern = SlidingWindow(window=min(window, pattern.window))
        elif isinstance(pattern, Streaming) and pattern.window >= window:
            pattern = SlidingWindow(window=window)
        else:
            pattern = WithinWindow(base=pattern, window=window)
    if chunk is not None:
        pattern = WithinChunk(base=pattern, chunk=chunk)
    return pattern


def translation_invariant(p: Pattern) -> bool:
    """True when the rule depends on ``i - j`` only (dropping leading keys cannot change it)."""
    if isinstance(p, (Dense, SlidingWindow, Dilated)):
        return True
    if isinstance(p, WithinWindow):
        return translation_invariant(p.base)
    return False


_PARSED: dict = {}


def _sparse_config(config) -> dict:
    raw = getattr(config, "sparse_attention", None) if config is not None else None
    try:
        key = json.dumps(raw, sort_keys=True, default=str)
    except TypeError:  # keys that do not sort (layer indices as ints and strings): validation names any problem
        key = json.dumps(raw, default=str)
    cfg = _PARSED.get(key)
    if cfg is None:
        cfg = validate_sparse_config(raw)
        if len(_PARSED) > 64:
            _PARSED.clear()
        _PARSED[key] = cfg
    return cfg


#: Default of ``attention_forward``'s ``sliding_window``: "the model did not pass one" (None = global layer).
NOT_PASSED = object()


#: Model types that keep a ``sliding_window`` on their config/modules but attend globally (their own
#: mask is the full causal one and they pass no window to the attention function).
GLOBAL_DESPITE_WINDOW = frozenset({"moshi"})


def _real_window(window) -> int | None:
    """``window`` as a number of keys, or None where it means "no window": None, 0 or less.

    qwen2_moe stores ``sliding_window=0`` when ``use_sliding_window`` is False (and its modules keep that 0 on layers
    ``layer_types`` marks sliding), and Transformers' flash-attention path runs a window <= 0 without a window
    (``window_size = (w - 1, w - 1)``, negative: unlimited); its sdpa / eager masks would let such a layer attend no
    key at all. A one-time warning says so when a window <= 0 is met.
    """
    if window is None:
        return None
    if window <= 0:
        warn_once(
            f"sliding_window={window} on a sliding layer: sparse_k runs the layer without a window (as Transformers' "
            "flash attention does; its sdpa / eager masks attend no key there)", key=f"no-window:{window}"
        )
        return None
    return int(window)


def config_window(config, layer_idx: int | None) -> int | None:
    """The sliding window ``config`` gives layer ``layer_idx`` as the model's attention function sees it (None: global).

    ``config.sliding_window`` on layers that ``config.layer_types`` marks ``"sliding_attention"`` (None on the
    others); without layer types (or without ``layer_idx``), ``config.sliding_window`` unless
    ``config.use_sliding_window`` is False. None when the model type is in ``GLOBAL_DESPITE_WINDOW``, and where the
    window is 0 or less (``_real_window``). ``SparseCache`` sizes its layers by it; ``_own_window`` falls back to it.
    """
    if config is None or getattr(config, "model_type", None) in GLOBAL_DESPITE_WINDOW:
        return None
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_idx is not None and 0 <= layer_idx < len(layer_types):
        sliding = layer_types[layer_idx] == "sliding_attention"
    else:
        sliding = getattr(config, "use_sliding_window", True) is not False
    return _real_window(window) if sliding else None


def _own_window(module, config, layer_idx):
    """The sliding window of a layer whose model does not pass ``sliding_window=`` (phimoe, qwen2_moe): the module's
    own ``sliding_window`` attribute, else ``config_window``. None when the layer is global or the model type is in
    ``GLOBAL_DESPITE_WINDOW``.
    """
    if getattr(config, "model_type", None) in GLOBAL_DESPITE_WINDOW:
        return None
    if "sliding_window" in getattr(module, "__dict__", {}):
        return module.__dict__["sliding_window"]
    return config_window(config, layer_idx)


def _layer_locality(config, layer_idx, sliding_window):
    """(window, chunk) of the model's own rule for this layer (None when the layer is global; a ``sliding_window`` of
    0 or less is none: ``_real_window``)."""
    window = _real_window(sliding_window)
    chunk = None
    layer_types = getattr(config, "layer_types", None) if config is not None else None
    chunk_size = getattr(config, "attention_chunk_size", None) if config is not None else None
    if chunk_size and layer_types is not None and layer_idx is not None and layer_idx < len(layer_types):
        if layer_types[layer_idx] == "chunked_attention":
            chunk = int(chunk_size)
    return window, chunk


def layer_pattern(config, layer_idx: int | None, sliding_window: int | None = None) -> Pattern:
    """The pattern layer ``layer_idx`` of a model with ``config`` runs (after the model's own locality)."""
    cfg = _sparse_config(config)
    pattern = pattern_for_layer(cfg, layer_idx)
    window, chunk = _layer_locality(config, layer_idx, sliding_window)
    if window is None and chunk is None:
        return pattern
    if cfg["full_attention_layers_only"]:
        pattern = Dense()
    return restrict_pattern(pattern, window=window, chunk=chunk)


def _shared_layer_idx(config, layer_idx: int) -> int:
    """Layer index to run for a module without a depth of its own (``layer_idx < 0``: zamba2's shared block)."""
    cfg = _sparse_config(config)
    if cfg.get("layers") or cfg.get("dense_layers"):
        raise ValueError(
            f"this attention module has layer_idx={layer_idx} (one module shared by several depths), so per-layer "
            "sparse settings (`layers`, `dense_layers`) cannot apply to it; configure one pattern for all layers"
        )
    return 0


def _resolve_layer_call(module, config=None, layer_idx: int | None = None, sliding_window=NOT_PASSED):
    """``(config, layer_idx, sliding_window)`` of a call of ``module`` as ``attention_forward`` runs it.

    ``config`` defaults to ``module.config``, ``layer_idx`` to ``module.layer_idx`` (None: 0; a negative one, a layer
    shared by several depths, runs layer 0: ``_shared_layer_idx``), ``sliding_window`` when not passed to the
    module's or config's own (``_own_window``; None: a global layer)."""
    config = config if config is not None else getattr(module, "config", None)
    layer_idx = layer_idx if layer_idx is not None else getattr(module, "layer_idx", 0)
    layer_idx = 0 if layer_idx is None else int(layer_idx)
    if sliding_window is NOT_PASSED:
        sliding_window = _own_window(module, config, layer_idx)
    if layer_idx < 0:
        layer_idx = _shared_layer_idx(config, layer_idx)
    return config, layer_idx, sliding_window


#: Attribute of an attention module holding its resolved ``(pattern, backend)`` and what they came from.
_SETUP_ATTR = "_sparse_k_layer_setup"


def _layer_setup(module, config, layer_idx: int, sliding_window) -> tuple[Pattern, str]:
    """``(pattern, backend)`` of this layer, resolved once and kept on the module.

    Kept while the config's ``sparse_attention`` is the same object with the same content (compared to
    a copy: a dict comparison, no JSON encoding per call). Under ``torch.compile`` the identity alone
    is checked (the compiled graph guards on the objects it reads), so a traced decode step runs no
    config parsing; its first call must have run eagerly (``generate``'s prefill does)."""
    raw = getattr(config, "sparse_attention", None) if config is not None else None
    store = getattr(module, "__dict__", None)
    memo = store.get(_SETUP_ATTR) if store is not None else None
    if (memo is not None and memo[0] is config and memo[1] is raw and memo[2] == (layer_idx, sliding_window)
            and (_tracing() or memo[3] == raw)):
        return memo[4], memo[5]
    pattern = layer_pattern(config, layer_idx, sliding_window)
    backend = _sparse_config(config).get("backend", "auto")
    if store is not None:
        store[_SETUP_ATTR] = (config, raw, (layer_idx, sliding_window), copy.deepcopy(raw), pattern, backend)
    return pattern, backend


def _mask_allows(mask: torch.Tensor) -> torch.Tensor:
    """Boolean "attend" view of a 4-D mask: bool, integer (1 = attend, as a 2-D mask) or additive float (0 / -inf or
    the dtype's minimum)."""
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_floating_point:
        return mask > torch.finfo(mask.dtype).min / 2
    return mask != 0


def _reduce_4d(mask: torch.Tensor, skv: int, q_len: int | None = None, window: int | None = None,
               chunk: int | None = None) -> torch.Tensor:
    """``(B, 1|H, Sq, Skv)`` bool, integer or additive float mask (``_mask_allows``) -> ``(B, L)`` key validity over
    written slots.

    Transformers hands a caller's own 4-D ``attention_mask`` to the attention function as it is. Only its key
    validity is kept (the pattern brings the rest), so a mask with ``q_len`` query rows must be the causal rule over
    the keys it lets take part (``_check_causal_4d``: within the layer's own ``window`` / ``chunk``, which the
    adapter applies itself); any other per-query structure raises ``ValueError`` instead of being dropped."""
    allowed = _mask_allows(mask)
    per_query = q_len is not None and q_len > 1 and allowed.shape[2] == q_len
    rows = _without_unmasked_rows(allowed) if per_query else allowed
    valid = rows.any(2).any(1)  # (B, Skv)
    j = torch.arange(valid.shape[-1], device=valid.device)
    written = int(torch.where(valid, j, -1).amax().item()) + 1
    if per_query and written > 0:
        _check_causal_4d(allowed[..., :written], valid[:, :written], window, chunk)
    return valid[:, : max(written, 1)]


def _without_unmasked_rows(allowed: torch.Tensor) -> torch.Tensor:
    """``allowed (..., Sq, L)`` bool with the query rows before the last one that attend every slot cleared.

    Such rows are padding queries that Transformers' older SDPA masks unmask (``_unmask_unattended``, to avoid NaNs):
    they say nothing about which keys are real. A causal query attends every slot only as the last one."""
    unmasked = allowed.all(-1, keepdim=True)
    unmasked[..., -1, :] = False
    return allowed & ~unmasked


def _check_causal_4d(allowed: torch.Tensor, valid: torch.Tensor, window: int | None, chunk: int | None,
                     q_start: torch.Tensor | None = None, documents: torch.Tensor | None = None) -> None:
    """``ValueError`` unless ``allowed (B, 1|H, Sq, L)`` is the causal mask over the keys ``valid (B, L)`` on every key
    the layer can attend (``window`` / ``chunk``: its own locality).

    Query ``i`` of row ``b`` sits at slot ``q_start[b] + i`` (``q_start``: int64 ``(B,)``; None: ``L - Sq``, the
    queries are the last slots). ``documents`` (int ``(B|1, L)``, the packed sequence of each slot: a packed call,
    which the adapter runs sequence by sequence whatever the mask says across sequences) limits the keys a query
    must see to those of its own sequence. Query rows with no valid key at or before them (left padding) are not
    checked: their output is never used, and Transformers' older SDPA masks let them attend everything."""
    sq, n = allowed.shape[2], allowed.shape[3]
    i = torch.arange(sq, device=allowed.device)
    qslot = (i + (n - sq) if q_start is None else q_start[:, None] + i).view(-1, 1, sq, 1)  # (B|1, 1, Sq, 1)
    j = torch.arange(n, device=allowed.device)
    causal = j <= qslot  # (B|1, 1, Sq, L)
    reach = causal
    if window is not None:
        reach = reach & (qslot - j < window)
    if chunk is not None:  # chunks count from each row's first valid key, as the positions of the pattern do
        first = torch.where(valid, j, n).amin(-1).view(-1, 1, 1, 1)  # (B, 1, 1, 1): n for a row without keys
        reach = reach & (torch.div(qslot - first, chunk, rounding_mode="floor")
                         == torch.div(j - first, chunk, rounding_mode="floor"))
    expected = valid[:, None, None, :] & causal  # (B, 1, Sq, L)
    if documents is not None:
        qdoc = torch.take_along_dim(documents, qslot.view(-1, sq).clamp(0, n - 1), dim=1)  # (B|1, Sq)
        expected = expected & (qdoc[:, None, :, None] == documents[:, None, None, :])
    checked = expected.any(-1, keepdim=True)  # rows of queries that have a key
    if bool((allowed & ~causal & checked).any()):
        raise ValueError(
            'attn_implementation="sparse_k" got a 4-D attention_mask that lets queries attend to later keys (a '
            "bidirectional mask), but it runs causal attention only; use attn_implementation=\"sdpa\" or \"eager\" "
            "for such a mask"
        )
    if bool((expected & reach & ~allowed).any()):
        raise ValueError(
            'attn_implementation="sparse_k" keeps only which keys take part from a 4-D attention_mask, but this mask '
            "also hides earlier keys from some queries (per-query structure: packed documents, a block or custom "
            "mask), which the sparse pattern would silently ignore. Pass a 2-D padding mask (B, keys), pack "
            "sequences with position_ids or cu_seq_lens (DataCollatorWithFlattening), or use "
            'attn_implementation="sdpa" or "eager" for a custom 4-D mask'
        )


#: dtype of a key mask that covers every slot of a static cache (``hf_sparse_attention``'s mask function
#: returns it for a StaticCache): the valid slots of a row end at its last written slot and the queries
#: are the last ``Sq`` of them, so ``q_start = (last True + 1) - Sq`` is computed on the device and the
#: key tensors keep their static size (no slicing by a length read on the host: CUDA-graph friendly).
STATIC_SLOTS_DTYPE = torch.uint8


class _OneReadPerTensor:
    """A host answer about a tensor, read once per tensor: the model builds one mask (and one
    ``position_ids``) per forward, one per layer type, and every layer receives that same tensor, so a
    forward pays one synchronisation per tensor, not one per layer. Keyed by identity and by the call's
    other arguments (``read(tensor, *args)``, hashable); the last ``tensors`` tensors are remembered
    (layer types that take turns hand their masks in turn).

    A tensor changed in place is read again. An ordinary tensor's version counter says so. An inference
    tensor (made under ``torch.inference_mode()``) has no version counter, may still be changed in place
    inside inference mode, and nothing short of reading its content (a host synchronisation, what this
    class saves) tells whether it was; so its answer is kept within one forward only: while the calls
    come from layers of increasing index (``layer=``, the calling layer's index). A call from a layer at
    or before the last one that used the answer starts the next forward, which reads again; only a change
    made in place between two layers of one forward would be missed. Without ``layer``, an inference
    tensor is read at every call."""

    def __init__(self, read, tensors: int = 1):
        self._read, self._tensors = read, tensors
        # [weakref to a tensor, its version (None: an inference tensor), last layer, {args: answer}], oldest first
        self._entries: list = []

    def __call__(self, tensor: torch.Tensor, *args, layer: int | None = None):
        inference = tensor.is_inference()
        if inference and layer is None:
            return self._read(tensor, *args)
        version = None if inference else tensor._version
        for entry in self._entries:
            ref, seen, last, answers = entry
            if ref() is tensor and seen == version and (not inference or layer > last):
                entry[2] = layer
                if args not in answers:
                    answers[args] = self._read(tensor, *args)
                return answers[args]
        answer = self._read(tensor, *args)
        kept = [e for e in self._entries if e[0]() is not None and e[0]() is not tensor]
        self._entries = kept[max(0, len(kept) - self._tensors + 1):] + [[weakref.ref(tensor), version, layer,
                                                                          {args: answer}]]
        return answer


#: Mask tensors one forward hands its layers in turn: one per layer type (Transformers' models build at most three
#: kinds of mask), and the types alternate (Gemma 3: five sliding layers, then a global one, and again).
MASKS_PER_FORWARD = 4


def _read_all_valid(mask: torch.Tensor) -> bool:
    return bool(mask.all())


#: ``bool(mask.all())`` once per mask tensor (a padded batch, or a mask a cache reports wider than its keys): each
#: layer type gets its own mask tensor from the mask function, and the types take turns.
_all_valid = _OneReadPerTensor(_read_all_valid, tensors=MASKS_PER_FORWARD)


#: ``_reduce_4d`` once per 4-D mask tensor and (``Skv``, ``Sq``, window, chunk): every layer of a forward gets the
#: caller's one mask (or the one of its type, from a dict of masks per layer type); layer types with their own windows
#: (sliding and global layers) take turns.
_reduced_4d = _OneReadPerTensor(_reduce_4d, tensors=MASKS_PER_FORWARD)


def _tracing() -> bool:
    return torch.compiler.is_compiling()


def _read_packed_starts(position_ids: torch.Tensor, batch: int = 1):
    """``_packed_from_position_ids`` itself (host reads)."""
    pos = position_ids.expand(batch, -1)  # (batch, S): one row of positions may stand for every row
    if not bool((pos[:, 0] == 0).all()):
        return None
    starts = torch.nonzero((pos == 0).reshape(-1)).flatten()  # b * S + i, ascending: the rows laid end to end
    if starts.numel() <= batch:
        return None
    total = torch.tensor([pos.numel()], device=pos.device)
    return torch.cat([starts, total]).to(torch.int32)


_packed_starts = _OneReadPerTensor(_read_packed_starts)


def _packed_from_position_ids(position_ids: torch.Tensor, batch: int = 1, layer: int | None = None):
    """``cu_seqlens`` (int32) over the ``batch * S`` tokens of the ``batch`` rows laid end to end when a row of
    ``position_ids (batch | 1, S)`` holds several sequences (positions restart at 0; every row starts at 0), else None.
    Transformers separates such sequences in each row (``masking_utils.find_packed_sequence_indices``), so the rows
    run as one varlen call. One host read per ``position_ids`` tensor and ``batch``: every layer of a forward gets the
    same one (``layer``: the calling layer's index, see ``_OneReadPerTensor``)."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch):
        return None
    return _packed_starts(position_ids, batch, layer=layer)


def _layer_selector(module, layer_idx, pattern):
    """The layer's selector: the attached one; else, in an eager call, what ``SELECTOR_PROVIDERS`` give for this
    layer and pattern (asked once per pattern; ``sparse_attention["shipped_selectors"] = False`` asks none and
    drops a provided one), attached. A selector the user attached is never replaced."""
    selector = getattr(module, _SELECTOR_ATTR, None)
    state = getattr(module, "__dict__", None)
    if state is None or not SELECTOR_PROVIDERS or torch.compiler.is_compiling():
        return selector
    asked, given = state.get(_PROVIDED_ATTR, (None, None))
    if selector is not None and selector is not given:
        return selector  # attached by the user
    cfg = getattr(getattr(module, "config", None), "sparse_attention", None) or {}
    want = pattern if cfg.get("shipped_selectors", True) else None
    if _PROVIDED_ATTR in state and asked == want:
        return selector
    given = None
    if want is not None:
        for provider in SELECTOR_PROVIDERS:
            given = provider(module, layer_idx, pattern)
            if given is not None:
                break
    if given is None:
        state.pop(_SELECTOR_ATTR, None)
    else:
        object.__setattr__(module, _SELECTOR_ATTR, given)
    state[_PROVIDED_ATTR] = (want, given)
    return given


def _selection(pattern, query, key, value, key_mask, q_start, layer_idx, module, cache_slots=None):
    try:
        from ..selection.selectors import build_selection
    except ImportError:
        warn_once(
            f"pattern {pattern.name!r}: the selector module is not available; attending to sinks + window only"
        )
        return None
    geometry = row_geometry(query.shape[0], query.shape[2], key.shape[2], key_mask, q_start, device=query.device)
    selector = _layer_selector(module, layer_idx, pattern)
    # The decode memo of a selection that reads the block's first query (training-free; a SparseK scorer with refine)
    # lives on the module; it is created outside any traced graph (sparse_k.selection.step_state), so a compiled step
    # that finds it traces without a break.
    memo = None
    if (selector is None or getattr(pattern, "refine", 0)) and hasattr(module, "__dict__"):
        memo = module.__dict__.get(SELECTION_MEMO_ATTR)
        if memo is None:
            memo = new_state_dict(module, SELECTION_MEMO_ATTR)
    # Over a static cache (``cache_slots``: its slots) the selection's per-key inputs are kept and updated for the
    # new key only (sparse_k.selection.selection_state), in buffers made outside any traced graph, as the memo's.
    state = None
    if cache_slots is not None and hasattr(module, "__dict__"):
        state = module.__dict__.get(SELECTION_STATE_ATTR)
        if state is None:
            state = new_state_dict(module, SELECTION_STATE_ATTR)
    # Memos of a block's first query follow the cache's rows when beam search reorders them (selection.beam_rows).
    memos = [memo, getattr(selector, "_block_memo", None)]
    for m in memos:
        realign(m, key, geometry.k_start, pattern.query_block)
    layout = build_selection(pattern, query, key, value, geometry, layer_idx=layer_idx, selector=selector, memo=memo,
                             state=state, state_slots=cache_slots)
    memos[1] = getattr(selector, "_block_memo", None)  # made by the first call
    for m in memos:
        remember(m, key, geometry.k_start, pattern.query_block)
    return layout


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = NOT_PASSED,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    config=None,
    layer_idx: int | None = None,
    q_start: int | torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Sparse attention for one Transformers attention layer.

    Args:
        module: the attention module (its ``config``, ``layer_idx``, ``training`` and optional
            ``_sparse_k_selector`` are read; without a selector the training-free selection keeps its decode memo
            in ``module._sparse_k_selection_memo``).
        query: ``(B, Hq, Sq, D)``; key, value: ``(B, Hkv, Skv, D)``.
        key_mask: ``(B, L)`` bool/int (True = key takes part) over absolute cache slots, a 4-D SDPA
            mask (reduced to key validity), or None (every key, queries bottom-right). Also taken
            by keyword as ``attention_mask=`` (afmoe).
        scaling: softmax scale (default ``D ** -0.5``). softcap: logit soft-capping.
        sliding_window: the model's own window for this layer (None: a global layer); when the model
            does not pass it, read from the module or config (``_own_window``). s_aux: ``(Hq,)`` sink logits.
        config: defaults to ``module.config``. layer_idx: defaults to ``module.layer_idx``; a negative
            one (a layer shared by several depths, zamba2) runs the pattern of layer 0 and is refused
            when the configuration gives layers different patterns.
        q_start: key index of query 0 (int or ``(B,)``), overriding the bottom-right default.
        kwargs: ``cu_seq_lens_q/k``, ``max_length_q/k`` (packed batches), ``position_ids``;
            ``output_attentions=True`` raises.
    Returns:
        ``(attn_output (B, Sq, Hq, D), None)``.
    """
    if kwargs.get("output_attentions", False):
        raise ValueError(
            'attn_implementation="sparse_k" never materialises attention weights, so output_attentions=True is not '
            'supported; load the model with attn_implementation="eager" to inspect attention weights'
        )
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise ValueError(
            'attn_implementation="sparse_k" runs causal self-attention only; this layer is bidirectional '
            "(is_causal=False): use sdpa or eager for it"
        )
    if dropout and getattr(module, "training", False):
        warn_once(f"sparse_k attention does not apply attention dropout (got p={dropout}); running without it")
    if "attention_mask" in kwargs:
        if key_mask is not None:
            raise TypeError("sparse_k attention got both a positional key mask and attention_mask=")
        key_mask = kwargs.pop("attention_mask")
    config, layer_idx, sliding_window = _resolve_layer_call(module, config, layer_idx, sliding_window)
    pattern, backend = _layer_setup(module, config, layer_idx, sliding_window)
    sink_logits = s_aux.to(query.dtype) if s_aux is not None else None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    rows = 1  # rows of packed sequences laid end to end into one varlen call
    if cu_q is None and cu_k is None and key_mask is None and query.shape[2] == key.shape[2] > 1:
        cu_q = cu_k = _packed_from_position_ids(kwargs.get("position_ids"), query.shape[0], layer=layer_idx)
        rows = query.shape[0] if cu_q is not None else 1
    if cu_q is not None or cu_k is not None:
        if pattern.learned:
            warn_once(f"pattern {pattern.name!r} on packed sequences: sinks + window only (no learned selection)")
        q1, k1, v1 = (t.transpose(0, 1).reshape(1, t.shape[1], -1, t.shape[3]) if rows > 1 else t
                      for t in (query, key, value))  # (B, H, S, D) -> (1, H, B * S, D)
        out = sparse_attention(
            q1, k1, v1, pattern, scale=scaling, softcap=softcap, sink_logits=sink_logits,
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, layer_idx=layer_idx, backend=backend,
        )
        if rows > 1:
            out = out.reshape(out.shape[1], rows, -1, out.shape[3]).transpose(0, 1)  # (B, H, S, D)
        return out.transpose(1, 2).contiguous(), None

    if isinstance(key_mask, torch.Tensor) and key_mask.dim() == 4:  # a caller's own 4-D mask: key validity
        locality = _layer_locality(config, layer_idx, sliding_window)
        if _tracing():
            key_mask = _reduce_4d(key_mask, key.shape[2], query.shape[2], *locality)
        else:
            key_mask = _reduced_4d(key_mask, key.shape[2], query.shape[2], *locality, layer=layer_idx)

    learned = pattern.learned and pattern.top_k > 0
    announced = announced_layer(module, key) if learned or not _tracing() else None  # the cache layer serving `key`
    check_pattern = None if _tracing() else getattr(announced, "check_pattern", None)
    if check_pattern is not None:  # a cache layer that keeps what one pattern needs (SparseCache) refuses another
        check_pattern(pattern, layer_idx)

    layer = announced if learned else None
    if layer is not None:

        def run(q, k, v, p, sel, qs, km):
            return sparse_attention(q, k, v, p, scale=scaling, softcap=softcap, sink_logits=sink_logits, attention_mask=km,
                                    layer_idx=layer_idx, backend=backend, selection=sel, q_start=qs)

        out = layer.attend(query, key, value, pattern, key_mask, run, selector=_layer_selector(module, layer_idx, pattern),
                           layer_idx=layer_idx)
        return out.transpose(1, 2).contiguous(), None

    cache_slots = None  # a static cache's slots: the key tensor holds all of them, or its written front
    if key_mask is not None:
        if not isinstance(key_mask, torch.Tensor):
            raise TypeError(f"sparse_k attention expects a 2-D key mask tensor or None, got {type(key_mask).__name__}")
        if key_mask.dim() != 2 or key_mask.shape[0] != query.shape[0]:
            raise ValueError(f"sparse_k attention expects a (B, L) key mask, got shape {tuple(key_mask.shape)}")
        static_slots = key_mask.dtype == STATIC_SLOTS_DTYPE and key_mask.shape[1] == key.shape[2]
        key_mask = key_mask.to(torch.bool)
        all_valid = q_start is None and not static_slots and not _tracing() and _all_valid(key_mask, layer=layer_idx)
        if not (all_valid or static_slots or _tracing()):
            if announced is not None:  # e.g. a SparseCache layer refuses padded batches
                announced.check_key_mask(key_mask)
        L, skv = key_mask.shape[1], key.shape[2]
        if static_slots:
            cache_slots = skv
            if q_start is None:
                q_start = after_last_true(key_mask) - query.shape[2]
        elif L < skv:
            cache_slots = skv
            key, value = key[:, :, :L], value[:, :, :L]
        elif L > skv:
            dropped = L - skv
            if translation_invariant(pattern):
                key_mask = key_mask[:, dropped:]
            elif all_valid and isinstance(pattern, _Restricted):
                # The model's window / chunk (no kernel rule: the PyTorch path either way) read at absolute slots
                # over the kept keys: no copy of K/V as long as the sequence.
                key_mask, pattern = key_mask[:, dropped:], FromSlot(base=pattern, causal=pattern.causal, start=dropped)
            else:  # padded rows count positions from their own first key: K/V padded back to absolute slots
                key = torch.nn.functional.pad(key, (0, 0, dropped, 0))
                value = torch.nn.functional.pad(value, (0, 0, dropped, 0))
        if all_valid:
            key_mask = None

    selection = None
    if learned:
        selection = _selection(pattern, query, key, value, key_mask, q_start, layer_idx, module, cache_slots=cache_slots)
        if selection is None:  # no block has a candidate yet: sinks + window is the whole rule
            pattern = pattern.static_part()
    out = sparse_attention(
        query, key, value, pattern, scale=scaling, softcap=softcap, sink_logits=sink_logits,
        attention_mask=key_mask, layer_idx=layer_idx, backend=backend, selection=selection, q_start=q_start,
    )
    return out.transpose(1, 2).contiguous(), None
