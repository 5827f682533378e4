"""Learned selectors: the SparseK key scorer (design §6) and the DSA lightning indexer (design §7).

One selector per attention layer. Both are small ``nn.Module``s that the Transformers integration
keeps *beside* the attention module (never in the model's state dict) and hands to
``build_selection``. Their parameters are float32; inputs are cast.

* ``SparseKScorer``: a query-independent score per key and KV head,
  ``u[b, h, j] = w_h . v[b, h, j] + c_h + a_h * pos_j / position_scale``, from the layer's *value*
  states (they carry no rotary phase, so the score depends on content, not on where the token
  sits) plus an optional linear position term (linear in the absolute position is, within one
  query block, the same as linear in the distance to the block: the SparseK threshold absorbs
  the constant).
* ``LightningIndexer``: ``I(t, s) = sum_h w(t, h) * relu(q_I(t, h) . k_I(s)) / sqrt(indexer_dim)``
  with ``q_I``/``w`` linear in the query states of token ``t`` (all query heads concatenated) and
  one indexer key ``k_I(s)`` per token, linear in its key states (all KV heads concatenated).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["SparseKScorer", "LightningIndexer", "selector_from_config"]


def _check_pos_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: `{name}` must be a positive int, got {value!r}")


class SparseKScorer(nn.Module):
    """Per-layer SparseK scorer.

    Args:
        num_kv_heads: ``Hkv`` of the layer. head_dim: ``D`` of its value states.
        position_term: add ``a_h * pos / position_scale`` (learned ``a_h``, zero at init).
        position_scale: fixed divisor of positions (keeps ``a_h`` of order 1 for long contexts).
    """

    kind = "sparse_k"

    def __init__(self, num_kv_heads: int, head_dim: int, *, position_term: bool = True, position_scale: float = 1024.0):
        super().__init__()
        _check_pos_int("SparseKScorer", "num_kv_heads", num_kv_heads)
        _check_pos_int("SparseKScorer", "head_dim", head_dim)
        if not isinstance(position_scale, (int, float)) or isinstance(position_scale, bool) or position_scale <= 0:
            raise ValueError(f"SparseKScorer: `position_scale` must be a positive number, got {position_scale!r}")
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.position_term, self.position_scale = bool(position_term), float(position_scale)
        self.weight = nn.Parameter(torch.randn(num_kv_heads, head_dim) / math.sqrt(head_dim))
        self.bias = nn.Parameter(torch.zeros(num_kv_heads))
        self.pos_weight = nn.Parameter(torch.zeros(num_kv_heads)) if self.position_term else None

    def config(self) -> dict:
        return {
            "kind": self.kind, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "position_term": self.position_term, "position_scale": self.position_scale,
        }

    def forward(self, value: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Scores ``u (B, Hkv, S)`` float32 from ``value (B, Hkv, S, D)`` and key ``positions (B' in {1, B}, S)``."""
        if value.dim() != 4 or value.shape[1] != self.num_kv_heads or value.shape[3] != self.head_dim:
            raise ValueError(
                f"SparseKScorer expects value (B, {self.num_kv_heads}, S, {self.head_dim}), got {tuple(value.shape)}"
            )
        w = self.weight.to(value.device)
        u = torch.einsum("bhsd,hd->bhs", value.float(), w) + self.bias.to(value.device)[None, :, None]
        if self.pos_weight is not None:
            pos = positions.to(device=value.device, dtype=torch.float32)[:, None, :] / self.position_scale
            u = u + self.pos_weight.to(value.device)[None, :, None] * pos
        return u


