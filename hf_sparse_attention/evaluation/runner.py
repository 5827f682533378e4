"""Work items of the three evaluations and the function that runs one item on a loaded model.

An item is a plain dict: ``{"kind": "perplexity" | "retrieval" | "speed", "variant": Variant, ...}``;
a retrieval item holds a batch of trials of one variant, task and context (``"items"``), answered by
one batched ``generate`` call, and its result lists one record per trial (``"records"``).
``Runner`` holds the model and the data the items share (corpus tokens, haystack tokens), switches
the model to an item's variant only when it changes, and returns a JSON-friendly record per item.
"""

from __future__ import annotations

import time

from .models import apply_variant
from .perplexity import strided_perplexity
from .retrieval import retrieval_items, run_retrieval_batch
from .speed import benchmark_lengths
from .variants import make_variants

__all__ = ["Runner", "budget_for", "perplexity_items", "retrieval_work", "speed_items", "variant_order"]


def budget_for(context: int, budget: int | None) -> int:
    """Keys per query for a context: ``budget`` when given, else a quarter of the context (>= 64)."""
    return int(budget) if budget is not None else max(64, context // 4)


def perplexity_items(patterns, contexts, budget, stride, windows: int = 1) -> list[dict]:
    """One item per (context, variant, text window); ``stride=None`` means half the context, ``0`` the
    context; ``windows``: text windows per (context, variant) (``Runner``'s ``ppl_windows``)."""
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise ValueError(f"windows must be a positive int, got {windows!r}")
    items = []
    for c in contexts:
        for v in make_variants(patterns, budget_for(c, budget)):
            for w in range(windows):
                items.append({"kind": "perplexity", "variant": v, "context": int(c), "window": w,
                              "stride": int(stride) if stride else (int(c) if stride == 0 else max(2, c // 2))})
    return items


def retrieval_work(task, patterns, contexts, depths, trials_per_depth, budget, seed,
                   only_dense: bool = False, batch_size: int = 1, needles: int = 4) -> list[dict]:
    """Items of up to ``batch_size`` trials of one (variant, context); ``only_dense``: dense only;
    ``needles``: needles per ``multikey`` trial.

    The batches are fixed here, before any work splitting, so every process count runs the same
    batches and produces the same records.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    trials = retrieval_items(task, list(contexts), list(depths), trials_per_depth, seed, needles=needles)
    items = []
    for c in dict.fromkeys(it.context for it in trials):
        group = [it for it in trials if it.context == c]
        for v in make_variants(patterns, budget_for(c, budget)):
            if only_dense and v.pattern != "dense":
                continue
            for start in range(0, len(group), batch_size):
                items.append({"kind": "retrieval", "variant": v, "items": group[start:start + batch_size]})
    return items


def speed_items(patterns, lengths, budget) -> list[dict]:
    """One item per variant (all lengths in one item: the lengths share a warm-up)."""
    return [{"kind": "speed", "variant": v, "lengths": [int(x) for x in lengths]}
            for v in make_variants(patterns, budget)]


def variant_order(item: dict):
    """Sort key grouping items by variant (fewer reconfigurations)."""
    v = item["variant"]
    return (v.pattern, sorted(v.params.items()))


class Runner:
    """Runs work items on one loaded model.

    ``token_ids``: ``(1, N)`` corpus tokens for perplexity (one window), or ``ppl_windows``: a list of
    ``(offset, ids (1, N))`` text windows (``perplexity_windows``; an item's ``"window"`` indexes it);
    ``haystack_ids``: token ids of the needle task's haystack (and the unseen formats' play filler);
    ``decode_tokens``/``repeats``: speed settings.
    """

    def __init__(self, model, tokenizer, *, token_ids=None, ppl_windows=None, haystack_ids=None,
                 decode_tokens: int = 16, repeats: int = 1, max_new_tokens: int = 7, seed: int = 0):
        if token_ids is not None and ppl_windows is not None:
            raise ValueError("give token_ids or ppl_windows, not both")
        self.model, self.tokenizer = model, tokenizer
        self.ppl_windows = ppl_windows if token_ids is None else [(0, token_ids)]
        self.haystack_ids = haystack_ids
        self.decode_tokens, self.repeats, self.max_new_tokens, self.seed = decode_tokens, repeats, max_new_tokens, seed
        self._current = None

    def _switch(self, variant) -> None:
        if self._current != variant:
            apply_variant(self.model, variant)
            self._current = variant

    def __call__(self, item: dict) -> dict:
        v = item["variant"]
        self._switch(v)
        base = {"variant": v.label, "pattern": v.pattern, "params": dict(v.params)}
        if item["kind"] == "perplexity":
            w = item.get("window", 0)
            if self.ppl_windows is None or w >= len(self.ppl_windows):
                raise ValueError(f"perplexity item of text window {w} needs corpus token ids for it")
            offset, ids = self.ppl_windows[w]
            t0 = time.perf_counter()
            r = strided_perplexity(self.model, ids, item["context"], item["stride"], progress=False)
            return {**base, "context": item["context"], "stride": item["stride"], **r,
                    "seconds": time.perf_counter() - t0, "window": w, "offset": int(offset)}
        if item["kind"] == "retrieval":
            records = run_retrieval_batch(self.model, self.tokenizer, item["items"], self.haystack_ids,
                                          self.max_new_tokens)
            return {**base, "records": [{**base, **r} for r in records]}
        if item["kind"] == "speed":
            rows = benchmark_lengths(self.model, item["lengths"], decode_tokens=self.decode_tokens,
                                     repeats=self.repeats, seed=self.seed)
            return {**base, "rows": rows}
        raise ValueError(f"unknown work item kind {item['kind']!r}")
