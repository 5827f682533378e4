"""The selection state a static-cache decode step updates for its new key only (``sparse_k.selection.selection_state``).

Over many steps of a static cache (random keys, values and queries, odd lengths, GQA, a left-padded
row, unwritten slots holding garbage), the layout ``build_selection`` returns from the stepped state
equals the layout it computes from every key of the same call (``state=None``), for the SparseK
scorer (exact path and prefix scan), the DSA indexer (shared and per KV head) and the training-free
pages. A step reads the new key only (the scorer, the indexer keys and the page summaries are
computed for one key per row), and the state is what the step reads (a corrupted state changes the
selection); a state written for another cache or selector is not trusted by an eager call.
"""

from __future__ import annotations

import pytest
import sparse_k
import torch
from sparse_k.layouts.geometry import RowGeometry
from sparse_k.selection import selectors
from sparse_k.selection.scorers import LightningIndexer, SparseKScorer
from sparse_k.selection.selectors import build_selection

B, HQ, HKV, D = 2, 4, 2, 16
SLOTS, PROMPT, PAD = 97, 13, 3  # row 1 is left-padded by PAD slots
SPARSEK = sparse_k.SparseK(sinks=2, window=5, top_k=6, query_block=4)
DSA = sparse_k.DSA(sinks=1, window=3, top_k=5, query_block=3)
KINDS = ["sparse_k", "sparse_k_prefix_scan", "sparse_k_refine", "sparse_k_refine_prefix_scan", "dsa", "dsa_per_kv_head",
         "pages"]
#: On a GPU the offsets are device tensors: every call takes the bounds a compiled step takes (no host read).
#: ``cpu_device_offsets`` takes that path on the CPU (the geometry's host offsets hidden).
DEVICES = ["cpu", "cpu_device_offsets", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                   reason="needs CUDA")])]


def _selector(kind):
    torch.manual_seed(5)
    if kind.startswith("sparse_k"):
        scorer = SparseKScorer(HKV, D)
        with torch.no_grad():
            for prm in scorer.parameters():
                prm.copy_(torch.randn(prm.shape))
            scorer.log_gain.fill_(0.0)  # gain 1: many fractional SparseK weights
        return scorer
    if kind.startswith("dsa"):
        return LightningIndexer(HQ, HKV, D, indexer_heads=2, indexer_dim=8, per_kv_head=kind == "dsa_per_kv_head")
    return None


def _pattern(kind):
    if kind.startswith("sparse_k_refine"):
        return SPARSEK.replace(top_k=3, refine=2)  # a pool of 6, refined to 3 keys by the block's first query
    return DSA if kind.startswith("dsa") else SPARSEK


