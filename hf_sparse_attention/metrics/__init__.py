"""``evaluate`` metric modules shipped with hf_sparse_attention, loadable offline::

    import evaluate
    from hf_sparse_attention.metrics import metric_path

    ppl = evaluate.load(metric_path("sparse_perplexity"))
    ppl.compute(predictions=texts, pattern="streaming", pattern_params={"sinks": 4, "window": 256})

    acc = evaluate.load(metric_path("retrieval_accuracy"))
    acc.compute(predictions=["12345.", "9"], references=["12345", "54321"])

Each folder (``<name>/<name>.py`` plus a README card) can be pushed to the Hub as a metric Space.
"""

from __future__ import annotations

import os

__all__ = ["METRICS", "metric_path"]

METRICS = ("sparse_perplexity", "retrieval_accuracy")


def metric_path(name: str) -> str:
    """Folder of the metric ``name`` (pass it to ``evaluate.load``)."""
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; available: {', '.join(METRICS)}")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
