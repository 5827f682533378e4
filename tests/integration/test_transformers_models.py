"""Tiny random-weight Llama, Mistral, Qwen2 and Gemma3-style hybrid models with ``attn_implementation="sparse_k"``.

Checks per model family: a covering pattern equals the model's own attention (SDPA, which applies
the model's sliding windows), a narrow window differs from it and equals a run whose attention is
the exact float64 reference under an independently built mask, and a left-padded batch equals the
examples run one by one for every fixed pattern. Models and helpers: ``tiny_models.py``.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import FIXED_PATTERNS, VOCAB, one_thread, reference_logits, sparse_logits, tiny_model  # noqa: F401

from sparse_k import get_pattern

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
