"""Every causal-LM model type of the installed Transformers as a tiny random model (CPU, float32).

``tiny_config(model_type)`` starts from the type's own config class defaults and shrinks every size
field it knows (also inside sub-configs: text/vision towers), keeping at least one layer of every
distinct ``layer_types`` entry. ``check_family(model_type)`` runs the family checks of
``tests/integration/test_transformers_families.py`` and returns what it found. Run as a script for a table.
"""

from __future__ import annotations

import time

import torch
import transformers
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_sparse_attention
from hf_sparse_attention.integration import ModelNotSupportedError

VOCAB = 128
SEQ = 12
PAD = 3

#: Causal-LM types that cannot be built as a tiny random model here, with the reason.
NOT_BUILDABLE = {
    "gpt-sw3": "same class as gpt2 (GPT2LMHeadModel), covered there",
    "bailing_hybrid": "the generic shrink leaves its linear-attention head size at 0",
    "cohere_compass_text": "its default config has no 'full_attention' layer type the model code expects",
    "dbrx": "nested attention config without `rope_theta` after the dict round trip",
    "deepseek_v2": "MoE router needs `topk_group`/`n_group` settings the default config leaves unset",
    "dory": "looped layout: n_input_layers + n_recurrent_layers + n_output_layers must equal num_hidden_layers",
    "dots3_note": "composite (vision + audio) config with adapters sized to the default hidden size",
    "dots3_note_text": "MoE/adapter sizes tied to the default hidden size",
    "dots1": "MoE expert sizes unset in the default config",
    "emu3": "composite (VQ image model) config without a top-level `pad_token_id`",
    "ernie4_5_moe": "MoE router top-k larger than the shrunk expert count",
    "gemma3n": "vision tower needs the `timm` package",
    "gemma3n_text": "per-layer settings (KV sharing, activation sparsity) tied to 35 layers",
    "gemma4_assistant": "drafter config requires `hidden_size_per_layer_input=0` and a target model",
    "gemma4_unified_assistant": "drafter config whose layer types have no sliding layer",
    "hrm_text": "hierarchical recurrent layout (H/L cycles) does not shrink with the generic rule",
    "kimi_linear": "linear-attention layout and MoE router need their own tiny settings",
    "lfm2_moe": "layer-type list (conv/attention) and MoE settings need their own tiny settings",
    "llama4": "composite (vision) config without a top-level `pad_token_id`; the text model is covered by llama4_text",
    "longcat_flash": "MLA head sizes fixed in the default config (192)",
    "musicgen": "composite (text encoder + audio decoder) config; the decoder reads fields of the outer config",
    "musicgen_melody": "composite (text encoder + audio decoder) config; the decoder reads fields of the outer config",
    "qwen3_5": "composite (vision) config without a top-level `vocab_size`; covered by qwen3_5_text",
    "qwen3_5_moe": "composite (vision) config without a top-level `vocab_size`; covered by qwen3_5_moe_text",
    "qwen4_exp": "composite (vision) config without a top-level `vocab_size`",
    "qwen4_exp_text": "linear-attention head sizes unset in the default config",
    "xlnet": "permutation LM: `d_head` must equal `d_model // n_head` and it is not a causal decoder",
    "xlstm": "recurrent (no attention) with fixed inner sizes (4096)",
    "xmod": "needs a language adapter chosen with `set_default_language()` before any forward",
    "zamba": "shared-transformer weight tying keyed to the default layer layout",
    "blt": "byte latent transformer: separate encoder/global/decoder configs with no `num_hidden_layers`; its "
    "default tiny build takes ~50 s before failing",
}

#: Types without attention layers (state-space / recurrent): sparse_k is never called, nothing to check.
NO_ATTENTION = frozenset({"falcon_mamba", "mamba", "mamba2"})

