"""Transformers entry points of the hub kernel: ``attn_implementation="<org>/sparse-k"``.

When a hub kernel has both ``flash_attn_forward`` and ``supports_flash_attn`` (and no
``flash_attn_varlen_func``, which would make it a FlashAttention drop-in), Transformers'
``integrations/hub_kernels.py::load_and_register_attn_kernel`` registers ``flash_attn_forward`` as
the attention function and pairs it with its **sdpa** mask function. ``flash_attn_forward`` is then
called like every attention function,
``flash_attn_forward(module, query, key, value, attention_mask, dropout=..., scaling=..., **kwargs)``,
with ``attention_mask`` either None or a 4-D boolean ``(B, 1, Sq, Skv)`` mask (True = attend).

The sparse patterns need two facts from that mask, not the mask itself: which key slots hold keys
(the 2-D key mask of ``transformers_adapter``: Transformers' convention, True = key takes part,
over the absolute cache slots ``0 .. L-1``) and where the queries sit (query ``i`` is slot
``q_start + i``). ``sdpa_mask_to_key_mask`` recovers both; ``flash_attn_forward`` then runs
``transformers_adapter.attention_forward``, the function ``attn_implementation="sparse_k"`` runs,
so both routes read ``config.sparse_attention`` and give the same result. Anything else the mask says
(queries that see later keys, earlier keys hidden inside the layer's own window or chunk) would be
dropped by the pattern, so it raises ``ValueError`` as ``"sparse_k"`` does for a caller's 4-D mask;
a one-row packed call (``position_ids`` that restart at 0) is run sequence by sequence, and
``cu_seq_lens_q/k`` make the mask unread, as on ``"sparse_k"``.

Limitation: the sdpa mask of a layer whose cache drops old keys (a sliding-window cache, once the
sequence is longer than the cache) covers only the kept keys, so the hub route counts positions from
the first kept key, where ``"sparse_k"`` (whose own mask function knows the absolute slots) counts
from the first token. Rules that depend on ``i - j`` only (dense, sliding_window, dilated, and what
the adapter makes of most patterns on such layers) give the same result; sinks or blocks restricted
to a model window wider than the pattern's own window do not.
"""

from __future__ import annotations

import torch

from .transformers_adapter import (
    GLOBAL_DESPITE_WINDOW,
    NOT_PASSED,
    _check_causal_4d,
    _layer_locality,
    _mask_allows,
    _OneReadPerTensor,
    _packed_from_position_ids,
    _resolve_layer_call,
    _without_unmasked_rows,
    attention_forward,
)

__all__ = ["flash_attn_forward", "sdpa_mask_to_key_mask", "supports_flash_attn"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CHUNK_ELEMENTS = 1 << 24  # mask elements per step of the reduction: int64 temporaries stay <= 128 MB


def _check_mask(attention_mask, batch: int, q_len: int, kv_len: int) -> None:
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"`attention_mask` must be a tensor or None, got {type(attention_mask).__name__}")
    if attention_mask.dim() != 4:
        raise ValueError(
            f"`attention_mask` must be Transformers' 4-D sdpa mask (B, 1, Sq, Skv) or None, got shape "
            f"{tuple(attention_mask.shape)}"
        )
    b, _, sq, skv = attention_mask.shape
    if b not in (1, batch) or sq not in (1, q_len) or skv < kv_len:
        raise ValueError(
            f"`attention_mask` of shape {tuple(attention_mask.shape)} does not fit B={batch}, Sq={q_len}, "
            f"Skv={kv_len}: expected ({batch} or 1, H or 1, {q_len} or 1, >= {kv_len})"
        )


def _check_locality(window, chunk, sequence_starts, kv_len: int) -> None:
    for name, value in (("window", window), ("chunk", chunk)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"`{name}` must be None or an int >= 1, got {value!r}")
    if sequence_starts is None:
        return
    starts = tuple(sequence_starts) if isinstance(sequence_starts, (tuple, list)) else None
    if (not starts or not all(isinstance(s, int) and not isinstance(s, bool) for s in starts) or starts[0] != 0
            or starts[-1] != kv_len or any(a >= b for a, b in zip(starts, starts[1:]))):
        raise ValueError(
            f"`sequence_starts` must be None or increasing ints from 0 to Skv={kv_len} (cu_seqlens), "
            f"got {sequence_starts!r}"
        )


def _most_common_offset(last: torch.Tensor, i: torch.Tensor, default: int) -> int:
    """Most common ``last[i] - i`` over queries that attend something (ties: the largest); ``default`` if none."""
    offsets = (last - i)[last >= 0]
    if offsets.numel() == 0:
        return default
    values, counts = torch.unique(offsets, return_counts=True)
    return int(values[counts == counts.max()].max())


