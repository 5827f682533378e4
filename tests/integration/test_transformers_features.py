"""Model features through ``attn_implementation="sparse_k"``: gpt-oss sink logits, Gemma2 softcapping,
chunked attention, packed batches, configuration round trip, switching implementations, errors."""

from __future__ import annotations

import pytest
import torch

import hf_sparse_attention
from hf_sparse_attention.integration import key_mask
from sparse_k import get_pattern, masked_attention, row_geometry
from sparse_k.integrations.transformers_adapter import WithinChunk, attention_forward, restrict_pattern
from tiny_models import VOCAB, one_thread, reference_logits, sparse_logits, tiny_model  # noqa: F401

transformers = pytest.importorskip("transformers")


def _common():
    return dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    )


def _eager_vs_sparse(model, ids, window):
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(ids).logits
    out = sparse_logits(model, ids, "sliding_window", {"window": window})
    return eager, out


def test_gpt_oss_sink_logits_and_sliding_layers():
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        **_common(), head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=12,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = transformers.GptOssForCausalLM(cfg).eval()
    for layer in model.model.layers:
        layer.self_attn.sinks.data.normal_(0, 2)  # random s_aux so they matter
    ids = torch.randint(0, VOCAB, (2, 37))
    eager, out = _eager_vs_sparse(model, ids, 37)
    assert (out - eager).abs().max() < 1e-4
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.zero_()
        without_sinks = model(ids).logits
    assert (without_sinks - out).abs().max() > 1e-3


