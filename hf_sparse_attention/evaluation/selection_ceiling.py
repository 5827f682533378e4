"""How good can a learned selection get? Perplexity with oracle selections (issue: learned selection).

Each oracle row runs the model with the ``sparse_k`` selection rules of design §6 (sinks, window,
``top_k`` keys per query block and KV head) but with the keys chosen inside every attention layer
from that layer's own *dense* causal attention probabilities; the four oracles (``future``,
``candidate``, ``causal``, ``block``) are defined in ``oracle``.

The table also has dense (``sdpa``), streaming with the same key budget, and trained selector files
(``--selector NAME=PATH``), with the protocol and code of ``evaluate_selectors`` (held-out
Gutenberg text, windows of ``--context`` tokens every ``--context // 2``). For the oracles it also
reports the fraction of the candidates' dense mass (from each block's own queries) that the selection
keeps: a ratio of sums over windows, layers, KV heads and blocks. Oracle (b)'s scores change from block
to block, so unlike design §6's fixed scores a key it drops may come back (no eviction). This module
is the command line of ``scripts/selection_ceiling.py``.

Example (the issue's setting, 516 keys per query)::

    python scripts/selection_ceiling.py --device cpu --dtype float32 --ppl-tokens 8192 \\
        --selector sparse_k=runs/sk/sparse_k_selectors.safetensors --output results/ceiling.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

import torch

from .cli import DefaultsHelpFormatter, checked_device
from .corpora import gutenberg_files, load_documents
from .evaluate_selectors import (
    add_setting_arguments,
    apply_selector_variant,
    selector_variants,
)
from .models import load_model
from .oracle import ORACLES, apply_oracle, oracle_mode
from .perplexity import strided_perplexity, tokenize_corpus

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``scripts/selection_ceiling.py`` (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    add_setting_arguments(p)
    p.add_argument("--oracles", nargs="*", default=list(ORACLES), choices=list(ORACLES),
                   help="oracle rows, one per mode (see hf_sparse_attention.evaluation.oracle)")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip streaming (dense is always run: the reference); default: streaming is run")
    p.add_argument("--ppl-tokens", type=int, default=8192,
                   help="tokens of held-out Gutenberg text scored, in windows of --context tokens every --context // 2")
    p.add_argument("--seed", type=int, default=0, help="torch random seed of the run")
    p.add_argument("--no-progress", action="store_true", help="no progress bars; default: progress bars shown")
    p.add_argument("--output", default=None,
                   help="JSON file for the results (the table is printed either way); default: none, the table only")
    return p


def main(argv=None) -> int:
    """Measure the flags ``argv`` (default ``sys.argv[1:]``), print the table and write ``--output``;
    returns the exit status 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.context < args.sinks + args.window + args.top_k:
        raise SystemExit(f"--context {args.context} is shorter than the key budget {args.sinks + args.window + args.top_k}")
    checked_device(parser, args.device)
    torch.manual_seed(args.seed)
    loaded = load_model(args.model, attn_implementation="sdpa", dtype=args.dtype, device=args.device)
    model, tok = loaded.model, loaded.tokenizer
    ids = tokenize_corpus(tok, load_documents("gutenberg", split="test"), max_tokens=args.ppl_tokens)
    ids = ids.to(next(model.parameters()).device)
    variants = selector_variants(args)
    if args.no_baselines:
        variants = [v for v in variants if v["pattern"] != "streaming"]
    variants[1:1] = [{"label": ORACLES[m], "oracle": m} for m in args.oracles]
    rows = []
    for variant in variants:
        t0 = time.perf_counter()
        with torch.no_grad():
            if "oracle" in variant:
                apply_oracle(model, args)
                with oracle_mode(variant["oracle"]) as state:
                    ppl = strided_perplexity(model, ids, args.context, args.context // 2, progress=not args.no_progress,
                                             desc=variant["label"])
                kept = state["kept"] / state["total"] if state["total"] else None
            else:
                apply_selector_variant(model, variant)
                ppl = strided_perplexity(model, ids, args.context, args.context // 2, progress=not args.no_progress,
                                         desc=variant["label"])
                kept = None
        rows.append({**variant, "perplexity": ppl["perplexity"], "tokens": ppl["tokens"], "windows": ppl["windows"],
                     "candidate_mass_kept": kept, "seconds": time.perf_counter() - t0})
        print(f"{variant['label']}: perplexity {ppl['perplexity']:.3f} ({rows[-1]['seconds']:.0f} s)", flush=True)
    dense = rows[0]["perplexity"]
    budget = args.sinks + args.window + args.top_k
    lines = [
        (f"context {args.context}, key budget {budget} per query (sinks {args.sinks}, window {args.window}, top_k "
         f"{args.top_k}, query_block {args.query_block} for the oracles); held-out Gutenberg "
         f"({', '.join(f.rsplit('/', 1)[-1] for f in gutenberg_files('test')[:2])}, ...), {rows[0]['tokens']} tokens "
         f"scored in {rows[0]['windows']} windows"),
        "",
        "| variant | perplexity | vs dense | candidate mass kept | seconds |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        kept = "" if r["candidate_mass_kept"] is None else f"{r['candidate_mass_kept']:.3f}"
        lines.append(f"| {r['label']} | {r['perplexity']:.3f} | {(r['perplexity'] / dense - 1) * 100:+.1f}% | {kept} | "
                     f"{r['seconds']:.0f} |")
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    lines += ["", f"command: `{command}`"]
    print("\n".join(lines))
    if args.output:
        with open(args.output, "w") as fh:
            json.dump({"command": command, "args": vars(args), "rows": rows, "table": "\n".join(lines)}, fh, indent=2,
                      default=str)
    return 0

