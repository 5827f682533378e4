"""The Hopper CUDA token-layout decode (``sparse_k.attention.cuda.decode``) against the exact float64 reference.

GPU tests (``gpu`` marker) need an sm_90 device and nvcc; they build the extension on first use.
Tolerance: relative Frobenius error as ``test_cuda_token`` (bf16 inputs 2e-2, fp16 4e-3: the kernel
keeps scores, probabilities and P V in float32, so the error is the inputs' rounding only; a wrong
gathered row, mask or bias gives O(1)); the LSE to 1e-3 absolute (float32 sums over <= 10K keys).
The selections are random (unsorted, distinct) key lists over all positions, so they hold keys inside
the window and the sinks (counted once) and slots past the count, which the kernel must drop.
"""

import time

import pytest
import sparse_k
import torch
from helpers import needs_sm90, random_slots, rel_err
from sparse_k import get_pattern, reference_attention, row_geometry
from sparse_k.attention import plan
from sparse_k.attention.cuda import decode as cd
from sparse_k.layouts import geometry

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}



def _selection(B, Hkv, S, QB, K, NB, weights, g, full=False):
    """Random distinct keys per (row, KV head, block); ``NB`` blocks ending at the decode query's
    block (``first_block`` per row); counts in [0, K] (all K with ``full``); weights in [0, 1) with
    about a tenth exactly 0 (ignored slots)."""
    idx, cnt, w = random_slots(B, Hkv, NB, S, K, weights, g, full)
    qblock = (S - 1) // QB
    first = qblock - torch.randint(0, min(NB, qblock + 1), (B,), device="cuda", generator=g)
    return sparse_k.TokenLayout(idx, cnt, QB, first.to(torch.int64), w)


