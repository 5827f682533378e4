#!/usr/bin/env python
"""Trained selectors vs streaming vs dense, in one table: key budget, perplexity and retrieval of each.

The command line of ``hf_sparse_attention.evaluation.evaluate_selectors`` (what each row and column
means: its docstring; the flags: ``--help``). Example (the defaults: SmolLM2-135M, 4K context,
sinks 4, window 256, top_k 256 -> 516 keys per query)::

    python scripts/evaluate_selectors.py --selector sparse_k=runs/sparse_k/sparse_k_selectors.safetensors \
        --training-free sparse_k --output results/selectors.json
"""

import sys

from hf_sparse_attention.evaluation.evaluate_selectors import main

if __name__ == "__main__":
    sys.exit(main())