#: Exact size fields (set wherever the config or a sub-config has them as an int).
SIZES = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "embed_dim": 64, "dim": 64, "n_embed": 64,
    "intermediate_size": 96, "ffn_dim": 96, "n_inner": 96, "d_ff": 96, "decoder_ffn_dim": 96,
    "encoder_ffn_dim": 96, "ffn_hidden_size": 96, "d_inner": 96, "inner_hidden_size": 96,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "decoder_attention_heads": 4,
    "encoder_attention_heads": 4, "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2,
    "head_dim": 16, "attention_head_dim": 16, "kv_channels": 16,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_topk": 2, "top_k": 2, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "expert_hidden_size": 32, "moe_ffn_hidden_size": 32,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4,
    "vocab_size": VOCAB, "max_position_embeddings": 256, "n_positions": 256,
    "num_layers": 2, "n_layer": 2, "n_layers": 2, "num_hidden_layers": 2, "decoder_layers": 2,
    "encoder_layers": 2, "num_decoder_layers": 2,
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_d_state": 16, "mamba_chunk_size": 8,
    "intermediate_size_mlp": 96, "rotary_dim": 8,
    "sliding_window": 5, "attention_chunk_size": 5, "window_size": 5,
}

#: Per-type config fields set after shrinking (hybrid layouts that the generic rule cannot keep).
OVERRIDES = {
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "num_hidden_layers": 2, "lru_width": 64,
                        "attention_window_size": 6},
    "bamba": {"attn_layer_indices": [1], "mamba_d_head": 16},
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"], "mamba_d_head": 16},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "mamba_dt_rank": 8},
    "mamba2": {"num_heads": 8, "head_dim": 16, "state_size": 16, "chunk_size": 8},
    "nemotron_h": {"ssm_state_size": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "chunk_size": 8},
    "kolibri1_1": {"layer_types": ["sliding_attention", "indexed_attention"], "num_hidden_layers": 2,
                   "index_layers": [1], "kv_source_layers": [0, 1], "mlp_only_layers": [0], "index_num_heads": 2,
                   "index_topk": 4, "index_pool_size": 8, "index_compression": 2, "index_num_local_tokens": 2,
                   "index_num_sink_tokens": 1},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid", "hybrid"], "num_hidden_layers": 3,
               "hybrid_layer_ids": [1, 2], "mamba_headdim": 16, "n_mamba_heads": 8, "mamba_d_state": 16,
               "attention_hidden_size": 128, "attention_head_dim": 32, "kv_channels": 16, "num_query_groups": 4,
               "chunk_size": 8, "adapter_rank": 8, "num_mem_blocks": 1},
}

#: Layer-count fields (a config with ``layer_types`` keeps one layer per distinct type instead).
LAYER_FIELDS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers", "num_decoder_layers")


