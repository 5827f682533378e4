"""Tuning sweeps behind the decode and token-layout defaults, on an H100; the official rows come from
``benchmark_kernels.py``, the sweeps' results are in docs/history.md (Triton tuning).

* ``--part decode``: B=8, one query token, KV length ``--kv-len`` (131072), Hq=32, Hkv=8, D=128, bf16;
  sliding window 4096 and a top-2048 token layout. For each kernel variant (key tile ``BLOCK_N``,
  warps, pipeline stages) and each split count, the output is checked against the PyTorch path
  (relative error < 2e-2, else the row is void), then the whole call (split kernel + combine) is
  timed as CUDA-graph replays (GPU time; ``do_bench`` median). The baselines get the same two
  timings: SDPA flash on a pre-sliced window, and torch gather of the 2048 keys + SDPA flash.
  ``kernels_us`` splits the best variant's GPU time by kernel (torch.profiler).
* ``--part static``: the decode launch of a learned layer's compiled ``StaticCache`` step, as the Transformers
  adapter makes it (``sparse_k.sparse_attention`` with the cache's slot mask as a bool key mask and ``q_start`` on
  the device): B in ``--static-batches`` (1, 8), Hq=32, Hkv=8, D=128, bf16, caches of ``--static-lens`` (32K, 128K)
  keys plus 64 unwritten slots, sinks 4 + window 1024 + a top-2048 selection (query_block 128; random sorted keys
  among the block's candidates) with and without SparseK weights. Each row times ``--static-layers`` launches on
  distinct caches in one CUDA graph, each after a GEMV over a 117 MB weight (a model's MLP matrix: the K/V,
  index lists and kernel code are cold, as between a model's layers), minus the GEMVs alone; ``hot_us`` is the
  same launch repeated on one cache without GEMVs. Rows: the former and the current default key tile
  (``plan.TOKEN_DECODE_BLOCK_N``), each without the key mask, without the index prefetch, with fewer splits,
  the static part alone, and the adapter's whole call; ``floor_us`` is the K/V + index bytes at the GPU's
  memory bandwidth.
* ``--part sass`` (no GPU needed): registers, spill stack and local loads / stores of that launch's kernel compiled
  for sm_90a here (``triton.compile`` for a ``GPUTarget``, Triton's ``cuobjdump``), former and new defaults.
* ``--part token``: token-layout prefill (query_block 128, top-2048 + window 1024, B=1, S=``--seqlen``)
  over tiles / warps / stages / GQA packing, beside our sliding-window 3072 forward (effective TF/s).
* ``--part token_blocks``: token-layout prefill with short selection blocks (``--token-query-blocks``, per-query
  selection at 1; sinks 4 + window 256 + top-256 by default), per head shape (``--token-shapes`` Hq:Hkv:D), the
  plan's query tile against the other row counts.

Example: ``python scripts/tune_decode.py --part decode,token --json results/tune_decode.json``;
``python scripts/tune_decode.py --part static --json results/tune_static.json`` (about 2 minutes on an H100).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark_kernels as bk  # noqa: E402

import sparse_k  # noqa: E402
from sparse_k import build_block_layout, get_pattern, row_geometry, torch_sparse_attention  # noqa: E402

HQ, HKV = bk.HQ, bk.HKV
DECODE_VARIANTS = [  # (BLOCK_N, warps, stages, merge in the last split program instead of a combine kernel,
    #                     selected-key indices loaded one tile ahead: sel_prefetch, unmasked row-major gathers: sel_lean,
    #                     far-tile shortcut: sel_fast 0 / 1 per tile / 2 per block first); the default second
    (64, 4, 3, True, True, False, 0), (64, 4, 3, True, True, True, 0), (64, 4, 3, True, True, True, 2),
    (32, 4, 3, True, True, True, 0),
]
DECODE_SPLITS = (3, 4, 5)
TOKEN_VARIANTS = [  # (BLOCK_M, BLOCK_N, warps, stages, pack, sel_fast, sel_prefetch, sel_lean); rows per head BLOCK_M // pack
    (128, 64, 8, 3, 4, 2, True, True), (128, 64, 8, 3, 4, 1, True, True), (128, 64, 8, 3, 4, 0, True, True),
    (128, 64, 8, 3, 4, 2, True, False), (128, 64, 8, 3, 4, 2, False, True), (128, 64, 8, 4, 4, 2, True, True),
]


def gbench(fn) -> float:
    """CUDA-graph replay median in ms with a shorter do_bench budget than the benchmark's (many rows)."""
    return bk.graph_bench(fn, warmup_ms=10, rep_ms=100)


def _us(ms):
    return None if ms is None else round(1e3 * ms, 2)


