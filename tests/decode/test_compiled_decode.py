"""Learned selections decode under ``torch.compile`` with a ``StaticCache`` (CUDA graphs on a GPU).

A decode step of ``sparse_k`` (trained ``SparseKScorer``, with and without the prefix top-k scan, and in two
stages with ``refine``),
``dsa`` (``LightningIndexer``) and the training-free default traces as one graph, its logits and
tokens equal the eager decode and recomputing the prefix, and the state the selection keeps from
step to step (the current block's first query: the module's memo, the indexer's memo) stays in the
buffers it was given: the compiled step writes them in place and never stores one of its outputs
there (a CUDA-graph output is overwritten by the next replay). On the CPU the steps run through the
Triton interpreter (the decode attention path) with ``backend="eager"``; the ``gpu`` test runs
``mode="reduce-overhead"`` (Inductor + CUDA graphs).
"""

from __future__ import annotations

import pytest
import torch
from triton_interp import KERNEL_TEST, ON_GPU, import_kernels, run_file_interpreted

HAVE_TRITON, IN_PROCESS, _kernels = import_kernels("attention.triton.fwd")

from sparse_k.selection import step_state  # noqa: E402

DEV = "cuda" if ON_GPU else "cpu"
PROMPT, STEPS = 25, 6  # steps cross the query-block boundary at position 28
PARAMS = {"sinks": 2, "window": 6, "top_k": 4, "query_block": 4}
VARIANTS = ["sparse_k", "sparse_k_prefix_scan", "sparse_k_refine", "dsa", "default"]
TOL = 2e-3 if ON_GPU else 1e-5


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ----- the buffers ------------------------------------------------------------------------------


def test_state_buffers_are_allocated_once_and_marked_static():
    state = {}
    spec = {"block": ((3,), torch.int64, -1), "q": ((3, 4, 8), torch.float32, 0.0)}
    assert step_state.state_buffers(state, spec, torch.device("cpu")) is False
    assert torch.equal(state["block"], torch.full((3,), -1)) and not bool(state["q"].any())
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in state.values())
    first = {k: (id(v), v.data_ptr()) for k, v in state.items()}
    state["q"].copy_(torch.randn(3, 4, 8))
    assert step_state.state_buffers(state, spec, torch.device("cpu")) is True
    assert {k: (id(v), v.data_ptr()) for k, v in state.items()} == first
    for changed in ({"q": ((2, 4, 8), torch.float32, 0.0)}, {"q": ((3, 4, 8), torch.float64, 0.0)}):
        assert step_state.state_buffers(state, {**spec, **changed}, torch.device("cpu")) is False
        name, (shape, dtype, _) = next(iter(changed.items()))
        assert tuple(state[name].shape) == shape and state[name].dtype == dtype


def test_state_buffers_made_under_inference_mode_stay_writable():
    state = {}
    with torch.inference_mode():
        step_state.state_buffers(state, {"q": ((2,), torch.float32, 0.0)}, torch.device("cpu"))
        state["q"].copy_(torch.ones(2))
    assert not state["q"].is_inference()
    state["q"].copy_(torch.full((2,), 2.0))  # outside inference mode too
    assert torch.equal(state["q"], torch.full((2,), 2.0))


def test_new_state_dict_keeps_an_existing_dict():
    class Owner:
        pass

    o = Owner()
    d = step_state.new_state_dict(o, "memo")
    assert d == {} and o.memo is d
    d["x"] = 1
    assert step_state.new_state_dict(o, "memo") is d


# ----- a compiled StaticCache decode ------------------------------------------------------------


@pytest.mark.skipif(IN_PROCESS or not HAVE_TRITON, reason="the kernels run in this process (or triton is missing)")
def test_interpreter_suite_in_subprocess():
    run_file_interpreted(__file__, len(VARIANTS))


def _model(variant, monkeypatch):
    transformers = pytest.importorskip("transformers")
    import hf_sparse_attention
    import sparse_k.selection.selectors as selectors
    from hf_sparse_attention.selectors import attach_selectors, create_selectors

    if variant == "sparse_k_prefix_scan":  # decode steps have more candidates than 2 * top_k + PREFIX_CHUNK
        monkeypatch.setattr(selectors, "PREFIX_CHUNK", 4)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval().to(DEV)
    params = dict(PARAMS, top_k=2, refine=2) if variant == "sparse_k_refine" else PARAMS  # a pool of 4, 2 kept
    hf_sparse_attention.configure(model, "dsa" if variant == "dsa" else "sparse_k", **params)
    model.set_attn_implementation("sparse_k")
    if variant != "default":
        torch.manual_seed(1)
        attach_selectors(model, create_selectors(model))
    return model