def causal_lm_types() -> list[str]:
    """Every model type with a causal-LM class in the installed Transformers, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def model_class(model_type: str):
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def _layer_count(d: dict):
    return next((d[k] for k in LAYER_FIELDS if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)


def _keep_layers(d: dict, n: int) -> list:
    """Layer indices to keep: the first layer of every distinct entry of every per-layer list, at least 2."""
    keep = set()
    for value in d.values():
        if isinstance(value, list) and len(value) == n:
            keep |= {value.index(v) for v in value if isinstance(v, (str, int, float, bool, type(None)))}
    keep = sorted(keep) or [0]
    for i in range(n):
        if len(keep) >= 2:
            break
        if i not in keep:
            keep = sorted(keep + [i])
    return keep


def _shrink_dict(d: dict) -> dict:
    d = dict(d)
    for key, value in list(d.items()):
        if isinstance(value, dict) and ("model_type" in value or key.endswith("config")):
            d[key] = _shrink_dict(value)
    n = _layer_count(d)
    if n is not None and n > 2:
        keep = _keep_layers(d, n)
        for key, value in list(d.items()):
            if isinstance(value, list) and len(value) == n:
                d[key] = [value[i] for i in keep]
            elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
                d[key] = {str(keep.index(int(k))): v for k, v in value.items() if int(k) in keep}
        for key in LAYER_FIELDS:
            if isinstance(d.get(key), int):
                d[key] = len(keep)
    for key, value in list(d.items()):
        if key in LAYER_FIELDS:
            continue
        if key in SIZES and isinstance(value, int) and not isinstance(value, bool):
            d[key] = min(value, SIZES[key])
        elif "vocab_size" in key and isinstance(value, int) and not isinstance(value, bool):
            d[key] = min(value, VOCAB)
    for key in ("head_dim", "num_key_value_heads"):
        if key in d and d[key] is None:
            d[key] = SIZES[key]
    if isinstance(d.get("qk_rope_head_dim"), int) and "head_dim" in d:
        d["head_dim"] = d["qk_rope_head_dim"]
    if isinstance(d.get("kv_lora_rank"), int) and "num_key_value_heads" in d:
        d["num_key_value_heads"] = d.get("num_attention_heads", 4)
    for key in ("num_key_value_heads", "n_kv_heads", "num_kv_heads"):
        if key in d and isinstance(d[key], int) and not isinstance(d.get("kv_lora_rank"), int):
            heads = next((d[h] for h in ("num_attention_heads", "n_head", "n_heads", "num_heads") if isinstance(d.get(h), int)), 4)
            d[key] = 2 if heads % 2 == 0 else 1
    if "is_decoder" in d and not d.get("is_encoder_decoder"):
        d["is_decoder"] = True
    if "use_sliding_window" in d:
        d["use_sliding_window"] = True
        if not d.get("sliding_window"):
            d["sliding_window"] = SIZES["sliding_window"]
        types = d.get("layer_types")
        if isinstance(types, list) and types and set(types) == {"full_attention"}:
            d["layer_types"] = ["sliding_attention"] + types[1:]
    for key, value in list(d.items()):
        if key.endswith("token_id") and isinstance(value, int) and value >= VOCAB:
            d[key] = VOCAB - 1 - (hash(key) % 4)
        elif key.endswith("token_id") and isinstance(value, list):
            d[key] = [v if v < VOCAB else VOCAB - 1 for v in value]
    experts = next((d[k] for k in ("num_experts", "n_routed_experts", "num_local_experts") if isinstance(d.get(k), int)), None)
    for key in ("num_experts_per_tok", "moe_topk", "top_k"):
        if experts is not None and isinstance(d.get(key), int):
            d[key] = min(d[key], experts)
    return d


def tiny_config(model_type: str):
    """The model type's default config shrunk to a tiny model (``attn_implementation`` unset)."""
    cls = CONFIG_MAPPING[model_type]
    base = cls()
    d = _shrink_dict(base.to_dict())
    d.update(OVERRIDES.get(model_type, {}))
    d.pop("transformers_version", None)
    d.pop("_attn_implementation_autoset", None)
    d.pop("architectures", None)
    cfg = cls.from_dict(d)
    cfg.use_cache = True
    return cfg


class CallCounter:
    """Counts calls of the registered ``sparse_k`` attention function (wraps it while active)."""

    def __init__(self):
        self.calls = 0

    def __enter__(self):
        self._orig = transformers.AttentionInterface._global_mapping["sparse_k"]

        def counted(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)

        transformers.AttentionInterface.register("sparse_k", counted)
        return self

    def __exit__(self, *exc):
        transformers.AttentionInterface.register("sparse_k", self._orig)


def build(model_type: str, attn: str, state=None, seed: int = 0):
    """A tiny model in eval mode with ``attn_implementation=attn`` (weights from ``state`` if given)."""
    cfg = tiny_config(model_type)
    if attn == "sparse_k":
        hf_sparse_attention.configure(cfg, "sliding_window", window=4 * SEQ)
    torch.manual_seed(seed)
    model = model_class(model_type)._from_config(cfg, attn_implementation=attn).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB - 8, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :PAD] = 0
    return ids, mask


def _greedy(model, ids, mask, steps=3):
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )
    return out.sequences, torch.stack(out.logits, 1)


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()


class NotBuildable(Exception):
    """The tiny model fails with the model's own attention (sdpa/eager): not a sparse_k result."""


