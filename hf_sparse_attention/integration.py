"""Registration of ``attn_implementation="sparse_k"`` with Transformers.

Importing this module registers, under the same name ``"sparse_k"``:

* an attention function (``AttentionInterface``): ``sparse_k.transformers_adapter.attention_forward``;
* a mask function (``AttentionMaskInterface``): ``key_mask``. Without it Transformers would hand the
  attention function ``attention_mask=None`` and padded batches would come out wrong. It never builds
  a 4-D mask: it returns a 2-D ``(B, L)`` bool key mask over the absolute cache slots
  ``0 .. L-1`` that hold keys after this step (``L = q_offset + q_length``), or None when every slot
  of the key tensor is a valid key. See the adapter's docstring for how ``L`` is read.
"""

from __future__ import annotations

import torch

from sparse_k.transformers_adapter import STATIC_SLOTS_DTYPE, attention_forward

__all__ = ["ATTN_IMPLEMENTATION", "attention_forward", "key_mask", "register"]

#: The name to pass as ``attn_implementation``.
ATTN_IMPLEMENTATION = "sparse_k"


def _as_int(x) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def key_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    device: "torch.device | str" = "cpu",
    **kwargs,
) -> torch.Tensor | None:
    """Transformers mask-interface function (5.17 and later): a 2-D key mask or None, never 4-D.

    Args (as ``masking_utils.create_*_mask`` passes them):
        batch_size, q_length: of this forward. kv_length, kv_offset: this layer's key slots are
            ``[kv_offset, kv_offset + kv_length)`` (a StaticCache reports its full size; a sliding
            cache an offset past the keys it dropped). q_offset: tokens already in the cache (an int,
            or a 0-d tensor for a StaticCache).
        attention_mask: Transformers' 2-D padding mask ``(B, seen + q_length)`` (True/1 = real token) or None.
        mask_function: the model's mask rule; not used (the layer's pattern decides, see the adapter).
    A StaticCache (``q_offset`` a tensor, ``kv_offset == 0``) gets a ``(B, kv_length)`` uint8 mask
    over all its slots instead (``_static_slots_mask``: no host read, static shape).

    Returns:
        None when every slot of the key tensor is a valid key (no padding, nothing dropped, nothing
        unwritten: one answer for every layer of a type even when their caches differ in length),
        else ``(B, L)`` bool with ``L = q_offset + q_length``: True where slot ``j`` holds a key that
        takes part.
    """
    if isinstance(q_offset, torch.Tensor) and kv_offset == 0:
        return _static_slots_mask(batch_size, q_length, kv_length, q_offset, attention_mask, device)
    end = kv_offset + kv_length
    written = _as_int(q_offset) + q_length
    L = min(end, written)
    if attention_mask is None:
        if kv_offset == 0 and L == kv_length:
            return None
        return torch.ones(batch_size, L, dtype=torch.bool, device=device)
    if attention_mask.dim() != 2:
        raise ValueError(
            f'attn_implementation="sparse_k" takes a 2-D attention mask (B, keys), got shape {tuple(attention_mask.shape)}'
        )
    mask = attention_mask.to(device=device, dtype=torch.bool)
    if mask.shape[1] < L:
        mask = torch.nn.functional.pad(mask, (0, L - mask.shape[1]), value=False)
    mask = mask[:, :L]
    if kv_offset == 0 and L == kv_length and bool(mask.all()):
        return None
    return mask


def _static_slots_mask(batch_size, q_length, kv_length, q_offset, attention_mask, device) -> torch.Tensor:
    """``(B, kv_length)`` uint8 (``STATIC_SLOTS_DTYPE``) mask over every slot of a static cache layer: 1 where
    slot ``j < q_offset + q_length`` holds a key that takes part. Built on the device from the tensor
    ``q_offset`` (nothing read on the host, one shape for every step: CUDA-graph friendly); the adapter
    places the queries after each row's last valid slot."""
    written = q_offset.to(device=device).reshape(-1)[:1] + q_length
    valid = (torch.arange(kv_length, device=device) < written).expand(batch_size, kv_length)
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f'attn_implementation="sparse_k" takes a 2-D attention mask (B, keys), got shape {tuple(attention_mask.shape)}'
            )
        pad = attention_mask.to(device=device, dtype=torch.bool)
        if pad.shape[1] < kv_length:
            pad = torch.nn.functional.pad(pad, (0, kv_length - pad.shape[1]), value=False)
        valid = valid & pad[:, :kv_length]
    return valid.to(STATIC_SLOTS_DTYPE)


def register() -> None:
    """Register ``"sparse_k"`` with Transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, key_mask)
