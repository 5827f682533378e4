"""Compare two results files of the same evaluation (e.g. ``accelerate launch`` on 2 GPUs vs 1).

    python -m hf_sparse_attention.evaluation.compare results/one_gpu/results.json results/two_gpus/results.json

Prints the wall-time ratio, whether the retrieval outcomes (per task, pattern, context: correct
counts) are identical and the largest relative perplexity difference; exits 1 when the retrieval
counts differ or a perplexity differs by more than ``--rtol`` (default 1e-4).
"""

from __future__ import annotations

import argparse
import json

__all__ = ["compare_results", "main"]


def compare_results(a: dict, b: dict) -> dict:
    """``{"time_ratio", "retrieval_identical", "max_perplexity_rel_diff", "processes"}`` of two results dicts."""
    def counts(r):
        return {(s["task"], s["variant"], s["context"]): (s["correct"], s["total"]) for s in r.get("retrieval_summary", [])}

    def ppl(r):
        return {(p["variant"], p["context"], p.get("window", 0)): p["perplexity"] for p in r.get("perplexity", [])}

    pa, pb = ppl(a), ppl(b)
    if set(pa) != set(pb):
        raise ValueError(f"the perplexity rows differ: {sorted(set(pa) ^ set(pb))}")
    diffs = [abs(pa[k] - pb[k]) / abs(pa[k]) for k in pa]
    return {
        "processes": (a["environment"]["num_processes"], b["environment"]["num_processes"]),
        "time_ratio": a["timing"]["total_seconds"] / b["timing"]["total_seconds"],
        "evaluation_time_ratio": a["timing"].get("evaluation_seconds", float("nan")) / b["timing"].get("evaluation_seconds", float("nan")),
        "retrieval_identical": counts(a) == counts(b),
        "max_perplexity_rel_diff": max(diffs) if diffs else 0.0,
    }


def main(argv=None) -> int:
    """Command line (see the module docstring)."""
    p = argparse.ArgumentParser(description="Compare two results.json files.")
    p.add_argument("first")
    p.add_argument("second")
    p.add_argument("--rtol", type=float, default=1e-4)
    args = p.parse_args(argv)
    with open(args.first) as f:
        a = json.load(f)
    with open(args.second) as f:
        b = json.load(f)
    out = compare_results(a, b)
    print(f"processes {out['processes'][0]} vs {out['processes'][1]}: wall time ratio {out['time_ratio']:.2f} "
          f"(evaluation part {out['evaluation_time_ratio']:.2f}); retrieval counts identical: {out['retrieval_identical']}; "
          f"max relative perplexity difference {out['max_perplexity_rel_diff']:.2e}")
    return 0 if out["retrieval_identical"] and out["max_perplexity_rel_diff"] <= args.rtol else 1


if __name__ == "__main__":
    raise SystemExit(main())
