"""Registration of ``attn_implementation="sparse_k"`` with Transformers.

Importing this module registers, under the same name ``"sparse_k"``:

* an attention function (``AttentionInterface``): ``sparse_k.integrations.transformers_adapter.attention_forward``;
* a mask function (``AttentionMaskInterface``): ``key_mask``. Without it Transformers would hand the
  attention function ``attention_mask=None`` and padded batches would come out wrong. It never builds
  a 4-D mask: it returns a 2-D ``(B, L)`` bool key mask over the absolute cache slots
  ``0 .. L-1`` that hold keys after this step (``L = q_offset + q_length``), or None when every slot
  of the key tensor is a valid key. See the adapter's docstring for how ``L`` is read.
"""

from __future__ import annotations

import inspect
import re
import sys

import torch

from sparse_k.integrations.transformers_adapter import STATIC_SLOTS_DTYPE, attention_forward
from sparse_k.warn import warn_once

__all__ = ["ATTN_IMPLEMENTATION", "ModelNotSupportedError", "attention_forward", "check_model_support", "key_mask", "register"]

#: The name to pass as ``attn_implementation``.
ATTN_IMPLEMENTATION = "sparse_k"


def _as_int(x) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def _sees_the_next_token(mask_function, batch_size: int, q_length: int, q_offset: int, end: int, device) -> bool:
    """True when the model's own mask rule lets some query of this forward attend to the next token.

    A causal rule (with windows, chunks, packing or padding) never does; a bidirectional overlay
    (Gemma 3 image blocks, a prefix-LM prompt) does. Checks the pairs ``(i, i + 1)`` only: O(B * Sq).
    """
    from transformers.masking_utils import bidirectional_mask_function

    if mask_function is None or mask_function is bidirectional_mask_function or q_length < 2:
        return False  # no rule, or an encoder / cross-attention mask (the adapter refuses bidirectional self-attention)
    upper = min(end, q_offset + q_length) - 1
    if upper <= q_offset:  # no pair inside the key slots (e.g. a bounded cache whose slots lie before q_offset)
        return False
    q = torch.arange(q_offset, upper, device=device)
    batch = torch.arange(batch_size, device=device)[:, None]
    head = torch.zeros((), dtype=torch.long, device=device)
    try:
        allowed = mask_function(batch, head, q[None, :], q[None, :] + 1)
    except (IndexError, RuntimeError, TypeError):  # a rule not evaluable on index tensors: taken as causal
        return False
    return bool(torch.as_tensor(allowed).any())


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
        mask_function: the model's mask rule; the layer's pattern decides (see the adapter), but a rule
            that lets a query see the next token (a bidirectional overlay) raises ValueError.
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
    q_offset = _as_int(q_offset)
    if (
        attention_mask is not None
        and attention_mask.dim() == 2
        and kv_offset == 0
        and kv_length == q_offset + q_length
        and attention_mask.shape[1] > kv_length
    ):
        # The model asked the cache about a layer that holds no keys (recurrent_gemma: layer 0 is a
        # recurrent block, so q_offset = 0 while decoding): the 2-D padding mask, which covers every
        # token seen so far, gives the true number of slots.
        q_offset = attention_mask.shape[1] - q_length
        kv_length = attention_mask.shape[1]
    end = kv_offset + kv_length
    written = q_offset + q_length
    if _sees_the_next_token(mask_function, batch_size, q_length, q_offset, end, device):
        raise ValueError(
            f'attn_implementation="{ATTN_IMPLEMENTATION}" runs causal attention only, but this model\'s own mask lets '
            "tokens attend to later tokens in this forward (a bidirectional block: image/audio tokens or a prefix-LM "
            'prompt); run such inputs with attn_implementation="sdpa"'
        )
    L = min(end, written)
    if attention_mask is None:
        if kv_offset == 0 and L == kv_length:
            return None
        return torch.ones(batch_size, L, dtype=torch.bool, device=device)
    mask = _bool_key_mask(attention_mask, L, device)
    if kv_offset == 0 and L == kv_length and bool(mask.all()):
        return None
    return mask


