#!/usr/bin/env python
"""Selection cost vs attention cost on one GPU.

For each context length: dense causal SDPA, then for each selector (``sparse_k`` with a random
``SparseKScorer``, ``dsa`` with a random ``LightningIndexer``, the training-free default, and ``per_query``: the
training-free selection at its default budget with ``query_block=1, refine=8``) the time of
``build_selection`` alone and of selection + ``sparse_attention``, one layer, B=1. Also whether the
selection call synchronises with the host (``torch.cuda.set_sync_debug_mode``) and, for sparse_k, the
the recall of a variant against its reference (sparse_k: the top-k over whole rows; dsa_paged: dsa).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

import torch


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _time(fn, reps):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def _syncs(fn) -> str:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "none"
    except RuntimeError as e:
        return f"sync: {str(e).splitlines()[0][:80]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=_positive_int, nargs="+", default=[32768, 131072])
    p.add_argument("--selectors", nargs="+", default=["sparse_k", "sparse_k_full", "dsa", "dsa_paged", "training_free"],
                   choices=["sparse_k", "sparse_k_full", "dsa", "dsa_paged", "training_free", "per_query"],
                   help="sparse_k (default path: prefix scan on long rows), sparse_k_full (top-k over whole rows), dsa "
                        "(default: exact), dsa_paged (DSA_PRESELECT on), training_free, per_query (training-free, "
                        "query_block=1, refine=8, sinks 4 + window 256 + top_k 256)")
    p.add_argument("--reps", type=_positive_int, default=5)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU: it times CUDA kernels with CUDA events (torch.cuda.is_available() is False)")
    import sparse_k
    import sparse_k.selection.selectors as sel
    from sparse_k.selection.scorers import LightningIndexer, SparseKScorer

    warnings.simplefilter("ignore")
    dev, dt = "cuda", torch.bfloat16
    B, Hq, Hkv, D = 1, 32, 8, 128
    rows = []
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for S in args.contexts:
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(B, h, S, D, device=dev, dtype=dt, generator=g) for h in (Hq, Hkv, Hkv))
        dense = _time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1),
                                                                              v.repeat_interleave(4, 1), is_causal=True),
                      args.reps)
        print(f"S={S}: dense causal SDPA {dense:.2f} ms", flush=True)
        rows.append({"S": S, "variant": "dense sdpa", "total_ms": dense})
        geo = sparse_k.row_geometry(B, S, S, device=dev)
        for name in args.selectors:
            pat_cls = sparse_k.DSA if name.startswith("dsa") else sparse_k.SparseK
            pattern = pat_cls(sinks=4, window=1024, top_k=2048, query_block=128)
            if name == "per_query":
                pattern = sparse_k.SparseK(query_block=1, refine=8)
            selector = None
            if name.startswith("sparse_k"):
                selector = SparseKScorer(Hkv, D).to(dev)
                with torch.no_grad():
                    selector.weight.normal_(0, D ** -0.5)
            elif name.startswith("dsa"):
                selector = LightningIndexer(Hq, Hkv, D, indexer_heads=4, indexer_dim=32).to(dev)
            saved = (sel.PREFIX_CHUNK, sel.DSA_PRESELECT)

            def configure(variant):
                sel.PREFIX_CHUNK = 10**9 if variant == "sparse_k_full" else saved[0]
                sel.DSA_PRESELECT = variant == "dsa_paged"

            configure(name)
            try:
                def select():
                    with torch.no_grad():
                        return sparse_k.build_selection(pattern, q, k, v, geo, layer_idx=0, selector=selector,
                                                        memo={} if selector is None else None)

                def both():
                    lay = select()
                    return sparse_k.sparse_attention(q, k, v, pattern, selection=lay)

                try:
                    t_sel = _time(select, args.reps)
                    t_all = _time(both, args.reps)
                    syncs = _syncs(select)
                except Exception as e:  # report and go on with the next variant
                    print(f"  {name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    torch.cuda.empty_cache()
                    continue
                row = {"S": S, "variant": name, "selection_ms": t_sel, "total_ms": t_all, "vs_dense": t_all / dense,
                       "host_syncs": syncs, "peak_GiB": torch.cuda.max_memory_allocated() / 2**30}
                reference = {"sparse_k": "sparse_k_full", "dsa_paged": "dsa"}.get(name)
                if reference in args.selectors:
                    try:
                        fast = select()
                        configure(reference)
                        exact = select()
                        configure(name)
                        a = torch.zeros(B, Hkv, fast.indices.shape[2], S + 1, dtype=torch.bool, device=dev)
                        a.scatter_(-1, fast.indices.long().clamp_min(-1) % (S + 1), True)
                        bm = torch.zeros_like(a)
                        bm.scatter_(-1, exact.indices.long() % (S + 1), True)
                        row["recall_vs_exact"] = float((a & bm)[..., :S].sum() / bm[..., :S].sum().clamp_min(1))
                    except Exception as e:
                        print(f"  {name}: recall failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                print(f"  {name}: selection {t_sel:.2f} ms, selection+attention {t_all:.2f} ms = {t_all / dense:.2f}x dense,"
                      f" host syncs: {syncs}" + (f", recall {row['recall_vs_exact']:.4f}" if "recall_vs_exact" in row else ""),
                      flush=True)
                rows.append(row)
            finally:
                sel.PREFIX_CHUNK, sel.DSA_PRESELECT = saved
            torch.cuda.reset_peak_memory_stats()
    if args.output:
        with open(args.output, "w") as fh:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