def test_gemma2_softcapping_and_scaling():
    torch.manual_seed(1)
    cfg = transformers.Gemma2Config(
        **_common(), head_dim=16, query_pre_attn_scalar=9, attn_logit_softcapping=2.0, sliding_window=10,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    ids = torch.randint(0, VOCAB, (2, 29))
    eager, out = _eager_vs_sparse(model, ids, 29)
    assert (out - eager).abs().max() < 1e-4
    narrow = sparse_logits(model, ids, "streaming", {"sinks": 2, "window": 5})
    assert (narrow - eager).abs().max() > 1e-3


class _Layer(torch.nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx


def test_chunked_layers_stay_in_their_chunk():
    """Llama 4 style: ``layer_types[i] == "chunked_attention"`` restricts the pattern to the chunk."""
    config = transformers.PretrainedConfig()
    config.layer_types = ["chunked_attention", "full_attention"]
    config.attention_chunk_size = 8
    config.sparse_attention = {"pattern": "streaming", "sinks": 2, "window": 5}
    B, Hq, Hkv, S, D = 2, 4, 2, 27, 16
    q, k, v = torch.randn(B, Hq, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    for layer_idx, chunk in ((0, 8), (1, None)):
        out, weights = attention_forward(_Layer(config, layer_idx), q, k, v, None, scaling=0.3)
        assert weights is None and out.shape == (B, S, Hq, D)
        pos = torch.arange(S)
        qpos, kpos = pos[:, None], pos[None, :]
        mask = get_pattern("streaming", sinks=2, window=5).allowed(qpos, kpos)
        if chunk is not None:
            mask = mask & (qpos // chunk == kpos // chunk)
        ref, _ = masked_attention(q, k, v, mask, scale=0.3)
        assert (out - ref.float().transpose(1, 2)).abs().max() < 1e-5
    assert isinstance(restrict_pattern(get_pattern("streaming", sinks=2, window=5), chunk=8), WithinChunk)


@pytest.mark.parametrize("rule", ["window", "chunk"])
@pytest.mark.parametrize("sparse", [
    {"pattern": "streaming", "sinks": 2, "window": 5},
    {"pattern": "block_diagonal", "block": 6},
    {"pattern": "bigbird", "block": 4, "window_blocks": 1, "global_blocks": 1, "random_blocks": 2, "seed": 3},
    {"pattern": "dense"},
])
@pytest.mark.parametrize("q_len", [1, 3])
def test_kept_keys_of_a_sliding_cache_attend_at_their_absolute_slots(rule, sparse, q_len):
    """A sliding cache that dropped the first ``L - Skv`` slots (the key mask covers all ``L``): inside the model's
    window or chunk, a pattern with absolute parts (sinks, blocks, chunks) attends the kept keys as it would the whole
    tensor (``FromSlot``, no K/V rebuilt to the length), for an unpadded batch; a padded batch still equals it."""
    config = transformers.PretrainedConfig()
    config.sparse_attention = sparse
    if rule == "chunk":
        config.layer_types, config.attention_chunk_size, sliding_window, keep = ["chunked_attention"], 16, None, 16
    else:
        sliding_window, keep = 16, 16
    B, Hq, Hkv, L, D = 2, 4, 2, 53, 16
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(B, Hq, q_len, D, generator=g), torch.randn(B, Hkv, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g)
    skv = keep - 1 + q_len  # what Transformers' sliding layer returns: its window - 1 kept keys and the new ones
    layer = _Layer(config, 0)
    want, _ = attention_forward(layer, q, k, v, None, scaling=0.3, sliding_window=sliding_window)
    every_slot = torch.ones(B, L, dtype=torch.bool)
    got, _ = attention_forward(layer, q, k[:, :, -skv:], v[:, :, -skv:], every_slot, scaling=0.3,
                               sliding_window=sliding_window)
    assert (got - want).abs().max() < 1e-5
    padded = every_slot.clone()
    padded[1, :3] = False  # row 1 starts 3 slots later: its positions shift, so compare with its own full-key call
    want_padded, _ = attention_forward(layer, q, k, v, padded, scaling=0.3, sliding_window=sliding_window)
    got_padded, _ = attention_forward(layer, q, k[:, :, -skv:], v[:, :, -skv:], padded, scaling=0.3,
                                      sliding_window=sliding_window)
    assert (got_padded - want_padded).abs().max() < 1e-5


def test_packed_batch_equals_sequences_one_by_one():
    model = tiny_model("llama", seed=14)
    lengths = [11, 23, 7]
    seqs = [torch.randint(1, VOCAB, (n,)) for n in lengths]
    features = [{"input_ids": s.tolist()} for s in seqs]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=6)
    model.set_attn_implementation("sparse_k")
    kwargs = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    with torch.no_grad():
        packed = model(batch["input_ids"], position_ids=batch["position_ids"], **kwargs).logits[0]
        from_positions = model(batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        singles = torch.cat([model(s[None]).logits[0] for s in seqs])
    assert (packed - singles).abs().max() < 1e-4
    assert (from_positions - singles).abs().max() < 1e-4


@pytest.mark.parametrize("shared_positions", [False, True])
def test_rows_of_packed_sequences_equal_sdpa(shared_positions):
    """Several rows, each holding several sequences whose ``position_ids`` restart at 0 (no mask, no cache: packing
    for training): Transformers' sdpa separates the sequences of every row, and so does ``"sparse_k"`` (the rows run as
    one varlen call); one row of positions may stand for every row."""
    model = tiny_model("llama", seed=17)
    ids = torch.randint(1, VOCAB, (2, 12))
    if shared_positions:
        position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    else:
        position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = model(ids, position_ids=position_ids, use_cache=False).logits
        hf_sparse_attention.configure(model, "sliding_window", window=64)  # covers every key: dense here
        got = model(ids, position_ids=position_ids, use_cache=False).logits
        singles = model(ids[:1, 5:], use_cache=False).logits[0]
    assert (got - want).abs().max() < 1e-4
    assert (got[0, 5:] - singles).abs().max() < 1e-4


def test_packing_is_read_from_position_ids_once_per_forward(monkeypatch):
    """Every layer gets the forward's one ``position_ids`` tensor: the packed-sequence starts are read on the
    host once per forward (a synchronisation per layer would stall the GPU queue), and a new or modified
    tensor is read again."""
    from sparse_k.integrations import transformers_adapter as adapter

    model = tiny_model("llama", seed=16)
    assert model.config.num_hidden_layers > 1
    hf_sparse_attention.configure(model, "streaming", sinks=2, window=6)
    model.set_attn_implementation("sparse_k")
    reads = []
    read = adapter._packed_starts._read
    monkeypatch.setattr(adapter._packed_starts, "_read", lambda *a: reads.append(1) or read(*a))
    ids = torch.randint(1, VOCAB, (1, 20))
    position_ids = torch.cat([torch.arange(12), torch.arange(8)])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids).logits[0]
        assert len(reads) == 1
        model(ids, position_ids=position_ids.clone())
        assert len(reads) == 2
        position_ids[0, 12:] = torch.arange(12, 20)  # one sequence now: the modified tensor is read again
        whole = model(ids, position_ids=position_ids).logits[0]
        assert len(reads) == 3
        singles = torch.cat([model(ids[:, :12]).logits[0], model(ids[:, 12:]).logits[0]])
    assert (packed - singles).abs().max() < 1e-4
    assert (whole - model(ids).logits[0]).abs().max() < 1e-4


def test_configuration_round_trips_and_is_settable_before_loading(tmp_path):
    model = tiny_model("llama", seed=15)
    written = hf_sparse_attention.configure(
        model, "bigbird", block=4, random_blocks=1, layers={1: {"pattern": "sliding_window", "window": 5}}
    )
    assert model.config.sparse_attention == written
    model.save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert config.sparse_attention == written
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sparse_k").eval()
    assert loaded.config._attn_implementation == "sparse_k"
    ids = torch.randint(0, VOCAB, (1, 30))
    model.set_attn_implementation("sparse_k")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    # Before loading: through the config.
    config.sparse_attention = {"pattern": "sliding_window", "window": 3}
    other = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, config=config, attn_implementation="sparse_k")
    with torch.no_grad():
        narrow = other.eval()(ids).logits
    ref = reference_logits(other, ids, get_pattern("sliding_window", window=3))
    assert (narrow - ref).abs().max() < 1e-4


def test_switching_implementations_back_and_forth():
    model = tiny_model("mistral", seed=16)
    ids = torch.randint(0, VOCAB, (1, 40))
    with torch.no_grad():
        sdpa = model(ids).logits
    narrow = sparse_logits(model, ids, "sliding_window", {"window": 4})
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        again = model(ids).logits
    assert (narrow - sdpa).abs().max() > 1e-3
    assert torch.equal(again, sdpa)


def test_default_pattern_is_sparse_k_with_fallback():
    model = tiny_model("llama", seed=17)
    model.config.sparse_attention = None
    model.set_attn_implementation("sparse_k")
    with torch.no_grad():
        out = model(torch.randint(0, VOCAB, (1, 20))).logits
    assert torch.isfinite(out).all()


def test_clear_errors():
    model = tiny_model("llama", seed=18)
    hf_sparse_attention.configure(model, "sliding_window", window=4)
    model.set_attn_implementation("sparse_k")
    ids = torch.randint(0, VOCAB, (1, 6))
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="unknown"):
        hf_sparse_attention.configure(model, "no_such_pattern")
    with pytest.raises(ValueError, match="window"):
        hf_sparse_attention.configure(model, "sliding_window", window=0)
    with pytest.raises(TypeError, match="model or config"):
        hf_sparse_attention.configure(object(), "dense")
    layer = _Layer(model.config, 0)
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match="key mask"):
        attention_forward(layer, q, k, k, torch.ones(1, 3, 3, dtype=torch.bool))
    layer.is_causal = False
    with pytest.raises(ValueError, match="causal"):
        attention_forward(layer, q, k, k, None)


