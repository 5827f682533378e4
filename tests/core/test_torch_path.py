"""The PyTorch path against the exact reference: every fixed pattern, odd lengths, GQA, head
dims, left padding, Sq < Skv, sink logits, softcap; fp64 gradcheck; linear memory."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import rel_err
from helpers import BIDIRECTIONAL, FIXED, left_padding_mask, random_pattern, random_qkv
from hypothesis import given, settings
from hypothesis import strategies as st

import sparse_k as sk

# fp32 against the float64 reference: the same arithmetic in another summation order lands near
# 1e-6 (the bar is 1e-5, ten times that).
TOL_FP32 = 1e-5


def _compare(q, k, v, p, **kw):
    out, lse = sk.sparse_attention(q, k, v, p, backend="torch", return_lse=True, **kw)
    ref, ref_lse = sk.sparse_attention(q.double(), k.double(), v.double(), p, backend="reference", return_lse=True, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape[:3] + v.shape[-1:]
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL_FP32, (p, rel_err(out, ref))
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert torch.allclose(lse[fin].double(), ref_lse[fin], atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(FIXED),
    seed=st.integers(0, 2**31 - 1),
    sq=st.integers(1, 90),
    extra_kv=st.sampled_from([0, 0, 1, 17, 64]),
    gqa=st.sampled_from([1, 3, 4]),
    hkv=st.sampled_from([1, 2]),
    d=st.sampled_from([8, 64, 128, 256]),
    padded=st.booleans(),
    sinks=st.booleans(),
    softcap=st.sampled_from([None, 3.0]),
)
def test_matches_reference_on_random_configurations(name, seed, sq, extra_kv, gqa, hkv, d, padded, sinks, softcap):
    torch.manual_seed(seed)
    rng = torch.Generator().manual_seed(seed)
    skv = sq + extra_kv
    p = random_pattern(name, rng, max_len=skv)
    B = 2 if padded else 1
    q, k, v = random_qkv(B, hkv * gqa, hkv, sq, skv, d)
    kw = {"softcap": softcap, "layer_idx": seed % 5}
    if padded:
        kw["attention_mask"] = left_padding_mask(B, skv, rng)
    if sinks:
        kw["sink_logits"] = torch.randn(hkv * gqa)
    _compare(q, k, v, p, **kw)


@pytest.mark.parametrize("name", FIXED)
@pytest.mark.parametrize("length", [1, 63, 113, 1000, 4097])
def test_odd_lengths(name, length):
    torch.manual_seed(length)
    p = random_pattern(name, torch.Generator().manual_seed(length), max_len=min(length, 600))
    heads = (1, 1) if length > 1000 else (3, 1)
    q, k, v = random_qkv(1, heads[0], heads[1], length, length, 64)
    _compare(q, k, v, p)
    # Decode and chunked prefill against the same cache (Sq < Skv, bottom-right).
    for sq in (1, 7):
        if sq <= length:
            _compare(q[:, :, -sq:].contiguous(), k, v, p)


@pytest.mark.parametrize("name", BIDIRECTIONAL)
def test_bidirectional(name):
    torch.manual_seed(0)
    p = random_pattern(name, torch.Generator().manual_seed(2), causal=False, max_len=100)
    q, k, v = random_qkv(2, 4, 2, 100, 100, 32)
    _compare(q, k, v, p, attention_mask=left_padding_mask(2, 100, torch.Generator().manual_seed(4)))


def test_mask_with_holes_and_fully_masked_rows():
    torch.manual_seed(0)
    q, k, v = random_qkv(2, 2, 1, 40, 40, 16)
    mask = torch.rand(2, 40) > 0.4
    mask[1] = False  # a row whose keys are all padding: zeros out, lse = -inf
    _compare(q, k, v, sk.SlidingWindow(window=9), attention_mask=mask)
    out, lse = sk.sparse_attention(q, k, v, "sliding_window", attention_mask=mask, backend="torch", return_lse=True)
    assert (out[1] == 0).all() and torch.isinf(lse[1]).all()


def test_learned_pattern_with_a_given_selection():
    torch.manual_seed(0)
    B, Hq, Hkv, S, D = 2, 4, 2, 70, 16
    p = sk.SparseK(sinks=2, window=8, top_k=5, query_block=16)
    q, k, v = random_qkv(B, Hq, Hkv, S, S, D)
    g = sk.row_geometry(B, S, S)
    nb = (S + 15) // 16
    idx = torch.stack([torch.randperm(S)[:5].sort().values for _ in range(B * Hkv * nb)]).view(B, Hkv, nb, 5)
    sel = sk.TokenLayout(idx.int(), torch.randint(0, 6, (B, Hkv, nb)).int(), 16, torch.zeros(B, dtype=torch.long),
                         torch.rand(B, Hkv, nb, 5) + 0.05)
    _compare(q, k, v, p, selection=sel)
    del g


@pytest.mark.parametrize("qb,weights,padded,sq,extra", [(1, True, True, 77, 19), (1, False, False, 40, 19),
                                                          (3, True, False, 61, 19), (5, False, True, 23, 19),
                                                          (16, True, True, 50, 19), (64, True, True, 150, 0),
                                                          (64, False, False, 128, 0)])
def test_query_blocks_with_a_given_selection(qb, weights, padded, sq, extra):
    """Query blocks shorter than the PyTorch path's query tile (every query, or a few, with their own keys:
    ``torch_path._own_block_scores``) and as long as several tiles (a tile's queries share their block's keys),
    against the reference: GQA, left padding, a chunk of queries at the end, SparseK weights with zeros, sink
    logits, selected keys that the window also holds (counted once)."""
    from helpers import random_token_layout

    gen = torch.Generator().manual_seed(qb * 100 + sq)
    B, Hq, Hkv, Skv, D = 2, 6, 2, sq + extra, 16
    p = sk.SparseK(sinks=2, window=5, top_k=7, query_block=qb)
    q, k, v = random_qkv(B, Hq, Hkv, sq, Skv, D)
    mask = left_padding_mask(B, Skv, gen) if padded else None
    geo = sk.row_geometry(B, sq, Skv, mask)
    sel = random_token_layout(B, Hkv, sq, Skv, qb, 7, geo, gen, weights=weights)
    sink = torch.randn(Hq, generator=gen)
    _compare(q, k, v, p, selection=sel, attention_mask=mask, sink_logits=sink)


@pytest.mark.parametrize("name", FIXED)
def test_gradcheck_fp64(name):
    torch.manual_seed(1)
    p = random_pattern(name, torch.Generator().manual_seed(5), max_len=14)
    q, k, v = random_qkv(2, 2, 1, 9, 14, 3, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(2, dtype=torch.float64, requires_grad=True)
    mask = left_padding_mask(2, 14, torch.Generator().manual_seed(1))

    def f(q, k, v, sink):
        return sk.sparse_attention(q, k, v, p, backend="torch", sink_logits=sink, softcap=2.0, attention_mask=mask)

    assert torch.autograd.gradcheck(f, (q, k, v, sink), fast_mode=True)


def test_gradients_match_reference():
    torch.manual_seed(2)
    q, k, v = random_qkv(1, 4, 2, 50, 50, 16, dtype=torch.float64, requires_grad=True)
    p = sk.Streaming(sinks=3, window=10)
    g1 = torch.autograd.grad(sk.sparse_attention(q, k, v, p, backend="torch").square().sum(), (q, k, v))
    g2 = torch.autograd.grad(sk.sparse_attention(q, k, v, p, backend="reference").square().sum(), (q, k, v))
    for a, b in zip(g1, g2):
        assert rel_err(a, b) < 1e-10


def test_packed_sequences_equal_separate_calls():
    torch.manual_seed(3)
    lens_q, lens_k = [5, 17, 1, 30], [5, 20, 9, 30]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = random_qkv(1, 4, 2, sum(lens_q), sum(lens_k), 8)
    p = sk.Streaming(sinks=2, window=6)
    for backend in ("torch", "reference"):
        out = sk.sparse_attention(q, k, v, p, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend=backend)
        for s in range(4):
            qs = q[:, :, cu_q[s] : cu_q[s + 1]]
            ks, vs = k[:, :, cu_k[s] : cu_k[s + 1]], v[:, :, cu_k[s] : cu_k[s + 1]]
            want = sk.sparse_attention(qs, ks, vs, p, backend="reference")
            assert rel_err(out[:, :, cu_q[s] : cu_q[s + 1]], want) < TOL_FP32


_MEMORY_SCRIPT = r"""
import resource, torch, sparse_k as sk
torch.manual_seed(0)
S = 65536
q, k, v = (torch.randn(1, 1, S, 64) for _ in range(3))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = sk.sparse_attention(q, k, v, sk.SlidingWindow(window=1024), backend="torch")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert torch.isfinite(out).all()
print((peak - base) * 1024)
"""


def test_memory_is_linear_in_sequence_length():
    """sliding_window 1024 at S = 65,536: a dense mask alone would be 4 GiB; we stay under 1 GB."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    res = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    extra = int(res.stdout.strip().splitlines()[-1])
    assert extra < 1_000_000_000, f"extra peak memory {extra / 2**20:.0f} MiB"