class ModelNotSupportedError(ValueError):
    """``attn_implementation="sparse_k"`` was requested for a model it cannot run correctly."""


#: Model types whose attention goes through the interface but which sparse_k refuses, with the reason.
REFUSED_TYPES = {
    "deepseek_v32": "its attention runs its own DSA lightning indexer, which selects keys from a 4-D additive mask "
    "that sparse_k never builds",
    "glm_moe_dsa": "its attention runs its own DSA lightning indexer, which selects keys from a 4-D additive mask "
    "that sparse_k never builds",
    "axk2": "its attention runs its own DSA lightning indexer, which selects keys from a 4-D additive mask "
    "that sparse_k never builds",
    "deepseek_v4": "its attention combines compressed and selected keys under its own 4-D mask, which sparse_k "
    "never builds",
    "hy_v4": "its attention indexes the attention mask as a 4-D tensor, which sparse_k never builds",
    "bigbird_pegasus": "its decoder self-attention is marked non-causal (is_causal=False) and takes its causal "
    "rule from a 4-D mask, which sparse_k never builds",
    "inkling2_text": "its block attention residuals run bidirectional attention (is_causal=False) through the "
    "attention interface, which sparse_k does not run",
    "inkling2_loop_text": "its block attention residuals run bidirectional attention (is_causal=False) through the "
    "attention interface, which sparse_k does not run",
    "doge": "its attention builds its own dynamic 4-D mask (dynamic mask attention), which sparse_k would ignore",
    "kolibri1_1": "its indexed-attention layers select keys from the 4-D attention mask (their own indexer and "
    "key pool), which sparse_k never builds",
}

#: Source text of a modeling module that picks its attention class from a fixed table (eager/sdpa/...).
_CLASS_TABLE = re.compile(r"\w+_ATTENTION_CLASSES\[")


def _own_attention_code(cls) -> bool:
    """True when ``cls``'s modeling code computes attention outside the AttentionInterface."""
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        return True
    try:
        source = inspect.getsource(sys.modules[cls.__module__])
    except (KeyError, OSError, TypeError):
        return False
    return _CLASS_TABLE.search(source) is not None


def check_model_support(model) -> None:
    """Raise ``ModelNotSupportedError`` (naming the model type and why) if ``model`` cannot run sparse_k.

    A model is refused when its modeling code computes attention itself instead of calling
    Transformers' ``AttentionInterface`` (Transformers' own test, ``_can_set_attn_implementation``,
    or an ``*_ATTENTION_CLASSES[...]`` table of fixed implementations): sparse_k would never run and
    the causal mask, which the sparse_k mask function leaves to the attention function, would be
    lost. Also refused: the types in ``REFUSED_TYPES``.
    """
    cls = type(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None) or cls.__name__
    reason = REFUSED_TYPES.get(model_type)
    if reason is None and _own_attention_code(cls):
        reason = (
            f"{cls.__name__} computes attention in its own code instead of calling Transformers' AttentionInterface, "
            "so the sparse attention function would never run"
        )
    if reason is not None:
        raise ModelNotSupportedError(
            f'attn_implementation="{ATTN_IMPLEMENTATION}" does not support model type {model_type!r}: {reason}. '
            'Load it with attn_implementation="sdpa" or "eager".'
        )


