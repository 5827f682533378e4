"""First-call build times of the Hopper CUDA extensions and timings of their kernels alone (sm_90 GPU).

    SPARSE_K_CUDA_CACHE=/tmp/empty python scripts/cuda_build_and_time.py build
    python scripts/cuda_build_and_time.py bench
    python scripts/cuda_build_and_time.py ab [--rows=fwd,bwd,token] before=/tmp/csrc_before [name=dir ...]

``build`` times each extension's first load (an empty ``SPARSE_K_CUDA_CACHE`` makes it a build);
``bench`` times the CUDA kernels through their wrappers, no dispatch, no Triton or Flex baselines:
forward sliding_window 4096 / streaming 4096 + 128 sinks / token top-2048 + window 1024 (query blocks
of 128) at S=65536, backward sliding_window 4096 at S=65536, dense causal forward at S=16384
(B=1, Hq=32, Hkv=8, D=128, bf16; ``do_bench`` medians, ms), and decode (B=8, top-2048 + window 1024,
S=32768; per call in a 20-call CUDA graph, us). The inputs are seeded, so two checkouts (before /
after a change, ``PYTHONPATH`` pointing at each) time the same rows; run them in turn, twice. One JSON
line per result, tagged with ``$TREE`` (default "?").

``ab`` times the structured forward and backward of other source trees in this process, beside this tree's:
each ``name=dir`` is a folder with another revision's ``csrc`` files (e.g. ``mkdir /tmp/csrc_before && git
archive REV kernel_src/attention/cuda/csrc | tar -x -C /tmp/csrc_before --strip-components=4``), built as its
own extensions. Per row (``AB_ROWS``: dense, windows, streaming, block_diagonal forwards; ``AB_D64_ROWS``: four of
them at head dim 64; ``AB_BWD_ROWS``: backwards; ``AB_TOKEN_SEQLENS``: the token forward of learned selection; B=1,
Hq=32, Hkv=8, D=128 unless named, bf16) the
builds run in turn, back-to-back launches averaged over ~120 ms, 5 rounds; the median of each and its ratio to this
tree's (> 1: this tree is faster), and the largest difference of its outputs from this tree's (0: bit for bit; the
backward: dK, dV and the float32 dQ accumulator of one call, whose reduce-adds run in no fixed order). ``--rows``
picks the groups to build and time (``AB_GROUPS``; default all), e.g. ``--rows=bwd`` for a backward-only change.
"""
import contextlib
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


