"""hf_sparse_attention.evaluation.oracle (the oracles of ``scripts/selection_ceiling.py``): oracle masses,
selections and attention against brute force (float64, GQA, odd lengths), and the model-level identity
"top_k covering every candidate == dense"."""

from types import SimpleNamespace

import pytest
import sparse_k
import torch
from helpers import tiny_llama
from sparse_k.layouts.geometry import row_geometry
from sparse_k.attention.reference import masked_attention
from sparse_k.selection.selectors import selection_from_scores

from hf_sparse_attention.evaluation import oracle as mod


def _brute_probs(q, k, scale):
    """Dense causal probabilities ``(B, Hq, S, S)`` (float64)."""
    G = q.shape[1] // k.shape[1]
    s = torch.einsum("bhid,bhjd->bhij", q, k.repeat_interleave(G, 1)) * scale
    S = q.shape[2]
    return torch.softmax(s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")), -1)


def _brute_selection(P, Hkv, pattern, mode):
    """``{(b, g, n): sorted selected key list}`` and (kept, total) by loops over blocks (module docstring rules)."""
    B, Hq, S, _ = P.shape
    G, bq = Hq // Hkv, pattern.query_block
    grp = P.view(B, Hkv, G, S, S).sum(2)  # (B, Hkv, S_q, S_k)
    out, kept, total = {}, 0.0, 0.0
    for n in range(-(-S // bq)):
        b0 = n * bq
        cands = list(range(pattern.sinks, b0 - pattern.window + 1))
        own = grp[:, :, b0:b0 + bq].sum(2)
        seen = [i for i in range(S) if (i // bq) * bq - pattern.window >= pattern.sinks]  # queries whose block has candidates
        via_cand = sum(grp[:, :, i] * (torch.arange(S) <= (i // bq) * bq - pattern.window) for i in seen)
        score = {"future": grp.sum(2), "candidate": via_cand, "causal": grp[:, :, :b0].sum(2), "block": own}[mode]
        for b in range(B):
            for g in range(Hkv):
                chosen = sorted(sorted(cands, key=lambda j: -float(score[b, g, j]))[:pattern.top_k])
                out[b, g, n] = chosen
                kept += float(own[b, g, chosen].sum())
                total += float(own[b, g, cands].sum())
    return out, kept, total


@pytest.mark.parametrize("mode", ["future", "candidate", "causal", "block"])
def test_oracle_selection_and_attention_match_brute_force(mode):
    torch.manual_seed(3)
    B, Hq, Hkv, S, D = 2, 6, 3, 75, 8
    q, k, v = (torch.randn(B, h, S, D, dtype=torch.float64) for h in (Hq, Hkv, Hkv))
    pattern = sparse_k.SparseK(sinks=2, window=9, top_k=5, query_block=8)
    scale = 0.4

    P = _brute_probs(q, k, scale)
    layout, kept, total = mod.oracle_selection(pattern, q, k, scale, mode)
    want, want_kept, want_total = _brute_selection(P, Hkv, pattern, mode)
    got = {(b, g, n): sorted(int(j) for j in layout.indices[b, g, n] if j >= 0)
           for b in range(B) for g in range(Hkv) for n in range(layout.indices.shape[2])}
    assert got == want
    # the mass is float32 (training.distill.block_attention_mass): sums of ~1e3 probabilities
    assert kept == pytest.approx(want_kept, rel=1e-5) and total == pytest.approx(want_total, rel=1e-5)
    assert 0 < kept < total

    cfg = SimpleNamespace(sparse_attention=pattern.to_dict())
    with mod.oracle_mode(mode):
        out, _ = mod.oracle_attention_forward(None, q, k, v, None, scaling=scale, config=cfg, layer_idx=0)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    mask = ((j < pattern.sinks) | (i - j < pattern.window)) & (j <= i)
    mask = mask.expand(B, Hkv, S, S).clone()
    for (b, g, n), keys in want.items():
        mask[b, g, n * 8:(n + 1) * 8, keys] = True
    ref, _ = masked_attention(q, k, v, mask, scale=scale)
    torch.testing.assert_close(out.transpose(1, 2), ref, rtol=1e-10, atol=1e-10)


def test_oracle_covering_every_candidate_equals_dense_model():
    """With query_block 1 and top_k >= every candidate, each oracle attends to all causal keys: the model's logits
    equal sdpa's (with larger blocks, keys between the first query's window and a later query's are never candidates)."""
    model = tiny_llama()
    ids = torch.randint(0, 50, (1, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        for top_k, query_block, same in ((64, 1, True), (2, 4, False)):
            mod.apply_oracle(model, SimpleNamespace(sinks=2, window=4, top_k=top_k, query_block=query_block))
            for mode in mod.ORACLES:
                with mod.oracle_mode(mode) as state:
                    logits = model(ids, use_cache=False).logits
                assert state["total"] > 0 and (state["kept"] == pytest.approx(state["total"])) == same
                if same:
                    torch.testing.assert_close(logits, dense, rtol=1e-5, atol=1e-5)  # fp32 softmax orderings differ
                else:
                    assert (logits - dense).abs().max() > 1e-3


def test_errors():
    with pytest.raises(ValueError, match="oracle mode"):
        mod.oracle_scores(torch.zeros(1, 1, 1, 4), "mean", torch.ones(1, 1, 4, dtype=torch.bool))
    q = torch.randn(1, 2, 16, 4)
    cfg = SimpleNamespace(sparse_attention={"pattern": "sparse_k", "sinks": 1, "window": 2, "top_k": 2, "query_block": 4})
    with pytest.raises(RuntimeError, match="oracle_mode"):
        mod.oracle_attention_forward(None, q, q, q, None, config=cfg, layer_idx=0)
    with mod.oracle_mode("block"):
        with pytest.raises(ValueError, match="unpadded prefill"):
            mod.oracle_attention_forward(None, q, q, q, torch.ones(1, 16, dtype=torch.bool), config=cfg, layer_idx=0)
        with pytest.raises(ValueError, match="softcap=30.0"):
            mod.oracle_attention_forward(None, q, q, q, None, softcap=30.0, config=cfg, layer_idx=0)
    geo = row_geometry(1, 16, 16)
    with pytest.raises(ValueError, match=r"\(B, Hkv, 1 or 4, 16\)"):
        selection_from_scores(sparse_k.SparseK(sinks=1, window=2, top_k=2, query_block=4), torch.zeros(1, 2, 3, 16), geo, 16, 16)
    with pytest.raises(TypeError, match="learned pattern"):
        selection_from_scores(sparse_k.Streaming(), torch.zeros(1, 2, 1, 16), geo, 16, 16)


def test_help_says_what_every_flag_is_and_its_default():
    """``scripts/selection_ceiling.py --help`` is the script's manual: every flag has a line saying what it is and
    what it is when not given, never ``(default: None)``."""
    from helpers import undescribed_flags

    from hf_sparse_attention.evaluation.selection_ceiling import build_parser

    assert undescribed_flags(build_parser()) == []
