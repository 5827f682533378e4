"""Tuning sweeps behind the decode and token-layout defaults, on an H100; the official rows come from
``benchmark_kernels.py``, the sweeps' results are in docs/history.md (Triton tuning).

* ``--part decode``: B=8, one query token, KV length ``--kv-len`` (131072), Hq=32, Hkv=8, D=128, bf16;
  sliding window 4096 and a top-2048 token layout. For each kernel variant (key tile ``BLOCK_N``,
  warps, pipeline stages) and each split count, the output is checked against the PyTorch path
  (relative error < 2e-2, else the row is void), then the whole call (split kernel + combine) is
  timed as CUDA-graph replays (GPU time; ``do_bench`` median). The baselines get the same two
  timings: SDPA flash on a pre-sliced window, and torch gather of the 2048 keys + SDPA flash.
  ``kernels_us`` splits the best variant's GPU time by kernel (torch.profiler).
* ``--part token``: token-layout prefill (query_block 128, top-2048 + window 1024, B=1, S=``--seqlen``)
  over tiles / warps / stages / GQA packing, beside our sliding-window 3072 forward (effective TF/s).

Example: ``python scripts/tune_decode.py --part decode,token --json results/tune_decode.json``
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


def part_token(args, rows):
    from sparse_k.attention import dispatch

    dev, dtype, D, S = args.device, args.dtype, 128, args.seqlen
    p_tok = get_pattern("sparse_k", sinks=0, window=1024, top_k=2048, query_block=128)
    p_sw = get_pattern("sliding_window", window=3072)
    q, k, v = bk._inputs(1, S, D, dtype, dev, S + 5)
    geo = row_geometry(1, S, S, None, device=dev)
    scale = D ** -0.5
    sel = bk.token_selection(1, S, S, p_tok, dev)
    refs = [(q0, sparse_k.sparse_attention(q[:, :, q0 : q0 + 256], k, v, p_tok, backend="torch", selection=sel, q_start=q0))
            for q0 in (0, S - 256)]
    lay_sw = build_block_layout(p_sw, S, S, geo, block_q=128, block_k=128, num_kv_heads=HKV)
    sw_ms = bk.bench(lambda: dispatch.attention_forward(q, k, v, lay_sw, scale=scale))
    sw_tf = 4.0 * bk.allowed_pairs(lay_sw, S) * HQ * D / sw_ms / 1e9
    rows.append(dict(part="token", S=S, what="sw3072 (default forward)", ms=round(sw_ms, 3), tflops=round(sw_tf, 1)))
    print(json.dumps(rows[-1]), flush=True)
    pairs = None
    for bm, bn, warps, stages, pack, fast, pf, lean in TOKEN_VARIANTS:
        row = dict(part="token", S=S, bm=bm, bn=bn, warps=warps, stages=stages, pack=pack, fast=fast, pf=pf, lean=lean)
        try:
            lay = build_block_layout(p_tok, S, S, geo, block_q=bm // pack, block_k=bn, num_kv_heads=HKV)
            if pairs is None:
                pairs = (bk.allowed_pairs(lay, S) + bk.selected_pairs(sel, S, S)) * HQ

            def fn(lay=lay, pack=pack, warps=warps, stages=stages, fast=fast, pf=pf, lean=lean):
                return dispatch.attention_forward(q, k, v, lay, scale=scale, pack=pack, num_warps=warps,
                                                  num_stages=stages, selection=sel, sel_fast=fast, sel_prefetch=pf,
                                                  sel_lean=lean)

            out = fn()[0]
            row["err"] = max(bk.rel_err(out[:, :, q0 : q0 + 256], r) for q0, r in refs)
            del out
            if row["err"] < bk.TOL:
                row["ms"] = round(bk.bench(fn), 3)
                row["tflops"] = round(4.0 * pairs * D / row["ms"] / 1e9, 1)
                row["ratio_vs_sw3072"] = round(row["tflops"] / sw_tf, 3)
            else:
                row["error"] = "check failed: void"
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append(row)
        print(json.dumps(row), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", type=lambda s: s.split(","), default=["decode", "token"])
    ap.add_argument("--patterns", type=lambda s: s.split(","), default=["sliding_window", "token_top2048"],
                    help="decode patterns: sliding_window, token_top2048, token_contig2048 (probe)")
    ap.add_argument("--kv-len", type=int, default=131072)
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, fp16, no timing (tests this script)")
    args = ap.parse_args(argv)
    args.device, args.dtype = "cuda", torch.bfloat16
    if args.dry_run:
        args.device, args.dtype = "cpu", torch.float16
        bk.bench = bk.graph_bench = lambda fn, *a, **k: (fn(), 1e-3)[1]
        bk.kernel_times = lambda fn, iters=3: {}
        global DECODE_VARIANTS, DECODE_SPLITS, TOKEN_VARIANTS
        DECODE_VARIANTS, DECODE_SPLITS, TOKEN_VARIANTS = DECODE_VARIANTS[:2], (1, 3), TOKEN_VARIANTS[:2]
    elif not torch.cuda.is_available():
        print("tune_decode.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__, triton=triton.__version__,
                command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]))
    print(json.dumps(meta), flush=True)
    rows = []
    for part in args.part:
        try:
            {"decode": part_decode, "token": part_token}[part](args, rows)
        except Exception:  # noqa: BLE001 — keep the other part
            traceback.print_exc()
        torch.cuda.empty_cache()
    keys = ("part", "pattern", "what", "bm", "bn", "warps", "stages", "fused", "pf", "lean", "pack", "fast", "splits", "graph_us",
            "graph10_us", "eager_us", "gbps",
            "ms", "tflops", "ratio_vs_sw3072", "err", "error")
    print("| " + " | ".join(keys) + " |")
    for r in rows:
        if r.get("part") == "decode" and r.get("what") is None and r.get("graph_us") is not None:
            continue  # the per-split rows are in the JSON; print the summary rows below
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
