"""Where each row's queries and keys sit: tensor indices -> token positions (design §3).

For batch row ``b`` the valid keys are the tensor indices ``k_start[b] <= j < k_end[b]`` (and, when
a 2-D key mask is given, only where it is True); key ``j`` has position ``j - k_start[b]``. Query
``i`` (tensor index along the query axis) sits at key index ``q_start[b] + i`` and so has position
``q_start[b] + i - k_start[b]``. Causality compares key indices, so left padding shifts queries and
keys alike, while sinks, blocks and anchors are counted from each row's first valid key.

Defaults: ``q_start = Skv - Sq`` (bottom-right: prefill, chunked prefill, decode), ``k_start`` = the
first True of the key mask (0 without one), ``k_end`` = one past its last True (``Skv`` without one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .host_memo import host_memo

__all__ = ["RowGeometry", "after_last_true", "bottom_right_geometry", "decode_geometry", "host_rows", "plain_geometry",
           "row_geometry"]


@dataclass(frozen=True)
class RowGeometry:
    """Per-row offsets, each an int64 tensor of shape ``(B,)`` (or ``(1,)`` when every row is alike)."""

    q_start: torch.Tensor
    k_start: torch.Tensor
    k_end: torch.Tensor
    #: The same offsets as host ints ``(q_start, k_start, k_end)`` (lists of ``rows`` ints) when they
    #: are known without reading the device (no mask, bottom-right or int ``q_start``), else None.
    #: Learned-selection builders use it to size their outputs without a host synchronisation.
    host: tuple | None = field(default=None, compare=False)

    @property
    def rows(self) -> int:
        return self.q_start.shape[0]

    def q_positions(self, q_len: int) -> torch.Tensor:
        """``(B', q_len)`` query positions."""
        i = torch.arange(q_len, device=self.q_start.device)
        return (self.q_start - self.k_start)[:, None] + i

    def k_positions(self, kv_len: int) -> torch.Tensor:
        """``(B', kv_len)`` key positions (negative before a row's first valid key)."""
        j = torch.arange(kv_len, device=self.k_start.device)
        return j - self.k_start[:, None]

    def key_valid(self, kv_len: int) -> torch.Tensor:
        """``(B', kv_len)`` bool: inside ``[k_start, k_end)``."""
        j = torch.arange(kv_len, device=self.k_start.device)
        return (j >= self.k_start[:, None]) & (j < self.k_end[:, None])

    def cache_key(self) -> tuple:
        """The offsets as tuples of ints (a hashable key): from the host offsets when known, else read from the device
        (a synchronisation)."""
        host = self.host_offsets()
        if host is not None:
            return tuple(tuple(x) for x in host)
        return (tuple(self.q_start.tolist()), tuple(self.k_start.tolist()), tuple(self.k_end.tolist()))

    def select(self, b: int) -> "RowGeometry":
        b = b if self.rows > 1 else 0
        host = None if self.host is None else tuple([x[b]] for x in self.host)
        return RowGeometry(self.q_start[b : b + 1], self.k_start[b : b + 1], self.k_end[b : b + 1], host)

    def host_offsets(self) -> tuple | None:
        """``(q_start, k_start, k_end)`` as lists of ints, read without a device synchronisation (from
        ``host``, or from the tensors when they live on the CPU); None when only the device knows them."""
        if self.host is not None:
            return self.host
        if self.q_start.device.type == "cpu" and not torch.compiler.is_compiling():
            return self.q_start.tolist(), self.k_start.tolist(), self.k_end.tolist()
        return None  # (traced CPU tensors too: their values are not known while tracing)


def after_last_true(mask: torch.Tensor) -> torch.Tensor:
    """``(...)`` int64: one past the last True of each row of ``mask (..., L)`` bool (0 for a row with none)."""
    j = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return torch.where(mask, j, 0).amax(-1)


def host_rows(host: tuple) -> list[tuple[int, ...]]:
    """``RowGeometry.host_offsets()`` (lists of one int per row, or one int for all rows) as one
    ``(q_start, k_start, k_end)`` tuple per row: as many rows as the longest list (one when all are shared)."""
    rows = max(len(x) for x in host)
    return [tuple(x[r if len(x) > 1 else 0] for x in host) for r in range(rows)]


def _as_rows(name: str, value, batch: int, device) -> torch.Tensor:
    """``value`` (an int, or an int tensor of shape ``(batch,)`` or ``(1,)``) as an int64 tensor ``(batch,)`` or
    ``(1,)`` on ``device``."""
    shapes = "(1,)" if batch == 1 else f"({batch},) or (1,)"
    allowed = f"`{name}` must be an int or an int tensor of shape {shapes} (batch size {batch})"
    if isinstance(value, bool):
        raise TypeError(f"{allowed}, got bool")
    if isinstance(value, int):
        return torch.tensor([value], dtype=torch.int64, device=device)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{allowed}, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype == torch.bool:
        raise TypeError(f"`{name}` must hold integers, got dtype {value.dtype}")
    if value.dim() != 1 or value.shape[0] not in (1, batch):
        raise ValueError(f"{allowed}, got shape {tuple(value.shape)}")
    return value.to(device=device, dtype=torch.int64)


def _check_size(name: str, value, low: int) -> None:
    """``value`` an int ``>= low``; a SymInt (under ``torch.compile``) is not checked."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"row_geometry: `{name}` must be an int >= {low}, got {type(value).__name__}")
    if isinstance(value, int) and value < low:
        raise ValueError(f"row_geometry: `{name}` must be an int >= {low}, got {value}")


def _check_key_mask(mask, batch, kv_len) -> None:
    """``mask (batch or 1, kv_len)`` bool or integer; sizes that are SymInts are not compared (O(1), no device read)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype.is_floating_point or mask.dtype.is_complex:
        got = f"dtype {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"row_geometry: `attention_mask` must be a bool or integer tensor (True/1: the key takes part), "
                        f"got {got}")
    shape = tuple(mask.shape)
    bad = len(shape) != 2
    if not bad:
        rows, length = shape
        bad = ((isinstance(batch, int) and isinstance(rows, int) and rows not in (1, batch))
               or (isinstance(kv_len, int) and isinstance(length, int) and length != kv_len))
    if bad:
        raise ValueError(f"row_geometry: `attention_mask` must have shape (B, kv_len) = ({batch}, {kv_len}) or "
                         f"(1, {kv_len}), got {shape}")


