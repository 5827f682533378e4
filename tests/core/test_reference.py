"""The exact reference: conventions of design §3 checked against independent computations."""

import pytest
import torch
from conftest import rel_err
from helpers import random_qkv

import sparse_k as sk


def test_dense_causal_equals_sdpa_with_gqa():
    torch.manual_seed(0)
    q, k, v = random_qkv(2, 6, 2, 33, 33, 16, dtype=torch.float64)
    out = sk.sparse_attention(q, k, v, "dense", backend="reference")
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)
    assert rel_err(out, want) < 1e-12


def test_bottom_right_alignment_for_decode():
    torch.manual_seed(1)
    q, k, v = random_qkv(1, 2, 2, 4, 30, 8, dtype=torch.float64)
    out = sk.sparse_attention(q, k, v, "dense", backend="reference")
    mask = torch.ones(4, 30, dtype=torch.bool).tril(diagonal=26)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert rel_err(out, want) < 1e-12


def test_sink_logits_join_the_denominator_once():
    torch.manual_seed(2)
    q, k, v = random_qkv(1, 2, 1, 5, 5, 8, dtype=torch.float64)
    sink = torch.randn(2, dtype=torch.float64)
    out, lse = sk.sparse_attention(q, k, v, "dense", sink_logits=sink, backend="reference", return_lse=True)
    s = (q @ k.transpose(-1, -2)) * 8**-0.5
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    full = torch.cat([s, sink.view(1, 2, 1, 1).expand(1, 2, 5, 1)], -1)
    p = full.softmax(-1)[..., :5]
    assert rel_err(out, p @ v) < 1e-12
    assert torch.allclose(lse, full.logsumexp(-1))


def test_softcap_is_applied_to_the_logits():
    torch.manual_seed(3)
    q, k, v = random_qkv(1, 1, 1, 6, 6, 4, dtype=torch.float64)
    q = q * 10
    out = sk.sparse_attention(q, k, v, "dense", softcap=2.0, backend="reference")
    s = 2.0 * torch.tanh((q @ k.transpose(-1, -2)) * 0.5 / 2.0)
    s = s.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    assert rel_err(out, s.softmax(-1) @ v) < 1e-12


def test_fully_masked_rows_give_zeros_and_minus_infinity():
    q, k, v = random_qkv(2, 1, 1, 3, 7, 4)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1] = False
    out, lse = sk.sparse_attention(q, k, v, "dense", attention_mask=mask, backend="reference", return_lse=True)
    assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()
    assert torch.isfinite(out).all()


def test_left_padding_counts_sinks_from_the_first_valid_key():
    torch.manual_seed(4)
    q, k, v = random_qkv(1, 2, 1, 12, 12, 8)
    p = sk.Streaming(sinks=2, window=3)
    alone = sk.sparse_attention(q, k, v, p, backend="reference")
    pad = 5
    qp = torch.cat([torch.randn(1, 2, pad, 8), q], 2)
    kp = torch.cat([torch.randn(1, 1, pad, 8), k], 2)
    vp = torch.cat([torch.randn(1, 1, pad, 8), v], 2)
    mask = torch.ones(1, 12 + pad, dtype=torch.bool)
    mask[:, :pad] = False
    padded = sk.sparse_attention(qp, kp, vp, p, attention_mask=mask, backend="reference")
    assert rel_err(padded[:, :, pad:], alone) < 1e-6


def test_reference_gradients_exist_for_fully_masked_rows():
    q, k, v = random_qkv(1, 1, 1, 4, 4, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[False, False, True, True]])
    out = sk.sparse_attention(q, k, v, "dense", attention_mask=mask, backend="reference")
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_return_their_dtype(dtype):
    q, k, v = random_qkv(1, 2, 1, 9, 9, 8, dtype=dtype)
    for backend in ("reference", "torch"):
        out = sk.sparse_attention(q, k, v, "streaming", backend=backend)
        assert out.dtype == dtype and torch.isfinite(out).all()
