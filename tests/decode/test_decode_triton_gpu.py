"""GPU tests of the Triton decode path: bf16 / fp16, real head dims, long caches (``gpu`` marker).

Decode over a Transformers-style cache viewed as ``(B, Hkv, S, D)`` (no copies), the
FlashAttention-style ``flash_attn_with_kvcache`` with per-row cache lengths, and split-KV decode
captured in CUDA graphs. Tolerances as in ``attention_kernels/test_triton_gpu.py``: relative
Frobenius error against the float64 reference (bf16 2e-2, fp16 4e-3; a wrong tile gives O(0.1..1)).
"""

import pytest
import sparse_k
import torch
from helpers import rel_err
from sparse_k import get_pattern, reference_attention, row_geometry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or sparse_k.triton_backend is None, reason="needs CUDA and triton"),
]

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _inputs(B, Hq, Hkv, Sq, Skv, D, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    return mk(B, Hq, Sq, D), mk(B, Hkv, Skv, D), mk(B, Hkv, Skv, D)


@pytest.mark.parametrize("q_len", [1, 5, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_strided_cache(q_len, group):
    """Decode against a Transformers-style cache (B, S_max, Hkv, D) viewed as (B, Hkv, S, D), no copies."""
    B, Hkv, S_max, D = 3, 2, 5000, 128
    Hq = Hkv * group
    g = torch.Generator(device="cuda").manual_seed(q_len * 10 + group)
    cache_k = torch.randn(B, S_max, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cache_v = torch.randn(B, S_max, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(B, Hq, q_len, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = cache_k.transpose(1, 2), cache_v.transpose(1, 2)
    sink = torch.randn(Hq, device="cuda")
    for p in (get_pattern("sliding_window", window=1000), get_pattern("streaming", sinks=4, window=700), get_pattern("dense")):
        out = sparse_k.sparse_attention(q, k, v, p, backend="triton", sink_logits=sink)
        ref = sparse_k.sparse_attention(q.double(), k.double(), v.double(), p, backend="reference", sink_logits=sink.double())
        assert rel_err(out, ref) < TOL[torch.bfloat16], p


def test_flash_kvcache_decode():
    B, S_max, Hkv, Hq, D = 2, 4096, 2, 8, 64
    g = torch.Generator(device="cuda").manual_seed(7)
    kc = torch.randn(B, S_max, Hkv, D, device="cuda", dtype=torch.float16, generator=g)
    vc = torch.randn(B, S_max, Hkv, D, device="cuda", dtype=torch.float16, generator=g)
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.float16, generator=g)
    lens = torch.tensor([1000, 3001], device="cuda")
    out = sparse_k.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, window_size=(511, 0), backend="triton")
    ref = sparse_k.flash_attn_with_kvcache(q.double(), kc.double(), vc.double(), cache_seqlens=lens, causal=True, window_size=(511, 0), backend="reference")
    assert rel_err(out, ref) < TOL[torch.float16]


def test_decode_split_merge_under_cuda_graph():
    """Split-KV decode captured in CUDA graphs: on a fresh stream (no counters: the combine kernel
    merges) and on a stream that ran the call before (its counters exist: the last split program
    merges in place); replayed with new queries, eager launches in between; each replay against the
    float64 reference."""
    from sparse_k.attention import dispatch, launch_buffers

    B, Hq, Hkv, S, D = 4, 16, 4, 9000, 128
    _, k, v = _inputs(B, Hq, Hkv, 1, S, D, torch.bfloat16, seed=11)
    p = get_pattern("streaming", sinks=4, window=2000)
    geo = row_geometry(B, 1, S, None, device="cuda")
    lay = sparse_k.build_block_layout(p, 1, S, geo, block_q=4, block_k=64, num_kv_heads=Hkv)
    q_static = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    sink = torch.randn(Hq, device="cuda")

    def call():
        return dispatch.attention_forward(q_static, k, v, lay, scale=D ** -0.5, pack=4, num_splits=6, sink_logits=sink)

    call()  # compile and load the kernel outside the captures (default stream)
    torch.cuda.synchronize()
    graphs = []
    for warm in (False, True):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        if warm:
            with torch.cuda.stream(stream):
                call()
            assert (str(torch.device("cuda", torch.cuda.current_device())), stream.cuda_stream) in launch_buffers._COUNTERS
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out, _ = call()
        torch.cuda.current_stream().wait_stream(stream)
        graphs.append((graph, out))
    for i in range(3):
        q_static.copy_(torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16))
        ref, _ = reference_attention(q_static.double(), k.double(), v.double(), p, geo, scale=D ** -0.5,
                                     sink_logits=sink.double())
        for graph, out in graphs:
            graph.replay()
            assert rel_err(out, ref) < TOL[torch.bfloat16], i
        eager, _ = call()
        assert rel_err(eager, ref) < TOL[torch.bfloat16], i
