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

from sparse_k import available_patterns, get_pattern

__all__ = ["DEFAULT_PATTERNS", "Variant", "make_variants", "preset_params"]

#: Variants of the main job and of ``--patterns`` without arguments (dense is always added).
DEFAULT_PATTERNS = ("streaming", "sliding_window", "sparse_k", "dsa", "bigbird")


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
        # dsa: one selection per query, as its shipped selectors were trained (hf_sparse_attention.shipped)
        return {"sinks": 4, "window": budget // 2 - 4, "top_k": budget // 2, "query_block": 64 if name == "sparse_k" else 1}
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

