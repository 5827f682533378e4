"""Public SDPA-style entry point: ``sparse_attention(q, k, v, pattern, ...)``.

Validates inputs (clear ``ValueError``/``TypeError``), resolves the pattern and the row geometry,
builds (or fetches from cache) the layout, and dispatches to a backend:

* ``"reference"`` — exact dense-mask attention (float64 inside; small shapes only),
* ``"torch"`` — the PyTorch path (any device, memory linear in S, autograd),
* ``"triton"`` — the GPU kernels, when installed and the inputs are supported,
* ``"auto"`` — the fastest backend that supports the inputs; falling back from a requested fast
  path prints a one-time warning saying why.
"""

from __future__ import annotations

import math
import numbers

import torch

from .attention.backends import _AUTO_ORDER, _BACKENDS, AttentionCall, available_backends, register_backend
from .layouts.geometry import RowGeometry, row_geometry
from .layouts.patterns import L2Aligned, Pattern, _check_bool, get_pattern, resolve_l2_segment
from .attention.reference import reference_attention
from .layouts.token_layout import TokenLayout
from .attention.plan import plan_backend, record
from .attention.torch_path import torch_sparse_attention
from .warn import warn_once

__all__ = ["sparse_attention", "register_backend", "available_backends"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"`{name}` must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if t.dim() != 4:
        raise ValueError(f"`{name}` must be 4-D (B, H, S, D), got shape {tuple(t.shape)}")


def _validate(q, k, v, attention_mask, sink_logits, softcap, scale, layer_idx):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, Sq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in (B, Hkv, Skv)")
    if k.shape[3] != D:
        raise ValueError(f"q and k head dims differ: {D} vs {k.shape[3]}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if Sq == 0 or k.shape[2] == 0:
        raise ValueError(f"sequence lengths must be >= 1, got Sq={Sq}, Skv={k.shape[2]}")
    if D == 0 or v.shape[3] == 0:
        raise ValueError(f"head dims must be >= 1, got D={D} for q and k, {v.shape[3]} for v")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"`attention_mask` must be a tensor, got {type(attention_mask).__name__}")
        if attention_mask.dtype.is_floating_point:
            raise TypeError(
                f"`attention_mask` must be bool or integer (True/1 = key takes part), got {attention_mask.dtype}"
            )
        if tuple(attention_mask.shape) != (B, k.shape[2]):
            raise ValueError(
                f"`attention_mask` must be 2-D (B, Skv) = ({B}, {k.shape[2]}), got shape {tuple(attention_mask.shape)}"
            )
        if attention_mask.device != q.device:
            raise ValueError(f"`attention_mask` is on {attention_mask.device}, inputs on {q.device}")
    if sink_logits is not None:
        if not isinstance(sink_logits, torch.Tensor) or tuple(sink_logits.shape) != (Hq,):
            shape = tuple(sink_logits.shape) if isinstance(sink_logits, torch.Tensor) else type(sink_logits).__name__
            raise ValueError(f"`sink_logits` must be a tensor of shape ({Hq},) (one per query head), got {shape}")
        if sink_logits.device != q.device:
            raise ValueError(f"`sink_logits` is on {sink_logits.device}, inputs on {q.device}")
    for name, x in (("softcap", softcap), ("scale", scale)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, numbers.Real) or not 0 < x < math.inf):
            raise ValueError(f"`{name}` must be a positive finite number or None, got {x!r}")
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
        raise ValueError(f"`layer_idx` must be a non-negative int, got {layer_idx!r}")


def _resolve_pattern(pattern, causal, k) -> Pattern:
    if isinstance(pattern, Pattern):
        p = pattern if causal is None or causal == pattern.causal else pattern.replace(causal=causal)
    else:
        p = get_pattern(pattern)
        if causal is not None and causal != p.causal:
            p = p.replace(causal=causal)
    if isinstance(p, L2Aligned) and p.segment is None:
        kv_bytes = 2 * k.shape[1] * k.shape[3] * k.element_size()
        p = resolve_l2_segment(p, kv_bytes)
        warn_once(
            f"l2_aligned: segment resolved to {p.segment} tokens for this device; store it in the pattern "
            "(resolve_l2_segment) so results do not depend on the machine"
        )
    return p


def _check_selection(selection, pattern: Pattern, k: torch.Tensor) -> None:
    """A selection belongs to a learned pattern and was built for it: the pattern's ``query_block`` (or one block,
    ``NB == 1``, at least that long, shared by every query of the call) and at most its ``top_k`` keys per block."""
    if selection is None:
        return
    if not isinstance(selection, TokenLayout):
        raise TypeError(f"`selection` must be a TokenLayout, got {type(selection).__name__}")
    if not pattern.learned:
        raise ValueError(
            f"`selection` is only for the learned patterns sparse_k and dsa, got pattern {pattern.name!r} "
            "(its rule alone decides its keys: pass selection=None)"
        )
    B, Hkv = k.shape[:2]
    if selection.indices.shape[:2] != (B, Hkv):
        raise ValueError(
            f"`selection` must have (B, Hkv) = ({B}, {Hkv}) leading dims, got {tuple(selection.indices.shape[:2])}"
        )
    one_block = selection.indices.shape[2] == 1 and selection.query_block >= pattern.query_block
    if selection.query_block != pattern.query_block and not one_block:
        raise ValueError(
            f"`selection` has query_block={selection.query_block}, the pattern query_block={pattern.query_block}: "
            "build the selection for this pattern (build_selection)"
        )
    if selection.top_k > pattern.top_k:
        raise ValueError(
            f"`selection` holds {selection.top_k} keys per block (top_k), more than the pattern's top_k={pattern.top_k}"
        )


