"""Trained selectors (SparseK scorers / DSA indexers) beside a Transformers model: create, attach, save, load.

File format and location (documented contract):

* One safetensors file per model, by default ``sparse_k_selectors.safetensors`` (``SELECTOR_FILE``)
  in the model directory. Tensors are named ``layers.<layer_idx>.<parameter>`` (float32); the
  metadata holds ``format = "hf_sparse_attention.selectors"``, ``version``, ``selectors`` (JSON:
  layer index -> the selector's ``config()``) and ``pattern`` (JSON: the pattern it was trained for).
* ``config.sparse_attention["selector_path"]`` (``CONFIG_KEY``) names the file: absolute, or
  relative to the model directory (then to the working directory). Without the key, the default
  file in the model directory is used when it exists.
* Selectors are attached as ``attention_module._sparse_k_selector`` with ``object.__setattr__``:
  they are *not* submodules, so they never enter the model's ``state_dict``, ``save_pretrained``
  output or ``parameters()``. The Transformers integration passes them to
  ``sparse_k.selection.selectors.build_selection``.
* Loading never fails because of selectors: a missing, unreadable or mismatched file gives a
  one-time warning and the training-free fallback is used.
"""

from __future__ import annotations

import json
import os

import torch
from sparse_k.warn import warn_once
from sparse_k.integrations.config import pattern_for_layer
from sparse_k.layouts.patterns import DSA, Pattern, SparseK
from sparse_k.selection.scorers import LightningIndexer, SparseKScorer, selector_from_config
from torch import nn

__all__ = [
    "CONFIG_KEY",
    "SELECTOR_ATTR",
    "SELECTOR_FILE",
    "attach_selectors",
    "attention_modules",
    "create_selectors",
    "detach_selectors",
    "get_selectors",
    "load_selectors",
    "load_selectors_for_model",
    "read_selector_metadata",
    "resolve_selector_path",
    "save_selectors",
]

SELECTOR_FILE = "sparse_k_selectors.safetensors"
CONFIG_KEY = "selector_path"
SELECTOR_ATTR = "_sparse_k_selector"
_FORMAT = "hf_sparse_attention.selectors"
_VERSION = "1"


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """``{layer_idx: attention module}``: the first module of each layer whose class name contains
    "Attention" and that carries an int ``layer_idx`` (Transformers' attention modules do)."""
    found: dict[int, nn.Module] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and not isinstance(idx, bool) and "attention" in type(module).__name__.lower():
            found.setdefault(idx, module)
    return found


def _model_dims(model: nn.Module) -> tuple[int, int, int]:
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if cfg is None:
        raise ValueError("create_selectors needs a Transformers model (with .config)")
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    return hq, hkv, d


def _sparse_config(model: nn.Module) -> dict | None:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "sparse_attention", None) if cfg is not None else None


def create_selectors(model: nn.Module, pattern: Pattern | None = None, *, position_term: bool = True,
                     key_norm_term: bool = True, per_kv_head: bool = False) -> dict[int, nn.Module]:
    """Fresh (untrained) selectors for every layer of ``model`` that runs a learned pattern.

    ``pattern``: one ``SparseK``/``DSA`` pattern for every layer; None: each layer's pattern from
    ``model.config.sparse_attention`` (layers whose pattern is not learned get none).
    ``position_term``/``key_norm_term``: ``SparseKScorer`` options; ``per_kv_head``: DSA indexers
    with one indexer (and selection) per KV head (``LightningIndexer``).
    Returns ``{layer_idx: SparseKScorer | LightningIndexer}`` on CPU, float32.
    """
    hq, hkv, d = _model_dims(model)
    out: dict[int, nn.Module] = {}
    cfg = _sparse_config(model)
    for idx in sorted(attention_modules(model)):
        p = pattern if pattern is not None else pattern_for_layer(cfg, idx)
        if isinstance(p, SparseK):
            out[idx] = SparseKScorer(hkv, d, position_term=position_term, key_norm_term=key_norm_term)
        elif isinstance(p, DSA):
            out[idx] = LightningIndexer(hq, hkv, d, indexer_heads=p.indexer_heads, indexer_dim=p.indexer_dim,
                                        per_kv_head=per_kv_head)
    return out


def attach_selectors(model: nn.Module, selectors: dict[int, nn.Module]) -> None:
    """Attach ``selectors`` to the attention modules (outside the state dict), on each module's device."""
    mods = attention_modules(model)
    missing = sorted(set(selectors) - set(mods))
    if missing:
        raise ValueError(f"attach_selectors: the model has no attention module for layer(s) {missing}")
    for idx, sel in selectors.items():
        if not isinstance(sel, (SparseKScorer, LightningIndexer)):
            raise TypeError(f"attach_selectors: layer {idx}: expected a SparseKScorer or LightningIndexer, got {type(sel).__name__}")
        param = next(mods[idx].parameters(), None)
        if param is not None:
            sel.to(param.device)
        object.__setattr__(mods[idx], SELECTOR_ATTR, sel)


def detach_selectors(model: nn.Module) -> None:
    """Remove attached selectors (layers then use the training-free fallback)."""
    for mod in attention_modules(model).values():
        if SELECTOR_ATTR in mod.__dict__:
            object.__delattr__(mod, SELECTOR_ATTR)


def get_selectors(model: nn.Module) -> dict[int, nn.Module]:
    """``{layer_idx: selector}`` currently attached to ``model``."""
    return {i: m.__dict__[SELECTOR_ATTR] for i, m in attention_modules(model).items() if SELECTOR_ATTR in m.__dict__}


