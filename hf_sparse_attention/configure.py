"""``configure(model, pattern=..., **params)``: write ``config.sparse_attention`` on a model or config.

On a model, ``configure`` also switches it to ``attn_implementation="sparse_k"`` when it runs one of
Transformers' dense implementations (``sdpa``, ``eager``, ``flash_attention_2``...): a model loaded
without ``attn_implementation="sparse_k"`` would otherwise keep running dense attention and ignore
the configuration. On a config nothing is switched (pass it to ``from_pretrained(...,
attn_implementation="sparse_k")``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from sparse_k.integrations.config import RESERVED_KEYS, layer_index, validate_sparse_config
from sparse_k.layouts.patterns import Pattern

__all__ = ["configure"]


def _configs(target):
    """The config objects whose attention layers read ``sparse_attention`` (outer and text config)."""
    config = getattr(target, "config", target)
    if not hasattr(config, "to_dict"):
        raise TypeError(f"configure() takes a Transformers model or config, got {type(target).__name__}")
    out = [config]
    get_text = getattr(config, "get_text_config", None)
    if get_text is not None:
        text = get_text()
        if text is not None and all(text is not c for c in out):
            out.append(text)
    return out


def _num_layers(configs) -> int | None:
    """``num_hidden_layers`` of the text config (the last of ``configs``), or None when it has none."""
    n = getattr(configs[-1], "num_hidden_layers", None)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _check_layer_range(cfg: dict, num_layers: int | None) -> None:
    if num_layers is None:
        return
    for name, indices in (("dense_layers", cfg["dense_layers"]), ("layers", [int(i) for i in cfg["layers"]])):
        bad = sorted(i for i in indices if i >= num_layers)
        if bad:
            raise ValueError(
                f"configure(): `{name}` names layer(s) {bad}, but the model has {num_layers} layers "
                f"(indices 0..{num_layers - 1})"
            )


def _attn_implementation(model) -> str | None:
    configs = _configs(model)
    return getattr(configs[-1], "_attn_implementation", None) or getattr(configs[0], "_attn_implementation", None)


def _switch_to_sparse(model) -> None:
    """Run ``model`` with ``attn_implementation="sparse_k"`` unless it already runs it (or a hub
    kernel, named ``"org/name"``, which reads the same ``config.sparse_attention``)."""
    current = _attn_implementation(model)
    if current == "sparse_k" or (isinstance(current, str) and "/" in current):
        return
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        raise TypeError(
            f"configure(): {type(model).__name__} runs attn_implementation={current!r} and has no "
            "set_attn_implementation(); configure its Transformers model, or its config before loading"
        )
    setter("sparse_k")


def configure(
    target,
    pattern: str | Pattern | None = None,
    *,
    layers: dict | None = None,
    dense_layers: list | None = None,
    full_attention_layers_only: bool | None = None,
    backend: str | None = None,
    cache_positions: str | None = None,
    selector_path: str | os.PathLike | None = None,
    shipped_selectors: bool | None = None,
    **params,
) -> dict:
    """Set the sparse attention of a model (or of a config before loading) and return the dict written.

    Args:
        target: a Transformers model (its ``config`` and text config are updated) or a config.
        pattern: a name from ``sparse_k.available_patterns()``; ``params`` are its parameters
            (``window=1024, sinks=4``...; numpy integers are written as Python ints). Without a pattern the defaults
            of ``"sparse_k"`` apply. A ``sparse_k`` Pattern object (``sparse_k.Streaming(sinks=1, window=3)``) is
            stored as its ``to_dict()``, name and every parameter; ``params`` then override its parameters.
        layers: per-layer overrides ``{layer_index: name | {"pattern": name, **params} | Pattern}``.
        dense_layers: layer indices that stay dense.
        full_attention_layers_only: layers the model itself runs with a sliding window or chunk keep
            only their own rule; only the model's global layers become sparse.
        backend: ``"auto"``, ``"torch"``, ``"reference"`` or a registered kernel backend.
        cache_positions: bounded-cache position mode, ``"original"`` or ``"rolling"``.
        selector_path: safetensors file with trained selectors (``sparse_k``/``dsa``); on a model they
            are loaded and attached at once (a missing or mismatched file warns and keeps the
            training-free selection). After ``from_pretrained`` of a config that already names one,
            call ``hf_sparse_attention.load_selectors_for_model(model)``.
        shipped_selectors: False keeps the package's shipped trained selectors (``hf_sparse_attention.shipped``,
            attached by themselves to the model they were trained on) off; default on.
    Returns:
        The plain, JSON-friendly dict stored as ``config.sparse_attention`` (it round-trips through
        ``save_pretrained``/``from_pretrained``). A model that ran a dense implementation (``sdpa``,
        ``eager``...) now runs ``attn_implementation="sparse_k"``; ``model.set_attn_implementation("sdpa")``
        switches it back.
    Raises:
        ValueError: an unknown pattern, backend or position mode, a bad pattern parameter, a bidirectional
            (``causal=False``) pattern, or a ``dense_layers``/``layers`` index outside ``0 .. num_hidden_layers - 1``.
        TypeError: ``pattern`` neither a name nor a Pattern, ``layers`` not a dict of layer indices, ``dense_layers`` not a list of them,
            ``full_attention_layers_only`` not a bool, or ``selector_path`` not a path.
    """
    if isinstance(selector_path, os.PathLike):  # stored as its string: the config must stay JSON-friendly
        selector_path = os.fspath(selector_path)
    if isinstance(pattern, Pattern):  # the config holds plain dicts: pattern_from_dict(to_dict()) is the pattern
        cfg: dict = pattern.to_dict()
    elif pattern is None or isinstance(pattern, str):
        cfg = {} if pattern is None else {"pattern": pattern}
    else:
        raise TypeError(f"configure(): pattern must be a pattern name (one of sparse_k.available_patterns()) or a "
                        f"sparse_k Pattern, got {type(pattern).__name__} {pattern!r}")
    cfg.update(params)
    if isinstance(layers, dict):  # keys as the saved (JSON) config holds them
        cfg["layers"] = {}
        for k, v in layers.items():
            key = str(layer_index(k, "configure(): `layers`"))
            if key in cfg["layers"]:  # 0 and "0": one would silently override the other
                raise ValueError(f"configure(): `layers` names layer {key} twice (keys {sorted(map(repr, layers))})")
            cfg["layers"][key] = v.to_dict() if isinstance(v, Pattern) else v
    elif layers is not None:  # validate_sparse_config names the type it refuses
        cfg["layers"] = layers
    for name, value in (
        ("dense_layers", dense_layers),
        ("full_attention_layers_only", full_attention_layers_only),
        ("backend", backend),
        ("cache_positions", cache_positions),
        ("selector_path", selector_path),
        ("shipped_selectors", shipped_selectors),
    ):
        if value is not None:
            if name == "dense_layers" and (isinstance(value, (str, bytes)) or not isinstance(value, Iterable)):
                raise TypeError(f"configure(): `dense_layers` must be a list of layer indices, got {value!r}")
            cfg[name] = list(value) if name == "dense_layers" else value
    configs = _configs(target)
    checked = validate_sparse_config(cfg)
    _check_layer_range(checked, _num_layers(configs))
    for key in cfg:  # numpy integers (accepted) as plain ints: the config stays JSON-friendly
        if key not in RESERVED_KEYS or key in ("layers", "dense_layers"):
            cfg[key] = checked[key]
    if isinstance(target, torch.nn.Module):
        _switch_to_sparse(target)
    for config in configs:
        config.sparse_attention = dict(cfg)
    if selector_path is not None and isinstance(target, torch.nn.Module):
        from .selectors import load_selectors_for_model

        load_selectors_for_model(target)
    return dict(cfg)
