"""Token layout: learned top-k key lists per query block and KV head (design §5).

* ``indices``: ``(B, Hkv, NB, K)`` int32 key *tensor indices*, ascending within the first
  ``counts`` entries; entries past ``counts`` are unspecified (filled with -1).
* ``counts``: ``(B, Hkv, NB)`` int32.
* ``weights``: optional ``(B, Hkv, NB, K)`` float, the SparseK weights ``p_j`` in ``(0, 1]``;
  ``log p_j`` is added to the logit (entries with ``p_j <= 0`` are ignored).
* ``query_block``: queries are grouped by *position*: query ``i`` of row ``b`` belongs to block
  ``qpos // query_block - first_block[b]`` (``first_block``: ``(B,)`` int64, the block of each row's
  first query), so decode and recompute share one selection per block.

Selected keys are meant to lie outside the sinks and window (design §6); a selected key that the
static rule already allows is ignored, so no key is ever counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .geometry import RowGeometry

__all__ = ["TokenLayout"]


@dataclass
class TokenLayout:
    indices: torch.Tensor
    counts: torch.Tensor
    query_block: int
    first_block: torch.Tensor
    weights: torch.Tensor | None = None

    def __post_init__(self):
        if self.indices.dim() != 4:
            raise ValueError(f"TokenLayout.indices must be (B, Hkv, NB, K), got shape {tuple(self.indices.shape)}")
        if tuple(self.counts.shape) != tuple(self.indices.shape[:3]):
            raise ValueError(
                f"TokenLayout.counts must have shape {tuple(self.indices.shape[:3])}, got {tuple(self.counts.shape)}"
            )
        if self.weights is not None and self.weights.shape != self.indices.shape:
            raise ValueError(
                f"TokenLayout.weights must match indices {tuple(self.indices.shape)}, got {tuple(self.weights.shape)}"
            )
        if self.first_block.dim() != 1:
            raise ValueError(f"TokenLayout.first_block must be (B,), got shape {tuple(self.first_block.shape)}")

    @property
    def top_k(self) -> int:
        return self.indices.shape[-1]

    def block_of_queries(self, geometry: RowGeometry, q_len: int) -> torch.Tensor:
        """``(B, q_len)`` int64 block index (into ``NB``) of every query."""
        qpos = geometry.q_positions(q_len)
        blocks = torch.div(qpos, self.query_block, rounding_mode="floor") - self.first_block[:, None]
        return blocks.expand(self.indices.shape[0], q_len)

    def per_query(self, geometry: RowGeometry, q_len: int, kv_len: int):
        """Dense ``(B, Hkv, q_len, kv_len)`` selection mask and log-weights (tests and the reference only)."""
        B, H, NB, K = self.indices.shape
        blk = self.block_of_queries(geometry, q_len).clamp(0, NB - 1)  # (B, Sq)
        idx = self.indices.long().gather(2, blk[:, None, :, None].expand(B, H, q_len, K))
        cnt = self.counts.long().gather(2, blk[:, None, :].expand(B, H, q_len))
        ok = torch.arange(K, device=idx.device) < cnt.unsqueeze(-1)
        if self.weights is not None:
            w = self.weights.gather(2, blk[:, None, :, None].expand(B, H, q_len, K))
            ok = ok & (w > 0)
            logw = torch.log(torch.where(ok, w, torch.ones_like(w)))
        else:
            logw = torch.zeros(idx.shape, dtype=torch.float32, device=idx.device)
        tgt = torch.where(ok & (idx >= 0) & (idx < kv_len), idx, torch.full_like(idx, kv_len))
        mask = torch.zeros(B, H, q_len, kv_len + 1, dtype=torch.bool, device=idx.device)
        mask.scatter_(-1, tgt, True)
        lw = torch.zeros(B, H, q_len, kv_len + 1, dtype=logw.dtype, device=idx.device)
        lw.scatter_(-1, tgt, logw)
        return mask[..., :kv_len], lw[..., :kv_len]
