"""The Triton decode kernels against the exact reference: split-KV over strided caches, the split
merge (fused in the last split program or by the combine kernel), GQA groups of any size, a token
layout with packed heads and splits; and the decode tile and split-count rules of ``attention.plan``.

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, fp32, tiny shapes,
16x16 tiles); with CUDA the same tests run compiled (``tests/triton_interp.py``: when triton was
imported earlier in the session this file runs in a fresh interpreter,
``test_interpreter_suite_in_subprocess``). Tolerances as in ``attention_kernels/test_triton_kernels.py``:
fp32 under the interpreter is exact float32 arithmetic; compiled fp32 ``tl.dot`` runs TF32.
"""

import warnings

import pytest
import torch
from triton_interp import KERNEL_TEST, ON_GPU, import_kernels, run_file_interpreted

HAVE_TRITON, IN_PROCESS, _kernels = import_kernels("attention.triton.fwd")

import sparse_k
from helpers import random_token_layout, rel_err
from sparse_k import build_block_layout, get_pattern, reference_attention, row_geometry
from sparse_k.attention import dispatch, launch_buffers

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")

_SUBPROCESS_ONLY = KERNEL_TEST  # not collected where IN_PROCESS is False (conftest): the subprocess runs them


@pytest.mark.skipif(IN_PROCESS, reason="the kernels run in this process")
def test_interpreter_suite_in_subprocess():
    """Run this file under a fresh interpreter with ``TRITON_INTERPRET=1`` set before triton loads."""
    run_file_interpreted(__file__, 11)  # every test of this file ran there


