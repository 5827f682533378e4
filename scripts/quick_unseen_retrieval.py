#!/usr/bin/env python
"""Stopgap check of the training-free selection on prompts no selector was designed on (until the
evaluation package has its unseen-format prompts): retrieval and perplexity, dense vs variants.

Two prompt formats, neither the passkey (grass/sky filler) nor the Gutenberg needle of
``hf_sparse_attention.evaluation.retrieval``:

* ``dev``: haystack = a Shakespeare play of the *train* split, needle "Remember this: the secret code
  word of the archive is N.", question after the haystack. Used to choose the design.
* ``report``: haystack = licence prose (``/usr/share/common-licenses``: GPL-3, GFDL-1.3, Apache-2.0),
  needle "Note for the auditor: the vault combination is N, written on the blue card.", the
  question asked *before* the haystack and again after it. Only run for the final numbers.

Perplexity: independent ``--context`` chunks of the held-out Gutenberg plays (``--ppl-tokens``).
Retrieval is scored teacher-forced (``_teacher_forced_hit``): one forward pass per prompt.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

FORMATS = {
    "dev": dict(
        needle="Remember this: the secret code word of the archive is {key}.",
        before="",
        question="\n\nQuestion: what is the secret code word of the archive?\nAnswer: The secret code word of the archive is",
    ),
    "report": dict(
        needle="Note for the auditor: the vault combination is {key}, written on the blue card.",
        before="Read the document below and find the vault combination.\n\n",
        question="\n\nWhat is the vault combination mentioned in the document? The vault combination is",
    ),
}


def _haystack(fmt: str) -> str:
    if fmt == "dev":
        from hf_sparse_attention.evaluation.corpora import gutenberg_files

        files = [f for f in gutenberg_files("train") if "coriolanus_gut.txt" in f or "as_you_like_it_gut.txt" in f]
    else:
        files = [f"/usr/share/common-licenses/{n}" for n in ("GPL-3", "GFDL-1.3", "Apache-2.0")]
    return "\n".join(open(f, encoding="utf-8", errors="replace").read() for f in files)


def _prompt(tok, hay_ids, fmt, context, depth, key, offset):
    f = FORMATS[fmt]
    needle = f["needle"].format(key=key)
    room = context - len(tok(f["before"] + needle + f["question"])["input_ids"]) - 8
    start = offset % (len(hay_ids) - room)
    text = tok.decode(hay_ids[start:start + room], skip_special_tokens=True)
    cuts = [i for i, c in enumerate(text) if c == "\n"] or [len(text)]
    cut = min(cuts, key=lambda c: abs(c - depth * len(text)))
    return f["before"] + text[:cut] + "\n" + needle + text[cut:] + f["question"]


def _teacher_forced_hit(model, tok, prompt: str, key: int) -> bool:
    """Greedy decoding would start its answer with `` key``: every answer token is the argmax given the
    prompt and the answer's earlier tokens (one forward pass; decode equals recompute, tested)."""
    p_ids = tok(prompt)["input_ids"]
    a_ids = tok(" " + str(key), add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p_ids + a_ids])
    with torch.no_grad():
        logits = model(ids, logits_to_keep=len(a_ids) + 1).logits[0, :-1]
    return bool((logits.argmax(-1) == torch.tensor(a_ids)).all())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", choices=list(FORMATS), default="dev")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--variants", nargs="+", default=["dense", "sparse_k"], help="dense, streaming, sparse_k, dsa")
    p.add_argument("--page", type=int, default=None, help="page size of the training-free selection")
    p.add_argument("--head-reduce", choices=["sum", "max"], default=None)
    p.add_argument("--ppl-tokens", type=int, default=0)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--top-k", type=int, default=256)
    p.add_argument("--query-block", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import hf_sparse_attention
    import sparse_k.page_selection as ps
    from hf_sparse_attention.evaluation import load_model, load_documents, strided_perplexity, tokenize_corpus
    from hf_sparse_attention.evaluation.retrieval import score_answer

    if args.page:
        ps.DEFAULT_PAGE = args.page
    if args.head_reduce:
        ps.HEAD_REDUCE = args.head_reduce
    torch.manual_seed(0)
    loaded = load_model(None, attn_implementation="sdpa", dtype="float32", device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    hay_ids = tok(_haystack(args.format))["input_ids"]
    rng = random.Random(f"{args.seed}-{args.format}")
    trials = [(i / max(1, args.trials - 1) * 0.9 + 0.05, rng.randint(10000, 99999), rng.randint(0, 10**6))
              for i in range(args.trials)]
    prompts = [_prompt(tok, hay_ids, args.format, args.context, d, k, o) for d, k, o in trials]
    ppl_ids = None
    if args.ppl_tokens:
        ppl_ids = tokenize_corpus(tok, load_documents("gutenberg", split="test"), max_tokens=args.ppl_tokens)
    learned = dict(sinks=args.sinks, window=args.window, top_k=args.top_k, query_block=args.query_block)
    rows = []
    for name in args.variants:
        if name == "dense":
            model.set_attn_implementation("sdpa")
        else:
            model.set_attn_implementation("sparse_k")
            params = learned if name in ("sparse_k", "dsa") else dict(sinks=args.sinks, window=args.window + args.top_k)
            hf_sparse_attention.configure(model, name, **params)
        t0 = time.perf_counter()
        hits = 0
        for prompt, (_, key, _) in zip(prompts, trials):
            hits += _teacher_forced_hit(model, tok, prompt, key)
        ppl = None
        if ppl_ids is not None:
            ppl = strided_perplexity(model, ppl_ids, args.context, args.context, progress=False)["perplexity"]
        rows.append((name, hits, ppl, time.perf_counter() - t0))
        print(f"{name}: retrieved {hits}/{len(prompts)}" + (f", ppl {ppl:.3f}" if ppl else "")
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    dense = {r[0]: r for r in rows}.get("dense")
    if dense and dense[2]:
        for name, hits, ppl, _ in rows:
            print(f"| {name} | {hits}/{len(prompts)} | {ppl:.3f} | {(ppl / dense[2] - 1) * 100:+.1f}% |")
    print("command: python " + " ".join(sys.argv), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
