"""Key budgets of a variant at a context length: keys per query and the fraction of causal pairs.

For a causal prefill of ``S`` tokens there are ``S (S + 1) / 2`` causal (query, key) pairs.
``attention_budget(pattern, S)`` counts the pairs the pattern attends:

* the static rule (``Pattern.allowed``; for ``sparse_k``/``dsa`` their sinks + window part),
  counted row chunk by row chunk (no ``S x S`` tensor);
* for the learned patterns, the selection: every query of block ``[b0, b0 + query_block)`` gets
  ``min(top_k, candidates)`` extra keys, the candidates being ``[sinks, b0 - window]``
  (``Pattern.candidate_range``), which lie before every query of the block and outside its
  window, so they never overlap the static part.

``keys_per_query`` is the largest number of keys any query attends at that length (for ``sparse_k``:
``sinks + window + top_k`` once the context is long enough); ``fraction`` is attended pairs over
causal pairs. Per-head and per-layer rules (bigbird's random blocks) are counted for layer 0,
KV head 0.

``layered_budget(pattern, S, num_layers, dense_layers)`` counts a model whose ``dense_layers`` stay
dense: ``keys_per_query`` is the sparse layers' figure, ``dense_layers`` says how many layers attend
every causal key, and ``fraction`` / ``mean_keys_per_query`` average over all ``num_layers`` layers.
"""

from __future__ import annotations

import torch
from sparse_k import get_pattern

__all__ = ["attention_budget", "layered_budget", "variant_budget"]


def _learned_counts(pattern, qpos: torch.Tensor) -> torch.Tensor:
    """Selected keys per query ``(n,)`` int64 for query positions ``qpos (n,)``."""
    block_start = torch.div(qpos, pattern.query_block, rounding_mode="floor") * pattern.query_block
    lo, hi = pattern.candidate_range(block_start)
    return (hi - lo + 1).clamp_min(0).clamp_max(pattern.top_k)


def attention_budget(pattern, context: int, *, chunk: int = 256) -> dict:
    """``{"context", "keys_per_query", "mean_keys_per_query", "pairs", "causal_pairs", "fraction"}``
    of ``pattern`` (a ``sparse_k`` Pattern, name or dict) on a causal prefill of ``context`` tokens."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive int, got {context!r}")
    pattern = get_pattern(pattern)
    if not pattern.causal:
        raise ValueError(f"attention_budget counts causal pairs; pattern {pattern.name!r} is bidirectional")
    static = pattern.static_part() if pattern.learned else pattern
    kpos = torch.arange(context, dtype=torch.int64)[None, :]
    pairs, most = 0, 0
    for q0 in range(0, context, chunk):
        qpos = torch.arange(q0, min(context, q0 + chunk), dtype=torch.int64)
        rows = static.allowed(qpos[:, None], kpos, 0, 0, context).sum(-1)
        if pattern.learned:
            rows = rows + _learned_counts(pattern, qpos)
        pairs += int(rows.sum())
        most = max(most, int(rows.max()))
    causal = context * (context + 1) // 2
    return {"context": context, "keys_per_query": most, "mean_keys_per_query": pairs / context,
            "pairs": pairs, "causal_pairs": causal, "fraction": pairs / causal}


def variant_budget(variant, context: int) -> dict:
    """``attention_budget`` of an evaluation ``Variant`` (dense: every causal pair), with its label."""
    return {"variant": variant.label, "pattern": variant.pattern,
            **attention_budget(get_pattern(variant.pattern, **variant.params), context)}


def layered_budget(pattern, context: int, num_layers: int, dense_layers=()) -> dict:
    """``attention_budget`` of a ``num_layers``-layer model running ``pattern`` except on ``dense_layers``
    (which attend every causal pair), averaged over the layers (module docstring); adds ``layers`` and
    ``dense_layers`` (how many)."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    dense = sorted(set(dense_layers))
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in dense):
        raise ValueError(f"dense_layers must be layer indices in [0, {num_layers - 1}], got {list(dense_layers)!r}")
    sparse = attention_budget(pattern, context)
    n_dense, causal = len(dense), sparse["causal_pairs"]
    pairs = (sparse["pairs"] * (num_layers - n_dense) + causal * n_dense) / num_layers
    return {**sparse, "pairs": pairs, "fraction": pairs / causal, "mean_keys_per_query": pairs / context,
            "layers": num_layers, "dense_layers": n_dense}
