"""Which kernel runs a launch (``sparse_k.attention.plan``): the decision table on CPU and meta tensors with an
explicit ``Capability`` (every branch of ``plan_forward`` / ``plan_decode`` / ``plan_backward``), the
switch, the geometry rules; on an sm_90 GPU, that the kernels the plan names are the ones that run
(``plan.recording``) and match the reference."""

from types import SimpleNamespace

import pytest
import torch
from helpers import needs_sm90, rel_err
from sparse_k import row_geometry
from sparse_k.attention import plan
from sparse_k.attention.plan import (
    Capability,
    Launch,
    plan_backward,
    plan_decode,
    plan_forward,
)
from sparse_k.layouts.geometry import plain_geometry
from sparse_k.layouts.token_layout import TokenLayout

ON = Capability(device_ok=True)  # an sm_90 GPU with nvcc, SPARSE_K_CUDA unset, nothing failed to build
BF16 = torch.bfloat16


def test_env_switch(monkeypatch):
    monkeypatch.delenv(plan.CUDA_ENV, raising=False)
    assert plan.cuda_enabled()
    monkeypatch.setenv(plan.CUDA_ENV, "0")
    assert not plan.cuda_enabled()
    assert plan.capability("cpu").refusal("forward").startswith("tensors on cpu")  # CPU: the switch is not read
    monkeypatch.setenv(plan.CUDA_ENV, "1")
    assert plan.cuda_enabled()
    monkeypatch.setenv(plan.CUDA_ENV, "yes")
    with pytest.raises(ValueError, match="SPARSE_K_CUDA='yes'"):
        plan.cuda_enabled()


@pytest.mark.parametrize(
    "q_len, kv_len, mask_row, expected",
    [
        (37, 37, None, True),  # plain self-attention
        (5, 37, None, False),  # chunked prefill: queries bottom-right, q_start = 32
        (37, 37, [0, 0] + [1] * 35, False),  # left padding: k_start = 2 for row 1
        (37, 37, [1] * 37, False),  # any mask: offsets known on the device only, not read (no sync)
    ],
)
def test_plain_geometry(q_len, kv_len, mask_row, expected):
    mask = None
    if mask_row is not None:
        mask = torch.ones(2, kv_len, dtype=torch.long)
        mask[1] = torch.tensor(mask_row)
    geo = row_geometry(2, q_len, kv_len, mask)
    assert plain_geometry(geo, q_len, kv_len) is expected


def test_custom_op_geometry_without_host_offsets_is_not_plain():
    z = torch.zeros(1, dtype=torch.long)
    assert not plain_geometry(SimpleNamespace(q_start=z, k_start=z, k_end=z + 8), 8, 8)


def _t(B, H, S, D=128, dtype=BF16, order="bhsd"):
    """A meta tensor ``(B, H, S, D)``: contiguous, a transposed ``(B, S, H, D)`` view, or head-expanded."""
    if order == "bshd":
        return torch.empty(B, S, H, D, dtype=dtype, device="meta").transpose(1, 2)
    if order == "expanded":
        return torch.empty(B, 1, S, D, dtype=dtype, device="meta").expand(B, H, S, D)
    return torch.empty(B, H, S, D, dtype=dtype, device="meta")


