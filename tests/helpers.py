"""Helpers shared by the core tests: random pattern configurations and inputs."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import sparse_k as sk
import torch
from sparse_k.attention.cuda.build import sm90_available


def random_pattern(name: str, rng: torch.Generator | None = None, *, causal: bool = True, max_len: int = 256) -> sk.Pattern:
    """A random valid configuration of pattern ``name`` (sizes scaled to ``max_len``)."""

    def r(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=rng).item())

    hi = max(2, max_len // 2)
    if name == "dense":
        return sk.Dense(causal=causal)
    if name == "sliding_window":
        return sk.SlidingWindow(window=r(1, hi), causal=causal)
    if name == "streaming":
        return sk.Streaming(sinks=r(0, 8), window=r(1, hi))
    if name == "block_diagonal":
        return sk.BlockDiagonal(block=r(1, hi), causal=causal)
    if name == "bigbird":
        return sk.BigBird(block=r(1, 32), window_blocks=r(0, 2), global_blocks=r(0, 2), random_blocks=r(0, 3), seed=r(0, 99), causal=causal)
    if name == "dilated":
        return sk.Dilated(window=r(1, 32), scales=r(1, 4), causal=causal)
    if name == "l2_aligned":
        block = r(1, 32)
        seg = r(1, 4) * block * 2
        return sk.L2Aligned(block=block, window_blocks=r(1, 3), segment=seg, anchor=r(0, seg))
    if name in ("sparse_k", "dsa"):
        cls = sk.SparseK if name == "sparse_k" else sk.DSA
        return cls(sinks=r(0, 4), window=r(1, hi), top_k=r(0, 16), query_block=r(1, 32))
    raise ValueError(name)


FIXED = ["dense", "sliding_window", "streaming", "block_diagonal", "bigbird", "dilated", "l2_aligned"]
BIDIRECTIONAL = ["dense", "sliding_window", "block_diagonal", "bigbird", "dilated"]


def left_padding_mask(batch: int, kv_len: int, rng: torch.Generator | None = None) -> torch.Tensor:
    """(B, Skv) bool mask with a random amount of left padding per row (row 0 unpadded)."""
    m = torch.ones(batch, kv_len, dtype=torch.bool)
    for b in range(1, batch):
        pad = int(torch.randint(0, max(1, kv_len // 2) + 1, (1,), generator=rng).item())
        m[b, :pad] = False
    return m


def random_qkv(B, Hq, Hkv, Sq, Skv, D, dtype=torch.float32, requires_grad=False):
    q = torch.randn(B, Hq, Sq, D, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(B, Hkv, Skv, D, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(B, Hkv, Skv, D, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


def tiny_llama(layers: int = 3):
    """A seeded random 3-layer Llama (hidden 32, 4 query / 2 KV heads, vocabulary 50)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg)


def sparse_tiny_llama(name: str, params: dict, *, random_selectors: bool = True, per_kv_head: bool = False):
    """``tiny_llama()`` on ``attn_implementation="sparse_k"`` with learned pattern ``name``; with
    ``random_selectors`` its selectors get seeded random weights (trained-like, not training-free);
    ``per_kv_head``: DSA indexers with one indexer per KV head."""
    import hf_sparse_attention
    from hf_sparse_attention.selectors import attach_selectors, create_selectors

    model = tiny_llama()
    hf_sparse_attention.configure(model, name, **params)
    model.set_attn_implementation("sparse_k")
    if random_selectors:
        torch.manual_seed(1)
        sels = create_selectors(model, per_kv_head=per_kv_head)
        with torch.no_grad():
            for sel in sels.values():
                for prm in sel.parameters():
                    prm.copy_(torch.randn_like(prm))
        attach_selectors(model, sels)
    return model


