"""Small index tensors that depend only on host-known values, built once and shared by the calls that need them.

Every attention layer of a forward computes the same geometry from the same sizes and offsets: the row offsets of
``row_geometry`` and the query blocks and candidate ranges of a learned selection (``selectors.block_candidates``).
When those inputs are host ints (no mask, or offsets the host knows), the tensors are a function of a hashable key,
and ``host_memo(key, build)`` returns the ones an earlier call built (a forward of ``L`` layers builds them once,
not ``L`` times: a few dozen kernel launches a layer less). The memo keeps the last ``MEMO_SIZE`` keys, at most
``MEMO_BYTES`` of tensors (a per-query selection's geometry at 128K is megabytes).

Nothing is kept while ``torch.compile`` traces (the values are graph values) or while a CUDA graph is captured
(a tensor made there lives in the graph's memory pool), and inference tensors are kept apart from ordinary ones
(an inference tensor cannot be saved for a backward). Callers never write the tensors they get.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

__all__ = ["MEMO_BYTES", "MEMO_SIZE", "host_memo"]

#: Keys kept (least recently used dropped): a forward needs a few (one per layer type and pattern), a decode step one.
MEMO_SIZE = 32
#: Bytes of tensors kept at most (least recently used dropped; a value larger than this is not kept).
MEMO_BYTES = 64 << 20

_MEMO: OrderedDict = OrderedDict()  # full key -> (value, bytes)


def _nbytes(value) -> int:
    """Bytes of the tensors in ``value`` (a tensor, a tuple / list, a dataclass of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(_nbytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


def _keepable(device: torch.device) -> bool:
    if torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def host_memo(key: tuple, device, build):
    """``build()``, or what it returned for an earlier call with the same ``key`` (hashable: sizes, host offsets,
    pattern parameters) on the same ``device`` and inference mode."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not _keepable(device):
        return build()
    full = (key, str(device), torch.is_inference_mode_enabled())
    hit = _MEMO.get(full)
    if hit is not None:
        _MEMO.move_to_end(full)
        return hit[0]
    value = build()
    size = _nbytes(value)
    if size <= MEMO_BYTES:
        _MEMO[full] = (value, size)
        total = sum(n for _, n in _MEMO.values())
        while len(_MEMO) > MEMO_SIZE or total > MEMO_BYTES:
            total -= _MEMO.popitem(last=False)[1][1]
    return value
