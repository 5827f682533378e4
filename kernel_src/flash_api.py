"""FlashAttention-style entry points over ``sparse_attention``: ``(B, S, H, D)`` tensors.

* ``flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, ...)``
* ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`` with
  packed ``(total, H, D)`` tensors
* ``flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, ...)``: decode /
  chunked prefill against a ``(B, S_cache, Hkv, D)`` cache read in place (strided views, no copies);
  new keys ``k``/``v`` are written into the cache at ``cache_seqlens`` first, as FlashAttention does.

``window_size=(left, right)`` follows FlashAttention: key ``j`` is attended by query ``i`` when
``i - left <= j <= i + right`` (``-1`` = unbounded). Causal with a finite ``left`` is the
``sliding_window`` pattern with ``window = left + 1``; non-causal with ``left == right`` is the
bidirectional ``sliding_window`` with ``window = left``. Other patterns go through ``pattern=`` (a name, dict or
pattern object) and keep their own causality, except that ``causal=True`` makes a bidirectional one causal (``False``
is FlashAttention's default, so it changes nothing: ``pattern={"pattern": "dense", "causal": False}`` for two-way).
Queries are aligned bottom-right, as in FlashAttention 2.1+.
"""

from __future__ import annotations

import operator

import torch

from .api import sparse_attention
from .layouts.patterns import Dense, Pattern, SlidingWindow, _check_bool, get_pattern

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def _pattern_from_window(window_size, causal: bool, pattern) -> Pattern:
    if pattern is not None:  # the pattern's own causality; causal=True (FlashAttention's default is False) forces it
        p = get_pattern(pattern)
        if window_size not in ((-1, -1), [-1, -1]):
            raise ValueError("pass either `pattern` or `window_size`, not both")
        return p.replace(causal=True) if causal and not p.causal else p
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"`window_size` must be a pair (left, right), got {window_size!r}")
    if any(isinstance(x, bool) or not hasattr(x, "__index__") for x in window_size):
        raise TypeError(f"`window_size` entries must be integers (-1: unbounded), got {window_size!r}")
    left, right = (operator.index(x) for x in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"`window_size` entries must be >= -1, got {window_size!r}")
    if causal:
        if left < 0:
            return Dense(causal=True)
        return SlidingWindow(window=left + 1, causal=True)
    if left < 0 and right < 0:
        return Dense(causal=False)
    if left != right or left < 0:
        raise ValueError(
            f"non-causal `window_size` must be symmetric (left == right >= 0) or (-1, -1), got {window_size!r}"
        )
    return SlidingWindow(window=left, causal=False)


def _softcap(softcap) -> float | None:
    if softcap is None or softcap == 0:
        return None
    return float(softcap)


def _check_unsupported(dropout_p, alibi_slopes):
    if dropout_p:
        raise ValueError(f"dropout_p must be 0 (dropout is not supported), got {dropout_p}")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes are not supported")


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, pattern=None, sink_logits=None,
    layer_idx=0, backend="auto",
):
    """``q (B, Sq, Hq, D)``, ``k``/``v`` ``(B, Skv, Hkv, D)`` -> ``out (B, Sq, Hq, D)`` (and ``lse (B, Hq, Sq)``
    when ``return_attn_probs``).

    The inputs reach the kernels as transposed views, without copies (the Hopper CUDA kernels read them
    through 4-D TMA maps: ``plan``), and the kernels write the output in ``(B, Sq, Hq, D)``
    memory order (``memory_order.new_output``), so ``out`` is contiguous whenever ``q`` is."""
    _check_unsupported(dropout_p, alibi_slopes)
    _check_bool("flash_attn_func", "return_attn_probs", return_attn_probs)
    _check_bool("flash_attn_func", "causal", causal)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"`{name}` must be a 4-D (B, S, H, D) tensor")
    p = _pattern_from_window(window_size, causal, pattern)
    out, lse = sparse_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), p, scale=softmax_scale, softcap=_softcap(softcap),
        sink_logits=sink_logits, layer_idx=layer_idx, return_lse=True, backend=backend,
    )
    out = out.transpose(1, 2)
    return (out, lse) if return_attn_probs else out


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, *, pattern=None, sink_logits=None, layer_idx=0, backend="auto",
):
    """Packed sequences: ``q (total_q, Hq, D)``, ``k``/``v`` ``(total_k, Hkv, D)``, ``cu_seqlens_*`` ``(N + 1,)``
    int32 -> ``out (total_q, Hq, D)`` (and ``lse (Hq, total_q)`` when ``return_attn_probs``)."""
    _check_unsupported(dropout_p, alibi_slopes)
    _check_bool("flash_attn_varlen_func", "return_attn_probs", return_attn_probs)
    _check_bool("flash_attn_varlen_func", "causal", causal)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"`{name}` must be a 3-D (total, H, D) tensor")
    p = _pattern_from_window(window_size, causal, pattern)
    out, lse = sparse_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), p,
        scale=softmax_scale, softcap=_softcap(softcap), sink_logits=sink_logits, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, layer_idx=layer_idx,
        return_lse=True, backend=backend,
    )
    out = out[0].transpose(0, 1)
    return (out, lse[0]) if return_attn_probs else out


