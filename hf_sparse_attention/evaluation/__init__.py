"""Evaluation library of hf_sparse_attention: model loading, corpora, strided perplexity,
passkey / needle-in-a-haystack retrieval, speed, report writing and ``accelerate`` work splitting.

Entry points: ``hfsa-evaluate`` (``main.py``), ``scripts/evaluate_perplexity.py``,
``scripts/evaluate_retrieval.py``, ``scripts/benchmark_model.py`` (all ``cli.main_for``);
``scripts/evaluate_selectors.py`` (``evaluate_selectors``: trained selectors vs streaming vs dense) and
``scripts/selection_ceiling.py`` (``selection_ceiling``, with the oracle selections of ``oracle``).
"""

from .corpora import GUTENBERG_TEST_PLAYS, gutenberg_files, load_documents
from .models import DEFAULT_MODEL, LoadedModel, apply_variant, default_gguf, load_model
from .perplexity import strided_perplexity, tokenize_corpus
from .report import SCHEMA_PATH, load_schema, validate_results, write_outputs
from .retrieval import (RetrievalItem, passkey_prompt, retrieval_items, run_retrieval_batch, run_retrieval_item,
                        run_retrieval_teacher_forced, score_answer)
from .speed import benchmark_lengths
from .variants import DEFAULT_PATTERNS, Variant, make_variants, preset_params

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_PATTERNS",
    "GUTENBERG_TEST_PLAYS",
    "LoadedModel",
    "RetrievalItem",
    "SCHEMA_PATH",
    "Variant",
    "apply_variant",
    "benchmark_lengths",
    "default_gguf",
    "gutenberg_files",
    "load_documents",
    "load_model",
    "load_schema",
    "make_variants",
    "passkey_prompt",
    "preset_params",
    "retrieval_items",
    "run_retrieval_batch",
    "run_retrieval_item",
    "run_retrieval_teacher_forced",
    "score_answer",
    "strided_perplexity",
    "tokenize_corpus",
    "validate_results",
    "write_outputs",
]