def sdpa_mask_to_key_mask(
    attention_mask: torch.Tensor | None,
    batch: int,
    q_len: int,
    kv_len: int,
    window: int | None = None,
    chunk: int | None = None,
    sequence_starts: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Reduce Transformers' sdpa mask to ``(key_mask, q_start)`` for ``transformers_adapter.attention_forward``.

    Args:
        attention_mask: None, or ``(B | 1, H | 1, Sq | 1, >= Skv)`` bool (True = attend), integer
            (1 = attend) or additive float mask; columns past ``Skv`` are ignored.
        batch, q_len, kv_len: ``B``, ``Sq`` and ``Skv`` of the call.
        window, chunk: the layer's own sliding window / attention chunk (None: none), which the adapter applies
            itself: the mask may hide the keys outside them.
        sequence_starts: the slots where packed sequences start, and ``Skv`` (``cu_seqlens`` of a one-row packed
            call, from its ``position_ids``), or None. They count only when every key slot holds a key, as the
            adapter then runs the sequences apart.
    Returns:
        ``key_mask``: None (every key slot holds a key, queries bottom-right) or ``(B, L)`` bool over
        absolute slots ``0 .. L-1``, where the queries are the last ``Sq`` of the ``L`` slots (the key
        tensor is cut to ``L``: a StaticCache's unwritten tail); ``q_start``: None, or an int64
        ``(B,)`` tensor of the slot of query 0 per row (only when rows disagree, which Transformers'
        own masks never do), with ``key_mask`` then over all ``Skv`` slots.
    Raises:
        ValueError: the mask has per-query structure the causal patterns would drop, within the layer's
            ``window`` / ``chunk`` (``transformers_adapter._check_causal_4d``, as ``attn_implementation="sparse_k"``
            checks a caller's 4-D mask): queries that see later keys (a bidirectional part), or earlier keys hidden
            from some queries (packed documents without ``sequence_starts``, a block or custom mask).

    Query ``i`` of row ``b`` sits at slot ``q_start + i``: in a causal mask the last key it attends is
    itself, so ``q_start`` is the most common ``last_allowed(i) - i`` over the row's queries (left
    padding queries attend nothing, right padding queries stop early: each of those gives its own value, the
    causal queries all give ``q_start``). A key slot holds a key when some query attends it; left padding, holes and
    a StaticCache's unwritten slots attend nothing. Rows before the last that attend every slot are left-padding
    queries of Transformers' older masks (``_unmask_unattended``) and count for neither. Without a mask, Transformers
    has only skipped building one: no padding and bottom-right queries, except for the prefill of an empty
    StaticCache (``Skv > Sq > 1``), where sdpa aligns queries top-left over slots ``0 .. Sq-1``.
    """
    if attention_mask is None:
        if 1 < q_len < kv_len:
            return torch.ones(batch, q_len, dtype=torch.bool), None
        return None, None
    _check_mask(attention_mask, batch, q_len, kv_len)
    _check_locality(window, chunk, sequence_starts, kv_len)
    full = _mask_allows(attention_mask)[..., :kv_len]  # (B', H', Sq', Skv)
    device = full.device
    j = torch.arange(kv_len, device=device)
    if full.shape[2] == 1 and q_len > 1:
        # One row for every query: key validity only, nothing says where the queries sit.
        key_mask = full[:, :, 0].any(1).expand(batch, kv_len)
        return (None if bool(key_mask.all()) else key_mask.contiguous()), None
    per_query = q_len > 1
    rows = _without_unmasked_rows(full) if per_query else full
    allowed = rows[:, 0] if rows.shape[1] == 1 else rows.any(1)  # (B', Sq', Skv)
    key_valid = allowed.any(1)  # (B', Skv)
    i = torch.arange(q_len, device=device)
    step = max(1, _CHUNK_ELEMENTS // (allowed.shape[0] * kv_len))  # bounds the int64 temporaries
    last = torch.cat(
        [torch.where(allowed[:, s : s + step], j, -1).amax(-1) for s in range(0, q_len, step)], dim=1
    )  # (B', Sq): last key each query attends
    q_start = torch.tensor([_most_common_offset(row, i, kv_len - q_len) for row in last], device=device)
    if per_query:
        documents = None
        if sequence_starts is not None and bool(key_valid.all()):
            bounds = torch.tensor(sequence_starts[1:-1], device=device)
            documents = torch.bucketize(j, bounds, right=True)[None]  # (1, Skv): the sequence of each slot
        _check_causal_4d(full, key_valid, window, chunk, q_start, documents)
    key_valid = key_valid.expand(batch, kv_len)
    q_start = q_start.expand(batch).to(torch.int64)
    first = int(q_start[0])
    if bool((q_start == first).all()) and first + q_len <= kv_len:
        key_mask = key_valid[:, : first + q_len]
        if first + q_len == kv_len and bool(key_mask.all()):
            return None, None
        return key_mask.contiguous(), None
    return key_valid.contiguous(), q_start.contiguous()


#: ``sdpa_mask_to_key_mask`` once per mask tensor and call shape and layer locality: Transformers builds one sdpa mask
#: per forward and layer type and hands it to every layer of that type; two types (sliding and global layers) take
#: turns.
_key_mask_once = _OneReadPerTensor(sdpa_mask_to_key_mask, tensors=2)


def _read_sequence_starts(position_ids: torch.Tensor) -> tuple[int, ...] | None:
    starts = _packed_from_position_ids(position_ids)
    return None if starts is None else tuple(starts.tolist())


#: The packed sequences' starts of a one-row ``position_ids`` (``_packed_from_position_ids``) as ints, read once per
#: tensor: every layer of a forward gets the same one.
_sequence_starts = _OneReadPerTensor(_read_sequence_starts)


def _mask_window(config, window: int | None) -> int | None:
    """The window past which Transformers' own sdpa mask may hide keys from a layer whose own window is ``window``.

    That window; for a model type that attends globally despite a ``sliding_window`` on its config
    (``GLOBAL_DESPITE_WINDOW``: moshi) the config's window, as the StaticCache Transformers builds for it keeps only
    that window and masks the rest (the layer runs globally over the keys it is given, as on ``"sparse_k"``)."""
    if window is None and getattr(config, "model_type", None) in GLOBAL_DESPITE_WINDOW:
        own = getattr(config, "sliding_window", None)
        return own if isinstance(own, int) and own > 0 else None
    return window


def flash_attn_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function of ``attn_implementation="<org>/sparse-k"`` (Transformers' hub-kernel route).

    Args:
        module: the attention layer (``config.sparse_attention``, ``layer_idx``, ``is_causal`` are read).
        query: ``(B, Hq, Sq, D)``; key, value: ``(B, Hkv, Skv, D)`` after RoPE and the cache update.
        attention_mask: Transformers' sdpa mask ``(B, 1, Sq, Skv)`` or None (see ``sdpa_mask_to_key_mask``; reduced
            once per mask tensor and layer locality: every layer of a forward gets the same one).
        scaling: softmax scale (default ``D ** -0.5``). dropout: not applied (a one-time warning in training).
        kwargs: ``sliding_window`` (the layer's own window; when not passed, the module's or config's, as on
            ``"sparse_k"``), ``position_ids`` and ``cu_seq_lens_q/k`` (packed calls), ``softcap``, ``s_aux`` and the
            rest of Transformers' attention kwargs.
    Returns:
        ``(attn_output (B, Sq, Hq, D), None)``.
    Raises:
        ValueError: the mask has per-query structure the pattern would drop (``sdpa_mask_to_key_mask``).
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"`{name}` must be a 4-D tensor (B, H, S, D), got {shape}")
    config, layer_idx, sliding_window = _resolve_layer_call(
        module, sliding_window=kwargs.pop("sliding_window", NOT_PASSED)
    )
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    key_mask = q_start = None
    if kwargs.get("cu_seq_lens_q") is None and kwargs.get("cu_seq_lens_k") is None:  # else no mask is read
        tracing = torch.compiler.is_compiling()
        starts = None
        position_ids = kwargs.get("position_ids")
        if isinstance(attention_mask, torch.Tensor) and isinstance(position_ids, torch.Tensor) and q_len == kv_len > 1:
            starts = _read_sequence_starts(position_ids) if tracing else _sequence_starts(position_ids, layer=layer_idx)
        window, chunk = _layer_locality(config, layer_idx, sliding_window)
        args = (attention_mask, batch, q_len, kv_len, _mask_window(config, window), chunk, starts)
        if isinstance(attention_mask, torch.Tensor) and not tracing:  # one reduction per mask, not per layer
            key_mask, q_start = _key_mask_once(*args, layer=layer_idx)
        else:
            key_mask, q_start = sdpa_mask_to_key_mask(*args)
    if key_mask is not None:
        key_mask = key_mask.to(query.device)
    if q_start is not None:
        q_start = q_start.to(query.device)
    return attention_forward(
        module, query, key, value, key_mask,
        scaling=scaling,
        dropout=dropout,
        sliding_window=sliding_window,
        softcap=kwargs.pop("softcap", None),
        s_aux=kwargs.pop("s_aux", None),
        config=config,
        layer_idx=layer_idx,
        q_start=q_start,
        **kwargs,
    )


def supports_flash_attn(
    query: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> bool:
    """Whether ``flash_attn_forward`` can run a call with these arguments (never raises).

    Without arguments: True, the route exists on every backend (the exact PyTorch path runs anywhere).
    With tensors: False for anything ``flash_attn_forward`` would reject: non-4-D or non-float
    tensors, mixed dtypes or devices, ``Hq % Hkv != 0``, different head dims, a mask that does not fit,
    ``is_causal=False`` (bidirectional layers) or ``output_attentions=True``.
    """
    if kwargs.get("output_attentions", False) or kwargs.get("is_causal", True) is False:
        return False
    if query is None and key is None and value is None:
        return attention_mask is None
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.dtype in _FLOAT_DTYPES for t in tensors):
        return False
    if len({t.dtype for t in tensors}) != 1 or len({t.device for t in tensors}) != 1:
        return False
    (b, hq, sq, d), (bk, hkv, skv, dk) = query.shape, key.shape
    if bk != b or value.shape[:3] != key.shape[:3] or dk != d or hkv == 0 or hq % hkv != 0 or sq == 0 or skv == 0:
        return False
    if attention_mask is not None:
        try:
            _check_mask(attention_mask, b, sq, skv)
        except (TypeError, ValueError):
            return False
    return True
