"""Exact reference: dense-mask attention in float64 (or float32) for small shapes.

This is the definition every fast path is tested against. It builds the full ``Sq x Skv`` mask
from the pattern's element rule, so use it for tests and small inputs only.

Conventions (design §3): a row with no allowed key outputs zeros and ``lse = -inf``; ``lse`` is the
natural log of the softmax denominator, which *includes* ``exp(sink_logit)`` when ``sink_logits``
are given (gpt-oss ``s_aux``: the sink joins the denominator only). ``softcap`` is applied as
``softcap * tanh(s / softcap)`` before masking; SparseK log-weights are added after it.
"""

from __future__ import annotations

import torch

from ..layouts.geometry import RowGeometry
from ..layouts.patterns import Pattern
from ..layouts.token_layout import TokenLayout

__all__ = ["REFERENCE_MAX_ENTRIES", "check_reference_size", "masked_attention", "pattern_mask", "reference_attention",
           "softmax_with_sink"]

#: Largest ``B * Hq * Sq * Skv`` the reference accepts: each of the few dense score tensors it holds at
#: once takes 2 GiB in float64 at this size (a 40K-token call would need hundreds of GB and be killed
#: by the operating system without a Python error).
REFERENCE_MAX_ENTRIES = 1 << 28


def check_reference_size(batch: int, q_heads: int, q_len: int, kv_len: int, dtype: torch.dtype = torch.float64) -> None:
    """Raise ``ValueError`` when the dense ``(B, Hq, Sq, Skv)`` tensors of the reference exceed
    ``REFERENCE_MAX_ENTRIES`` entries."""
    entries = batch * q_heads * q_len * kv_len
    if entries > REFERENCE_MAX_ENTRIES:
        gb = entries * torch.empty((), dtype=dtype).element_size() / 1e9
        raise ValueError(
            f"the exact reference (backend='reference') builds a dense (B, Hq, Sq, Skv) mask and {dtype} score "
            f"tensors: {batch} x {q_heads} x {q_len} x {kv_len} = {entries:,} entries ({gb:,.1f} GB each), over its "
            f"limit of {REFERENCE_MAX_ENTRIES:,} entries (sparse_k.attention.reference.REFERENCE_MAX_ENTRIES); use "
            "backend='torch' (memory linear in the sequence length) or 'auto', or check a slice of the queries (q_start=)"
        )


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
    log_weights: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
):
    """Attention with an explicit boolean mask, computed in ``dtype``.

    Args:
        q: ``(B, Hq, Sq, D)``; k: ``(B, Hkv, Skv, D)``; v: ``(B, Hkv, Skv, Dv)``; ``Hq % Hkv == 0``.
        mask: bool, broadcastable to ``(B, Hkv, Sq, Skv)`` (shared by a KV group) or ``(B, Hq, Sq, Skv)``.
        sink_logits: ``(Hq,)``. log_weights: like ``mask``, added to allowed logits.
    Returns: ``out (B, Hq, Sq, Dv)`` and ``lse (B, Hq, Sq)``, both in ``dtype``.
    """
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
    kf = kf.repeat_interleave(G, 1)
    vf = vf.repeat_interleave(G, 1)

    def per_q_head(t):
        if t.dim() == 4 and t.shape[1] == Hkv and Hkv != Hq:
            return t.repeat_interleave(G, 1)
        return t

    mask = per_q_head(mask)
    s = torch.einsum("bhqd,bhkd->bhqk", qf, kf) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if log_weights is not None:
        s = s + per_q_head(log_weights).to(dtype)
    mask = mask.expand_as(s)
    s = s.masked_fill(~mask, float("-inf"))
    sink = None if sink_logits is None else sink_logits.to(dtype).view(1, Hq, 1, 1)
    p, lse = softmax_with_sink(s, sink)
    out = torch.einsum("bhqk,bhkd->bhqd", p, vf)
    out = torch.where(mask.any(-1, keepdim=True), out, torch.zeros_like(out))
    return out, lse


def softmax_with_sink(s: torch.Tensor, sink: torch.Tensor | None):
    """Softmax over the last dim of masked logits ``s`` (``-inf`` = masked) whose denominator also
    holds ``exp(sink)`` (broadcastable to ``s[..., :1]``) once.

    Returns ``(p, lse)``: probabilities (all zero in a row with no allowed key) and the natural-log
    denominator with the last dim dropped (``-inf`` for a row with neither keys nor sink). Safe for
    autograd on fully-masked rows.
    """
    m = s.amax(-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - m)
    has = denom > 0
    safe = torch.where(has, denom, torch.ones_like(denom))
    lse = torch.where(has, torch.log(safe) + m, torch.full_like(m, float("-inf"))).squeeze(-1)
    return p / safe, lse


def pattern_mask(
    pattern: Pattern,
    geometry: RowGeometry,
    q_len: int,
    kv_len: int,
    *,
    num_kv_heads: int = 1,
    layer_idx: int = 0,
    key_mask: torch.Tensor | None = None,
    selection: TokenLayout | None = None,
):
    """Dense ``(B', H', Sq, Skv)`` bool mask of design §4 (and log-weights when ``selection`` is given)."""
    static = pattern.static_part() if pattern.learned else pattern
    qpos = geometry.q_positions(q_len)[:, None, :, None]
    kpos = geometry.k_positions(kv_len)[:, None, None, :]
    heads = num_kv_heads if static.per_head else 1
    h = torch.arange(heads, device=qpos.device).view(1, -1, 1, 1)
    valid = geometry.key_valid(kv_len)[:, None, None, :]
    if key_mask is not None:
        valid = valid & key_mask.to(torch.bool)[:, None, None, :]
    mask = static.allowed(qpos, kpos, layer_idx, h, kv_len) & valid
    if selection is None:
        return mask, None
    sel, logw = selection.per_query(geometry, q_len, kv_len)
    sel = sel & ~mask & valid & (kpos <= qpos)
    logw = torch.where(sel, logw, torch.zeros_like(logw))
    return mask | sel, logw


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: Pattern,
    geometry: RowGeometry,
    *,
    scale: float,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    selection: TokenLayout | None = None,
    layer_idx: int = 0,
    dtype: torch.dtype = torch.float64,
):
    """Exact sparse attention of ``pattern`` for unpacked ``(B, H, S, D)`` inputs; returns ``(out, lse)`` in ``dtype``.

    Raises ``ValueError`` when ``B * Hq * Sq * Skv`` exceeds ``REFERENCE_MAX_ENTRIES`` (``check_reference_size``).
    """
    check_reference_size(q.shape[0], q.shape[1], q.shape[2], k.shape[2], dtype)
    mask, logw = pattern_mask(
        pattern, geometry, q.shape[2], k.shape[2], num_kv_heads=k.shape[1], layer_idx=layer_idx,
        key_mask=key_mask, selection=selection,
    )
    return masked_attention(q, k, v, mask, scale=scale, softcap=softcap, sink_logits=sink_logits, log_weights=logw, dtype=dtype)