def row_geometry(
    batch: int,
    q_len: int,
    kv_len: int,
    attention_mask: torch.Tensor | None = None,
    q_start=None,
    device=None,
) -> RowGeometry:
    """Build the geometry of ``batch`` rows from the 2-D key mask (True/1 = key takes part).

    ``q_start`` overrides the bottom-right default (an int or ``(B,)`` tensor: key index of query 0),
    e.g. for a StaticCache whose valid length is shorter than its tensor. ``attention_mask``: ``(batch, kv_len)``
    or ``(1, kv_len)``, bool or integer. Sizes are checked when they are ints (a SymInt under ``torch.compile`` is
    not), the mask by its shape and dtype only (nothing is read from the device).
    """
    _check_size("batch", batch, 1)
    _check_size("q_len", q_len, 0)
    _check_size("kv_len", kv_len, 0)
    if attention_mask is not None:
        _check_key_mask(attention_mask, batch, kv_len)
    elif q_start is None or (isinstance(q_start, int) and not isinstance(q_start, bool)):
        if all(isinstance(x, int) for x in (batch, q_len, kv_len)):  # host-known: every layer shares the tensors
            return host_memo(("row_geometry", q_len, kv_len, q_start), device,
                             lambda: _row_geometry(batch, q_len, kv_len, None, q_start, device))
    return _row_geometry(batch, q_len, kv_len, attention_mask, q_start, device)


def _row_geometry(batch, q_len, kv_len, attention_mask, q_start, device) -> RowGeometry:
    if attention_mask is None:
        k_start = torch.zeros(1, dtype=torch.int64, device=device)
        k_end = torch.full((1,), kv_len, dtype=torch.int64, device=device)
    else:
        m = attention_mask.to(torch.bool)
        j = torch.arange(kv_len, device=m.device)
        any_valid = m.any(-1)
        first = torch.where(m, j, kv_len).amin(-1)
        last = after_last_true(m)
        k_start = torch.where(any_valid, first, torch.full_like(first, kv_len)).to(torch.int64)
        k_end = torch.where(any_valid, last, torch.full_like(last, kv_len)).to(torch.int64)
    if q_start is None:
        q_start_t = torch.full((1,), kv_len - q_len, dtype=torch.int64, device=k_start.device)
    else:
        q_start_t = _as_rows("q_start", q_start, batch, k_start.device)
    rows = max(q_start_t.shape[0], k_start.shape[0])
    host = None
    if attention_mask is None and (q_start is None or isinstance(q_start, int)):
        host = ([kv_len - q_len if q_start is None else int(q_start)], [0], [kv_len])
    return RowGeometry(q_start_t.expand(rows).contiguous(), k_start.expand(rows).contiguous(), k_end.expand(rows).contiguous(), host)


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


def decode_geometry(geometry, q_len: int, kv_len: int) -> bool:
    """Whether every row is a plain decode step: ``q_len == 1``, ``q_start == kv_len - 1``,
    ``k_start == 0`` and ``k_end == kv_len`` (host offsets; None: not known -> False, no sync)."""
    return q_len == 1 and bottom_right_geometry(geometry, q_len, kv_len)
