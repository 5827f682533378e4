"""The backends ``sparse_k.sparse_attention`` can pick, and the validated call it hands them.

``"reference"`` and ``"torch"`` are built in (``api``); a fast backend (the GPU kernels,
``attention.triton.backend``) registers itself here with ``register_backend`` when it imports.
"""

from __future__ import annotations

from typing import Callable

from ..layouts.block_layout import BlockLayout, build_block_layout

__all__ = ["AttentionCall", "available_backends", "register_backend"]

# name -> (why_unsupported(inputs) -> str | None, run(inputs) -> (out, lse))
_BACKENDS: dict[str, tuple[Callable, Callable]] = {}
_AUTO_ORDER: list[str] = []


def register_backend(name: str, why_unsupported: Callable, run: Callable, *, auto_priority: int | None = None) -> None:
    """Register a fast backend. ``why_unsupported(call)`` returns None when it can run ``call``
    (an ``AttentionCall``), else a short reason; ``run(call)`` returns ``(out, lse)``."""
    _BACKENDS[name] = (why_unsupported, run)
    if auto_priority is not None and name not in _AUTO_ORDER:
        _AUTO_ORDER.insert(auto_priority, name)


def available_backends() -> list[str]:
    return ["auto", "reference", "torch", *_BACKENDS]


class AttentionCall:
    """Validated inputs of one call, handed to backends."""

    __slots__ = (
        "q", "k", "v", "pattern", "geometry", "scale", "softcap", "sink_logits", "key_mask",
        "selection", "layer_idx", "need_grad",
    )

    def __init__(self, **kw):
        for name in self.__slots__:
            setattr(self, name, kw.get(name))

    def layout(self, block_q: int, block_k: int) -> BlockLayout:
        return build_block_layout(
            self.pattern, self.q.shape[2], self.k.shape[2], self.geometry, block_q=block_q, block_k=block_k,
            layer_idx=self.layer_idx, num_kv_heads=self.k.shape[1],
        )
