"""First-call build times of the Hopper CUDA extensions and timings of their kernels alone (sm_90 GPU).

    SPARSE_K_CUDA_CACHE=/tmp/empty python scripts/cuda_build_and_time.py build
    python scripts/cuda_build_and_time.py bench

``build`` times each extension's first load (an empty ``SPARSE_K_CUDA_CACHE`` makes it a build);
``bench`` times the CUDA kernels through their wrappers, no dispatch, no Triton or Flex baselines:
forward sliding_window 4096 / streaming 4096 + 128 sinks / token top-2048 + window 1024 (query blocks
of 128) at S=65536, backward sliding_window 4096 at S=65536, dense causal forward at S=16384
(B=1, Hq=32, Hkv=8, D=128, bf16; ``do_bench`` medians, ms), and decode (B=8, top-2048 + window 1024,
S=32768; per call in a 20-call CUDA graph, us). The inputs are seeded, so two checkouts (before /
after a change, ``PYTHONPATH`` pointing at each) time the same rows; run them in turn, twice. One JSON
line per result, tagged with ``$TREE`` (default "?").
"""
import json
import os
import sys
import time

import sparse_k
import torch
import triton.testing
from sparse_k.attention.cuda import decode as cd
from sparse_k.attention.cuda import structured as cs
from sparse_k.attention.cuda import structured_bwd as cb
from sparse_k.attention.cuda import token as ct

TREE = os.environ.get("TREE", "?")


def emit(**row):
    print(json.dumps({"tree": TREE, **row}), flush=True)


def build():
    assert os.path.dirname(sparse_k.__file__).startswith(os.getcwd()), sparse_k.__file__
    for name, mod in (("structured_fwd", cs), ("token_fwd", ct), ("structured_bwd", cb), ("decode", cd)):
        t0 = time.time()
        mod.load_extension()
        emit(kind="build", ext=name, seconds=round(time.time() - t0, 1))


def bench_ms(fn):
    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def graph_us(fn, calls=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return 1e3 * bench_ms(g.replay) / calls


def bench_backward(q, k, v, scale):
    """Backward, sliding window 4096 (the forward's out and lse, random dO)."""
    out, lse = cs.cuda_structured_forward(q, k, v, pattern_id=1, window=4096, scale=scale)
    do = torch.randn_like(q)
    ms = bench_ms(lambda: cb.cuda_structured_backward(do, q, k, v, out, lse, pattern_id=1, window=4096, scale=scale))
    emit(kind="bwd", row="sliding_window_4096", S=q.shape[2], ms=round(ms, 3))


def bench():
    dev, dt, D = "cuda", torch.bfloat16, 128
    B, Hq, Hkv = 1, 32, 8
    scale = D ** -0.5
    gen = torch.Generator(device=dev).manual_seed(1234)

    def qkv(S, b=B):
        return [torch.randn(b, h, S, D, device=dev, dtype=dt, generator=gen) for h in (Hq, Hkv, Hkv)]

    S = 65536
    q, k, v = qkv(S)
    for name, pid, W, sinks in (("sliding_window_4096", 1, 4096, 0), ("streaming_4096_128", 2, 4096, 128)):
        ms = bench_ms(lambda pid=pid, W=W, sinks=sinks: cs.cuda_structured_forward(q, k, v, pattern_id=pid, window=W,
                                                                                  sinks=sinks, scale=scale))
        emit(kind="fwd", row=name, S=S, ms=round(ms, 3))
    # token layout: top-2048 spread over [0, block_start - 1024], window 1024, query_block 128
    QB, K, W = 128, 2048, 1024
    NB = S // QB
    b0 = torch.arange(NB, device=dev) * QB
    cand = (b0 - W + 1).clamp_min(0)
    j = torch.arange(K, device=dev)
    idx = torch.where(cand[:, None] >= K, torch.div(j[None] * cand[:, None], K, rounding_mode="floor"), j[None])
    sel = sparse_k.TokenLayout(idx.to(torch.int32)[None, None].expand(B, Hkv, NB, K),
                               cand.clamp_max(K).to(torch.int32)[None, None].expand(B, Hkv, NB), QB,
                               torch.zeros(B, dtype=torch.int64, device=dev))
    ms = bench_ms(lambda: ct.cuda_token_forward(q, k, v, sel, pattern_id=1, window=W, scale=scale))
    emit(kind="fwd", row="token_top2048_w1024", S=S, ms=round(ms, 3))
    bench_backward(q, k, v, scale)
    del q, k, v
    # dense causal forward, S=16K
    q, k, v = qkv(16384)
    ms = bench_ms(lambda: cs.cuda_structured_forward(q, k, v, pattern_id=0, scale=scale))
    emit(kind="fwd", row="dense", S=16384, ms=round(ms, 3))
    del q, k, v
    # decode: B=8, top-2048 + window 1024, S=32768, 20 calls per graph
    Bd, S = 8, 32768
    k = torch.randn(Bd, Hkv, S, D, device=dev, dtype=dt, generator=gen)
    v = torch.randn(Bd, Hkv, S, D, device=dev, dtype=dt, generator=gen)
    q = torch.randn(Bd, Hq, 1, D, device=dev, dtype=dt, generator=gen)
    NB = S // QB
    cand = (torch.arange(NB, device=dev) * QB - W + 1).clamp_min(0)
    idx = torch.where(cand[:, None] >= K, torch.div(j[None] * cand[:, None], K, rounding_mode="floor"), j[None])
    sel = sparse_k.TokenLayout(idx.to(torch.int32)[None, None].expand(Bd, Hkv, NB, K),
                               cand.clamp_max(K).to(torch.int32)[None, None].expand(Bd, Hkv, NB), QB,
                               torch.zeros(Bd, dtype=torch.int64, device=dev))
    us = graph_us(lambda: cd.cuda_decode_forward(q, k, v, sel, pattern_id=1, window=W, scale=scale))
    emit(kind="decode", row="token_top2048_w1024_B8", S=S, us=round(us, 2))


if __name__ == "__main__":
    {"build": build, "bench": bench}[sys.argv[1]]()