def test_mask_function_returns_2d_or_none():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    # Prefill without padding: nothing to say.
    assert key_mask(2, 4, 4, 0, 0, attention_mask=torch.ones(2, 4)) is None
    # Padding: the 2-D mask itself.
    out = key_mask(2, 4, 4, 0, 0, attention_mask=mask)
    assert out.dtype == torch.bool and torch.equal(out, mask.bool())
    # StaticCache of 10 slots (a tensor q_offset), 4 written + 1 new: every slot, as a uint8 slot mask
    # (built on the device, static shape), 1 where a slot is written and not padding.
    grown = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    out = key_mask(2, 1, 10, torch.tensor(4), 0, attention_mask=grown)
    expect = torch.cat([grown.bool(), torch.zeros(2, 5, dtype=torch.bool)], 1)
    assert out.dtype == torch.uint8 and torch.equal(out.bool(), expect)
    out = key_mask(2, 1, 10, torch.tensor(4), 0, attention_mask=None)
    assert out.dtype == torch.uint8 and torch.equal(out.bool(), (torch.arange(10) < 5).expand(2, 10))
    # An int q_offset (no tensor) keeps the written slots only.
    assert key_mask(2, 1, 10, 4, 0, attention_mask=None).shape == (2, 5)
    # Sliding cache that dropped 3 slots: the mask covers the absolute slots.
    out = key_mask(2, 1, 5, 7, 3, attention_mask=torch.ones(2, 8))
    assert out.shape == (2, 8)


