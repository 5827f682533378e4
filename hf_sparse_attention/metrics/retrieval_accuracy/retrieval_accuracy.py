"""Exact-match retrieval accuracy for passkey / needle-in-a-haystack answers.

A prediction is correct when the first integer it contains equals the reference key exactly
(``"12345. Remember it."`` matches ``"12345"``; ``"123456"`` and ``"1234"`` do not). Optional
``groups`` (one label per example, e.g. ``"2048@0.5"`` or a pattern name) adds per-group accuracy.
"""

import datasets
import evaluate

from hf_sparse_attention.evaluation.retrieval import score_answer

_DESCRIPTION = __doc__

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): generated answers.
    references (list of str): the keys (digits).
    groups (list of str, optional): a label per example for a per-group breakdown.
Returns:
    accuracy (float), correct (int), total (int), and by_group ({label: accuracy}) when groups are given.
Examples:
    >>> acc = evaluate.load(hf_sparse_attention.metrics.metric_path("retrieval_accuracy"))
    >>> acc.compute(predictions=["12345.", "9"], references=["12345", "54321"])
    {'accuracy': 0.5, 'correct': 1, 'total': 2}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class RetrievalAccuracy(evaluate.Metric):
    """Exact match of the first integer of each prediction against its key."""

    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
            reference_urls=["https://arxiv.org/abs/2305.16300"],
        )

    def _compute(self, predictions, references, groups=None):
        for ref in references:
            if not str(ref).strip().isdigit():
                raise ValueError(f"references must be keys made of digits, got {ref!r}")
        hits = [score_answer(p, str(r).strip()) for p, r in zip(predictions, references)]
        out = {"accuracy": sum(hits) / len(hits) if hits else 0.0, "correct": sum(hits), "total": len(hits)}
        if groups is not None:
            if len(groups) != len(hits):
                raise ValueError(f"groups has {len(groups)} labels for {len(hits)} examples")
            by: dict = {}
            for g, h in zip(groups, hits):
                by.setdefault(str(g), []).append(h)
            out["by_group"] = {g: sum(v) / len(v) for g, v in by.items()}
        return out
