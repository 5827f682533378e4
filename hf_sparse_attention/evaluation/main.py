"""The main job (``hfsa-evaluate``): perplexity, passkey/needle retrieval and speed of dense vs
sparse patterns on the embedded SmolLM2-135M (or any model by flag), written to
``results/<timestamp>/{report.md, results.json, *.png}``.

On CPU the ``small`` profile runs in a few minutes on 2 cores; on CUDA the ``full`` profile runs
contexts 2K/4K/8K. ``accelerate launch -m hf_sparse_attention.evaluation.main ...`` splits the
work across GPUs.
"""

from __future__ import annotations

from .cli import main_for

__all__ = ["main"]

main = main_for("hfsa-evaluate")

if __name__ == "__main__":
    raise SystemExit(main())
