"""``torch.library`` custom ops around the Triton kernels (``register_fake`` + ``register_autograd``).

The ops take only tensors and plain scalars, so ``torch.compile`` traces through them:

* ``sparse_k::block_attn_fwd(q, k, v, <forward layout>, <transposed layout>, <geometry>, sink?, key_mask?,
  ..., <token layout>?)`` -> ``(out (B, Hq, Sq, D), lse (B, Hq, Sq) float32)``, out in q's memory order
  (``memory_order.new_output``)
* ``sparse_k::block_attn_bwd(do, q, k, v, out, lse, ...)`` -> ``(dq, dk, dv, dsink, dweights)``

A layout travels as its four tensors ``(full_num, full_idx, part_num, part_idx)``; the transposed
layout (query tiles per key tile, see ``block_layout.transposed_layout``) travels beside it so the
backward needs no host synchronisation. The pattern travels as ``(pattern_id, causal, params)``;
``full_contig`` (full tiles form one ascending run per query tile) is computed once per layout.
The ops run ``dispatch``, which asks ``plan`` for the kernel (and imports the kernel modules on first
use, so that ``TRITON_INTERPRET`` is read at that moment).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .._ops import add_op_namespace_prefix
from ..layouts.block_layout import full_tiles_contiguous, transposed_layout
from ..layouts.geometry import bottom_right_geometry
from . import dispatch
from .launch_buffers import placeholder
from .memory_order import new_output
from .pattern_codes import PatternCode, pattern_code

__all__ = ["block_attn", "layout_args"]


def _layout_ns(fnum, fidx, pnum, pidx, qs, ks, ke, block_q, block_k, q_len, kv_len, pid, causal, params, plain=False,
               struct_tiles=0):
    # ``plain``: the caller's geometry had host offsets q_start == kv_len - q_len, k_start == 0,
    # k_end == kv_len (``geometry.bottom_right_geometry``: plain self-attention or a decode step);
    # the device tensors alone cannot say so without a sync. ``struct_tiles > 0``: a
    # ``decode_layout.DecodeLayout`` with that ``max_tiles`` (the index tensors are placeholders).
    host = ([kv_len - q_len], [0], [kv_len]) if plain else None
    geo = SimpleNamespace(q_start=qs, k_start=ks, k_end=ke, rows=qs.shape[0], host=host)
    return SimpleNamespace(
        full_kv_num_blocks=fnum, full_kv_indices=fidx, kv_num_blocks=pnum, kv_indices=pidx,
        block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, geometry=geo,
        pattern=PatternCode(pid, causal, params),
        num_q_blocks=-(-q_len // block_q), num_k_blocks=-(-kv_len // block_k),
        structured_decode=struct_tiles > 0, max_tiles=struct_tiles,
    )


@torch.library.custom_op(add_op_namespace_prefix("block_attn_fwd"), mutates_args=())
def block_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    fnum: torch.Tensor, fidx: torch.Tensor, pnum: torch.Tensor, pidx: torch.Tensor,
    t_fnum: torch.Tensor, t_fidx: torch.Tensor, t_pnum: torch.Tensor, t_pidx: torch.Tensor,
    q_start: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor,
    sink_logits: torch.Tensor | None, key_mask: torch.Tensor | None,
    pattern_id: int, causal: bool, params: list[int], block_q: int, block_k: int, pack: int, num_splits: int,
    scale: float, softcap: float, full_contig: bool,
    sel_idx: torch.Tensor | None = None, sel_cnt: torch.Tensor | None = None, sel_w: torch.Tensor | None = None,
    sel_first: torch.Tensor | None = None, sel_qb: int = 1, plain_geo: bool = False, struct_tiles: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    sel = None
    if sel_idx is not None:
        sel = SimpleNamespace(indices=sel_idx, counts=sel_cnt, weights=sel_w, first_block=sel_first, query_block=sel_qb)
    lay = _layout_ns(fnum, fidx, pnum, pidx, q_start, k_start, k_end, block_q, block_k, q.shape[2], k.shape[2], pattern_id,
                     causal, params, plain_geo, struct_tiles)
    return dispatch.attention_forward(
        q, k, v, lay, scale=scale, softcap=softcap if softcap > 0 else None, sink_logits=sink_logits,
        key_mask=key_mask, pack=pack, num_splits=num_splits, pattern=lay.pattern, full_contig=full_contig,
        selection=sel,
    )


@block_attn_fwd.register_fake
def _(q, k, v, fnum, fidx, pnum, pidx, t_fnum, t_fidx, t_pnum, t_pidx, q_start, k_start, k_end, sink_logits, key_mask,
      pattern_id, causal, params, block_q, block_k, pack, num_splits, scale, softcap, full_contig,
      sel_idx=None, sel_cnt=None, sel_w=None, sel_first=None, sel_qb=1, plain_geo=False, struct_tiles=0):
    B, Hq, Sq, D = q.shape
    return new_output(q, v.shape[-1]), q.new_empty(B, Hq, Sq, dtype=torch.float32)


@torch.library.custom_op(add_op_namespace_prefix("block_attn_bwd"), mutates_args=())
def block_attn_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    fnum: torch.Tensor, fidx: torch.Tensor, pnum: torch.Tensor, pidx: torch.Tensor,
    t_fnum: torch.Tensor, t_fidx: torch.Tensor, t_pnum: torch.Tensor, t_pidx: torch.Tensor,
    q_start: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor,
    sink_logits: torch.Tensor | None, key_mask: torch.Tensor | None,
    pattern_id: int, causal: bool, params: list[int], block_q: int, block_k: int, scale: float, softcap: float,
    sel_idx: torch.Tensor | None = None, sel_cnt: torch.Tensor | None = None, sel_w: torch.Tensor | None = None,
    sel_first: torch.Tensor | None = None, sel_qb: int = 1, plain_geo: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    sel = None
    if sel_idx is not None:
        sel = SimpleNamespace(indices=sel_idx, counts=sel_cnt, weights=sel_w, first_block=sel_first, query_block=sel_qb)
    lay = _layout_ns(fnum, fidx, pnum, pidx, q_start, k_start, k_end, block_q, block_k, q.shape[2], k.shape[2], pattern_id,
                     causal, params, plain_geo)
    lay._transposed = (t_fnum, t_fidx, t_pnum, t_pidx)
    dq, dk, dv, dsink, dw = dispatch.attention_backward(
        do, q, k, v, out, lse, lay, scale=scale, softcap=softcap if softcap > 0 else None,
        sink_logits=sink_logits, key_mask=key_mask, selection=sel,
    )
    if dsink is None:
        dsink = q.new_zeros(q.shape[1], dtype=torch.float32)
    if dw is None:
        dw = q.new_zeros(0, dtype=torch.float32)
    return dq, dk, dv, dsink, dw


@block_attn_bwd.register_fake
def _(do, q, k, v, out, lse, fnum, fidx, pnum, pidx, t_fnum, t_fidx, t_pnum, t_pidx, q_start, k_start, k_end,
      sink_logits, key_mask, pattern_id, causal, params, block_q, block_k, scale, softcap,
      sel_idx=None, sel_cnt=None, sel_w=None, sel_first=None, sel_qb=1, plain_geo=False):
    dw = q.new_empty(sel_w.shape if sel_w is not None else (0,), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty(q.shape[1], dtype=torch.float32), dw


_FWD_ARGS = (
    "q", "k", "v", "fnum", "fidx", "pnum", "pidx", "t_fnum", "t_fidx", "t_pnum", "t_pidx",
    "q_start", "k_start", "k_end", "sink_logits", "key_mask",
    "pattern_id", "causal", "params", "block_q", "block_k", "pack", "num_splits", "scale", "softcap", "full_contig",
    "sel_idx", "sel_cnt", "sel_w", "sel_first", "sel_qb", "plain_geo", "struct_tiles",
)


def _setup_context(ctx, inputs, output):
    a = dict(zip(_FWD_ARGS, inputs))
    out, lse = output
    ctx.save_for_backward(
        a["q"], a["k"], a["v"], out, lse, a["fnum"], a["fidx"], a["pnum"], a["pidx"], a["t_fnum"], a["t_fidx"],
        a["t_pnum"], a["t_pidx"], a["q_start"], a["k_start"], a["k_end"],
        a["sink_logits"] if a["sink_logits"] is not None else lse.new_empty(0),
        a["key_mask"] if a["key_mask"] is not None else lse.new_empty(0, dtype=torch.bool),
    )
    ctx.has_sink = a["sink_logits"] is not None
    ctx.has_kmask = a["key_mask"] is not None
    ctx.meta = (a["pattern_id"], a["causal"], a["params"], a["block_q"], a["block_k"], a["scale"], a["softcap"])
    ctx.sel = (a["sel_idx"], a["sel_cnt"], a["sel_w"], a["sel_first"], a["sel_qb"])
    ctx.plain_geo = bool(a.get("plain_geo", False))
    if a["pack"] != 1 or a["num_splits"] != 1 or a.get("struct_tiles", 0):
        ctx.meta = None  # decode-style launches are inference only


def _backward(ctx, d_out, d_lse):
    if ctx.meta is None:
        raise RuntimeError(
            "sparse_k::block_attn_fwd has no backward when launched with pack > 1 or num_splits > 1; use pack=1, num_splits=1"
        )
    (q, k, v, out, lse, fnum, fidx, pnum, pidx, tfn, tfi, tpn, tpi, qs, ks, ke, sink, kmask) = ctx.saved_tensors
    pid, causal, params, bq, bk, scale, softcap = ctx.meta
    sel_idx, sel_cnt, sel_w, sel_first, sel_qb = ctx.sel
    do = d_out if d_out.stride(-1) == 1 else d_out.contiguous()  # the kernels read any strides with a unit last one
    dq, dk, dv, dsink, dw = block_attn_bwd(
        do, q, k, v, out, lse, fnum, fidx, pnum, pidx, tfn, tfi, tpn, tpi, qs, ks, ke,
        sink if ctx.has_sink else None, kmask if ctx.has_kmask else None, pid, causal, params, bq, bk, scale, softcap,
        sel_idx, sel_cnt, sel_w, sel_first, sel_qb, ctx.plain_geo,
    )
    grads = [dq, dk, dv] + [None] * 11 + [dsink.to(sink.dtype) if ctx.has_sink else None] + [None] * 11
    grads += [None, None, dw.to(sel_w.dtype) if sel_w is not None else None, None, None]
    grads += [None, None]  # plain_geo, struct_tiles
    return tuple(grads)


block_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def layout_args(layout, *, need_transposed: bool) -> tuple:
    """The tensors of a ``BlockLayout`` (and of its transpose) in the order the ops take them."""
    fnum, fidx, pnum, pidx = layout.full_kv_num_blocks, layout.full_kv_indices, layout.kv_num_blocks, layout.kv_indices
    if fnum.stride() != pnum.stride():
        fnum, pnum = fnum.contiguous(), pnum.contiguous()
    if need_transposed:
        t = transposed_layout(layout)
    else:
        empty = placeholder(fnum.device, torch.int32, 4)
        t = (empty[..., 0], empty, empty[..., 0], empty)
    return (fnum, fidx, pnum, pidx, *t)


def _eager_inference(need_grad: bool, tensors) -> bool:
    """True for a plain eager call without gradients: the launcher then runs directly, since the custom
    op's dispatch costs tens of microseconds per call (more than a decode kernel's GPU time). Under
    ``torch.compile``, with gradients or with fake tensors the op runs (it is what those trace)."""
    if need_grad or torch.compiler.is_compiling():
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    from torch._subclasses.fake_tensor import FakeTensor

    return not any(isinstance(t, FakeTensor) for t in tensors)


def block_attn(
    q, k, v, layout, *, scale, softcap=None, sink_logits=None, key_mask=None, pack=1, num_splits=1, need_grad=False,
    selection=None,
):
    """Block-sparse attention through the custom op (or, for eager calls without gradients, the same
    launcher directly). ``layout``: a ``BlockLayout`` whose ``block_q`` is ``BLOCK_M // pack``;
    ``selection``: an optional ``TokenLayout`` fused into the same pass.
    Returns ``(out (B, Hq, Sq, D), lse (B, Hq, Sq) float32)``."""
    weights = None if selection is None else selection.weights
    if _eager_inference(need_grad, (q, k, v, sink_logits, weights)):
        return dispatch.attention_forward(
            q, k, v, layout, scale=float(scale), softcap=softcap if softcap else None, sink_logits=sink_logits,
            key_mask=key_mask, pack=pack, num_splits=num_splits, full_contig=full_tiles_contiguous(layout),
            selection=selection,
        )
    sel = ()
    if selection is not None:
        sel = (selection.indices, selection.counts, selection.weights,
               selection.first_block.to(device=q.device, dtype=torch.int64), selection.query_block)
    pid, params = pattern_code(layout.pattern)
    geo = layout.geometry
    return block_attn_fwd(
        q, k, v, *layout_args(layout, need_transposed=need_grad), geo.q_start, geo.k_start, geo.k_end,
        sink_logits, key_mask, pid, bool(layout.pattern.causal), list(params), layout.block_q, layout.block_k,
        pack, num_splits, float(scale), float(softcap) if softcap is not None else 0.0,
        full_tiles_contiguous(layout), *(sel or (None, None, None, None, 1)),
        bottom_right_geometry(geo, q.shape[2], k.shape[2]),
        int(layout.max_tiles) if getattr(layout, "structured_decode", False) else 0,
    )
