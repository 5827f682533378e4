"""Strided sliding-window perplexity (the Transformers documentation's recipe).

Windows of ``max_length`` tokens start every ``stride`` tokens; each window scores only the tokens
not scored by the previous one (earlier tokens serve as context, labelled -100). Perplexity is
``exp(sum NLL / scored tokens)``. Results carry the NLL sum and the token count, so results from
several processes merge exactly.

``perplexity_windows`` cuts several disjoint text windows from one tokenized corpus (window 0 is
the corpus's first tokens, the others at seeded offsets), so a perplexity comes with a spread
(``perplexity_spread``: mean, sample standard deviation, min and max over the windows).
"""

from __future__ import annotations

import math
import random
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

__all__ = ["perplexity_spread", "perplexity_windows", "strided_perplexity", "tokenize_corpus"]


def perplexity_windows(ids: torch.Tensor, tokens: int, count: int, seed: int = 0) -> list[tuple[int, torch.Tensor]]:
    """``count`` disjoint windows ``(offset, ids (1, tokens))`` of the corpus ``ids (1, N)``.

    Window 0 starts at token 0 (the single-window evaluation's text); windows 1.. start at distinct
    multiples of ``tokens`` drawn by a generator seeded with ``seed``, so every seed index scores
    different text. Raises ``ValueError`` when the corpus holds fewer than ``count * tokens`` tokens.
    """
    for name, value in (("tokens", tokens), ("count", count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must have shape (1, N), got {tuple(ids.shape)}")
    slots = ids.shape[1] // tokens
    if slots < count:
        raise ValueError(f"the corpus has {ids.shape[1]} tokens: {count} windows of {tokens} tokens need "
                         f"{count * tokens} (use fewer windows, fewer tokens or a longer corpus)")
    picks = [0] + sorted(random.Random(f"ppl-windows-{seed}").sample(range(1, slots), count - 1))
    return [(p * tokens, ids[:, p * tokens:(p + 1) * tokens]) for p in picks]


def perplexity_spread(values: list[float]) -> dict:
    """``{"n", "mean", "std", "min", "max"}`` of per-window perplexities (``std``: sample, 0 for one)."""
    if not values:
        raise ValueError("perplexity_spread needs at least one value")
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"n": len(values), "mean": statistics.fmean(values), "std": std, "min": min(values), "max": max(values)}


def tokenize_corpus(tokenizer, documents: list[str], max_tokens: int | None = None, *, return_count: bool = False):
    """Token ids ``(1, N)`` int64 of the documents joined by blank lines, cut to ``max_tokens``.

    With ``return_count=True`` returns ``(ids, number of documents that contributed tokens)``.
    """
    if not documents:
        raise ValueError("the corpus has no documents")
    ids: list[int] = []
    used = 0
    for doc in documents:
        used += 1
        piece = tokenizer(doc if not ids else "\n\n" + doc, add_special_tokens=not ids)["input_ids"]
        ids.extend(piece)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    if max_tokens is not None:
        ids = ids[:max_tokens]
    out = torch.tensor([ids], dtype=torch.long)
    return (out, used) if return_count else out


@torch.no_grad()
def strided_perplexity(
    model,
    input_ids: torch.Tensor,
    max_length: int,
    stride: int | None = None,
    *,
    progress: bool = True,
    desc: str = "perplexity",
) -> dict:
    """Perplexity of ``input_ids`` ``(1, N)`` with windows of ``max_length`` tokens every ``stride``.

    Returns ``{"perplexity", "nll_sum", "tokens", "windows", "seconds"}``; ``tokens`` counts scored
    tokens: ``N - 1`` when ``stride < max_length`` (the first token of the text has no prediction);
    with ``stride == max_length`` the windows are independent chunks and, as in the recipe, the
    first token of each chunk is not scored either.
    """
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape (1, N), got {tuple(input_ids.shape)}")
    for name, value in (("max_length", max_length), ("stride", stride if stride is not None else max_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ValueError(f"{name} must be an int >= 2, got {value!r}")
    stride = max_length if stride is None else stride
    if stride > max_length:
        raise ValueError(f"stride ({stride}) must be <= max_length ({max_length})")
    seq_len = input_ids.shape[1]
    if seq_len < 2:
        raise ValueError(f"need at least 2 tokens to score, got {seq_len}")
    device = next(model.parameters()).device
    nll_sum, n_scored, prev_end, windows = 0.0, 0, 0, 0
    starts = list(range(0, seq_len, stride))
    t0 = time.perf_counter()
    for begin in tqdm(starts, desc=desc, disable=not progress, leave=False):
        end = min(begin + max_length, seq_len)
        trg_len = end - prev_end
        window = input_ids[:, begin:end].to(device)
        logits = model(window, use_cache=False).logits[0, :-1].float()
        targets = window[0, 1:].clone()
        first_scored = max(0, (end - begin) - trg_len - 1)
        targets[:first_scored] = -100
        nll = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
        nll_sum += float(nll)
        n_scored += int((targets != -100).sum())
        windows += 1
        prev_end = end
        if end == seq_len:
            break
    seconds = time.perf_counter() - t0
    return {"perplexity": math.exp(nll_sum / n_scored), "nll_sum": nll_sum, "tokens": n_scored,
            "windows": windows, "seconds": seconds}
