"""Train SparseK scorers or DSA indexers for a frozen causal LM (design §6-§7), with ``accelerate``.

The command line of ``hf_sparse_attention.training.train_selector`` (losses, data, recipes,
checkpoints and outputs: its docstring; the flags: ``--help``). Examples::

    python scripts/train_selector.py --device cpu --steps 2 --seq-len 256 --window 32 --top-k 32 ...
    accelerate launch --num_processes 1 scripts/train_selector.py --output-dir runs/sk
    accelerate launch --num_processes 2 scripts/train_selector.py --output-dir runs/sk2
"""

import sys

from hf_sparse_attention.training.train_selector import main

if __name__ == "__main__":
    sys.exit(main())
