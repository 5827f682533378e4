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
so both routes read ``config.sparse_attention`` and give the same result.

Limitation: the sdpa mask of a layer whose cache drops old keys (a sliding-window cache, once the
sequence is longer than the cache) covers only the kept keys, so the hub route counts positions from
the first kept key, where ``"sparse_k"`` (whose own mask function knows the absolute slots) counts
from the first token. Rules that depend on ``i - j`` only (dense, sliding_window, dilated, and what
the adapter makes of most patterns on such layers) give the same result; sinks or blocks restricted
to a model window wider than the pattern's own window do not.
"""

from __future__ import annotations

import torch

from ..warn import warn_once
from .transformers_adapter import _OneReadPerTensor, _mask_allows, attention_forward

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


def _most_common_offset(last: torch.Tensor, i: torch.Tensor, default: int) -> int:
    """Most common ``last[i] - i`` over queries that attend something (ties: the largest); ``default`` if none."""
    offsets = (last - i)[last >= 0]
    if offsets.numel() == 0:
        return default
    values, counts = torch.unique(offsets, return_counts=True)
    return int(values[counts == counts.max()].max())


def sdpa_mask_to_key_mask(
    attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Reduce Transformers' sdpa mask to ``(key_mask, q_start)`` for ``transformers_adapter.attention_forward``.

    Args:
        attention_mask: None, or ``(B | 1, H | 1, Sq | 1, >= Skv)`` bool (True = attend), integer
            (1 = attend) or additive float mask; columns past ``Skv`` are ignored.
        batch, q_len, kv_len: ``B``, ``Sq`` and ``Skv`` of the call.
    Returns:
        ``key_mask``: None (every key slot holds a key, queries bottom-right) or ``(B, L)`` bool over
        absolute slots ``0 .. L-1``, where the queries are the last ``Sq`` of the ``L`` slots (the key
        tensor is cut to ``L``: a StaticCache's unwritten tail); ``q_start``: None, or an int64
        ``(B,)`` tensor of the slot of query 0 per row (only when rows disagree, which Transformers'
        own masks never do), with ``key_mask`` then over all ``Skv`` slots.

    Query ``i`` of row ``b`` sits at slot ``q_start + i``: in a causal mask the last key it attends is
    itself, so ``q_start`` is the most common ``last_allowed(i) - i`` over the row's queries (left
    padding queries attend nothing, right padding queries stop early, queries of a bidirectional
    block reach later keys: each of those gives its own value, the causal queries all give
    ``q_start``). A key slot holds a key when some query attends it; left padding, holes and a
    StaticCache's unwritten slots attend nothing. Without a mask, Transformers has only
    skipped building one: no padding and bottom-right queries, except for the prefill of an empty
    StaticCache (``Skv > Sq > 1``), where sdpa aligns queries top-left over slots ``0 .. Sq-1``.
    """
    if attention_mask is None:
        if 1 < q_len < kv_len:
            return torch.ones(batch, q_len, dtype=torch.bool), None
        return None, None
    _check_mask(attention_mask, batch, q_len, kv_len)
    allowed = _mask_allows(attention_mask)[..., :kv_len]
    allowed = allowed[:, 0] if allowed.shape[1] == 1 else allowed.any(1)  # (B', Sq', Skv)
    device = allowed.device
    j = torch.arange(kv_len, device=device)
    if allowed.shape[1] == 1 and q_len > 1:
        # One row for every query: key validity only, nothing says where the queries sit.
        key_mask = allowed[:, 0].expand(batch, kv_len)
        return (None if bool(key_mask.all()) else key_mask.contiguous()), None
    key_valid = allowed.any(1)  # (B', Skv)
    i = torch.arange(q_len, device=device)
    rows = max(1, _CHUNK_ELEMENTS // (allowed.shape[0] * kv_len))  # bounds the int64 temporaries
    last = torch.cat(
        [torch.where(allowed[:, s : s + rows], j, -1).amax(-1) for s in range(0, q_len, rows)], dim=1
    )  # (B', Sq): last key each query attends
    q_start = torch.tensor([_most_common_offset(row, i, kv_len - q_len) for row in last], device=device)
    if any(
        bool((allowed[:, s : s + rows] & (j > (q_start[:, None] + i[s : s + rows])[..., None])).any())
        for s in range(0, q_len, rows)
    ):
        warn_once(
            "hub sparse_k attention: the attention mask lets queries see later keys (a bidirectional part); "
            "the causal patterns drop them"
        )
    key_valid = key_valid.expand(batch, kv_len)
    q_start = q_start.expand(batch).to(torch.int64)
    first = int(q_start[0])
    if bool((q_start == first).all()) and first + q_len <= kv_len:
        key_mask = key_valid[:, : first + q_len]
        if first + q_len == kv_len and bool(key_mask.all()):
            return None, None
        return key_mask.contiguous(), None
    return key_valid.contiguous(), q_start.contiguous()


#: ``sdpa_mask_to_key_mask`` once per mask tensor and call shape: Transformers builds one sdpa mask per forward and
#: layer type and hands it to every layer of that type; two types (sliding and global layers) take turns.
_key_mask_once = _OneReadPerTensor(sdpa_mask_to_key_mask, tensors=2)


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
            once per mask tensor: every layer of a forward gets the same one).
        scaling: softmax scale (default ``D ** -0.5``). dropout: not applied (a one-time warning in training).
        kwargs: ``sliding_window``, ``softcap``, ``s_aux`` and the rest of Transformers' attention kwargs.
    Returns:
        ``(attn_output (B, Sq, Hq, D), None)``.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"`{name}` must be a 4-D tensor (B, H, S, D), got {shape}")
    reduce = sdpa_mask_to_key_mask
    if isinstance(attention_mask, torch.Tensor) and not torch.compiler.is_compiling():
        reduce = _key_mask_once  # one reduction per mask, not per layer
    key_mask, q_start = reduce(attention_mask, query.shape[0], query.shape[2], key.shape[2])
    if key_mask is not None:
        key_mask = key_mask.to(query.device)
    if q_start is not None:
        q_start = q_start.to(query.device)
    return attention_forward(
        module, query, key, value, key_mask,
        scaling=scaling,
        dropout=dropout,
        sliding_window=kwargs.pop("sliding_window", None),
        softcap=kwargs.pop("softcap", None),
        s_aux=kwargs.pop("s_aux", None),
        config=getattr(module, "config", None),
        layer_idx=getattr(module, "layer_idx", None),
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
