"""Triton device functions shared by the attention kernels (forward, backward, structured and
layout paths): the element rule of each pattern (``_pattern_rule``, ids of ``pattern_codes``),
softcapping and a floor division that agrees between the interpreter and compiled code."""

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