def _sel(B, Hkv, S, qb=128, K=64, idx_dtype=torch.int32):
    nb = -(-S // qb)
    return TokenLayout(torch.zeros(B, Hkv, nb, K, dtype=idx_dtype, device="meta"),
                       torch.zeros(B, Hkv, nb, dtype=torch.int32, device="meta"), qb,
                       torch.zeros(B, dtype=torch.int64, device="meta"))


def _tiles_ns(B, H, S, tile=128, dtype=torch.int32):
    """A block layout's tile lists as the listed kernel reads them (meta tensors): ``(B, H, ceil(S / tile))``
    counts and ``(..., 3)`` tiles, full and partial."""
    nq = -(-S // tile)
    num, idx = torch.zeros(B, H, nq, dtype=dtype, device="meta"), torch.zeros(B, H, nq, 3, dtype=dtype, device="meta")
    return SimpleNamespace(block_q=tile, block_k=tile, full_kv_num_blocks=num, full_kv_indices=idx, kv_num_blocks=num,
                           kv_indices=idx)


def _launch(Sq=300, Skv=None, Hq=8, Hkv=2, B=2, D=128, dtype=BF16, pid=1, causal=True, order="bhsd", q_start=None,
            mask=False, sel=None, **kw):
    Skv = Sq if Skv is None else Skv
    q = _t(B, Hq, Sq, D, dtype, order)
    k, v = _t(B, Hkv, Skv, D, dtype, "bhsd" if order == "expanded" else order), _t(B, Hkv, Skv, D, dtype, order)
    key_mask = torch.ones(B, Skv, dtype=torch.bool) if mask else None
    geo = row_geometry(B, Sq, Skv, key_mask, q_start)
    return Launch(q, k, v, geo, pid, causal, sel, **kw)


def _forward_cases():
    sw = dict(pid=1)
    yield "sliding_window plain bf16 D=128 GQA", _launch(**sw), ON, "cuda_sm90_structured"
    yield "dense / streaming", _launch(pid=0), ON, "cuda_sm90_structured"
    yield "(B, S, H, D) views", _launch(order="bshd"), ON, "cuda_sm90_structured"
    yield "fp16", _launch(dtype=torch.float16), ON, "cuda_sm90_structured"
    yield "fp32", _launch(dtype=torch.float32), ON, "triton_structured"
    yield "head dim 64", _launch(D=64), ON, "cuda_sm90_structured"
    yield "head dim 96", _launch(D=96), ON, "triton_structured"
    yield "head dim 256", _launch(D=256), ON, "triton_structured"
    yield "expanded heads (stride 0)", _launch(order="expanded"), ON, "triton_structured"
    yield "Hq = Hkv", _launch(Hq=2), ON, "cuda_sm90_structured"
    yield "softcap", _launch(softcap=30.0), ON, "triton_structured"
    yield "sink logits", _launch(sink_logits=torch.zeros(8)), ON, "triton_structured"
    yield "caller's output view", _launch(out=_t(2, 8, 300)), ON, "triton_structured"
    yield "chunked prefill (Sq < Skv)", _launch(Sq=5, Skv=300), ON, "triton_structured"
    yield "key mask: offsets on the device only", _launch(mask=True), ON, "triton_structured"
    yield "dense bidirectional", _launch(pid=0, causal=False), ON, "triton_structured"
    yield "streaming bidirectional", _launch(pid=2, causal=False), ON, "triton_layout"
    yield "block_diagonal", _launch(pid=3), ON, "cuda_sm90_structured"
    yield "block_diagonal bidirectional", _launch(pid=3, causal=False), ON, "triton_structured"
    yield "dilated", _launch(pid=5), ON, "triton_layout"
    yield "bigbird without a layout", _launch(pid=4), ON, "triton_layout"
    yield "bigbird, 128x128 layout", _launch(pid=4, layout=_tiles_ns(2, 2, 300)), ON, "cuda_sm90_listed"
    yield "bigbird, one layout row for all heads", _launch(pid=4, layout=_tiles_ns(1, 1, 300)), ON, "cuda_sm90_listed"
    yield "bigbird, (B, S, H, D) views", _launch(pid=4, order="bshd", layout=_tiles_ns(2, 2, 300)), ON, \
        "cuda_sm90_listed"
    yield "bigbird, 64x64 layout", _launch(pid=4, layout=_tiles_ns(2, 2, 300, tile=64)), ON, "triton_layout"
    yield "bigbird, int64 tile lists", _launch(pid=4, layout=_tiles_ns(2, 2, 300, dtype=torch.int64)), ON, \
        "triton_layout"
    yield "bigbird, lists of another length", _launch(pid=4, layout=_tiles_ns(2, 2, 600)), ON, "triton_layout"
    yield "bigbird bidirectional", _launch(pid=4, causal=False, layout=_tiles_ns(2, 2, 300)), ON, "triton_layout"
    yield "bigbird, key mask", _launch(pid=4, mask=True, layout=_tiles_ns(2, 2, 300)), ON, "triton_layout"
    yield "bigbird, head dim 64", _launch(pid=4, D=64, layout=_tiles_ns(2, 2, 300)), ON, "cuda_sm90_listed"
    yield "bigbird, head dim 96", _launch(pid=4, D=96, layout=_tiles_ns(2, 2, 300)), ON, "triton_layout"
    yield "bigbird, packed heads", _launch(pid=4, pack=2, layout=_tiles_ns(2, 2, 300)), ON, "triton_layout"
    yield "bigbird, cuda=False", _launch(pid=4, cuda=False, layout=_tiles_ns(2, 2, 300)), ON, "triton_layout"
    yield "bigbird, forward failed to build", _launch(pid=4, layout=_tiles_ns(2, 2, 300)), \
        Capability(True, failed=frozenset({"forward"})), "triton_layout"
    yield "pack 2", _launch(pack=2), ON, "triton_layout"
    yield "structured=False", _launch(structured=False), ON, "triton_layout"
    yield "split-KV", _launch(num_splits=3), ON, "triton_split_kv"
    yield "cuda=False", _launch(cuda=False), ON, "triton_structured"
    yield "Triton tuning argument", _launch(triton_tuned=True), ON, "triton_structured"
    yield "SPARSE_K_CUDA=0", _launch(), Capability(device_ok=False, enabled=False), "triton_structured"
    yield "no sm_90 / nvcc", _launch(), Capability(device_ok=False), "triton_structured"
    yield "forward failed to build", _launch(), Capability(True, failed=frozenset({"forward"})), "triton_structured"
    yield "token failed, forward fine", _launch(), Capability(True, failed=frozenset({"token"})), "cuda_sm90_structured"
    tok = dict(pid=2, sel=_sel(2, 2, 300))
    yield "token prefill", _launch(**tok), ON, "cuda_sm90_token"
    yield "token, (B, S, H, D) views", _launch(order="bshd", **tok), ON, "cuda_sm90_token"
    yield "token, head dim 64", _launch(D=64, **tok), ON, "cuda_sm90_token"
    yield "token, head dim 96", _launch(D=96, **tok), ON, "triton_token"
    yield "token, query_block 64", _launch(pid=2, sel=_sel(2, 2, 300, qb=64)), ON, "triton_token"
    yield "token, int64 indices", _launch(pid=2, sel=_sel(2, 2, 300, idx_dtype=torch.int64)), ON, "triton_token"
    yield "token, dense static part", _launch(pid=0, sel=_sel(2, 2, 300)), ON, "triton_token"
    yield "token, sel_fast given", _launch(sel_fast=2, **tok), ON, "triton_token"
    yield "token, two splits", _launch(num_splits=2, **tok), ON, "triton_split_kv"
    yield "token, chunk", _launch(Sq=5, Skv=300, pid=2, sel=_sel(2, 2, 300)), ON, "triton_token"
    yield "token failed to build", _launch(**tok), Capability(True, failed=frozenset({"token"})), "triton_token"
    yield "token, CPU capability", _launch(**tok), plan.capability("cpu"), "triton_token"


def _decode_cases():
    dec = dict(Sq=1, Skv=777, pid=1, sel=_sel(2, 2, 777))
    yield "decode step", _launch(**dec), ON, "cuda_sm90_decode"
    yield "decode, packed heads and splits (the kernel splits itself)", _launch(pack=4, num_splits=5, **dec), ON, \
        "cuda_sm90_decode"
    yield "decode, streaming static part", _launch(Sq=1, Skv=777, pid=2, sel=_sel(2, 2, 777)), ON, "cuda_sm90_decode"
    yield "decode, group 3", _launch(Hq=6, **dec), ON, "triton_token"
    yield "decode, group 16", _launch(Hq=32, **dec), ON, "triton_token"
    yield "decode, group 3, split", _launch(Hq=6, num_splits=4, **dec), ON, "triton_split_kv"
    yield "decode, head dim 64", _launch(D=64, **dec), ON, "triton_token"
    yield "decode, fp32", _launch(dtype=torch.float32, **dec), ON, "triton_token"
    yield "decode, query before the last key", _launch(q_start=775, **dec), ON, "triton_token"
    yield "decode, key mask", _launch(mask=True, **dec), ON, "triton_token"
    yield "decode, query_block 16 is fine", _launch(Sq=1, Skv=777, pid=1, sel=_sel(2, 2, 777, qb=16)), ON, \
        "cuda_sm90_decode"
    yield "decode, sel_fast", _launch(sel_fast=0, num_splits=3, **dec), ON, "triton_split_kv"
    yield "decode, SPARSE_K_CUDA=0", _launch(num_splits=3, **dec), Capability(False, enabled=False), "triton_split_kv"
    yield "decode failed to build", _launch(num_splits=3, **dec), Capability(True, failed=frozenset({"decode"})), \
        "triton_split_kv"
    one = dict(Sq=1, Skv=1, pid=1, sel=_sel(2, 2, 1))
    yield "one key: the decode kernel first", _launch(**one), ON, "cuda_sm90_decode"
    yield "one key, decode failed: the token kernel", _launch(**one), Capability(True, failed=frozenset({"decode"})), \
        "cuda_sm90_token"


@pytest.mark.parametrize("name, launch, cap, kernel", list(_forward_cases()) + list(_decode_cases()),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_forward_plan_table(name, launch, cap, kernel):
    got = plan_forward(launch, cap)
    assert got.kernel == kernel, (name, got)
    assert got.entry == ("decode" if launch.q.shape[2] == 1 else "forward")
    assert got.reason and got.cuda == kernel.startswith("cuda_")
    if got.entry == "decode":
        assert plan_decode(launch, cap) == got


def test_plan_decode_takes_decode_launches_only():
    with pytest.raises(ValueError, match="Sq=300"):
        plan_decode(_launch(pid=2, sel=_sel(2, 2, 300)), ON)
    got = plan_decode(_launch(Sq=1, Skv=77, pack=4, num_splits=3), ON)  # a window decode step: Triton split-KV
    assert (got.entry, got.kernel) == ("decode", "triton_split_kv")
    got = plan_decode(_launch(Sq=1, Skv=77), ON)  # one head per program, one split: a structured launch
    assert (got.entry, got.kernel) == ("decode", "triton_structured")  # Sq != Skv: not the CUDA kernel


def test_refusals_say_why():
    assert "SPARSE_K_CUDA=0" in plan_forward(_launch(), Capability(False, enabled=False)).reason
    assert "failed to build" in plan_forward(_launch(), Capability(True, failed=frozenset({"forward"}))).reason
    assert "output view" in plan_forward(_launch(out=_t(2, 8, 300)), ON).reason
    assert "not plain" in plan_forward(_launch(Sq=5, Skv=300), ON).reason
    assert "softcap" in plan_forward(_launch(softcap=1.0), ON).reason
    assert "contract" in plan_forward(_launch(D=96), ON).reason
    assert "not causal" in plan_forward(_launch(pid=0, causal=False), ON).reason
    assert "sel_fast" in plan_forward(_launch(pid=2, sel=_sel(2, 2, 300), sel_fast=1), ON).reason
    assert "3 key splits" in plan_forward(_launch(num_splits=3), ON).reason
    assert "decode" in plan_forward(_launch(Sq=1, Skv=77, Hq=6, pid=1, sel=_sel(2, 2, 77)), ON).reason


def _backward_cases():
    def grads(launch, do_order="bhsd", lse_dtype=torch.float32):
        B, Hq, Sq, D = launch.q.shape
        do = _t(B, Hq, Sq, D, launch.q.dtype, do_order)
        if do_order == "d_major":
            do = torch.empty(B, Hq, D, Sq, dtype=launch.q.dtype, device="meta").transpose(2, 3)
        return do, _t(B, Hq, Sq, D, launch.q.dtype), torch.empty(B, Hq, Sq, dtype=lse_dtype, device="meta")

    base = _launch()
    yield "plain sliding_window", base, grads(base), ON, "cuda_sm90_structured_bwd"
    tr = _launch(order="bshd", pid=2)
    yield "streaming, (B, S, H, D) views", tr, grads(tr, "bshd"), ON, "cuda_sm90_structured_bwd"
    yield "dO with a strided head dim", base, grads(base, "d_major"), ON, "triton_structured_bwd"
    for D, kernel in ((64, "cuda_sm90_structured_bwd"), (96, "triton_structured_bwd"), (256, "triton_structured_bwd")):
        launch = _launch(D=D)
        yield f"head dim {D}", launch, grads(launch), ON, kernel
    yield "lse in bf16", base, grads(base, lse_dtype=BF16), ON, "triton_structured_bwd"
    yield "backward failed to build", base, grads(base), Capability(True, failed=frozenset({"backward"})), \
        "triton_structured_bwd"
    yield "forward failed, backward fine", base, grads(base), Capability(True, failed=frozenset({"forward"})), \
        "cuda_sm90_structured_bwd"
    for name, launch in (("fp32", _launch(dtype=torch.float32)), ("chunk", _launch(Sq=5, Skv=300)),
                         ("softcap", _launch(softcap=2.0)), ("tuned", _launch(triton_tuned=True)),
                         ("cuda=False", _launch(cuda=False)), ("dense bidirectional", _launch(pid=0, causal=False)),
                         ("block_diagonal (no CUDA backward)", _launch(pid=3))):
        yield name, launch, grads(launch), ON, "triton_structured_bwd"
    for name, launch in (("dilated", _launch(pid=5)), ("streaming bidirectional", _launch(pid=2, causal=False)),
                         ("token layout", _launch(pid=2, sel=_sel(2, 2, 300))),
                         ("structured=False", _launch(structured=False))):
        yield name, launch, grads(launch), ON, "triton_layout_bwd"
    yield "pack and splits do not matter", _launch(pack=2, num_splits=2), grads(base), ON, "cuda_sm90_structured_bwd"
    viewed = _launch(out=_t(2, 8, 300))  # the forward wrote into a caller's view: the backward only reads it
    yield "forward into a caller's view", viewed, grads(viewed), ON, "cuda_sm90_structured_bwd"


@pytest.mark.parametrize("name, launch, tensors, cap, kernel", list(_backward_cases()),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_backward_plan_table(name, launch, tensors, cap, kernel):
    got = plan_backward(launch, *tensors, cap)
    assert got.entry == "backward" and got.kernel == kernel, (name, got)


def test_structured_rule_is_the_same_both_ways():
    """The forward's structured launches are the backward's structured launches with one head per
    program and one split: one rule (``pattern_codes.structured_pattern``)."""
    from sparse_k.attention.pattern_codes import structured_pattern

    for pid in range(7):
        for causal in (True, False):
            for sel in (None, _sel(1, 1, 16)):
                fwd = plan.structured_launch(_launch(pid=pid, causal=causal, sel=sel))
                assert fwd == structured_pattern(pid, causal, sel) == (pid in (0, 1, 2, 3) and sel is None
                                                                       and (causal or pid != 2))
                assert not plan.structured_launch(_launch(pid=pid, causal=causal, sel=sel, num_splits=2))


def test_cpu_calls_stay_on_triton():
    """Without an explicit capability the plan reads q's device: CPU tensors never reach a CUDA kernel."""
    q, k, v = torch.randn(1, 4, 40, 128, dtype=BF16), torch.randn(1, 2, 40, 128, dtype=BF16), torch.randn(
        1, 2, 40, 128, dtype=BF16)
    launch = Launch(q, k, v, row_geometry(1, 40, 40, None), 1, True)
    assert plan_forward(launch, ON).kernel == "cuda_sm90_structured"  # the rules alone would take it
    assert plan_forward(launch).kernel == "triton_structured"
    assert plan_backward(launch, q, q, torch.zeros(1, 4, 40)).kernel == "triton_structured_bwd"
    assert plan_backward(launch, q, q, torch.zeros(1, 4, 40), ON).kernel == "cuda_sm90_structured_bwd"


def test_backend_plan():
    """``plan_backend``: requested reference / torch as asked; auto takes the first kernel backend that
    can run the call (asking lazily, in order), else the PyTorch path with every reason; a requested
    kernel backend that cannot run falls back to the PyTorch path, saying why."""
    asked = []

    def why(reasons):
        def ask(name):
            asked.append(name)
            return reasons[name]
        return ask

    assert plan.plan_backend("torch", ["triton"], why({})).kernel == "torch"
    assert plan.plan_backend("reference", ["triton"], why({})).kernel == "reference" and not asked
    got = plan.plan_backend("auto", ["a", "b", "c"], why({"a": "no", "b": None, "c": None}))
    assert (got.entry, got.kernel, asked) == ("backend", "b", ["a", "b"])
    got = plan.plan_backend("auto", ["a", "b"], why({"a": "dtype float64", "b": "tensors on cpu"}))
    assert got.kernel == "torch" and "a: dtype float64" in got.reason and "b: tensors on cpu" in got.reason
    assert plan.plan_backend("auto", [], why({})).reason == "auto: no kernel backend registered"
    got = plan.plan_backend("triton", ["triton"], why({"triton": "head dim 48"}))
    assert got.kernel == "torch" and got.reason == "backend 'triton' cannot run this call (head dim 48)"
    assert plan.plan_backend("triton", ["triton"], why({"triton": None})).kernel == "triton"


def test_api_records_the_pytorch_path_and_warns_with_the_plans_reason():
    import warnings

    import sparse_k
    from sparse_k import warn

    q = torch.randn(1, 2, 9, 48)
    warn._WARNED.clear()
    with plan.recording() as seen, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sparse_k.sparse_attention(q, q, q, "sliding_window", backend="torch")
        sparse_k.sparse_attention(q, q, q, "sliding_window", backend="reference")
        if "triton" in sparse_k.available_backends():
            sparse_k.sparse_attention(q, q, q, "sliding_window", backend="triton")  # head dim 48 (or CPU): no kernel
    kernels = [x.kernel for x in seen]
    assert kernels[:2] == ["torch", "reference"] and all(x.entry == "backend" for x in seen)
    if "triton" in sparse_k.available_backends():
        assert kernels[2] == "torch" and seen[2].reason.startswith("backend 'triton' cannot run this call (")
        assert f"{seen[2].reason}; using the PyTorch path instead" in [str(w.message) for w in caught]


_CUDA = dict(device_type="cuda")


@pytest.mark.parametrize("kw, want", [
    (dict(q_len=4096, group=4, head_dim=128, **_CUDA, need_grad=False, selection=False), (128, 128, 1, False)),
    (dict(q_len=4096, group=4, head_dim=256, **_CUDA, need_grad=False, selection=False), (64, 64, 1, False)),
    (dict(q_len=4096, group=4, head_dim=128, **_CUDA, need_grad=True, selection=False), (64, 64, 1, False)),
    (dict(q_len=4096, group=4, head_dim=128, **_CUDA, need_grad=False, selection=True), (32, 64, 4, False)),
    (dict(q_len=4096, group=3, head_dim=128, **_CUDA, need_grad=False, selection=True), (128, 64, 1, False)),
    (dict(q_len=4096, group=3, head_dim=64, **_CUDA, need_grad=False, selection=True, query_block=1),
     (16, 64, 1, False)),
    (dict(q_len=4096, group=4, head_dim=128, **_CUDA, need_grad=False, selection=True, query_block=64),
     (32, 64, 4, False)),
    (dict(q_len=4096, group=4, head_dim=128, **_CUDA, need_grad=True, selection=True, query_block=1),
     (64, 64, 1, False)),
    (dict(q_len=4096, group=4, head_dim=64, **_CUDA, need_grad=False, selection=True), (32, 64, 4, False)),
    (dict(q_len=4096, group=4, head_dim=96, **_CUDA, need_grad=False, selection=True), (128, 128, 1, False)),
    (dict(q_len=4096, group=4, head_dim=128, **_CUDA, need_grad=True, selection=True), (64, 64, 1, False)),
    (dict(q_len=1, group=4, head_dim=128, **_CUDA, need_grad=False, selection=True), (4, plan.TOKEN_DECODE_BLOCK_N, 4, True)),
    (dict(q_len=1, group=4, head_dim=128, **_CUDA, need_grad=False, selection=False), (4, 64, 4, True)),
    (dict(q_len=3, group=2, head_dim=64, **_CUDA, need_grad=False, selection=True), (8, plan.TOKEN_DECODE_BLOCK_N, 2, True)),
    (dict(q_len=1, group=3, head_dim=128, **_CUDA, need_grad=False, selection=False), (16, 64, 1, True)),
    (dict(q_len=5, group=8, head_dim=256, **_CUDA, need_grad=False, selection=False), (8, 64, 8, True)),
    (dict(q_len=1, group=4, head_dim=128, **_CUDA, need_grad=True, selection=False), (64, 64, 1, False)),
    (dict(q_len=1, group=4, head_dim=64, device_type="cpu", need_grad=False, selection=False), (4, 16, 4, True)),
    (dict(q_len=300, group=4, head_dim=64, device_type="cpu", need_grad=True, selection=False), (16, 16, 1, False)),
    (dict(q_len=4096, group=4, head_dim=128, **_CUDA, need_grad=False, selection=False, bigbird_block=128),
     (64, 64, 1, False)),
    (dict(q_len=4096, group=4, head_dim=128, **_CUDA, need_grad=True, selection=False, bigbird_block=128),
     (128, 128, 1, False)),
    (dict(q_len=1, group=4, head_dim=128, **_CUDA, need_grad=False, selection=False, bigbird_block=32),
     (32, 32, 1, False)),
    (dict(q_len=4096, group=4, head_dim=128, **_CUDA, need_grad=False, selection=False, bigbird_block=128,
          bigbird_cuda=True), (128, 128, 1, False)),
    (dict(q_len=4096, group=4, head_dim=128, **_CUDA, need_grad=False, selection=False, bigbird_block=256,
          bigbird_cuda=True), (128, 128, 1, False)),
    (dict(q_len=4096, group=4, head_dim=128, **_CUDA, need_grad=False, selection=False, bigbird_block=192,
          bigbird_cuda=True), (64, 64, 1, False)),
    (dict(q_len=4096, group=4, head_dim=64, **_CUDA, need_grad=False, selection=False, bigbird_block=128,
          bigbird_cuda=True), (128, 128, 1, False)),
    (dict(q_len=4096, group=4, head_dim=96, **_CUDA, need_grad=False, selection=False, bigbird_block=128,
          bigbird_cuda=True), (64, 64, 1, False)),
    (dict(q_len=300, group=4, head_dim=128, device_type="cpu", need_grad=False, selection=False, bigbird_block=128,
          bigbird_cuda=True), (128, 128, 1, False)),
])
def test_tile_plan(kw, want):
    """The Triton backend's tiles per call (``plan_tiles``): prefill, gradients, token-layout prefill
    (heads packed at D = 128 only), decode (heads packed, keys split; gathered keys of a token layout in
    ``TOKEN_DECODE_BLOCK_N``-key tiles), CPU tiles, bigbird's blocks."""
    t = plan.plan_tiles(**kw)
    assert (t.block_q, t.block_k, t.pack, t.decode) == want, t
    assert t.reason


def test_bigbird_cuda_rule(monkeypatch):
    """Which bigbird calls get the listed kernel's 128x128 tiles (``plan.bigbird_cuda``): eager inference prefill,
    causal, blocks of a multiple of 128, plain geometry, bf16/fp16 with D = 128, CUDA allowed."""
    q, k, v = _t(2, 8, 300), _t(2, 2, 300), _t(2, 2, 300)
    geo = row_geometry(2, 300, 300, None)
    assert plan.bigbird_cuda(128, True, q, k, v, geo, False, ON)
    assert plan.bigbird_cuda(256, True, q, k, v, geo, False, ON)
    assert not plan.bigbird_cuda(192, True, q, k, v, geo, False, ON)
    assert not plan.bigbird_cuda(128, False, q, k, v, geo, False, ON)
    assert not plan.bigbird_cuda(128, True, q, k, v, geo, True, ON)
    assert not plan.bigbird_cuda(128, True, q, k, v, geo, False, Capability(device_ok=False))
    assert not plan.bigbird_cuda(128, True, q, k, v, geo, False, Capability(True, failed=frozenset({"forward"})))
    masked = row_geometry(2, 300, 300, torch.ones(2, 300, dtype=torch.bool))
    assert not plan.bigbird_cuda(128, True, q, k, v, masked, False, ON)
    assert not plan.bigbird_cuda(128, True, _t(2, 8, 300, D=96), _t(2, 2, 300, D=96), _t(2, 2, 300, D=96), geo, False,
                                 ON)
    assert plan.bigbird_cuda(128, True, _t(2, 8, 300, D=64), _t(2, 2, 300, D=64), _t(2, 2, 300, D=64), geo, False, ON)
    assert not plan.bigbird_cuda(128, True, _t(2, 8, 16), _t(2, 2, 16), _t(2, 2, 16), row_geometry(2, 16, 16, None),
                                 False, ON)
    assert not plan.bigbird_cuda(128, True, q, k, v, geo, False, plan.capability("cpu"))
    f32 = [_t(2, h, 300, dtype=torch.float32) for h in (8, 2, 2)]
    assert not plan.bigbird_cuda(128, True, *f32, geo, False, ON)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # a torch.compile trace keeps Triton's tiles
    assert not plan.bigbird_cuda(128, True, q, k, v, geo, False, ON)


def test_recording_collects_what_dispatch_records():
    p1, p2 = plan.Plan("forward", "triton_layout", "a"), plan.Plan("backward", "triton_layout_bwd", "b")
    plan.record(p1)  # nobody recording: dropped
    with plan.recording() as outer:
        plan.record(p1)
        with plan.recording() as inner:
            plan.record(p2)
    plan.record(p2)
    assert outer == [p1, p2] and inner == [p2]
    assert set(plan.KERNELS) >= {"cuda_sm90_structured", "cuda_sm90_token", "cuda_sm90_decode",
                                             "triton_structured", "triton_token", "triton_split_kv"}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("name, kw", [("sliding_window", {"window": 300}), ("streaming", {"window": 300, "sinks": 64}),
                                      ("dense", {})])
def test_block_attn_dispatches_to_cuda_and_matches_triton(name, kw):
    """Plain causal bf16 self-attention goes to the CUDA kernel; its output matches the Triton kernel's
    (same inputs) and the float64 reference. bf16 operands: 1e-3..1e-2 relative (design §10)."""
    from sparse_k import build_block_layout, get_pattern, reference_attention
    from sparse_k.attention import dispatch
    from sparse_k.attention.ops import block_attn

    S, D = 1001, 128
    q = torch.randn(1, 8, S, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    p = get_pattern(name, **kw)
    geo = row_geometry(1, S, S, None, device="cuda")
    lay = build_block_layout(p, S, S, geo, block_q=128, block_k=128, num_kv_heads=2)
    with plan.recording() as seen:
        out, lse = block_attn(q, k, v, lay, scale=D ** -0.5)
        out_t, lse_t = dispatch.attention_forward(q, k, v, lay, scale=D ** -0.5, cuda=False)
    assert [x.kernel for x in seen] == ["cuda_sm90_structured", "triton_structured"], seen
    ref, _ = reference_attention(q.double(), k.double(), v.double(), p, geo, scale=D ** -0.5)
    assert rel_err(out, ref) < 2e-2 and rel_err(out, out_t) < 2e-2
    torch.testing.assert_close(lse, lse_t, rtol=0, atol=2e-2)


@pytest.mark.gpu
@needs_sm90
def test_autograd_path_uses_cuda_forward_and_backward():
    """Through the custom op with gradients (the training path) the plain geometry reaches the dispatch
    of both passes: the CUDA forward and the CUDA backward run; gradients match the float64 reference's."""
    from sparse_k import build_block_layout, get_pattern, reference_attention
    from sparse_k.attention.ops import block_attn

    S, D = 777, 128
    p = get_pattern("streaming", window=200, sinks=32)
    geo = row_geometry(1, S, S, None, device="cuda")
    lay = build_block_layout(p, S, S, geo, block_q=64, block_k=64, num_kv_heads=2)
    leaves = [torch.randn(1, h, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2)]
    do = torch.randn(1, 8, S, D, device="cuda", dtype=torch.bfloat16)
    with plan.recording() as seen:
        out, _ = block_attn(*leaves, lay, scale=D ** -0.5, need_grad=True)
        grads = torch.autograd.grad(out, leaves, do)
    assert [x.kernel for x in seen] == ["cuda_sm90_structured", "cuda_sm90_structured_bwd"], seen
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref, _ = reference_attention(*ref_leaves, p, geo, scale=D ** -0.5)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())
    assert rel_err(out, ref) < 2e-2
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 2e-2


def _view(shape, strides, dtype=torch.bfloat16, offset=0):
    n = offset + 1 + sum((m - 1) * st for m, st in zip(shape, strides))
    return torch.empty(n + 64, dtype=dtype)[offset:].as_strided(shape, strides)


@pytest.mark.parametrize(
    "shape, strides, dtype, offset, expected",
    [
        ((2, 8, 37, 128), (8 * 37 * 128, 37 * 128, 128, 1), torch.bfloat16, 0, True),  # contiguous
        ((2, 8, 37, 128), (37 * 8 * 128, 128, 8 * 128, 1), torch.bfloat16, 0, True),  # transposed (B, S, H, D)
        ((2, 2, 37, 128), (37 * 12 * 128, 128, 12 * 128, 1), torch.float16, 8 * 128, True),  # slice of fused QKV
        ((1, 1, 37, 128), (3, 5, 128, 1), torch.bfloat16, 0, True),  # size-1 dimensions: any stride
        ((1, 4, 1, 128), (7, 128, 9, 1), torch.bfloat16, 0, True),
        ((2, 8, 37, 128), (37 * 8 * 136, 136, 8 * 136, 1), torch.bfloat16, 0, True),  # padded rows, 272 bytes
        ((2, 8, 37, 128), (37 * 8 * 132, 132, 8 * 132, 1), torch.bfloat16, 0, False),  # rows of 264 bytes
        ((2, 8, 37, 128), (37 * 8 * 132, 132, 8 * 132, 1), torch.float32, 0, True),  # 528 bytes
        ((2, 8, 37, 128), (8 * 37 * 128, 0, 128, 1), torch.bfloat16, 0, False),  # expanded heads
        ((2, 8, 37, 128), (8 * 37 * 128, 37 * 128, 1, 37), torch.bfloat16, 0, False),  # head dim not innermost
        ((2, 8, 37, 128), (8 * 37 * 128, 37 * 128, 128, 1), torch.bfloat16, 4, False),  # data 8 bytes off
        ((2, 8, 37, 128), (2**39, 37 * 128, 128, 1), torch.bfloat16, 0, False),  # batch stride of 2**40 bytes
    ],
)
def test_tma_view_rule(shape, strides, dtype, offset, expected):
    """The stride rule of the CUDA kernels' inputs, on CPU tensors (it reads strides and the data pointer
    only); ``tensors_ok`` applies it after the device checks."""
    from sparse_k.attention.cuda.contract import tma_view_ok

    if strides[0] >= 2**39:  # no storage that large: a meta tensor has the strides (and data pointer 0)
        t = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
    else:
        t = _view(shape, strides, dtype, offset)
    assert t.data_ptr() % 16 == (8 if offset == 4 else 0)
    assert tma_view_ok(t) is expected


def test_output_follows_query_order():
    """Outputs of the forward kernels take q's memory order: (B, S, H, D) storage for transposed
    queries (so a Transformers layer's transpose back is free), contiguous otherwise and where both
    orders are one (H = 1 or S = 1)."""
    from sparse_k.attention.memory_order import new_output, sequence_major

    bshd = torch.empty(2, 37, 8, 128, dtype=torch.float16).transpose(1, 2)
    out = new_output(bshd)
    assert sequence_major(bshd) and out.shape == bshd.shape and out.dtype == bshd.dtype
    assert out.transpose(1, 2).is_contiguous() and not out.is_contiguous()
    assert new_output(bshd, 64).shape == (2, 8, 37, 64)
    for q in (torch.empty(2, 8, 37, 128), torch.empty(2, 37, 1, 128).transpose(1, 2),
              torch.empty(2, 1, 8, 128).transpose(1, 2)):
        assert not sequence_major(q) and new_output(q).is_contiguous()


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_api_bshd_reaches_cuda_without_copies(monkeypatch, dtype):
    """``flash_attn_func`` on (B, S, H, D) tensors: the CUDA forward takes the transposed views as they
    are, and the (B, S, H, D) output it returns is contiguous (written in that order, no copy)."""
    from sparse_k import get_pattern, reference_attention
    from sparse_k.flash_api import flash_attn_func

    B, S, Hq, Hkv, W = 2, 1001, 8, 2, 300
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(B, S, h, 128, device="cuda", dtype=dtype, generator=g) for h in (Hq, Hkv, Hkv))
    from sparse_k.attention.cuda import structured as cuda_structured

    made = []  # the CUDA launcher's own output: flash_attn_func must return it as it is (no copy)
    real = cuda_structured.cuda_structured_forward
    monkeypatch.setattr(cuda_structured, "cuda_structured_forward",
                        lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    with plan.recording() as seen:
        out = flash_attn_func(q, k, v, causal=True, window_size=(W - 1, 0))
    assert [x.kernel for x in seen] == ["cuda_sm90_structured"], f"the CUDA kernel did not take the call: {seen}"
    assert out.shape == q.shape and out.is_contiguous() and made[0][0].data_ptr() == out.data_ptr()
    geo = row_geometry(B, S, S, None, device="cuda")
    ref, _ = reference_attention(*(t.transpose(1, 2).double() for t in (q, k, v)),
                                 get_pattern("sliding_window", window=W), geo, scale=128 ** -0.5)
    assert rel_err(out.transpose(1, 2), ref) < (2e-2 if dtype == torch.bfloat16 else 4e-3)


@pytest.mark.gpu
@needs_sm90
def test_transposed_training_path_uses_cuda_both_ways():
    """A Transformers-style call with gradients (leaves (B, S, H, D), the attention gets their
    transposed views): the CUDA forward and backward both run, the output is in (B, S, H, D) order,
    and the leaves' gradients match the float64 reference's."""
    from sparse_k import get_pattern, reference_attention, sparse_attention

    B, S, Hq, Hkv, D = 1, 777, 8, 2, 128
    p = get_pattern("streaming", window=200, sinks=32)
    g = torch.Generator(device="cuda").manual_seed(11)
    leaves = [torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
              for h in (Hq, Hkv, Hkv)]
    do = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    with plan.recording() as seen:
        out = sparse_attention(*(t.transpose(1, 2) for t in leaves), p, backend="triton")
        assert out.transpose(1, 2).is_contiguous()  # the adapter's transpose(1, 2).contiguous() copies nothing
        grads = torch.autograd.grad(out.transpose(1, 2), leaves, do)
    assert [x.kernel for x in seen] == ["cuda_sm90_structured", "cuda_sm90_structured_bwd"], seen
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    geo = row_geometry(B, S, S, None, device="cuda")
    ref, _ = reference_attention(*(t.transpose(1, 2) for t in ref_leaves), p, geo, scale=D ** -0.5)
    ref_grads = torch.autograd.grad(ref.transpose(1, 2), ref_leaves, do.double())
    assert rel_err(out.transpose(1, 2), ref.transpose(1, 2)) < 2e-2
    for gr, r in zip(grads, ref_grads):
        assert gr.is_contiguous() and rel_err(gr, r) < 2e-2
