"""Distillation losses of selector training (design §6-§7): the dense attention mass of each query
block on the candidate keys is the target, the selector's scores the student.

``distill_loss``: per layer, query block and KV head, the dense attention mass that the block's
queries put on each *candidate* key (outside sinks and window), normalised over the candidates, is
the target distribution; the student is the softmax of the selector's scores over the same
candidates (SparseK: ``u / gain`` per KV head; DSA: the indexer score of the block's first query,
target summed over all heads). Loss = KL(target || student), averaged over the blocks that have
more than ``top_k`` candidates (and, by the caller, the heads and the layers). With an ``answer``
mask and ``answer_weight > 0`` the same KL is added on the blocks of the *answer* queries of
synthetic passkey sequences, with the target taken from those queries only (the attention mass of
the queries that retrieve, which the block-summed target dilutes with the block's other queries).
``distill_blocks`` picks random query blocks to distil on instead of all of them.

``block_attention_mass`` is also the mass of the selection oracles
(``hf_sparse_attention.evaluation.oracle``).
"""

from __future__ import annotations

import random

import torch
from sparse_k import SparseKScorer, row_geometry
from sparse_k.selection.selectors import selection_blocks

__all__ = ["block_attention_mass", "distill_blocks", "distill_loss"]


def block_attention_mass(q: torch.Tensor, k: torch.Tensor, scale: float, query_block: int, chunk_queries: int = 512,
                         query_weight: torch.Tensor | None = None):
    """Dense causal attention mass of every query block on every key: ``(B, Hkv, NB, Skv)`` float32.

    ``q (B, Hq, S, D)`` with queries at the last ``S`` key positions of ``k (B, Hkv, Skv, D)``;
    the mass of a block is summed over its queries and the query heads of each KV group.
    ``query_weight (B, S)``: optional weight of every query (chunks whose weights are all zero are skipped).
    """
    B, Hq, S, _ = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    NB = -(-S // query_block)
    kf = k.float().repeat_interleave(G, 1)
    off = Skv - S
    out = torch.zeros(B, Hkv, NB, Skv, dtype=torch.float32, device=q.device)
    step = max(1, chunk_queries // query_block)
    j = torch.arange(Skv, device=q.device)
    for c0 in range(0, NB, step):
        c1 = min(NB, c0 + step)
        q0, q1 = c0 * query_block, min(S, c1 * query_block)
        if query_weight is not None and not bool(query_weight[:, q0:q1].any()):
            continue
        s = torch.einsum("bhqd,bhkd->bhqk", q[:, :, q0:q1].float(), kf) * scale
        i = torch.arange(q0, q1, device=q.device)[:, None] + off
        s = s.masked_fill(j[None, :] > i, float("-inf"))
        p = torch.softmax(s, -1)
        if query_weight is not None:
            p = p * query_weight[:, None, q0:q1, None].to(p.dtype)
        p = torch.nn.functional.pad(p, (0, 0, 0, (c1 - c0) * query_block - (q1 - q0)))
        out[:, :, c0:c1] = p.view(B, Hkv, G, c1 - c0, query_block, Skv).sum((2, 4))
    return out


def _block_kl(target, logits, cand, active):
    """Per-sequence mean over ``active`` blocks of KL(target || softmax(logits)) over the candidates.

    ``target (B, H, N, Skv)`` unnormalised mass, ``logits`` broadcastable to it, ``cand (B, 1, N, Skv)``,
    ``active (B, N)``; returns ``(B,)`` (0 for a sequence without an active block).
    """
    target = torch.where(cand, target, torch.zeros_like(target))
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    logq = torch.log_softmax(logits.expand(target.shape).masked_fill(~cand, float("-inf")), -1)
    pos = target > 0
    kl = torch.where(pos, target * (torch.log(torch.where(pos, target, torch.ones_like(target))) - logq),
                     torch.zeros_like(target)).sum(-1)
    act = active[:, None].expand(kl.shape)
    return torch.where(act, kl, torch.zeros_like(kl)).sum((1, 2)) / act.sum((1, 2)).clamp_min(1)


def _student_logits(selector, query, key, value, kpos, first_query):
    """Selector logits on the keys: SparseK ``(B, Hkv, 1, Skv)`` (``u / gain``, one row for all blocks);
    DSA ``(B, 1, N, Skv)`` (per KV head: ``(B, Hkv, N, Skv)``) from the indexer query of each block's
    first query ``first_query (B, N)``."""
    if isinstance(selector, SparseKScorer):
        return selector.ranking_logits(value, kpos, key)[:, :, None, :]
    q_index, w = selector.index_queries(query)
    rows = torch.arange(query.shape[0], device=query.device)[:, None]
    scores = selector.scores(q_index[rows, first_query], w[rows, first_query], selector.index_keys(key))
    return scores.transpose(1, 2) if selector.per_kv_head else scores[:, None]


def _gather_blocks(t, blocks):
    """``t (B, H, NB, Skv)`` at ``blocks (B, N)`` (clamped; callers mask invalid ones) -> ``(B, H, N, Skv)``."""
    B, H, _, Skv = t.shape
    idx = blocks.clamp(0, t.shape[2] - 1)[:, None, :, None].expand(B, H, blocks.shape[1], Skv)
    return t.gather(2, idx)


def distill_loss(pattern, selector, query, key, value, scale: float, *, blocks: torch.Tensor | None = None,
                 answer: torch.Tensor | None = None, answer_weight: float = 0.0) -> torch.Tensor | None:
    """Per-sequence distillation loss ``(B,)`` of one layer (module docstring), or None when no block
    has more than ``top_k`` candidates.

    ``blocks (B, N)``: the query blocks to distil on (-1 entries ignored; None: all). ``answer (B, S)``
    bool: answer queries; with ``answer_weight > 0`` their own attention mass adds a weighted KL on
    the blocks that hold them (SparseK and per-KV-head DSA: summed over the heads of a group; shared
    DSA: over all heads).
    """
    B, _, S, _ = query.shape
    Skv = key.shape[2]
    qb = pattern.query_block
    geo = row_geometry(B, S, Skv, device=query.device)
    _, block_start, _, cand, kpos = selection_blocks(pattern, geo, B, S, Skv)
    NB = cand.shape[1]
    n_cand = cand.sum(-1)  # (B, NB)
    if not bool((n_cand > pattern.top_k).any()):
        return None
    per_head = isinstance(selector, SparseKScorer) or selector.per_kv_head
    all_blocks = torch.arange(NB, device=query.device).expand(B, NB)
    sets = [(all_blocks if blocks is None else blocks.to(query.device), None, 1.0)]
    if answer is not None and answer_weight > 0 and bool(answer.any()):
        pos = torch.arange(S, device=query.device) + (Skv - S)
        ab = torch.where(answer.to(query.device), torch.div(pos, qb, rounding_mode="floor") - (Skv - S) // qb, -1)
        ab = torch.sort(ab, dim=-1, descending=True).values  # answer blocks first (duplicates are harmless)
        n = int((ab >= 0).sum(-1).max())
        sets.append((ab[:, :n], answer, answer_weight))
    total = torch.zeros(B, device=query.device)
    for blk, qweight, weight in sets:
        with torch.no_grad():
            mass = block_attention_mass(query, key, scale, qb, query_weight=qweight)
        if not per_head:
            mass = mass.sum(1, keepdim=True)
        ok = blk >= 0
        blk_c = blk.clamp(0, NB - 1)
        active = ok & (n_cand.gather(1, blk_c) > pattern.top_k)
        if qweight is not None:
            active = active & (_gather_blocks(mass, blk_c).sum((1, 3)) > 0)
        first_query = (block_start.gather(1, blk_c) - (Skv - S)).clamp(0, S - 1)
        logits = _student_logits(selector, query, key, value, kpos, first_query)
        cm = _gather_blocks(cand[:, None], blk_c)
        total = total + weight * _block_kl(_gather_blocks(mass, blk_c), logits, cm, active)
    return total


def distill_blocks(pattern, seq_len: int, n: int, seed: int, step: int, slot: int) -> torch.Tensor:
    """``(n,)`` int64 random query blocks of sequence (``step``, ``slot``) that have more than ``top_k``
    candidates (-1 padding when fewer exist); depends only on its arguments (same on every process)."""
    qb = pattern.query_block
    n_blocks = -(-seq_len // qb)
    # Block b has candidates [sinks, b * qb - window]: more than top_k once b * qb >= sinks + window + top_k.
    first = -(-(pattern.sinks + pattern.window + pattern.top_k) // qb)
    pool = list(range(min(first, n_blocks), n_blocks))
    picked = random.Random(f"{seed}-{step}-{slot}-blocks").sample(pool, min(n, len(pool)))
    return torch.tensor(sorted(picked) + [-1] * (n - len(picked)), dtype=torch.long)

