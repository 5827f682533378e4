"""Triton device functions shared by the attention kernels (forward, backward, structured and
layout paths): the element rule of each pattern (``_pattern_rule``, ids of ``pattern_codes``),
softcapping, a floor division that agrees between the interpreter and compiled code, and the tile runs
of the structured patterns (``_key_runs``, ``_query_runs``: the tables in ``triton.structured`` and
``triton.structured_bwd``)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["LOG2E"]

LOG2E = 1.4426950408889634


@triton.jit
def _floordiv(a, b):
    # Floor division that agrees between the interpreter (numpy) and compiled code (C truncation).
    return tl.where(a >= 0, a // b, -((-a + b - 1) // b))


@triton.jit
def _key_runs(qlo, qhi, k_start, k_end, P0, PATTERN: tl.constexpr, CAUSAL: tl.constexpr):
    """Key runs of a query tile whose valid queries sit at key indices ``qlo..qhi`` (structured patterns:
    dense, sliding_window / streaming with window ``P0``, block_diagonal with block ``P0``): ``(a_lo, a_hi)``
    the keys some row may see, ``(w_lo, w_hi)`` the keys every row may see, half-open, clipped to
    ``[k_start, k_end)``, ``a_hi >= a_lo``. Streaming's sink keys are not included."""
    a_lo = k_start
    w_lo = k_start
    if CAUSAL:
        a_hi = tl.minimum(k_end, qhi + 1)
        w_hi = tl.minimum(k_end, qlo + 1)
    else:
        a_hi = k_end
        w_hi = k_end
    if PATTERN == 1 or PATTERN == 2:
        if CAUSAL:
            a_lo = tl.maximum(k_start, qlo - P0 + 1)
            w_lo = tl.maximum(k_start, qhi - P0 + 1)
        else:
            a_lo = tl.maximum(k_start, qlo - P0)
            w_lo = tl.maximum(k_start, qhi - P0)
            a_hi = tl.minimum(k_end, qhi + P0 + 1)
            w_hi = tl.minimum(k_end, qlo + P0 + 1)
    elif PATTERN == 3:  # block of position p: [floor(p / P0) * P0, that + P0)
        b_lo = _floordiv(qlo - k_start, P0) * P0 + k_start
        b_hi = _floordiv(qhi - k_start, P0) * P0 + k_start
        a_lo = tl.maximum(k_start, b_lo)
        w_lo = tl.maximum(k_start, b_hi)
        a_hi = tl.minimum(a_hi, b_hi + P0)
        w_hi = tl.minimum(w_hi, b_lo + P0)
    a_hi = tl.maximum(a_hi, a_lo)
    return a_lo, a_hi, w_lo, w_hi


@triton.jit
def _query_runs(kl, kh, k_start, q_start, big, P0, P1, PATTERN: tl.constexpr, CAUSAL: tl.constexpr):
    """Query runs (key-index space) of a key tile whose valid keys are ``kl..kh``: ``(a_lo, a_hi)`` the
    queries that see some key, ``(f_lo, f_hi)`` those that see every key, half-open; ``big`` is past the
    last query. A streaming tile that holds sink keys is seen by every later query (all masked)."""
    if CAUSAL:
        a_lo = kl
        f_lo = kh
    else:
        a_lo = q_start
        f_lo = q_start
    a_hi = big
    f_hi = big
    if PATTERN == 1 or PATTERN == 2:
        if CAUSAL:
            a_hi = kh + P0  # exclusive: kh + W - 1 inclusive
            f_hi = kl + P0
        else:
            a_lo = kl - P0
            f_lo = kh - P0
            a_hi = kh + P0 + 1
            f_hi = kl + P0 + 1
        if PATTERN == 2:
            if kl < k_start + P1:  # holds sink keys: every later query sees them
                a_hi = big
                f_hi = f_lo
    elif PATTERN == 3:
        b_lo = _floordiv(kl - k_start, P0) * P0 + k_start
        b_hi = _floordiv(kh - k_start, P0) * P0 + k_start
        if not CAUSAL:
            a_lo = b_lo
            f_lo = b_hi
        a_hi = b_hi + P0
        f_hi = b_lo + P0
    return a_lo, a_hi, f_lo, f_hi


@triton.jit
def _pattern_rule(qpos, kpos, P0, P1, P2, P3, PATTERN: tl.constexpr, CAUSAL: tl.constexpr, SCALES: tl.constexpr = 0):
    """Element rule of design §4 on positions (broadcast int tensors); ``kpos >= 0`` and causality included.

    ``SCALES``: dilated only, the number of scales ``P1`` as a compile-time constant (the scale loop is
    unrolled); 0 loops over ``P1`` at run time, a loop inside the tile loop that Triton does not
    software-pipeline around."""
    d = qpos - kpos
    if PATTERN == 0:
        ok = d == d
    elif PATTERN == 1:
        if CAUSAL:
            ok = d < P0
        else:
            ok = (d <= P0) & (d >= -P0)
    elif PATTERN == 2:
        ok = (kpos < P1) | (d < P0)
    elif PATTERN == 3:
        ok = _floordiv(qpos, P0) == _floordiv(kpos, P0)
    elif PATTERN == 4:
        ok = d == d
    elif PATTERN == 5:
        ad = tl.where(d >= 0, d, -d)
        ok = d != d
        if SCALES > 0:
            for s in tl.static_range(SCALES):
                ok = ok | (((ad & ((1 << s) - 1)) == 0) & (ad < P0 * (1 << s)))
        else:
            stride = 1
            for _s in range(0, P1):
                ok = ok | (((ad & (stride - 1)) == 0) & (ad < P0 * stride))
                stride = stride * 2
    else:
        win = _floordiv(qpos, P0) - P1 < _floordiv(kpos, P0)
        kp = tl.where(kpos >= 0, kpos, 0)
        ok = win | ((kp % P2) < P3)
    ok = ok & (kpos >= 0)
    if CAUSAL:
        ok = ok & (d >= 0)
    return ok


@triton.jit
def _softcap(s, softcap):
    # softcap * tanh(s / softcap), tanh through exp (portable to the interpreter).
    x = s / softcap
    e = tl.exp(-2.0 * tl.where(x >= 0, x, -x))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(x >= 0, t, -t)
    return softcap * t
