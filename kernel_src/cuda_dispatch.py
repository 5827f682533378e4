"""When the structured forward and backward and the token-layout forward run on the Hopper CUDA
kernels (``cuda_structured``, ``cuda_structured_bwd``, ``cuda_token``) instead of Triton.

``triton_fwd.attention_forward`` asks ``try_cuda_structured`` first for dense / sliding_window /
streaming launches, ``triton_bwd.attention_backward`` asks ``try_cuda_structured_backward``. A CUDA
kernel takes a call when all of these hold, else the Triton kernel runs:

* the environment variable ``SPARSE_K_CUDA`` is unset or ``1`` (``0`` switches the kernel off);
* an sm_90 GPU (H100 / H200) and nvcc are present (the extension is built on first use: about a
  minute once, then loaded from ``$SPARSE_K_CUDA_CACHE`` or ``~/.cache/sparse_k``);
* causal self-attention over the plain geometry (no padding, ``Sq == Skv``, query ``i`` at key
  index ``i``), D = 128, bf16 / fp16, no softcap, sink logits or key mask, and no caller-provided
  output view;
* q / k / v (and dO for the backward) contiguous or strided views with unit last stride and strides
  of 16-byte multiples (``cuda_contract.tma_view_ok``): the transposed ``(B, S, H, D)`` projections
  a Transformers layer passes and ``flash_api``'s ``(B, S, H, D)`` tensors are read in place. The
  output follows q's memory order (``memory_order.new_output``), so ``out.transpose(1, 2)`` of a
  transposed call is contiguous; gradients are laid out like their inputs where those are dense.

``try_cuda_token`` does the same for a token-layout forward (``selection``, the learned ``sparse_k``
prefill; ``cuda_token``) under the same conditions, with a sliding_window / streaming static part and
``query_block`` a multiple of 128.

``try_cuda_decode`` takes a token-layout decode (``Sq == 1``, the query at key ``Skv - 1``, every
key valid: ``decode_geometry``; ``cuda_decode``) under the same conditions otherwise, for k / v with
unit last stride and 16-byte aligned rows (a Transformers cache, read in place) and ``Hq / Hkv`` in
1, 2, 4, 8, whatever ``num_splits`` / ``pack`` the caller chose for the Triton kernel.

If an extension cannot be built, a one-time warning says why and every later call takes the Triton
kernel; never a different answer (both compute the same function, tested against the reference).
"""

from __future__ import annotations

import os

from .api import warn_once
from .cuda_build import sm90_available

__all__ = [
    "CUDA_ENV",
    "bottom_right_geometry",
    "cuda_decode_applies",
    "cuda_enabled",
    "cuda_structured_applies",
    "cuda_structured_backward_applies",
    "cuda_token_applies",
    "decode_geometry",
    "plain_geometry",
    "try_cuda_decode",
    "try_cuda_structured",
    "try_cuda_structured_backward",
    "try_cuda_token",
]

#: Environment switch: "1" (default) lets the CUDA kernel take the calls it computes, "0" never.
CUDA_ENV = "SPARSE_K_CUDA"
_BUILD_FAILED: set[str] = set()  # names of the extensions that failed to build in this process


