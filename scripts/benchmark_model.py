"""End-to-end prefill time, decode tokens/s and peak memory at several lengths.

Run `python scripts/benchmark_model.py --help` for the flags; `accelerate launch scripts/benchmark_model.py ...` splits the
work across GPUs. Results go to `results/<timestamp>/` (report.md, results.json, PNG plots).
"""

from hf_sparse_attention.evaluation.cli import main_for

main = main_for("benchmark_model")

if __name__ == "__main__":
    raise SystemExit(main())
