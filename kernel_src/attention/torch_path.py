"""PyTorch path: block-sparse attention that runs on any device, with memory linear in S.

Per chunk of query tiles it gathers only the key tiles the ``BlockLayout`` lists (and, with a
``TokenLayout``, only the selected keys), so no ``S x S`` tensor is ever built. Full tiles skip the
element rule; partial tiles evaluate it. Everything is plain differentiable PyTorch, so autograd
works. It is the CPU path and the fallback of every fast path.
"""

from __future__ import annotations

import torch

from ..layouts.block_layout import BlockLayout
from ..layouts.token_layout import TokenLayout
from .reference import softmax_with_sink

__all__ = ["torch_sparse_attention"]

#: Upper bound on score elements materialised per chunk (B * Hq * rows * keys).
CHUNK_ELEMENTS = 1 << 21


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def torch_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    *,
    scale: float,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    selection: TokenLayout | None = None,
):
    """Sparse attention over ``layout`` (+ optional ``selection``).

    Args:
        q: ``(B, Hq, Sq, D)``; k: ``(B, Hkv, Skv, D)``; v: ``(B, Hkv, Skv, Dv)``.
        key_mask: optional ``(B, Skv)`` bool (True = key takes part), applied inside every tile.
    Returns: ``out (B, Hq, Sq, Dv)`` in ``q.dtype`` and ``lse (B, Hq, Sq)`` in float32 (float64 inputs: float64).
    """
    B, Hq, Sq, D = q.shape
    Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = Hq // Hkv
    bq, bk = layout.block_q, layout.block_k
    NQ = layout.num_q_blocks
    cdt = _compute_dtype(q.dtype)
    dev = q.device
    lay = layout.expand(B, Hkv) if layout.kv_num_blocks.shape[:2] != (B, Hkv) else layout
    geo = layout.geometry
    rows = geo.rows

    km = None if key_mask is None else key_mask.to(torch.bool)  # (B, Skv)

    idx = torch.cat([lay.full_kv_indices, lay.kv_indices], -1).long()  # (B, Hkv, NQ, M)
    F = lay.full_kv_indices.shape[-1]
    slot = torch.arange(idx.shape[-1], device=dev)
    is_full = slot < F
    slot_ok = torch.where(
        is_full, slot < lay.full_kv_num_blocks.unsqueeze(-1), (slot - F) < lay.kv_num_blocks.unsqueeze(-1)
    )
    M = idx.shape[-1]

    if selection is not None:
        sel_blocks = selection.block_of_queries(geo, Sq)  # (B, Sq)

    per_tile = max(1, B * Hq * bq * (M * bk + (selection.top_k * 2 if selection is not None else 0)))
    chunk = max(1, CHUNK_ELEMENTS // per_tile)
    outs, lses = [], []
    b_ix = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h_ix = torch.arange(Hkv, device=dev).view(1, Hkv, 1, 1)
    row_ix = (torch.arange(B, device=dev) if rows > 1 else torch.zeros(B, dtype=torch.long, device=dev)).view(B, 1, 1, 1, 1, 1)
    head_ix = (torch.arange(Hkv, device=dev) if layout.kv_num_blocks.shape[1] > 1 else torch.zeros(Hkv, dtype=torch.long, device=dev))
    head_ix = head_ix.view(1, Hkv, 1, 1, 1, 1)
    for t0 in range(0, NQ, chunk):
        t1 = min(NQ, t0 + chunk)
        C = t1 - t0
        q0, q1 = t0 * bq, min(Sq, t1 * bq)
        qc = torch.nn.functional.pad(q[:, :, q0:q1], (0, 0, 0, C * bq - (q1 - q0))).view(B, Hkv, G, C, bq, D)
        ic = idx[:, :, t0:t1]  # (B, Hkv, C, M)
        # Gather the listed key tiles straight from the (possibly strided) cache tensors; indices past
        # Skv in the last tile are clamped here and masked out below (key validity: k < k_end <= Skv).
        tok = (ic.unsqueeze(-1) * bk + torch.arange(bk, device=dev)).clamp_max(Skv - 1)  # (B, Hkv, C, M, bk)
        kg = k[b_ix.unsqueeze(-1), h_ix.unsqueeze(-1), tok]  # (B, Hkv, C, M, bk, D)
        vg = v[b_ix.unsqueeze(-1), h_ix.unsqueeze(-1), tok]
        s = torch.einsum("bhgcqd,bhcmkd->bhgcqmk", qc.to(cdt), kg.to(cdt)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        # Element rule: full tiles need only key validity; partial tiles the pattern rule too.
        q_idx = (torch.arange(t0, t1, device=dev).view(C, 1) * bq + torch.arange(bq, device=dev)).view(1, 1, C, bq, 1, 1)
        k_idx = (ic.unsqueeze(-1) * bk + torch.arange(bk, device=dev)).unsqueeze(3)  # (B, Hkv, C, 1, M, bk)
        rule = lay.element_rule(q_idx, k_idx, row_ix, head_ix)  # (B, Hkv, C, bq, M, bk)
        ks, ke = geo.k_start[row_ix], geo.k_end[row_ix]
        in_range = (k_idx >= ks) & (k_idx < ke)
        full_c = is_full.view(1, 1, 1, 1, M, 1)
        ok = torch.where(full_c, in_range, rule) & slot_ok[:, :, t0:t1].view(B, Hkv, C, 1, M, 1)
        ok = ok & (q_idx < Sq)
        if km is not None:
            ok = ok & km[b_ix.unsqueeze(-1), tok].unsqueeze(3)
        s = s.masked_fill(~ok.unsqueeze(2), float("-inf")).flatten(-2)  # (B, Hkv, G, C, bq, M*bk)
        vals = vg.flatten(3, 4)  # (B, Hkv, C, M*bk, Dv)
        if selection is not None:
            s_sel, v_sel = _selection_scores(
                qc, k, v, selection, sel_blocks, q_idx, lay, row_ix, head_ix,
                km, scale, softcap, t0, t1, cdt, Skv,
            )
            s = torch.cat([s, s_sel], -1)
        out_c, lse_c = _softmax_combine(s, vals, v_sel if selection is not None else None, sink_logits, Hkv, G, cdt)
        outs.append(out_c)
        lses.append(lse_c)
    out = torch.cat(outs, 3).flatten(3, 4)[..., :Sq, :].reshape(B, Hq, Sq, Dv)
    lse = torch.cat(lses, 3).flatten(3, 4)[..., :Sq].reshape(B, Hq, Sq)
    return out.to(q.dtype), lse


def _selection_scores(qc, k_flat, v_flat, sel: TokenLayout, sel_blocks, q_idx, lay, row_ix, head_ix, km, scale, softcap, t0, t1, cdt, Skv):
    """Scores ``(B, Hkv, G, C, bq, K)`` of the selected keys, and their values ``(B, Hkv, C, K, Dv)``, for tiles that
    each lie inside one selection block (their queries share the block's keys); ``_own_block_scores`` otherwise."""
    B, Hkv, G, C, bq, D = qc.shape
    K = sel.indices.shape[3]
    Sq = sel_blocks.shape[1]
    qi = q_idx.view(C, bq).clamp_max(Sq - 1)
    blk = sel_blocks[:, qi]  # (B, C, bq)
    lo = blk.amin(-1)  # (B, C)
    if bool((blk.amax(-1) != lo).any()):  # query blocks shorter than the tile: each query gathers its own block's keys
        return _own_block_scores(qc, k_flat, v_flat, sel, blk, q_idx, lay, row_ix, head_ix, km, scale, softcap, cdt, Skv)
    idx_c, ok, logw, kg, vg = _gather_selected(sel, lo.unsqueeze(-1), k_flat, v_flat, Hkv, Skv, cdt)
    kg, vg = kg.flatten(3, 4), vg.flatten(3, 4)  # (B, Hkv, C, K, D)
    s = torch.einsum("bhgcqd,bhcnd->bhgcqn", qc.to(cdt), kg.to(cdt)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if logw is not None:
        s = s + logw.view(B, Hkv, 1, C, 1, K)
    allow = ok.view(B, Hkv, C, 1, K) & _counts_for_query(idx_c.view(B, Hkv, C, 1, K), q_idx, lay, row_ix, head_ix, km)
    return s.masked_fill(~allow.unsqueeze(2), float("-inf")), vg


def _counts_for_query(k_idx, q_idx, lay, row_ix, head_ix, km):
    """Whether a selected key at tensor index ``k_idx (B, Hkv, C, 1 or bq, K)`` counts for each query ``q_idx (C * bq,)``
    of the tile: a key of the query's row, at or before it, not masked out (``km``), and not already in the static
    part. ``(B, Hkv, C, bq, K)``."""
    B, C = k_idx.shape[0], k_idx.shape[2]
    q = q_idx.view(1, 1, C, -1, 1)
    rows = row_ix.view(-1, 1, 1, 1, 1)
    static = lay.element_rule(q, k_idx, rows, head_ix.view(1, -1, 1, 1, 1))
    geo = lay.geometry
    valid = (k_idx >= geo.k_start[rows]) & (k_idx < geo.k_end[rows]) & (k_idx <= geo.q_start[rows] + q)
    if km is not None:
        valid = valid & km[torch.arange(B, device=k_idx.device).view(B, 1, 1, 1, 1), k_idx]
    return valid & ~static


def _gather_selected(sel: TokenLayout, blocks, k_flat, v_flat, Hkv: int, Skv: int, cdt):
    """The selected keys of selection blocks ``blocks (B, C, n)`` (out of range: none): key indices ``idx (B, Hkv, C,
    n, K)`` (0 where unused), their mask ``ok``, ``log`` SparseK weights (or None), keys and values ``(B, Hkv, C, n, K,
    D)``."""
    B, C, n = blocks.shape
    NB, K = sel.indices.shape[2], sel.indices.shape[3]
    dev = blocks.device
    blocks_ok = (blocks >= 0) & (blocks < NB)
    bc = blocks.clamp(0, NB - 1).view(B, 1, C * n)
    gi = bc.unsqueeze(-1).expand(B, Hkv, C * n, K)
    idx = sel.indices.long().gather(2, gi).view(B, Hkv, C, n, K)
    cnt = sel.counts.long().gather(2, bc.expand(B, Hkv, C * n)).view(B, Hkv, C, n, 1)
    ok = (torch.arange(K, device=dev) < cnt) & blocks_ok.view(B, 1, C, n, 1) & (idx >= 0) & (idx < Skv)
    logw = None
    if sel.weights is not None:
        w = sel.weights.gather(2, gi).view(B, Hkv, C, n, K)
        ok = ok & (w > 0)
        logw = torch.log(torch.where(ok, w, torch.ones_like(w)).to(cdt))
    idx_c = torch.where(ok, idx, torch.zeros_like(idx))
    b_ix = torch.arange(B, device=dev).view(B, 1, 1, 1, 1)
    h_ix = torch.arange(Hkv, device=dev).view(1, Hkv, 1, 1, 1)
    return idx_c, ok, logw, k_flat[b_ix, h_ix, idx_c], v_flat[b_ix, h_ix, idx_c]


def _own_block_scores(qc, k_flat, v_flat, sel: TokenLayout, blk, q_idx, lay, row_ix, head_ix, km, scale, softcap, cdt, Skv):
    """``_selection_scores`` for a tile that spans several selection blocks (``query_block`` < the tile): scores
    ``(B, Hkv, G, C, bq, K)`` of each query against its own block's ``K`` selected keys and their values
    ``(B, Hkv, C, bq, K, Dv)`` (per query: the shared form would score every query against every block of the tile)."""
    B, Hkv, G, C, bq, D = qc.shape
    idx_c, ok, logw, kg, vg = _gather_selected(sel, blk, k_flat, v_flat, Hkv, Skv, cdt)  # (B, Hkv, C, bq, K[, D])
    s = torch.einsum("bhgcqd,bhcqkd->bhgcqk", qc.to(cdt), kg.to(cdt)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if logw is not None:
        s = s + logw.unsqueeze(2)
    allow = ok & _counts_for_query(idx_c, q_idx, lay, row_ix, head_ix, km)
    return s.masked_fill(~allow.unsqueeze(2), float("-inf")), vg


def _softmax_combine(s, vals, v_sel, sink_logits, Hkv, G, cdt):
    """Softmax over the last dim of ``s`` (B, Hkv, G, C, bq, N) with an optional per-head sink."""
    sink = None if sink_logits is None else sink_logits.to(cdt).view(1, Hkv, G, 1, 1, 1)
    p, lse = softmax_with_sink(s, sink)
    n_static = vals.shape[3]
    out = torch.einsum("bhgcqn,bhcnd->bhgcqd", p[..., :n_static], vals.to(cdt))
    if v_sel is not None and v_sel.dim() == 6:  # per-query selected values (B, Hkv, C, bq, K, Dv)
        out = out + torch.einsum("bhgcqn,bhcqnd->bhgcqd", p[..., n_static:], v_sel.to(cdt))
    elif v_sel is not None:
        out = out + torch.einsum("bhgcqn,bhcnd->bhgcqd", p[..., n_static:], v_sel.to(cdt))
    return out, lse
