"""The selection's temporaries stay bounded with one query per block: no ``S x S`` tensor on any path.

Each path runs twice: with the library's chunk sizes and with tiny ones under a dispatch mode that records the
largest tensor any ATen op returns. The layouts must be equal (chunking changes nothing) and, with tiny chunks, no
tensor may reach an eighth of ``S x S`` elements (a mask or score over every (query, key) pair would) beyond the
layout itself.
"""

import warnings

import pytest
import sparse_k
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sparse_k.selection import page_selection, selectors
from sparse_k.selection.scorers import LightningIndexer, SparseKScorer
from sparse_k.selection.selectors import build_selection

S = 2304  # above 2 * top_k + PREFIX_CHUNK candidates (top_k 16), so a SparseK scorer takes the prefix scan


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), func
        return out


def _selector(kind: str, Hq: int, Hkv: int, D: int, seed: int):
    torch.manual_seed(seed)
    if kind == "sparse_k":
        sel = SparseKScorer(Hkv, D)
    elif kind is None:
        return None
    else:
        sel = LightningIndexer(Hq, Hkv, D, per_kv_head=kind == "dsa_per_kv_head")
    with torch.no_grad():
        for prm in sel.parameters():
            prm.normal_()
    return sel


CASES = {  # name: (pattern fields, selector)
    "training_free": (dict(pattern="sparse_k"), None),
    "training_free_refine": (dict(pattern="sparse_k", refine=8), None),
    "sparse_k_prefix_scan": (dict(pattern="sparse_k"), "sparse_k"),
    "sparse_k_short_rows": (dict(pattern="sparse_k", top_k=512), "sparse_k"),
    "dsa": (dict(pattern="dsa"), "dsa"),
    "dsa_per_kv_head": (dict(pattern="dsa"), "dsa_per_kv_head"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_per_query_selection_has_no_square_temporaries(case, monkeypatch):
    fields, kind = CASES[case]
    pattern = sparse_k.get_pattern({"sinks": 4, "window": 64, "top_k": 16, "query_block": 1, **fields})
    B, Hq, Hkv, D = 1, 4, 2, 16
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hq, Hkv, Hkv))
    geo = sparse_k.row_geometry(B, S, S, None)
    selector = _selector(kind, Hq, Hkv, D, seed)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the training-free selection's one-time advice
        want = build_selection(pattern, q, k, v, geo, layer_idx=0, selector=selector)
    monkeypatch.setattr(selectors, "_CHUNK_ELEMENTS", 1 << 16)
    monkeypatch.setattr(page_selection, "CHUNK_ELEMENTS", 1 << 16)
    tracker = _LargestTensor()
    with torch.no_grad(), warnings.catch_warnings(), tracker:
        warnings.simplefilter("ignore")
        got = build_selection(pattern, q, k, v, geo, layer_idx=0, selector=selector)
    assert torch.equal(got.indices, want.indices) and torch.equal(got.counts, want.counts), f"seed {seed}"
    assert (got.weights is None) == (want.weights is None)
    if want.weights is not None:
        torch.testing.assert_close(got.weights, want.weights)
    assert int(want.counts.max()) == min(pattern.top_k, want.indices.shape[-1])  # the selection did select
    bound = max(S * S // 8, want.indices.numel())  # the layout itself has B * Hkv * S * K entries
    assert tracker.numel <= bound, f"{tracker.op} returned {tracker.numel} elements (S x S = {S * S})"

