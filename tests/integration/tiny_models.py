"""Shared helpers of the Transformers integration tests: tiny random-weight Llama, Mistral, Qwen2 and
Gemma3-style hybrid models, the fixed patterns at small sizes, logits under ``attn_implementation=
"sparse_k"`` and under the exact float64 reference with an independently built mask
(``attn_implementation="sparse_k_test_ref"``), and the one-thread fixture (autouse where imported).
"""

from __future__ import annotations

import pytest
import torch
from helpers import one_thread  # noqa: F401  (autouse fixture; re-exported to the test_transformers_* files)
from sparse_k import masked_attention

import hf_sparse_attention

transformers = pytest.importorskip("transformers")

VOCAB = 96

#: Fixed patterns with parameters small enough to be non-trivial at ~40-64 tokens.
FIXED_PATTERNS = {
    "dense": {},
    "sliding_window": {"window": 9},
    "streaming": {"sinks": 3, "window": 7},
    "block_diagonal": {"block": 8},
    "bigbird": {"block": 4, "window_blocks": 1, "global_blocks": 1, "random_blocks": 2, "seed": 3},
    "dilated": {"window": 4, "scales": 3},
    "l2_aligned": {"block": 4, "window_blocks": 2, "segment": 16, "anchor": 3},
}


def tiny_model(family: str, seed: int = 0, attn: str = "sdpa", layers: int = 2, layer_types: list | None = None):
    """A tiny random-weight causal LM (hidden 64, ``layers`` layers, GQA 4:2) in float32 eval mode.

    ``layer_types`` (gemma3 only): its layers' types; default one sliding layer, then global ones."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
    )
    if family == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif family == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=24)
        cls = transformers.MistralForCausalLM
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=24, max_window_layers=1)
        cls = transformers.Qwen2ForCausalLM
    elif family == "gemma3":
        default = ["sliding_attention", "full_attention"][:layers] + ["full_attention"] * max(0, layers - 2)
        cfg = transformers.Gemma3TextConfig(
            **common, head_dim=16, sliding_window=20, query_pre_attn_scalar=16, layer_types=layer_types or default,
        )
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(family)
    model = cls(cfg).eval()
    model.set_attn_implementation(attn)
    return model


def model_windows(model) -> list:
    """The model's own sliding window of every layer (None for global layers)."""
    cfg = model.config
    types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    out = []
    for i in range(cfg.num_hidden_layers):
        if types is not None:
            out.append(window if types[i] == "sliding_attention" else None)
        else:
            out.append(window)
    return out


class ReferenceMaskAttention:
    """An attention function that runs ``sparse_k.masked_attention`` (float64) under a mask built here.

    The mask of layer ``l`` is ``pattern.allowed(qpos, kpos) & (qpos - kpos < W_l)`` (``W_l`` the
    model's own window) & key validity from the 2-D padding mask, with positions counted from each
    row's first real token. Registered as ``attn_implementation="sparse_k_test_ref"``; set
    ``.pattern``, ``.windows`` and ``.padding`` before the forward.
    """

    name = "sparse_k_test_ref"

    def __init__(self):
        self.pattern = None
        self.windows = None
        self.padding = None
        self.dtype = torch.float64
        transformers.AttentionInterface.register(self.name, self)
        transformers.masking_utils.AttentionMaskInterface.register(self.name, lambda *a, **k: None)

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        B, _, Sq, _ = query.shape
        Skv = key.shape[2]
        assert Sq == Skv, "the reference run covers full forwards without a cache"
        pad = self.padding if self.padding is not None else torch.ones(B, Skv, dtype=torch.bool)
        first = pad.to(torch.int64).argmax(-1)
        pos = torch.arange(Skv)[None, :] - first[:, None]  # (B, S)
        qpos, kpos = pos[:, None, :, None], pos[:, None, None, :]
        heads = torch.arange(key.shape[1]).view(1, -1, 1, 1)
        mask = self.pattern.allowed(qpos, kpos, module.layer_idx, heads, Skv) & pad[:, None, None, :]
        window = self.windows[module.layer_idx]
        if window is not None:
            mask = mask & (qpos - kpos < window)
        out, _ = masked_attention(query, key, value, mask, scale=scaling, dtype=self.dtype)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None


REFERENCE = ReferenceMaskAttention()


def reference_logits(model, ids, pattern, padding=None, dtype=torch.float64):
    """Logits of ``model`` with every attention layer replaced by the exact reference under ``pattern``
    (attention computed in ``dtype``)."""
    old = model.config._attn_implementation
    REFERENCE.pattern, REFERENCE.windows, REFERENCE.padding = pattern, model_windows(model), padding
    REFERENCE.dtype = dtype
    model.set_attn_implementation(REFERENCE.name)
    try:
        with torch.no_grad():
            return model(ids, attention_mask=None if padding is None else padding.long()).logits
    finally:
        model.set_attn_implementation(old)


def sparse_logits(model, ids, pattern_name, params, attention_mask=None, **extra):
    hf_sparse_attention.configure(model, pattern_name, **params, **extra)
    model.set_attn_implementation("sparse_k")
    with torch.no_grad():
        return model(ids, attention_mask=attention_mask).logits
