"""The attention function of selector training, registered with Transformers as ``IMPL_NAME``.

The LM stays frozen; every attention layer that carries a selector adds its distillation loss
(``distill.distill_loss``) to ``TrainState.losses`` and returns dense (``sdpa``) attention; with the
``lm`` or ``both`` loss it returns the sparse pattern's attention on the selectors' selection instead
(PyTorch path, SparseK weights as ``log p``), so next-token cross-entropy reaches the scorers through
``p``. ``TrainState.mode == "init"`` starts DSA indexers at the layer's own attention
(``LightningIndexer.init_from_attention``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from sparse_k import build_selection, row_geometry, sparse_attention

from ..selectors import SELECTOR_ATTR
from .distill import distill_loss

__all__ = ["IMPL_NAME", "TrainState", "register_attention", "train_attention"]

IMPL_NAME = "hfsa_selector_train"


class TrainState:
    """What the registered attention function needs during one forward pass."""

    pattern = None
    mode = "distill"
    losses: ClassVar[list] = []
    #: ``(B, N)`` int64 query blocks to distil on (-1: none), or None for every block.
    blocks = None
    #: ``(B, S)`` bool answer queries of this micro-batch, or None.
    answer = None
    answer_weight = 0.0


def train_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function registered with Transformers during training (dense or sparse + losses)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    selector = module.__dict__.get(SELECTOR_ATTR)
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    st = TrainState
    if st.mode == "init":
        if selector is not None:
            selector.init_from_attention(query, key, scale)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scale, dropout=0.0, **kwargs)
    if selector is not None and st.mode in ("distill", "both"):
        with torch.enable_grad():
            loss = distill_loss(st.pattern, selector, query, key, value, scale, blocks=st.blocks, answer=st.answer,
                                answer_weight=st.answer_weight)
        if loss is not None:
            st.losses.append(loss)
    if st.mode == "distill" or selector is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scale, dropout=0.0, **kwargs)
    geo = row_geometry(query.shape[0], query.shape[2], key.shape[2], device=query.device)
    sel = build_selection(st.pattern, query, key, value, geo, layer_idx=module.layer_idx, selector=selector)
    out = sparse_attention(query, key, value, st.pattern, scale=scale, selection=sel, backend="torch",
                           layer_idx=module.layer_idx)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Register ``train_attention`` (with the ``sdpa`` mask) with Transformers as ``IMPL_NAME``."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(IMPL_NAME, train_attention)
    AttentionMaskInterface.register(IMPL_NAME, sdpa_mask)

