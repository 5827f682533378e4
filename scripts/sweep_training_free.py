#!/usr/bin/env python
"""The command line of ``hf_sparse_attention.evaluation.sweep_training_free``: settings of the
training-free selection at the acceptance cells, in one process (what it runs and checks: its
docstring; the flags: ``--help``). Example::

    python scripts/sweep_training_free.py --cells 4096:4:256:256 8192:4:508:512 \\
        --settings qb=64,page=16,heads=sum qb=16,page=16,heads=sum,dense=0-1 --output sweep.json \\
        -- --scoring teacher-forced --tasks unseen passkey --depths 0.1 0.3 0.5 0.7 0.9 --trials-per-depth 2
"""

import sys

from hf_sparse_attention.evaluation.sweep_training_free import main

if __name__ == "__main__":
    sys.exit(main())