def _qkv(S, gen, D=128):
    """Seeded q ``(1, 32, S, D)``, k and v ``(1, 8, S, D)``, bf16 on the GPU: the shapes of every row here."""
    return [torch.randn(1, h, S, D, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (32, 8, 8)]


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

    S = 65536
    q, k, v = _qkv(S, gen)
    for name, pid, W, sinks in (("sliding_window_4096", 1, 4096, 0), ("streaming_4096_128", 2, 4096, 128)):
        ms = bench_ms(lambda pid=pid, W=W, sinks=sinks: cs.cuda_structured_forward(q, k, v, pattern_id=pid, window=W,
                                                                                  sinks=sinks, scale=scale))
        emit(kind="fwd", row=name, S=S, ms=round(ms, 3))
    sel = _token_layout(S, B, Hkv, dev)
    ms = bench_ms(lambda: ct.cuda_token_forward(q, k, v, sel, pattern_id=1, window=1024, scale=scale))
    emit(kind="fwd", row="token_top2048_w1024", S=S, ms=round(ms, 3))
    bench_backward(q, k, v, scale)
    del q, k, v
    # dense causal forward, S=16K
    q, k, v = _qkv(16384, gen)
    ms = bench_ms(lambda: cs.cuda_structured_forward(q, k, v, pattern_id=0, scale=scale))
    emit(kind="fwd", row="dense", S=16384, ms=round(ms, 3))
    del q, k, v
    # decode: B=8, top-2048 + window 1024, S=32768, 20 calls per graph
    Bd, S = 8, 32768
    k = torch.randn(Bd, Hkv, S, D, device=dev, dtype=dt, generator=gen)
    v = torch.randn(Bd, Hkv, S, D, device=dev, dtype=dt, generator=gen)
    q = torch.randn(Bd, Hq, 1, D, device=dev, dtype=dt, generator=gen)
    sel = _token_layout(S, Bd, Hkv, dev)
    us = graph_us(lambda: cd.cuda_decode_forward(q, k, v, sel, pattern_id=1, window=1024, scale=scale))
    emit(kind="decode", row="token_top2048_w1024_B8", S=S, us=round(us, 2))


def _token_layout(S, B, Hkv, dev, QB=128, K=2048, W=1024):
    """The token layout of the ``bench`` / ``ab`` token rows: per query block of ``QB``, ``K`` keys spread evenly
    over ``[0, block_start - W]`` (all of them while fewer), for a window of ``W`` beside it."""
    NB = S // QB
    cand = (torch.arange(NB, device=dev) * QB - W + 1).clamp_min(0)
    j = torch.arange(K, device=dev)
    idx = torch.where(cand[:, None] >= K, torch.div(j[None] * cand[:, None], K, rounding_mode="floor"), j[None])
    return sparse_k.TokenLayout(idx.to(torch.int32)[None, None].expand(B, Hkv, NB, K),
                                cand.clamp_max(K).to(torch.int32)[None, None].expand(B, Hkv, NB), QB,
                                torch.zeros(B, dtype=torch.int64, device=dev))


#: ``ab`` rows: (name, pattern id, window or block, sinks, S).
AB_ROWS = (
    ("dense", 0, 0, 0, 16384), ("dense", 0, 0, 0, 65536),
    ("sliding_window_4096", 1, 4096, 0, 16384), ("sliding_window_4096", 1, 4096, 0, 65536),
    ("sliding_window_4096", 1, 4096, 0, 131072),
    ("streaming_4096_128", 2, 4096, 128, 65536), ("streaming_4096_128", 2, 4096, 128, 131072),
    ("streaming_4096_4", 2, 4096, 4, 16384), ("streaming_4096_4", 2, 4096, 4, 65536),
    ("streaming_4096_4", 2, 4096, 4, 131072),
    ("block_diagonal_4096", 3, 4096, 0, 16384), ("block_diagonal_4096", 3, 4096, 0, 65536),
    ("block_diagonal_4096", 3, 4096, 0, 131072), ("block_diagonal_1024", 3, 1024, 0, 65536),
    ("block_diagonal_512", 3, 512, 0, 65536),
)
#: ``ab`` rows of the structured forward at head dim 64, as ``AB_ROWS``; a build whose kernel refuses D = 64 (a
#: revision before it) is left out of them.
AB_D64_ROWS = (
    ("d64_dense", 0, 0, 0, 16384), ("d64_sliding_window_4096", 1, 4096, 0, 65536),
    ("d64_streaming_4096_128", 2, 4096, 128, 65536), ("d64_block_diagonal_4096", 3, 4096, 0, 65536),
)


#: ``ab`` backward rows: (name, pattern id, window, sinks, S).
AB_BWD_ROWS = (
    ("sliding_window_4096", 1, 4096, 0, 65536), ("streaming_4096_128", 2, 4096, 128, 65536), ("dense", 0, 0, 0, 16384),
)


#: ``ab`` token forward rows (``_token_layout``: top-2048 + window 1024, query blocks of 128): S.
AB_TOKEN_SEQLENS = (16384, 65536)


def _mean_ms(fn, n):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


#: ``ab``'s row groups: group -> (extension name prefix of another tree's build, its sources, this tree's module).
AB_GROUPS = {
    "fwd": ("structured_ab", ("structured_fwd_sm90.cpp", "structured_fwd_sm90.cu"), cs),
    "bwd": ("structured_bwd_ab", ("structured_bwd_sm90.cpp", "structured_bwd_sm90.cu"), cb),
    "token": ("token_ab", ("token_fwd_sm90.cpp", "token_fwd_sm90.cu"), ct),
}


def _holds_sources(folder, group):
    """Whether a csrc ``folder`` holds the CUDA source of ``AB_GROUPS[group]``."""
    return (folder / AB_GROUPS[group][1][1]).is_file()


def ab_args(argv):
    """``ab``'s command line -> (groups, name=dir specs): an optional first ``--rows=a,b`` of ``AB_GROUPS``."""
    groups = tuple(AB_GROUPS)
    if argv and argv[0].startswith("--rows"):
        flag, sep, value = argv[0].partition("=")
        picked = tuple(value.split(","))
        if flag != "--rows" or not sep or any(g not in AB_GROUPS for g in picked):
            raise SystemExit(f"ab: {argv[0]!r}: expected --rows= and a comma list of {', '.join(AB_GROUPS)}")
        groups, argv = picked, argv[1:]
    return groups, list(argv)


def ab(specs, groups=tuple(AB_GROUPS)):
    """The ``ab`` command (module docstring): ``specs`` are ``name=dir`` strings; ``groups`` the row groups to build
    and time. A folder's build of a group is timed when the folder holds that group's sources."""
    import pathlib

    from sparse_k.attention.cuda import build as cuda_build

    folders = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        src = pathlib.Path(folder).resolve()
        if not sep or not name or name in folders or name == "tree" or not any(_holds_sources(src, g) for g in groups):
            raise SystemExit(f"ab: {spec!r} is not name=dir with a new name (not 'tree') and a csrc folder holding "
                             f"the sources of one of {', '.join(groups)}")
        folders[name] = src
    if not torch.cuda.is_available():
        raise SystemExit("ab: needs an sm_90 GPU (torch.cuda.is_available() is False)")
    built = {g: {"tree": AB_GROUPS[g][2].load_extension()} for g in groups}
    here = cuda_build.CUDA_SRC_DIR
    try:
        for name, src in folders.items():
            cuda_build.CUDA_SRC_DIR = src
            for g in groups:
                if _holds_sources(src, g):
                    prefix, sources, _ = AB_GROUPS[g]
                    built[g][name] = cuda_build.load_sm90_extension(f"{prefix}_{name}", sources)
    finally:
        cuda_build.CUDA_SRC_DIR = here
    mods, bwd_mods, token_mods = (built.get(g, {}) for g in AB_GROUPS)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    stream = torch.cuda.current_stream().cuda_stream
    scale = 128 ** -0.5

    fwd_rows = [(*r, 128) for r in AB_ROWS] + [(*r, 64) for r in AB_D64_ROWS]
    for row, pid, W, sinks, S, D in fwd_rows if mods else ():
        q, k, v = _qkv(S, gen, D)
        outs = {m: _poisoned_outputs(q) for m in mods}
        calls = {m: (lambda m=m: mods[m].structured_fwd(q, k, v, *outs[m], pid, W, sinks, D ** -0.5, stream))
                 for m in mods}
        if D != 128:  # a build from before head dim 64 refuses the row
            calls = {m: call for m, call in calls.items() if m == "tree" or _runs(call)}
        _ab_rounds("ab", row, S, calls, lambda m: [outs[m][0]])
        del q, k, v, outs
    for row, pid, W, sinks, S in AB_BWD_ROWS if bwd_mods else ():
        q, k, v = _qkv(S, gen)
        do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        out, lse = cs.cuda_structured_forward(q, k, v, pattern_id=pid, window=W, sinks=sinks, scale=scale)
        delta = (do.float() * out.float()).sum(-1)
        lse2, delta = cb.padded_stats((delta, lse * 1.4426950408889634))
        grads = {m: (torch.zeros(1, 32, lse2.shape[2], 128, device="cuda"), torch.full_like(k, float("nan")),
                     torch.full_like(v, float("nan"))) for m in bwd_mods}
        calls = {m: (lambda m=m: bwd_mods[m].structured_bwd(q, k, v, do, lse2, delta, *grads[m], pid, W, sinks, scale,
                                                             stream)) for m in bwd_mods}
        _ab_rounds("ab_bwd", row, S, calls, lambda m: list(grads[m]))
        del q, k, v, do, out, lse, grads
    for S in AB_TOKEN_SEQLENS if token_mods else ():
        q, k, v = _qkv(S, gen)
        sel = _token_layout(S, q.shape[0], k.shape[1], "cuda")
        outs = {m: _poisoned_outputs(q) for m in token_mods}

        def call(m):
            with _token_extension(token_mods[m]):
                ct._launch(q, k, v, *outs[m], sel, 1, 1024, 0, scale)

        _ab_rounds("ab_token", "token_top2048_w1024", S, {m: (lambda m=m: call(m)) for m in token_mods},
                   lambda m: [outs[m][0]])
        del q, k, v, sel, outs


def _runs(call) -> bool:
    """Whether ``call`` returns (a build that refuses the row's shapes raises)."""
    try:
        call()
    except RuntimeError:
        return False
    return True


def _poisoned_outputs(q):
    """A forward's ``out`` (like q) and ``lse`` ``(B, Hq, S)`` float32, both NaN until a kernel writes them."""
    return torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"), device=q.device)


@contextlib.contextmanager
def _token_extension(mod):
    """``cuda.token``'s launches call ``mod`` (another build's token extension) inside the block."""
    here = ct.load_extension
    ct.load_extension = lambda: mod
    try:
        yield
    finally:
        ct.load_extension = here


def _ab_rounds(kind, row, S, calls, outputs):
    """One ``ab`` row: each build's call once (its outputs compared with this tree's), then 5 interleaved rounds of
    back-to-back calls; one JSON line per build. ``outputs(build)``: the tensors its first call wrote."""
    import statistics

    for call in calls.values():
        call()
    first = {m: [t.float().clone() for t in outputs(m)] for m in calls}
    n = max(3, int(120 / _mean_ms(calls["tree"], 3)))
    times = {m: [] for m in calls}
    for _ in range(5):
        for m, call in calls.items():
            times[m].append(_mean_ms(call, n))
    tree_ms = statistics.median(times["tree"])
    for m in calls:
        ms = statistics.median(times[m])
        diff = max((a - b).abs().max().item() for a, b in zip(first[m], first["tree"]))
        emit(kind=kind, build=m, row=row, S=S, ms=round(ms, 3), tree_speedup=round(ms / tree_ms, 3), max_diff=diff,
             nan=any(bool(t.isnan().any()) for t in first[m]))


def main(argv) -> int:
    """The command line (module docstring): ``build``, ``bench`` or ``ab ...``; ``-h`` / ``--help`` prints the
    docstring. A bad command, or a timing command without a GPU, ends with an error line (exit status 1)."""
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    command = argv[0] if argv else None
    if command not in ("build", "bench", "ab"):
        got = "no command" if command is None else f"unknown command {command!r}"
        raise SystemExit(f"cuda_build_and_time.py: expected build, bench or ab, got {got} (--help describes them)")
    if command == "ab":
        groups, specs = ab_args(argv[1:])
        ab(specs, groups)
        return 0
    if argv[1:]:
        raise SystemExit(f"{command}: takes no arguments, got {argv[1:]}")
    if not torch.cuda.is_available():
        raise SystemExit(f"{command}: needs an sm_90 GPU (torch.cuda.is_available() is False)")
    {"build": build, "bench": bench}[command]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
