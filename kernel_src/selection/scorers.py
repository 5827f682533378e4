"""Learned selectors: the SparseK key scorer (design §6) and the DSA lightning indexer (design §7).

One selector per attention layer. Both are small ``nn.Module``s that the Transformers integration
keeps *beside* the attention module (never in the model's state dict) and hands to
``build_selection``. Their parameters are float32; they compute in float32 (float64 for float64 inputs, for gradcheck).

* ``SparseKScorer``: a query-independent score per key and KV head,
  ``u[b, h, j] = g_h * (w_h . v[b, h, j] + c_h + a_h * pos_j / position_scale + e_h * ||k[b, h, j]||)``, from the layer's *value*
  states (they carry no rotary phase, so the score depends on content, not on where the token
  sits) plus an optional linear position term (linear in the absolute position is, within one
  query block, the same as linear in the distance to the block: the SparseK threshold absorbs
  the constant). The optional key-norm term (``key_norm_term``, on by default) starts at
  ``e_h = -1`` with ``w_h = 0``, so an untrained scorer ranks keys exactly like the training-free
  fallback (``-||k||``) and training starts from there. The gain ``g_h = exp(log_gain_h)`` (8 at init) sets how hard the SparseK
  projection of ``u`` is (a large gain: weights near 0/1, a few fractional at the boundary); it
  does not change the ranking. Distillation trains ``u / g`` (``ranking_logits``); the gain
  learns only through the attention (LM) loss.
* ``LightningIndexer``: ``I(t, s) = sum_h w(t, h) * relu(q_I(t, h) . k_I(s)) / sqrt(indexer_dim)``
  with ``q_I``/``w`` linear in the query states of token ``t`` (all query heads concatenated) and
  one indexer key ``k_I(s)`` per token, linear in its key states (all KV heads concatenated).
  With ``per_kv_head=True`` every KV head ``g`` has its own indexer: ``I_g(t, s) = sum_h w_g(t, h) *
  relu(q_g(t, h) . k_g(s)) / sqrt(indexer_dim)``, ``q_g``/``w_g`` linear in the query states of
  ``g``'s query-head group, ``k_g`` linear in the key states of head ``g``; scores are
  ``(B, T, Hkv, S)`` and every KV head gets its own selection. ``init_from_attention`` starts it
  at the model's own attention: indexer heads 0 and 1 carry ``+`` and ``-`` the group-mean query
  on the ``indexer_dim / 2`` rotary pairs with the most query x key energy, with weights ``+1``
  and ``-1``, so ``relu(x) - relu(-x) = x`` makes ``I_g(t, s)`` exactly the group-mean attention
  logit restricted to those pairs (the same ranking as the model's logits, up to the dropped pairs).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["LightningIndexer", "SparseKScorer", "selector_from_config"]


def _compute(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def _check_pos_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: `{name}` must be a positive int, got {value!r}")


class SparseKScorer(nn.Module):
    """Per-layer SparseK scorer.

    Args:
        num_kv_heads: ``Hkv`` of the layer. head_dim: ``D`` of its value states.
        position_term: add ``a_h * pos / position_scale`` (learned ``a_h``, zero at init).
        position_scale: fixed divisor of positions (keeps ``a_h`` of order 1 for long contexts).
        gain: initial SparseK gain ``g_h``.
        key_norm_term: add ``e_h * ||k_j||`` (then ``forward`` needs ``key``; ``w_h`` starts at 0 and
            ``e_h`` at -1, the training-free ranking); without it ``w_h`` starts random.
    """

    kind = "sparse_k"

    def __init__(self, num_kv_heads: int, head_dim: int, *, position_term: bool = True, position_scale: float = 1024.0,
                 gain: float = 8.0, key_norm_term: bool = True):
        super().__init__()
        _check_pos_int("SparseKScorer", "num_kv_heads", num_kv_heads)
        _check_pos_int("SparseKScorer", "head_dim", head_dim)
        if not isinstance(position_scale, (int, float)) or isinstance(position_scale, bool) or position_scale <= 0:
            raise ValueError(f"SparseKScorer: `position_scale` must be a positive number, got {position_scale!r}")
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.position_term, self.position_scale = bool(position_term), float(position_scale)
        self.key_norm_term = bool(key_norm_term)
        if self.key_norm_term:
            self.weight = nn.Parameter(torch.zeros(num_kv_heads, head_dim))
            self.key_norm_weight = nn.Parameter(torch.full((num_kv_heads,), -1.0))
        else:
            self.weight = nn.Parameter(torch.randn(num_kv_heads, head_dim) / math.sqrt(head_dim))
            self.key_norm_weight = None
        self.bias = nn.Parameter(torch.zeros(num_kv_heads))
        self.pos_weight = nn.Parameter(torch.zeros(num_kv_heads)) if self.position_term else None
        if not isinstance(gain, (int, float)) or isinstance(gain, bool) or gain <= 0:
            raise ValueError(f"SparseKScorer: `gain` must be a positive number, got {gain!r}")
        self.log_gain = nn.Parameter(torch.full((num_kv_heads,), math.log(gain)))

    def config(self) -> dict:
        return {
            "kind": self.kind, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "position_term": self.position_term, "position_scale": self.position_scale,
            "key_norm_term": self.key_norm_term,
        }

    def forward(self, value: torch.Tensor, positions: torch.Tensor, key: torch.Tensor | None = None) -> torch.Tensor:
        """Scores ``u (B, Hkv, S)`` (float32; float64 inputs: float64) from ``value (B, Hkv, S, D)``, key
        ``positions (B' in {1, B}, S)`` and, with the key-norm term, ``key (B, Hkv, S, D)``."""
        r = self.ranking_logits(value, positions, key)
        return r * self.log_gain.to(device=r.device, dtype=r.dtype).exp()[None, :, None]

    def ranking_logits(self, value: torch.Tensor, positions: torch.Tensor, key: torch.Tensor | None = None) -> torch.Tensor:
        """``u / g (B, Hkv, S)``: the gain-free score that distillation fits (same ranking as ``forward``)."""
        if value.dim() != 4 or value.shape[1] != self.num_kv_heads or value.shape[3] != self.head_dim:
            raise ValueError(
                f"SparseKScorer expects value (B, {self.num_kv_heads}, S, {self.head_dim}), got {tuple(value.shape)}"
            )
        x = _compute(value)
        w = self.weight.to(device=x.device, dtype=x.dtype)
        # A per-key product and sum (not a batched matmul): a key's score does not depend on how many
        # keys are scored together, so incremental decoding scores exactly like a full recompute.
        u = (x * w[None, :, None, :]).sum(-1) + self.bias.to(device=x.device, dtype=x.dtype)[None, :, None]
        if self.pos_weight is not None:
            pos = positions.to(device=x.device, dtype=x.dtype)[:, None, :] / self.position_scale
            u = u + self.pos_weight.to(device=x.device, dtype=x.dtype)[None, :, None] * pos
        if self.key_norm_weight is not None:
            if key is None or key.shape != value.shape:
                raise ValueError(
                    f"SparseKScorer with key_norm_term needs `key` shaped like value {tuple(value.shape)}, "
                    f"got {None if key is None else tuple(key.shape)}"
                )
            u = u + self.key_norm_weight.to(device=x.device, dtype=x.dtype)[None, :, None] * _compute(key).norm(dim=-1)
        return u


class LightningIndexer(nn.Module):
    """Per-layer DSA lightning indexer (design §7).

    Args:
        num_q_heads, num_kv_heads, head_dim: the layer's ``Hq``, ``Hkv``, ``D``.
        indexer_heads: ``H_I`` small heads (per KV head with ``per_kv_head``). indexer_dim: ``d_I`` of
            each head and of the indexer key.
        per_kv_head: one indexer per KV head (module docstring), so every KV head selects its own keys.
    """

    kind = "dsa"

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, *, indexer_heads: int = 4, indexer_dim: int = 32,
                 per_kv_head: bool = False):
        super().__init__()
        for name, value in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("indexer_heads", indexer_heads), ("indexer_dim", indexer_dim)):
            _check_pos_int("LightningIndexer", name, value)
        if num_q_heads % num_kv_heads:
            raise ValueError(f"LightningIndexer: `num_q_heads` ({num_q_heads}) must be a multiple of `num_kv_heads` ({num_kv_heads})")
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.indexer_heads, self.indexer_dim, self.per_kv_head = indexer_heads, indexer_dim, bool(per_kv_head)
        if self.per_kv_head:
            g_in = (num_q_heads // num_kv_heads) * head_dim
            self.q_weight = nn.Parameter(torch.randn(num_kv_heads, indexer_heads * indexer_dim, g_in) / math.sqrt(g_in))
            self.w_weight = nn.Parameter(torch.zeros(num_kv_heads, indexer_heads, g_in))
            self.w_bias = nn.Parameter(torch.ones(num_kv_heads, indexer_heads) / indexer_heads)
            self.k_weight = nn.Parameter(torch.randn(num_kv_heads, indexer_dim, head_dim) / math.sqrt(head_dim))
        else:
            self.q_proj = nn.Linear(num_q_heads * head_dim, indexer_heads * indexer_dim, bias=False)
            self.w_proj = nn.Linear(num_q_heads * head_dim, indexer_heads)
            self.k_proj = nn.Linear(num_kv_heads * head_dim, indexer_dim, bias=False)
        # Decode memo: the indexer queries of the last blocks' first queries (block_ring), for calls that start
        # inside a block (the block's first query arrived in an earlier call). Not a module buffer: a dict of
        # tensors written in place (sparse_k.selection.step_state), created at the first call; None resets it.
        self._block_memo: dict | None = None

    @property
    def key_width(self) -> int:
        """Last dim of ``index_keys``: ``d_I`` (shared) or ``Hkv * d_I`` (per KV head)."""
        return self.indexer_dim * (self.num_kv_heads if self.per_kv_head else 1)

    def config(self) -> dict:
        return {
            "kind": self.kind, "num_q_heads": self.num_q_heads, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "indexer_heads": self.indexer_heads, "indexer_dim": self.indexer_dim,
            "per_kv_head": self.per_kv_head,
        }

    def index_keys(self, key: torch.Tensor) -> torch.Tensor:
        """Indexer keys ``(B, S, key_width)`` float32 from ``key (B, Hkv, S, D)`` (per KV head: the
        ``Hkv`` keys of ``d_I`` concatenated, head-major)."""
        if key.dim() != 4 or key.shape[1] != self.num_kv_heads or key.shape[3] != self.head_dim:
            raise ValueError(f"LightningIndexer expects key (B, {self.num_kv_heads}, S, {self.head_dim}), got {tuple(key.shape)}")
        x = _compute(key)
        if self.per_kv_head:
            return torch.einsum("bgsd,ged->bsge", x, self.k_weight.to(device=x.device, dtype=x.dtype)).flatten(2)
        return nn.functional.linear(x.transpose(1, 2).flatten(2), self.k_proj.weight.to(device=x.device, dtype=x.dtype))

    def index_queries(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_I (B, T, H, d_I)`` and head weights ``w (B, T, H)`` from ``query (B, Hq, T, D)``, with
        ``H = H_I`` (shared) or ``Hkv * H_I`` (per KV head, head-major)."""
        if query.dim() != 4 or query.shape[1] != self.num_q_heads or query.shape[3] != self.head_dim:
            raise ValueError(f"LightningIndexer expects query (B, {self.num_q_heads}, T, {self.head_dim}), got {tuple(query.shape)}")
        x = _compute(query)
        cast = {"device": x.device, "dtype": x.dtype}
        if self.per_kv_head:
            B, _, T, _ = x.shape
            xg = x.view(B, self.num_kv_heads, -1, T, self.head_dim).permute(0, 3, 1, 2, 4).flatten(3)  # (B, T, Hkv, G*D)
            q = torch.einsum("btgc,gec->btge", xg, self.q_weight.to(**cast))
            w = torch.einsum("btgc,ghc->btgh", xg, self.w_weight.to(**cast)) + self.w_bias.to(**cast)
            return q.reshape(B, T, -1, self.indexer_dim), w.flatten(2)
        x = x.transpose(1, 2).flatten(2)
        q = nn.functional.linear(x, self.q_proj.weight.to(**cast)).unflatten(-1, (self.indexer_heads, self.indexer_dim))
        w = nn.functional.linear(x, self.w_proj.weight.to(**cast), self.w_proj.bias.to(**cast))
        return q, w

    def scores(self, q_index: torch.Tensor, w: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """``I (B, T, S)`` (shared) or ``(B, T, Hkv, S)`` (per KV head):
        ``sum_h w[b,t,h] * relu(q_index[b,t,h] . k_index[b,s]) / sqrt(d_I)`` (per KV head: over its own heads and key)."""
        if self.per_kv_head:
            B, T = q_index.shape[:2]
            q = q_index.reshape(B, T, self.num_kv_heads, self.indexer_heads, self.indexer_dim)
            k = k_index.reshape(k_index.shape[0], k_index.shape[1], self.num_kv_heads, self.indexer_dim)
            dots = torch.einsum("btghd,bsgd->btghs", q, k) / math.sqrt(self.indexer_dim)
            return torch.einsum("btgh,btghs->btgs", w.reshape(B, T, self.num_kv_heads, self.indexer_heads), torch.relu(dots))
        dots = torch.einsum("bthd,bsd->bths", q_index, k_index) / math.sqrt(self.indexer_dim)
        return torch.einsum("bth,bths->bts", w, torch.relu(dots))

    def forward(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """Scores for every query of ``query (B, Hq, T, D)`` against ``key (B, Hkv, S, D)`` (shape as ``scores``)."""
        q, w = self.index_queries(query)
        return self.scores(q, w, self.index_keys(key))

    @torch.no_grad()
    def init_from_attention(self, query: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
        """Start a per-KV-head indexer at the model's own attention (module docstring).

        ``query (B, Hq, T, D)``, ``key (B, Hkv, S, D)``: the layer's states (after RoPE) on some
        sample text; ``scale``: the attention's logit scale. Rotary pairs are ``(i, i + D/2)``
        (Transformers' ``rotate_half``); keeping whole pairs keeps the score rotation-consistent.
        The ``d_I / 2`` pairs with the largest mean ``|q_pair| * |k_pair|`` of each KV head are kept.
        Indexer heads past the first two keep random queries with weight 0. Returns the kept
        dimensions ``(Hkv, d_I)``.
        """
        if not self.per_kv_head:
            raise ValueError("LightningIndexer.init_from_attention needs per_kv_head=True (one indexer per KV head)")
        D, dI, H = self.head_dim, self.indexer_dim, self.indexer_heads
        if H < 2 or dI % 2 or dI > D or D % 2:
            raise ValueError(f"init_from_attention needs indexer_heads >= 2 and an even indexer_dim <= head_dim "
                             f"(an even {D}); got indexer_heads={H}, indexer_dim={dI}")
        if query.dim() != 4 or query.shape[1] != self.num_q_heads or key.dim() != 4 or key.shape[1] != self.num_kv_heads:
            raise ValueError(f"init_from_attention expects query (B, {self.num_q_heads}, T, {D}) and key "
                             f"(B, {self.num_kv_heads}, S, {D}), got {tuple(query.shape)} and {tuple(key.shape)}")
        Hkv, G, half = self.num_kv_heads, self.num_q_heads // self.num_kv_heads, D // 2
        q, k = query.double(), key.double()
        q_pair = (q[..., :half] ** 2 + q[..., half:] ** 2).sqrt().mean((0, 2)).view(Hkv, G, half).sum(1)
        k_pair = (k[..., :half] ** 2 + k[..., half:] ** 2).sqrt().mean((0, 2))
        top = torch.sort((q_pair * k_pair).topk(dI // 2, dim=-1).indices, dim=-1).values
        dims = torch.cat([top, top + half], -1)  # (Hkv, d_I)
        qw = torch.zeros(Hkv, H, dI, G, D, dtype=torch.float64)
        kw = torch.zeros(Hkv, dI, D, dtype=torch.float64)
        # q_I . k_I / sqrt(d_I) == scale * (group-mean query) . (key) on the kept dims.
        c = scale * math.sqrt(dI) / G
        for g in range(Hkv):
            e = torch.arange(dI)
            kw[g, e, dims[g]] = 1.0
            qw[g, 0, e, :, dims[g]] = c
            qw[g, 1, e, :, dims[g]] = -c
        self.k_weight.copy_(kw)
        q_new = qw.flatten(3).flatten(1, 2)  # (Hkv, H*d_I, G*D), query head-major within the group
        self.q_weight[:, : 2 * dI].copy_(q_new[:, : 2 * dI])
        self.w_weight.zero_()
        self.w_bias.zero_()
        self.w_bias[:, 0], self.w_bias[:, 1] = 1.0, -1.0
        return dims


def selector_from_config(cfg: dict) -> nn.Module:
    """Rebuild a selector from its ``config()`` dict (used when loading saved selectors)."""
    if not isinstance(cfg, dict) or "kind" not in cfg:
        raise ValueError(f"a selector config needs a 'kind' ('sparse_k' or 'dsa'), got {cfg!r}")
    cfg = dict(cfg)
    kind = cfg.pop("kind")
    if kind == "sparse_k":
        return SparseKScorer(cfg["num_kv_heads"], cfg["head_dim"], position_term=cfg.get("position_term", True),
                             position_scale=cfg.get("position_scale", 1024.0), gain=cfg.get("gain", 8.0),
                             key_norm_term=cfg.get("key_norm_term", False))
    if kind == "dsa":
        return LightningIndexer(cfg["num_q_heads"], cfg["num_kv_heads"], cfg["head_dim"],
                                indexer_heads=cfg["indexer_heads"], indexer_dim=cfg["indexer_dim"],
                                per_kv_head=cfg.get("per_kv_head", False))
    raise ValueError(f"unknown selector kind {kind!r}; expected 'sparse_k' or 'dsa'")