CASES = [  # B, Hq, Hkv, S, dtype, sinks, window, QB, K, NB, weights
    (3, 8, 2, 1001, torch.bfloat16, 0, 1, 128, 300, 1, False),
    (2, 8, 2, 3001, torch.float16, 64, 512, 256, 300, 3, True),
    (2, 32, 4, 1500, torch.bfloat16, 4, 100, 128, 128, 2, True),
    (1, 2, 1, 77, torch.float16, 0, 16, 128, 40, 1, False),
    (2, 8, 1, 2100, torch.bfloat16, 130, 300, 64, 700, 4, False),
    (1, 4, 4, 9000, torch.bfloat16, 3, 1, 128, 2048, 1, True),
    (17, 16, 4, 3001, torch.bfloat16, 0, 1, 128, 1500, 1, False),  # 68 (row, head) pairs: one split, 12 tiles a warp
    (8, 32, 8, 5000, torch.float16, 0, 1, 128, 2048, 1, True),  # the benchmark's shape class: 2 splits of 1025 keys
    (5, 16, 4, 4000, torch.bfloat16, 4, 64, 128, 1000, 2, True),  # 20 (row, head) pairs on an H100: 6 splits
    (17, 8, 4, 9001, torch.float16, 0, 700, 128, 3000, 1, True),  # one split of 3700 keys: two batches a CTA
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-S{c[3]}-{str(c[4])[6:]}-s{c[5]}-W{c[6]}-QB{c[7]}-K{c[8]}-NB{c[9]}-w{int(c[10])}")
@pytest.mark.parametrize("merge", ["cluster", "fused", "kernel"])
def test_matches_reference(case, merge):
    """Poisoned outputs, fresh random inputs, both static parts (sinks 0: sliding_window and streaming
    are one rule), GQA 1..8, odd S, counts below K, weights with zeros, the three split merges
    (thread-block cluster, last CTA to arrive, second kernel)."""
    B, Hq, Hkv, S, dtype, sinks, window, QB, K, NB, weights = case
    seed = time.time_ns() % 2**31
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, 1, 128, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(B, Hkv, S, 128, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    sel = _selection(B, Hkv, S, QB, K, NB, weights, g)
    p = get_pattern("sparse_k", sinks=sinks, window=window, top_k=K, query_block=QB)
    scale = 128 ** -0.5
    geo = row_geometry(B, 1, S, None, device="cuda")
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), p, geo, scale=scale, selection=sel)
    fused = merge == "fused"
    counters = torch.zeros(B * Hkv + 3, dtype=torch.int32, device="cuda") if fused else None
    for pid in ((1, 2) if sinks == 0 else (2,)):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((B, Hq, 1), float("nan"), device="cuda")
        for _ in range(2):  # the second call checks that the counters were left at zero
            o, l = cd.cuda_decode_forward(q, k, v, sel, pattern_id=pid, window=window, sinks=sinks, scale=scale,
                                          counters=counters, cluster=merge == "cluster")
            out.copy_(o)
            lse.copy_(l)
            assert not out.isnan().any() and not lse.isnan().any(), seed
            assert rel_err(out, ref) < TOL[dtype], (seed, pid)
            assert float((lse.double() - ref_lse).abs().max()) < 1e-3, (seed, pid)
        if fused:
            assert int(counters.abs().sum()) == 0


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("grad", [False, True])
def test_dispatch_takes_decode(monkeypatch, grad):
    """``sparse_attention`` (Triton backend) on a decode step runs the CUDA decode kernel, eagerly and
    through the custom op (``grad``: q requires grad, so the call goes through the op, whose
    ``plain_geo`` flag carries the bottom-right geometry), with a selection expanded over rows and
    heads (stride 0, as the benchmark's), and matches the reference; ``SPARSE_K_CUDA=0``, a
    mid-sequence query and a non-128 head dim stay off the kernel."""
    B, Hq, Hkv, S, D, QB, K = 4, 32, 8, 5003, 128, 128, 1024
    seed = time.time_ns() % 2**31
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(grad)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    one = _selection(1, 1, S, QB, K, 1, False, g, full=True)
    sel = sparse_k.TokenLayout(one.indices.expand(B, Hkv, 1, K), one.counts.expand(B, Hkv, 1), QB,
                               one.first_block.expand(B).contiguous())
    p = get_pattern("sparse_k", sinks=0, window=1, top_k=K, query_block=QB)
    with plan.recording() as seen:
        out = sparse_k.sparse_attention(q, k, v, p, backend="triton", selection=sel)
    assert [x.kernel for x in seen] == ["cuda_sm90_decode"], f"the CUDA decode kernel did not take the call: {seen}"
    geo = row_geometry(B, 1, S, None, device="cuda")
    ref, _ = reference_attention(q.detach().double(), k.double(), v.double(), p, geo, scale=D ** -0.5, selection=sel)
    assert rel_err(out, ref) < TOL[torch.bfloat16], seed
    monkeypatch.setenv(plan.CUDA_ENV, "0")
    with plan.recording() as seen:
        out_off = sparse_k.sparse_attention(q, k, v, p, backend="triton", selection=sel)
    assert seen and not any(x.cuda for x in seen), f"SPARSE_K_CUDA=0 must keep the decode on Triton: {seen}"
    assert rel_err(out_off, ref) < TOL[torch.bfloat16], seed
    assert not geometry.decode_geometry(row_geometry(B, 1, S, None, q_start=S - 2, device="cuda"), 1, S)
    assert geometry.decode_geometry(geo, 1, S)
    assert not cd.cuda_decode_ok(q, k, v, sel, pattern_id=2, decode_geometry=False)
    assert not cd.cuda_decode_ok(q, k, v, sel, pattern_id=0)
    assert not cd.cuda_decode_ok(q[..., :64], k[..., :64], v[..., :64], sel, pattern_id=1)
    with pytest.raises(ValueError, match="window"):
        cd.cuda_decode_forward(q, k, v, sel, pattern_id=2, window=0, scale=0.1)