def _state(model):
    """Every tensor a layer's selection keeps across calls (the module's memo of the training-free selection,
    the indexer's): ``{(layer, name): (id, data_ptr, static-address mark)}``."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        selector = getattr(attn, "_sparse_k_selector", None)
        memo = attn.__dict__.get("_sparse_k_selection_memo") or getattr(selector, "_block_memo", None)
        for name, t in (memo or {}).items():
            if isinstance(t, torch.Tensor):
                out[(i, name)] = (id(t), t.data_ptr(), getattr(t, "_dynamo_static_input_type", None))
    return out


def _decode(model, forward, ids, tokens=None):
    """Eager prefill of ``ids (B, PROMPT)`` into a new StaticCache, then ``STEPS`` decode steps through
    ``forward``, fed ``tokens`` (a list of ``(B, 1)``) when given, else greedy. Returns ``(logits (STEPS, B, V),
    tokens fed, selection state after the prefill, state after every step)``."""
    import transformers

    cache = transformers.StaticCache(config=model.config, max_cache_len=PROMPT + STEPS + 5)
    logits, fed, states = [], [], []
    with torch.no_grad():
        nxt = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        before = _state(model)
        for t in range(STEPS):
            nxt = tokens[t] if tokens is not None else nxt
            fed.append(nxt)
            cp = torch.tensor([PROMPT + t], device=DEV)
            out = forward(input_ids=nxt, past_key_values=cache, use_cache=True, cache_position=cp).logits[:, -1]
            logits.append(out.clone())  # a CUDA-graph output is overwritten by the next replay
            states.append(_state(model))
            nxt = out.argmax(-1, keepdim=True)
    return torch.stack(logits), fed, before, states


def _check_compiled_decode(variant, monkeypatch, **compile_kwargs):
    """Eager decode, then the same tokens through the compiled step; recompute checks come last (a
    recompute writes the module's selection state too)."""
    from torch._dynamo.utils import counters

    model = _model(variant, monkeypatch)
    ids = torch.randint(1, 50, (2, PROMPT), generator=torch.Generator().manual_seed(3)).to(DEV)
    want, tokens, _, _ = _decode(model, model.forward, ids)
    torch._dynamo.reset()
    counters.clear()
    got, _, before, states = _decode(model, torch.compile(model.forward, fullgraph=True, **compile_kwargs), ids, tokens)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    if variant in ("dsa", "default", "sparse_k_refine"):  # the block's-first-query memo, in static buffers
        assert before and all(v[2] for v in before.values()), before
    for t, s in enumerate(states):
        assert s == before, f"step {t}: the selection state was replaced, not written in place"
    assert rel(got, want) < TOL, rel(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    seq = torch.cat([ids, *tokens], 1)
    cfg = model.config.sparse_attention
    model.config.sparse_attention = {**cfg, "backend": "torch"}  # the PyTorch path recomputes (fast on the CPU)
    with torch.no_grad():
        for t in (0, STEPS - 1):  # inside the prompt's last block, and inside the next one
            ref = model(seq[:, : PROMPT + t + 1], use_cache=False).logits[:, -1]
            assert rel(got[t], ref) < TOL, (variant, t, rel(got[t], ref))
    model.config.sparse_attention = cfg
    return counters


@KERNEL_TEST
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("variant", VARIANTS)
def test_static_cache_decode_compiles_as_one_graph_and_keeps_state_in_place(variant, monkeypatch):
    """``fullgraph=True`` (no graph break), one graph for every step, decode == eager == recompute, and
    the selection state's tensors are the same buffers before and after every compiled step."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    _check_compiled_decode(variant, monkeypatch, backend="eager")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (CUDA graphs)")
@pytest.mark.parametrize("variant", VARIANTS)
def test_static_cache_decode_under_cuda_graphs(variant, monkeypatch):
    """The same under ``mode="reduce-overhead"`` (Inductor, CUDA graphs): no step is refused a CUDA graph."""
    counters = _check_compiled_decode(variant, monkeypatch, mode="reduce-overhead")
    assert not counters["inductor"].get("cudagraph_skips", 0), dict(counters["inductor"])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (the Triton SparseK kernel under Inductor)")
def test_triton_sparsek_with_a_mask_compiles():
    """``sparsek`` with a bool candidate mask under Inductor (the mask reaches the kernel as uint8)."""
    from sparse_k.selection.sparsek import sparsek

    g = torch.Generator(device="cuda").manual_seed(0)
    u = torch.randn(2, 3, 97, device="cuda", generator=g)
    mask = torch.rand(2, 3, 97, device="cuda", generator=g) > 0.3
    want = sparsek(u, 7, mask)
    got = torch.compile(lambda a, m: sparsek(a, 7, m), fullgraph=True)(u, mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (CUDA graphs)")
@pytest.mark.parametrize("variant", VARIANTS)
def test_200_compiled_steps_trace_one_graph(variant, monkeypatch):
    """200 compiled StaticCache steps (many query blocks, prefix-scan chunks and pages, the selection state
    stepped every time) trace one graph and record CUDA graphs without a skip: no recompile as the cache fills."""
    import transformers
    from torch._dynamo.utils import counters

    model = _model(variant, monkeypatch)
    ids = torch.randint(1, 50, (2, PROMPT), generator=torch.Generator().manual_seed(4)).to(DEV)
    cache = transformers.StaticCache(config=model.config, max_cache_len=PROMPT + 205)
    torch._dynamo.reset()
    counters.clear()
    forward = torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        nxt = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for t in range(200):
            cp = torch.tensor([PROMPT + t], device=DEV)
            nxt = forward(input_ids=nxt, past_key_values=cache, use_cache=True, cache_position=cp).logits[:, -1:].argmax(-1)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["inductor"].get("cudagraph_skips", 0), dict(counters["inductor"])
