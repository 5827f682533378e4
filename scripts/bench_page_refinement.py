#!/usr/bin/env python
"""The training-free per-query refinement kernel alone (``select_triton.refine_page_scores``) on one GPU.

The shape of the per-query prefill's refinement (``query_block=1, refine=8``) on a Llama-3.1-8B layer: the last
``--queries`` queries of a ``--context`` context, 8 KV heads of 4 query heads, head dimension 128, bf16 keys, pages
of 16 keys, ``8 * 256 / 16`` = 128 preselected pages per query, sinks 4, window 256. Two kinds of page lists:
``random`` (what random weights give: 16 neighbouring queries list about 1,270 distinct pages at 32K) and
``clustered`` (neighbours list mostly the same pages, about 170). ``--queries 1`` is a decode step.

Every configuration is checked first against the gather kernel (``refine_scores`` over the packed keys of
``page_selection.expand_pages``, float32 queries) on the first 64 queries, then timed with
``triton.testing.do_bench`` (median; ``--cuda-graph``: replays of a captured graph, as compiled decode runs it);
"useful TFLOP/s" counts the products of each query with its own pool and static keys (two passes). Sweeps
``PAGE_REFINE_ROWS``, ``PAGE_REFINE_BLOCK_N`` and ``PAGE_REFINE_SPLIT`` (module constants).
``--device cpu`` (with ``TRITON_INTERPRET=1``, small sizes) runs the checks only: a smoke test of the script.

    python scripts/bench_page_refinement.py --context 32768 --queries 4096 --rows 16 64 --block-n 32 64
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch


def _lists(kind: str, H: int, block_start: torch.Tensor, S: int, page: int, n_pages: int, sinks: int, window: int,
           gen: torch.Generator) -> torch.Tensor:
    """``(1, H, C, n_pages)`` int32 ascending page lists of each query's candidate pages (wholly inside
    ``[sinks, block_start - window]``), ``-1`` after when a query has fewer candidates."""
    P = S // page
    p = torch.arange(P, device=block_start.device)
    cand = (p[None, :] * page >= sinks) & (p[None, :] * page + page - 1 <= (block_start - window)[:, None])
    C = block_start.numel()
    n_pages = min(n_pages, P)
    noise = torch.rand(H, C, P, device=block_start.device, generator=gen)
    score = noise if kind == "random" else torch.rand(H, 1, P, device=block_start.device, generator=gen) + 0.05 * noise
    score = score.masked_fill(~cand[None], -1.0)
    top = score.topk(n_pages, -1)
    pages = torch.where(top.values >= 0, top.indices, P)  # non-candidates sort last, then become -1
    pages = pages.sort(-1).values
    return torch.where(pages < P, pages, -1).to(torch.int32)[None]


def _time(fn, cuda_graph: bool) -> float:
    """Median milliseconds of ``fn`` on the GPU; with ``cuda_graph`` the replays of one captured call, so the host's
    launch cost stays out (what a compiled decode step sees)."""
    import triton

    if cuda_graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # compile and warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        fn = graph.replay
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--queries", type=int, default=4096, help="queries at the end of the context (1: a decode step)")
    p.add_argument("--lists", nargs="+", default=["random", "clustered"], choices=["random", "clustered"])
    p.add_argument("--rows", type=int, nargs="+", default=[64], help="PAGE_REFINE_ROWS values")
    p.add_argument("--block-n", type=int, nargs="+", default=[64], help="PAGE_REFINE_BLOCK_N values")
    p.add_argument("--split", type=int, nargs="+", default=[2048], help="PAGE_REFINE_SPLIT values")
    p.add_argument("--pages-per-query", type=int, default=128, help="preselected pages of 16 keys per query")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: checks only, under TRITON_INTERPRET=1 (no timing)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time replays of a captured CUDA graph (no host launch cost: a compiled decode step)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_page_refinement: needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1 for the checks)",
              file=sys.stderr)
        return 2
    if not 1 <= args.queries <= args.context:
        raise ValueError(f"--queries must be in [1, --context ({args.context})], got {args.queries}")
    if args.pages_per_query < 1:
        raise ValueError(f"--pages-per-query must be >= 1, got {args.pages_per_query}")
    from sparse_k.selection import page_selection
    from sparse_k.selection import select_triton as st

    dev = args.device
    H, G, D, page, sinks, window = 8, 4, 128, 16, 4, 256
    if dev == "cpu":  # the interpreter: float16 products (its bf16 dot is wrong), small heads
        H, D, dtype = 2, 32, torch.float16
    else:
        dtype = torch.bfloat16
    S, C = args.context, args.queries
    gen = torch.Generator(device=dev).manual_seed(0)
    block_start = torch.arange(S - C, S, device=dev)
    q = torch.randn(1, H, C, G, D, device=dev, generator=gen).to(dtype)
    key = torch.randn(1, H, S, D, device=dev, generator=gen).to(dtype)
    n_keys = torch.full((1,), S, device=dev)
    k_start = torch.zeros(1, dtype=torch.long, device=dev)
    bs = block_start[None].contiguous()
    flops = 2 * 2 * H * C * G * (args.pages_per_query * page + sinks + window) * D
    rows_out = []
    defaults = (st.PAGE_REFINE_ROWS, st.PAGE_REFINE_BLOCK_N, st.PAGE_REFINE_SPLIT)
    try:
        for kind in args.lists:
            pages = _lists(kind, H, block_start, S, page, args.pages_per_query, sinks, window, gen)
            n_pages = pages.shape[-1]
            distinct = pages[0, 0, : min(C, 16)].unique().numel() - int((pages[0, 0, : min(C, 16)] < 0).any())
            n_check = min(C, 64)
            hi = bs[:, :n_check] - window
            pos, _ = page_selection.expand_pages(pages[:, :, :n_check], pages[:, :, :n_check] >= 0, page,
                                                 torch.full_like(hi, sinks), hi, n_keys, n_pages * page)
            spos, sok = page_selection.static_positions(bs[:, :n_check], hi, n_keys, sinks, window)
            want = st.refine_scores(q[:, :, :n_check].float(), key, pos.clamp_min(0), pos >= 0,
                                    spos[:, None].clamp_min(0), sok[:, None])
            slot_ok = pages[:, :, :n_check, :, None].expand(-1, -1, -1, -1, page).flatten(-2) >= 0
            for rows, block_n, split in itertools.product(args.rows, args.block_n, args.split):
                st.PAGE_REFINE_ROWS, st.PAGE_REFINE_BLOCK_N, st.PAGE_REFINE_SPLIT = rows, block_n, split
                got = st.refine_page_scores(q, key, pages, page, bs, n_keys, k_start, sinks, window)
                sel = got[:, :, :n_check]
                dest = torch.where(slot_ok, slot_ok.long().cumsum(-1) - 1, want.shape[-1])
                packed = torch.zeros(*want.shape[:-1], want.shape[-1] + 1, device=dev).scatter(
                    -1, dest, torch.where(slot_ok, sel, 0.0))[..., :-1]
                err = (packed - want).abs().max().item()
                # the same float32 sums of the same half-precision products in another order, of probabilities <= 1:
                # about 1e-7 apart (tests/selection/test_select_triton.py's 128K test: rtol 1e-4, atol 1e-6)
                ok = err <= 1e-5
                ms = _time(lambda: st.refine_page_scores(q, key, pages, page, bs, n_keys, k_start, sinks, window),
                           args.cuda_graph) if ok and dev == "cuda" else float("nan")
                row = {"lists": kind, "distinct_pages_16_queries": distinct, "rows": rows, "block_n": block_n,
                       "split": split, "context": S, "queries": C, "cuda_graph": args.cuda_graph, "check_max_abs": err, "check_ok": ok, "ms": ms,
                       "useful_tflops": flops / ms / 1e9 if ok and dev == "cuda" else None}
                rows_out.append(row)
                if not ok:
                    result = f"CHECK FAILED (max abs {err:.2e})"
                elif dev == "cuda":
                    result = f"{ms * 1e3:10.1f} us ({flops / ms / 1e9:.1f} useful TFLOP/s)"
                else:
                    result = f"check ok (max abs {err:.2e}; no timing on the CPU)"
                print(f"{kind:9s} rows {rows:3d} block_n {block_n:3d} split {split:5d}: {result}", flush=True)
    finally:
        st.PAGE_REFINE_ROWS, st.PAGE_REFINE_BLOCK_N, st.PAGE_REFINE_SPLIT = defaults
    if args.json:
        with open(args.json, "w") as f:
            name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (TRITON_INTERPRET=1)"
            json.dump({"device": name, "rows": rows_out}, f, indent=1)
    return 0 if all(r["check_ok"] for r in rows_out) else 1


if __name__ == "__main__":
    sys.exit(main())
