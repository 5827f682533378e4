#!/usr/bin/env python
"""How good can a learned selection get? Perplexity with oracle selections (issue: learned selection).

The command line of ``hf_sparse_attention.evaluation.selection_ceiling`` (the table: its docstring;
the oracles: ``hf_sparse_attention.evaluation.oracle``; the flags: ``--help``). Example (the issue's
setting, 516 keys per query)::

    python scripts/selection_ceiling.py --device cpu --dtype float32 --ppl-tokens 8192 \\
        --selector sparse_k=runs/sk/sparse_k_selectors.safetensors --output results/ceiling.json
"""

import sys

from hf_sparse_attention.evaluation.selection_ceiling import main

if __name__ == "__main__":
    sys.exit(main())
