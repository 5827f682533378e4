"""Oracle selections: how good can a learned selection get? (measured by ``selection_ceiling``)

An oracle runs the model with the ``sparse_k`` selection rules of design §6 (sinks, window,
``top_k`` keys per query block and KV head among the candidates ``sinks <= j <= b0 - window``, weight 1),
but the keys are chosen inside every attention layer from that layer's own *dense* causal attention
probabilities ``P (B, Hq, S, S)`` on the states the sparse forward actually produced. With
``M[b, g, n, j]`` = the mass the queries of block ``n`` and the query heads of KV group ``g`` give key
``j`` (a sum of probabilities), the oracle scores are:

* ``future`` (a): ``u_j = sum_n M[n, j]``, the total mass key ``j`` receives from all queries of the
  sequence, future ones included: one score per key and KV head for every block, as a query-independent
  score (SparseK by design §6) has, but with knowledge no such score has;
* ``candidate`` (a'): ``u_j = sum_n M[n, j] [j is a candidate of block n]``, the same but only from
  the blocks that can select ``j`` (mass that the window serves anyway does not count): the better
  query-independent oracle of the two (neither is a strict bound: the best fixed ranking is a
  combinatorial problem);
* ``causal`` (b): ``u_j(n) = sum_{n' < n} M[n', j]``, the mass received from the queries before block
  ``n`` (what a cumulative, heavy-hitter-like score could know when the block starts);
* ``block`` (c): ``u_j(n) = M[n, j]``, the mass the block's own queries give each candidate: the
  per-block, per-KV-head ceiling for query-dependent selectors (DSA-like).

Oracle (b)'s scores change from block to block, so unlike design §6's fixed scores a key it drops
may come back (no eviction). ``oracle_attention_forward`` is a Transformers attention function
(``register`` names it ``ATTN_IMPLEMENTATION``); ``oracle_mode`` sets the oracle of the forwards run
inside it and tallies the kept mass.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from sparse_k import row_geometry, sparse_attention
from sparse_k.selection.selectors import selection_blocks, selection_from_scores
from sparse_k.integrations.transformers_adapter import _sparse_config, layer_pattern

from ..configure import configure
from ..integration import key_mask
from ..selectors import detach_selectors
from ..training.distill import block_attention_mass

__all__ = ["ATTN_IMPLEMENTATION", "ORACLES", "apply_oracle", "oracle_attention_forward", "oracle_mode",
           "oracle_scores", "oracle_selection", "register"]

#: ``attn_implementation`` name of the oracle attention function (registered by ``register``).
ATTN_IMPLEMENTATION = "sparse_k_selection_oracle"

#: Oracle modes and their table labels.
ORACLES = {
    "future": "oracle (a): query-independent, total mass incl. future queries",
    "candidate": "oracle (a'): query-independent, mass from the blocks where the key is a candidate",
    "causal": "oracle (b): query-independent, mass from queries before the block",
    "block": "oracle (c): per block and KV head, mass from the block's queries",
}

#: The oracle of the running forward (``oracle_mode``) and its kept-mass tally.
_STATE: dict = {"mode": None, "kept": 0.0, "total": 0.0}


def oracle_scores(mass: torch.Tensor, mode: str, cand: torch.Tensor) -> torch.Tensor:
    """Scores ``(B, Hkv, 1 | NB, S)`` of oracle ``mode`` (module docstring) from ``mass (B, Hkv, NB, S)``
    and the candidate mask ``cand (B, NB, S)`` (``selection_blocks``)."""
    if mode == "future":
        return mass.sum(2, keepdim=True)
    if mode == "candidate":
        return (mass * cand[:, None]).sum(2, keepdim=True)
    if mode == "causal":
        return mass.cumsum(2) - mass
    if mode == "block":
        return mass
    raise ValueError(f"oracle mode must be one of {list(ORACLES)}, got {mode!r}")


def oracle_selection(pattern, query: torch.Tensor, key: torch.Tensor, scale: float, mode: str):
    """``(TokenLayout | None, kept, total)`` of oracle ``mode`` for one prefill ``query (B, Hq, S, D)``,
    ``key (B, Hkv, S, D)``.

    The mass ``M (B, Hkv, NB, S)`` is ``training.distill.block_attention_mass`` (the distillation target);
    the layout comes from ``sparse_k.selection.selectors.selection_from_scores``. ``kept``/``total``: the mass of
    each block's own queries on the selected keys / on all candidates, summed over blocks and heads.
    """
    B, _, S, _ = query.shape
    mass = block_attention_mass(query, key, scale, pattern.query_block)
    geometry = row_geometry(B, S, S, None, None, device=query.device)
    cand = selection_blocks(pattern, geometry, B, S, S, mass.shape[2])[3]  # (B, NB, S)
    layout = selection_from_scores(pattern, oracle_scores(mass, mode, cand), geometry, S, S)
    if layout is None:
        return None, 0.0, 0.0
    total = float((mass * cand[:, None]).sum())
    idx = layout.indices.long()
    kept = float(torch.where(idx >= 0, mass.gather(-1, idx.clamp_min(0)), torch.zeros((), dtype=mass.dtype)).sum())
    return layout, kept, total


def oracle_attention_forward(module, query, key, value, key_mask, *, scaling=None, dropout=0.0, sliding_window=None,
                             softcap=None, s_aux=None, config=None, layer_idx=None, **kwargs):
    """Transformers attention function: the layer's ``sparse_k`` pattern with the selection of the
    oracle set by ``oracle_mode`` (prefill without padding only: what strided perplexity runs)."""
    mode = _STATE["mode"]
    if mode not in ORACLES:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION}: run the model inside oracle_mode(one of {list(ORACLES)})")
    if key_mask is not None or query.shape[2] != key.shape[2] or sliding_window is not None or softcap is not None \
            or s_aux is not None:
        raise ValueError(f"{ATTN_IMPLEMENTATION} runs an unpadded prefill without the model's own sliding window, "
                         f"softcap or sink logits (got a key mask: {key_mask is not None}, Sq={query.shape[2]}, "
                         f"Skv={key.shape[2]}, sliding_window={sliding_window}, softcap={softcap}, "
                         f"sink logits: {s_aux is not None})")
    config = config if config is not None else module.config
    layer_idx = int(layer_idx if layer_idx is not None else getattr(module, "layer_idx", 0) or 0)
    pattern = layer_pattern(config, layer_idx)
    if not pattern.learned:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: layer {layer_idx} runs {pattern.name!r}; configure a learned pattern")
    scale = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
    layout, kept, total = oracle_selection(pattern, query, key, scale, mode)
    _STATE["kept"] += kept
    _STATE["total"] += total
    out = sparse_attention(query, key, value, pattern if layout is not None else pattern.static_part(), scale=scale,
                           layer_idx=layer_idx, selection=layout,
                           backend=_sparse_config(config).get("backend", "auto"))
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register the oracle attention function (and the ``sparse_k`` key-mask function) with Transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, oracle_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, key_mask)


@contextmanager
def oracle_mode(mode: str):
    """Run forwards with oracle ``mode``; yields the state whose ``kept``/``total`` tally the kept mass."""
    if mode not in ORACLES:
        raise ValueError(f"oracle mode must be one of {list(ORACLES)}, got {mode!r}")
    _STATE.update(mode=mode, kept=0.0, total=0.0)
    try:
        yield _STATE
    finally:
        _STATE["mode"] = None


def apply_oracle(model, args) -> None:
    """Configure ``model`` with the ``sparse_k`` budget of ``args`` (``sinks``, ``window``, ``top_k``,
    ``query_block``) and the oracle attention function."""
    detach_selectors(model)
    register()
    configure(model, "sparse_k", sinks=args.sinks, window=args.window, top_k=args.top_k,
              query_block=args.query_block)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
