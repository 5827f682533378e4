"""Patterns as the kernels see them: a pattern id (``PATTERN`` constexpr of the Triton kernels, the
``pattern_id`` of the CUDA kernels) and four integer parameters ``P0..P3``.

====  ===============  =====================================================================
 id    pattern          parameters
====  ===============  =====================================================================
 0     dense            —
 1     sliding_window   P0 = window
 2     streaming        P0 = window, P1 = sinks
 3     block_diagonal   P0 = block
 4     bigbird          — (aligned tiles only: a listed tile is allowed as a whole)
 5     dilated          P0 = window, P1 = scales
 6     l2_aligned       P0 = block, P1 = window_blocks, P2 = segment, P3 = anchor
====  ===============  =====================================================================

Learned patterns (``sparse_k``, ``dsa``) run their static part (streaming) plus a token layout.
"""

from __future__ import annotations

__all__ = ["PATTERN_IDS", "STRUCTURED_PATTERNS", "pattern_code", "structured_pattern"]

PATTERN_IDS = {
    "dense": 0, "sliding_window": 1, "streaming": 2, "block_diagonal": 3, "bigbird": 4, "dilated": 5,
    "l2_aligned": 6, "sparse_k": 2, "dsa": 2,
}

#: Pattern ids whose key tiles follow from the row geometry by arithmetic (no layout index lists):
#: dense, sliding_window, streaming, block_diagonal (``triton_structured``, ``triton_structured_bwd``).
STRUCTURED_PATTERNS = (0, 1, 2, 3)


def pattern_code(pattern) -> tuple[int, tuple[int, int, int, int]]:
    """``(PATTERN id, (P0, P1, P2, P3))`` for the kernels; learned patterns use their static part."""
    if hasattr(pattern, "pid"):  # already encoded (ops._PatternCode)
        return pattern.pid, pattern.params
    p = pattern.static_part() if pattern.learned else pattern
    pid = PATTERN_IDS[p.name]
    if pid == 1:
        params = (p.window, 0, 0, 0)
    elif pid == 2:
        params = (p.window, p.sinks, 0, 0)
    elif pid == 3:
        params = (p.block, 0, 0, 0)
    elif pid == 5:
        params = (p.window, p.scales, 0, 0)
    elif pid == 6:
        params = (p.block, p.window_blocks, p._seg(), p.anchor)
    else:
        params = (0, 0, 0, 0)
    return pid, params


def structured_pattern(pattern_id: int, causal: bool, selection=None) -> bool:
    """Whether the arithmetic-tile (structured) kernels compute this pattern: dense, sliding_window,
    streaming (causal only) or block_diagonal without a token layout. The one statement of the rule; the
    forward also needs one query head per program and one split (``plan``)."""
    return pattern_id in STRUCTURED_PATTERNS and selection is None and (bool(causal) or pattern_id != 2)
