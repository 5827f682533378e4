"""``configure(model, pattern=..., **params)``: write ``config.sparse_attention`` on a model or config."""

from __future__ import annotations

import torch
from sparse_k.config import validate_sparse_config

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


def configure(
    target,
    pattern: str | None = None,
    *,
    layers: dict | None = None,
    dense_layers: list | None = None,
    full_attention_layers_only: bool | None = None,
    backend: str | None = None,
    cache_positions: str | None = None,
    selector_path: str | None = None,
    **params,
) -> dict:
    """Set the sparse attention of a model (or of a config before loading) and return the dict written.

    Args:
        target: a Transformers model (its ``config`` and text config are updated) or a config.
        pattern: a name from ``sparse_k.available_patterns()``; ``params`` are its parameters
            (``window=1024, sinks=4``...). Without a pattern the defaults of ``"sparse_k"`` apply.
        layers: per-layer overrides ``{layer_index: name | {"pattern": name, **params}}``.
        dense_layers: layer indices that stay dense.
        full_attention_layers_only: layers the model itself runs with a sliding window or chunk keep
            only their own rule; only the model's global layers become sparse.
        backend: ``"auto"``, ``"torch"``, ``"reference"`` or a registered kernel backend.
        cache_positions: bounded-cache position mode, ``"original"`` or ``"rolling"``.
        selector_path: safetensors file with trained selectors (``sparse_k``/``dsa``); on a model they
            are loaded and attached at once (a missing or mismatched file warns and keeps the
            training-free selection). After ``from_pretrained`` of a config that already names one,
            call ``hf_sparse_attention.load_selectors_for_model(model)``.
    Returns:
        The plain, JSON-friendly dict stored as ``config.sparse_attention`` (it round-trips through
        ``save_pretrained``/``from_pretrained``). The model must run with
        ``attn_implementation="sparse_k"`` (``model.set_attn_implementation("sparse_k")``) to use it.
    """
    cfg: dict = {} if pattern is None else {"pattern": pattern}
    cfg.update(params)
    if layers is not None:
        cfg["layers"] = {str(int(k)): v for k, v in layers.items()}
    for name, value in (
        ("dense_layers", dense_layers),
        ("full_attention_layers_only", full_attention_layers_only),
        ("backend", backend),
        ("cache_positions", cache_positions),
        ("selector_path", selector_path),
    ):
        if value is not None:
            cfg[name] = list(value) if name == "dense_layers" else value
    validate_sparse_config(cfg)
    for config in _configs(target):
        config.sparse_attention = dict(cfg)
    if selector_path is not None and isinstance(target, torch.nn.Module):
        from .selectors import load_selectors_for_model

        load_selectors_for_model(target)
    return dict(cfg)
