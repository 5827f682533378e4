"""Benchmark the sparse_k kernels against FlexAttention, FA4, SDPA flash and SDPA cuDNN.

Same inputs, same process, same BlockMask: FlexAttention gets ``layout.to_block_mask(...)`` of the
very layout our kernel runs (default ``kernel_options``, ``torch.compile``d). Every row is checked
before it is timed: against the exact float64 reference on a small shape of the same pattern, and
against the PyTorch path on the first and last query rows of the large shape; a failed check voids
the row (its time is not reported). A row's ``kernel`` (and ``token_kernel``, ``sw3072_kernel``) is
the name ``sparse_k.attention.plan`` gave the call's launches (``plan.recording``; e.g. ``cuda_sm90_structured``,
``triton_split_kv``, ``forward / backward`` pairs such as ``cuda_sm90_structured / cuda_sm90_structured_bwd``);
where it is a CUDA kernel, the Triton kernel is timed beside it (``cuda=False``).

Sections (each fits in a few minutes on an H100):

* ``--section fwd``: prefill forward, ``S`` in 4K/16K/64K/128K (+1M for window patterns, ours only
  where baselines cannot run), patterns dense, sliding_window, streaming, bigbird (``--patterns``: any of
  ``_patterns``, also block_diagonal, dilated and l2_aligned, in the fwd, bwd, tune, tune_structured and padded sections).
  ``--patterns token`` adds the token layout (query_block 128, top-2048 + window 1024) beside our own
  sliding window 3072 (effective TFLOP/s ratio), at each ``--head-dims`` entry.
* ``--section bwd``: backward only (gradients of q, k, v given the forward's graph).
* ``--section decode``: one query token against a long cache, B=8 (window, streaming, dense and a
  top-2048 token layout vs torch gather + SDPA); GB/s of K/V actually read
  (``ours us``: the kernels on a prebuilt layout, eager; ``graph us``: the same replayed from a CUDA
  graph, i.e. GPU time without host launch overhead; ``graph10 us``: a graph of 10 back-to-back
  calls per replay, per call, which also spreads the graph's own launch latency; ``api us``:
  ``sparse_attention`` end to end). The baselines are timed the same ways (``slice ...``,
  ``gather+sdpa ...``); compare like with like. The top-2048 row names its ``kernel`` (the Hopper CUDA
  decode where it applies) and times the Triton split-KV kernel beside it (``triton graph us``,
  ``triton graph10 us``), and both kernels' own GPU time from the profiler (``kernel us``, eager calls
  back to back). Tuning sweeps behind the decode defaults: ``scripts/tune_decode.py``.
* ``--section tune`` / ``tune_bwd``: the tile / warps / stages (/ TMA) sweeps behind the defaults
  (sliding window at the first ``--seqlens``).
* ``--section tune_structured``: the structured forward (``triton_structured``: arithmetic tile ranges)
  over tile shapes / warps / stages / program order (``STRUCTURED_VARIANTS``, the first is the
  default; ``--variants N`` keeps the first N) beside FlexAttention and (dense)
  cuDNN, for each ``--patterns`` entry at the first ``--seqlens``; other patterns (bigbird) run the
  layout path over ``LAYOUT_VARIANTS`` (Flex keeps the 128x128 BlockMask).
* ``--section tune_structured_bwd``: the structured backward's tile shapes / warps / stages / TMA /
  atomic dQ (``STRUCTURED_BWD_VARIANTS``, the first is the default; ``--variants N`` keeps the first
  N) beside the layout-path backward and Flex's, sliding window at the first ``--seqlens``, with the
  GPU time of each kernel (profiler).
* ``--compile-only --shard i/n`` (the two tune_structured sections): launch every n-th variant once, no
  checks, no timing — run n shards in parallel before a timed run to fill Triton's and Inductor's
  caches (compiling is then not paid on the GPU clock one variant after another).
* ``--section layouts``: the sliding_window forward (``--window``) at each ``--seqlens``
  through the entry points a model uses, same inputs, same process: ``sparse_attention`` on contiguous
  ``(B, H, S, D)`` tensors, ``flash_api.flash_attn_func`` on ``(B, S, H, D)`` tensors, ``sparse_attention``
  on transposed views of ``(B, S, H, D)`` storage (what a Transformers layer passes), and that call
  followed by the adapter's ``out.transpose(1, 2).contiguous()``; each row names the forward kernel that
  ran (e.g. ``cuda_sm90_structured``: the Hopper CUDA kernel took the call) and its time relative to the contiguous
  call; then forward + backward (gradients of q, k, v) from contiguous leaves and from ``(B, S, H, D)``
  leaves passed transposed (a layer in training; with ``--layouts-bwd``), the kernels named
  ``forward / backward``. The calls of a group are timed in turn, ``--rounds`` times (``ms``: the
  median over rounds).
* ``--section sparsek``: the SparseK operator, Triton kernel vs the PyTorch path (forward, forward +
  backward), after checking they agree; decides ``sparse_k.selection.sparsek.AUTO_TRITON_ON_CUDA``.
* ``--section padded``: a left-padded batch (B=2, the second row's first ``--pad`` keys masked, as Transformers
  pads a batch of prompts) through ``sparse_attention`` (``backend="auto"``) for each ``--patterns`` entry: the
  kernel the call reaches (``kernel``; a fallback's warning in ``warning``), checked against the PyTorch path on the
  first and last 256 queries, timed beside the same call without the mask (``unpadded_ms``) and, up to
  ``--padded-torch-max``, on the PyTorch path (``torch_path_ms``: what a call the kernels refuse costs). With
  ``--padded-backward`` the rows time forward + backward (the gradients of q, k, v; ``bwd_kernel``) instead, and up
  to ``--padded-torch-max`` check the gradients against the PyTorch path's (``err_grad``) before timing.
* ``--section l2``: issue item 9 — dense, sliding_window and l2_aligned at the first ``--seqlens`` in
  each program order (``o0`` query tiles fastest, ``o2`` heads fastest, ``o3`` GQA group adjacent);
  times each; with ``--single-launch`` every configuration launches exactly once (after one
  compile launch), in the printed order, for ``ncu --metrics lts__t_sector_hit_rate.pct ...``.

FA4 (``flash_attn.cute.flash_attn_func`` of the flash-attn-4 package, CuTe DSL) is timed beside the fwd and
bwd rows it can express when it is importable: dense causal and sliding_window (``window_size=(window - 1, 0)``) on
``(B, S, H, D)`` copies of the same inputs, its output checked like ours (forward) or its gradients against ours
(backward) before it is timed, in turn with ours for ``--fa4-rounds`` rounds (``ratio_vs_fa4``: the median of the
per-round ratios, ``ratio_vs_fa4_range`` their smallest and largest; a drift of the GPU's clocks between two
timings hits both); a streaming row times FA4's sliding window of the same window (FA4 has no sink
tokens: the kernel a user would otherwise run for a window). Where it is not importable, each such row says why
(``fa4_error``). It needs ``nvidia-cutlass-dsl`` and its libs wheels, and ``<site>/nvidia_cutlass_dsl/dsl_packages``
on ``PYTHONPATH``.

Effective TFLOP/s count only allowed (query, key) pairs: ``4 * Hq * D`` flops per pair (forward),
``10 * Hq * D`` (backward: 2.5x). Prints a table and writes JSON (``--json``).

Example: ``python scripts/benchmark_kernels.py --section fwd --json results/fwd.json``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
import warnings

import torch

import sparse_k
from sparse_k import build_block_layout, get_pattern, reference_attention, row_geometry, torch_sparse_attention
from sparse_k.attention.ops import block_attn

from hf_sparse_attention.evaluation.fa4_baseline import fa4_backward, fa4_counterpart, fa4_forward, load_fa4
from hf_sparse_attention.evaluation.side_by_side import paired_times

B_PREFILL, HQ, HKV = 1, 32, 8


def _patterns(window: int, sinks: int):
    """The patterns ``--patterns`` names (``window`` and ``sinks``: the flags)."""
    return {
        "dense": get_pattern("dense"),
        "sliding_window": get_pattern("sliding_window", window=window),
        "streaming": get_pattern("streaming", window=window, sinks=sinks),
        "bigbird": get_pattern("bigbird", block=128, window_blocks=1, global_blocks=2, random_blocks=3),
        # blocks as long as the window, so each query row does the same work as sliding_window's
        "block_diagonal": get_pattern("block_diagonal", block=window),
        "dilated": get_pattern("dilated", window=window // 4, scales=3),
        # the window in blocks of 128 plus the default anchors; segments sized to this GPU's L2 for D=128 bf16 K and V
        "l2_aligned": sparse_k.resolve_l2_segment(
            get_pattern("l2_aligned", block=128, window_blocks=max(1, window // 128)), 2 * HKV * 128 * 2),
    }


DEFAULT_PATTERNS = ["dense", "sliding_window", "streaming", "bigbird"]
L2_SECTION_PATTERNS = ("dense", "sliding_window", "l2_aligned")


def check_patterns(ap: argparse.ArgumentParser, args) -> None:
    """Fill ``args.patterns`` (default: ``L2_SECTION_PATTERNS`` for ``--section l2``, else ``DEFAULT_PATTERNS``) and
    check every name against the section's patterns (``_patterns``; ``token`` too for ``fwd``, only
    ``L2_SECTION_PATTERNS`` for ``l2``): a bad name, window or sink count ends the process through ``ap.error``."""
    try:
        names = list(_patterns(args.window, args.sinks))
    except ValueError as exc:
        ap.error(f"--window {args.window} / --sinks {args.sinks}: {exc}")
    if args.section == "l2":
        names = list(L2_SECTION_PATTERNS)
    elif args.section == "fwd":
        names.append("token")
    if args.patterns is None:
        args.patterns = list(L2_SECTION_PATTERNS if args.section == "l2" else DEFAULT_PATTERNS)
    unknown = [n for n in args.patterns if n not in names]
    if unknown:
        ap.error(f"argument --patterns: unknown pattern(s) {unknown} for --section {args.section}; "
                 f"a comma list of {', '.join(names)}")


def bench(fn, warmup_ms=25, rep_ms=200) -> float:
    """Median milliseconds of ``fn`` (CUDA events through triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graph_bench(fn, calls: int = 1, warmup_ms=25, rep_ms=200) -> float:
    """Median milliseconds per call of ``fn`` replayed from a CUDA graph holding ``calls`` back-to-back
    calls (host launch overhead removed; ``calls > 1`` also spreads the graph's own launch latency,
    ~10 us on the H100 machine, over the calls). do_bench clears the L2 before each replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # the warm-up stream: per-stream buffers already exist
        for _ in range(calls):
            fn()
    return bench(graph.replay, warmup_ms, rep_ms) / calls


def allowed_pairs(layout, q_len: int) -> int:
    """Exact number of allowed (query, key) pairs, summed over the layout's H' rows (batch row 0)."""
    bq, bk = layout.block_q, layout.block_k
    dev = layout.kv_num_blocks.device
    total = 0
    fnum = layout.full_kv_num_blocks[0].long()  # (H', NQ)
    for h in range(fnum.shape[0]):
        nq = torch.arange(layout.num_q_blocks, device=dev)
        rows = (torch.clamp((nq + 1) * bq, max=q_len) - nq * bq)
        fidx = layout.full_kv_indices[0, h].long()
        slot = torch.arange(fidx.shape[-1], device=dev)
        cols = torch.clamp((fidx + 1) * bk, max=layout.kv_len) - fidx * bk
        cols = torch.where(slot < fnum[h].unsqueeze(-1), cols, torch.zeros_like(cols))
        total += int((rows * cols.sum(-1)).sum().item())
        pnum = layout.kv_num_blocks[0, h].long()
        pidx = layout.kv_indices[0, h].long()
        P = pidx.shape[-1]
        step = max(1, (1 << 24) // max(1, P * bq * bk))
        for m0 in range(0, layout.num_q_blocks, step):
            m1 = min(layout.num_q_blocks, m0 + step)
            q_idx = (torch.arange(m0, m1, device=dev).view(-1, 1, 1, 1) * bq + torch.arange(bq, device=dev).view(1, 1, -1, 1))
            k_idx = (pidx[m0:m1].view(m1 - m0, P, 1, 1) * bk + torch.arange(bk, device=dev).view(1, 1, 1, -1))
            ok = layout.element_rule(q_idx, k_idx, torch.zeros((), dtype=torch.long, device=dev), torch.full((), h, device=dev))
            ok = ok & (q_idx < q_len) & (k_idx < layout.kv_len)
            ok = ok & (torch.arange(P, device=dev).view(1, P, 1, 1) < pnum[m0:m1].view(-1, 1, 1, 1))
            total += int(ok.sum().item())
    return total


def token_selection(B: int, Sq: int, Skv: int, pattern, dev):
    """A ``TokenLayout`` with ``top_k`` keys per query block spread evenly over the candidates
    ``[sinks, block_start - window]`` (design §6), the same for every row and KV head."""
    QB, K, W, S0 = pattern.query_block, pattern.top_k, pattern.window, pattern.sinks
    q0 = Skv - Sq
    first = q0 // QB
    NB = (Skv - 1) // QB - first + 1
    b0 = (first + torch.arange(NB, device=dev)) * QB
    cand = (b0 - W - S0 + 1).clamp_min(0)  # (NB,)
    j = torch.arange(K, device=dev)
    spread = S0 + torch.div(j[None, :] * cand[:, None], K, rounding_mode="floor")
    idx = torch.where(cand[:, None] >= K, spread, S0 + j[None, :]).to(torch.int32)
    cnt = cand.clamp_max(K).to(torch.int32)
    idx = idx[None, None].expand(B, HKV, NB, K)
    cnt = cnt[None, None].expand(B, HKV, NB)
    return sparse_k.TokenLayout(idx, cnt, QB, torch.full((B,), first, dtype=torch.int64, device=dev))


def selected_pairs(sel, Sq: int, Skv: int) -> int:
    """Selected (query, key) pairs of one head (every selected key lies outside the static part)."""
    qpos = torch.arange(Skv - Sq, Skv, device=sel.counts.device)
    blk = torch.div(qpos, sel.query_block, rounding_mode="floor") - sel.first_block[0]
    return int(sel.counts[0, 0].long()[blk].sum().item())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------- baselines
_FLEX = None


def flex_fn():
    global _FLEX
    if _FLEX is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 256
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = 256
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def sdpa(q, k, v, backend_name: str, causal=True):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bk = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    with sdpa_kernel(bk):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _fa4_call(p, row):
    """``(fa4, window_size, pattern FA4 computes)`` for a row of pattern ``p``, or None (``p`` has no FA4
    counterpart, or FA4 is not importable: the row says so)."""
    fa4, counterpart = load_fa4(), fa4_counterpart(p)
    if counterpart is None:
        return None
    if isinstance(fa4, str):
        row["fa4_error"] = fa4
        return None
    return (fa4, *counterpart)


def _fa4_timed(ours, call, rounds, row):
    """FA4's ``call`` timed in turn with ``ours`` (``paired_times``, 100 ms a timing): ``fa4_ms``, ``ratio_vs_fa4``
    (the median of the per-round ratios FA4 / ours) and its range over the rounds."""
    t = paired_times(ours, call, rounds, lambda fn: bench(fn, rep_ms=100))
    row["fa4_ms"], row["ours_ms_paired"] = t["theirs_ms"], t["ours_ms"]
    row["ratio_vs_fa4"] = t["ratio"]
    row["ratio_vs_fa4_range"] = [round(t["ratio_min"], 4), round(t["ratio_max"], 4)]


def _fa4_fwd(p, q, k, v, ours, scale, row, rounds):
    """FA4 beside a forward row: checked on the first and last query rows, then timed in turn with ``ours``."""
    found = _fa4_call(p, row)
    if found is None:
        return
    fa4, window_size, fa4_pattern = found
    if fa4_pattern is not p:
        row["fa4_runs"] = f"sliding_window {p.window} (no sinks)"
    out, call = fa4_forward(fa4, q, k, v, scale=scale, window_size=window_size)
    row["err_fa4"] = large_check(q, k, v, None, out, pattern=fa4_pattern)
    if not row["err_fa4"] < TOL:  # NaN fails too
        row["fa4_error"] = f"check failed ({row['err_fa4']:.2e})"
        return
    _fa4_timed(ours, call, rounds, row)


def _fa4_bwd(p, q, k, v, do, grads, ours, scale, row, rounds):
    """FA4's backward beside a bwd row (same pattern only): its gradients against ours, then timed in turn with
    ``ours``."""
    found = _fa4_call(p, row)
    if found is None:
        return
    fa4, window_size, fa4_pattern = found
    if fa4_pattern is not p:
        row["fa4_error"] = "FA4 has no sink tokens"
        return
    fa4_grads, call = fa4_backward(fa4, q, k, v, do, scale=scale, window_size=window_size)
    row["err_fa4_grads"] = max(rel_err(a, b) for a, b in zip(fa4_grads, grads))
    if not row["err_fa4_grads"] < TOL:
        row["fa4_error"] = f"gradient check failed ({row['err_fa4_grads']:.2e})"
        return
    _fa4_timed(ours, call, rounds, row)


# ---------------------------------------------------------------- checks
def small_check(pattern, D: int, dtype, section: str) -> float:
    """Relative error of our kernel vs the exact float64 reference (and of the gradients for bwd)."""
    S = 1000 if not isinstance(pattern, sparse_k.BigBird) else 1024
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(int(time.time()) % 100000)
    q = torch.randn(1, HQ, S, D, device=dev, dtype=dtype, generator=g)
    k = torch.randn(1, HKV, S, D, device=dev, dtype=dtype, generator=g)
    v = torch.randn(1, HKV, S, D, device=dev, dtype=dtype, generator=g)
    geo = row_geometry(1, S, S, None, device=dev)
    scale = D ** -0.5
    if section == "bwd":
        for t in (q, k, v):
            t.requires_grad_()
    out = sparse_k.sparse_attention(q, k, v, pattern, backend="triton")
    qd, kd, vd = (t.detach().double().requires_grad_(section == "bwd") for t in (q, k, v))
    ref, _ = reference_attention(qd, kd, vd, pattern, geo, scale=scale)
    err = rel_err(out, ref)
    if section == "bwd":
        do = torch.randn_like(out)
        g1 = torch.autograd.grad(out, (q, k, v), do)
        g2 = torch.autograd.grad(ref, (qd, kd, vd), do.double())
        err = max([err] + [rel_err(a, b) for a, b in zip(g1, g2)])
    return err


def large_check(q, k, v, layout, out, rows=256, pattern=None) -> float:
    """Relative error of ``out`` on the first and last ``rows`` queries vs the PyTorch path (of ``layout``'s
    pattern, or of ``pattern``, layer 0, where given)."""
    S = q.shape[2]
    errs = []
    pattern, layer_idx = (layout.pattern, layout.layer_idx) if pattern is None else (pattern, 0)
    for q0 in (0, max(0, S - rows)):
        n = min(rows, S - q0)
        geo = row_geometry(1, n, k.shape[2], None, q_start=q0, device=q.device)
        lay = build_block_layout(pattern, n, k.shape[2], geo, block_q=64, block_k=128,
                                 layer_idx=layer_idx, num_kv_heads=k.shape[1])
        ref, _ = torch_sparse_attention(q[:, :, q0 : q0 + n], k, v, lay, scale=q.shape[-1] ** -0.5)
        errs.append(rel_err(out[:, :, q0 : q0 + n], ref))
    return max(errs)


TOL = 2e-2  # bf16 operands: relative errors of 1e-3..1e-2 are rounding (design §10); a wrong kernel gives O(1)


# ---------------------------------------------------------------- sections
def _record_row(results, row, fill):
    """Run ``fill()`` (it writes into ``row``), then append ``row`` to ``results`` and print it; an OOM or any other
    error is written into the row instead (one failing row must not end the section)."""
    try:
        fill()
    except torch.OutOfMemoryError as e:
        row["error"] = f"OOM: {str(e)[:80]}"
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
    torch.cuda.empty_cache()
    results.append(row)
    print(json.dumps(row), flush=True)


def section_fwd(args, results):
    dev = "cuda"
    dtype = torch.bfloat16
    pats = _patterns(args.window, args.sinks)
    if "token" in args.patterns:
        _token_fwd_rows(args, results)
    for D in args.head_dims:
        for name in [n for n in args.patterns if n != "token"]:
            p = pats[name]
            err_small = small_check(p, D, dtype, "fwd")
            for S in args.seqlens:
                if S > 131072 and name in ("dense", "bigbird"):
                    continue
                row = dict(section="fwd", pattern=name, S=S, D=D)
                _record_row(results, row, lambda: _fwd_row(p, S, D, dtype, dev, err_small, row, args))


def _inputs(B, S, D, dtype, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, HQ, S, D, device=dev, dtype=dtype, generator=g)
    k = torch.randn(B, HKV, S, D, device=dev, dtype=dtype, generator=g)
    v = torch.randn(B, HKV, S, D, device=dev, dtype=dtype, generator=g)
    return q, k, v


def ran(fn):
    """``(fn(), label)``: the kernels ``sparse_k.attention.plan`` named for the launches of one call of ``fn``
    (``plan.recording``), e.g. "cuda_sm90_structured" or "cuda_sm90_structured / cuda_sm90_structured_bwd"."""
    from sparse_k.attention import plan

    with plan.recording() as seen:
        result = fn()
    return result, " / ".join(dict.fromkeys(x.kernel for x in seen)) or "none"


def _is_cuda(label: str) -> bool:
    return all(name.startswith("cuda_") for name in label.split(" / "))


def _fwd_row(p, S, D, dtype, dev, err_small, row, args):
    q, k, v = _inputs(1, S, D, dtype, dev, S + D)
    geo = row_geometry(1, S, S, None, device=dev)
    from sparse_k.attention.plan import bigbird_cuda, plan_tiles

    bigbird = isinstance(p, sparse_k.BigBird)
    tiles = plan_tiles(q_len=S, group=HQ // HKV, head_dim=D, device_type="cuda", need_grad=False, selection=False,
                       bigbird_block=p.block if bigbird else None,
                       bigbird_cuda=bigbird and bigbird_cuda(p.block, p.causal, q, k, v, geo, False))  # the backend's
    bm, bn = tiles.block_q, tiles.block_k
    t0 = time.time()
    layout = build_block_layout(p, S, S, geo, block_q=bm, block_k=bn, num_kv_heads=HKV)
    row["layout_build_s"] = round(time.time() - t0, 3)
    pairs = allowed_pairs(layout, S) * (HQ if layout.kv_num_blocks.shape[1] == 1 else HQ // HKV)
    flops = 4.0 * pairs * D
    scale = D ** -0.5
    torch.cuda.reset_peak_memory_stats()
    base_mem = torch.cuda.memory_allocated()
    (out, _), row["kernel"] = ran(lambda: block_attn(q, k, v, layout, scale=scale))
    torch.cuda.synchronize()
    row["extra_mem_gb"] = round((torch.cuda.max_memory_allocated() - base_mem - out.numel() * out.element_size()) / 2**30, 3)
    err_large = large_check(q, k, v, layout, out)
    row["err_small"], row["err_large"] = err_small, err_large
    ok = err_small < TOL and err_large < TOL
    row["ours_ms"] = bench(lambda: block_attn(q, k, v, layout, scale=scale)) if ok else None
    if not ok:
        row["error"] = "correctness check failed: row void"
    row["tflops_ours"] = flops / row["ours_ms"] / 1e9 if row["ours_ms"] else None
    if ok and _is_cuda(row["kernel"]):  # the portable Triton kernel beside it, same inputs
        from sparse_k.attention import dispatch

        lay_triton = layout
        if bigbird:  # Triton's own tiles for bigbird (bigbird_tiles without the CUDA kernel)
            t_tiles = plan_tiles(q_len=S, group=HQ // HKV, head_dim=D, device_type="cuda", need_grad=False,
                                 selection=False, bigbird_block=p.block)
            lay_triton = build_block_layout(p, S, S, geo, block_q=t_tiles.block_q, block_k=t_tiles.block_k,
                                            num_kv_heads=HKV)
        triton_call = lambda: dispatch.attention_forward(q, k, v, lay_triton, scale=scale, cuda=False)
        row["err_large_triton"] = large_check(q, k, v, layout, triton_call()[0])
        if row["err_large_triton"] < TOL:
            row["triton_ms"] = bench(triton_call)
            row["tflops_triton"] = flops / row["triton_ms"] / 1e9
    if ok:
        try:
            _fa4_fwd(p, q, k, v, lambda: block_attn(q, k, v, layout, scale=scale), scale, row, args.fa4_rounds)
            if row.get("fa4_ms") and "fa4_runs" not in row:
                row["tflops_fa4"] = flops / row["fa4_ms"] / 1e9
        except Exception as e:  # noqa: BLE001 — a baseline failing is reported, not fatal
            row["fa4_error"] = f"{type(e).__name__}: {str(e)[:120]}"
        torch.cuda.empty_cache()
    if S <= args.flex_max:
        try:
            lay_flex = layout
            if isinstance(p, sparse_k.BigBird) and (bm, bn) != (p.block, p.block):  # Flex: the pattern's own blocks
                lay_flex = build_block_layout(p, S, S, geo, block_q=p.block, block_k=p.block, num_kv_heads=HKV)
            bm_flex = lay_flex.to_block_mask(1, HQ)
            flex = flex_fn()
            o_flex = flex(q, k, v, block_mask=bm_flex, enable_gqa=True, scale=scale)
            e_flex = large_check(q, k, v, layout, o_flex)
            row["err_flex"] = e_flex
            if e_flex < TOL:
                row["flex_ms"] = bench(lambda: flex(q, k, v, block_mask=bm_flex, enable_gqa=True, scale=scale))
                row["ratio_vs_flex"] = row["flex_ms"] / row["ours_ms"] if row["ours_ms"] else None
                if row.get("triton_ms"):
                    row["ratio_triton_vs_flex"] = row["flex_ms"] / row["triton_ms"]
            del o_flex, bm_flex
        except Exception as e:  # noqa: BLE001 — a baseline failing is reported, not fatal
            row["flex_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    if p.name == "dense" and S <= 131072:
        for bname in ("flash", "cudnn"):
            try:
                o_b = sdpa(q, k, v, bname)
                e_b = large_check(q, k, v, layout, o_b)
                if e_b < TOL:
                    row[f"sdpa_{bname}_ms"] = bench(lambda: sdpa(q, k, v, bname))
                    row[f"ratio_vs_{bname}"] = row[f"sdpa_{bname}_ms"] / row["ours_ms"] if row["ours_ms"] else None
                else:
                    row[f"sdpa_{bname}_error"] = f"check failed ({e_b:.2e})"
                del o_b
            except Exception as e:  # noqa: BLE001
                row[f"sdpa_{bname}_error"] = f"{type(e).__name__}: {str(e)[:120]}"


def _token_fwd_rows(args, results):
    """Token layout (query_block 128, top-2048 + window 1024) vs our sliding window 3072 at each S and head dim."""
    dev, dtype = "cuda", torch.bfloat16
    p_tok = get_pattern("sparse_k", sinks=0, window=1024, top_k=2048, query_block=128)
    p_sw = get_pattern("sliding_window", window=3072)
    for D, S in [(D, S) for D in args.head_dims for S in args.seqlens]:
        if S > 131072:
            continue
        row = dict(section="fwd", pattern="token_top2048_w1024", S=S, D=D)
        try:
            q, k, v = _inputs(1, S, D, dtype, dev, S + 5)
            geo = row_geometry(1, S, S, None, device=dev)
            sel = token_selection(1, S, S, p_tok, dev)
            from sparse_k.attention.plan import plan_tiles

            tiles = plan_tiles(q_len=S, group=HQ // HKV, head_dim=D, device_type="cuda", need_grad=False, selection=True)
            rows_, pack, bn = tiles.block_q, tiles.pack, tiles.block_k  # the backend's own tiles
            row["tile"] = f"{rows_ * pack}x{bn} pack {pack}"  # the Triton token kernel's (token_kernel: which ran)
            lay = build_block_layout(p_tok, S, S, geo, block_q=rows_, block_k=bn, num_kv_heads=HKV)
            (out, _), row["token_kernel"] = ran(lambda: block_attn(q, k, v, lay, scale=D ** -0.5, selection=sel, pack=pack))
            errs = []
            for q0 in (0, S - 256):
                ref = sparse_k.sparse_attention(q[:, :, q0 : q0 + 256], k, v, p_tok, backend="torch", selection=sel, q_start=q0)
                errs.append(rel_err(out[:, :, q0 : q0 + 256], ref))
            row["err_large"] = max(errs)
            pairs = (allowed_pairs(lay, S) + selected_pairs(sel, S, S)) * HQ
            if row["err_large"] < TOL:
                row["ours_ms"] = bench(lambda: block_attn(q, k, v, lay, scale=D ** -0.5, selection=sel, pack=pack))
                row["tflops_ours"] = 4.0 * pairs * D / row["ours_ms"] / 1e9
                from sparse_k.attention import dispatch

                if _is_cuda(row["token_kernel"]):  # the Triton token kernel too, for comparison
                    row["token_triton_ms"] = bench(lambda: dispatch.attention_forward(
                        q, k, v, lay, scale=D ** -0.5, selection=sel, pack=pack, cuda=False))
                    row["tflops_token_triton"] = 4.0 * pairs * D / row["token_triton_ms"] / 1e9
            else:
                row["error"] = "correctness check failed: row void"
            lay_sw = build_block_layout(p_sw, S, S, geo, block_q=128, block_k=128, num_kv_heads=HKV)
            sw_flops = 4.0 * allowed_pairs(lay_sw, S) * HQ * D
            _, row["sw3072_kernel"] = ran(lambda: block_attn(q, k, v, lay_sw, scale=D ** -0.5))
            sw_ms = bench(lambda: block_attn(q, k, v, lay_sw, scale=D ** -0.5))
            row["sw3072_ms"] = sw_ms
            row["sw3072_tflops"] = sw_flops / sw_ms / 1e9
            if _is_cuda(row["sw3072_kernel"]):  # the Triton sliding-window kernel too
                from sparse_k.attention import dispatch

                row["sw3072_triton_ms"] = bench(
                    lambda: dispatch.attention_forward(q, k, v, lay_sw, scale=D ** -0.5, cuda=False))
                row["sw3072_triton_tflops"] = sw_flops / row["sw3072_triton_ms"] / 1e9
            if row.get("tflops_ours"):
                row["tflops_ratio_vs_sw3072"] = row["tflops_ours"] / row["sw3072_tflops"]
                if row.get("sw3072_triton_tflops"):
                    row["tflops_ratio_vs_sw3072_triton"] = row["tflops_ours"] / row["sw3072_triton_tflops"]
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        results.append(row)
        print(json.dumps(row), flush=True)


def section_bwd(args, results):
    dev = "cuda"
    dtype = torch.bfloat16
    pats = _patterns(args.window, args.sinks)
    for D in args.head_dims:
        for name in args.patterns:
            p = pats[name]
            err_small = small_check(p, D, dtype, "bwd")
            for S in args.seqlens:
                if S > 131072:
                    continue
                row = dict(section="bwd", pattern=name, S=S, D=D, err_small=err_small)
                _record_row(results, row, lambda: _bwd_row(p, S, D, dtype, dev, err_small, row, args))


def _bwd_kernel_rows(p, q, k, v, do, layout, scale, flops, row):
    """Which backward kernel runs (``plan``'s name, recorded on the same inputs) and, for a CUDA one, the
    Triton backward beside it on the same inputs (gradients compared, then timed)."""
    from sparse_k.attention import dispatch

    with torch.no_grad():
        out, lse = block_attn(q, k, v, layout, scale=scale)
    grads, row["kernel"] = ran(lambda: dispatch.attention_backward(do, q, k, v, out, lse, layout, scale=scale)[:3])
    if not _is_cuda(row["kernel"]):
        return
    triton_call = lambda: dispatch.attention_backward(do, q, k, v, out, lse, layout, scale=scale, cuda=False)
    row["err_grads_vs_triton"] = max(rel_err(a, b) for a, b in zip(grads, triton_call()[:3]))
    if row["err_grads_vs_triton"] < TOL:
        row["triton_ms"] = bench(triton_call)
        row["tflops_triton"] = flops / row["triton_ms"] / 1e9


def _bwd_row(p, S, D, dtype, dev, err_small, row, args):
    q, k, v = _inputs(1, S, D, dtype, dev, S + D + 1)
    for t in (q, k, v):
        t.requires_grad_()
    scale = D ** -0.5
    out = sparse_k.sparse_attention(q, k, v, p, backend="triton")
    do = torch.randn_like(out)
    geo = row_geometry(1, S, S, None, device=dev)
    from sparse_k.attention.plan import tile_config

    bm, bn = (128, 128) if isinstance(p, sparse_k.BigBird) else tile_config(D, "cuda", True)
    layout = build_block_layout(p, S, S, geo, block_q=bm, block_k=bn, num_kv_heads=HKV)
    pairs = allowed_pairs(layout, S) * (HQ if layout.kv_num_blocks.shape[1] == 1 else HQ // HKV)
    flops = 10.0 * pairs * D
    ok = err_small < TOL
    if ok:
        row["ours_ms"] = bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
        row["tflops_ours"] = flops / row["ours_ms"] / 1e9
        _bwd_kernel_rows(p, q, k, v, do, layout, scale, flops, row)
        try:
            grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
            _fa4_bwd(p, q, k, v, do, grads, lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), scale,
                     row, args.fa4_rounds)
            if row.get("fa4_ms"):
                row["tflops_fa4"] = flops / row["fa4_ms"] / 1e9
            del grads
        except Exception as e:  # noqa: BLE001 — a baseline failing is reported, not fatal
            row["fa4_error"] = f"{type(e).__name__}: {str(e)[:120]}"
        torch.cuda.empty_cache()
    else:
        row["error"] = "correctness check failed: row void"
    if S <= args.flex_max:
        try:
            flex_layout = build_block_layout(p, S, S, geo, block_q=128, block_k=128, num_kv_heads=HKV)
            bm_flex = flex_layout.to_block_mask(1, HQ)
            flex = flex_fn()
            o_flex = flex(q, k, v, block_mask=bm_flex, enable_gqa=True, scale=scale)
            row["err_flex_fwd"] = rel_err(o_flex, out)
            row["flex_ms"] = bench(lambda: torch.autograd.grad(o_flex, (q, k, v), do, retain_graph=True))
            row["ratio_vs_flex"] = row["flex_ms"] / row["ours_ms"] if row.get("ours_ms") else None
            if row.get("triton_ms"):
                row["ratio_triton_vs_flex"] = row["flex_ms"] / row["triton_ms"]
            del o_flex
        except Exception as e:  # noqa: BLE001
            row["flex_error"] = f"{type(e).__name__}: {str(e)[:120]}"


def section_decode(args, results):
    dev = "cuda"
    dtype = torch.bfloat16
    B, D = 8, 128
    pats = _patterns(args.window, args.sinks)
    for S in args.decode_lens:
        g = torch.Generator(device=dev).manual_seed(S)
        # Transformers' cache layout (B, Hkv, S, D); the kernel reads it in place.
        k = torch.randn(B, HKV, S, D, device=dev, dtype=dtype, generator=g)
        v = torch.randn(B, HKV, S, D, device=dev, dtype=dtype, generator=g)
        q = torch.randn(B, HQ, 1, D, device=dev, dtype=dtype, generator=g)
        for name in ("sliding_window", "streaming", "dense", "token_top2048"):
            row = dict(section="decode", pattern=name, S=S, D=D, B=B)
            try:
                if name == "token_top2048":
                    _decode_token_row(q, k, v, S, D, B, row)
                else:
                    _decode_row(pats[name], name, q, k, v, S, D, B, row, args)
            except Exception as e:  # noqa: BLE001 — one failing row must not end the section
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            results.append(row)
            print(json.dumps(row), flush=True)


def _decode_token_row(q, k, v, S, D, B, row):
    """Top-2048 token layout at decode vs torch gather of the same 2048 keys + SDPA."""
    p = get_pattern("sparse_k", sinks=0, window=1, top_k=2048, query_block=128)
    sel = token_selection(B, 1, S, p, q.device)
    out = sparse_k.sparse_attention(q, k, v, p, backend="triton", selection=sel)
    ref = sparse_k.sparse_attention(q, k, v, p, backend="torch", selection=sel)
    row["err"] = rel_err(out, ref)
    from sparse_k.attention import dispatch
    from sparse_k.attention.plan import plan_tiles, split_count

    tiles = plan_tiles(q_len=1, group=HQ // HKV, head_dim=D, device_type="cuda", need_grad=False, selection=False)
    rows_, pack, bn = tiles.block_q, tiles.pack, tiles.block_k
    geo = row_geometry(B, 1, S, None, device=q.device)
    klay = build_block_layout(p, 1, S, geo, block_q=rows_, block_k=bn, num_kv_heads=HKV)
    tiles = klay.kv_indices.shape[-1] + klay.full_kv_indices.shape[-1] + 2048 // bn
    splits = split_count(B * HKV * (HQ // HKV // pack), tiles, q.device, gathered=True)
    row["splits"] = splits

    def fn():
        return block_attn(q, k, v, klay, scale=D ** -0.5, pack=pack, num_splits=splits, selection=sel)

    def triton_fn():
        return dispatch.attention_forward(q, k, v, klay, scale=D ** -0.5, pack=pack, num_splits=splits,
                                          selection=sel, cuda=False)

    (o_k, _), row["kernel"] = ran(fn)
    cuda = _is_cuda(row["kernel"])
    row["err_kernel"] = rel_err(o_k, ref)
    nbytes = 2 * B * HKV * 2049 * D * k.element_size()
    if max(row["err"], row["err_kernel"]) < TOL:
        row["ours_us"] = 1e3 * bench(fn)
        row["graph_us"] = 1e3 * graph_bench(fn)
        row["graph10_us"] = 1e3 * graph_bench(fn, calls=10)
        row["gbps_ours"] = nbytes / (row["graph10_us"] * 1e-6) / 1e9
        row["kernel_us"] = 1e3 * sum(kernel_times(fn, iters=20).values())  # GPU time of the kernels alone (profiler)
        if cuda:  # the Triton split-KV kernel beside it, same inputs
            row["err_triton"] = rel_err(triton_fn()[0], ref)
            if row["err_triton"] < TOL:
                row["triton_graph_us"] = 1e3 * graph_bench(triton_fn)
                row["triton_graph10_us"] = 1e3 * graph_bench(triton_fn, calls=10)
                row["triton_kernel_us"] = 1e3 * sum(kernel_times(triton_fn, iters=20).values())
    else:
        row["error"] = "correctness check failed: row void"
    blk = sel.indices[:, :, -1].long()  # (B, Hkv, 2048): the decode query's block

    def gather_sdpa():
        kg = k.gather(2, blk[..., None].expand(-1, -1, -1, D))
        vg = v.gather(2, blk[..., None].expand(-1, -1, -1, D))
        return sdpa(q, kg, vg, "flash", causal=False)

    row["gather_sdpa_us"] = 1e3 * bench(gather_sdpa)
    row["gather_sdpa_graph_us"] = 1e3 * graph_bench(gather_sdpa)
    row["gather_sdpa_graph10_us"] = 1e3 * graph_bench(gather_sdpa, calls=10)
    if row.get("graph10_us"):
        row["ratio_vs_gather_sdpa_graph10"] = row["gather_sdpa_graph10_us"] / row["graph10_us"]


def _decode_row(p, name, q, k, v, S, D, B, row, args):
    """One decode row: check against the PyTorch path, then time eager, graph-replayed and end to end."""
    dev = q.device
    out = sparse_k.sparse_attention(q, k, v, p, backend="triton")
    geo = row_geometry(B, 1, S, None, device=dev)
    lay = build_block_layout(p, 1, S, geo, block_q=1, block_k=128, num_kv_heads=HKV)
    ref, _ = torch_sparse_attention(q, k, v, lay, scale=D ** -0.5)
    row["err"] = rel_err(out, ref)
    keys = min(S, args.window + (args.sinks if name == "streaming" else 0)) if name != "dense" else S
    nbytes = 2 * B * HKV * keys * D * k.element_size()
    if row["err"] < TOL:
        from sparse_k.attention.plan import plan_tiles, split_count

        tiles = plan_tiles(q_len=1, group=HQ // HKV, head_dim=D, device_type="cuda", need_grad=False, selection=False)
        rows_, pack, bn = tiles.block_q, tiles.pack, tiles.block_k
        klay = build_block_layout(p, 1, S, geo, block_q=rows_, block_k=bn, num_kv_heads=HKV)
        tiles = klay.kv_indices.shape[-1] + klay.full_kv_indices.shape[-1]
        splits = split_count(B * HKV * (HQ // HKV // pack), tiles, q.device)
        o_k, _ = block_attn(q, k, v, klay, scale=D ** -0.5, pack=pack, num_splits=splits)
        row["err_kernel"] = rel_err(o_k, ref)
        row["splits"] = splits
        row["ours_us"] = 1e3 * bench(lambda: block_attn(q, k, v, klay, scale=D ** -0.5, pack=pack, num_splits=splits))
        row["graph_us"] = 1e3 * graph_bench(lambda: block_attn(q, k, v, klay, scale=D ** -0.5, pack=pack, num_splits=splits))
        row["graph10_us"] = 1e3 * graph_bench(
            lambda: block_attn(q, k, v, klay, scale=D ** -0.5, pack=pack, num_splits=splits), calls=10)
        for alt in (1, 4) if name != "dense" else ():  # beside the default split count
            row[f"graph10_us_splits{alt}"] = 1e3 * graph_bench(
                lambda: block_attn(q, k, v, klay, scale=D ** -0.5, pack=pack, num_splits=alt), calls=10
            )
        row["api_us"] = 1e3 * bench(lambda: sparse_k.sparse_attention(q, k, v, p, backend="triton"))
        row["gbps_ours"] = nbytes / (row["graph10_us"] * 1e-6) / 1e9
    else:
        row["error"] = "correctness check failed: row void"
    if name == "dense":
        row["sdpa_flash_us"] = 1e3 * bench(lambda: sdpa(q, k, v, "flash", causal=False))
    elif name == "sliding_window":
        ks, vs = k[:, :, -args.window :], v[:, :, -args.window :]
        row["sdpa_window_slice_us"] = 1e3 * bench(lambda: sdpa(q, ks, vs, "flash", causal=False))
        row["sdpa_window_slice_graph_us"] = 1e3 * graph_bench(lambda: sdpa(q, ks, vs, "flash", causal=False))
        row["sdpa_window_slice_graph10_us"] = 1e3 * graph_bench(lambda: sdpa(q, ks, vs, "flash", causal=False), calls=10)


def section_tune(args, results):
    """Sweep tile shapes, warps, stages and TMA for the sliding-window forward (first of --seqlens)."""
    from sparse_k.attention import dispatch

    dev, dtype, D = "cuda", torch.bfloat16, args.head_dims[0]
    S = args.seqlens[0]
    pats = _patterns(args.window, args.sinks)
    q, k, v = _inputs(1, S, D, dtype, dev, 11)
    geo = row_geometry(1, S, S, None, device=dev)
    scale = D ** -0.5
    variants = [
        (128, 128, 8, 3, True), (128, 128, 8, 2, True), (128, 128, 8, 4, True), (128, 64, 4, 3, True),
        (128, 64, 8, 3, True), (128, 64, 4, 4, True), (64, 64, 4, 3, True), (128, 128, 8, 3, False),
        (128, 64, 4, 3, False), (128, 32, 4, 4, True), (128, 128, 4, 3, True), (128, 128, 4, 2, True),
    ]
    for name in args.patterns:
        p = pats[name]
        flex_ms = None
        for bm, bn, warps, stages, tma in variants:
            row = dict(section="tune", pattern=name, S=S, D=D, tile=f"{bm}x{bn}", warps=warps, stages=stages, tma=tma)
            try:
                lay = build_block_layout(p, S, S, geo, block_q=bm, block_k=bn, num_kv_heads=HKV)
                pairs = allowed_pairs(lay, S) * (HQ if lay.kv_num_blocks.shape[1] == 1 else HQ // HKV)

                def fn():
                    return dispatch.attention_forward(q, k, v, lay, scale=scale, num_warps=warps, num_stages=stages, use_tma=tma)

                out, _ = fn()
                row["err_large"] = large_check(q, k, v, lay, out)
                if row["err_large"] < TOL:
                    row["ours_ms"] = bench(fn)
                    row["tflops_ours"] = 4.0 * pairs * D / row["ours_ms"] / 1e9
                else:
                    row["error"] = "correctness check failed: row void"
                if flex_ms is None and S <= args.flex_max:
                    lay_f = build_block_layout(p, S, S, geo, block_q=128, block_k=128, num_kv_heads=HKV)
                    bmask = lay_f.to_block_mask(1, HQ)
                    flex = flex_fn()
                    flex(q, k, v, block_mask=bmask, enable_gqa=True, scale=scale)
                    flex_ms = bench(lambda: flex(q, k, v, block_mask=bmask, enable_gqa=True, scale=scale))
                row["flex_ms"] = flex_ms
                if row.get("ours_ms") and flex_ms:
                    row["ratio_vs_flex"] = flex_ms / row["ours_ms"]
            except Exception as e:  # noqa: BLE001 — a variant that fails to compile is reported
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            results.append(row)
            print(json.dumps(row), flush=True)


def section_tune_bwd(args, results):
    """Sweep tile shapes, warps and stages of the backward (sliding window, first of --seqlens)."""
    from sparse_k.attention import dispatch

    dev, dtype, D = "cuda", torch.bfloat16, args.head_dims[0]
    S = args.seqlens[0]
    p = _patterns(args.window, args.sinks)["sliding_window"]
    q, k, v = _inputs(1, S, D, dtype, dev, 12)
    geo = row_geometry(1, S, S, None, device=dev)
    scale = D ** -0.5
    do = torch.randn_like(q)
    ref_grads = None
    variants = [(64, 64, 4, 2), (64, 64, 4, 1), (64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2), (64, 128, 8, 2)]
    for bm, bn, warps, stages in variants:
        row = dict(section="tune_bwd", pattern=p.name, S=S, D=D, tile=f"{bm}x{bn}", warps=warps, stages=stages)
        try:
            lay = build_block_layout(p, S, S, geo, block_q=bm, block_k=bn, num_kv_heads=HKV)
            out, lse = dispatch.attention_forward(q, k, v, lay, scale=scale)

            def fn():
                return dispatch.attention_backward(do, q, k, v, out, lse, lay, scale=scale, num_warps=warps,
                                                   num_stages=stages, structured=False)

            grads = fn()[:3]
            if ref_grads is None:
                ref_grads = grads
            row["err_vs_first"] = max(rel_err(a, b) for a, b in zip(grads, ref_grads))
            if row["err_vs_first"] < TOL:
                row["ours_ms"] = bench(fn)
                pairs = allowed_pairs(lay, S) * HQ
                row["tflops_ours"] = 10.0 * pairs * D / row["ours_ms"] / 1e9
            else:
                row["error"] = "gradients disagree with the first variant: row void"
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        results.append(row)
        print(json.dumps(row), flush=True)


STRUCTURED_VARIANTS = [  # (BLOCK_M, BLOCK_N, stages, warps, program order); the first is the default
    (128, 128, 3, 8, 3), (128, 128, 3, 8, 0), (128, 128, 3, 8, 2), (128, 128, 2, 8, 3), (64, 64, 3, 4, 3),
    (64, 64, 2, 4, 3), (128, 64, 3, 8, 3),
]
LAYOUT_VARIANTS = [  # layout path for the other patterns: (BLOCK_M, BLOCK_N, stages, warps)
    (128, 128, 2, 8), (128, 128, 3, 8), (64, 64, 3, 4), (64, 64, 2, 4), (128, 64, 3, 8),
]


def _shard(args, labels):
    """The labels this process handles (``--shard i/n``: every n-th from the i-th)."""
    if not args.shard:
        return list(labels)
    i, n = (int(x) for x in args.shard.split("/"))
    return list(labels)[i::n]


def _compile_rows(args, results, section, name, S, D, fns):
    """``--compile-only``: launch each variant of this shard once (fills Triton's and Inductor's caches)."""
    for label in _shard(args, fns):
        row = dict(section=section, pattern=name, S=S, D=D, tile=label, note="compile only")
        t0 = time.time()
        try:
            fns[label]()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 — reported; the timed run reports it again
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        row["compile_s"] = round(time.time() - t0, 2)
        results.append(row)
        print(json.dumps(row), flush=True)


def section_tune_structured(args, results):
    """Forward variants vs Flex (same BlockMask) and cuDNN (dense), one S.

    dense / sliding_window / streaming: the structured kernel over ``STRUCTURED_VARIANTS``; other
    patterns (bigbird): the layout path over ``LAYOUT_VARIANTS`` (each with its own layout; Flex gets
    the 128x128 one)."""
    from sparse_k.attention import dispatch
    from sparse_k.attention.triton import structured as triton_structured
    from sparse_k.attention.pattern_codes import STRUCTURED_PATTERNS, pattern_code

    dev, dtype, D = "cuda", torch.bfloat16, args.head_dims[0]
    S = args.seqlens[0]
    pats = _patterns(args.window, args.sinks)
    q, k, v = _inputs(1, S, D, dtype, dev, 13)
    geo = row_geometry(1, S, S, None, device=dev)
    scale = D ** -0.5
    for name in args.patterns:
        p = pats[name]
        lay = build_block_layout(p, S, S, geo, block_q=128, block_k=128, num_kv_heads=HKV)
        pid, params = pattern_code(p)
        fns = {}
        if pid in STRUCTURED_PATTERNS:
            for bm, bn, stages, warps, order in STRUCTURED_VARIANTS[: args.variants or None]:
                fns[f"st {bm}x{bn} s{stages} w{warps} o{order}"] = (
                    lambda bm=bm, bn=bn, stages=stages, warps=warps, order=order: triton_structured.structured_forward(
                        q, k, v, geo, pattern_id=pid, params=params, causal=p.causal, scale=scale, block_m=bm,
                        block_n=bn, num_warps=warps, num_stages=stages, order=order))
        else:
            for bm, bn, stages, warps in LAYOUT_VARIANTS:
                lay_v = lay if (bm, bn) == (128, 128) else build_block_layout(p, S, S, geo, block_q=bm, block_k=bn, num_kv_heads=HKV)
                fns[f"layout {bm}x{bn} s{stages} w{warps}"] = (
                    lambda lay_v=lay_v, stages=stages, warps=warps: dispatch.attention_forward(
                        q, k, v, lay_v, scale=scale, structured=False, num_stages=stages, num_warps=warps))
        if S <= args.flex_max:
            bmask = lay.to_block_mask(1, HQ)
            flex = flex_fn()
            fns["flex"] = lambda: (flex(q, k, v, block_mask=bmask, enable_gqa=True, scale=scale), None)
        if name == "dense":
            fns["cudnn"] = lambda: (sdpa(q, k, v, "cudnn"), None)
        if args.compile_only:
            _compile_rows(args, results, "tune_structured", name, S, D, fns)
            continue
        pairs = allowed_pairs(lay, S) * (HQ if lay.kv_num_blocks.shape[1] == 1 else HQ // HKV)
        for label, fn in fns.items():
            row = dict(section="tune_structured", pattern=name, S=S, D=D, tile=label)
            try:
                out = fn()[0]
                row["err_large"] = large_check(q, k, v, lay, out)
                del out
                if row["err_large"] < TOL:
                    row["ours_ms"] = bench(fn)
                    row["tflops_ours"] = 4.0 * pairs * D / row["ours_ms"] / 1e9
                else:
                    row["error"] = "correctness check failed: row void"
            except Exception as e:  # noqa: BLE001 — a variant that fails to compile is reported
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            results.append(row)
            print(json.dumps(row), flush=True)
        ref = {r["tile"]: r.get("ours_ms") for r in results if r.get("pattern") == name and r["section"] == "tune_structured"}
        for r in results:
            if r.get("pattern") != name or r["section"] != "tune_structured" or not r.get("ours_ms"):
                continue
            for key, other in (("ratio_vs_flex", ref.get("flex")), ("ratio_vs_cudnn", ref.get("cudnn"))):
                if other:
                    r[key] = other / r["ours_ms"]


STRUCTURED_BWD_VARIANTS = [
    # (BLOCK_N1, BLOCK_M1, warps1, stages1, BLOCK_M2, BLOCK_N2, warps2, stages2), TMA loads in the dK/dV
    # kernel (True: its K/V tile and Q/dO; "kv": its K/V tile only), in the dQ kernel, atomic dQ (False: its
    # own kernel; True: per-element atomics; "tma": TMA reduce-adds). The first is the default.
    ((128, 64, 8, 3, 128, 64, 8, 3), False, False, False), ((128, 64, 8, 3, 128, 64, 8, 3), True, False, False),
    ((128, 64, 8, 3, 128, 64, 8, 3), "kv", False, False), ((128, 64, 8, 4, 128, 64, 8, 3), True, False, False),
    ((128, 64, 8, 3, 128, 64, 8, 3), True, True, False), ((128, 64, 8, 2, 128, 64, 8, 2), True, True, False),
    ((64, 64, 4, 3, 64, 64, 4, 3), True, True, False), ((128, 64, 8, 2, 128, 64, 8, 2), True, True, True),
    ((128, 64, 8, 2, 128, 64, 8, 2), True, True, "tma"), ((128, 64, 8, 3, 128, 64, 8, 3), True, True, "tma"),
]


def kernel_times(fn, iters=3) -> dict:
    """Mean GPU milliseconds per call of each kernel ``fn`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            times[e.key[:40]] = round(t / iters / 1000, 3)
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:4])


def section_tune_structured_bwd(args, results):
    """Structured backward configurations vs the layout-path backward and Flex (sliding window).

    Every variant's gradients are compared with the layout path's (itself checked against the float64
    reference by ``--section bwd`` and the GPU tests)."""
    from sparse_k.attention import dispatch
    from sparse_k.attention.triton import structured_bwd as triton_structured_bwd
    from sparse_k.attention.pattern_codes import pattern_code

    dev, dtype, D = "cuda", torch.bfloat16, args.head_dims[0]
    S = args.seqlens[0]
    p = _patterns(args.window, args.sinks)["sliding_window"]
    q, k, v = _inputs(1, S, D, dtype, dev, 14)
    geo = row_geometry(1, S, S, None, device=dev)
    scale = D ** -0.5
    do = torch.randn_like(q)
    lay = build_block_layout(p, S, S, geo, block_q=64, block_k=64, num_kv_heads=HKV)
    out, lse = dispatch.attention_forward(q, k, v, lay, scale=scale)
    pid, params = pattern_code(p)
    fns = {"layout path": lambda: dispatch.attention_backward(do, q, k, v, out, lse, lay, scale=scale, structured=False)[:3]}
    for cfg, tma, dq_tma, atomic in STRUCTURED_BWD_VARIANTS[: args.variants or None]:
        label = ("st " + "/".join(map(str, cfg)) + {True: " tma", "kv": " kv-tma"}.get(tma, "")
                 + (" dq-tma" if dq_tma else "") + {True: " atomic-dq", "tma": " tma-reduce-dq"}.get(atomic, ""))
        fns[label] = lambda cfg=cfg, tma=tma, dq_tma=dq_tma, atomic=atomic: triton_structured_bwd.structured_backward(
            do, q, k, v, out, lse, geo, pattern_id=pid, params=params, causal=True, scale=scale, config=cfg,
            use_tma=tma is True, kv_tma=tma in (True, "kv"), dq_tma=dq_tma, atomic_dq=atomic)[:3]
    flex_ms = None
    if S <= args.flex_max:
        qf, kf, vf = (t.detach().clone().requires_grad_() for t in (q, k, v))
        bmask = build_block_layout(p, S, S, geo, block_q=128, block_k=128, num_kv_heads=HKV).to_block_mask(1, HQ)
        o_flex = flex_fn()(qf, kf, vf, block_mask=bmask, enable_gqa=True, scale=scale)
        flex_grad = lambda: torch.autograd.grad(o_flex, (qf, kf, vf), do, retain_graph=True)  # noqa: E731
        if args.compile_only:
            fns["flex"] = flex_grad
        else:
            flex_ms = bench(flex_grad)
            results.append(dict(section="tune_structured_bwd", pattern=p.name, S=S, D=D, tile="flex", ours_ms=flex_ms))
            print(json.dumps(results[-1]), flush=True)
    if args.compile_only:
        _compile_rows(args, results, "tune_structured_bwd", p.name, S, D, fns)
        return
    pairs = allowed_pairs(lay, S) * HQ
    if flex_ms:
        results[-1]["tflops_ours"] = 10.0 * pairs * D / flex_ms / 1e9
    ref = None
    for label, fn in fns.items():
        row = dict(section="tune_structured_bwd", pattern=p.name, S=S, D=D, tile=label)
        try:
            grads = fn()
            if ref is None:
                ref = grads
            row["err_vs_first"] = max(rel_err(a, b) for a, b in zip(grads, ref))
            del grads
            if row["err_vs_first"] < TOL:
                row["ours_ms"] = bench(fn)
                row["tflops_ours"] = 10.0 * pairs * D / row["ours_ms"] / 1e9
                row["kernels_ms"] = kernel_times(fn)
                if flex_ms:
                    row["ratio_vs_flex"] = flex_ms / row["ours_ms"]
            else:
                row["error"] = "gradients disagree with the layout path: row void"
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        results.append(row)
        print(json.dumps(row), flush=True)


def section_l2(args, results):
    """Program order vs L2 behaviour (timing here; hit rates from ncu over ``--single-launch``)."""
    from sparse_k import resolve_l2_segment
    from sparse_k.attention import dispatch

    dev, dtype, D = "cuda", torch.bfloat16, args.head_dims[0]
    S = args.seqlens[0]
    q, k, v = _inputs(1, S, D, dtype, dev, 17)
    geo = row_geometry(1, S, S, None, device=dev)
    scale = D ** -0.5
    pats = {
        "dense": get_pattern("dense"),
        "sliding_window": get_pattern("sliding_window", window=args.window),
        "l2_aligned": resolve_l2_segment(get_pattern("l2_aligned"), 2 * HKV * D * 2),
    }
    launch = 0
    for name in args.patterns:
        p = pats[name]
        lay = build_block_layout(p, S, S, geo, block_q=128, block_k=128, num_kv_heads=HKV)
        pairs = allowed_pairs(lay, S) * HQ
        for order in ((0, 2) if name == "l2_aligned" else (0, 1, 2, 3) if name == "dense" else (0, 2, 3)):
            row = dict(section="l2", pattern=name, S=S, D=D, tile=f"order {order}")
            fn = lambda order=order: dispatch.attention_forward(q, k, v, lay, scale=scale, order=order)  # noqa: E731
            try:
                out = fn()[0]
                torch.cuda.synchronize()
                if args.single_launch:
                    launch += 1  # the compile launch above is launch 2n-1, this one 2n (1-based)
                    fn()
                    torch.cuda.synchronize()
                    row["ncu_launch"] = 2 * launch
                else:
                    row["err_large"] = large_check(q, k, v, lay, out)
                    if row["err_large"] < TOL:
                        row["ours_ms"] = bench(fn)
                        row["tflops_ours"] = 4.0 * pairs * D / row["ours_ms"] / 1e9
                    else:
                        row["error"] = "correctness check failed: row void"
                del out
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            results.append(row)
            print(json.dumps(row), flush=True)


def section_padded(args, results):
    """A left-padded batch through ``sparse_attention`` (module docstring, ``--section padded``)."""
    dev, dtype = "cuda", torch.bfloat16
    pats = _patterns(args.window, args.sinks)
    for D in args.head_dims:
        for name in args.patterns:
            p = pats[name]
            for S in args.seqlens:
                row = dict(section="padded", pattern=name, S=S, D=D, pad=args.pad)
                _record_row(results, row, lambda: _padded_row(p, S, D, dtype, dev, row, args))


def _padded_row(p, S, D, dtype, dev, row, args):
    q, k, v = _inputs(2, S, D, dtype, dev, S + D + 2)
    mask = torch.ones(2, S, dtype=torch.bool, device=dev)
    mask[1, : args.pad] = False
    if args.padded_backward:  # forward + backward (the gradients of q, k, v), checked up to --padded-torch-max
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        do = torch.randn_like(q)

        def call(backend="auto", attention_mask=mask):
            out = sparse_k.sparse_attention(*leaves, p, attention_mask=attention_mask, backend=backend)
            return torch.autograd.grad(out, leaves, do)

        def check(grads):
            if S > args.padded_torch_max:
                return True
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref = call(backend="torch")
            # rows inside the padding see no key: both paths give them no gradient (the reference may hold NaN there)
            row["err_grad"] = max(rel_err(g, r.nan_to_num()) for g, r in zip(grads, ref))
            return row["err_grad"] < 2 * TOL  # NaN fails too
    else:
        def call(backend="auto", attention_mask=mask):
            return sparse_k.sparse_attention(q, k, v, p, attention_mask=attention_mask, backend=backend)

        def check(out):  # the first and last 256 queries against the PyTorch path
            errs = []
            for q0 in (0, S - 256):
                ref = sparse_k.sparse_attention(q[:, :, q0 : q0 + 256], k, v, p, attention_mask=mask, q_start=q0,
                                                backend="torch")
                errs.append(rel_err(out[:, :, q0 : q0 + 256], ref))
            row["err_large"] = max(errs)
            return row["err_large"] < TOL  # NaN fails too

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, label = ran(call)
    if args.padded_backward:
        row["kernel"], _, row["bwd_kernel"] = label.partition(" / ")
    else:
        row["kernel"] = label
    if caught:
        row["warning"] = str(caught[0].message)[:160]
    if not check(result):
        row["error"] = ("gradient" if args.padded_backward else "correctness") + " check failed: row void"
        return
    row["ours_ms"] = bench(call)
    _, row["unpadded_kernel"] = ran(lambda: call(attention_mask=None))
    row["unpadded_ms"] = bench(lambda: call(attention_mask=None))
    row["ratio_vs_unpadded"] = row["unpadded_ms"] / row["ours_ms"]
    if S <= args.padded_torch_max:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row["torch_path_ms"] = bench(lambda: call(backend="torch"))
        row["ratio_vs_torch_path"] = row["torch_path_ms"] / row["ours_ms"]


def _which_kernels(fn):
    """Run ``fn()`` once (then synchronise); return its result and the kernels ``plan`` named for it."""
    out, label = ran(fn)
    torch.cuda.synchronize()
    return out, label


def _median(xs):
    r = sorted(xs)
    return r[len(r) // 2] if len(r) % 2 else 0.5 * (r[len(r) // 2 - 1] + r[len(r) // 2])


def _layout_rows(rows, calls, rounds, results):
    """Time the checked rows' calls in turn, ``rounds`` times; median and ratio to the first row."""
    timed = [n for n, r in rows.items() if "error" not in r]
    for _ in range(rounds):
        for name in timed:
            rows[name].setdefault("ms_rounds", []).append(round(bench(calls[name]), 3))
    base = rows[next(iter(calls))]
    for row in rows.values():
        if row.get("ms_rounds"):
            row["ours_ms"] = _median(row["ms_rounds"])
        if row.get("ours_ms") and base.get("ours_ms"):
            row["ratio_vs_contiguous"] = row["ours_ms"] / base["ours_ms"]
        results.append(row)
        print(json.dumps(row), flush=True)


def section_layouts(args, results):
    """Sliding window forward (and forward + backward) through the model-facing entry points (module
    docstring)."""
    from sparse_k.flash_api import flash_attn_func

    dev, dtype, D = "cuda", torch.bfloat16, 128
    p = get_pattern("sliding_window", window=args.window)
    for S in args.seqlens:
        g = torch.Generator(device=dev).manual_seed(S)
        q, k, v = (torch.randn(B_PREFILL, S, h, D, device=dev, dtype=dtype, generator=g) for h in (HQ, HKV, HKV))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views of (B, S, H, D) storage
        qc, kc, vc = (t.contiguous() for t in (qt, kt, vt))
        layout = build_block_layout(p, S, S, row_geometry(1, S, S, None, device=dev), block_q=128, block_k=128,
                                    num_kv_heads=HKV)
        calls = {
            "sparse_attention, contiguous (B,H,S,D)": (lambda: sparse_k.sparse_attention(qc, kc, vc, p), False),
            "flash_attn_func, (B,S,H,D)": (
                lambda: flash_attn_func(q, k, v, causal=True, window_size=(args.window - 1, 0)), True),
            "sparse_attention, transposed (B,S,H,D) views": (lambda: sparse_k.sparse_attention(qt, kt, vt, p), False),
            "  + adapter's transpose(1,2).contiguous()": (
                lambda: sparse_k.sparse_attention(qt, kt, vt, p).transpose(1, 2).contiguous(), True),
        }
        rows = {}
        for name, (fn, bshd_out) in calls.items():
            row = dict(section="layouts", pattern="sliding_window", S=S, D=D, call=name)
            try:
                out, row["kernel"] = _which_kernels(fn)
                out_bhsd = out.transpose(1, 2) if bshd_out else out
                row["out_order"] = "(B,S,H,D)" if out_bhsd.transpose(1, 2).is_contiguous() else (
                    "(B,H,S,D)" if out_bhsd.is_contiguous() else "strided")
                row["err_large"] = large_check(qc, kc, vc, layout, out_bhsd)
                if row["err_large"] >= TOL:
                    row["error"] = "correctness check failed: row void"
                del out, out_bhsd
            except Exception as e:  # noqa: BLE001 — one failing row must not end the section
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            rows[name] = row
        _layout_rows(rows, {n: c[0] for n, c in calls.items()}, args.rounds, results)
        if args.layouts_bwd:
            _layout_bwd_rows(p, (q, k, v), (qc, kc, vc), S, args.rounds, results)
        del q, k, v, qt, kt, vt, qc, kc, vc
        torch.cuda.empty_cache()


def _layout_bwd_rows(p, bshd, contiguous, S, rounds, results):
    """Forward + backward (gradients of q, k, v): contiguous leaves vs (B, S, H, D) leaves passed as
    transposed views (a Transformers layer in training); the gradients of the second checked against
    the first's."""
    g = torch.Generator(device="cuda").manual_seed(S + 1)
    do = torch.randn(bshd[0].shape, device="cuda", dtype=bshd[0].dtype, generator=g)  # (B, S, Hq, D)
    leaves_c = [t.detach().requires_grad_() for t in contiguous]
    leaves_t = [t.detach().requires_grad_() for t in bshd]
    calls = {
        "fwd+bwd, contiguous (B,H,S,D)": lambda: torch.autograd.grad(
            sparse_k.sparse_attention(*leaves_c, p), leaves_c, do.transpose(1, 2)),
        "fwd+bwd, transposed (B,S,H,D) views": lambda: torch.autograd.grad(
            sparse_k.sparse_attention(*(t.transpose(1, 2) for t in leaves_t), p).transpose(1, 2), leaves_t, do),
    }
    rows, ref = {}, None
    for name, fn in calls.items():
        row = dict(section="layouts", pattern="sliding_window", S=S, D=bshd[0].shape[-1], call=name)
        try:
            grads, row["kernel"] = _which_kernels(fn)
            if ref is None:
                ref = grads
            else:
                row["err_vs_contiguous"] = max(rel_err(a.transpose(1, 2), b) for a, b in zip(grads, ref))
                if row["err_vs_contiguous"] >= 1e-2:  # one kernel on the same values: equal up to dQ's add order
                    row["error"] = "gradients differ from the contiguous call's: row void"
            del grads
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows[name] = row
    del ref
    _layout_rows(rows, calls, rounds, results)


def _fmt(x, nd=2):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def print_table(results):
    cols = [
        ("section", "section"), ("pattern", "pattern"), ("call", "call"), ("S", "S"), ("D", "D"), ("tile", "tile"), ("warps", "warps"),
        ("stages", "stages"), ("tma", "tma"), ("kernel", "kernel"), ("ours_ms", "ours ms"),
        ("out_order", "out order"), ("ms_rounds", "ms per round"), ("ratio_vs_contiguous", "x contiguous"),
        ("err_vs_contiguous", "grad err vs contiguous"),
        ("tflops_ours", "TF/s"), ("triton_ms", "triton ms"), ("tflops_triton", "triton TF/s"), ("flex_ms", "flex ms"), ("ratio_triton_vs_flex", "triton x flex"), ("ratio_vs_flex", "x flex"),
        ("fa4_ms", "fa4 ms"), ("tflops_fa4", "fa4 TF/s"), ("ratio_vs_fa4", "x fa4"), ("sdpa_cudnn_ms", "cudnn ms"),
        ("ratio_vs_cudnn", "x cudnn"), ("sdpa_flash_ms", "fa2 ms"), ("ours_us", "ours us"), ("gbps_ours", "GB/s"), ("graph_us", "graph us"), ("api_us", "api us"),
        ("sdpa_flash_us", "sdpa us"), ("sdpa_window_slice_us", "slice us"), ("gather_sdpa_us", "gather+sdpa us"),
        ("sdpa_window_slice_graph_us", "slice graph us"), ("gather_sdpa_graph_us", "gather+sdpa graph us"),
        ("graph10_us", "graph10 us"), ("sdpa_window_slice_graph10_us", "slice graph10 us"),
        ("gather_sdpa_graph10_us", "gather+sdpa graph10 us"), ("triton_graph_us", "triton graph us"),
        ("triton_graph10_us", "triton graph10 us"), ("kernel_us", "kernel us"), ("triton_kernel_us", "triton kernel us"),
        ("torch_fwd_ms", "torch fwd ms"), ("triton_fwd_ms", "triton fwd ms"), ("ratio_fwd", "x fwd"),
        ("torch_fwdbwd_ms", "torch fwd+bwd ms"), ("triton_fwdbwd_ms", "triton fwd+bwd ms"), ("ratio_fwdbwd", "x fwd+bwd"),
        ("token_kernel", "token kernel"), ("token_triton_ms", "token triton ms"),
        ("sw3072_ms", "SW3072 ms"), ("tflops_ratio_vs_sw3072", "TF/s ratio"), ("sw3072_triton_ms", "SW3072 triton ms"),
        ("tflops_ratio_vs_sw3072_triton", "TF/s ratio vs triton"), ("kernels_ms", "kernels ms"), ("fa4_runs", "fa4 runs"),
        ("fa4_error", "fa4 note"), ("bwd_kernel", "bwd kernel"), ("err_grad", "grad err"),
        ("unpadded_kernel", "unpadded kernel"), ("unpadded_ms", "unpadded ms"),
        ("ratio_vs_unpadded", "x unpadded"), ("torch_path_ms", "torch path ms"), ("ratio_vs_torch_path", "x torch path"),
        ("warning", "warning"), ("error", "note"),
    ]
    used = [c for c in cols if any(r.get(c[0]) is not None for r in results)]
    print("| " + " | ".join(h for _, h in used) + " |")
    print("|" + "---|" * len(used))
    for r in results:
        print("| " + " | ".join(_fmt(r.get(key)) for key, _ in used) + " |")


SPARSEK_SHAPES = ((192, 4096, 256), (4096, 32768, 2048))  # (rows = B*Hkv*query blocks, candidates, k)


def section_sparsek(args, results, dev="cuda"):
    """The SparseK operator (``sparse_k.sparsek``): Triton kernel vs the PyTorch path, forward and
    forward + backward, float32 scores; rows = SmolLM2 at 4K (3 KV heads x 64 query blocks) and a
    Llama-size layer at 32K (8 x 512). Decides ``selection.sparsek.AUTO_TRITON_ON_CUDA``."""
    from sparse_k import sparsek

    for rows, n, k in SPARSEK_SHAPES:
        g = torch.Generator(device=dev).manual_seed(rows + n)
        u = torch.randn(rows, n, device=dev, generator=g)
        w = torch.randn(rows, n, device=dev, generator=g)
        row = dict(section="sparsek", pattern=f"sparsek k={k}", S=n, tile=f"{rows} rows")
        try:
            p_t, p_r = sparsek(u, k, backend="triton"), sparsek(u, k, backend="torch")
            row["err"] = rel_err(p_t, p_r)
            if row["err"] > 1e-4:  # float32 on both paths: a correct kernel agrees to rounding
                row["error"] = "correctness check failed: row void"
            else:
                for backend in ("torch", "triton"):
                    row[f"{backend}_fwd_ms"] = bench(lambda b=backend: sparsek(u, k, backend=b))
                    x = u.clone().requires_grad_()
                    row[f"{backend}_fwdbwd_ms"] = bench(
                        lambda b=backend: torch.autograd.grad((sparsek(x, k, backend=b) * w).sum(), x))
                row["ratio_fwd"] = row["torch_fwd_ms"] / row["triton_fwd_ms"]
                row["ratio_fwdbwd"] = row["torch_fwdbwd_ms"] / row["triton_fwdbwd_ms"]
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        results.append(row)
        print(json.dumps(row), flush=True)


def write_json(path, meta, rows):
    """Write ``{"meta": meta, "rows": rows}`` to ``path`` (folders created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--section", choices=("fwd", "bwd", "decode", "tune", "tune_bwd", "tune_structured", "tune_structured_bwd", "l2", "sparsek", "layouts", "padded"), required=True)
    ap.add_argument("--seqlens", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 16384, 65536, 131072])
    ap.add_argument("--decode-lens", type=lambda s: [int(x) for x in s.split(",")], default=[32768, 131072])
    ap.add_argument("--patterns", type=lambda s: s.split(","), default=None,
                    help="comma list; default dense,sliding_window,streaming,bigbird (l2: dense,sliding_window,l2_aligned)")
    ap.add_argument("--head-dims", type=lambda s: [int(x) for x in s.split(",")], default=[128, 64])
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--sinks", type=int, default=128)
    ap.add_argument("--pad", type=int, default=77, help="padded: masked keys at the start of the second row")
    ap.add_argument("--padded-backward", action="store_true",
                    help="padded: time forward + backward (gradients checked against the PyTorch path)")
    ap.add_argument("--padded-torch-max", type=int, default=32768,
                    help="padded: largest S also timed on the PyTorch path")
    ap.add_argument("--flex-max", type=int, default=131072, help="largest S given to the FlexAttention baseline")
    ap.add_argument("--fa4-rounds", type=int, default=5,
                    help="fwd / bwd: rounds of FA4 and ours timed in turn (ratio_vs_fa4: the median round's)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--single-launch", action="store_true", help="l2: one timed-free launch per configuration (for ncu)")
    ap.add_argument("--compile-only", action="store_true",
                    help="tune_structured / tune_structured_bwd: launch each variant once, no checks, no timing "
                         "(fills Triton's and Inductor's caches; run shards in parallel before a timed run)")
    ap.add_argument("--rounds", type=int, default=5, help="layouts: times each call is timed, in turn with the others")
    ap.add_argument("--layouts-bwd", action="store_true",
                    help="layouts: also forward + backward, contiguous vs transposed views")
    ap.add_argument("--variants", type=int, default=0, help="tune_structured*: only the first N variants (0: all)")
    ap.add_argument("--shard", default=None, help="with --compile-only: 'i/n' handles every n-th variant from the i-th")
    args = ap.parse_args(argv)
    if args.fa4_rounds < 1:
        ap.error(f"--fa4-rounds {args.fa4_rounds}: at least 1 round is required")
    check_patterns(ap, args)
    if not torch.cuda.is_available():
        print("benchmark_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        config=dict(B=B_PREFILL, Hq=HQ, Hkv=HKV, dtype="bfloat16", window=args.window, sinks=args.sinks),
    )
    print(json.dumps(meta), flush=True)
    results = []
    {"fwd": section_fwd, "bwd": section_bwd, "decode": section_decode, "tune": section_tune, "tune_bwd": section_tune_bwd,
     "tune_structured": section_tune_structured, "tune_structured_bwd": section_tune_structured_bwd, "l2": section_l2, "sparsek": section_sparsek,
     "layouts": section_layouts, "padded": section_padded}[args.section](args, results)
    print_table(results)
    if args.json:
        write_json(args.json, meta, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