class LightningIndexer(nn.Module):
    """Per-layer DSA lightning indexer (design §7).

    Args:
        num_q_heads, num_kv_heads, head_dim: the layer's ``Hq``, ``Hkv``, ``D``.
        indexer_heads: ``H_I`` small heads. indexer_dim: ``d_I`` of each head and of the indexer key.
    """

    kind = "dsa"

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, *, indexer_heads: int = 4, indexer_dim: int = 32):
        super().__init__()
        for name, value in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("indexer_heads", indexer_heads), ("indexer_dim", indexer_dim)):
            _check_pos_int("LightningIndexer", name, value)
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.indexer_heads, self.indexer_dim = indexer_heads, indexer_dim
        self.q_proj = nn.Linear(num_q_heads * head_dim, indexer_heads * indexer_dim, bias=False)
        self.w_proj = nn.Linear(num_q_heads * head_dim, indexer_heads)
        self.k_proj = nn.Linear(num_kv_heads * head_dim, indexer_dim, bias=False)
        # Decode memo: the indexer query of the current block's first query, for calls that start
        # inside a block (the block's first query arrived in an earlier call). Not a buffer.
        self._block_memo: dict | None = None

    def config(self) -> dict:
        return {
            "kind": self.kind, "num_q_heads": self.num_q_heads, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "indexer_heads": self.indexer_heads, "indexer_dim": self.indexer_dim,
        }

    def index_keys(self, key: torch.Tensor) -> torch.Tensor:
        """Indexer keys ``(B, S, d_I)`` float32 from ``key (B, Hkv, S, D)``."""
        if key.dim() != 4 or key.shape[1] != self.num_kv_heads or key.shape[3] != self.head_dim:
            raise ValueError(f"LightningIndexer expects key (B, {self.num_kv_heads}, S, {self.head_dim}), got {tuple(key.shape)}")
        x = key.float().transpose(1, 2).flatten(2)
        return nn.functional.linear(x, self.k_proj.weight.to(key.device))

    def index_queries(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_I (B, T, H_I, d_I)`` and head weights ``w (B, T, H_I)`` from ``query (B, Hq, T, D)``."""
        if query.dim() != 4 or query.shape[1] != self.num_q_heads or query.shape[3] != self.head_dim:
            raise ValueError(f"LightningIndexer expects query (B, {self.num_q_heads}, T, {self.head_dim}), got {tuple(query.shape)}")
        x = query.float().transpose(1, 2).flatten(2)
        dev = query.device
        q = nn.functional.linear(x, self.q_proj.weight.to(dev)).unflatten(-1, (self.indexer_heads, self.indexer_dim))
        w = nn.functional.linear(x, self.w_proj.weight.to(dev), self.w_proj.bias.to(dev))
        return q, w

    def scores(self, q_index: torch.Tensor, w: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """``I (B, T, S)``: ``sum_h w[b,t,h] * relu(q_index[b,t,h] . k_index[b,s]) / sqrt(d_I)``."""
        dots = torch.einsum("bthd,bsd->bths", q_index, k_index) / math.sqrt(self.indexer_dim)
        return torch.einsum("bth,bths->bts", w, torch.relu(dots))

    def forward(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """``I (B, T, S)`` for every query of ``query (B, Hq, T, D)`` against ``key (B, Hkv, S, D)``."""
        q, w = self.index_queries(query)
        return self.scores(q, w, self.index_keys(key))


def selector_from_config(cfg: dict) -> nn.Module:
    """Rebuild a selector from its ``config()`` dict (used when loading saved selectors)."""
    if not isinstance(cfg, dict) or "kind" not in cfg:
        raise ValueError(f"a selector config needs a 'kind' ('sparse_k' or 'dsa'), got {cfg!r}")
    cfg = dict(cfg)
    kind = cfg.pop("kind")
    if kind == "sparse_k":
        return SparseKScorer(cfg["num_kv_heads"], cfg["head_dim"], position_term=cfg.get("position_term", True),
                             position_scale=cfg.get("position_scale", 1024.0))
    if kind == "dsa":
        return LightningIndexer(cfg["num_q_heads"], cfg["num_kv_heads"], cfg["head_dim"],
                                indexer_heads=cfg["indexer_heads"], indexer_dim=cfg["indexer_dim"])
    raise ValueError(f"unknown selector kind {kind!r}; expected 'sparse_k' or 'dsa'")
