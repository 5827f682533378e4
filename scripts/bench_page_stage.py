#!/usr/bin/env python
"""The training-free selection's page stage alone on one GPU: page bounds (``select_triton.page_bound_scores``) and
the page top-k (``select_triton.topk_rows``) over a whole prefill, chunk by chunk as ``page_selection.quest_layout``
runs them.

Shape: a Llama-3.1-8B layer (8 KV heads of 4 query heads, head dimension 128), pages of 16 keys, a ``--context``
prefill in query blocks of ``--query-block`` (1: ``per_query``; 64: the default), chunks of ``--chunk`` blocks, each
block choosing ``--pages`` pages among its complete pages (128: ``refine = 8`` at ``top_k = 256``). Every
``--every``-th chunk is timed (their positions spread over the context) and the total is scaled to the whole prefill.
Sweeps ``PAGE_BOUND_ROWS``, ``PAGE_BOUND_WARPS`` and ``PAGE_BOUND_PROGRAMS`` (module constants), and times the top-k
with per-row lengths (what ``quest_layout`` passes) and without, and at the chunk sizes of ``--topk-block``. ``--before FILE`` also times another revision's
``select_triton.py`` (e.g. ``git show REV:kernel_src/selection/select_triton.py > old.py``) in the same process.

Checks first: the bounds of the first chunk's first 16 blocks against ``page_selection.quest_scores`` in float64 (at
most twice PyTorch's float32 error plus a rounding floor), the top-k with lengths equal to the top-k without (and to
``--before``'s on the same scores). ``--device cpu`` (with ``TRITON_INTERPRET=1``, small sizes) runs the checks only.

    python scripts/bench_page_stage.py --context 131072 --query-block 1 --rows 16 64 --warps 4 8 --topk-block 8192
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys

import torch


def _load_before(path: str):
    """Another revision's ``select_triton`` as a module (its custom ops registered under other names)."""
    spec = importlib.util.spec_from_file_location("sparse_k.selection._select_triton_before", path)
    module = importlib.util.module_from_spec(spec)
    custom_op = torch.library.custom_op
    torch.library.custom_op = lambda name, *a, **k: custom_op(name + "_before", *a, **k)
    try:
        spec.loader.exec_module(module)
    finally:
        torch.library.custom_op = custom_op
    return module


