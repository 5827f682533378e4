#!/usr/bin/env python
"""How good can a learned selection get? Perplexity with oracle selections (issue: learned selection).

Each oracle row runs the model with the ``sparse_k`` selection rules of design §6 (sinks, window,
``top_k`` keys per query block and KV head among the candidates ``sinks <= j <= b0 - window``, weight 1),
but the keys are chosen inside every attention layer from that layer's own *dense* causal attention
probabilities ``P (B, Hq, S, S)`` on the states the sparse forward actually produced. With
``M[b, g, n, j]`` = the mass the queries of block ``n`` and the query heads of KV group ``g`` give key
``j`` (a sum of probabilities), the oracle scores are:

* ``future`` (a): ``u_j = sum_n M[n, j]``, the total mass key ``j`` receives from all queries of the
  sequence, future ones included: one score per key and KV head for every block, as a query-independent
  score (SparseK by design §6) has, but with knowledge no such score has;
* ``candidate`` (a'): ``u_j = sum_n M[n, j] [j is a candidate of block n]``, the same but only from
  the blocks that can select ``j`` (mass that the window serves anyway does not count): the better
  query-independent oracle of the two (neither is a strict bound: the best fixed ranking is a
  combinatorial problem);
* ``causal`` (b): ``u_j(n) = sum_{n' < n} M[n', j]``, the mass received from the queries before block
  ``n`` (what a cumulative, heavy-hitter-like score could know when the block starts);
* ``block`` (c): ``u_j(n) = M[n, j]``, the mass the block's own queries give each candidate: the
  per-block, per-KV-head ceiling for query-dependent selectors (DSA-like).

The table also has dense (``sdpa``), streaming with the same key budget, and trained selector files
(``--selector NAME=PATH``), with the protocol and code of ``scripts/evaluate_selectors.py`` (held-out
Gutenberg text, windows of ``--context`` tokens every ``--context // 2``). For the oracles it also
reports the fraction of the candidates' dense mass (from each block's own queries) that the selection
keeps: a ratio of sums over windows, layers, KV heads and blocks. Oracle (b)'s scores change from block
to block, so unlike design §6's fixed scores a key it drops may come back (no eviction).

Example (the issue's setting, 516 keys per query)::

    python scripts/selection_ceiling.py --device cpu --dtype float32 --ppl-tokens 8192 \\
        --selector sparse_k=runs/sk/sparse_k_selectors.safetensors --output results/ceiling.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time
from contextlib import contextmanager
from functools import cache

import torch

#: ``attn_implementation`` name of the oracle attention function (registered by ``register``).
ATTN_IMPLEMENTATION = "sparse_k_selection_oracle"

#: Oracle modes and their table labels.
ORACLES = {
    "future": "oracle (a): query-independent, total mass incl. future queries",
    "candidate": "oracle (a'): query-independent, mass from the blocks where the key is a candidate",
    "causal": "oracle (b): query-independent, mass from queries before the block",
    "block": "oracle (c): per block and KV head, mass from the block's queries",
}

#: The oracle of the running forward (``oracle_mode``) and its kept-mass tally.
_STATE: dict = {"mode": None, "kept": 0.0, "total": 0.0}


@cache
def _script(name: str):
    """``scripts/<name>.py`` as a module: ``evaluate_selectors`` (variants, selector loading, parser helpers),
    ``train_selector`` (``block_attention_mass``, the distillation target)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def oracle_scores(mass: torch.Tensor, mode: str, cand: torch.Tensor) -> torch.Tensor:
    """Scores ``(B, Hkv, 1 | NB, S)`` of oracle ``mode`` (module docstring) from ``mass (B, Hkv, NB, S)``
    and the candidate mask ``cand (B, NB, S)`` (``selection_blocks``)."""
    if mode == "future":
        return mass.sum(2, keepdim=True)
    if mode == "candidate":
        return (mass * cand[:, None]).sum(2, keepdim=True)
    if mode == "causal":
        return mass.cumsum(2) - mass
    if mode == "block":
        return mass
    raise ValueError(f"oracle mode must be one of {list(ORACLES)}, got {mode!r}")


def oracle_selection(pattern, query: torch.Tensor, key: torch.Tensor, scale: float, mode: str):
    """``(TokenLayout | None, kept, total)`` of oracle ``mode`` for one prefill ``query (B, Hq, S, D)``,
    ``key (B, Hkv, S, D)``.

    The mass ``M (B, Hkv, NB, S)`` is ``train_selector.block_attention_mass`` (the distillation target);
    the layout comes from ``sparse_k.selection.selectors.selection_from_scores``. ``kept``/``total``: the mass of
    each block's own queries on the selected keys / on all candidates, summed over blocks and heads.
    """
    from sparse_k.layouts.geometry import row_geometry
    from sparse_k.selection.selectors import selection_blocks, selection_from_scores

    B, _, S, _ = query.shape
    mass = _script("train_selector").block_attention_mass(query, key, scale, pattern.query_block)
    geometry = row_geometry(B, S, S, None, None, device=query.device)
    cand = selection_blocks(pattern, geometry, B, S, S, mass.shape[2])[3]  # (B, NB, S)
    layout = selection_from_scores(pattern, oracle_scores(mass, mode, cand), geometry, S, S)
    if layout is None:
        return None, 0.0, 0.0
    total = float((mass * cand[:, None]).sum())
    idx = layout.indices.long()
    kept = float(torch.where(idx >= 0, mass.gather(-1, idx.clamp_min(0)), torch.zeros((), dtype=mass.dtype)).sum())
    return layout, kept, total