def _check_q_start(q_start, q_len: int, kv_len: int) -> None:
    """``q_start`` in ``[-q_len, kv_len - q_len]``: the queries end at or before the last key (queries before key 0
    only as bottom-right alignment puts them there when ``Sq > Skv``). Only an int is checked: a tensor is not read
    (a decode step reads nothing on the host, whatever the device), and ``row_geometry`` names a wrong type or shape."""
    if not isinstance(q_start, int) or isinstance(q_start, bool):
        return
    lo = hi = q_start
    if lo < -q_len or hi > kv_len - q_len:
        bad = hi if hi > kv_len - q_len else lo
        raise ValueError(
            f"`q_start` (key index of query 0) must lie in [-Sq, Skv - Sq] = [{-q_len}, {kv_len - q_len}] "
            f"(the queries end at or before the last key), got {bad}"
        )


def _run_unpacked(call: AttentionCall, backend: str):
    if backend not in ("auto", "reference", "torch") and backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; available: {available_backends()}")
    chosen = plan_backend(backend, _AUTO_ORDER, lambda name: _BACKENDS[name][0](call))
    if chosen.kernel not in ("reference", "torch"):
        return _BACKENDS[chosen.kernel][1](call)
    if backend not in ("auto", chosen.kernel):
        warn_once(f"{chosen.reason}; using the PyTorch path instead")
    record(chosen)
    if chosen.kernel == "reference":
        out, lse = reference_attention(
            call.q, call.k, call.v, call.pattern, call.geometry, scale=call.scale, softcap=call.softcap,
            sink_logits=call.sink_logits, key_mask=call.key_mask, selection=call.selection,
            layer_idx=call.layer_idx,
        )
        lse_dtype = torch.float64 if call.q.dtype == torch.float64 else torch.float32
        return out.to(call.q.dtype), lse.to(lse_dtype)
    blk = 64 if call.q.device.type == "cpu" else 128
    # Short query runs (decode) get a query tile just large enough, so nothing is padded to 64 rows.
    block_q = min(blk, 1 << max(0, (call.q.shape[2] - 1).bit_length()))
    return torch_sparse_attention(
        call.q, call.k, call.v, call.layout(block_q, blk), scale=call.scale, softcap=call.softcap,
        sink_logits=call.sink_logits, key_mask=call.key_mask, selection=call.selection,
    )


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: "str | Pattern | dict" = "sliding_window",
    *,
    causal: bool | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    layer_idx: int = 0,
    return_lse: bool = False,
    backend: str = "auto",
    selection: TokenLayout | None = None,
    q_start: "int | torch.Tensor | None" = None,
):
    """Sparse attention with SDPA-style tensors.

    Args:
        q: ``(B, Hq, Sq, D)``; k, v: ``(B, Hkv, Skv, D)`` with ``Hq % Hkv == 0`` (GQA; K/V are never
            repeated). float16, bfloat16, float32 or float64.
        pattern: a name from ``available_patterns()`` (its defaults), a dict ``{"pattern": name, ...}``
            or a pattern object such as ``SlidingWindow(window=1024)``.
        causal: for a name or dict, ``False`` picks the bidirectional version; a pattern object keeps
            its own unless this is given.
        scale: softmax scale, default ``D ** -0.5``. softcap: ``softcap * tanh(s / softcap)``. Both positive and
            finite.
        sink_logits: ``(Hq,)`` logits that join each row's softmax denominator once (gpt-oss ``s_aux``).
        attention_mask: ``(B, Skv)`` bool/int, Transformers' convention (True/1 = the key takes part).
            Left padding moves each row's positions to start at its first valid key.
        cu_seqlens_q, cu_seqlens_k: ``(N + 1,)`` int32 offsets of N packed sequences (then ``B == 1``);
            ``max_seqlen_q/k`` are accepted for FlashAttention compatibility.
        layer_idx: layer index (seeds bigbird's random blocks).
        return_lse: also return ``lse (B, Hq, Sq)`` (natural log; includes the sink logit).
        backend: ``"auto"``, ``"reference"``, ``"torch"`` or a registered kernel backend.
        selection: a ``TokenLayout`` with the learned top-k keys of a ``sparse_k``/``dsa`` pattern, built for
            it (its ``query_block``, at most its ``top_k`` keys per block); any other pattern refuses one.
        q_start: key index of query 0 (int or ``(B,)``); default ``Skv - Sq`` (bottom-right). It must lie in
            ``[-Sq, Skv - Sq]``, checked for an int (a tensor is not read: no host sync).
    Returns:
        ``out (B, Hq, Sq, D)`` in the input dtype, and ``lse`` when ``return_lse``.
    """
    _validate(q, k, v, attention_mask, sink_logits, softcap, scale, layer_idx)
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"`causal` must be a bool or None, got {type(causal).__name__}")
    _check_bool("sparse_attention", "return_lse", return_lse)
    if not isinstance(backend, str) or backend not in available_backends():
        raise ValueError(f"unknown backend {backend!r}; available: {available_backends()}")
    p = _resolve_pattern(pattern, causal, k)
    if p.learned and selection is None and p.top_k > 0:
        warn_once(
            f"pattern {p.name!r} called without a selection: attending to its sinks and window only "
            "(pass selection=TokenLayout, or use the Transformers integration which runs the selector)"
        )
    _check_selection(selection, p, k)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    softcap = None if softcap is None else float(softcap)
    key_mask = None if attention_mask is None else attention_mask.to(torch.bool)

    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        out, lse = _packed(q, k, v, p, cu_seqlens_q, cu_seqlens_k, scale, softcap, sink_logits, layer_idx, backend, selection, key_mask, q_start)
    else:
        _check_q_start(q_start, q.shape[2], k.shape[2])
        geo = row_geometry(q.shape[0], q.shape[2], k.shape[2], key_mask, q_start, device=q.device)
        call = AttentionCall(
            q=q, k=k, v=v, pattern=p, geometry=geo, scale=scale, softcap=softcap, sink_logits=sink_logits,
            key_mask=_holes_only(key_mask, geo, k.shape[2], q.shape[2]), selection=selection, layer_idx=layer_idx,
            need_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
        )
        out, lse = _run_unpacked(call, backend)
    return (out, lse) if return_lse else out