def random_slots(B: int, Hkv: int, NB: int, S: int, K: int, weights: bool, g: torch.Generator, full: bool = False):
    """``(indices, counts, weights)`` of a random token layout on the GPU: distinct keys of ``[0, S)``
    per (row, KV head, block), unsorted; counts in [0, K] (all K with ``full``); with ``weights``,
    weights in [0, 1) with about a tenth exactly 0 (ignored slots), else None."""
    idx = torch.rand(B, Hkv, NB, S, device="cuda", generator=g).topk(K, -1).indices.to(torch.int32)
    if full:
        cnt = torch.full((B, Hkv, NB), K, dtype=torch.int32, device="cuda")
    else:
        cnt = torch.randint(0, K + 1, (B, Hkv, NB), device="cuda", generator=g, dtype=torch.int32)
    w = None
    if weights:
        w = torch.rand(B, Hkv, NB, K, device="cuda", generator=g)
        w = torch.where(torch.rand(w.shape, device="cuda", generator=g) < 0.1, torch.zeros_like(w), w)
    return idx, cnt, w


def random_token_layout(B: int, Hkv: int, Sq: int, Skv: int, query_block: int, top_k: int, geo, gen: torch.Generator,
                        weights: bool = True, device="cpu") -> sk.TokenLayout:
    """A ``TokenLayout`` on ``device`` for ``Sq`` queries placed by ``geo`` (a ``RowGeometry``): per (row,
    KV head, query block) a random count in [0, top_k] of distinct sorted keys of ``[0, Skv)`` (int32,
    -1 padded); with ``weights``, weights in [0, 1) of which about a fifth are exactly 0."""
    qpos = geo.q_positions(Sq).expand(B, Sq).cpu()
    first = torch.div(qpos[:, 0], query_block, rounding_mode="floor")
    NB = int((torch.div(qpos[:, -1], query_block, rounding_mode="floor") - first).max()) + 1
    idx = torch.full((B, Hkv, NB, top_k), -1, dtype=torch.int32)
    cnt = torch.randint(0, top_k + 1, (B, Hkv, NB), generator=gen, dtype=torch.int32)
    for b in range(B):
        for h in range(Hkv):
            for n in range(NB):
                keys = torch.randperm(Skv, generator=gen)[:top_k].sort().values
                idx[b, h, n, : cnt[b, h, n]] = keys[: cnt[b, h, n]].int()
    w = None
    if weights:
        w = torch.rand(B, Hkv, NB, top_k, generator=gen) * (torch.rand(B, Hkv, NB, top_k, generator=gen) > 0.2)
        w = w.to(device)
    return sk.TokenLayout(idx.to(device), cnt.to(device), query_block, first.to(device), w)