def save_selectors(
    selectors: dict[int, nn.Module] | nn.Module,
    path: str,
    *,
    pattern: Pattern | None = None,
    update_config: bool = False,
) -> str:
    """Write ``selectors`` (a dict, or a model with attached selectors) to ``path``.

    ``path`` is a file, or a directory (then ``<path>/sparse_k_selectors.safetensors``).
    ``update_config`` (model only): also set ``model.config.sparse_attention["selector_path"]`` to
    the file name, so that ``save_pretrained`` into the same directory finds it.
    Returns the file path.
    """
    from safetensors.torch import save_file

    model = selectors if isinstance(selectors, nn.Module) else None
    sels = get_selectors(model) if model is not None else selectors
    if not isinstance(sels, dict) or not sels:
        raise ValueError("save_selectors: nothing to save (no selectors given or attached)")
    if os.path.isdir(path) or path.endswith(os.sep) or not path.endswith(".safetensors"):
        os.makedirs(path, exist_ok=True)
        path = os.path.join(path, SELECTOR_FILE)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tensors, configs = {}, {}
    for idx, sel in sorted(sels.items()):
        configs[str(idx)] = sel.config()
        for name, t in sel.state_dict().items():
            tensors[f"layers.{idx}.{name}"] = t.detach().to("cpu", torch.float32).contiguous()
    meta = {"format": _FORMAT, "version": _VERSION, "selectors": json.dumps(configs)}
    if pattern is not None:
        meta["pattern"] = json.dumps(pattern.to_dict())
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)
    if update_config and model is not None:
        cfg = dict(_sparse_config(model) or {})
        cfg[CONFIG_KEY] = os.path.basename(path)
        model.config.sparse_attention = cfg
    return path


def read_selector_metadata(path: str) -> dict:
    """The metadata of a selector file: ``{"format", "version", "selectors": {...}, "pattern": {...} | None}``."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{path} is not a selector file (metadata format {meta.get('format')!r}, expected {_FORMAT!r})")
    return {
        "format": meta["format"], "version": meta.get("version"),
        "selectors": json.loads(meta.get("selectors", "{}")),
        "pattern": json.loads(meta["pattern"]) if "pattern" in meta else None,
    }


def load_selectors(path: str, device: str | torch.device | None = None) -> dict[int, nn.Module]:
    """``{layer_idx: selector}`` from a file written by ``save_selectors`` (a directory: its default file)."""
    from safetensors.torch import load_file

    if os.path.isdir(path):
        path = os.path.join(path, SELECTOR_FILE)
    meta = read_selector_metadata(path)
    tensors = load_file(path, device="cpu")
    out: dict[int, nn.Module] = {}
    for key, cfg in meta["selectors"].items():
        sel = selector_from_config(cfg)
        prefix = f"layers.{key}."
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        sel.load_state_dict(state, strict=True)
        out[int(key)] = sel.to(device) if device is not None else sel
    return out


def resolve_selector_path(model: nn.Module, path: str | None = None) -> tuple[str | None, bool]:
    """``(file or None, explicitly requested)``: ``path``, else ``config.sparse_attention["selector_path"]``,
    else the default file in the model directory (``config._name_or_path``) when it exists."""
    cfg = _sparse_config(model) or {}
    requested = path if path is not None else cfg.get(CONFIG_KEY)
    model_dir = getattr(getattr(model, "config", None), "_name_or_path", None) or ""
    if requested is None:
        default = os.path.join(model_dir, SELECTOR_FILE) if model_dir else None
        return (default if default and os.path.isfile(default) else None), False
    candidates = [requested] if os.path.isabs(requested) else [os.path.join(model_dir, requested), requested]
    for c in candidates:
        if os.path.isdir(c):
            c = os.path.join(c, SELECTOR_FILE)
        if c and os.path.isfile(c):
            return c, True
    return None, True


def load_selectors_for_model(model: nn.Module, path: str | None = None) -> bool:
    """Find, load and attach the model's selectors; True when attached. Never raises for a missing,
    unreadable or mismatched file: it warns once and the training-free fallback stays in use."""
    file, requested = resolve_selector_path(model, path)
    if file is None:
        if requested:
            warn_once(f"sparse_attention: selector file {path or (_sparse_config(model) or {}).get(CONFIG_KEY)!r} not found; "
                      "using the training-free selection")
        return False
    try:
        sels = load_selectors(file)
        hq, hkv, d = _model_dims(model)
        mods = attention_modules(model)
        for idx, sel in sels.items():
            if idx not in mods:
                raise ValueError(f"layer {idx} does not exist in the model")
            if sel.num_kv_heads != hkv or sel.head_dim != d or getattr(sel, "num_q_heads", hq) != hq:
                raise ValueError(f"layer {idx}: selector dims {sel.config()} do not match the model (Hq={hq}, Hkv={hkv}, D={d})")
        cfg = _sparse_config(model)
        for idx in list(sels):
            want = pattern_for_layer(cfg, idx).name
            if want != sels[idx].kind:
                warn_once(f"sparse_attention: {file!r} holds a {sels[idx].kind!r} selector for layer {idx}, which runs "
                          f"{want!r}; not attached there")
                del sels[idx]
        attach_selectors(model, sels)
    except Exception as exc:  # noqa: BLE001 - a bad selector file must not break from_pretrained
        warn_once(f"sparse_attention: could not use selector file {file!r} ({exc}); using the training-free selection")
        return False
    return True