#: Longest query run for which a key mask is kept as given (no host check whether the geometry covers it).
_DECODE_QUERIES = 16


def _holes_only(key_mask, geo: RowGeometry, kv_len: int, q_len: int):
    """The key mask if it has holes inside ``[k_start, k_end)``; None when the geometry already says it all.

    Deciding reads the device (one synchronisation), so decode calls (``q_len <= 16``) and traced calls
    keep the mask as it is: the kernels apply it exactly, at the cost of one mask load per key tile."""
    if key_mask is None:
        return None
    if q_len <= _DECODE_QUERIES or torch.compiler.is_compiling():
        return key_mask
    if torch.equal(key_mask, geo.key_valid(kv_len).expand_as(key_mask)):
        return None
    return key_mask


def _packed(q, k, v, p, cu_q, cu_k, scale, softcap, sink_logits, layer_idx, backend, selection, key_mask, q_start):
    if cu_q is None or cu_k is None:
        raise ValueError("packed sequences need both cu_seqlens_q and cu_seqlens_k")
    if q.shape[0] != 1:
        raise ValueError(f"packed sequences need B == 1, got B={q.shape[0]}")
    if key_mask is not None or selection is not None or q_start is not None:
        raise ValueError("packed sequences do not take attention_mask, selection or q_start (pass one call per sequence)")
    for name, cu, total in (("cu_seqlens_q", cu_q, q.shape[2]), ("cu_seqlens_k", cu_k, k.shape[2])):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point:
            raise TypeError(f"`{name}` must be a 1-D integer tensor of offsets")
        if cu.numel() < 2:
            raise ValueError(f"`{name}` must hold N + 1 >= 2 offsets (0, then each sequence's end), got {cu.tolist()}")
        if int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"`{name}` must rise from 0 to {total} (the packed length), got {cu.tolist()}")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got {cu_q.numel()-1} and {cu_k.numel()-1}")
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs, lses = [], []
    for s in range(len(cq) - 1):
        qs, ks_ = q[:, :, cq[s] : cq[s + 1]], k[:, :, ck[s] : ck[s + 1]]
        vs = v[:, :, ck[s] : ck[s + 1]]
        if qs.shape[2] == 0:
            continue
        if ks_.shape[2] == 0:
            outs.append(torch.zeros_like(qs[..., : v.shape[-1]]))
            lses.append(torch.full(qs.shape[:3], float("-inf"), device=q.device))
            continue
        geo = row_geometry(1, qs.shape[2], ks_.shape[2], None, None, device=q.device)
        call = AttentionCall(
            q=qs, k=ks_, v=vs, pattern=p, geometry=geo, scale=scale, softcap=softcap, sink_logits=sink_logits,
            key_mask=None, selection=None, layer_idx=layer_idx, need_grad=False,
        )
        o, l_ = _run_unpacked(call, backend)
        outs.append(o)
        lses.append(l_.to(torch.float64 if q.dtype == torch.float64 else torch.float32))
    return torch.cat(outs, 2), torch.cat(lses, 2)
