"""The selection's Triton kernels (``sparse_k.selection.select_triton``) and the decode steps that skip them.

Without CUDA the kernels run under Triton's interpreter (``tests/triton_interp.py``; where triton was imported
before this module could set ``TRITON_INTERPRET=1``, ``test_interpreter_suite_in_subprocess`` runs this file in a
fresh interpreter). Every kernel output is poisoned before the launch (a sentinel), so an entry a kernel does not
write fails the comparison, and a row whose flag is off must still hold the sentinel.

* ``topk_rows`` equals the PyTorch selection (``front_pack(top_mask(...) & valid)``) exactly: ties (small integer
  scores), ``-inf``, ``-0.0``, ``k`` above the valid count, odd lengths, with and without a mask.
* ``page_bound_scores`` / ``index_scores`` / ``refine_scores`` / ``refine_page_scores`` against ``quest_scores`` /
  ``LightningIndexer.scores`` / ``refine_probabilities``: the error against a float64 reference is at most twice
  PyTorch's own float32 error plus a rounding floor (the refinements: GQA, odd sizes, keys split over programs, half
  precision keys and a strided view; the page refinement's slots mapped to ``expand_pages``' packed keys).
* ``build_selection`` through the kernels selects what the PyTorch path selects (training-free pages, with and
  without refinement, per query and per block; a trained SparseK pool refined; DSA shared and per KV head); over many static-cache decode steps (device-known and host-known offsets) a step equals the full
  selection of the same call, and the steps inside a query block launch the kernels with every row's flag off.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_interp import ON_GPU, KERNEL_TEST, import_kernels, run_file_interpreted

HAVE_TRITON, IN_PROCESS, _kernels = import_kernels("selection.select_triton")
if HAVE_TRITON:
    (st,) = _kernels

import sparse_k  # noqa: E402
from sparse_k.layouts.geometry import RowGeometry  # noqa: E402
from sparse_k.selection import page_selection  # noqa: E402
from sparse_k.selection.page_selection import front_pack, page_summaries, quest_scores, refine_probabilities, top_mask  # noqa: E402
from sparse_k.selection.scorers import LightningIndexer, SparseKScorer  # noqa: E402
from sparse_k.selection.selectors import build_selection  # noqa: E402

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")

_N_KERNEL_TESTS = 49  # tests below marked KERNEL_TEST, parametrisations included
DEV = "cuda" if ON_GPU else "cpu"
SENTINEL = -7


@pytest.mark.skipif(IN_PROCESS, reason="the kernels run in this process")
def test_interpreter_suite_in_subprocess():
    run_file_interpreted(__file__, _N_KERNEL_TESTS, "-k", "not gpu", timeout=900)


@pytest.fixture(autouse=True)
def _interpret_and_poison(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    if HAVE_TRITON:
        monkeypatch.setattr(st, "_empty", lambda shape, dtype, device: torch.full(shape, SENTINEL, dtype=dtype, device=device))


def _reference_topk(x, k, mask=None):
    """The PyTorch selection the kernel must equal: ``(..., k)`` int64, ascending, -1 after."""
    valid = mask.expand(x.shape) if mask is not None else x > float("-inf")
    xm = torch.where(valid, x.float(), torch.full((), float("-inf"), device=x.device))
    return front_pack(top_mask(xm, k) & valid, k, torch.arange(x.shape[-1], device=x.device).expand(x.shape), -1)


def _rows(n, seed):
    """Five rows of length ``n``: small-integer ties, ties with -inf holes, distinct values, signed zeros, all -inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (5, n), generator=g).float()
    x[1, ::3] = float("-inf")
    x[2] = torch.randn(n, generator=g)
    x[3] = torch.where(torch.rand(n, generator=g) > 0.5, -0.0, 0.0)
    x[4] = float("-inf")
    return x.to(DEV), (torch.rand(5, n, generator=g) > 0.4).to(DEV)