def warn_if_sparse_config_unused(model) -> None:
    """One-time warning when ``model`` is built without an ``attn_implementation`` (Transformers' default, ``sdpa``,
    runs) although its config carries ``sparse_attention``: a model saved with sparse attention and reloaded by a
    plain ``from_pretrained`` would otherwise run dense attention without a word. An explicitly requested
    implementation (``"sdpa"`` for a dense baseline, say) is the caller's choice and is not warned about."""
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    configs = [config, get_text() if get_text is not None else None]
    if all(getattr(c, "sparse_attention", None) is None for c in configs):
        return
    model_type = getattr(config, "model_type", None) or type(model).__name__
    warn_once(
        f"this {model_type} config carries sparse_attention, but the model was built without attn_implementation, "
        f"so it runs Transformers' default dense attention and ignores it; pass "
        f'attn_implementation="{ATTN_IMPLEMENTATION}" to from_pretrained / from_config, or call '
        f'model.set_attn_implementation("{ATTN_IMPLEMENTATION}") on the loaded model'
    )


def _install_load_check() -> None:
    """Make ``from_pretrained``/``set_attn_implementation`` with ``"sparse_k"`` call ``check_model_support``, and
    a model built without an ``attn_implementation`` whose config carries ``sparse_attention`` warn
    (``warn_if_sparse_config_unused``).

    Wraps ``PreTrainedModel.get_correct_attn_implementation`` (called by every Transformers 5.x
    model's ``__init__``, with ``None`` when no implementation was requested, and by ``set_attn_implementation``),
    once.
    """
    from transformers import PreTrainedModel

    original = PreTrainedModel.get_correct_attn_implementation
    if getattr(original, "_sparse_k_checked", False):
        return

    def get_correct_attn_implementation(self, requested_attention, *args, **kwargs):
        if requested_attention == ATTN_IMPLEMENTATION:
            check_model_support(self)
        elif requested_attention is None:
            warn_if_sparse_config_unused(self)
        return original(self, requested_attention, *args, **kwargs)

    get_correct_attn_implementation._sparse_k_checked = True
    get_correct_attn_implementation.__doc__ = original.__doc__
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation


def _static_slots_mask(batch_size, q_length, kv_length, q_offset, attention_mask, device) -> torch.Tensor:
    """``(B, kv_length)`` uint8 (``STATIC_SLOTS_DTYPE``) mask over every slot of a static cache layer: 1 where
    slot ``j < q_offset + q_length`` holds a key that takes part. Built on the device from the tensor
    ``q_offset`` (nothing read on the host, one shape for every step: CUDA-graph friendly); the adapter
    places the queries after each row's last valid slot."""
    written = q_offset.to(device=device).reshape(-1)[:1] + q_length
    valid = (torch.arange(kv_length, device=device) < written).expand(batch_size, kv_length)
    if attention_mask is not None:
        valid = valid & _bool_key_mask(attention_mask, kv_length, device)
    return valid.to(STATIC_SLOTS_DTYPE)


def _bool_key_mask(attention_mask: torch.Tensor, length: int, device) -> torch.Tensor:
    """The model's 2-D ``(B, keys)`` mask as a ``(B, length)`` bool tensor on ``device``: cut to ``length``
    keys, or padded with False (keys the mask does not cover take no part). Raises ValueError for any
    other rank."""
    if attention_mask.dim() != 2:
        raise ValueError(
            f'attn_implementation="{ATTN_IMPLEMENTATION}" takes a 2-D attention mask (B, keys), '
            f"got shape {tuple(attention_mask.shape)}"
        )
    mask = attention_mask.to(device=device, dtype=torch.bool)
    if mask.shape[1] < length:
        mask = torch.nn.functional.pad(mask, (0, length - mask.shape[1]), value=False)
    return mask[:, :length]


def register() -> None:
    """Register ``"sparse_k"`` with Transformers' attention and mask interfaces and the load check, and the shipped
    selectors as a selector provider (``hf_sparse_attention.shipped``; idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, key_mask)
    _install_load_check()
    from sparse_k.integrations.transformers_adapter import SELECTOR_PROVIDERS

    from .shipped import shipped_selector

    if shipped_selector not in SELECTOR_PROVIDERS:
        SELECTOR_PROVIDERS.append(shipped_selector)
