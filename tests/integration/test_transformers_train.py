"""``torch.compile`` and fine-tuning (gradient checkpointing) with ``attn_implementation="sparse_k"``."""

from __future__ import annotations

import pytest
import torch

import hf_sparse_attention
from tiny_models import VOCAB, one_thread, tiny_model  # noqa: F401

transformers = pytest.importorskip("transformers")


def test_torch_compile_matches_eager():
    model = tiny_model("llama", seed=21)
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=9)
    model.set_attn_implementation("sparse_k")
    ids = torch.randint(0, VOCAB, (2, 33))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        eager = model(ids, attention_mask=mask).logits
        compiled = torch.compile(model, backend="aot_eager")
        out = compiled(ids, attention_mask=mask).logits
    assert (out - eager).abs().max() < 1e-5


def test_finetuning_with_gradient_checkpointing_lowers_the_loss():
    model = tiny_model("llama", seed=22)
    hf_sparse_attention.configure(model, "bigbird", block=4, window_blocks=1, global_blocks=1, random_blocks=1)
    model.set_attn_implementation("sparse_k")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    torch.manual_seed(0)
    data = torch.randint(0, VOCAB, (4, 48))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(data, labels=data).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert model.is_gradient_checkpointing
    assert losses[-1] < losses[0] - 0.1, losses
    grads = [p.grad for p in model.model.layers[0].self_attn.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