@KERNEL_TEST
@pytest.mark.parametrize("n", [1, 7, 33, 1000, 4097])
def test_topk_rows_equals_the_torch_selection(n):
    """The default launch, and for a row longer than ``TOPK_ONE_CHUNK_MAX`` the whole row in one chunk too."""
    x, mask = _rows(n, n)
    whole = max(16, 1 << (n - 1).bit_length())
    for k in sorted({0, 1, 5, n // 2, n - 1, n, n + 3} - {-1}):
        assert torch.equal(st.topk_rows(x, k).long(), _reference_topk(x, k)), (n, k)
        assert torch.equal(st.topk_rows(x, k, mask).long(), _reference_topk(x, k, mask)), (n, k)
        if n > st.TOPK_ONE_CHUNK_MAX:
            assert torch.equal(st.topk_rows(x, k, mask, block=whole).long(), _reference_topk(x, k, mask)), (n, k)


@KERNEL_TEST
def test_topk_rows_small_chunks_and_half_precision():
    """Chunks smaller than the row (the radix passes and the compaction carry counts across chunks) and float16 input."""
    x, mask = _rows(301, 1)
    for k in (1, 17, 100, 301):
        assert torch.equal(st.topk_rows(x, k, mask, block=16).long(), _reference_topk(x, k, mask)), k
    h = x.half()
    assert torch.equal(st.topk_rows(h, 40).long(), _reference_topk(h.float(), 40))


@KERNEL_TEST
def test_topk_rows_skips_rows_whose_flag_is_off():
    x, mask = _rows(257, 2)
    flag = torch.tensor([True, False, True, False, False], device=DEV)
    got = st.topk_rows(x, 9, mask, flag)
    assert bool((got[~flag] == SENTINEL).all())
    assert torch.equal(got[flag].long(), _reference_topk(x, 9, mask)[flag])


@KERNEL_TEST
@pytest.mark.parametrize("block", [16, None])
def test_topk_rows_with_lengths_reads_only_each_rows_head(block):
    """``lengths`` cuts every row short: the selection of the row's head alone, whatever lies past it (here NaN,
    which no comparison would survive); a causal row (``-inf`` past its length) selects what the whole row does.
    ``block=16`` carries the counts across chunks, the default reads each row at once."""
    x, mask = _rows(301, 5)
    lengths = torch.tensor([0, 1, 150, 301, 77], device=DEV)
    poisoned = x.clone()
    for r, n in enumerate(lengths.tolist()):
        poisoned[r, n:] = float("nan")
    for k in (1, 17, 100, 301):
        want = torch.stack([_reference_topk(x[r:r + 1, :n], k, mask[r:r + 1, :n])[0] if n else
                            torch.full((k,), -1, device=DEV) for r, n in enumerate(lengths.tolist())])
        got = st.topk_rows(poisoned, k, mask, lengths=lengths, block=block).long()
        assert torch.equal(got, want), k
        causal = torch.where(torch.arange(301, device=DEV) < lengths[:, None], x, float("-inf"))
        assert torch.equal(st.topk_rows(causal, k, lengths=lengths[:, None, None].view(5), block=block).long(),
                           _reference_topk(causal, k)), k


@KERNEL_TEST
def test_topk_rows_rejects_bad_arguments():
    x = torch.zeros(2, 8, device=DEV)
    with pytest.raises(ValueError, match="`k`"):
        st.topk_rows(x, -1)
    with pytest.raises(ValueError, match="`mask`"):
        st.topk_rows(x, 2, torch.ones(3, 8, dtype=torch.bool, device=DEV))
    with pytest.raises(ValueError, match="`flag`"):
        st.topk_rows(x, 2, flag=torch.ones(2, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="`x`"):
        st.topk_rows(x.double(), 2)
    with pytest.raises(ValueError, match="`lengths`"):
        st.topk_rows(x, 2, lengths=torch.ones(2, device=DEV))
    with pytest.raises(ValueError, match="`lengths`"):
        st.topk_rows(x, 2, lengths=torch.ones(3, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="`block`"):
        st.topk_rows(x, 2, block=2 * st.TOPK_BLOCK_MAX)


def _pages(B, H, C, G, D, P, page, seed):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(B, H, P * page - 3, D, generator=g)
    kmin, kmax, ok = page_summaries(key, torch.zeros(B, dtype=torch.long), torch.tensor([P * page - 3, 50])[:B], page,
                                    1, P)
    q = torch.randn(B, H, C, G, D, generator=g)
    last = torch.tensor([[5, 20, P - 1], [-1, 3, P - 1]])[:B, :C]
    return (t.to(DEV) for t in (q, kmin, kmax, ok, last))


def _within_float32_error(got, want32, want64, where):
    """``|got - want64| <= 2 |want32 - want64|max + floor`` (float32 rounding of sums of a few dozen products)."""
    fin = torch.isfinite(want64)
    assert torch.equal(torch.isfinite(got), fin), where
    err = (got.double() - want64)[fin].abs().max()
    ref_err = (want32.double() - want64)[fin].abs().max()
    floor = 1e-6 * want64[fin].abs().max().clamp_min(1.0)
    assert err <= 2 * ref_err + floor, (where, float(err), float(ref_err))


@KERNEL_TEST
@pytest.mark.parametrize("page, dtype, strided", [(16, torch.float32, False), (4, torch.float16, True),
                                                  (8, torch.bfloat16, True), (3, torch.float32, True)])
def test_page_summaries_kernel_equals_the_torch_summaries(page, dtype, strided, monkeypatch):
    """Exact (a min and a max): rows with their own valid ranges (left padding, a short row), sinks, a last partial
    page, pages past the keys, odd D; half-precision keys and a strided view (Transformers' transposed layout)."""
    g = torch.Generator().manual_seed(11)
    B, H, S, D = 2, 3, 83, 24
    key = torch.randn(B, S, H, D, generator=g).to(dtype)
    key = key.transpose(1, 2) if strided else key.transpose(1, 2).contiguous()
    n_pages = -(-S // page) + 2
    key = key.to(DEV)
    for k_start, k_end in ((torch.tensor([0, 5]), torch.tensor([83, 61])), (torch.tensor([3]), torch.tensor([83, 61])),
                           (torch.tensor([0, 5]), torch.tensor([70]))):  # per row, or one for every row
        k_start, k_end = k_start.to(DEV), k_end.to(DEV)
        got = st.page_summaries(key, k_start, k_end, page, 2, n_pages)
        with monkeypatch.context() as m:
            m.setattr(page_selection, "TRITON_SELECTION", False)
            want = page_summaries(key, k_start.expand(B), k_end.expand(B), page, 2, n_pages)
        for name, a, b in zip(("kmin", "kmax", "ok"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b), (name, k_start, k_end)


def _page_lists(B, H, C, n, P, seed):
    """Ascending page ids per block (some rows shorter: -1 after), ``(B, H, C, n)`` int32."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.stack([torch.randperm(P, generator=g)[:n] for _ in range(B * H * C)]).view(B, H, C, n)
    pages = pages.sort(-1).values
    short = torch.rand(B, H, C, 1, generator=g) < 0.3
    pages = torch.where(short & (torch.arange(n) >= n // 2), torch.full_like(pages, P + 1), pages).sort(-1).values
    return torch.where(pages > P, -1, pages).to(torch.int32)


@KERNEL_TEST
@pytest.mark.parametrize("page, n, top_k, width", [(16, 4, 64, 64), (4, 5, 20, 24), (8, 3, 24, 29)])
def test_page_layout_equals_expand_pages(page, n, top_k, width):
    """``page_layout`` equals ``expand_pages`` + ``_finish_chunk`` exactly: blocks that take all their candidates
    (at most ``top_k`` of them), blocks outside the call, pages cut by the sinks, the candidate range's end and the row's keys, a
    row with its own ``k_start``, short page lists."""
    from sparse_k.selection.page_selection import _finish_chunk, expand_pages

    B, H, C, P = 2, 3, 7, 12
    pages = _page_lists(B, H, C, n, P, seed=page)
    hi = torch.tensor([[3, 30, 60, 95, 120, 150, 190], [190, 100, 70, 45, 22, 10, 0]])
    lo = torch.full_like(hi, 2)
    hi[0, 1] = lo[0, 1] + top_k - 1  # exactly top_k candidates: all of them
    block_ok = torch.tensor([[True] * 7, [True, True, True, False, True, True, True]])
    n_keys = torch.tensor([180, 150])
    for k_start in (torch.tensor([0, 9]), torch.tensor([4])):  # per row; one for every row (a geometry without a mask)
        dev = [t.to(DEV) for t in (pages, lo, hi, block_ok, n_keys, k_start)]
        idx, cnt = st.page_layout(dev[0], page, *dev[1:4], dev[4], dev[5], top_k, width)
        want_pos, want_cnt = expand_pages(pages.long(), pages >= 0, page, lo, hi, n_keys, width)
        want_idx = torch.empty(B, H, C, width, dtype=torch.int32)
        want_counts = torch.empty(B, H, C, dtype=torch.int32)
        _finish_chunk(want_idx, want_counts, want_pos, want_cnt, lo, hi, block_ok, n_keys, k_start.expand(B), top_k)
        assert torch.equal(cnt.cpu(), want_counts)
        assert torch.equal(idx.cpu(), want_idx), k_start
        assert (want_counts <= top_k).all() and (want_counts > 0).any() and (want_counts == 0).any()


@KERNEL_TEST
@pytest.mark.parametrize("page, n, k, width", [(16, 6, 40, 40), (4, 5, 7, 12)])
def test_page_layout_of_refined_slots(page, n, k, width):
    """With ``slots`` (the refinement's chosen page slots, ascending, -1 after) ``page_layout`` gives the keys at those
    slots, as the PyTorch form does (gather the slot's page, then ``_finish_chunk``); blocks with few candidates take
    all of them."""
    from sparse_k.selection.page_selection import _finish_chunk

    B, H, C, P = 2, 3, 5, 14
    pages = _page_lists(B, H, C, n, P, seed=page + 1)
    g = torch.Generator().manual_seed(page)
    listed = (pages >= 0).sum(-1, keepdim=True) * page
    keys = torch.where(torch.arange(n * page) < listed, torch.rand(B, H, C, n * page, generator=g), -1.0)
    top = keys.topk(k, -1).indices.sort(-1).values
    slots = torch.where(keys.gather(-1, top) >= 0, top, n * page).sort(-1).values
    slots = torch.where(slots < n * page, slots, -1).to(torch.int32)
    hi = torch.tensor([[300, 9, 250, 200, 150], [120, 300, 280, 30, 260]])
    lo = torch.full_like(hi, 2)
    hi[0, 1] = lo[0, 1] + k - 2  # k - 1 candidates: all of them
    block_ok = torch.ones(B, C, dtype=torch.bool)
    n_keys, k_start = torch.tensor([290, 250]), torch.tensor([0, 6])
    dev = [t.to(DEV) for t in (pages, slots, lo, hi, block_ok, n_keys, k_start)]
    idx, cnt = st.page_layout(dev[0], page, *dev[2:5], dev[5], dev[6], k, width, slots=dev[1])
    at = slots.long()
    pos = pages.long().gather(-1, at.clamp_min(0) // page) * page + at.clamp_min(0) % page
    pos = torch.nn.functional.pad(torch.where(at >= 0, pos, -1), (0, max(0, width - k)), value=-1)[..., :width]
    want_idx = torch.empty(B, H, C, width, dtype=torch.int32)
    want_counts = torch.empty(B, H, C, dtype=torch.int32)
    _finish_chunk(want_idx, want_counts, pos, (at >= 0).sum(-1).clamp_max(width), lo, hi, block_ok, n_keys, k_start, k)
    assert torch.equal(cnt.cpu(), want_counts)
    assert torch.equal(idx.cpu(), want_idx)
    assert (want_counts < k).any() and (want_counts == min(k, width)).any()


def test_page_summaries_and_page_layout_reject_bad_arguments():
    key = torch.zeros(1, 2, 8, 4)
    r = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="`key` must be"):
        st.page_summaries(key.double(), r, r, 4, 0, 2)
    with pytest.raises(ValueError, match="`k_end` must be"):
        st.page_summaries(key, r, r.int(), 4, 0, 2)
    with pytest.raises(ValueError, match="`page` must be an int >= 1"):
        st.page_summaries(key, r, r, 0, 0, 2)
    pages = torch.zeros(1, 2, 3, 4, dtype=torch.int32)
    lo = torch.zeros(1, 3, dtype=torch.long)
    ok = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="`page` must be a power of two"):
        st.page_layout(pages, 6, lo, lo, ok, r, r, 8, 8)
    with pytest.raises(ValueError, match="`hi` must have shape"):
        st.page_layout(pages, 4, lo, lo[:, :2], ok, r, r, 8, 8)
    with pytest.raises(ValueError, match="`block_ok` bool"):
        st.page_layout(pages, 4, lo, lo, ok.long(), r, r, 8, 8)
    with pytest.raises(ValueError, match="`width` must be an int >= 0"):
        st.page_layout(pages, 4, lo, lo, ok, r, r, 8, -1)
    with pytest.raises(ValueError, match="`slots` must be a"):
        st.page_layout(pages, 4, lo, lo, ok, r, r, 8, 8, slots=pages[:, :1])


@KERNEL_TEST
@pytest.mark.parametrize("programs, late", [(2048, False), (1, False), (1, True)])
def test_page_bound_scores_match_quest_scores_and_skip_flagged_rows(programs, late, monkeypatch):
    """One page tile a program, or a run of them (``PAGE_BOUND_PROGRAMS = 1``); with ``late`` False no block reaches
    the last page tile, which is written -inf without a read."""
    monkeypatch.setattr(st, "PAGE_BOUND_PROGRAMS", programs)
    q, kmin, kmax, ok, last = _pages(2, 2, 3, 4, 16, 37, 4, 0)
    if not late:
        last = last.clamp_max(20)
    P = kmin.shape[2]
    cand = ok[:, :, None, :] & (torch.arange(P, device=DEV) <= last[:, None, :, None])
    neg = float("-inf")
    want32 = torch.where(cand, quest_scores(q, kmin, kmax, ok), neg)
    want64 = torch.where(cand, quest_scores(q.double(), kmin.double(), kmax.double(), ok), neg)
    _within_float32_error(st.page_bound_scores(q, kmin, kmax, ok, last, block_p=16), want32, want64, "all rows")
    flag = torch.tensor([[True, False, True], [False, True, False]], device=DEV)[:, None].expand(2, 2, 3)
    got = st.page_bound_scores(q, kmin, kmax, ok, last, flag)
    assert bool((got[~flag] == SENTINEL).all())
    _within_float32_error(got[flag], want32[flag], want64[flag], "flagged rows")


@KERNEL_TEST
@pytest.mark.parametrize("per_kv_head", [False, True])
def test_index_scores_match_the_indexer_and_skip_flagged_rows(per_kv_head):
    torch.manual_seed(3)
    ix = LightningIndexer(4, 2, 16, indexer_heads=2, indexer_dim=8, per_kv_head=per_kv_head)
    with torch.no_grad():
        qi, w = ix.index_queries(torch.randn(2, 4, 3, 16))
        ik = ix.index_keys(torch.randn(2, 2, 29, 16))
        cand = torch.rand(2, 3, 29) > 0.3
        G = 2 if per_kv_head else 1

        def ref(dtype):
            sc = ix.double().scores(qi.double(), w.double(), ik.double()) if dtype == torch.float64 else ix.float().scores(qi, w, ik)
            sc = sc if sc.dim() == 4 else sc[:, :, None]
            return torch.where(cand[:, :, None], sc, float("-inf"))

        want32, want64 = ref(torch.float32), ref(torch.float64)
        args = [t.to(DEV) for t in (qi, w, ik, cand)]
        _within_float32_error(st.index_scores(*args, G, block_s=16).cpu(), want32, want64, "all rows")
        flag = torch.tensor([[True, False, True], [False, False, True]], device=DEV)[:, :, None].expand(2, 3, G)
        got = st.index_scores(*args, G, flag).cpu()
        f = flag.cpu()
        assert bool((got[~f] == SENTINEL).all())
        _within_float32_error(got[f], want32[f], want64[f], "flagged rows")


def _refine_inputs(B, H, C, G, D, S, W, Ws, seed):
    """Block queries, keys and, per block, distinct preselected and static keys (as the selection passes them: a key
    is in at most one list), with holes; keys ``(B, H, S, D)`` float32."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, C, G, D, generator=g) * 2
    key = torch.randn(B, H, S, D, generator=g)
    perm = torch.stack([torch.randperm(S, generator=g) for _ in range(B * C)]).view(B, 1, C, S)
    idx = perm[..., :W].expand(B, H, C, W).clone()
    idx[:, 1:] = perm[..., W + Ws:2 * W + Ws].expand(B, H - 1, C, W)  # another KV head, other keys
    ok = torch.rand(B, H, C, W, generator=g) > 0.3
    ok[0, 0, 0] = False  # a row without a preselected key
    sidx, sok = perm[..., W:W + Ws], torch.rand(B, 1, C, Ws, generator=g) > 0.2
    return q, key, idx, ok, sidx, sok


@KERNEL_TEST
@pytest.mark.parametrize("split,static_norm", [(512, False), (16, False), (16, True)])  # one program per row, or 3
def test_refine_scores_match_the_refinement_and_skip_flagged_rows(split, static_norm, monkeypatch):
    """``refine_scores`` equals ``refine_probabilities`` (either normaliser: the static keys and the preselected ones,
    or the static keys alone) on float32, strided and bfloat16 keys; rows off the flag stay unwritten."""
    monkeypatch.setattr(page_selection, "TRITON_SELECTION", False)  # the references: PyTorch
    monkeypatch.setattr(st, "REFINE_SPLIT", split)
    B, H, C, G, D, S, W, Ws = 2, 2, 3, 3, 24, 101, 37, 9
    q, key, idx, ok, sidx, sok = _refine_inputs(B, H, C, G, D, S, W, Ws, seed=int(torch.randint(0, 10**6, ())))
    norm = dict(static_norm=static_norm)
    want64 = refine_probabilities(q.double(), key.double(), idx, ok, sidx, sok, **norm)
    want32 = refine_probabilities(q, key, idx, ok, sidx, sok, **norm)
    args = [t.to(DEV) for t in (q, key, idx, ok, sidx, sok)]
    got = st.refine_scores(*args, block_n=16, **norm).cpu()
    assert bool((got[0, 0, 0] == 0).all()) and bool((got[~ok] == 0).all())
    _within_float32_error(got, want32, want64, "float32 keys")
    strided = args[1].transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, S, D) view of a (B, S, H, D) tensor
    _within_float32_error(st.refine_scores(args[0], strided, *args[2:], **norm).cpu(), want32, want64, "strided keys")
    k16 = key.to(torch.bfloat16)
    want16 = refine_probabilities(q.double(), k16.double(), idx, ok, sidx, sok, **norm)
    _within_float32_error(st.refine_scores(args[0], k16.to(DEV), *args[2:], **norm).cpu(),
                          refine_probabilities(q, k16.float(), idx, ok, sidx, sok, **norm), want16, "bfloat16 keys")
    flag = torch.tensor([[True, False, True], [False, True, True]], device=DEV)[:, None].expand(B, H, C)
    got = st.refine_scores(*args, flag=flag, **norm).cpu()
    f = flag.cpu()
    assert bool((got[~f] == SENTINEL).all())
    _within_float32_error(got[f], want32[f], want64[f], "flagged rows")
    if static_norm:  # the two normalisers differ (the test would not see a kernel that ignores the flag)
        assert not torch.allclose(want64, refine_probabilities(q.double(), key.double(), idx, ok, sidx, sok))


def _page_refine_inputs(B, H, C, G, D, S, page, sinks, window, n_sel, seed):
    """Block queries, keys, block starts (row 1 left-padded by 3 slots) and per block ``n_sel`` distinct candidate pages
    (ascending, ``-1`` after: blocks with fewer candidates), as ``_kernel_pages`` passes them."""
    g = torch.Generator().manual_seed(seed)
    q, key = torch.randn(B, H, C, G, D, generator=g) * 2, torch.randn(B, H, S, D, generator=g)
    k_start, n_keys = torch.tensor([0, 3])[:B], torch.tensor([S, S - 3])[:B]
    bs = torch.stack([torch.randint(0, int(n), (C,), generator=g) for n in n_keys])
    last = torch.div(bs - window + 1, page, rounding_mode="floor") - 1
    P = -(-S // page)
    score = torch.where(torch.arange(P) <= last[:, None, :, None], torch.rand(B, H, C, P, generator=g), -1.0)
    top = torch.topk(score, min(n_sel, P), -1)
    pages = torch.sort(torch.where(top.values >= 0, top.indices, P), -1).values
    return q, key, torch.where(pages >= P, -1, pages), bs, n_keys, k_start


def _page_refine_reference(q, key, pages, page, bs, n_keys, k_start, sinks, window, dtype, static_norm=False):
    """``refine_probabilities`` of ``expand_pages``' packed keys in ``dtype``, and the slot of each packed key."""
    hi = bs - window
    W = pages.shape[-1] * page
    pos, _ = page_selection.expand_pages(pages.clamp_min(0), pages >= 0, page, torch.full_like(bs, sinks), hi, n_keys, W)
    spos, sok = page_selection.static_positions(bs, hi, n_keys, sinks, window)
    ks = k_start.view(-1, 1, 1, 1)
    want = refine_probabilities(q.to(dtype), key.to(dtype), pos.clamp_min(0) + ks, pos >= 0, spos[:, None].clamp_min(0) + ks,
                                sok[:, None], static_norm=static_norm)
    slot_pos = (pages.clamp_min(0)[..., None] * page + torch.arange(page)).flatten(-2)
    slot_ok = (pages >= 0).repeat_interleave(page, -1) & (slot_pos >= sinks) & (slot_pos <= hi[:, None, :, None]) \
        & (slot_pos < n_keys[:, None, None, None])
    return want, slot_ok


def _packed(got, slot_ok):
    """The slot-order scores at the valid slots, packed to the front like ``expand_pages``' keys (zeros after)."""
    dest = torch.where(slot_ok, slot_ok.long().cumsum(-1) - 1, slot_ok.shape[-1])
    out = torch.zeros(*got.shape[:-1], got.shape[-1] + 1, dtype=got.dtype)
    return out.scatter(-1, dest, torch.where(slot_ok, got, 0.0))[..., :-1]


@KERNEL_TEST
@pytest.mark.parametrize("split, page, G, D, static_norm", [(4096, 16, 3, 24, False), (64, 16, 4, 32, False),
                                                            (64, 8, 1, 24, False), (128, 64, 2, 16, False),
                                                            (64, 16, 3, 24, True)])
def test_refine_page_scores_match_the_refinement_and_skip_flagged_rows(split, page, G, D, static_norm, monkeypatch):
    """Page-slot scores equal ``refine_probabilities`` of the packed keys (GQA, odd sizes, keys split over programs,
    left padding, blocks before the sinks end, blocks with fewer pages; head dimensions below and at the kernel's
    power of two; either normaliser), -inf at every other slot; float16 products; a strided key view; rows off the
    flag stay unwritten."""
    monkeypatch.setattr(page_selection, "TRITON_SELECTION", False)  # the references: PyTorch
    monkeypatch.setattr(st, "PAGE_REFINE_SPLIT", split)
    B, H, C, S, sinks, window = 2, 2, 37, 203, 5, 20
    q, key, pages, bs, n_keys, k_start = _page_refine_inputs(B, H, C, G, D, S, page, sinks, window, 5,
                                                             seed=int(torch.randint(0, 10**6, ())))
    bs[0, :2] = torch.tensor([1, 3])  # blocks before the sinks end (no pool)
    want64, slot_ok = _page_refine_reference(q, key, pages, page, bs, n_keys, k_start, sinks, window, torch.float64,
                                             static_norm)
    want32, _ = _page_refine_reference(q, key, pages, page, bs, n_keys, k_start, sinks, window, torch.float32,
                                       static_norm)
    assert bool((pages < 0).any()) and bool(slot_ok.any())
    if static_norm:  # the two normalisers differ here
        full, _ = _page_refine_reference(q, key, pages, page, bs, n_keys, k_start, sinks, window, torch.float64)
        assert not torch.allclose(_packed(want64, slot_ok), _packed(full, slot_ok))
    run = lambda qq, kk, flag=None: st.refine_page_scores(qq.to(DEV), kk.to(DEV), pages.to(DEV), page, bs.to(DEV),  # noqa: E731
                                                         n_keys.to(DEV), k_start.to(DEV), sinks, window, flag,
                                                         static_norm=static_norm).cpu()
    got = run(q, key)
    assert bool((got[~slot_ok] == float("-inf")).all())
    _within_float32_error(_packed(got, slot_ok), want32, want64, "float32")
    strided = key.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, S, D) view of a (B, S, H, D) tensor
    _within_float32_error(_packed(run(q, strided), slot_ok), want32, want64, "strided keys")
    q16, k16 = q.half(), key.half()
    w16, _ = _page_refine_reference(q16.double(), k16.double(), pages, page, bs, n_keys, k_start, sinks, window,
                                    torch.float64, static_norm)
    w16_32, _ = _page_refine_reference(q16.float(), k16.float(), pages, page, bs, n_keys, k_start, sinks, window,
                                       torch.float32, static_norm)
    _within_float32_error(_packed(run(q16, k16), slot_ok), w16_32, w16, "float16 products")
    flag = (torch.arange(C) % 3 != 1).view(1, 1, C).expand(B, H, C).clone()
    flag[1, 0] = False
    got = run(q, key, flag.to(DEV))
    assert bool((got[~flag] == SENTINEL).all())
    _within_float32_error(_packed(got, slot_ok)[flag], want32[flag], want64[flag], "flagged rows")


@KERNEL_TEST
def test_refine_page_scores_rejects_bad_arguments():
    q, key, pages, bs, n_keys, k_start = (t.to(DEV) for t in _page_refine_inputs(1, 2, 3, 2, 16, 64, 8, 2, 4, 2, seed=0))
    ok = dict(page=8, block_start=bs, n_keys=n_keys, k_start=k_start, sinks=2, window=4)
    with pytest.raises(ValueError, match="`pages`"):
        st.refine_page_scores(q, key, pages.float(), **ok)
    with pytest.raises(ValueError, match="`page`"):
        st.refine_page_scores(q, key, pages, **{**ok, "page": 12})
    with pytest.raises(ValueError, match="`block_start`"):
        st.refine_page_scores(q, key, pages, **{**ok, "block_start": bs.int()})
    with pytest.raises(ValueError, match="`window`"):
        st.refine_page_scores(q, key, pages, **{**ok, "window": -1})
    with pytest.raises(ValueError, match="`key`"):
        st.refine_page_scores(q, key.double(), pages, **ok)
    with pytest.raises(TypeError, match="`static_norm` must be a bool"):
        st.refine_page_scores(q, key, pages, **ok, static_norm=1)


@KERNEL_TEST
def test_refine_scores_rejects_bad_arguments():
    q, key, idx, ok, sidx, sok = (t.to(DEV) for t in _refine_inputs(1, 2, 2, 2, 16, 40, 8, 4, seed=0))
    with pytest.raises(ValueError, match="`idx`"):
        st.refine_scores(q, key, idx.float(), ok, sidx, sok)
    with pytest.raises(ValueError, match="`sok`"):
        st.refine_scores(q, key, idx, ok, sidx, sok.int())
    with pytest.raises(TypeError, match="`static_norm` must be a bool"):
        st.refine_scores(q, key, idx, ok, sidx, sok, static_norm="yes")
    with pytest.raises(ValueError, match="`key`"):
        st.refine_scores(q, key.double(), idx, ok, sidx, sok)
    with pytest.raises(ValueError, match="do not match"):
        st.refine_scores(q, key[:, :1], idx, ok, sidx, sok)
    with pytest.raises(ValueError, match="`block_n`"):
        st.refine_scores(q, key, idx, ok, sidx, sok, block_n=24)


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sparse_k.selection import select_triton as st
topk = {"X": "*fp32", "M": "*u8", "FLAG": "*u8", "LEN": "*i32", "OUT": "*i32", "n": "i32", "k": "i32",
        "stride_x": "i32", "stride_m": "i32", "stride_o": "i32", "HAS_MASK": "constexpr", "HAS_FLAG": "constexpr",
        "HAS_LEN": "constexpr", "ONE_CHUNK": "constexpr", "BLOCK": "constexpr", "BLOCK_K": "constexpr"}
pages = {"Q": "*fp32", "KMIN": "*fp32", "KMAX": "*fp32", "OK": "*u8", "LAST": "*i64", "FLAG": "*u8", "OUT": "*fp32",
         **{n: "i32" for n in ("H", "C", "G", "D", "P", "TILES", "sq_b", "sq_h", "sq_c", "sq_g", "sk_b", "sk_h", "sk_p",
                              "sok_b", "sl_b", "so_r")},
         "HAS_FLAG": "constexpr", "BLOCK_C": "constexpr", "BLOCK_P": "constexpr", "BLOCK_D": "constexpr"}
strides = ("sq_b", "sq_h", "sq_c", "sq_g", "sk_b", "sk_h", "sk_s", "si_b", "si_h", "si_c")
refine_part = {"Q": "*fp32", "K": "*bf16", "IDX": "*i32", "OK": "*u8", "SIDX": "*i32", "SOK": "*u8", "FLAG": "*u8",
               "PM": "*fp32", "PL": "*fp32", **{n: "i32" for n in ("H", "C", "G", "D", "W", "WS", "NS")}, "scale": "fp32",
               **{n: "i32" for n in (*strides, "ss_b", "ss_h", "ss_c")}, "HAS_FLAG": "constexpr", "SPLIT": "constexpr",
               "BLOCK_G": "constexpr", "BLOCK_N": "constexpr", "BLOCK_D": "constexpr", "STATIC_NORM": "constexpr"}
refine_prob = {"Q": "*fp32", "K": "*bf16", "IDX": "*i32", "OK": "*u8", "FLAG": "*u8", "PM": "*fp32", "PL": "*fp32",
               "OUT": "*fp32", **{n: "i32" for n in ("H", "C", "G", "D", "W", "NS")}, "scale": "fp32",
               **{n: "i32" for n in (*strides, "so_r")}, "HAS_FLAG": "constexpr", "SPLIT": "constexpr",
               "BLOCK_S": "constexpr", "BLOCK_G": "constexpr", "BLOCK_N": "constexpr", "BLOCK_D": "constexpr"}
page_refine = {"Q": "*bf16", "K": "*bf16", "PAGES": "*i32", "BS": "*i64", "NK": "*i64", "KST": "*i64", "FLAG": "*u8",
               "PM": "*fp32", "PL": "*fp32", **{n: "i32" for n in ("H", "C", "G", "NPG", "NS", "sinks", "window")},
               "scale": "fp32", **{n: "i32" for n in ("sq_b", "sq_h", "sq_c", "sq_g", "sk_b", "sk_h", "sk_s")},
               **{n: "constexpr" for n in ("HAS_FLAG", "F32", "PAGE", "SPLIT", "BLOCK_C", "BLOCK_G", "BLOCK_N", "D",
                                           "BLOCK_D", "BLOCK_L", "NP")}}
page_refine_out = dict([*list(page_refine.items())[:9], ("OUT", "*fp32"), *list(page_refine.items())[9:]])  # OUT after PL
page_refine_part = {**page_refine, "STATIC_NORM": "constexpr"}
page_const = {"HAS_FLAG": True, "PAGE": 16, "SPLIT": 4096, "BLOCK_C": 16, "BLOCK_G": 4, "BLOCK_N": 64, "D": 128,
              "BLOCK_D": 128, "BLOCK_L": 128, "NP": 4}
index = {"Q": "*fp32", "W": "*fp32", "IK": "*fp32", "CAND": "*u8", "FLAG": "*u8", "OUT": "*fp32",
         **{n: "i32" for n in ("T", "G", "HG", "S", "DI")}, "scale": "fp32",
         **{n: "i32" for n in ("sq_b", "sq_t", "sq_h", "sw_b", "sw_t", "sk_b", "sk_s", "sc_b", "sc_t", "so_r")},
         "HAS_FLAG": "constexpr", "BLOCK_S": "constexpr", "BLOCK_D": "constexpr"}
summary = {"K": "*bf16", "KST": "*i64", "KEND": "*i64", "KMIN": "*fp32", "KMAX": "*fp32", "OK": "*i8",
           **{n: "i32" for n in ("H", "S", "D", "P", "sinks", "sk_b", "sk_h", "sk_s", "sk_d", "s_ks", "s_ke", "so_b",
                                 "so_h", "so_p")}, "PAGE": "constexpr", "BLOCK_PG": "constexpr", "BLOCK_D": "constexpr"}
layout = {"PAGES": "*i32", "SLOTS": "*i32", "LO": "*i64", "HI": "*i64", "BOK": "*u8", "NK": "*i64", "KST": "*i64",
          "IDX": "*i32", "CNT": "*i32",
          **{n: "i32" for n in ("H", "C", "NPG", "K", "W", "top_k", "sp_r", "ss_r", "sg_b", "sg_c", "s_nk", "s_ks",
                                "si_r")},
          "HAS_SLOTS": "constexpr", "PAGE": "constexpr", "BLOCK_N": "constexpr", "BLOCK_W": "constexpr"}
for fn, sig, const, warps in ((st._page_summary_kernel, summary, {"PAGE": 16, "BLOCK_PG": 16, "BLOCK_D": 64}, 4),
                              (st._page_layout_kernel, layout, {"HAS_SLOTS": False, "PAGE": 16, "BLOCK_N": 2048,
                                                                "BLOCK_W": 1024}, 4),
                              (st._page_layout_kernel, layout, {"HAS_SLOTS": True, "PAGE": 16, "BLOCK_N": 2048,
                                                                "BLOCK_W": 1024}, 4),
                              (st._topk_kernel, topk, {"HAS_MASK": True, "HAS_FLAG": True, "HAS_LEN": False,
                                                       "ONE_CHUNK": False, "BLOCK": 1024, "BLOCK_K": 1024}, 8),
                              (st._topk_kernel, topk, {"HAS_MASK": False, "HAS_FLAG": False, "HAS_LEN": True,
                                                       "ONE_CHUNK": False, "BLOCK": 1024, "BLOCK_K": 128}, 8),
                              (st._topk_kernel, topk, {"HAS_MASK": False, "HAS_FLAG": True, "HAS_LEN": True,
                                                       "ONE_CHUNK": True, "BLOCK": 8192, "BLOCK_K": 1024}, 16),
                              (st._page_bound_kernel, pages, {"HAS_FLAG": True, "BLOCK_C": st.PAGE_BOUND_ROWS,
                                                              "BLOCK_P": 64, "BLOCK_D": 128}, st.PAGE_BOUND_WARPS),
                              (st._page_bound_kernel, pages, {"HAS_FLAG": False, "BLOCK_C": 64, "BLOCK_P": 64,
                                                              "BLOCK_D": 128}, 8),
                              (st._index_score_kernel, index, {"HAS_FLAG": True, "BLOCK_S": 128, "BLOCK_D": 64}, 4),
                              (st._refine_partial_kernel, refine_part, {"HAS_FLAG": True, "SPLIT": 512, "BLOCK_G": 4,
                                                                        "BLOCK_N": 16, "BLOCK_D": 128,
                                                                        "STATIC_NORM": False}, 8),
                              (st._refine_partial_kernel, refine_part, {"HAS_FLAG": True, "SPLIT": 512, "BLOCK_G": 4,
                                                                        "BLOCK_N": 16, "BLOCK_D": 128,
                                                                        "STATIC_NORM": True}, 8),
                              (st._refine_prob_kernel, refine_prob, {"HAS_FLAG": True, "SPLIT": 512, "BLOCK_S": 4,
                                                                     "BLOCK_G": 4, "BLOCK_N": 16, "BLOCK_D": 128}, 8),
                              (st._refine_pages_partial_kernel, page_refine_part,
                               {**page_const, "F32": False, "STATIC_NORM": False}, 4),
                              (st._refine_pages_partial_kernel, page_refine_part,
                               {**page_const, "F32": False, "STATIC_NORM": True}, 4),
                              (st._refine_pages_prob_kernel, page_refine_out, {**page_const, "F32": False}, 4),
                              (st._refine_pages_prob_kernel, {**page_refine_out, "Q": "*fp32"}, {**page_const, "F32": True},
                               4)):
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    assert "cubin" in k.asm, list(k.asm)
print("compiled")
"""


def test_kernels_compile_for_sm90(tmp_path):
    """The compiled frontend accepts the kernels (the early return on a flag, the radix passes, the histogram): compiled
    to an sm_90 cubin without a GPU, in a fresh process with the interpreter off."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300,
                         cwd=str(Path(__file__).resolve().parents[2]))
    assert res.returncode == 0 and "compiled" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


# ----- build_selection through the kernels ----------------------------------------------------------------------

B, HQ, HKV, D = 2, 4, 2, 16
SLOTS, PROMPT, PAD = 83, 13, 3  # row 1 is left-padded by PAD slots
KINDS = ["dsa", "dsa_per_kv_head", "pages", "pages_refine"]  # decode steps keep a selection inside a block
PER_QUERY_KINDS = ["pages_refine_qb1", "pages_refine_qb1_static", "sparse_k_refine"]  # every query its own block
# ("_static": page_selection.REFINE_NORMALISER = "static")


def _pattern(kind):
    if kind.startswith("pages"):
        refine, qb = {"pages": (0, 4), "pages_refine": (2, 4), "pages_refine_qb1": (3, 1)}[kind.removesuffix("_static")]
        return sparse_k.SparseK(sinks=2, window=5, top_k=8, query_block=qb, refine=refine)
    if kind == "sparse_k_refine":
        return sparse_k.SparseK(sinks=2, window=5, top_k=6, query_block=1, refine=3)
    return sparse_k.DSA(sinks=1, window=3, top_k=5, query_block=3)


def _selector(kind):
    torch.manual_seed(5)
    if kind.startswith("pages"):
        return None
    if kind == "sparse_k_refine":
        scorer = SparseKScorer(HKV, D, key_norm_term=False)
        with torch.no_grad():
            scorer.pos_weight.normal_()
        return scorer.to(DEV)
    return LightningIndexer(HQ, HKV, D, indexer_heads=2, indexer_dim=8, per_kv_head=kind == "dsa_per_kv_head").to(DEV)


class Cache:
    """A static cache ``k, v (B, HKV, SLOTS, D)`` (garbage in unwritten slots); ``call`` writes the next ``q_len`` slots."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.k, self.v, self.q = (torch.randn(B, h, SLOTS, D, generator=g).to(DEV) for h in (HKV, HKV, HQ))
        self.written = 0

    def call(self, q_len):
        self.written += q_len
        mask = torch.arange(SLOTS) < self.written
        mask = torch.stack([mask, mask & (torch.arange(SLOTS) >= PAD)]).to(DEV)
        geo = sparse_k.row_geometry(B, q_len, SLOTS, mask, torch.full((B,), self.written - q_len, device=DEV))
        return self.q[:, :, self.written - q_len: self.written], geo


def _select(kind, selector, cache, q, geo, state=None, memo=None):
    return build_selection(_pattern(kind), q, cache.k, cache.v, geo, layer_idx=0, selector=selector, memo=memo,
                           state=state)


def _same(got, want, where):
    assert (got is None) == (want is None), where
    if got is not None:
        assert torch.equal(got.counts, want.counts), where
        assert torch.equal(got.indices, want.indices), where


@KERNEL_TEST
@pytest.mark.parametrize("kind", KINDS + PER_QUERY_KINDS)
def test_selection_through_the_kernels_equals_the_torch_path(kind, monkeypatch):
    monkeypatch.setattr(st, "REFINE_SPLIT", 8)  # the refinements' rows split over programs
    if kind.endswith("_static"):
        monkeypatch.setattr(page_selection, "REFINE_NORMALISER", "static")
    selector, cache = _selector(kind), Cache(1)
    q, geo = cache.call(SLOTS - 2)
    with torch.no_grad():
        got = _select(kind, selector, cache, q, geo, memo={})
        assert page_selection.row_kernels(cache.k) is not None
        monkeypatch.setattr(page_selection, "TRITON_SELECTION", False)
        want = _select(kind, selector, cache, q, geo, memo={})
    assert got.counts.max() > 0
    _same(got, want, kind)


@KERNEL_TEST
@pytest.mark.parametrize("offsets", ["host", "device"])
@pytest.mark.parametrize("kind", KINDS)
def test_decode_steps_equal_the_full_selection_and_skip_inside_a_block(kind, offsets, monkeypatch):
    """Every step equals the full selection of the same call (which runs the kernels with every flag on); a step
    whose rows are all inside their query block (not the first after the prefill) passes flags that are all off,
    and the layout it returns is then the kept one."""
    if offsets == "device":
        monkeypatch.setattr(RowGeometry, "host_offsets", lambda self: None)
    monkeypatch.setattr(st, "REFINE_SPLIT", 8)  # pages_refine: a row's keys split over programs
    flags = []
    topk_rows = st.topk_rows
    monkeypatch.setattr(st, "topk_rows", lambda x, k, mask=None, flag=None, **kw: flags.append(flag) or topk_rows(x, k, mask, flag, **kw))
    selector, cache, state, memo, memo_ref = _selector(kind), Cache(2), {}, {}, {}
    bq = _pattern(kind).query_block
    skipped = 0
    with torch.no_grad():
        q, geo = cache.call(PROMPT)
        _same(_select(kind, selector, cache, q, geo, state, memo), _select(kind, selector, cache, q, geo, None, memo_ref),
              "prefill")
        for t in range(SLOTS - PROMPT):
            q, geo = cache.call(1)
            flags.clear()
            got = _select(kind, selector, cache, q, geo, state, memo)
            step_flags = list(flags)
            _same(got, _select(kind, selector, cache, q, geo, None, memo_ref), f"step {t}")
            pos = torch.tensor([cache.written - 1, cache.written - 1 - PAD])
            inside = t > 0 and bool((pos % bq != 0).all())
            if got is not None and inside:
                assert step_flags and all(f is not None and not bool(f.any()) for f in step_flags), (t, step_flags)
                skipped += 1
            elif got is not None and t > 0 and bool((pos % bq == 0).all()):
                assert all(f is not None and bool(f.all()) for f in step_flags), (t, step_flags)
    assert skipped >= (SLOTS - PROMPT) // 3, skipped  # pages: rows at block starts 1 and 0 mod 4 (half the steps)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("n, k", [(32768, 2048), (131072, 2048), (8192, 128), (131071, 4097)])
def test_topk_rows_at_real_sizes_bf16_scores(n, k):
    """Real decode sizes (DSA over 32K / 128K keys, training-free pages at 128K / 16), bf16 scores (many ties)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, n, device="cuda", generator=g).to(torch.bfloat16)
    x[1, : n // 2] = float("-inf")
    mask = torch.rand(8, n, device="cuda", generator=g) > 0.1
    assert torch.equal(st.topk_rows(x, k).long(), _reference_topk(x.float(), k))
    assert torch.equal(st.topk_rows(x, k, mask).long(), _reference_topk(x.float(), k, mask))
    flag = torch.arange(8, device="cuda") % 2 == 0
    got = st.topk_rows(x, k, mask, flag)
    assert bool((got[~flag] == SENTINEL).all()) and torch.equal(got[flag].long(), _reference_topk(x.float(), k, mask)[flag])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_page_bound_scores_at_real_sizes():
    """128K keys in pages of 16 (8192 pages), 8 KV heads of 4 query heads, head dim 128."""
    g = torch.Generator(device="cuda").manual_seed(1)
    B, H, G, Dh, P = 1, 8, 4, 128, 8192
    kmin = torch.randn(B, H, P, Dh, device="cuda", generator=g)
    kmax = kmin + torch.rand(B, H, P, Dh, device="cuda", generator=g)
    ok = torch.ones(B, 1, P, dtype=torch.bool, device="cuda")
    q = torch.randn(B, H, 1, G, Dh, device="cuda", generator=g)
    last = torch.full((B, 1), P - 70, device="cuda")
    cand = torch.arange(P, device="cuda") <= last[:, None, :, None]
    want32 = torch.where(cand, quest_scores(q, kmin, kmax, ok), float("-inf"))  # TF32 off: torch's default for matmul
    want64 = torch.where(cand, quest_scores(q.double(), kmin.double(), kmax.double(), ok), float("-inf"))
    _within_float32_error(st.page_bound_scores(q, kmin, kmax, ok, last), want32, want64, "128K")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("C", [1, 40])  # a decode step (one block of 16 rows live); a prefill chunk of 40 queries
def test_refine_page_scores_at_real_sizes(C):
    """128K bf16 keys in pages of 16, 8 KV heads of 4 query heads, head dim 128, a pool of 128 pages per query (the
    training-free ``refine=8`` at ``top_k`` 256), window 256: the tile kernel equals the gather kernel
    (``refine_scores`` over the packed keys) within float32 rounding."""
    g = torch.Generator(device="cuda").manual_seed(2)
    B, H, G, D, S, page, sinks, window = 1, 8, 4, 128, 131072, 16, 4, 256
    key = torch.randn(B, H, S, D, device="cuda", generator=g).to(torch.bfloat16)
    q = torch.randn(B, H, C, G, D, device="cuda", generator=g).to(torch.bfloat16)
    bs = torch.sort(torch.randint(S // 2, S, (B, C), device="cuda", generator=g)).values
    last = (bs - window + 1) // page - 1
    score = torch.rand(B, H, C, S // page, device="cuda", generator=g)
    first = -(-sinks // page)  # the first page wholly past the sinks (a candidate page holds no sink)
    page_idx = torch.arange(S // page, device="cuda")
    score = torch.where((page_idx >= first) & (page_idx <= last[:, None, :, None]), score, -1.0)
    pages = torch.sort(torch.topk(score, 128, -1).indices, -1).values
    n_keys, k_start = torch.full((B,), S, device="cuda"), torch.zeros(B, dtype=torch.long, device="cuda")
    got = st.refine_page_scores(q, key, pages, page, bs, n_keys, k_start, sinks, window)
    hi = bs - window
    pos, _ = page_selection.expand_pages(pages, pages >= 0, page, torch.full_like(bs, sinks), hi, n_keys, 128 * page)
    spos, sok = page_selection.static_positions(bs, hi, n_keys, sinks, window)
    want = st.refine_scores(q.float(), key, pos.clamp_min(0), pos >= 0, spos[:, None].clamp_min(0), sok[:, None])
    assert torch.equal(pos, (pages[..., None] * page + torch.arange(page, device="cuda")).flatten(-2))  # no clipped key
    # logits of order 1 summed over 128 exact bf16 products in another order: ~1e-6 apart, relative after exp
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