def oracle_attention_forward(module, query, key, value, key_mask, *, scaling=None, dropout=0.0, sliding_window=None,
                             softcap=None, s_aux=None, config=None, layer_idx=None, **kwargs):
    """Transformers attention function: the layer's ``sparse_k`` pattern with the selection of the
    oracle set by ``oracle_mode`` (prefill without padding only: what strided perplexity runs)."""
    from sparse_k import sparse_attention
    from sparse_k.integrations.transformers_adapter import _sparse_config, layer_pattern

    mode = _STATE["mode"]
    if mode not in ORACLES:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION}: run the model inside oracle_mode(one of {list(ORACLES)})")
    if key_mask is not None or query.shape[2] != key.shape[2] or sliding_window is not None or softcap is not None \
            or s_aux is not None:
        raise ValueError(f"{ATTN_IMPLEMENTATION} runs an unpadded prefill without the model's own sliding window, "
                         f"softcap or sink logits (got a key mask: {key_mask is not None}, Sq={query.shape[2]}, "
                         f"Skv={key.shape[2]}, sliding_window={sliding_window}, softcap={softcap}, "
                         f"sink logits: {s_aux is not None})")
    config = config if config is not None else module.config
    layer_idx = int(layer_idx if layer_idx is not None else getattr(module, "layer_idx", 0) or 0)
    pattern = layer_pattern(config, layer_idx)
    if not pattern.learned:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: layer {layer_idx} runs {pattern.name!r}; configure a learned pattern")
    scale = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
    layout, kept, total = oracle_selection(pattern, query, key, scale, mode)
    _STATE["kept"] += kept
    _STATE["total"] += total
    out = sparse_attention(query, key, value, pattern if layout is not None else pattern.static_part(), scale=scale,
                           layer_idx=layer_idx, selection=layout,
                           backend=_sparse_config(config).get("backend", "auto"))
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register the oracle attention function (and the ``sparse_k`` key-mask function) with Transformers."""
    from hf_sparse_attention.integration import key_mask
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, oracle_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, key_mask)


@contextmanager
def oracle_mode(mode: str):
    """Run forwards with oracle ``mode``; yields the state whose ``kept``/``total`` tally the kept mass."""
    if mode not in ORACLES:
        raise ValueError(f"oracle mode must be one of {list(ORACLES)}, got {mode!r}")
    _STATE.update(mode=mode, kept=0.0, total=0.0)
    try:
        yield _STATE
    finally:
        _STATE["mode"] = None


def apply_oracle(model, args) -> None:
    """Configure ``model`` with the table's ``sparse_k`` budget and the oracle attention function."""
    import hf_sparse_attention
    from hf_sparse_attention.selectors import detach_selectors

    detach_selectors(model)
    register()
    hf_sparse_attention.configure(model, "sparse_k", sinks=args.sinks, window=args.window, top_k=args.top_k,
                                  query_block=args.query_block)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


def build_parser() -> argparse.ArgumentParser:
    ev = _script("evaluate_selectors")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ev.add_setting_arguments(p)
    p.add_argument("--oracles", nargs="*", default=list(ORACLES), choices=list(ORACLES))
    p.add_argument("--no-baselines", action="store_true", help="skip streaming (dense is always run: the reference)")
    p.add_argument("--ppl-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--output", default=None, help="JSON file for the results (the table is printed either way)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.context < args.sinks + args.window + args.top_k:
        raise SystemExit(f"--context {args.context} is shorter than the key budget {args.sinks + args.window + args.top_k}")
    ev = _script("evaluate_selectors")
    from hf_sparse_attention.evaluation import gutenberg_files, load_documents, load_model, strided_perplexity, tokenize_corpus

    torch.manual_seed(args.seed)
    model, tok = (lambda m: (m.model, m.tokenizer))(load_model(args.model, attn_implementation="sdpa", dtype=args.dtype,
                                                              device=args.device))
    ids = tokenize_corpus(tok, load_documents("gutenberg", split="test"), max_tokens=args.ppl_tokens)
    ids = ids.to(next(model.parameters()).device)
    variants = ev._variants(args)
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
                ev._apply(model, variant)
                ppl = strided_perplexity(model, ids, args.context, args.context // 2, progress=not args.no_progress,
                                         desc=variant["label"])
                kept = None
        rows.append({**variant, "perplexity": ppl["perplexity"], "tokens": ppl["tokens"], "windows": ppl["windows"],
                     "candidate_mass_kept": kept, "seconds": time.perf_counter() - t0})
        print(f"{variant['label']}: perplexity {ppl['perplexity']:.3f} ({rows[-1]['seconds']:.0f} s)", flush=True)
    dense = rows[0]["perplexity"]
    budget = args.sinks + args.window + args.top_k
    lines = [
        f"context {args.context}, key budget {budget} per query (sinks {args.sinks}, window {args.window}, top_k "
        f"{args.top_k}, query_block {args.query_block} for the oracles); held-out Gutenberg "
        f"({', '.join(f.rsplit('/', 1)[-1] for f in gutenberg_files('test')[:2])}, ...), {rows[0]['tokens']} tokens scored "
        f"in {rows[0]['windows']} windows",
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


if __name__ == "__main__":
    sys.exit(main())
