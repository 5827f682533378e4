"""Pattern values past int32 (``window=2**40`` for "no limit", a query block of ``2**32 + 128``) reach the Hopper CUDA
kernels capped at the sequence length (``cuda.contract.length_capped``), which selects the same keys, instead of
truncated to 32 bits by the bindings (a window of ``2**32 + 1`` read as 1: each query would see only itself).

CPU tests: the launchers' arguments to a recording stand-in for the extension, and the capping rule against the
PyTorch path. GPU tests (``gpu`` marker, sm_90): the kernels with such values against the exact reference.
"""

import contextlib
import sys
import time

import pytest
import sparse_k
import torch
from helpers import needs_sm90, rel_err
from sparse_k import get_pattern, reference_attention, row_geometry, sparse_attention
from sparse_k.attention import plan
from sparse_k.attention.cuda import decode as cd
from sparse_k.attention.cuda import structured as cs
from sparse_k.attention.cuda import structured_bwd as cb
from sparse_k.attention.cuda import token as ct
from sparse_k.attention.cuda.contract import length_capped

HUGE = (2**31, 2**32 + 1, 2**32 + 128, sys.maxsize)


class _Recorder:
    """Stands in for a built extension: keeps the positional arguments of each call by entry point."""

    def __init__(self):
        self.calls = {}

    def __getattr__(self, name):
        def record(*args):
            self.calls[name] = args

        return record


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    for mod in (cs, cb, ct, cd):
        monkeypatch.setattr(mod, "load_extension", lambda: rec)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("Stream", (), {"cuda_stream": 0})())
    return rec


def _int32(x) -> bool:
    return isinstance(x, int) and -(2**31) <= x < 2**31


@pytest.mark.parametrize("length,multiple,value,expected", [
    (1000, 1, 2**32 + 1, 1000), (1000, 1, 999, 999), (1000, 1, 1000, 1000), (1000, 128, 2**32 + 128, 1024),
    (1000, 128, 384, 384), (1, 1, sys.maxsize, 1), (128, 128, 2**31, 128), (1000, 1, 0, 0),
])
def test_length_capped(length, multiple, value, expected):
    assert length_capped(value, length, multiple) == expected


@pytest.mark.parametrize("name,huge", [
    ("sliding_window", {"window": 2**32 + 1}), ("streaming", {"window": 2**32 + 1, "sinks": 2**32 + 3}),
    ("streaming", {"window": 7, "sinks": sys.maxsize}), ("block_diagonal", {"block": 2**32 + 64}),
])
@pytest.mark.parametrize("S", [1, 77, 200])
def test_capped_values_select_the_same_keys(name, huge, S):
    """The PyTorch path (exact rule, any Python int) gives the same output for the pattern as given and for the
    values the launchers pass on."""
    g = torch.Generator().manual_seed(time.time_ns() % 2**31)
    q, k, v = (torch.randn(1, h, S, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    capped = {key: length_capped(val, S) for key, val in huge.items()}
    a = sparse_attention(q, k, v, get_pattern(name, **huge), scale=0.25, backend="torch")
    b = sparse_attention(q, k, v, get_pattern(name, **capped), scale=0.25, backend="torch")
    assert torch.equal(a, b)


@pytest.mark.parametrize("value", HUGE)
def test_structured_launchers_pass_int32(recorder, value):
    B, Hq, Hkv, S, D = 1, 4, 2, 300, 64
    q, k, v = torch.zeros(B, Hq, S, D), torch.zeros(B, Hkv, S, D), torch.zeros(B, Hkv, S, D)
    cs._launch(q, k, v, torch.empty_like(q), torch.empty(B, Hq, S), 2, value, value, 0.125)
    args = recorder.calls["structured_fwd"]
    assert args[6:8] == (S, S)  # window, sinks
    stats = (torch.zeros(B, Hq, S), torch.zeros(B, Hq, S))
    cb._launch(q, q, k, v, q, torch.zeros(B, Hq, S), torch.empty_like(k), torch.empty_like(v), 2, value, 5, 0.125,
               stats)
    args = recorder.calls["structured_bwd"]
    assert args[10:12] == (S, 5)
    assert all(_int32(a) for a in args if isinstance(a, int))


@pytest.mark.parametrize("value", HUGE)
def test_token_and_decode_launchers_pass_int32(recorder, monkeypatch, value):
    B, Hq, Hkv, S, D, K = 2, 8, 2, 300, 128, 16
    qb = value - value % 128 or 128  # a multiple of 128, as the token kernel requires
    sel = sparse_k.TokenLayout(torch.zeros(B, Hkv, 1, K, dtype=torch.int32), torch.zeros(B, Hkv, 1, dtype=torch.int32),
                               qb, torch.zeros(B, dtype=torch.int64))
    q, k, v = torch.zeros(B, Hq, S, D), torch.zeros(B, Hkv, S, D), torch.zeros(B, Hkv, S, D)
    ct._launch(q, k, v, torch.empty_like(q), torch.empty(B, Hq, S), sel, 2, value, value, 0.125)
    args = recorder.calls["token_fwd"]
    assert args[9] == 384 and args[11:13] == (S, S)  # query block (300 rounded up to 128s), window, sinks
    monkeypatch.setattr(cd, "cuda_decode_ok", lambda *a, **kw: True)
    monkeypatch.setattr(cd, "_sm_count", lambda device: 132)
    cd.cuda_decode_forward(q[:, :, -1:], k, v, sel, pattern_id=2, window=value, sinks=value, scale=0.125)
    args = recorder.calls["decode_fwd"]
    assert args[12] == 384 and args[14:16] == (S, S)
    assert all(_int32(a) for a in args if isinstance(a, int))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("name,huge,exact", [
    ("sliding_window", {"window": 2**32 + 1}, "dense"), ("streaming", {"window": 100, "sinks": 2**32 + 3}, "dense"),
    ("block_diagonal", {"block": 2**32 + 64}, "dense"),
])
def test_kernels_with_huge_values_match_reference(name, huge, exact, D):
    """Through ``sparse_attention`` on the CUDA kernels (forward and backward): a window, sinks or block past int32
    covers every key, so the answer is dense causal attention."""
    B, Hq, Hkv, S = 1, 4, 2, 777
    g = torch.Generator(device="cuda").manual_seed(time.time_ns() % 2**31)
    q, k, v = (torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for h in (Hq, Hkv, Hkv))
    with plan.recording() as ran:
        out = sparse_attention(q, k, v, get_pattern(name, **huge), scale=D**-0.5)
        out.backward(torch.ones_like(out))
    assert any(r.kernel.startswith("cuda_sm90") for r in ran), [r.kernel for r in ran]
    geo = row_geometry(B, S, S, None, device="cuda")
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = reference_attention(qd, kd, vd, get_pattern(exact), geo, scale=D**-0.5)
    assert rel_err(out, ref) < 2e-2
    ref.backward(torch.ones_like(ref))
    if name != "block_diagonal":  # the CUDA backward computes dense, sliding_window and streaming
        assert rel_err(q.grad, qd.grad) < 3e-2 and rel_err(k.grad, kd.grad) < 3e-2