def check_family(model_type: str, atol: float = 2e-4) -> dict:
    """Run the family checks; returns ``{"status": "works"|"refused", ...}`` or raises AssertionError.

    works: a left-padded batch (covering window) equals the reference implementation on every real
    token, greedy cached decode equals the reference's, and cached decode equals recomputation
    under a narrow ``streaming`` pattern with sinks (where the model's own decode equals its recompute).
    """
    ref_attn = "sdpa" if model_class(model_type)._supports_sdpa else "eager"
    ids, mask = _inputs()
    valid = mask.bool()
    try:
        sparse = build(model_type, "sparse_k")
    except ModelNotSupportedError as err:
        return {"status": "refused", "reason": str(err)}
    except Exception:  # noqa: BLE001 - decided below: does the model build with its own attention?
        sparse = None
    try:
        ref = build(model_type, ref_attn)
        want = _logits(ref, ids, mask)
        with torch.no_grad():
            seq_ref, dec_ref = _greedy(ref, ids, mask)
    except Exception as err:  # noqa: BLE001 - any failure of the model's own attention
        raise NotBuildable(f"{model_type} with {ref_attn}: {type(err).__name__}: {err}") from err
    if sparse is None:
        sparse = build(model_type, "sparse_k")
    sparse.load_state_dict(ref.state_dict())
    with CallCounter() as counter:
        got = _logits(sparse, ids, mask)
    diff = (got - want)[valid].abs().max().item()
    assert diff < atol, f"{model_type}: padded batch with a covering window differs from {ref_attn} by {diff:.3g}"
    # Rows whose cached decode equals recomputation under the model's own attention (some models'
    # own decode is not exact with left padding, e.g. recurrent_gemma's sdpa mask): decode is checked there.
    full_mask = torch.cat([mask, torch.ones(2, seq_ref.shape[1] - SEQ, dtype=mask.dtype)], 1)
    own = (_logits(ref, seq_ref, full_mask)[:, SEQ - 1 : -1] - dec_ref.float()).abs().amax((1, 2))
    rows = [b for b in range(2) if own[b] <= atol]
    result = {"status": "works", "ref": ref_attn, "calls": counter.calls, "diff": diff,
              "decode_rows": rows, "own_decode_err": own.tolist()}
    with torch.no_grad():
        seq, dec = _greedy(sparse, ids, mask)
    if not rows:  # same inexact decode plumbing on both sides (roberta-style position ids): compare all rows
        rows = [0, 1]
        result["streaming"] = "skipped: the model's own cached decode differs from recompute on every row"
    assert torch.equal(seq[rows], seq_ref[rows]), f"{model_type}: greedy tokens differ from {ref_attn}"
    ddiff = (dec[rows].float() - dec_ref[rows].float()).abs().max().item()
    assert ddiff < atol, f"{model_type}: cached decode logits differ from {ref_attn} by {ddiff:.3g}"
    result["diff"] = max(diff, ddiff)
    if "streaming" in result:
        return result
    # Decode vs recompute with sinks and a narrow window (absolute positions in the mask path).
    hf_sparse_attention.configure(sparse, "streaming", sinks=2, window=3)
    with torch.no_grad():
        seq_s, dec_s = _greedy(sparse, ids, mask)
        rec = _logits(sparse, seq_s, full_mask)[:, SEQ - 1 : -1]
    sdiff = (dec_s[rows].float() - rec[rows]).abs().max().item()
    assert sdiff < atol, f"{model_type}: streaming cached decode differs from recompute by {sdiff:.3g}"
    return result


def main():
    import sys

    torch.set_num_threads(1)
    types = sys.argv[1:] or causal_lm_types()
    t_all = time.time()
    for mt in types:
        t0 = time.time()
        if mt in NOT_BUILDABLE:
            print(f"{mt:28s} NOT_BUILDABLE {NOT_BUILDABLE[mt]}")
            continue
        try:
            res = check_family(mt)
            msg = f"{res['status']:8s} " + (res.get("reason", "")[:150] if res["status"] == "refused" else
                                             f"calls={res['calls']} diff={res['diff']:.2g} decode_rows={res['decode_rows']}")
        except NotBuildable as e:
            msg = f"NOTBUILD {str(e)[:200]}"
        except AssertionError as e:
            msg = f"FAIL     {str(e)[:200]}"
        except Exception as e:  # noqa: BLE001
            msg = f"ERROR    {type(e).__name__}: {str(e)[:200]}"
        print(f"{mt:28s} {time.time() - t0:5.1f}s {msg}", flush=True)
    print(f"total {time.time() - t_all:.0f}s")


if __name__ == "__main__":
    main()
