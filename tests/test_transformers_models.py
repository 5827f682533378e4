"""Tiny random-weight Llama, Mistral, Qwen2 and Gemma3-style hybrid models with ``attn_implementation="sparse_k"``.

Checks per model family: a covering pattern equals the model's own attention (SDPA, which applies
the model's sliding windows), a narrow window differs from it and equals a run whose attention is
the exact float64 reference under an independently built mask, and a left-padded batch equals the
examples run one by one for every fixed pattern. Helpers here are imported by the other
``test_transformers_*`` files.
"""

from __future__ import annotations

import pytest
import torch

import hf_sparse_attention
from helpers import one_thread  # noqa: F401  (autouse fixture; re-exported to the other test_transformers_* files)
from sparse_k import get_pattern, masked_attention

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


def tiny_model(family: str, seed: int = 0, attn: str = "sdpa", layers: int = 2):
    """A tiny random-weight causal LM (hidden 64, ``layers`` layers, GQA 4:2) in float32 eval mode."""
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
        cfg = transformers.Gemma3TextConfig(
            **common, head_dim=16, sliding_window=20, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"][:layers] + ["full_attention"] * max(0, layers - 2),
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


FAMILIES = ["llama", "mistral", "qwen2", "gemma3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_covering_window_equals_model_attention(family):
    model = tiny_model(family, seed=1)
    ids = torch.randint(0, VOCAB, (2, 53))
    with torch.no_grad():
        dense = model(ids).logits
    out = sparse_logits(model, ids, "sliding_window", {"window": 53})
    # fp32 logits of a 2-layer model; SDPA and the PyTorch path sum in different orders (~1e-6).
    assert (out - dense).abs().max() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_narrow_window_equals_reference_mask(family):
    model = tiny_model(family, seed=2)
    ids = torch.randint(0, VOCAB, (2, 61))
    with torch.no_grad():
        dense = model(ids).logits
    out = sparse_logits(model, ids, "sliding_window", {"window": 6})
    ref = reference_logits(model, ids, get_pattern("sliding_window", window=6))
    assert (out - dense).abs().max() > 1e-2
    assert (out - ref).abs().max() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(FIXED_PATTERNS))
def test_left_padded_batch_equals_one_by_one(family, name):
    model = tiny_model(family, seed=3)
    params = FIXED_PATTERNS[name]
    lengths = [41, 29, 35]
    S = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), S))
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, S - n :] = 1
    ids = ids.masked_fill(mask == 0, 0)
    batch = sparse_logits(model, ids, name, params, attention_mask=mask)
    for b, n in enumerate(lengths):
        single = sparse_logits(model, ids[b : b + 1, S - n :], name, params)
        assert (batch[b, S - n :] - single[0]).abs().max() < 1e-4, (name, b)
    if name in ("streaming", "bigbird", "block_diagonal"):
        ref = reference_logits(model, ids, get_pattern(name, **params), padding=mask.bool())
        valid = mask.bool()
        assert (batch - ref)[valid].abs().max() < 1e-4


def test_full_attention_layers_only_keeps_local_layers():
    """Gemma3-style hybrid: with full_attention_layers_only the sliding layer keeps its own window."""
    model = tiny_model("gemma3", seed=4)
    ids = torch.randint(0, VOCAB, (1, 57))
    out = sparse_logits(model, ids, "sliding_window", {"window": 5}, full_attention_layers_only=True)

    class Mixed:
        def allowed(self, qpos, kpos, layer_idx, heads, kv_len):
            rule = get_pattern("dense") if layer_idx == 0 else get_pattern("sliding_window", window=5)
            return rule.allowed(qpos, kpos, layer_idx, heads, kv_len)

    ref = reference_logits(model, ids, Mixed())
    assert (out - ref).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["streaming", "bigbird", "dilated"])
def test_right_padded_batch_equals_one_by_one(name):
    model = tiny_model("qwen2", seed=5)
    params = FIXED_PATTERNS[name]
    lengths = [38, 25]
    ids = torch.randint(1, VOCAB, (2, 38))
    mask = torch.zeros(2, 38, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    batch = sparse_logits(model, ids, name, params, attention_mask=mask)
    for b, n in enumerate(lengths):
        single = sparse_logits(model, ids[b : b + 1, :n], name, params)
        assert (batch[b, :n] - single[0]).abs().max() < 1e-4, (name, b)
