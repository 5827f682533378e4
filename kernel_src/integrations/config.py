"""``config.sparse_attention``: the plain-dict configuration stored on a model config.

Schema (every key optional; JSON-friendly, so it round-trips through ``save_pretrained``)::

    {
        "pattern": "sparse_k",          # default pattern of every layer (a name from available_patterns())
        "window": 256, "sinks": 4, ...  # that pattern's parameters
        "layers": {"3": "dense",        # per-layer overrides: a name or {"pattern": ..., params}
                   "7": {"pattern": "sliding_window", "window": 512}},
        "dense_layers": [0, 1],         # shorthand for layers that stay dense
        "full_attention_layers_only": false,  # true: layers the model itself runs with a sliding
                                        # window / chunk keep only their own rule (not made sparser)
        "backend": "auto",              # "auto" | "torch" | "reference" | a kernel backend
        "cache_positions": "original",  # bounded-cache position mode: "original" | "rolling"
        "selector_path": null,          # safetensors file with trained selectors (sparse_k / dsa)
        "shipped_selectors": true       # false: no selector from SELECTOR_PROVIDERS (the package's shipped ones)
    }

``pattern_for_layer`` turns it into the ``Pattern`` of one layer.
"""

from __future__ import annotations

import operator

from ..attention.backends import available_backends
from ..layouts.patterns import Pattern, _plain_int, available_patterns, get_pattern

__all__ = ["DEFAULT_SPARSE_CONFIG", "RESERVED_KEYS", "pattern_for_layer", "pattern_to_config", "validate_sparse_config"]

#: What ``attn_implementation="sparse_k"`` uses when the model config carries no ``sparse_attention``.
DEFAULT_SPARSE_CONFIG: dict = {"pattern": "sparse_k", "sinks": 4, "window": 256, "top_k": 256, "query_block": 64}

RESERVED_KEYS = frozenset(
    {"pattern", "layers", "dense_layers", "full_attention_layers_only", "backend", "cache_positions", "selector_path",
     "shipped_selectors"}
)


def _pattern_params(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in RESERVED_KEYS}


def _plain_ints(params: dict) -> dict:
    """``params`` with numpy integers as Python ints (as the patterns store them): the config stays JSON-friendly."""
    return {k: _plain_int(v) for k, v in params.items()}


def validate_sparse_config(cfg: dict | None) -> dict:
    """Check ``cfg`` (raising ``ValueError``/``TypeError`` naming the bad key) and return a normalised copy (defaults
    filled in, layer keys as strings, numpy integers as Python ints)."""
    if cfg is None:
        cfg = DEFAULT_SPARSE_CONFIG
    if not isinstance(cfg, dict):
        raise TypeError(f"config.sparse_attention must be a dict, got {type(cfg).__name__}")
    cfg = dict(cfg)
    cfg.setdefault("pattern", DEFAULT_SPARSE_CONFIG["pattern"])
    name = cfg["pattern"]
    if name not in available_patterns():
        raise ValueError(f"config.sparse_attention['pattern'] = {name!r} is unknown; available: {available_patterns()}")
    cfg.update(_plain_ints(_pattern_params(cfg)))
    _check_causal(get_pattern(name, **_pattern_params(cfg)), "config.sparse_attention")  # validates the parameters
    layers = cfg.get("layers") or {}
    if not isinstance(layers, dict):
        raise TypeError(f"config.sparse_attention['layers'] must be a dict of layer index -> pattern, got {type(layers).__name__}")
    norm_layers = {}
    for key, spec in layers.items():
        idx = layer_index(key, "config.sparse_attention['layers']")
        if str(idx) in norm_layers:  # 0 and "0": one would silently override the other
            raise ValueError(f"config.sparse_attention['layers'] names layer {idx} twice (keys {sorted(map(repr, layers))})")
        _check_causal(_layer_pattern(spec), f"config.sparse_attention['layers'][{key!r}]")
        norm_layers[str(idx)] = _plain_ints(spec) if isinstance(spec, dict) else spec
    cfg["layers"] = norm_layers
    dense = cfg.get("dense_layers")
    dense = [] if dense is None else dense
    if not isinstance(dense, (list, tuple)) or not all(_is_index(i) for i in dense):
        raise TypeError(f"config.sparse_attention['dense_layers'] must be a list of ints, got {dense!r}")
    dense = [operator.index(i) for i in dense]  # numpy integers as plain ints: the config stays JSON-friendly
    if any(i < 0 for i in dense):
        raise ValueError(f"config.sparse_attention['dense_layers'] must hold layer indices >= 0, got {dense}")
    cfg["dense_layers"] = dense
    selector_path = cfg.get("selector_path")
    if selector_path is not None and not isinstance(selector_path, str):
        raise TypeError(f"config.sparse_attention['selector_path'] must be a file path (str) or None, got {selector_path!r}")
    shipped = cfg.get("shipped_selectors", True)
    if not isinstance(shipped, bool):
        raise TypeError(f"config.sparse_attention['shipped_selectors'] must be True or False, got {shipped!r}")
    backend = cfg.get("backend", "auto")
    if not isinstance(backend, str) or backend not in available_backends():
        hint = " (the 'triton' backend needs the triton package)" if backend == "triton" else ""
        raise ValueError(
            f"config.sparse_attention['backend'] = {backend!r} is unknown; available: {available_backends()}{hint}"
        )
    mode = cfg.get("cache_positions", "original")
    if mode not in ("original", "rolling"):
        raise ValueError(f"config.sparse_attention['cache_positions'] must be 'original' or 'rolling', got {mode!r}")
    cfg["cache_positions"] = mode
    only_full = cfg.get("full_attention_layers_only")
    only_full = False if only_full is None else only_full
    if not isinstance(only_full, bool):
        raise TypeError(
            f"config.sparse_attention['full_attention_layers_only'] must be True or False, got {only_full!r}"
        )
    cfg["full_attention_layers_only"] = only_full
    return cfg


