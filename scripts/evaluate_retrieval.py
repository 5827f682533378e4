"""Passkey retrieval and needle-in-a-haystack accuracy over context lengths x needle depths.

Run `python scripts/evaluate_retrieval.py --help` for the flags; `accelerate launch scripts/evaluate_retrieval.py ...` splits the
work across GPUs. Results go to `results/<timestamp>/` (report.md, results.json, PNG plots).
"""

from hf_sparse_attention.evaluation.cli import main_for

main = main_for("evaluate_retrieval")

if __name__ == "__main__":
    raise SystemExit(main())
