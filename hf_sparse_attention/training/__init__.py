"""Selector training: SparseK scorers or DSA indexers learn, per layer, which keys a frozen causal
LM's queries attend (design §6-§7).

Modules: ``train_selector`` (the command line of ``scripts/train_selector.py`` and the training
loop), ``distill`` (distillation losses and their target, the dense attention mass per query
block), ``data`` (training texts and deterministic token sequences), ``attention`` (the attention
function that computes the losses inside the frozen LM), ``checkpoints``. Nothing here is imported
by ``import hf_sparse_attention``; ``accelerate`` and ``datasets`` are imported only when used.
"""
