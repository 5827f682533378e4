"""Benchmark the sparse_k Triton kernels against FlexAttention, SDPA flash and SDPA cuDNN.

Same inputs, same process, same BlockMask: FlexAttention gets ``layout.to_block_mask(...)`` of the
very layout our kernel runs (default ``kernel_options``, ``torch.compile``d). Every row is checked
before it is timed: against the exact float64 reference on a small shape of the same pattern, and
against the PyTorch path on the first and last query rows of the large shape; a failed check voids
the row (its time is not reported).

Sections (each fits in a few minutes on an H100):

* ``--section fwd``: prefill forward, ``S`` in 4K/16K/64K/128K (+1M for window patterns, ours only
  where baselines cannot run), patterns dense, sliding_window, streaming, bigbird.
* ``--section bwd``: backward only (gradients of q, k, v given the forward's graph).
* ``--section decode``: one query token against a long cache, B=8; GB/s of K/V actually read.

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

import torch

import sparse_k
from sparse_k import build_block_layout, get_pattern, reference_attention, row_geometry, torch_sparse_attention
from sparse_k.ops import block_attn

B_PREFILL, HQ, HKV = 1, 32, 8


def _patterns(window: int, sinks: int):
    return {
        "dense": get_pattern("dense"),
        "sliding_window": get_pattern("sliding_window", window=window),
        "streaming": get_pattern("streaming", window=window, sinks=sinks),
        "bigbird": get_pattern("bigbird", block=128, window_blocks=1, global_blocks=2, random_blocks=3),
    }


def bench(fn, warmup_ms=25, rep_ms=200) -> float:
    """Median milliseconds of ``fn`` (CUDA events through triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


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


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
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


def large_check(q, k, v, layout, out, rows=256) -> float:
    """Relative error of ``out`` on the first and last ``rows`` queries vs the PyTorch path."""
    S = q.shape[2]
    errs = []
    for q0 in (0, max(0, S - rows)):
        n = min(rows, S - q0)
        geo = row_geometry(1, n, k.shape[2], None, q_start=q0, device=q.device)
        lay = build_block_layout(layout.pattern, n, k.shape[2], geo, block_q=64, block_k=128,
                                 layer_idx=layout.layer_idx, num_kv_heads=k.shape[1])
        ref, _ = torch_sparse_attention(q[:, :, q0 : q0 + n], k, v, lay, scale=q.shape[-1] ** -0.5)
        errs.append(rel_err(out[:, :, q0 : q0 + n], ref))
    return max(errs)


TOL = 2e-2  # bf16 operands: relative errors of 1e-3..1e-2 are rounding (METHOD.md); a wrong kernel gives O(1)


# ---------------------------------------------------------------- sections
def section_fwd(args, results):
    dev = "cuda"
    dtype = torch.bfloat16
    pats = _patterns(args.window, args.sinks)
    for D in args.head_dims:
        for name in args.patterns:
            p = pats[name]
            err_small = small_check(p, D, dtype, "fwd")
            for S in args.seqlens:
                if S > 131072 and name in ("dense", "bigbird"):
                    continue
                row = dict(section="fwd", pattern=name, S=S, D=D)
                try:
                    _fwd_row(p, S, D, dtype, dev, err_small, row, args)
                except torch.OutOfMemoryError as e:
                    row["error"] = f"OOM: {str(e)[:80]}"
                except Exception as e:  # noqa: BLE001 — one failing row must not end the section
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                torch.cuda.empty_cache()
                results.append(row)
                print(json.dumps(row), flush=True)


def _inputs(B, S, D, dtype, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, HQ, S, D, device=dev, dtype=dtype, generator=g)
    k = torch.randn(B, HKV, S, D, device=dev, dtype=dtype, generator=g)
    v = torch.randn(B, HKV, S, D, device=dev, dtype=dtype, generator=g)
    return q, k, v


def _fwd_row(p, S, D, dtype, dev, err_small, row, args):
    q, k, v = _inputs(1, S, D, dtype, dev, S + D)
    geo = row_geometry(1, S, S, None, device=dev)
    from sparse_k.triton_backend import tile_config

    bm, bn = (128, 128) if isinstance(p, sparse_k.BigBird) else tile_config(D, "cuda", False)
    t0 = time.time()
    layout = build_block_layout(p, S, S, geo, block_q=bm, block_k=bn, num_kv_heads=HKV)
    row["layout_build_s"] = round(time.time() - t0, 3)
    pairs = allowed_pairs(layout, S) * (HQ if layout.kv_num_blocks.shape[1] == 1 else HQ // HKV)
    flops = 4.0 * pairs * D
    scale = D ** -0.5
    torch.cuda.reset_peak_memory_stats()
    base_mem = torch.cuda.memory_allocated()
    out, _ = block_attn(q, k, v, layout, scale=scale)
    torch.cuda.synchronize()
    row["extra_mem_gb"] = round((torch.cuda.max_memory_allocated() - base_mem - out.numel() * out.element_size()) / 2**30, 3)
    err_large = large_check(q, k, v, layout, out)
    row["err_small"], row["err_large"] = err_small, err_large
    ok = err_small < TOL and err_large < TOL
    row["ours_ms"] = bench(lambda: block_attn(q, k, v, layout, scale=scale)) if ok else None
    if not ok:
        row["error"] = "correctness check failed: row void"
    row["tflops_ours"] = flops / row["ours_ms"] / 1e9 if row["ours_ms"] else None
    if S <= args.flex_max:
        try:
            bm_flex = layout.to_block_mask(1, HQ)
            flex = flex_fn()
            o_flex = flex(q, k, v, block_mask=bm_flex, enable_gqa=True, scale=scale)
            e_flex = large_check(q, k, v, layout, o_flex)
            row["err_flex"] = e_flex
            if e_flex < TOL:
                row["flex_ms"] = bench(lambda: flex(q, k, v, block_mask=bm_flex, enable_gqa=True, scale=scale))
                row["ratio_vs_flex"] = row["flex_ms"] / row["ours_ms"] if row["ours_ms"] else None
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
                try:
                    _bwd_row(p, S, D, dtype, dev, err_small, row, args)
                except torch.OutOfMemoryError as e:
                    row["error"] = f"OOM: {str(e)[:80]}"
                except Exception as e:  # noqa: BLE001 — one failing row must not end the section
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                torch.cuda.empty_cache()
                results.append(row)
                print(json.dumps(row), flush=True)


def _bwd_row(p, S, D, dtype, dev, err_small, row, args):
    q, k, v = _inputs(1, S, D, dtype, dev, S + D + 1)
    for t in (q, k, v):
        t.requires_grad_()
    scale = D ** -0.5
    out = sparse_k.sparse_attention(q, k, v, p, backend="triton")
    do = torch.randn_like(out)
    geo = row_geometry(1, S, S, None, device=dev)
    from sparse_k.triton_backend import tile_config

    bm, bn = (128, 128) if isinstance(p, sparse_k.BigBird) else tile_config(D, "cuda", True)
    layout = build_block_layout(p, S, S, geo, block_q=bm, block_k=bn, num_kv_heads=HKV)
    pairs = allowed_pairs(layout, S) * (HQ if layout.kv_num_blocks.shape[1] == 1 else HQ // HKV)
    flops = 10.0 * pairs * D
    ok = err_small < TOL
    if ok:
        row["ours_ms"] = bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
        row["tflops_ours"] = flops / row["ours_ms"] / 1e9
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
        for name in ("sliding_window", "streaming", "dense"):
            p = pats[name]
            row = dict(section="decode", pattern=name, S=S, D=D, B=B)
            out = sparse_k.sparse_attention(q, k, v, p, backend="triton")
            geo = row_geometry(B, 1, S, None, device=dev)
            lay = build_block_layout(p, 1, S, geo, block_q=1, block_k=128, num_kv_heads=HKV)
            ref, _ = torch_sparse_attention(q, k, v, lay, scale=D ** -0.5)
            row["err"] = rel_err(out, ref)
            keys = min(S, args.window + (args.sinks if name == "streaming" else 0)) if name != "dense" else S
            nbytes = 2 * B * HKV * keys * D * k.element_size()
            if row["err"] < TOL:
                row["ours_us"] = 1e3 * bench(lambda: sparse_k.sparse_attention(q, k, v, p, backend="triton"))
                row["gbps_ours"] = nbytes / (row["ours_us"] * 1e-6) / 1e9
            else:
                row["error"] = "correctness check failed: row void"
            if name == "dense":
                row["sdpa_flash_us"] = 1e3 * bench(lambda: sdpa(q, k, v, "flash", causal=False))
            elif name == "sliding_window":
                ks, vs = k[:, :, -args.window :], v[:, :, -args.window :]
                row["sdpa_window_slice_us"] = 1e3 * bench(lambda: sdpa(q, ks, vs, "flash", causal=False))
            results.append(row)
            print(json.dumps(row), flush=True)


def _fmt(x, nd=2):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def print_table(results):
    cols = [
        ("section", "section"), ("pattern", "pattern"), ("S", "S"), ("D", "D"), ("ours_ms", "ours ms"),
        ("tflops_ours", "TF/s"), ("flex_ms", "flex ms"), ("ratio_vs_flex", "x flex"), ("sdpa_cudnn_ms", "cudnn ms"),
        ("ratio_vs_cudnn", "x cudnn"), ("sdpa_flash_ms", "fa2 ms"), ("ours_us", "ours us"), ("gbps_ours", "GB/s"),
        ("sdpa_flash_us", "sdpa us"), ("sdpa_window_slice_us", "slice us"), ("error", "note"),
    ]
    used = [c for c in cols if any(r.get(c[0]) is not None for r in results)]
    print("| " + " | ".join(h for _, h in used) + " |")
    print("|" + "---|" * len(used))
    for r in results:
        print("| " + " | ".join(_fmt(r.get(key)) for key, _ in used) + " |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--section", choices=("fwd", "bwd", "decode"), required=True)
    ap.add_argument("--seqlens", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 16384, 65536, 131072])
    ap.add_argument("--decode-lens", type=lambda s: [int(x) for x in s.split(",")], default=[32768, 131072])
    ap.add_argument("--patterns", type=lambda s: s.split(","), default=["dense", "sliding_window", "streaming", "bigbird"])
    ap.add_argument("--head-dims", type=lambda s: [int(x) for x in s.split(",")], default=[128, 64])
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--sinks", type=int, default=128)
    ap.add_argument("--flex-max", type=int, default=131072, help="largest S given to the FlexAttention baseline")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
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
    {"fwd": section_fwd, "bwd": section_bwd, "decode": section_decode}[args.section](args, results)
    print_table(results)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
