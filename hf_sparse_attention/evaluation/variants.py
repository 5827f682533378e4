"""Attention variants compared by the evaluations: dense (``sdpa``) and sparse patterns with
comparable key budgets.

A *variant* is a label, a pattern name and its parameters. ``dense`` runs Transformers' own
``sdpa`` attention (the baseline users compare against); every other variant runs
``attn_implementation="sparse_k"`` configured with ``hf_sparse_attention.configure(model,
pattern=name, **params)``.

``preset_params(name, budget)`` gives each pattern about ``budget`` keys per query (far from the
sequence start), so perplexities at one context are compared at equal cost:

============== ===========================================================
streaming      sinks 4, window ``budget - 4``
sliding_window window ``budget``
sparse_k       sinks 4, window ``budget/2 - 4``, top_k ``budget/2``, query_block 64
dsa            as sparse_k
bigbird        block 64, global 1 block, window ``budget/4`` tokens (in blocks),
               the rest random blocks
block_diagonal block ``budget``
dilated        3 scales, window ``budget/3``
l2_aligned     block 64, window ``budget - 64`` tokens (in blocks), anchors 64 every 4096
============== ===========================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from sparse_k import available_patterns, build_block_layout, get_pattern, row_geometry

__all__ = ["DEFAULT_PATTERNS", "Variant", "key_budget", "make_variants", "preset_params"]

#: Variants of the main job and of ``--patterns`` without arguments (dense is always added).
DEFAULT_PATTERNS = ("streaming", "sliding_window", "sparse_k", "bigbird")


@dataclass(frozen=True)
class Variant:
    """One attention configuration: ``pattern == "dense"`` means Transformers' ``sdpa``."""

    label: str
    pattern: str
    params: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"label": self.label, "pattern": self.pattern, "params": dict(self.params)}


def preset_params(name: str, budget: int) -> dict:
    """Parameters giving pattern ``name`` about ``budget`` keys per query (module docstring)."""
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"budget must be an int, got {type(budget).__name__}")
    if budget < 64:
        raise ValueError(f"budget must be >= 64 keys, got {budget}")
    if name == "dense":
        return {}
    if name == "streaming":
        return {"sinks": 4, "window": budget - 4}
    if name == "sliding_window":
        return {"window": budget}
    if name in ("sparse_k", "dsa"):
        return {"sinks": 4, "window": budget // 2 - 4, "top_k": budget // 2, "query_block": 64}
    if name == "bigbird":
        blocks = budget // 64
        window = max(1, blocks // 4)
        return {"block": 64, "global_blocks": 1, "window_blocks": window,
                "random_blocks": max(0, blocks - 1 - window - 1), "seed": 0}
    if name == "block_diagonal":
        return {"block": budget}
    if name == "dilated":
        return {"window": max(1, budget // 3), "scales": 3}
    if name == "l2_aligned":
        return {"block": 64, "window_blocks": max(1, budget // 64 - 1), "segment": 4096, "anchor": 64}
    raise ValueError(f"unknown pattern {name!r}; available: {', '.join(available_patterns())}")


def make_variants(patterns, budget: int = 512, overrides: dict | None = None) -> list[Variant]:
    """Variants for ``patterns`` (names, or ``["all"]`` for every pattern), dense first.

    ``overrides`` maps a pattern name to parameters replacing the preset ones. Every variant is
    validated by building its pattern (bad parameters raise ``ValueError``/``TypeError`` here,
    before any model runs).
    """
    if patterns is None:
        patterns = list(DEFAULT_PATTERNS)
    if isinstance(patterns, str):
        patterns = [patterns]
    names = list(available_patterns()) if list(patterns) == ["all"] else list(patterns)
    unknown = [n for n in names if n not in available_patterns()]
    if unknown:
        raise ValueError(f"unknown pattern(s) {unknown}; available: all, {', '.join(available_patterns())}")
    overrides = overrides or {}
    for key in overrides:
        if key not in names:
            raise ValueError(f"parameters given for pattern {key!r}, which is not among {names}")
    ordered = ["dense"] + [n for n in dict.fromkeys(names) if n != "dense"]
    out = []
    for name in ordered:
        params = {**preset_params(name, budget), **overrides.get(name, {})}
        get_pattern(name, **params)
        out.append(Variant(label=name, pattern=name, params=params))
    return out


def _allowed_per_query(pattern, context: int, block: int = 64) -> torch.Tensor:
    """``(context,)`` int64: keys each query may attend under static ``pattern`` (causal, unpadded;
    KV head 0, layer 0), from its block layout: full tiles by their size, partial tiles by the rule."""
    geo = row_geometry(1, context, context)
    lay = build_block_layout(pattern, context, context, geo, block_q=block, block_k=block, cache=False)
    counts = torch.zeros(lay.num_q_blocks, block, dtype=torch.int64)
    width = torch.full((lay.num_k_blocks,), block, dtype=torch.int64)
    width[-1] = context - (lay.num_k_blocks - 1) * block
    nq = lay.num_q_blocks
    for m in range(nq):
        full = lay.full_kv_indices[0, 0, m, : int(lay.full_kv_num_blocks[0, 0, m])].long()
        counts[m] += int(width[full].sum())
    tiles_m = torch.repeat_interleave(torch.arange(nq), lay.kv_num_blocks[0, 0].long())
    tiles_n = torch.cat([lay.kv_indices[0, 0, m, : int(lay.kv_num_blocks[0, 0, m])].long() for m in range(nq)])
    offs = torch.arange(block)
    for i in range(0, len(tiles_m), 1024):
        tm, tn = tiles_m[i : i + 1024], tiles_n[i : i + 1024]
        qpos = (tm[:, None] * block + offs)[:, :, None]
        kpos = (tn[:, None] * block + offs)[:, None, :]
        ok = pattern.allowed(qpos, kpos, 0, torch.zeros((), dtype=torch.int64), context) & (kpos < context)
        counts.index_add_(0, tm, ok.sum(-1))
    return counts.flatten()[:context]


def key_budget(pattern: str, params: dict, context: int) -> dict:
    """Keys a query attends under ``pattern`` in a causal sequence of ``context`` tokens, counted exactly.

    Static patterns are counted from their block layout and element rule (bigbird: layer 0, KV head
    0, as its random blocks differ per layer and head); ``sparse_k``/``dsa`` count sinks + window plus
    ``min(top_k, candidates)`` selected keys per query block (design §6; candidates ``sinks <= j <=
    block_start - window``). Returns ``{"last_query_keys", "mean_keys_per_query", "causal_fraction"}``:
    the keys of the last query (the budget far from the start), the mean over all queries, and the
    allowed (query, key) pairs over the ``context * (context + 1) / 2`` causal pairs.
    """
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive int, got {context!r}")
    p = get_pattern(pattern, **params)
    per_query = _allowed_per_query(p.static_part() if p.learned else p, context)
    if p.learned:
        block_start = torch.arange(context) // p.query_block * p.query_block
        per_query = per_query + (block_start - p.window - p.sinks + 1).clamp(0, p.top_k)
    total = int(per_query.sum())
    return {"last_query_keys": int(per_query[-1]), "mean_keys_per_query": total / context,
            "causal_fraction": total / (context * (context + 1) // 2)}