def layout_sets(lay, geometry, Sq: int, B: int) -> dict:
    """``{(b, kv head, query block): selected key tensor indices}`` of a ``TokenLayout`` over the call's blocks
    (asserts the entries past each count are -1)."""
    out = {}
    qpos = geometry.q_positions(Sq).expand(B, Sq)
    for b in range(B):
        for blk in sorted({int(p) // lay.query_block for p in qpos[b].tolist() if p >= 0}):
            n = blk - int(lay.first_block[b])
            for h in range(lay.indices.shape[1]):
                c = int(lay.counts[b, h, n])
                idx = lay.indices[b, h, n].tolist()
                assert all(i == -1 for i in idx[c:]), "entries past the count must be -1"
                out[(b, h, blk)] = idx[:c]
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error ``||a - b|| / ||b||`` in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def structured_pattern(pattern_id: int, window: int, sinks: int) -> sk.Pattern:
    """The pattern behind a structured kernel's ``pattern_id``: 0 dense, 1 sliding_window, 2 streaming,
    3 block_diagonal (``window`` is its block)."""
    if pattern_id == 0:
        return sk.get_pattern("dense")
    if pattern_id == 1:
        return sk.get_pattern("sliding_window", window=window)
    if pattern_id == 3:
        return sk.get_pattern("block_diagonal", block=window)
    return sk.get_pattern("streaming", window=window, sinks=sinks)


#: Shapes of the Hopper CUDA structured kernels' GPU tests: odd lengths, GQA 1..8, every pattern, both
#: 16-bit dtypes. Each: (B, Hq, Hkv, S, dtype, pattern id, window, sinks).
STRUCTURED_CUDA_CASES = [
    (1, 4, 1, 1000, torch.bfloat16, 1, 256, 0),
    (2, 8, 2, 3001, torch.float16, 2, 1024, 64),
    (1, 8, 2, 1000, torch.bfloat16, 2, 256, 128),
    (2, 4, 4, 1000, torch.bfloat16, 0, 0, 0),
    (1, 8, 1, 1000, torch.float16, 1, 1024, 0),
    (1, 4, 2, 3001, torch.bfloat16, 1, 1024, 0),
    (1, 4, 2, 129, torch.bfloat16, 2, 64, 128),
    (1, 2, 1, 77, torch.float16, 1, 256, 0),
]
#: The structured forward's cases: ``STRUCTURED_CUDA_CASES`` (the backward's), block_diagonal (forward only) with a
#: block that is a multiple of the 128-row tiles, one that is not and a block shorter than a tile, three query
#: heads a KV head (the kernel's work-tile arithmetic divides by Hq, Hq / Hkv and the block by multiply-high:
#: divisors that are no power of two), and rows of 2,048 keys or more on average, where the launcher takes the
#: kernel's other variant (``kLongRowKeys`` in structured_fwd_sm90.cu): dense, a streaming window, a block of 6,400,
#: a window of 2,500 with three query heads a KV head; streaming with few sinks (1, 4, 16, 17: a sink tile of a few
#: keys; up to 16 take the kernel's narrow sink step) in both variants, on query tiles that have a sink tile and on
#: early ones whose window reaches key 0, and a window longer than the sequence (every sink step masked).
STRUCTURED_CUDA_FWD_CASES = STRUCTURED_CUDA_CASES + [
    (1, 4, 2, 3001, torch.bfloat16, 3, 512, 0),
    (2, 8, 2, 1000, torch.float16, 3, 200, 0),
    (2, 12, 4, 1000, torch.bfloat16, 1, 256, 0),
    (1, 6, 2, 777, torch.float16, 3, 200, 0),
    (1, 8, 8, 777, torch.bfloat16, 3, 48, 0),
    (1, 4, 2, 6211, torch.bfloat16, 0, 0, 0),
    (1, 4, 1, 5001, torch.float16, 2, 4096, 64),
    (1, 2, 2, 6600, torch.bfloat16, 3, 6400, 0),
    (1, 6, 2, 4999, torch.float16, 1, 2500, 0),
    (2, 8, 2, 3001, torch.bfloat16, 2, 512, 4),
    (1, 6, 2, 2999, torch.float16, 2, 300, 16),
    (1, 4, 1, 2000, torch.bfloat16, 2, 256, 17),
    (1, 4, 2, 5003, torch.bfloat16, 2, 2100, 1),
    (1, 4, 2, 700, torch.float16, 2, 1024, 4),
]


def structured_case_id(case) -> str:
    """pytest id of a ``STRUCTURED_CUDA_CASES`` entry."""
    B, Hq, Hkv, S, dtype, pid, window, sinks = case
    return f"B{B}-Hq{Hq}-Hkv{Hkv}-S{S}-{str(dtype)[6:]}-p{pid}-W{window}-s{sinks}"


#: Memory layouts of the strided-view tests: "bshd", each of q, k, v (and dO) a transposed view of its own
#: (B, S, H, D) tensor (a Transformers layer after RoPE; flash_api); "qkv", slices of one fused (B, S,
#: (Hq + 2 Hkv) * D) projection (row strides not those of any packed tensor).
VIEW_LAYOUTS = ("bshd", "qkv")


def bshd_views(B: int, Hq: int, Hkv: int, S: int, dtype, g: torch.Generator, layout: str, D: int = 128):
    """Random ``q (B, Hq, S, D)``, ``k, v (B, Hkv, S, D)`` and ``do`` (like q) on the GPU as strided
    views (``VIEW_LAYOUTS``), never contiguous (for ``Hq, Hkv, S > 1``)."""
    if layout == "bshd":
        return tuple(torch.randn(B, S, h, D, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
                     for h in (Hq, Hkv, Hkv, Hq))
    if layout != "qkv":
        raise ValueError(layout)
    qkv = torch.randn(B, S, (Hq + 2 * Hkv) * D, device="cuda", dtype=dtype, generator=g)
    q, k, v = qkv.split((Hq * D, Hkv * D, Hkv * D), dim=-1)
    do = torch.randn(B, S, Hq * D + 64, device="cuda", dtype=dtype, generator=g)[..., 64:]
    return tuple(t.unflatten(-1, (-1, D)).transpose(1, 2) for t in (q, k, v, do))


def nan_bshd(B: int, H: int, S: int, dtype, D: int = 128) -> torch.Tensor:
    """A NaN-filled ``(B, H, S, D)`` view of ``(B, S, H, D)`` storage (a poisoned strided output)."""
    return torch.full((B, S, H, D), float("nan"), device="cuda", dtype=dtype).transpose(1, 2)


#: Marks the tests of the Hopper CUDA kernels: they build the extensions, so they need an sm_90 GPU and nvcc.
needs_sm90 = pytest.mark.skipif(not sm90_available(), reason="needs an sm_90 GPU and nvcc")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread is faster than two and immune to a busy CI machine (autouse in
    the modules that import it)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


#: Source folders of the package's own code (a read from anywhere else is not counted).
_OURS = (os.sep + "kernel_src" + os.sep, os.sep + "hf_sparse_attention" + os.sep, os.sep + "sparse_k" + os.sep)
#: ``RowGeometry.host_offsets`` reads offsets that live on the CPU (on a GPU it returns None instead).
_CPU_ONLY = ("host_offsets",)


@contextlib.contextmanager
def host_reads():
    """Record every ``Tensor.item / tolist / __bool__ / __int__ / __index__ / __float__`` and ``torch.equal``
    called from the package's own code (on a GPU each is a device synchronisation)."""
    hits, saved = [], []

    def wrap(owner, name):
        orig = getattr(owner, name)
        saved.append((owner, name, orig))

        def spy(*a, **kw):
            frame = sys._getframe(1)
            path = frame.f_code.co_filename
            if any(r in path for r in _OURS) and frame.f_code.co_name not in _CPU_ONLY:
                hits.append(f"{name} at {os.path.basename(path)}:{frame.f_lineno} ({frame.f_code.co_name})")
            return orig(*a, **kw)

        setattr(owner, name, spy)

    for n in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__"):
        wrap(torch.Tensor, n)
    wrap(torch, "equal")
    try:
        yield hits
    finally:
        for owner, name, orig in saved:
            setattr(owner, name, orig)


def flag_help(help_text: str) -> dict[str, str]:
    """``{first option string: its help text}`` of an argparse ``--help`` text (wrapped lines joined; "" for a flag
    listed without a help text)."""
    blocks, flag = {}, None
    for line in help_text.splitlines():
        if line.startswith("  -"):
            invocation, _, rest = line.strip().partition("  ")
            flag = invocation.split()[0].rstrip(",")
            blocks[flag] = rest.strip()
        elif flag is not None and line.startswith("    "):
            blocks[flag] = (blocks[flag] + " " + line.strip()).strip()
        else:
            flag = None
    return blocks


def undescribed_flags(parser) -> list[str]:
    """The flags of ``parser`` whose ``--help`` entry has no text, does not show a default that is not None or
    False, does not say what the flag is when not given (no ``default`` in the text), or shows
    ``(default: None)``, each as ``"--flag: what is missing"``."""
    blocks, missing = flag_help(parser.format_help()), []
    for action in parser._actions:
        flag = action.option_strings[0] if action.option_strings else None
        if flag is None or flag == "-h":
            continue
        text = blocks.get(flag, "")
        if not text:
            missing.append(f"{flag}: no help text")
        elif action.default not in (None, False) and f"default: {action.default}" not in text:
            missing.append(f"{flag}: default {action.default!r} not shown in {text!r}")
        elif "default" not in text:
            missing.append(f"{flag}: no default stated in {text!r}")
        elif "(default: None)" in text:
            missing.append(f"{flag}: {text!r} shows (default: None)")
    return missing