def _is_index(value) -> bool:
    """An integer a layer index can be: an int or a numpy integer, not a bool, float or string."""
    return not isinstance(value, (bool, str)) and hasattr(type(value), "__index__")


def layer_index(key, where: str) -> int:
    """A ``layers`` key: a layer index, or its decimal string (a JSON key), as an int >= 0. ValueError for a string
    that is not one or a negative index, TypeError for any other type (a float or a bool is not an index)."""
    if isinstance(key, str):
        try:
            idx = int(key)
        except ValueError:
            raise ValueError(f"{where} keys must be layer indices, got {key!r}") from None
    elif not _is_index(key):
        raise TypeError(f"{where} keys must be layer indices (int), got {key!r}")
    else:
        idx = operator.index(key)
    if idx < 0:
        raise ValueError(f"{where} keys must be layer indices >= 0, got {key!r}")
    return idx


def _check_causal(pattern: Pattern, where: str) -> None:
    """``config.sparse_attention`` drives causal decoders: a bidirectional pattern would let tokens see later ones."""
    if not pattern.causal:
        raise ValueError(
            f"{where}: pattern {pattern.name!r} with causal=False is bidirectional, but the Transformers integration "
            "runs causal self-attention only (leave `causal` out)"
        )


def _layer_pattern(spec) -> Pattern:
    if isinstance(spec, str):
        return get_pattern(spec)
    if isinstance(spec, dict):
        return get_pattern(dict(spec))
    raise TypeError(f"a per-layer pattern must be a name or a dict, got {type(spec).__name__}")


def pattern_for_layer(cfg: dict | None, layer_idx: int | None) -> Pattern:
    """The ``Pattern`` that layer ``layer_idx`` runs under ``cfg`` (``None``: the defaults)."""
    cfg = validate_sparse_config(cfg)
    if layer_idx is not None:
        if layer_idx in cfg["dense_layers"]:
            return get_pattern("dense")
        spec = cfg["layers"].get(str(layer_idx))
        if spec is not None:
            return _layer_pattern(spec)
    return get_pattern(cfg["pattern"], **_pattern_params(cfg))


def pattern_to_config(pattern: Pattern, **extra) -> dict:
    """``config.sparse_attention`` dict for one pattern on every layer."""
    d = {k: v for k, v in pattern.to_dict().items() if v is not None}
    if pattern.causal:
        d.pop("causal")
    return {**d, **extra}
