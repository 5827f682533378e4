"""Patterns as the kernels see them: a pattern id (``PATTERN`` constexpr of the Triton kernels, the
``pattern_id`` of the CUDA kernels) and four integer parameters ``P0..P3``.

====  ===============  =====================================================================
 id    pattern          parameters
====  ===============  =====================================================================
 0     dense            —
 1     sliding_window   P0 = window
 2     streaming        P0 = window, P1 = sinks
 3     block_diagonal   P0 = block
 4     bigbird          — (aligned tiles only: a listed tile is allowed as a whole); a decode step's
                       launch, or one over tiles that straddle its blocks (``decode_pattern_code``):
                       P0 = block, P1 = window_blocks + 65536 * random_blocks, P2 = global_blocks,
                       P3 = the layer's hash seed (the kernel then evaluates bigbird's rule)
 5     dilated          P0 = window, P1 = scales
 6     l2_aligned       P0 = block, P1 = window_blocks, P2 = segment, P3 = anchor
====  ===============  =====================================================================

Learned patterns (``sparse_k``, ``dsa``) run their static part (streaming) plus a token layout.

A decode step (``decode_layout.DecodeLayout``) of any causal pattern computes its key tiles in the
kernel (``DECODE_PATTERNS``), except bigbird with blocks under 16 or more than ``MAX_DECODE_RANDOM_BLOCKS``
random blocks (``decode_pattern_code``).
"""

from __future__ import annotations

import torch

from ..layouts.patterns import bigbird_draws, cached_block_table

__all__ = [
    "BIGBIRD_RANDOM_SHIFT", "DECODE_PATTERNS", "MAX_DECODE_RANDOM_BLOCKS", "PATTERN_IDS", "PatternCode", "STRUCTURED_PATTERNS",
    "bigbird_code_draws", "decode_pattern_code", "pattern_code", "structured_pattern",
]

PATTERN_IDS = {
    "dense": 0, "sliding_window": 1, "streaming": 2, "block_diagonal": 3, "bigbird": 4, "dilated": 5,
    "l2_aligned": 6, "sparse_k": 2, "dsa": 2,
}

#: Pattern ids whose key tiles follow from the row geometry by arithmetic (no layout index lists):
#: dense, sliding_window, streaming, block_diagonal (``triton_structured``, ``triton_structured_bwd``).
STRUCTURED_PATTERNS = (0, 1, 2, 3)

#: Pattern ids whose decode steps (causal, ``Sq <= 16``) compute their key tiles in the split-KV kernel
#: (``triton.fwd._struct_runs``, ``_random_slot``, ``_anchor_slot``): the structured ones plus bigbird, dilated,
#: l2_aligned.
DECODE_PATTERNS = (0, 1, 2, 3, 4, 5, 6)

#: Most random blocks of a bigbird decode step drawn in the kernel (its draws live in a vector this long).
MAX_DECODE_RANDOM_BLOCKS = 16

#: ``P1`` of a bigbird decode launch carries ``window_blocks + BIGBIRD_RANDOM_SHIFT * random_blocks``.
BIGBIRD_RANDOM_SHIFT = 1 << 16


class PatternCode:
    """A pattern already encoded for the kernels (``pid``, ``causal``, ``params``): stands for a ``Pattern``
    wherever ``pattern_code`` reads one (the custom op's layouts, a bigbird decode step's layer-specific code)."""

    learned = False

    def __init__(self, pid: int, causal: bool, params):
        self.pid, self.causal, self.params = pid, causal, tuple(params)


def pattern_code(pattern) -> tuple[int, tuple[int, int, int, int]]:
    """``(PATTERN id, (P0, P1, P2, P3))`` for the kernels; learned patterns use their static part."""
    if hasattr(pattern, "pid"):  # already encoded (``PatternCode``)
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


def decode_pattern_code(pattern, layer_idx: int) -> PatternCode | None:
    """The kernels' code of a causal decode step of ``pattern`` whose tiles the kernel computes, or None
    where it cannot: non-causal, a pattern outside ``DECODE_PATTERNS``, a bigbird with blocks under 16
    (a step's rows would span more than two query blocks) or more than ``MAX_DECODE_RANDOM_BLOCKS`` random
    blocks. bigbird's code carries ``layer_idx`` in its hash seed (the random blocks differ per layer)."""
    p = pattern.static_part() if pattern.learned else pattern
    if not p.causal or PATTERN_IDS.get(p.name) not in DECODE_PATTERNS:
        return None
    pid, params = pattern_code(p)
    if pid == 4:
        if p.block < 16 or p.random_blocks > MAX_DECODE_RANDOM_BLOCKS or p.window_blocks >= BIGBIRD_RANDOM_SHIFT:
            return None
        params = (p.block, p.window_blocks + BIGBIRD_RANDOM_SHIFT * p.random_blocks, p.global_blocks,
                  p.layer_seed(layer_idx))
    return PatternCode(pid, True, params)


#: Random tables of bigbird codes by (params, KV heads, device); see ``bigbird_code_draws``.
_CODE_DRAWS: dict = {}
_CODE_DRAWS_MAX = 256


def bigbird_code_draws(params, num_kv_heads: int, num_q_blocks: int, device) -> torch.Tensor:
    """The random key blocks of causal bigbird's code ``params`` (``decode_pattern_code``: block, window_blocks +
    ``BIGBIRD_RANDOM_SHIFT`` * random_blocks, global_blocks, the layer's seed): ``(num_kv_heads, num_q_blocks, r)``
    int32, -1 where none, the values of ``BigBird.random_table`` for that layer. Cached (room for the next power of
    two of query blocks) except inside a ``torch.compile`` trace or a CUDA-graph capture, where a cached tensor could
    live in a graph's memory pool that the next replay overwrites."""
    _, p1, g, seed = (int(x) for x in params)
    w, r = p1 % BIGBIRD_RANDOM_SHIFT, p1 // BIGBIRD_RANDOM_SHIFT
    dev = torch.device(device)
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if torch.compiler.is_compiling() or capturing:
        return bigbird_draws(r, g, w, True, seed, num_kv_heads, num_q_blocks, None, dev).to(torch.int32)
    key = (tuple(int(x) for x in params), num_kv_heads, str(dev))
    return cached_block_table(
        _CODE_DRAWS, _CODE_DRAWS_MAX, key, num_q_blocks,
        lambda room: bigbird_draws(r, g, w, True, seed, num_kv_heads, room, None, dev).to(torch.int32))