def _cache_lengths(cache_seqlens, batch: int, slots: int, n_new: int, device) -> torch.Tensor:
    """``cache_seqlens`` as ``(B,)`` int64 on ``device``: None (the cache's ``slots`` less the ``n_new`` new keys), an
    int, or an integer tensor of shape ``(B,)``, each value in ``[0, slots - n_new]``. The values are read from an
    int or a CPU tensor, and from a CUDA tensor only when new keys are written (the write is checked); a CUDA tensor
    with no new keys is checked for dtype and shape only (no host synchronisation)."""
    if cache_seqlens is None:
        return torch.full((batch,), slots - n_new, dtype=torch.int64, device=device)
    if not isinstance(cache_seqlens, (torch.Tensor, bool)):
        try:
            cache_seqlens = operator.index(cache_seqlens)
        except TypeError:
            raise TypeError(f"`cache_seqlens` must be an int or an integer tensor of shape ({batch},), "
                            f"got {type(cache_seqlens).__name__}") from None
    if isinstance(cache_seqlens, bool):
        raise TypeError(f"`cache_seqlens` must be an int or an integer tensor of shape ({batch},), got a bool")
    if isinstance(cache_seqlens, int):
        lens = torch.full((batch,), cache_seqlens, dtype=torch.int64, device=device)
        bad = not 0 <= cache_seqlens <= slots - n_new
    else:
        if cache_seqlens.dtype.is_floating_point or cache_seqlens.dtype.is_complex or cache_seqlens.dtype == torch.bool:
            raise TypeError(f"`cache_seqlens` must hold integers, got dtype {cache_seqlens.dtype}")
        if tuple(cache_seqlens.shape) != (batch,):
            raise ValueError(f"`cache_seqlens` must have shape ({batch},) (one length per batch row), "
                             f"got {tuple(cache_seqlens.shape)}")
        lens = cache_seqlens.to(device=device, dtype=torch.int64)
        read = cache_seqlens.device.type == "cpu" or n_new > 0
        bad = read and bool(((lens < 0) | (lens > slots - n_new)).any())
    if bad:
        new = f", {n_new} of them for the new keys" if n_new else ""
        shown = cache_seqlens if isinstance(cache_seqlens, int) else cache_seqlens.tolist()
        raise ValueError(f"`cache_seqlens` must lie in [0, {slots - n_new}] (a cache of {slots} slots{new}), got {shown}")
    return lens


def _check_new_keys(k, v, k_cache, v_cache) -> None:
    """``k``/``v`` ``(B, Sq_new, Hkv, D)``: given together, shaped and typed as the cache they are written into."""
    if k is None and v is None:
        return
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        raise ValueError("k and v must be given together, as tensors of shape (B, Sq_new, Hkv, D)")
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if t.dim() != 4 or t.shape[0] != cache.shape[0] or t.shape[2:] != cache.shape[2:] or t.shape[1] != k.shape[1]:
            raise ValueError(f"`{name}` must have shape (B, Sq_new, Hkv, D) = ({cache.shape[0]}, {k.shape[1]}, "
                             f"{cache.shape[2]}, {cache.shape[3]}) like its cache, got {tuple(t.shape)}")
        if t.dtype != cache.dtype or t.device != cache.device:
            raise TypeError(f"`{name}` ({t.dtype} on {t.device}) must have the dtype and device of its cache "
                            f"({cache.dtype} on {cache.device})")


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
    return_softmax_lse=False, *, pattern=None, sink_logits=None, layer_idx=0, backend="auto",
):
    """Attention of ``q (B, Sq, Hq, D)`` against a cache ``(B, S_cache, Hkv, D)``.

    ``cache_seqlens`` (int or integer ``(B,)`` tensor): valid keys per row before this call, in
    ``[0, S_cache - Sq_new]`` (default: the whole cache). With ``k``/``v`` ``(B, Sq_new, Hkv, D)`` (the cache's
    dtype) they are written into the cache in place at ``cache_seqlens`` and attended too. The cache is read
    through strided views, never copied. The lengths' values are checked for an int or a CPU tensor, and for a
    CUDA tensor only when ``k``/``v`` are written; without new keys a CUDA tensor is checked for dtype and shape
    only, so the call reads nothing back to the host.
    """
    if rotary_cos is not None or rotary_sin is not None:
        raise ValueError("rotary embedding inside the call is not supported; apply RoPE before calling")
    if cache_batch_idx is not None or block_table is not None or cache_leftpad is not None:
        raise ValueError("cache_batch_idx, block_table and cache_leftpad are not supported")
    _check_unsupported(0.0, alibi_slopes)
    _check_bool("flash_attn_with_kvcache", "return_softmax_lse", return_softmax_lse)
    _check_bool("flash_attn_with_kvcache", "causal", causal)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"`{name}` must be a 4-D (B, S, H, D) tensor")
    _check_new_keys(k, v, k_cache, v_cache)
    p = _pattern_from_window(window_size, causal, pattern)  # before the cache is written
    B, S_cache = k_cache.shape[:2]
    Sq = q.shape[1]
    dev = q.device
    lens = _cache_lengths(cache_seqlens, B, S_cache, 0 if k is None else k.shape[1], dev)
    if k is not None:
        n_new = k.shape[1]
        pos = lens[:, None] + torch.arange(n_new, device=dev)
        rows = torch.arange(B, device=dev)[:, None].expand_as(pos)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
        lens = lens + n_new
    key_mask = torch.arange(S_cache, device=dev)[None, :] < lens[:, None]
    out, lse = sparse_attention(
        q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), p, scale=softmax_scale,
        softcap=_softcap(softcap), sink_logits=sink_logits, attention_mask=key_mask, q_start=lens - Sq,
        layer_idx=layer_idx, return_lse=True, backend=backend,
    )
    out = out.transpose(1, 2)
    return (out, lse) if return_softmax_lse else out