def part_decode(args, rows):
    from sparse_k.attention import dispatch

    dev, dtype, B, D, S = args.device, args.dtype, 8, 128, args.kv_len
    g = torch.Generator(device=dev).manual_seed(S + 1)
    k = torch.randn(B, HKV, S, D, device=dev, dtype=dtype, generator=g)
    v = torch.randn(B, HKV, S, D, device=dev, dtype=dtype, generator=g)
    q = torch.randn(B, HQ, 1, D, device=dev, dtype=dtype, generator=g)
    scale = D ** -0.5
    geo = row_geometry(B, 1, S, None, device=dev)
    pats = {
        "sliding_window": (get_pattern("sliding_window", window=args.window), None),
        "token_top2048": None,
    }
    p_tok = get_pattern("sparse_k", sinks=0, window=1, top_k=2048, query_block=128)
    sel = bk.token_selection(B, 1, S, p_tok, dev)
    pats["token_top2048"] = (p_tok, sel)
    # The same 2048 keys per head as one contiguous run (the 2048 before the query): the gather's
    # access pattern against the bytes alone (a probe, not a target row).
    run = (S - 2049 + torch.arange(2048, device=dev, dtype=torch.int32)).expand_as(sel.indices).contiguous()
    pats["token_contig2048"] = (p_tok, sparse_k.TokenLayout(run, sel.counts, sel.query_block, sel.first_block))
    for name, (p, s) in pats.items():
        if name not in args.patterns:
            continue
        if s is None:
            ref = torch_sparse_attention(q, k, v, build_block_layout(p, 1, S, geo, block_q=1, block_k=128,
                                                                     num_kv_heads=HKV), scale=scale)[0]
            keys = args.window
        else:
            ref = sparse_k.sparse_attention(q, k, v, p, backend="torch", selection=s)
            keys = 2049
        nbytes = 2 * B * HKV * keys * D * k.element_size()
        best = {}
        lays = {}
        for bn, warps, stages, fuse, pf, lean, fast in DECODE_VARIANTS:
            if bn not in lays:
                lays[bn] = build_block_layout(p, 1, S, geo, block_q=4, block_k=bn, num_kv_heads=HKV)
            lay = lays[bn]
            if name == "token_contig2048" and (bn, warps, stages, fuse, pf, lean, fast) != DECODE_VARIANTS[0]:
                continue  # the probe runs one variant
            for splits in DECODE_SPLITS:
                if splits == 1 and fuse:
                    continue  # nothing to merge: the same launch as the unfused row
                if (pf or lean or fast) and s is None:
                    continue  # no selected keys: the same launch as without them
                row = dict(part="decode", pattern=name, S=S, bn=bn, warps=warps, stages=stages, fused=fuse, pf=pf,
                           lean=lean, fast=fast, splits=splits)

                def fn(lay=lay, splits=splits, warps=warps, stages=stages, fuse=fuse, pf=pf, lean=lean, fast=fast):
                    return dispatch.attention_forward(q, k, v, lay, scale=scale, pack=4, num_splits=splits,
                                                      num_warps=warps, num_stages=stages, selection=s,
                                                      fuse_combine=fuse, sel_prefetch=pf, sel_lean=lean, sel_fast=fast)

                try:
                    row["err"] = bk.rel_err(fn()[0], ref)
                    if row["err"] < bk.TOL:
                        row["graph_us"] = _us(gbench(fn))
                        row["gbps"] = round(nbytes / (row["graph_us"] * 1e-6) / 1e9)
                        key = (fuse, pf, lean, fast)
                        if best.get(key) is None or row["graph_us"] < best[key][0]:
                            best[key] = (row["graph_us"], fn, row)
                    else:
                        row["error"] = "check failed: void"
                except Exception as e:  # noqa: BLE001 — a variant that fails to compile is reported
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
        for (fuse, pf, lean, fast), b in sorted(best.items()):
            r = dict(part="decode", pattern=name, S=S, what=("best fused" if fuse else "best with combine kernel")
                     + (", prefetch" if pf else "") + (", lean" if lean else "") + (f", fast {fast}" if fast else ""),
                     **{k_: b[2][k_] for k_ in ("bn", "warps", "stages", "fused", "pf", "lean", "fast", "splits")})
            r["graph_us"] = b[0]
            r["graph10_us"] = _us(bk.graph_bench(b[1], calls=10, warmup_ms=10, rep_ms=100))
            r["eager_us"] = _us(bk.bench(b[1]))
            r["kernels_us"] = {k_: round(1e3 * t, 2) for k_, t in bk.kernel_times(b[1], iters=20).items()}
            rows.append(r)
            print(json.dumps(r), flush=True)
        base = dict(part="decode", pattern=name, S=S, what="baseline")
        try:
            if s is None:
                ks, vs = k[:, :, -args.window :], v[:, :, -args.window :]

                def bfn():
                    return bk.sdpa(q, ks, vs, "flash", causal=False)

                base["baseline"] = "SDPA flash on a pre-sliced window"
            elif name == "token_contig2048":
                continue  # a probe: no baseline row
            else:
                blk = s.indices[:, :, -1].long()

                def bfn():
                    kg = k.gather(2, blk[..., None].expand(-1, -1, -1, D))
                    vg = v.gather(2, blk[..., None].expand(-1, -1, -1, D))
                    return bk.sdpa(q, kg, vg, "flash", causal=False)

                base["baseline"] = "torch gather + SDPA flash"
            base["err"] = bk.rel_err(bfn(), ref)
            base["graph_us"] = _us(bk.graph_bench(bfn))
            base["graph10_us"] = _us(bk.graph_bench(bfn, calls=10, warmup_ms=10, rep_ms=100))
            base["eager_us"] = _us(bk.bench(bfn))
        except Exception as e:  # noqa: BLE001
            base["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append(base)
        print(json.dumps(base), flush=True)
    del k, v


#: ``--part static`` rows: (label, key tile or None for ``plan``'s default, splits or None for ``plan.split_count``,
#: key mask, dispatch options, batch sizes it runs at (None: every one), with and without weights (else with)).
_OLD = {"sel_prefetch": True, "merge_rows": False}  # the former defaults' launch options (with 64-key tiles)
STATIC_ROWS = [
    ("old default: 64-key tiles, index prefetch, per-split merge", 64, None, True, _OLD, None, True),
    ("new default", None, None, True, {}, None, True),
    ("64-key tiles, no index prefetch", 64, None, True, {"sel_prefetch": False}, None, False),
    ("32-key tiles, index prefetch", 32, None, True, {"sel_prefetch": True}, (1,), False),
    ("new default, per-split merge", None, None, True, {"merge_rows": False}, (1,), False),
    ("old default, row merge", 64, None, True, {"sel_prefetch": True}, (1,), False),
    ("new default, no key mask", None, None, False, {}, None, False),
    ("old default, no key mask", 64, None, False, _OLD, (1,), False),
    ("new default, 16 splits", None, 16, True, {}, (1,), False),
    ("new default, 8 splits", None, 8, True, {}, (1,), False),
    ("old default, 16 splits", 64, 16, True, _OLD, (1,), False),
    ("new default, merge kernel", None, None, True, {"fuse_combine": False}, (1,), False),
    ("old default, merge kernel", 64, None, True, {**_OLD, "fuse_combine": False}, (1,), False),
    ("static part alone (new default tiles)", None, None, True, {}, (1,), False),
    ("adapter call (geometry + launch)", None, None, True, {}, None, True),
]
#: Memory bandwidth by device name (GB/s) for ``floor_us``.
_BANDWIDTH = {"H200": 4800, "H100": 3350}


def _graph_us(calls, fillers=None, dry=False) -> float | None:
    """Microseconds of one replay of a CUDA graph holding ``calls`` (each after its filler, when given), minus
    the fillers' own graph. ``dry`` (CPU, interpreter): the calls run once and None is returned."""
    if dry:
        for i, fn in enumerate(calls):
            if fillers:
                fillers[i % len(fillers)]()
            fn()
        return None

    def graph_of(seq):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in seq:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for fn in seq:
                fn()
        return graph

    seq = [f for i, fn in enumerate(calls) for f in ((fillers[i % len(fillers)], fn) if fillers else (fn,))]
    t = bk.bench(graph_of(seq).replay, 10, 100)
    if fillers:
        t -= bk.bench(graph_of([fillers[i % len(fillers)] for i in range(len(calls))]).replay, 10, 100)
    return 1e3 * t


def _static_selection(B, n, p, weighted, dev, g):
    """A decode step's ``TokenLayout`` over ``n`` written keys: per (row, KV head) ``top_k`` distinct sorted keys
    among the query block's candidates ``[sinks, block_start - window]``, counts full, SparseK-like weights."""
    block = (n - 1) // p.query_block
    lo, hi = p.sinks, block * p.query_block - p.window  # inclusive candidate range
    n_cand = max(0, hi - lo + 1)
    K = min(p.top_k, n_cand)
    pick = torch.rand(B * HKV, n_cand, device=dev, generator=g).topk(K, dim=-1).indices.sort(-1).values
    idx = (lo + pick).to(torch.int32).view(B, HKV, 1, K).contiguous()
    cnt = torch.full((B, HKV, 1), K, dtype=torch.int32, device=dev)
    w = None
    if weighted:
        w = (0.05 + 0.95 * torch.rand(B, HKV, 1, K, device=dev, generator=g)).contiguous()
    first = torch.full((B,), block, dtype=torch.int64, device=dev)
    return sparse_k.TokenLayout(idx, cnt, p.query_block, first, w), K


def part_static(args, rows):
    from sparse_k.attention import dispatch, plan
    from sparse_k.attention.decode_layout import decode_layout

    dev, dtype, D = args.device, args.dtype, args.head_dim
    p = get_pattern("sparse_k", sinks=args.static_sinks, window=args.static_window, top_k=args.static_top_k,
                    query_block=args.static_query_block)
    dry = bool(args.dry_run)
    name = "cpu" if dry else torch.cuda.get_device_name()
    bw = next((v for k_, v in _BANDWIDTH.items() if k_ in name), None)
    g = torch.Generator(device=dev).manual_seed(15)
    hidden, inter = (64, 96) if dry else (4096, 14336)
    mlp = [torch.randn(inter, hidden, device=dev, dtype=dtype, generator=g) for _ in range(2)]
    x = torch.randn(hidden, device=dev, dtype=dtype, generator=g)
    fillers = [lambda w=w: torch.mv(w, x) for w in mlp]
    scale = D ** -0.5
    for B in args.static_batches:
        for n in args.static_lens:
            slots = n + 64
            per_layer = 2 * B * HKV * slots * D * torch.finfo(dtype).bits // 8
            layers = max(1, min(args.static_layers, int(args.static_memory_gb * 1e9) // per_layer))
            caches = [(torch.randn(B, HKV, slots, D, device=dev, dtype=dtype, generator=g),
                       torch.randn(B, HKV, slots, D, device=dev, dtype=dtype, generator=g)) for _ in range(layers)]
            # the query as a Transformers layer passes it: (B, 1, Hq, D) projections seen as (B, Hq, 1, D)
            qs = [torch.randn(B, 1, HQ, D, device=dev, dtype=dtype, generator=g).transpose(1, 2) for _ in range(layers)]
            mask = (torch.arange(slots, device=dev)[None] < n).expand(B, slots).contiguous()  # written slots (bool)
            q_start = torch.full((B,), n - 1, dtype=torch.int64, device=dev)
            geo = row_geometry(B, 1, slots, mask, q_start, device=dev)
            for weighted in (True, False):
                sels = [_static_selection(B, n, p, weighted, dev, g) for _ in range(layers)]
                K = sels[0][1]
                keys = min(p.sinks, max(0, n - p.window)) + min(p.window, n) + K
                nbytes = B * HKV * (keys * 2 * D * torch.finfo(dtype).bits // 8 + K * (4 + (4 if weighted else 0)))
                q0, (k0, v0), (s0, _) = qs[0], caches[0], sels[0]
                ref = sparse_k.sparse_attention(q0, k0, v0, p, backend="torch", attention_mask=mask, q_start=q_start,
                                                selection=s0)
                tiles = plan.plan_tiles(q_len=1, group=HQ // HKV, head_dim=D, device_type=torch.device(dev).type,
                                        need_grad=False, selection=True)
                extra = [("CUDA decode kernel, written prefix (plain geometry)", None, None, False, {}, None, True)]
                for label, bn, splits, use_mask, opts, batches, both in STATIC_ROWS + (extra if args.static_cuda else []):
                    if (batches is not None and B not in batches) or not (weighted or both):
                        continue
                    row = dict(part="static", B=B, kv_len=n, slots=slots, weights=weighted, what=label, layers=layers)
                    try:
                        block_n = tiles.block_k if bn is None else bn
                        if dry:
                            block_n = min(block_n, 16)  # the interpreter's tiles (dry run)
                        static_only = label.startswith("static")
                        if label.startswith("CUDA"):
                            geo_plain = row_geometry(B, 1, n, None, None, device=dev)
                            lay = decode_layout(p, 1, n, geo_plain, block_q=tiles.block_q, block_k=block_n, num_kv_heads=HKV)
                            with plan.recording() as seen:
                                dispatch.attention_forward(qs[0], caches[0][0][:, :, :n], caches[0][1][:, :, :n], lay,
                                                           scale=scale, pack=tiles.pack, num_splits=2, selection=sels[0][0])
                            row["kernel"] = seen[-1].kernel if seen else None

                            def make(i, lay=lay):
                                qi, (ki, vi), (si, _) = qs[i], caches[i], sels[i]
                                return lambda: dispatch.attention_forward(qi, ki[:, :, :n], vi[:, :, :n], lay, scale=scale,
                                                                          pack=tiles.pack, num_splits=2, selection=si)
                        elif label.startswith("adapter"):
                            def make(i):
                                qi, (ki, vi), (si, _) = qs[i], caches[i], sels[i]
                                return lambda: sparse_k.sparse_attention(qi, ki, vi, p, attention_mask=mask, q_start=q_start,
                                                                         selection=si, backend="triton")
                        else:
                            lay = decode_layout(p, 1, slots, geo, block_q=tiles.block_q, block_k=block_n, num_kv_heads=HKV)
                            sel_tiles = 0 if static_only else -(-K // block_n)
                            ns = splits or plan.split_count(B * HKV * (HQ // HKV // tiles.pack), (1 << 30) + sel_tiles,
                                                            torch.device(dev), gathered=not static_only)
                            row.update(bn=block_n, splits=ns)

                            def make(i, lay=lay, ns=ns, use_mask=use_mask, opts=opts, static_only=static_only):
                                qi, (ki, vi), (si, _) = qs[i], caches[i], sels[i]
                                return lambda: dispatch.attention_forward(
                                    qi, ki, vi, lay, scale=scale, key_mask=mask if use_mask else None, pack=tiles.pack,
                                    num_splits=ns, selection=None if static_only else si, **opts)
                        calls = [make(i) for i in range(layers)]
                        with plan.recording() as seen:
                            out = calls[0]()
                        row.setdefault("kernel", seen[-1].kernel if seen else None)
                        if not static_only:
                            row["err"] = bk.rel_err(out[0] if isinstance(out, tuple) else out, ref)
                            if row["err"] >= bk.TOL:
                                row["error"] = "check failed: void"
                        if "error" not in row:
                            row["cold_us"] = _graph_us(calls, fillers, dry)
                            hot = None if dry else _graph_us([calls[0]] * layers)  # (dry: the cold row ran them)
                            row["hot_us"] = None if hot is None else hot / layers
                            if row["cold_us"] is not None:
                                row["cold_us"] /= layers
                                b = 2 * B * HKV * (min(p.sinks, max(0, n - p.window)) + min(p.window, n)) * D * 2 if static_only else nbytes
                                row["gbps"] = round(b / (row["cold_us"] * 1e-6) / 1e9)
                                if bw:
                                    row["floor_us"] = round(b / (bw * 1e9) * 1e6, 2)
                    except Exception as e:  # noqa: BLE001 — a variant that fails is reported, the others run
                        traceback.print_exc()
                        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            caches = qs = sels = calls = make = lay = ref = out = q0 = k0 = v0 = s0 = None  # free this shape's caches
            if not dry:
                torch.cuda.empty_cache()


#: ``--part sass`` variants: (label, constexpr overrides of the StaticCache decode launch of ``_SASS_BASE``).
SASS_VARIANTS = [
    ("64-key tiles, index prefetch, weights, per-split merge (former sparse_k default)",
     {"BLOCK_N": 64, "SEL_PREFETCH": True, "MERGE_ROWS": False}),
    ("64-key tiles, index prefetch, no weights, per-split merge (former dsa default)",
     {"BLOCK_N": 64, "SEL_PREFETCH": True, "HAS_SELW": False, "MERGE_ROWS": False}),
    ("64-key tiles, no prefetch, weights", {"BLOCK_N": 64}),
    ("32-key tiles, index prefetch, weights", {"SEL_PREFETCH": True}),
    ("32-key tiles, no prefetch, weights (new default)", {}),
    ("32-key tiles, no prefetch, no weights (new default)", {"HAS_SELW": False}),
    ("static part only", {"HAS_SEL": False, "HAS_SELW": False, "SEL_LEAN": False}),
]
_SASS_BASE = dict(PATTERN=2, CAUSAL=True, PACK=4, BLOCK_M=16, BLOCK_N=32, HEAD_DIM=128, EVEN_N=True, HAS_SOFTCAP=False,
                  HAS_SINK=False, HAS_KMASK=True, SPLIT=True, LAYOUT_B=0, LAYOUT_H=0, USE_TMA=False, FULL_CONTIG=False,
                  HAS_SEL=True, HAS_SELW=True, HEADS_FIRST=False, FUSE_COMBINE=True, BLOCK_S=64, SEL_FAST=0,
                  SEL_PREFETCH=False, SEL_LEAN=True, SEL_SCAN=2048, DIL_SCALES=0, STRUCT=True, MERGE_ROWS=True)


def part_sass(args, rows):
    """Registers, spill stack and local loads / stores of the split-KV decode kernel (``_attn_fwd`` as a B=1 StaticCache
    step of a learned layer launches it: Hq / Hkv = 4 packed, D = 128, bf16, key mask, fused merge of 33 splits),
    compiled for sm_90a on this machine: ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` and Triton's own
    ``cuobjdump``; no GPU needed."""
    import re
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sparse_k.attention.triton import fwd

    ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*fp32", "LSE": "*fp32", "SINK": "*fp32", "KMASK": "*u8",
           "QSTART": "*i64", "KSTART": "*i64", "KEND": "*i64", "FNUM": "*i32", "FIDX": "*i32", "PNUM": "*i32",
           "PIDX": "*i32", "SEL_IDX": "*i32", "SEL_CNT": "*i32", "SEL_W": "*fp32", "FIRST_BLOCK": "*i64",
           "OUT_F": "*bf16", "LSE_F": "*fp32", "SEM": "*i32", "scale_log2": "fp32", "softcap": "fp32", "BBT": "*i32"}
    tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")
    variants = SASS_VARIANTS[:1] if args.dry_run else SASS_VARIANTS
    # constexpr parameters the launch leaves at their defaults stay compile-time constants here too (a name missing
    # from the signature's constants would be compiled as a run-time integer, and branches on it would not fold)
    defaults = {p.name: p.default for p in fwd._attn_fwd.params if p.is_constexpr and p.has_default}
    for label, over in variants:
        consts = {**defaults, **_SASS_BASE, **over}
        sig = {n: "constexpr" if n in consts else ptr.get(n, "i32") for n in fwd._attn_fwd.arg_names}
        row = dict(part="sass", what=label, triton=triton.__version__, **{k_: consts[k_] for k_ in ("BLOCK_N", "SEL_PREFETCH", "HAS_SELW")})
        try:
            kern = triton.compile(ASTSource(fwd._attn_fwd, sig, consts), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "num_stages": 3})
            path = os.path.join(args.sass_dir, f"attn_fwd_{len(rows)}.cubin")
            os.makedirs(args.sass_dir, exist_ok=True)
            with open(path, "wb") as f:
                f.write(kern.asm["cubin"])
            res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
            sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
            row["registers"] = int(re.search(r"REG:(\d+)", res).group(1))
            row["spill_stack"] = int(re.search(r"STACK:(\d+)", res).group(1))
            row["local_ld_st"] = len(re.findall(r"\b(?:LDL|STL)\b", sass))
            row["sass_instructions"] = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))
        except Exception as e:  # noqa: BLE001 — no NVIDIA backend or tools here: say so, keep the other parts
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append(row)
        print(json.dumps(row), flush=True)


def part_token(args, rows):
    from sparse_k.attention import dispatch

    dev, dtype, D, S = args.device, args.dtype, 128, args.seqlen
    p_tok = get_pattern("sparse_k", sinks=0, window=1024, top_k=2048, query_block=128)
    p_sw = get_pattern("sliding_window", window=3072)
    q, k, v = bk._inputs(1, S, D, dtype, dev, S + 5)
    geo = row_geometry(1, S, S, None, device=dev)
    scale = D ** -0.5
    sel = bk.token_selection(1, S, S, p_tok, dev)
    n = min(S, 256)  # queries per checked slice (the dry run's S is shorter)
    refs = [(q0, sparse_k.sparse_attention(q[:, :, q0 : q0 + n], k, v, p_tok, backend="torch", selection=sel, q_start=q0))
            for q0 in sorted({0, S - n})]
    lay_sw = build_block_layout(p_sw, S, S, geo, block_q=128, block_k=128, num_kv_heads=HKV)
    sw_ms = bk.bench(lambda: dispatch.attention_forward(q, k, v, lay_sw, scale=scale))
    sw_tf = 4.0 * bk.allowed_pairs(lay_sw, S) * HQ * D / sw_ms / 1e9
    rows.append(dict(part="token", S=S, what="sw3072 (default forward)", ms=round(sw_ms, 3), tflops=round(sw_tf, 1)))
    print(json.dumps(rows[-1]), flush=True)
    pairs = []
    for bm, bn, warps, stages, pack, fast, pf, lean in TOKEN_VARIANTS:
        row = dict(part="token", S=S, bm=bm, bn=bn, warps=warps, stages=stages, pack=pack, fast=fast, pf=pf, lean=lean)

        def make(bm=bm, bn=bn, warps=warps, stages=stages, pack=pack, fast=fast, pf=pf, lean=lean):
            lay = build_block_layout(p_tok, S, S, geo, block_q=bm // pack, block_k=bn, num_kv_heads=HKV)
            if not pairs:
                pairs.append((bk.allowed_pairs(lay, S) + bk.selected_pairs(sel, S, S)) * HQ)
            return lambda: dispatch.attention_forward(q, k, v, lay, scale=scale, pack=pack, num_warps=warps,
                                                      num_stages=stages, selection=sel, sel_fast=fast,
                                                      sel_prefetch=pf, sel_lean=lean)

        def rates(row):
            row["tflops"] = round(4.0 * pairs[0] * D / row["ms"] / 1e9, 1)
            row["ratio_vs_sw3072"] = round(row["tflops"] / sw_tf, 3)

        _checked_row(rows, row, make, refs, n, rates)


def _checked_row(rows, row, make, refs, n: int, rates=None) -> None:
    """One timing row: ``make()`` builds the call, whose output's largest relative error against ``refs`` (pairs
    ``(q0, the PyTorch path's output for queries [q0, q0 + n))``) goes to ``row["err"]``; within ``bk.TOL`` it is
    timed (``row["ms"]``, then ``rates(row)``), else the row is void; an exception is recorded in ``row["error"]``.
    The row is appended to ``rows`` and printed."""
    try:
        fn = make()
        out = fn()[0]
        row["err"] = max(bk.rel_err(out[:, :, q0: q0 + n], r) for q0, r in refs)
        del out
        if row["err"] < bk.TOL:
            row["ms"] = round(bk.bench(fn), 3)
            if rates is not None:
                rates(row)
        else:
            row["error"] = "check failed: void"
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
    rows.append(row)
    print(json.dumps(row), flush=True)


def _spread_selection(Hkv: int, S: int, p, dev):
    """``bk.token_selection`` for ``Hkv`` KV heads (B=1): every block's ``top_k`` keys spread evenly over its
    candidates, so neighbouring blocks' lists share most key tiles (as a real model's neighbouring queries do;
    docs/selection.md)."""
    sel = bk.token_selection(1, S, S, p, dev)
    return sparse_k.TokenLayout(sel.indices[:, :1].expand(1, Hkv, *sel.indices.shape[2:]),
                                sel.counts[:, :1].expand(1, Hkv, sel.counts.shape[2]), sel.query_block, sel.first_block)


def part_token_blocks(args, rows):
    """Token-layout prefill with short selection blocks (per-query selection): for each head shape and query block,
    the tile the plan picks (``plan.selection_prefill_config``) and every other power-of-two row count a head, each
    checked against the PyTorch path on two slices of queries, then timed."""
    from sparse_k.attention import dispatch
    from sparse_k.attention.plan import selection_prefill_config

    dev, dtype, S = args.device, args.dtype, args.seqlen
    for shape in args.token_shapes:
        hq, hkv, D = (int(x) for x in shape.split(":"))
        if args.dry_run:
            D = args.head_dim
        g = torch.Generator(device=dev).manual_seed(S + hq)
        q, k, v = (torch.randn(1, h, S, D, device=dev, dtype=dtype, generator=g) for h in (hq, hkv, hkv))
        geo = row_geometry(1, S, S, None, device=dev)
        for qb in args.token_query_blocks:
            p = get_pattern("sparse_k", sinks=args.token_sinks, window=args.token_window, top_k=args.token_top_k,
                            query_block=qb)
            sel = _spread_selection(hkv, S, p, dev)
            n = min(S, args.token_check_queries)
            refs = [(q0, sparse_k.sparse_attention(q[:, :, q0: q0 + n], k, v, p, backend="torch", selection=sel,
                                                    q_start=q0)) for q0 in sorted({0, S - n})]
            plan_rows, pack, bn = selection_prefill_config(hq // hkv, "cuda", D, qb)
            cands = sorted({plan_rows, *(r for r in (16, 32, 64, 128) if 16 <= r * pack <= 128)})
            for rph in cands:
                row = dict(part="token_blocks", S=S, heads=shape, D=D, query_block=qb, rows=rph, pack=pack, bn=bn,
                           plan=rph == plan_rows)

                def make(rph=rph, p=p, sel=sel, pack=pack, bn=bn):
                    lay = build_block_layout(p, S, S, geo, block_q=rph, block_k=bn, num_kv_heads=hkv)
                    return lambda: dispatch.attention_forward(q, k, v, lay, scale=D ** -0.5, pack=pack, selection=sel)

                _checked_row(rows, row, make, refs, n)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", type=lambda s: s.split(","), default=["decode", "token"])
    ap.add_argument("--patterns", type=lambda s: s.split(","), default=["sliding_window", "token_top2048"],
                    help="decode patterns: sliding_window, token_top2048, token_contig2048 (probe)")
    ap.add_argument("--kv-len", type=int, default=131072)
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--static-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--static-lens", type=lambda s: [int(x) for x in s.split(",")], default=[32768, 131072])
    ap.add_argument("--static-layers", type=int, default=8, help="distinct caches per graph (cold rows)")
    ap.add_argument("--static-memory-gb", type=float, default=24.0, help="at most this much K/V for the caches")
    ap.add_argument("--static-sinks", type=int, default=4)
    ap.add_argument("--static-window", type=int, default=1024)
    ap.add_argument("--static-top-k", type=int, default=2048)
    ap.add_argument("--static-query-block", type=int, default=128)
    ap.add_argument("--static-cuda", action="store_true",
                    help="also time the Hopper CUDA decode kernel on the written prefix (plain geometry; builds its extension)")
    ap.add_argument("--token-shapes", type=lambda s: s.split(","), default=["9:3:64", "32:8:128"],
                    help="--part token_blocks: Hq:Hkv:D head shapes")
    ap.add_argument("--token-query-blocks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64],
                    help="--part token_blocks: selection blocks (queries sharing one key list)")
    ap.add_argument("--token-sinks", type=int, default=4)
    ap.add_argument("--token-window", type=int, default=256)
    ap.add_argument("--token-top-k", type=int, default=256)
    ap.add_argument("--token-check-queries", type=int, default=256, help="queries per checked slice")
    ap.add_argument("--sass-dir", default=os.path.join("results", "sass"), help="--part sass: where the cubins go")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, fp16, no timing (tests this script)")
    args = ap.parse_args(argv)
    args.device, args.dtype, args.head_dim = "cuda", torch.bfloat16, 128
    if args.dry_run:
        args.device, args.dtype, args.head_dim = "cpu", torch.float16, 16
        bk.bench = bk.graph_bench = lambda fn, *a, **k: (fn(), 1e-3)[1]
        bk.kernel_times = lambda fn, iters=3: {}
        global DECODE_VARIANTS, DECODE_SPLITS, TOKEN_VARIANTS
        DECODE_VARIANTS, DECODE_SPLITS, TOKEN_VARIANTS = DECODE_VARIANTS[:2], (1, 3), TOKEN_VARIANTS[:2]
        global STATIC_ROWS
        STATIC_ROWS = [(*r[:5], None, r[6]) for r in STATIC_ROWS if r[0].startswith(("old default: ", "static", "adapter"))
                       or r[0] in ("new default", "new default, 8 splits")]
        args.static_batches, args.static_lens, args.static_layers = [2], [203], 2
        args.static_window, args.static_top_k, args.static_query_block = 32, 40, 16
        args.seqlen, args.token_window, args.token_top_k, args.token_check_queries = 160, 24, 32, 48
    elif not torch.cuda.is_available() and set(args.part) - {"sass"}:
        print("tune_decode.py needs a CUDA GPU (but --part sass)", file=sys.stderr)
        return 2
    import triton

    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__, triton=triton.__version__,
                command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]))
    print(json.dumps(meta), flush=True)
    rows = []
    for part in args.part:
        try:
            {"decode": part_decode, "token": part_token, "token_blocks": part_token_blocks, "static": part_static,
             "sass": part_sass}[part](args, rows)
        except Exception:  # noqa: BLE001 — keep the other part
            traceback.print_exc()
        torch.cuda.empty_cache()
    for r in rows:
        if r.get("part") == "sass":
            print("sass", r["what"], *(f"{k_}={r.get(k_)}" for k_ in ("registers", "spill_stack", "local_ld_st",
                                                                      "sass_instructions", "error") if k_ in r))
    skeys = ("B", "kv_len", "weights", "what", "kernel", "bn", "splits", "cold_us", "hot_us", "floor_us", "gbps", "err", "error")
    if any(r.get("part") == "static" for r in rows):
        print("| " + " | ".join(skeys) + " |")
        for r in rows:
            if r.get("part") == "static":
                print("| " + " | ".join(bk._fmt(r.get(k_)) for k_ in skeys) + " |")
    tkeys = ("heads", "D", "query_block", "rows", "pack", "plan", "ms", "err", "error")
    if any(r.get("part") == "token_blocks" for r in rows):
        print("| " + " | ".join(tkeys) + " |")
        for r in rows:
            if r.get("part") == "token_blocks":
                print("| " + " | ".join(bk._fmt(r.get(k_)) for k_ in tkeys) + " |")
    keys = ("part", "pattern", "what", "bm", "bn", "warps", "stages", "fused", "pf", "lean", "pack", "fast", "splits", "graph_us",
            "graph10_us", "eager_us", "gbps",
            "ms", "tflops", "ratio_vs_sw3072", "err", "error")
    print("| " + " | ".join(keys) + " |")
    for r in rows:
        if r.get("part") == "decode" and r.get("what") is None and r.get("graph_us") is not None:
            continue  # the per-split rows are in the JSON; print the summary rows below
        if r.get("part") in ("token_blocks", "static", "sass"):
            continue  # their own tables above
        print("| " + " | ".join(bk._fmt(r.get(k_)) for k_ in keys) + " |")
    summary = {}
    for r in rows:
        if r.get("part") == "decode" and r.get("what") is None and r.get("graph_us") is not None:
            key = (r["pattern"], r["bn"], r["warps"], r["stages"], "fused" if r["fused"] else "combine",
                   "prefetch" if r["pf"] else "", "lean" if r["lean"] else "", f"fast {r['fast']}" if r["fast"] else "")
            summary.setdefault(key, []).append(f"{r['splits']}:{r['graph_us']:.1f}")
    for key, vals in summary.items():
        print("decode", *key, " ".join(vals))
    if args.json:
        bk.write_json(args.json, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
