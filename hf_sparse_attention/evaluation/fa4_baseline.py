"""FA4 (``flash_attn.cute.flash_attn_func`` of the flash-attn-4 package, CuTe DSL) as a kernel baseline.

``scripts/benchmark_kernels.py`` times it beside the forward and backward rows it can express: causal dense and
sliding_window, and a streaming row against FA4's sliding window of the same window (FA4 has no sink tokens: its
window is what a user would run instead). FA4 takes ``(B, S, H, D)`` tensors; the calls here take and
return this package's ``(B, H, S, D)`` and make contiguous ``(B, S, H, D)`` copies once, outside anything timed.
FA4 masks key ``j`` of query ``i`` outside ``[i - left, i + right]`` for ``window_size=(left, right)``, so a causal
window of ``w`` keys (the query included) is ``(w - 1, 0)``.
"""

from __future__ import annotations

from typing import Callable

import torch

from sparse_k import Pattern, get_pattern

__all__ = ["fa4_backward", "fa4_counterpart", "fa4_forward", "load_fa4"]

_FA4: Callable | str | None = None


def load_fa4() -> Callable | str:
    """FA4's ``flash_attn_func``, or a sentence saying why it cannot be imported here (cached)."""
    global _FA4
    if _FA4 is None:
        try:
            from flash_attn.cute import flash_attn_func

            _FA4 = flash_attn_func
        except Exception as e:  # noqa: BLE001 — any import failure means "no baseline", said in the rows
            _FA4 = f"FA4 not importable ({type(e).__name__}: {str(e)[:100]})"
    return _FA4


def fa4_counterpart(pattern: Pattern) -> tuple[tuple[int | None, int | None], Pattern] | None:
    """``(window_size, the pattern FA4 computes)`` of FA4's causal call standing for ``pattern``, or None where FA4
    has none: causal dense is ``(None, None)``; sliding_window ``(window - 1, 0)``; streaming the same window
    without its sinks (the second item is then a sliding_window pattern, not ``pattern``)."""
    if not pattern.causal:
        return None
    if pattern.name == "dense":
        return (None, None), pattern
    if pattern.name == "sliding_window":
        return (pattern.window - 1, 0), pattern
    if pattern.name == "streaming":
        return (pattern.window - 1, 0), get_pattern("sliding_window", window=pattern.window)
    return None


def _bshd(t: torch.Tensor, grad: bool = False) -> torch.Tensor:
    return t.detach().transpose(1, 2).contiguous().requires_grad_(grad)


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def fa4_forward(fa4: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                window_size: tuple[int | None, int | None]) -> tuple[torch.Tensor, Callable[[], object]]:
    """FA4's causal forward of ``q (B, Hq, S, D)``, ``k, v (B, Hkv, S, D)``: ``(out (B, Hq, S, D) view, call)``,
    where ``call()`` runs the same launch again on the prepared ``(B, S, H, D)`` copies (for timing)."""
    qt, kt, vt = _bshd(q), _bshd(k), _bshd(v)

    def call():
        return fa4(qt, kt, vt, softmax_scale=scale, causal=True, window_size=window_size)

    return _first(call()).transpose(1, 2), call


def fa4_backward(fa4: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, *,
                 scale: float, window_size: tuple[int | None, int | None]
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], Callable[[], object]]:
    """FA4's gradients of q, k, v (``(B, H, S, D)`` views) for ``grad_out (B, Hq, S, D)``, and ``call()``, which
    runs the same backward again on the kept graph (for timing)."""
    qt, kt, vt = _bshd(q, True), _bshd(k, True), _bshd(v, True)
    dot = _bshd(grad_out)
    out = _first(fa4(qt, kt, vt, softmax_scale=scale, causal=True, window_size=window_size))

    def call():
        return torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True)

    return tuple(g.transpose(1, 2) for g in call()), call