def test_4d_mask_is_reduced_to_key_validity():
    """The hub route: an SDPA 4-D mask (StaticCache, left padding) equals the 2-D call."""
    config = transformers.PretrainedConfig()
    config.sparse_attention = {"pattern": "streaming", "sinks": 1, "window": 3}
    layer = _Layer(config, 0)
    B, S, L, D = 2, 2, 9, 16
    q, k, v = torch.randn(B, 4, S, D), torch.randn(B, 2, 12, D), torch.randn(B, 2, 12, D)
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[1, :2] = False
    geo = row_geometry(B, S, L, valid)
    qpos, kpos = geo.q_positions(S)[:, None, :, None], geo.k_positions(12)[:, None, None, :]
    four_d = (kpos <= qpos) & (kpos >= 0) & (torch.arange(12) < L)
    out4, _ = attention_forward(layer, q, k, v, four_d, scaling=0.25)
    out2, _ = attention_forward(layer, q, k, v, valid, scaling=0.25)
    assert (out4 - out2).abs().max() < 1e-6


def test_user_4d_mask_of_a_padded_batch_equals_the_2d_mask():
    """A caller's own 4-D causal mask of a left-padded batch runs as its 2-D padding mask, also in the form of
    Transformers' older SDPA helper, which unmasks the padding queries (``_unmask_unattended``: their rows attend
    every slot, padding included); the padding keys must stay out."""
    model = tiny_model("mistral", seed=23)  # sliding layers too: the layer's own window is applied as with 2-D
    hf_sparse_attention.configure(model, "streaming", sinks=1, window=6)
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    allowed = torch.ones(12, 12, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    four_d = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    # AttentionMaskConverter._unmask_unattended (Transformers' older SDPA masks): rows that attend nothing attend all
    unmasked = torch.where(allowed.any(-1, keepdim=True), four_d, 0.0)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits[mask.bool()]
        for m4 in (four_d, unmasked, unmasked == 0):
            got = model(ids, attention_mask=m4).logits[mask.bool()]
            assert (got - want).abs().max() < 1e-5


def test_user_4d_integer_mask_reads_one_as_attend():
    """A caller's 4-D mask of integers reads 1 as attend, as the 2-D mask and the hub route's sdpa mask do (not a
    ``torch.finfo`` TypeError from inside the adapter); a per-query structure is still refused."""
    model = tiny_model("llama", seed=25)
    hf_sparse_attention.configure(model, "streaming", sinks=1, window=6)
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    allowed = torch.ones(12, 12, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits[mask.bool()]
        for dtype in (torch.long, torch.int32, torch.uint8):
            got = model(ids, attention_mask=allowed.to(dtype)).logits[mask.bool()]
            assert (got - want).abs().max() < 1e-5
        block = allowed.clone()
        block[..., 8:, :6] = False
        with pytest.raises(ValueError, match="hides earlier keys from some queries"):
            model(ids, attention_mask=block.long())


def test_user_4d_mask_with_per_query_structure_is_refused():
    """A 4-D mask that hides earlier keys from some queries (two packed documents) or shows later ones cannot be
    reduced to key validity: ValueError, instead of attending across the documents without a word."""
    model = tiny_model("llama", seed=24)
    hf_sparse_attention.configure(model, "sliding_window", window=64)
    ids = torch.randint(0, VOCAB, (1, 12))
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    doc = (torch.arange(12) >= 5).long()
    packed = ((j <= i) & (doc[:, None] == doc[None, :]))[None, None]
    with torch.no_grad(), pytest.raises(ValueError, match="hides earlier keys from some queries"):
        model(ids, attention_mask=packed)
    with torch.no_grad(), pytest.raises(ValueError, match="hides earlier keys from some queries"):
        model(ids, attention_mask=torch.where(packed, 0.0, torch.finfo(torch.float32).min))
    with torch.no_grad(), pytest.raises(ValueError, match="later keys"):
        model(ids, attention_mask=torch.ones(1, 1, 12, 12, dtype=torch.bool))
    model.set_attn_implementation("sdpa")  # the alternative the message names runs it
    with torch.no_grad():
        model(ids, attention_mask=packed)


@pytest.mark.parametrize("family, checks", [("llama", 1), ("gemma3", 2)])
def test_callers_4d_mask_is_checked_once_per_forward(family, checks, monkeypatch):
    """Transformers hands a caller's 4-D mask to every layer as it is: its reduction to key validity and the check
    that it is the causal rule (``(B, 1, Sq, L)`` temporaries, host reads) run once per mask tensor and layer window
    (gemma3: a sliding and a global layer, two checks), not once per layer. A new mask, or the same tensor changed in
    place, is checked again: a mask given per-query structure in place still raises."""
    from sparse_k.integrations import transformers_adapter as adapter

    model = tiny_model(family, seed=25, layers=4)
    hf_sparse_attention.configure(model, "streaming", sinks=1, window=6)
    model.set_attn_implementation("sparse_k")
    calls, check = [], adapter._check_causal_4d
    monkeypatch.setattr(adapter, "_check_causal_4d", lambda *a: calls.append(1) or check(*a))
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    four_d = torch.ones(12, 12, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits[mask.bool()]
        got = model(ids, attention_mask=four_d).logits[mask.bool()]
        assert len(calls) == checks
        assert (got - want).abs().max() < 1e-5
        model(ids, attention_mask=four_d.clone())
        assert len(calls) == 2 * checks
        four_d[0, 0, 8:, :5] = False  # row 0 now holds two packed documents
        with pytest.raises(ValueError, match="hides earlier keys from some queries"):
            model(ids, attention_mask=four_d)


@pytest.mark.parametrize("family, masks", [("llama", 1), ("gemma3", 2)])
def test_masks_are_read_once_per_forward_under_inference_mode(family, masks, monkeypatch):
    """Under ``torch.inference_mode()`` the masks the layers get are inference tensors, which have no version counter:
    still, the host reads of a padded batch's key mask and the reduction of a caller's 4-D mask run once per mask
    tensor and forward (llama: one mask; gemma3: a sliding and a global one), not once per layer. A 4-D mask changed in
    place between two forwards (inside inference mode) is read again: given per-query structure, it raises."""
    from sparse_k.integrations import transformers_adapter as adapter

    model = tiny_model(family, seed=26, layers=4)
    hf_sparse_attention.configure(model, "streaming", sinks=1, window=6)
    model.set_attn_implementation("sparse_k")
    key_reads, checks = [], []
    read, check = adapter._all_valid._read, adapter._check_causal_4d
    monkeypatch.setattr(adapter._all_valid, "_read", lambda *a: key_reads.append(1) or read(*a))
    monkeypatch.setattr(adapter, "_check_causal_4d", lambda *a: checks.append(1) or check(*a))
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    with torch.inference_mode():
        want = model(ids, attention_mask=mask).logits[mask.bool()]
        assert len(key_reads) == masks
        four_d = torch.ones(12, 12, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
        assert four_d.is_inference()
        got = model(ids, attention_mask=four_d).logits[mask.bool()]
        assert len(checks) == masks
        assert (got - want).abs().max() < 1e-5
        model(ids, attention_mask=four_d)
        assert len(checks) == 2 * masks
        four_d[0, 0, 8:, :5] = False  # row 0 now holds two packed documents
        with pytest.raises(ValueError, match="hides earlier keys from some queries"):
            model(ids, attention_mask=four_d)


def test_alternating_layer_types_read_each_mask_once_per_forward(monkeypatch):
    """Gemma-3-style models alternate sliding and global layers, each type with its own key mask tensor: a padded
    batch's masks are read on the host once per mask tensor and forward (two reads), not at every switch of layer
    type (six layers: six reads), with or without inference mode."""
    from sparse_k.integrations import transformers_adapter as adapter

    model = tiny_model("gemma3", seed=27, layers=6, layer_types=["sliding_attention", "full_attention"] * 3)
    hf_sparse_attention.configure(model, "streaming", sinks=1, window=6)
    reads, read = [], adapter._all_valid._read
    monkeypatch.setattr(adapter._all_valid, "_read", lambda mask: reads.append(mask) or read(mask))
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    for mode in (torch.no_grad, torch.inference_mode):
        reads.clear()
        with mode():
            model(ids, attention_mask=mask)
        assert len(reads) == len({id(m) for m in reads}) == 2, mode.__name__


def test_configure_rejects_unknown_backend_and_layers_outside_the_model():
    model = tiny_model("llama", seed=19, layers=3)
    before = getattr(model.config, "sparse_attention", None)
    with pytest.raises(ValueError, match=r"'trition' is unknown; available: \['auto', 'reference', 'torch'"):
        hf_sparse_attention.configure(model, "streaming", backend="trition")
    with pytest.raises(ValueError, match=r"`dense_layers` names layer\(s\) \[3, 100\], but the model has 3 layers \(indices 0..2\)"):
        hf_sparse_attention.configure(model, "streaming", dense_layers=[0, 100, 3])
    with pytest.raises(ValueError, match=r"`layers` names layer\(s\) \[7\]"):
        hf_sparse_attention.configure(model, "streaming", layers={7: "dense"})
    with pytest.raises(ValueError, match=r"dense_layers'\] must hold layer indices >= 0, got \[-1\]"):
        hf_sparse_attention.configure(model, "streaming", dense_layers=[-1])
    with pytest.raises(ValueError, match="backend"):
        hf_sparse_attention.configure(model.config, backend=3)
    assert getattr(model.config, "sparse_attention", None) == before  # nothing written on failure
    assert model.config._attn_implementation == "sdpa"  # nor switched
    written = hf_sparse_attention.configure(model, "streaming", sinks=1, window=3, dense_layers=[2], backend="torch")
    assert written["dense_layers"] == [2] and written["backend"] == "torch"


def test_configure_switches_a_dense_model_to_sparse_k():
    """``configure`` on a model loaded with sdpa/eager runs the pattern at once (it used to be ignored)."""
    ids = torch.randint(0, VOCAB, (1, 30))
    for attn in ("sdpa", "eager"):
        model = tiny_model("llama", seed=20, attn=attn)
        with torch.no_grad():
            dense = model(ids).logits
        hf_sparse_attention.configure(model, "sliding_window", window=3)
        assert model.config._attn_implementation == "sparse_k"
        with torch.no_grad():
            narrow = model(ids).logits
        ref = reference_logits(model, ids, get_pattern("sliding_window", window=3))
        assert (narrow - ref).abs().max() < 1e-4
        assert (narrow - dense).abs().max() > 1e-3
        model.set_attn_implementation(attn)  # and back
        with torch.no_grad():
            assert torch.equal(model(ids).logits, dense)
    config = tiny_model("llama", seed=20).config
    hf_sparse_attention.configure(config, "sliding_window", window=3)  # a config: nothing to switch
    assert config._attn_implementation == "sdpa"


def test_mask_function_counts_slots_from_the_padding_mask_when_asked_a_keyless_layer():
    """RecurrentGemma decodes with q_offset=0, kv_length=1 (its layer 0 is recurrent): the 2-D mask,
    which covers every token seen, gives the slots; a consistent call is unchanged."""
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :3] = 0
    out = key_mask(2, 1, 1, 0, 0, attention_mask=mask)
    assert out.shape == (2, 13) and torch.equal(out, mask.bool())
    assert key_mask(2, 1, 13, 12, 0, attention_mask=torch.ones(2, 13)) is None
    # Prefix-tuning style: no cache, kv_length = the longer mask's length: the slots written so far, as before.
    assert key_mask(2, 4, 6, 0, 0, attention_mask=torch.ones(2, 6)).shape == (2, 4)


def _random_qkv(seed, sq=7, skv=7):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, sq, 16, generator=g), torch.randn(1, 2, skv, 16, generator=g),
            torch.randn(1, 2, skv, 16, generator=g))


def test_attention_mask_by_keyword_equals_positional():
    config = transformers.PretrainedConfig()
    config.sparse_attention = {"pattern": "streaming", "sinks": 1, "window": 3}
    layer = _Layer(config, 0)
    q, k, v = _random_qkv(1)
    valid = torch.ones(1, 7, dtype=torch.bool)
    valid[0, :2] = False
    a, _ = attention_forward(layer, q, k, v, valid)
    b, _ = attention_forward(layer, q, k, v, attention_mask=valid)
    assert torch.equal(a, b)
    with pytest.raises(TypeError, match="attention_mask"):
        attention_forward(layer, q, k, v, valid, attention_mask=valid)


def test_window_kept_on_the_module_or_config_applies_when_not_passed():
    """PhiMoE/Qwen2-MoE do not pass sliding_window=: the module's (or config's) window applies;
    an explicit None (a global layer) and Moshi's ignored config window do not."""
    config = transformers.PretrainedConfig()
    config.sparse_attention = {"pattern": "dense"}
    q, k, v = _random_qkv(2, 9, 9)
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    want = masked_attention(q, k, v, (j <= i) & (i - j < 3), scale=0.25)[0].transpose(1, 2)
    dense = masked_attention(q, k, v, j <= i, scale=0.25)[0].transpose(1, 2)
    layer = _Layer(config, 0)
    layer.sliding_window = 3
    assert (attention_forward(layer, q, k, v, None)[0] - want).abs().max() < 1e-5
    assert (attention_forward(layer, q, k, v, None, sliding_window=None)[0] - dense).abs().max() < 1e-5
    config.sliding_window = 3  # no module attribute: the config's window
    assert (attention_forward(_Layer(config, 0), q, k, v, None)[0] - want).abs().max() < 1e-5
    config.model_type = "moshi"
    assert (attention_forward(_Layer(config, 0), q, k, v, None)[0] - dense).abs().max() < 1e-5


def test_shared_layer_runs_layer_zero_and_refuses_per_layer_settings():
    config = transformers.PretrainedConfig()
    config.sparse_attention = {"pattern": "streaming", "sinks": 1, "window": 3}
    q, k, v = _random_qkv(3)
    shared, first = _Layer(config, -1), _Layer(config, 0)
    assert torch.equal(attention_forward(shared, q, k, v, None)[0], attention_forward(first, q, k, v, None)[0])
    config.sparse_attention = {"pattern": "streaming", "sinks": 1, "window": 3, "dense_layers": [1]}
    with pytest.raises(ValueError, match="layer_idx=-1"):
        attention_forward(shared, q, k, v, None)


def test_mask_function_refuses_a_bidirectional_overlay():
    """Gemma 3 image blocks / prefix-LM prompts let tokens see later tokens: sparse_k (causal) refuses."""
    from transformers.masking_utils import blockwise_overlay, causal_mask_function, or_masks

    blocks = torch.tensor([[-1, 0, 0, 0, -1, -1], [-1, -1, -1, -1, -1, -1]])
    with pytest.raises(ValueError, match="later tokens"):
        key_mask(2, 6, 6, 0, 0, mask_function=or_masks(causal_mask_function, blockwise_overlay(blocks)))
    assert key_mask(2, 6, 6, 0, 0, mask_function=causal_mask_function) is None
    text_only = torch.full((2, 6), -1)
    assert key_mask(2, 6, 6, 0, 0, mask_function=or_masks(causal_mask_function, blockwise_overlay(text_only))) is None


def test_a_forward_builds_the_selection_geometry_once_for_all_layers(monkeypatch):
    """Every layer of a prefill shares the call's query blocks and candidate ranges (built once, not per layer); the
    logits equal those of a forward that builds them in every layer."""
    from sparse_k.layouts import host_memo as hm
    from sparse_k.selection import selectors

    model = tiny_model("llama", layers=3)
    hf_sparse_attention.configure(model, "sparse_k", shipped_selectors=False, sinks=2, window=8, top_k=8, query_block=4)
    model.set_attn_implementation("sparse_k")
    ids = torch.randint(0, VOCAB, (1, 45))
    calls = []
    build = selectors._block_candidates
    monkeypatch.setattr(selectors, "_block_candidates", lambda *a: calls.append(1) or build(*a))
    monkeypatch.setattr(hm, "_MEMO", type(hm._MEMO)())
    with torch.no_grad():
        shared = model(ids, use_cache=False).logits
    assert len(calls) == 1
    monkeypatch.setattr(hm, "_keepable", lambda device: False)
    with torch.no_grad():
        rebuilt = model(ids, use_cache=False).logits
    assert len(calls) == 4
    torch.testing.assert_close(shared, rebuilt, rtol=0, atol=0)
