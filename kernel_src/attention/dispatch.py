"""Runs an attention launch on the kernel that ``plan`` names: the one module that reaches both the
Triton launchers (``triton.fwd``, ``triton.structured``, ``triton.bwd``, ``triton.structured_bwd``)
and the Hopper CUDA launchers (``cuda.structured`` and its listed bigbird forward, ``cuda.token``,
``cuda.decode``, ``cuda.structured_bwd``). It decides nothing itself: it describes the launch
(``plan.Launch``), asks the plan, builds a CUDA extension on first use (a build failure warns once, is
remembered by the plan, and the launch is planned again), records the plan it runs (``plan.recording``)
and launches.

Kernel modules are imported on first use, so that ``TRITON_INTERPRET`` is read at that moment.
"""

from __future__ import annotations

from .launch_buffers import split_counters
from .pattern_codes import pattern_code
from .plan import CUDA_ENV, Launch, mark_build_failed, plan_backward, plan_forward, record
from ..warn import warn_once

__all__ = ["attention_backward", "attention_forward"]

#: Options of the Triton forward launchers (``triton.fwd.layout_forward``; the first four also tune
#: ``triton.structured.structured_forward``). Giving one of ``_TUNING`` keeps the launch on Triton.
TRITON_FORWARD_OPTIONS = ("num_warps", "num_stages", "use_tma", "order", "full_contig", "fuse_combine", "sel_fast",
                          "sel_prefetch", "sel_lean", "merge_rows")
_TUNING = ("num_warps", "num_stages", "use_tma", "order")


def _built(extension: str, module) -> bool:
    """Build (or load) ``module``'s extension; on failure warn once, tell the plan, and return False."""
    try:
        module.load_extension()
    except Exception as e:  # noqa: BLE001 — any build failure: say why once, then the Triton kernel
        mark_build_failed(extension)
        warn_once(f"sparse_k: the Hopper CUDA {extension} could not be built ({type(e).__name__}: {str(e)[:300]}); "
                  f"the Triton kernel runs instead (set {CUDA_ENV}=0 to skip the attempt)")
        return False
    return True


def _cuda_forward(kernel: str, launch: Launch, params, scale: float):
    """``(out, lse)`` of the CUDA forward ``kernel``, or None when its extension cannot be built."""
    q, k, v = launch.q, launch.k, launch.v
    window, sinks = int(params[0]), int(params[1])
    if kernel == "cuda_sm90_structured":
        from .cuda import structured as cs

        if not _built("forward", cs):
            return None
        return cs.cuda_structured_forward(q, k, v, pattern_id=launch.pattern_id, window=window, sinks=sinks,
                                          scale=scale)
    if kernel == "cuda_sm90_listed":
        from .cuda import structured as cs

        if not _built("forward", cs):
            return None
        return cs.cuda_listed_forward(q, k, v, launch.layout, scale=scale)
    if kernel == "cuda_sm90_token":
        from .cuda import token as ct

        if not _built("token", ct):
            return None
        return ct.cuda_token_forward(q, k, v, launch.selection, pattern_id=launch.pattern_id, window=window,
                                     sinks=sinks, scale=scale)
    from .cuda import decode as cd

    if not _built("decode", cd):
        return None
    # Two to eight splits merge in a thread-block cluster; more through the per-stream counters (a
    # second merge kernel when none can be had, e.g. in a capture on a new stream).
    counters = split_counters(q.device, q.shape[0] * k.shape[1])
    return cd.cuda_decode_forward(q, k, v, launch.selection, pattern_id=launch.pattern_id, window=window,
                                  sinks=sinks, scale=scale, counters=counters)


