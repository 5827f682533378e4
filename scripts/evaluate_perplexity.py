"""Strided sliding-window perplexity of one model under dense and sparse attention patterns.

Run `python scripts/evaluate_perplexity.py --help` for the flags; `accelerate launch scripts/evaluate_perplexity.py ...` splits the
work across GPUs. Results go to `results/<timestamp>/` (report.md, results.json, PNG plots).
"""

from hf_sparse_attention.evaluation.cli import main_for

main = main_for("evaluate_perplexity")

if __name__ == "__main__":
    raise SystemExit(main())