def _seconds(fn) -> float:
    """Median seconds of ``fn`` on the GPU by ``triton.testing.do_bench`` (as ``bench_page_refinement.py`` times)."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=131072, help="prefill length (default 131072)")
    p.add_argument("--query-block", type=int, default=1, help="queries per selection block (default 1)")
    p.add_argument("--chunk", type=int, default=512, help="blocks per chunk (default 512)")
    p.add_argument("--every", type=int, default=8, help="time every N-th chunk (default 8)")
    p.add_argument("--pages", type=int, default=128, help="pages each block chooses (default 128)")
    p.add_argument("--rows", type=int, nargs="+", default=[16], help="PAGE_BOUND_ROWS values (default 16)")
    p.add_argument("--warps", type=int, nargs="+", default=[4], help="PAGE_BOUND_WARPS values (default 4)")
    p.add_argument("--programs", type=int, nargs="+", default=[2048], help="PAGE_BOUND_PROGRAMS values (default 2048)")
    p.add_argument("--topk-block", type=int, nargs="+", default=[],
                   help="also time the page top-k (with lengths) at these chunk sizes (e.g. 8192: a row in one chunk)")
    p.add_argument("--before", default=None, metavar="FILE", help="another revision's select_triton.py, timed beside")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: checks only, under TRITON_INTERPRET=1 (no timing)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    for name in ("context", "query_block", "chunk", "every", "pages"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.context % 16:
        p.error(f"--context must be a multiple of the page (16), got {args.context}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1 for the checks)")
    from sparse_k.selection import page_selection
    from sparse_k.selection import select_triton as st

    before = _load_before(args.before) if args.before else None
    dev = args.device
    H, G, D, page, sinks = (8, 4, 128, 16, 4) if dev == "cuda" else (2, 2, 32, 16, 4)
    S = args.context
    P = S // page
    gen = torch.Generator(device=dev).manual_seed(0)
    key = torch.randn(1, H, S, D, device=dev, generator=gen).to(torch.bfloat16 if dev == "cuda" else torch.float32)
    kmin, kmax, ok = page_selection.page_summaries(key, torch.zeros(1, dtype=torch.long, device=dev),
                                                   torch.full((1,), S, device=dev), page, sinks, P, aligned=True)
    n_blocks = -(-S // args.query_block)
    starts = list(range(0, n_blocks, args.chunk))
    timed = starts[:: args.every]
    chunks = []
    for c0 in timed:
        blocks = torch.arange(c0, min(n_blocks, c0 + args.chunk), device=dev)
        first_pos = blocks * args.query_block  # the block's first query: its pages end before it
        last = (torch.div(first_pos + 1, page, rounding_mode="floor") - 1)[None].contiguous()
        q = torch.randn(1, H, blocks.numel(), G, D, device=dev, generator=gen)
        chunks.append((q, last))
    scale = len(starts) / len(timed)
    n_sel = min(args.pages, P)

    q0, last0 = chunks[-1][0][:, :, :16], chunks[-1][1][:, :16]
    cand = ok[:, :, None, :] & (torch.arange(P, device=dev) <= last0[:, None, :, None])
    want32 = torch.where(cand, page_selection.quest_scores(q0, kmin, kmax, ok), float("-inf"))
    want64 = torch.where(cand, page_selection.quest_scores(q0.double(), kmin.double(), kmax.double(), ok),
                         float("-inf"))
    fin = torch.isfinite(want64)
    floor = 1e-6 * want64[fin].abs().max().clamp_min(1.0)
    bound_of_err = 2 * (want32.double() - want64)[fin].abs().max() + floor

    rows_out, defaults = [], (st.PAGE_BOUND_ROWS, st.PAGE_BOUND_WARPS, st.PAGE_BOUND_PROGRAMS)
    kernels = [("this", st)] + ([("before", before)] if before is not None else [])
    try:
        for label, mod in kernels:
            configs = itertools.product(args.rows, args.warps, args.programs) if label == "this" else [(None,) * 3]
            for rows, warps, programs in configs:
                if label == "this":
                    st.PAGE_BOUND_ROWS, st.PAGE_BOUND_WARPS, st.PAGE_BOUND_PROGRAMS = rows, warps, programs
                got = mod.page_bound_scores(q0, kmin, kmax, ok, last0)
                err = (got.double() - want64)[fin].abs().max()
                ok_bounds = bool(torch.equal(torch.isfinite(got), fin) and err <= bound_of_err)
                bounds = lambda: [mod.page_bound_scores(q, kmin, kmax, ok, last) for q, last in chunks]  # noqa: E731
                sec = _seconds(bounds) * scale if ok_bounds and dev == "cuda" else None
                row = {"kernels": label, "rows": rows, "warps": warps, "programs": programs, "stage": "bounds",
                       "check_ok": ok_bounds, "check_max_abs": float(err), "ms": sec * 1e3 if sec else None}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
        st.PAGE_BOUND_ROWS, st.PAGE_BOUND_WARPS, st.PAGE_BOUND_PROGRAMS = defaults
        scores = [st.page_bound_scores(q, kmin, kmax, ok, last) for q, last in chunks]
        lengths = [(last + 1)[:, None] for _, last in chunks]
        plain = [st.topk_rows(s, n_sel) for s in scores]
        variants = [("this, lengths", lambda: [st.topk_rows(s, n_sel, lengths=n) for s, n in zip(scores, lengths)]),
                    ("this, no lengths", lambda: [st.topk_rows(s, n_sel) for s in scores])]
        for block in args.topk_block:
            variants.append((f"this, lengths, block {block}",
                             lambda block=block: [st.topk_rows(s, n_sel, lengths=n, block=block)
                                                  for s, n in zip(scores, lengths)]))
        if before is not None:
            variants.append(("before", lambda: [before.topk_rows(s, n_sel) for s in scores]))
        for label, fn in variants:
            same = all(torch.equal(a, b) for a, b in zip(fn(), plain))
            sec = _seconds(fn) * scale if same and dev == "cuda" else None
            row = {"kernels": label, "stage": "topk", "check_ok": same, "ms": sec * 1e3 if sec else None}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    finally:
        st.PAGE_BOUND_ROWS, st.PAGE_BOUND_WARPS, st.PAGE_BOUND_PROGRAMS = defaults
    if args.json:
        with open(args.json, "w") as f:
            name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (TRITON_INTERPRET=1)"
            json.dump({"device": name, "args": vars(args), "chunks_timed": len(timed), "chunks": len(starts),
                       "rows": rows_out}, f, indent=1)
    return 0 if all(r["check_ok"] for r in rows_out) else 1


if __name__ == "__main__":
    sys.exit(main())