def attention_forward(
    q, k, v, layout, *, scale, softcap=None, sink_logits=None, key_mask=None, pack=1, num_splits=1, out=None,
    causal=None, pattern=None, selection=None, structured=None, cuda=None, **triton_options,
):
    """Attention forward over ``layout`` on the kernel ``plan.plan_forward`` picks.

    Args:
        q: ``(B, Hq, Sq, D)`` (any strides with unit last stride); k, v: ``(B, Hkv, Skv, D)`` likewise.
        layout: a ``BlockLayout`` (or ``decode_layout.DecodeLayout``, or the custom op's namespace) with
            ``block_q == BLOCK_M // pack`` and ``block_k == BLOCK_N``; its ``geometry`` and ``pattern``.
        pattern, causal: override the layout's pattern (a ``Pattern`` or ``pattern_codes.PatternCode``) / causality.
        pack: query heads per program (divides ``Hq // Hkv``); num_splits: split-KV factor (decode).
        out: optional ``(B, Hq, Sq, D)`` output view to write into (e.g. a ``(B, S, H, D)`` tensor's transpose).
        selection: an optional ``TokenLayout`` (or namespace with its fields) fused into the pass.
        structured: run dense / sliding_window / streaming on the arithmetic-tile kernels (True) or on
            the layout path (False); default: where ``plan.structured_launch`` allows it.
        cuda: False keeps the launch on the Triton kernels; default None: a Hopper CUDA kernel takes
            the launch where the plan allows it.
        triton_options: ``TRITON_FORWARD_OPTIONS`` of the Triton launchers (``triton.fwd.layout_forward``);
            ``num_warps``, ``num_stages``, ``use_tma`` or ``order`` keep the launch on Triton, and so does
            ``sel_fast`` for a token-layout launch.
    Returns: ``out (B, Hq, Sq, D)`` in q's dtype and memory order (``memory_order.new_output``) and
    ``lse (B, Hq, Sq)`` float32 (natural log, sink included).
    """
    unknown = sorted(set(triton_options) - set(TRITON_FORWARD_OPTIONS))
    if unknown:
        raise TypeError(f"attention_forward: unknown option(s) {unknown}; allowed: {', '.join(TRITON_FORWARD_OPTIONS)}")
    from .triton.fwd import check_sel_fast

    check_sel_fast(triton_options.get("sel_fast"))
    G = q.shape[1] // k.shape[1]
    if G % pack:
        raise ValueError(f"pack ({pack}) must divide the group size Hq // Hkv = {G}")
    pat = layout.pattern if pattern is None else pattern
    pid, params = pattern_code(pat)
    is_causal = bool(pat.causal if causal is None else causal)
    geo = layout.geometry
    launch = Launch(q, k, v, geo, pid, is_causal, selection, pack, num_splits, softcap, sink_logits, key_mask, out,
                    structured, cuda, any(triton_options.get(n) is not None for n in _TUNING),
                    triton_options.get("sel_fast"), layout)
    plan = plan_forward(launch)
    while plan.cuda:
        result = _cuda_forward(plan.kernel, launch, params, float(scale))
        if result is not None:
            record(plan)
            return result
        plan = plan_forward(launch)  # the extension failed to build: the plan now leaves it out
    record(plan)
    if plan.kernel == "triton_structured":
        from .triton.structured import structured_forward

        return structured_forward(
            q, k, v, geo, pattern_id=pid, params=params, causal=is_causal, scale=scale, block_m=layout.block_q * pack,
            block_n=layout.block_k, softcap=softcap, sink_logits=sink_logits, key_mask=key_mask, out=out,
            **{n: triton_options.get(n) for n in _TUNING},
        )
    from .triton.fwd import layout_forward

    return layout_forward(
        q, k, v, layout, pattern_id=pid, params=params, causal=is_causal, scale=scale, softcap=softcap,
        sink_logits=sink_logits, key_mask=key_mask, pack=pack, num_splits=num_splits, out=out, selection=selection,
        **triton_options,
    )


def attention_backward(
    do, q, k, v, out, lse, layout, *, scale, softcap=None, sink_logits=None, key_mask=None, selection=None,
    structured=None, cuda=None, num_warps=None, num_stages=None,
):
    """Gradients of ``attention_forward`` on the kernel ``plan.plan_backward`` picks.

    Args:
        do, q, out: ``(B, Hq, Sq, D)``; k, v: ``(B, Hkv, Skv, D)``; lse: ``(B, Hq, Sq)`` float32 from
            the forward. ``layout``: a ``BlockLayout`` with ``block_q = BLOCK_M`` and ``block_k =
            BLOCK_N`` (one query head per tile). ``selection``: the forward's ``TokenLayout``, if any.
        structured: dense / sliding_window / streaming on ``triton_structured_bwd`` (arithmetic tile
            ranges, its own tile shapes) or the CUDA backward; default: whenever the pattern allows it
            (no token layout; streaming causal only).
        cuda: False keeps the launch on the Triton kernels, and so do ``num_warps`` / ``num_stages``
            (which tune the layout-path kernels).
    Returns: ``dq, dk, dv`` (input dtypes), ``dsink (Hq,)`` float32 or None, and ``dweights`` (like
    ``selection.weights``, float32) or None.
    """
    from .triton.bwd import bwd_preprocess

    do = do.contiguous() if do.stride(-1) != 1 else do
    out = out.contiguous() if out.stride(-1) != 1 else out
    lse = lse.contiguous()
    pid, params = pattern_code(layout.pattern)
    geo = layout.geometry
    causal = bool(layout.pattern.causal)
    launch = Launch(q, k, v, geo, pid, causal, selection, softcap=softcap, sink_logits=sink_logits, key_mask=key_mask,
                    structured=structured, cuda=cuda, triton_tuned=(num_warps, num_stages) != (None, None))
    plan = plan_backward(launch, do, out, lse)
    while plan.cuda:
        from .cuda import structured_bwd as cb

        if _built("backward", cb):
            record(plan)
            grads = cb.cuda_structured_backward(do, q, k, v, out, lse, pattern_id=pid, window=int(params[0]),
                                                sinks=int(params[1]), scale=float(scale),
                                                stats=bwd_preprocess(do, out, lse))
            return (*grads, None, None)
        plan = plan_backward(launch, do, out, lse)
    record(plan)
    prep = bwd_preprocess(do, out, lse)  # (delta, lse2), (B, Hq, Sq) float32 each
    if plan.kernel == "triton_structured_bwd":
        from .triton.structured_bwd import structured_backward

        dq, dk, dv, dsink = structured_backward(
            do, q, k, v, out, lse, geo, pattern_id=pid, params=params, causal=causal, scale=scale, softcap=softcap,
            sink_logits=sink_logits, key_mask=key_mask, prep=prep,
        )
        return dq, dk, dv, dsink, None
    from .triton.bwd import layout_backward

    return layout_backward(
        do, q, k, v, out, lse, layout, pattern_id=pid, params=params, causal=causal, scale=scale, softcap=softcap,
        sink_logits=sink_logits, key_mask=key_mask, num_warps=num_warps, num_stages=num_stages, selection=selection,
        prep=prep,
    )