def cuda_enabled() -> bool:
    """``SPARSE_K_CUDA``: unset or "1" -> True, "0" -> False; any other value is a ValueError."""
    value = os.environ.get(CUDA_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{CUDA_ENV}={value!r}: allowed are '1' (default: use the Hopper CUDA forward where it applies) and '0'")
    return value == "1"


def bottom_right_geometry(geometry, q_len: int, kv_len: int) -> bool:
    """Whether every row is bottom-right aligned with no padding: ``q_start == kv_len - q_len``,
    ``k_start == 0`` and ``k_end == kv_len``, judged from the geometry's host offsets (None: not known
    -> False, no sync). The custom op carries this as its ``plain_geo`` flag."""
    host = getattr(geometry, "host", None)  # the custom op's geometry namespace carries one only with the flag
    if host is None or not 1 <= q_len <= kv_len:
        return False
    q_start, k_start, k_end = host
    return (all(x == kv_len - q_len for x in q_start) and all(x == 0 for x in k_start)
            and all(x == kv_len for x in k_end))


def plain_geometry(geometry, q_len: int, kv_len: int) -> bool:
    """Whether every row is plain self-attention: ``q_len == kv_len``, ``q_start == k_start == 0`` and
    ``k_end == kv_len`` (host offsets; None: not known -> False, no sync)."""
    return q_len == kv_len and bottom_right_geometry(geometry, q_len, kv_len)


def _gate(name: str, q) -> bool:
    """The conditions every CUDA kernel shares: switched on, its extension not failed to build, q on an
    sm_90 GPU with nvcc present."""
    return name not in _BUILD_FAILED and q.is_cuda and cuda_enabled() and sm90_available(q.device)


def decode_geometry(geometry, q_len: int, kv_len: int) -> bool:
    """Whether every row is a plain decode step: ``q_len == 1``, ``q_start == kv_len - 1``,
    ``k_start == 0`` and ``k_end == kv_len`` (host offsets; None: not known -> False, no sync)."""
    return q_len == 1 and bottom_right_geometry(geometry, q_len, kv_len)


def cuda_structured_applies(q, k, v, geometry, *, pattern_id, causal, softcap=None, sink_logits=None,
                            key_mask=None, out=None) -> bool:
    """Whether ``try_cuda_structured`` would hand this call to the CUDA kernel (module docstring)."""
    if not _gate("forward", q) or out is not None:
        return False
    from . import cuda_structured as cs

    plain = plain_geometry(geometry, q.shape[2], k.shape[2])
    return cs.cuda_structured_ok(
        q, k, v, pattern_id=pattern_id, causal=bool(causal), plain_geometry=plain, softcap=softcap,
        sink_logits=sink_logits, key_mask=key_mask,
    )


def _built(name: str, module) -> bool:
    """Build (or load) ``module``'s extension; on failure warn once, remember it, and return False."""
    try:
        module.load_extension()
    except Exception as e:  # noqa: BLE001 — any build failure: say why once, then the Triton kernel
        _BUILD_FAILED.add(name)
        warn_once(f"sparse_k: the Hopper CUDA {name} could not be built ({type(e).__name__}: {str(e)[:300]}); "
                  f"the Triton kernel runs instead (set {CUDA_ENV}=0 to skip the attempt)")
        return False
    return True


def try_cuda_structured(q, k, v, geometry, *, pattern_id, params, causal, scale, softcap=None, sink_logits=None,
                        key_mask=None, out=None):
    """``(out, lse)`` from the CUDA kernel, or None when the call is not one it takes (module docstring).

    Args: as ``triton_structured.structured_forward`` (``params`` from ``triton_fwd.pattern_code``:
    ``P0`` the window, ``P1`` the sinks).
    """
    if not cuda_structured_applies(q, k, v, geometry, pattern_id=pattern_id, causal=causal, softcap=softcap,
                                   sink_logits=sink_logits, key_mask=key_mask, out=out):
        return None
    from . import cuda_structured as cs

    if not _built("forward", cs):
        return None
    return cs.cuda_structured_forward(q, k, v, pattern_id=pattern_id, window=int(params[0]), sinks=int(params[1]),
                                      scale=float(scale))


def cuda_structured_backward_applies(do, q, k, v, out, lse, geometry, *, pattern_id, causal, softcap=None,
                                     sink_logits=None, key_mask=None) -> bool:
    """Whether ``try_cuda_structured_backward`` would hand this call to the CUDA backward."""
    if not _gate("backward", q):
        return False
    from . import cuda_structured_bwd as cb

    plain = plain_geometry(geometry, q.shape[2], k.shape[2])
    return cb.cuda_structured_bwd_ok(
        do, q, k, v, out, lse, pattern_id=pattern_id, causal=bool(causal), plain_geometry=plain, softcap=softcap,
        sink_logits=sink_logits, key_mask=key_mask,
    )


def try_cuda_structured_backward(do, q, k, v, out, lse, geometry, *, pattern_id, params, causal, scale, softcap=None,
                                 sink_logits=None, key_mask=None):
    """``(dq, dk, dv)`` from the CUDA backward, or None when the call is not one it takes (module
    docstring; the forward's ``lse`` may come from either kernel: both give the natural-log LSE).

    Args: as ``triton_structured_bwd.structured_backward``.
    """
    if not cuda_structured_backward_applies(do, q, k, v, out, lse, geometry, pattern_id=pattern_id, causal=causal,
                                            softcap=softcap, sink_logits=sink_logits, key_mask=key_mask):
        return None
    from . import cuda_structured_bwd as cb

    if not _built("backward", cb):
        return None
    return cb.cuda_structured_backward(do, q, k, v, out, lse, pattern_id=pattern_id, window=int(params[0]),
                                       sinks=int(params[1]), scale=float(scale))


def cuda_token_applies(q, k, v, geometry, selection, *, pattern_id, causal, softcap=None, sink_logits=None,
                       key_mask=None, out=None) -> bool:
    """Whether ``try_cuda_token`` would hand this token-layout call to the CUDA kernel."""
    if not _gate("token", q) or out is not None or selection is None:
        return False
    from . import cuda_token as ct

    plain = plain_geometry(geometry, q.shape[2], k.shape[2])
    return ct.cuda_token_ok(
        q, k, v, selection, pattern_id=pattern_id, causal=bool(causal), plain_geometry=plain, softcap=softcap,
        sink_logits=sink_logits, key_mask=key_mask,
    )


def try_cuda_token(q, k, v, geometry, selection, *, pattern_id, params, causal, scale, softcap=None,
                   sink_logits=None, key_mask=None, out=None):
    """``(out, lse)`` from the CUDA token-layout forward, or None when the call is not one it takes.

    Args: as ``triton_fwd.attention_forward`` (``selection`` a ``TokenLayout``; ``params`` from
    ``triton_fwd.pattern_code`` of the static part: ``P0`` the window, ``P1`` the sinks).
    """
    if not cuda_token_applies(q, k, v, geometry, selection, pattern_id=pattern_id, causal=causal, softcap=softcap,
                              sink_logits=sink_logits, key_mask=key_mask, out=out):
        return None
    from . import cuda_token as ct

    if not _built("token", ct):
        return None
    return ct.cuda_token_forward(q, k, v, selection, pattern_id=pattern_id, window=int(params[0]),
                                 sinks=int(params[1]), scale=float(scale))


def cuda_decode_applies(q, k, v, geometry, selection, *, pattern_id, causal, softcap=None, sink_logits=None,
                        key_mask=None, out=None) -> bool:
    """Whether ``try_cuda_decode`` would hand this token-layout decode call to the CUDA kernel."""
    if not _gate("decode", q) or out is not None or selection is None:
        return False
    from . import cuda_decode as cd

    dec = decode_geometry(geometry, q.shape[2], k.shape[2])
    return cd.cuda_decode_ok(
        q, k, v, selection, pattern_id=pattern_id, causal=bool(causal), decode_geometry=dec, softcap=softcap,
        sink_logits=sink_logits, key_mask=key_mask,
    )


def try_cuda_decode(q, k, v, geometry, selection, *, pattern_id, params, causal, scale, softcap=None,
                    sink_logits=None, key_mask=None, out=None):
    """``(out, lse)`` from the CUDA token-layout decode, or None when the call is not one it takes.

    Args: as ``try_cuda_token`` (``q (B, Hq, 1, D)``). Two to eight splits merge in a thread-block
    cluster; more merge through ``triton_fwd.split_counters`` (a second merge kernel when none can be
    had, e.g. in a capture on a new stream).
    """
    if not cuda_decode_applies(q, k, v, geometry, selection, pattern_id=pattern_id, causal=causal, softcap=softcap,
                               sink_logits=sink_logits, key_mask=key_mask, out=out):
        return None
    from . import cuda_decode as cd
    from .triton_fwd import split_counters

    if not _built("decode", cd):
        return None
    counters = split_counters(q.device, q.shape[0] * k.shape[1])
    return cd.cuda_decode_forward(q, k, v, selection, pattern_id=pattern_id, window=int(params[0]),
                                  sinks=int(params[1]), scale=float(scale), counters=counters)