DEV = "cuda" if ON_GPU else "cpu"
TOL32 = 2e-3 if ON_GPU else 1e-5
LSE_ATOL = 5e-3 if ON_GPU else 1e-4  # TF32 logits on a GPU (see test_triton_kernels.py)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def triton_attn(*args, **kwargs):
    """``sparse_attention(backend="triton")`` that fails if the backend fell back to the PyTorch path."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        return sparse_k.sparse_attention(*args, backend="triton", **kwargs)


def rand(*shape, gen=None):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(DEV)


PATTERNS = {
    "dense": get_pattern("dense"),
    "sliding_window": get_pattern("sliding_window", window=11),
    "streaming": get_pattern("streaming", sinks=3, window=10),
}


def _layout(p, Sq, Skv, geo, Hkv, bq=16, bk=16):
    return build_block_layout(p, Sq, Skv, geo, block_q=bq, block_k=bk, num_kv_heads=Hkv)


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("q_len", [1, 3, 16])
def test_decode_split_kv_strided_cache(q_len):
    """Split-KV decode over a (B, S_max, Hkv, D) cache read through a transposed view; sink added once."""
    g = torch.Generator().manual_seed(q_len)
    B, Hq, Hkv, S_max, D = 2, 4, 1, 70, 16
    cache_k, cache_v = rand(B, S_max, Hkv, D, gen=g), rand(B, S_max, Hkv, D, gen=g)
    k, v = cache_k.transpose(1, 2), cache_v.transpose(1, 2)
    q = rand(B, Hq, q_len, D, gen=g)
    sink = rand(Hq, gen=g)
    mask = torch.ones(B, S_max, dtype=torch.bool, device=DEV)
    mask[1, 50:] = False  # row 1 holds 50 keys (a StaticCache-like tail)
    for p in (PATTERNS["streaming"], PATTERNS["dense"]):
        out = triton_attn(q, k, v, p, sink_logits=sink, attention_mask=mask, q_start=torch.tensor([S_max - q_len, 50 - q_len], device=DEV))
        ref = sparse_k.sparse_attention(q, k, v, p, backend="reference", sink_logits=sink, attention_mask=mask, q_start=torch.tensor([S_max - q_len, 50 - q_len], device=DEV))
        assert rel_err(out, ref) < TOL32
    geo = row_geometry(B, q_len, S_max, None, device=DEV)
    lay = _layout(PATTERNS["sliding_window"], q_len, S_max, geo, Hkv, bq=4)
    for splits in (1, 2, 5):
        o, lse = dispatch.attention_forward(q, k, v, lay, scale=D ** -0.5, pack=4, num_splits=splits, sink_logits=sink)
        ro, rl = reference_attention(q, k, v, PATTERNS["sliding_window"], geo, scale=D ** -0.5, sink_logits=sink)
        assert rel_err(o, ro) < TOL32
        assert torch.allclose(lse.double(), rl, atol=LSE_ATOL)


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("fuse", [True, False])
def test_decode_split_merge_fused_and_separate(fuse):
    """Split-KV merge in the last split program (fused) or in the combine kernel: every output row
    written (NaN-poisoned first), sink added once, counters back at zero for the next launch."""
    g = torch.Generator().manual_seed(31 + fuse)
    B, Hq, Hkv, S, D = 2, 4, 2, 83, 16
    k, v = rand(B, Hkv, S, D, gen=g), rand(B, Hkv, S, D, gen=g)
    sink = rand(Hq, gen=g)
    p = get_pattern("streaming", sinks=3, window=29)
    for q_len, splits in ((1, 3), (5, 4), (16, 7)):
        q = rand(B, Hq, q_len, D, gen=g)
        geo = row_geometry(B, q_len, S, None, device=DEV)
        lay = _layout(p, q_len, S, geo, Hkv, bq=8)
        ro, rl = reference_attention(q, k, v, p, geo, scale=D ** -0.5, sink_logits=sink)
        for _ in range(2 if q_len == 1 else 1):  # the second launch must find the counters reset
            out = torch.full((B, Hq, q_len, D), float("nan"), device=DEV)
            o, lse = dispatch.attention_forward(q, k, v, lay, scale=D ** -0.5, pack=2, num_splits=splits,
                                                sink_logits=sink, out=out, fuse_combine=fuse)
            assert o.data_ptr() == out.data_ptr() and not o.isnan().any()
            assert rel_err(o, ro) < TOL32
            assert torch.allclose(lse.double(), rl, atol=LSE_ATOL)
        if fuse:
            assert not launch_buffers.split_counters(torch.device(DEV), 1).any()


def test_decode_tiles_are_powers_of_two_for_every_group_size():
    """tl.arange needs BLOCK_M = rows * pack to be a power of two, whatever the GQA group (3 for SmolLM2)."""
    from sparse_k.attention.plan import decode_config

    for group in range(1, 17):
        for q_len in range(1, 17):
            for head_dim in (64, 128, 256):
                rows, pack, _ = decode_config(q_len, group, "cuda", head_dim)
                m = rows * pack
                assert group % pack == 0 and rows >= q_len and m >= 16 and m & (m - 1) == 0, (group, q_len, rows, pack)


@_SUBPROCESS_ONLY
@pytest.mark.parametrize("hq, hkv", [(6, 2), (9, 3), (12, 2)])
def test_decode_with_odd_gqa_groups(hq, hkv):
    """Decode through the backend with groups of 3 and 6 query heads per KV head."""
    g = torch.Generator().manual_seed(hq)
    B, S, D = 1, 45, 16
    q, k, v = rand(B, hq, 1, D, gen=g), rand(B, hkv, S, D, gen=g), rand(B, hkv, S, D, gen=g)
    for p in (PATTERNS["streaming"], PATTERNS["sliding_window"]):
        out = triton_attn(q, k, v, p)
        ref = sparse_k.sparse_attention(q, k, v, p, backend="reference")
        assert rel_err(out, ref) < TOL32


@_SUBPROCESS_ONLY
def test_token_layout_decode_split():
    """Decode with a selection: packed heads, split-KV over block tiles and selected keys together."""
    g = torch.Generator().manual_seed(23)
    B, Hq, Hkv, Skv, D, QB = 2, 8, 2, 90, 16, 16
    p = get_pattern("dsa", sinks=1, window=9, top_k=20, query_block=QB)
    for q_len in (1, 4):
        geo = row_geometry(B, q_len, Skv, None, device=DEV)
        sel = random_token_layout(B, Hkv, q_len, Skv, QB, 20, geo, g, weights=False, device=DEV)
        q, k, v = rand(B, Hq, q_len, D, gen=g), rand(B, Hkv, Skv, D, gen=g), rand(B, Hkv, Skv, D, gen=g)
        out = triton_attn(q, k, v, p, selection=sel)
        ref = sparse_k.sparse_attention(q, k, v, p, backend="reference", selection=sel)
        assert rel_err(out, ref) < TOL32


def test_decode_split_count_fills_one_wave(monkeypatch):
    """Split-KV factor: one wave of programs over the SMs for contiguous key tiles, two with gathered
    (token-layout) keys, never more splits than tiles, at least one."""
    from types import SimpleNamespace

    from sparse_k.attention.plan import split_count

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(multi_processor_count=132))
    dev = torch.device("cuda")
    assert split_count(64, 66, dev) == 2  # B=8 x 8 KV heads, window 4096 in 64-key tiles
    assert split_count(64, 33, dev, gathered=True) == 4  # top-2048 + the query's own tile
    assert split_count(8, 66, dev) == 16
    assert split_count(8, 5, dev) == 5
    assert split_count(500, 66, dev) == 1
    assert split_count(1, 10_000, dev) == 64