class Cache:
    """A static cache: ``k, v (B, HKV, SLOTS, D)`` with garbage in unwritten slots, ``written`` slots in use."""

    def __init__(self, seed, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        self.k = torch.randn(B, HKV, SLOTS, D, generator=g).to(device)
        self.v = torch.randn(B, HKV, SLOTS, D, generator=g).to(device)
        self.q = torch.randn(B, HQ, SLOTS, D, generator=g).to(device)
        self.written, self.device = 0, device

    def call(self, q_len):
        """``(query, geometry)`` of a call that writes ``q_len`` slots (the adapter's static-slots geometry)."""
        self.written += q_len
        mask = torch.arange(SLOTS) < self.written
        mask = torch.stack([mask, mask & (torch.arange(SLOTS) >= PAD)]).to(self.device)
        q_start = torch.full((B,), self.written - q_len, device=self.device)
        geo = sparse_k.row_geometry(B, q_len, SLOTS, mask, q_start)
        return self.q[:, :, self.written - q_len: self.written], geo


def _select(kind, selector, cache, q, geo, state, memo):
    return build_selection(_pattern(kind), q, cache.k, cache.v, geo, layer_idx=0, selector=selector, memo=memo,
                           state=state)


def _same(got, want, where):
    assert (got is None) == (want is None), where
    if got is None:
        return
    assert torch.equal(got.counts, want.counts), where
    assert torch.equal(got.indices, want.indices), where
    assert torch.equal(got.first_block, want.first_block), where
    assert (got.weights is None) == (want.weights is None), where
    if got.weights is not None:
        torch.testing.assert_close(got.weights, want.weights, rtol=0, atol=1e-6, msg=where)


def _setup(kind, monkeypatch, device="cpu"):
    """The kind's selector; for ``cpu_device_offsets`` the geometry's host offsets are hidden (``device`` the
    caller then uses: ``"cpu"``)."""
    if device == "cpu_device_offsets":
        monkeypatch.setattr(RowGeometry, "host_offsets", lambda self: None)
    if kind.endswith("prefix_scan"):
        monkeypatch.setattr(selectors, "PREFIX_CHUNK", 8)
    return _selector(kind)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_stepped_state_equals_full_selection_over_many_steps(kind, device, monkeypatch):
    selector = _setup(kind, monkeypatch, device)
    device = "cpu" if device == "cpu_device_offsets" else device
    selector = selector.to(device) if selector is not None else None
    cache, state, memo, memo_ref = Cache(1, device), {}, {}, {}
    steps = SLOTS - PROMPT
    with torch.no_grad():
        q, geo = cache.call(PROMPT)
        _same(_select(kind, selector, cache, q, geo, state, memo), _select(kind, selector, cache, q, geo, None, memo_ref),
              "prefill")
        for t in range(steps):
            q, geo = cache.call(1)
            _same(_select(kind, selector, cache, q, geo, state, memo),
                  _select(kind, selector, cache, q, geo, None, memo_ref), f"step {t}")
    assert state["owner"][0] == sparse_k.selection.selection_state.state_kind(selector)


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_reads_only_the_new_key(kind, monkeypatch):
    """The scorer, the indexer keys and the page summaries see one key per row in a step."""
    selector = _setup(kind, monkeypatch)
    seen = []
    if kind.startswith("sparse_k"):
        forward = SparseKScorer.forward
        monkeypatch.setattr(SparseKScorer, "forward", lambda self, v, *a, **k: seen.append(v.shape[2]) or forward(self, v, *a, **k))
    elif kind.startswith("dsa"):
        index_keys = LightningIndexer.index_keys
        monkeypatch.setattr(LightningIndexer, "index_keys", lambda self, k: seen.append(k.shape[2]) or index_keys(self, k))
    else:
        summaries = selectors.page_summaries
        monkeypatch.setattr(selectors, "page_summaries", lambda key, *a, **k: seen.append(key.shape[2]) or summaries(key, *a, **k))
    cache, state, memo = Cache(2), {}, {}
    with torch.no_grad():
        _select(kind, selector, cache, *cache.call(PROMPT), state, memo)
        assert seen == [SLOTS]
        seen.clear()
        for _ in range(2 * _pattern(kind).query_block + 1):
            _select(kind, selector, cache, *cache.call(1), state, memo)
    assert seen == ([] if kind == "pages" else [1] * len(seen)) and (kind == "pages" or seen), seen


@pytest.mark.parametrize("kind", KINDS)
def test_the_step_reads_the_state(kind, monkeypatch):
    """Corrupting the stored per-key inputs changes a step's selection (the step does not recompute them)."""
    selector = _setup(kind, monkeypatch)
    cache, state, memo = Cache(3), {}, {}
    with torch.no_grad():
        _select(kind, selector, cache, *cache.call(SLOTS - 8), state, memo)
        clean = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
        q, geo = cache.call(1)
        want = _select(kind, selector, cache, q, geo, state, memo)
        for k, v in clean.items():
            state[k].copy_(v)
        # The prefix scan's step reads its block's stored selection S (the top-k stays fixed over a block).
        name = {"sparse_k": "u", "sparse_k_prefix_scan": "S", "sparse_k_refine": "u", "sparse_k_refine_prefix_scan": "S",
                "dsa": "ik", "dsa_per_kv_head": "ik", "pages": "kmax"}[kind]
        state[name].copy_(-state[name] if name != "S" else state[name].roll(1, -1))
        got = _select(kind, selector, cache, q, geo, state, memo)
    assert not torch.equal(got.indices, want.indices)


def test_the_prefix_scan_step_keeps_a_blocks_weights(monkeypatch):
    """SparseK weights are searched at a block's first step (and the first step after a full call) only: a later
    step of the block runs the operator with a budget of 0 in every row and reads ``state["W"]`` (corrupting it
    changes the step's weights); the next block's first step searches again and no longer reads it."""
    kind, bq = "sparse_k_prefix_scan", SPARSEK.query_block
    selector, cache, state, memo = _setup(kind, monkeypatch), Cache(4), {}, {}
    budgets = []
    sparsek = selectors.sparsek
    monkeypatch.setattr(selectors, "sparsek", lambda u, k, m=None: budgets.append(k) or sparsek(u, k, m))
    prompt = 9 * bq + 1  # past 2 * top_k + PREFIX_CHUNK candidates (the prefix scan); the next step is a block's second
    with torch.no_grad():
        _select(kind, selector, cache, *cache.call(prompt), state, memo)
        for step in range(2 * bq):
            budgets.clear()
            q, geo = cache.call(1)
            clean = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
            want = _select(kind, selector, cache, q, geo, state, None)
            (k,) = budgets
            inside = step > 0 and (prompt + step) % bq != 0  # row 0's positions (no padding)
            if step == 0:  # the first step after the prefill computes (W_ok was cleared)
                assert bool((k[0] == SPARSEK.top_k).all()), k
            elif inside:
                assert bool((k[0] == 0).all()), (step, k)
            for name, v in clean.items():
                state[name].copy_(v)
            state["W"].mul_(-1.0).sub_(1.0)
            got = _select(kind, selector, cache, q, geo, state, None)
            assert torch.equal(got.indices, want.indices)
            if step > 0 and inside:
                assert not torch.equal(got.weights[0], want.weights[0]), step
            elif step > 0:
                assert torch.equal(got.weights[0], want.weights[0]), step


@pytest.mark.parametrize("kind", ["dsa", "dsa_per_kv_head", "pages"])
def test_a_step_inside_a_block_returns_the_kept_selection(kind, monkeypatch):
    """DSA and training-free steps keep their block's selection (``state["sel"]``): corrupting it changes a step
    inside the block, not a block's first step (which selects afresh and overwrites it)."""
    selector, cache, state, memo = _setup(kind, monkeypatch), Cache(8), {}, {}
    bq = _pattern(kind).query_block
    checked = {True: 0, False: 0}
    with torch.no_grad():
        _select(kind, selector, cache, *cache.call(SLOTS - 4 * bq - 1), state, memo)
        _select(kind, selector, cache, *cache.call(1), state, memo)  # the first step after a full call selects
        for _ in range(2 * bq):
            q, geo = cache.call(1)
            clean = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
            memo_clean = {k: v.clone() for k, v in memo.items() if isinstance(v, torch.Tensor)}
            want = _select(kind, selector, cache, q, geo, state, memo)
            for k, v in clean.items():
                state[k].copy_(v)
            for k, v in memo_clean.items():
                memo[k].copy_(v)
            state["sel"].copy_(torch.where(state["sel"] >= 0, SLOTS - 1 - state["sel"], -1))
            got = _select(kind, selector, cache, q, geo, state, memo)
            start = bool(sparse_k.selection.selection_state.block_start(_pattern(kind), geo, B)[0])
            assert torch.equal(got.indices[0], want.indices[0]) == start, (start, got.indices[0], want.indices[0])
            checked[start] += 1
    assert checked[True] and checked[False], checked


def test_an_eager_call_does_not_trust_a_state_of_another_cache_or_selector(monkeypatch):
    """The state dict of one cache, then a decode step over another cache (same shapes) or with another selector:
    the eager step recomputes from every key (equal to the full selection) and takes the state over."""
    monkeypatch.setattr(selectors, "PREFIX_CHUNK", 8)
    kind = "sparse_k_prefix_scan"
    selector, state = _selector(kind), {}
    first, other = Cache(4), Cache(5)
    with torch.no_grad():
        _select(kind, selector, first, *first.call(SLOTS - 10), state, {})
        other.written = SLOTS - 11
        q, geo = other.call(1)
        _same(_select(kind, selector, other, q, geo, state, {}), _select(kind, selector, other, q, geo, None, {}),
              "another cache")
        assert state["owner"][1] == other.k.data_ptr()
        torch.manual_seed(9)
        fresh = SparseKScorer(HKV, D)
        q, geo = other.call(1)
        _same(_select(kind, fresh, other, q, geo, state, {}), _select(kind, fresh, other, q, geo, None, {}),
              "another selector")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_generation_restarted_at_slot_zero_on_the_same_cache(kind, device, monkeypatch):
    """A one-token prompt on a reused cache (the state matches its owner, so it steps): the prefix list restarts
    empty, pages restart at their first key, and every step equals the full selection."""
    selector = _setup(kind, monkeypatch, device)
    device = "cpu" if device == "cpu_device_offsets" else device
    state, memo, memo_ref, cache = {}, {}, {}, Cache(6, device)
    selector = selector.to(device) if selector is not None else None
    with torch.no_grad():
        _select(kind, selector, cache, *cache.call(SLOTS - 20), state, memo)
        cache.written = 0
        fresh = Cache(7, device)
        for name in ("k", "v", "q"):  # new content, same tensors
            getattr(cache, name).copy_(getattr(fresh, name))
        for t in range(SLOTS - 20):
            q, geo = cache.call(1)
            _same(_select(kind, selector, cache, q, geo, state, memo), _select(kind, selector, cache, q, geo, None, memo_ref),
                  f"step {t}")


#: (PREFIX_CHUNK, pattern): query blocks smaller than, equal to (one top-M merge a step instead of insertions) and
#: not dividing the chunk (2 and 3 insertions a step), windows smaller and larger than a block and a chunk, no sinks;
#: every one in the prefix-scan regime (more than 2 top_k + chunk candidates).
PREFIX_CASES = [
    (8, sparse_k.SparseK(sinks=2, window=5, top_k=6, query_block=4)),
    (8, sparse_k.SparseK(sinks=1, window=3, top_k=5, query_block=8)),
    (8, sparse_k.SparseK(sinks=0, window=1, top_k=3, query_block=3)),
    (16, sparse_k.SparseK(sinks=3, window=21, top_k=4, query_block=5)),
    (12, sparse_k.SparseK(sinks=2, window=7, top_k=9, query_block=7)),
    (8, sparse_k.SparseK(sinks=2, window=2, top_k=4, query_block=6)),
]


@pytest.mark.parametrize("prompt", [1, 13, 30, 41])
@pytest.mark.parametrize("case", range(len(PREFIX_CASES)))
def test_stepped_prefix_lists_equal_the_prefix_scan_at_every_step(case, prompt, monkeypatch):
    """SparseK with the prefix scan: every step from a prompt of ``prompt`` keys to the end of the cache (across
    block and chunk boundaries, both rows: one left-padded) gives the layout of the full recomputation exactly
    (indices, counts and weights: the step's SparseK runs on the same entries), and the block's selection S, once
    stored, stays fixed over the block."""
    chunk, pattern = PREFIX_CASES[case]
    monkeypatch.setattr(selectors, "PREFIX_CHUNK", chunk)
    selector, cache, state = _selector("sparse_k"), Cache(10 + case), {}

    def select(q, geo, st):
        return build_selection(pattern, q, cache.k, cache.v, geo, layer_idx=0, selector=selector, state=st)

    stepped = 0
    with torch.no_grad():
        select(*cache.call(prompt), state)
        first_chunk = state["chunk"].clone()
        while cache.written < SLOTS:
            q, geo = cache.call(1)
            got, want = select(q, geo, state), select(q, geo, None)
            assert (got is None) == (want is None)
            if got is None:
                continue
            where = f"slot {cache.written - 1}"
            assert torch.equal(got.counts, want.counts) and torch.equal(got.indices, want.indices), where
            assert torch.equal(got.weights, want.weights), where
            pos = (cache.written - 1) - torch.tensor([0, PAD])
            inside = pos % pattern.query_block != 0
            if stepped and inside.any():
                assert torch.equal(state["S"][inside], before[inside]), where
            before, stepped = state["S"].clone(), stepped + 1
    assert stepped > 0 and bool((state["chunk"] - first_chunk >= 2).all())  # the steps crossed two chunk advances


class _CountSelectionOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ``topk``, ``sort`` and ``kthvalue`` calls outside the SparseK operator (whose PyTorch path sorts; on a
    GPU it is one Triton kernel)."""

    def __init__(self):
        super().__init__()
        self.counts, self.paused = {}, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name in ("topk", "sort", "kthvalue"):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["sparse_k_prefix_scan", "dsa"])
def test_a_decode_step_runs_no_sort_and_no_top_k_for_the_prefix_scan(kind, monkeypatch):
    """Op counts of one decode step, with the CUDA top-k path (``top_indices(fused=True)``) forced on the CPU:
    the SparseK prefix-scan step runs no top-k and no sort (it kept two of each before the stepped lists), a DSA step
    one unsorted top-k over its indexer scores and no sort (a top-k and a sort before), or none where the selection's
    Triton kernels run (``page_selection.row_kernels``: under ``TRITON_INTERPRET=1``)."""
    selector = _setup(kind, monkeypatch)
    top_indices = sparse_k.selection.page_selection.top_indices
    monkeypatch.setattr(selectors, "_top_indices", lambda x, K, fused=None: top_indices(x, K, fused=True))
    counter, cache, state = _CountSelectionOps(), Cache(20), {}
    inner = selectors.sparsek

    def sparsek_uncounted(*a, **k):
        counter.paused = True
        try:
            return inner(*a, **k)
        finally:
            counter.paused = False

    monkeypatch.setattr(selectors, "sparsek", sparsek_uncounted)
    with torch.no_grad():
        _select(kind, selector, cache, *cache.call(SLOTS - 20), state, {})
        for _ in range(5):
            _select(kind, selector, cache, *cache.call(1), state, {})
        with counter:
            lay = _select(kind, selector, cache, *cache.call(1), state, {})
    assert lay is not None and lay.counts.max() > 0
    kernels = sparse_k.selection.page_selection.row_kernels(cache.k) is not None
    assert counter.counts == ({} if kind == "sparse_k_prefix_scan" or kernels else {"topk": 1}), counter.counts