def test_decode_plan_and_geometry():
    """The split plan counts static keys once, covers every virtual key with no empty split, and fills
    at most one wave of one CTA an SM; the geometry checks (CPU only)."""
    for S, W, sinks, pid, K in [(1, 1, 0, 1, 1), (131072, 1, 0, 1, 2048), (100, 50, 70, 2, 10), (100, 500, 4, 2, 7),
                                (5000, 4096, 128, 2, 2048), (5000, 4096, 128, 1, 2048), (9000, 1, 3, 2, 6000)]:
        static = set(range(max(0, S - W), S)) | (set(range(min(sinks, S))) if pid == 2 else set())
        for rows_heads, sms in [(1, 1), (64, 132), (8, 132), (1, 132), (40, 132), (200, 132), (3, 7)]:
            total, nsplit, chunk = cd.decode_plan(S, W, sinks, pid, K, rows_heads, sms)
            assert total == len(static) + K
            assert chunk == -(-total // nsplit) and (nsplit - 1) * chunk < total <= nsplit * chunk
            assert nsplit * rows_heads <= max(sms, rows_heads)  # one wave
    assert cd.decode_plan(131072, 1, 0, 1, 2048, 64, 132)[1:] == (2, 1025)  # B=8, Hkv=8 on an H100: 128 CTAs
    assert cd.decode_plan(131072, 1, 0, 1, 4096, 64, 132)[1:] == (2, 2049)  # two batches of keys a CTA, one wave
    geo = row_geometry(2, 1, 77, None)
    assert geometry.decode_geometry(geo, 1, 77)
    assert not geometry.decode_geometry(geo, 2, 77)
    assert not geometry.decode_geometry(row_geometry(2, 1, 77, None, q_start=70), 1, 77)
    assert not geometry.decode_geometry(row_geometry(2, 1, 77, torch.ones(2, 77, dtype=torch.bool)), 1, 77)
    chunk = row_geometry(2, 5, 77, None)  # chunked prefill: bottom-right, not plain, not a decode step
    assert geometry.bottom_right_geometry(chunk, 5, 77)
    assert not geometry.plain_geometry(chunk, 5, 77) and not geometry.decode_geometry(chunk, 5, 77)
    assert geometry.plain_geometry(row_geometry(2, 77, 77, None), 77, 77)


@pytest.mark.gpu
@needs_sm90
def test_cuda_graph_replay():
    """Captured in a CUDA graph (counters made before the capture) the kernel replays to the same result."""
    B, Hq, Hkv, S, QB, K = 2, 16, 4, 4097, 128, 512
    g = torch.Generator(device="cuda").manual_seed(time.time_ns() % 2**31)
    q = torch.randn(B, Hq, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, Hkv, S, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    sel = _selection(B, Hkv, S, QB, K, 1, True, g)
    counters = torch.zeros(B * Hkv, dtype=torch.int32, device="cuda")
    want, _ = cd.cuda_decode_forward(q, k, v, sel, pattern_id=1, window=1, scale=0.1, counters=counters)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        got, _ = cd.cuda_decode_forward(q, k, v, sel, pattern_id=1, window=1, scale=0.1, counters=counters)
    for _ in range(3):
        got.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


@pytest.mark.gpu
@needs_sm90
def test_transformers_decode_steps_run_the_cuda_kernel():
    """A bf16 Llama (head dim 128, 8 query / 2 KV heads) with the learned ``sparse_k`` pattern
    (training-free selection) generating from a 300-token prompt: its decode steps reach the CUDA
    decode kernel through Transformers' cache tensors, and each step's logits are as close to one
    float32 forward of the PyTorch path over the generated text as the bf16 PyTorch path's forward
    is (twice its error; one layer, so the selection sees the same inputs everywhere)."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_sparse_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=512, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    params = {"sinks": 4, "window": 64, "top_k": 64, "query_block": 64}
    hf_sparse_attention.configure(model, "sparse_k", backend="triton", **params)
    model.set_attn_implementation("sparse_k")
    torch_bf16 = copy.deepcopy(model)
    hf_sparse_attention.configure(torch_bf16, "sparse_k", backend="torch", **params)
    ref_model = copy.deepcopy(torch_bf16).float()
    prompt, new = 300, 12
    ids = torch.randint(1, cfg.vocab_size, (2, prompt), device="cuda")
    with torch.no_grad(), plan.recording() as seen:
        gen = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        steps = slice(prompt - 1, prompt - 1 + new)
        ref = ref_model(gen.sequences, use_cache=False).logits[:, steps].float()
        base = torch_bf16(gen.sequences, use_cache=False).logits[:, steps].float()
    taken = sum(x.kernel == "cuda_sm90_decode" for x in seen)
    assert taken == new - 1, f"CUDA decode took {taken} steps"
    got = torch.stack(gen.logits, 1).float()
    assert rel_err(got, ref) <= 2 * rel_err(base, ref) + 1e-3, (rel_err(got, ref), rel_err(base, ref))
