"""End to end through Transformers: prefill time, decode ms/token, peak memory and the kernels that ran,
for dense attention (sdpa, flex_attention) and every sparse variant, in one process on one model.

The model is a Llama built from a config (random weights; Llama-3.1-8B's shape by default, the layer
count a flag), or with ``--model`` a real checkpoint (Hub id, folder or ``.gguf``; ``smollm2-135m``: the
embedded SmolLM2-135M), loaded once; each variant switches its attention implementation
(``model.set_attn_implementation`` + ``hf_sparse_attention.configure``) on the same weights. Per
variant and length:

* **check** (gates the row): last-token logits of a short prompt (``--check-len`` tokens, longer than
  every window and budget, so the sparse rule is active) against the PyTorch path of the same variant
  (``backend="torch"``; eager attention for sdpa / flex_attention). The bound is twice the gap between
  two exact implementations of dense attention in the model's dtype (sdpa vs eager, measured on the
  same prompt) plus 1e-3, raised to 5e-2 for learned selection (a bf16 difference can swap a key at
  the selection boundary; the reason is printed with the row). A failed check voids the row's times.
* **prefill**: ``model(ids, logits_to_keep=1)`` on ``L`` random tokens, or with ``--text`` the first ``L`` tokens of a
  corpus (``gutenberg``: the held-out plays of the offline corpus; a ``.txt`` file or folder; a ``datasets`` name),
  what a selection sees on real prompts (its cost depends on how much neighbouring queries' choices overlap;
  random weights and tokens are the worst case) (median of ``--repeats`` after
  one warm-up run), peak memory (``torch.cuda.max_memory_allocated``), and the top kernels of one
  prefill (profiler) with the attention kernel named: for the sparse variants the kernels
  ``sparse_k.attention.plan`` named for the warm-up run's launches (``plan.recording``), for sdpa /
  flex_attention the profiler's kernel names.
* **decode**: the context is prefilled (the variant itself; sparse variants use
  ``hf_sparse_attention.SparseCache``, the bounded / selection-keeping cache a user passes to
  ``generate``), then greedy decode steps. Warm-up steps repeat until a whole warm-up round compiles
  nothing (Triton JIT hook and torch.compile counters), then ``--decode-steps`` are timed; the row
  says how many compilations happened inside the timed steps (must be 0). The loop keeps the next
  token and ``cache_position`` on the device (``cache_position + 1``, as ``generate`` advances it), so
  no step waits for the GPU: ``ms/token`` is the larger of the host's and the GPU's time per step.
  ``synced ms/token`` runs the same loop with one ``synchronize`` per step (as ``generate``'s stopping
  check does: host and GPU time add up). ``gpu ms`` is the pure GPU time of one step (sum of the
  kernels' device time in the profiler); ``ms/token`` over ``gpu ms`` is how host-bound the step is
  (1.0 = GPU-bound). ``--decode-mode compiled`` runs the steps through
  ``torch.compile(mode="reduce-overhead")`` on a ``StaticCache`` (CUDA graphs) instead of eagerly; it
  also reports ``host ms`` (the host time to issue one step while the GPU is busy) and ``GPU span``
  (first to last kernel of a step, gaps included).

Variants (``--variants``, comma list): ``sdpa``, ``flex_attention``, ``sliding_window`` (window
``--window`` 4096), ``streaming`` (``--sinks`` 4 + 4096), ``sparse_k`` (trained-shaped random
``SparseKScorer``: sinks 4, ``--learned-window`` 1024, ``--top-k`` 2048, ``--query-block`` 128), ``dsa``
(random ``LightningIndexer``, same budget), ``default`` (the ``sparse_k`` defaults with the
training-free selection), ``per_query`` (the same with ``query_block=1, refine=8``: the training-free selection
per query, refined by exact attention probabilities; docs/selection.md), ``block_diagonal`` (blocks of ``--window``
keys), ``bigbird`` (blocks of ``--bigbird-block`` 128, 1 window block, 2 global, 3 random: the kernel benchmark's),
``dilated`` (window ``--window`` / 4 over 3 scales: the same reach as the sliding window), ``l2_aligned`` (blocks of
128, ``--window`` / 128 window blocks, anchors of 64 every 8,192 keys).

Example (H100, 8 layers)::

    python scripts/benchmark_e2e.py --layers 8 --prefill-lens 32768,131072 --decode-lens 32768,131072 \\
        --json results/e2e.json

A real model on real text (the training-free rows then stay training-free: shipped selectors are off)::

    python scripts/benchmark_e2e.py --model smollm2-135m --text gutenberg --prefill-lens 8192,32768 \\
        --phases prefill --variants sdpa,default,per_query

Ratios to ``sdpa`` (prefill) and to ``flex_attention`` (decode) are printed per row; everything also
goes to ``--json``. On a CPU (tests) use a tiny model: ``--hidden 64 --heads 4 --kv-heads 2 ...``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from contextlib import contextmanager

import torch

VARIANTS = ("sdpa", "flex_attention", "sliding_window", "streaming", "sparse_k", "dsa", "default", "per_query",
            "block_diagonal", "bigbird", "dilated", "l2_aligned")


def variant_spec(name: str, args) -> dict:
    """``{"impl", "sparse" (config.sparse_attention), "selector" (attach random selectors)}`` of a variant."""
    learned = {"sinks": args.sinks, "window": args.learned_window, "top_k": args.top_k, "query_block": args.query_block}
    return {
        "sdpa": {"impl": "sdpa"},
        "flex_attention": {"impl": "flex_attention"},
        "sliding_window": {"impl": "sparse_k", "sparse": {"pattern": "sliding_window", "window": args.window}},
        "streaming": {"impl": "sparse_k", "sparse": {"pattern": "streaming", "sinks": args.sinks, "window": args.window}},
        "sparse_k": {"impl": "sparse_k", "selector": True, "sparse": {"pattern": "sparse_k", **learned}},
        "dsa": {"impl": "sparse_k", "selector": True, "sparse": {"pattern": "dsa", **learned}},
        "default": {"impl": "sparse_k", "sparse": {"pattern": "sparse_k", "shipped_selectors": False}},
        "per_query": {"impl": "sparse_k", "sparse": {"pattern": "sparse_k", "query_block": 1, "refine": 8,
                                                    "shipped_selectors": False}},
        "block_diagonal": {"impl": "sparse_k", "sparse": {"pattern": "block_diagonal", "block": args.window}},
        "bigbird": {"impl": "sparse_k", "sparse": {"pattern": "bigbird", "block": args.bigbird_block, "window_blocks": 1,
                                                  "global_blocks": 2, "random_blocks": 3}},
        "dilated": {"impl": "sparse_k", "sparse": {"pattern": "dilated", "window": max(1, args.window // 4), "scales": 3}},
        "l2_aligned": {"impl": "sparse_k", "sparse": {"pattern": "l2_aligned", "block": 128,
                                                     "window_blocks": max(1, args.window // 128), "segment": 8192,
                                                     "anchor": 64}},
    }[name]


#: Substrings of kernel names that identify which attention kernel ran (first match names the row's
#: kernel) where ``sparse_k.attention.plan`` recorded none (sdpa, flex_attention).
ATTENTION_KERNELS = (
    ("structured_fwd_kernel", "CUDA sm90 structured"), ("token_fwd_kernel", "CUDA sm90 token"),
    ("decode_kernel", "CUDA sm90 decode"), ("_st_fwd", "Triton structured"), ("_attn_fwd", "Triton layout / split-KV"),
    ("triton_tem", "FlexAttention (Inductor template)"), ("flex", "FlexAttention"), ("cudnn", "cuDNN (SDPA)"),
    ("flash", "FlashAttention (SDPA)"), ("fmha", "SDPA mem-efficient"),
)


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive ints, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma list of positive ints, got {text!r}")
    return values


def _variant_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {unknown or text!r}; allowed: {', '.join(VARIANTS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", type=_variant_list, default=list(VARIANTS), help="comma list: " + ", ".join(VARIANTS))
    p.add_argument("--model", default=None,
                   help="a real checkpoint instead of the random Llama: Hub id, folder, .gguf file or smollm2-135m "
                        "(the shape flags are then ignored)")
    p.add_argument("--text", default=None, metavar="CORPUS",
                   help="prompt tokens from this corpus instead of random ids (needs --model for its tokenizer): "
                        "gutenberg, a .txt file or folder, or a datasets name")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--window", type=int, default=4096, help="window of sliding_window / streaming")
    p.add_argument("--sinks", type=int, default=4, help="sink tokens of streaming and the learned variants")
    p.add_argument("--bigbird-block", type=int, default=128,
                   help="block of the bigbird variant (default 128: a multiple of 128 reaches the Hopper CUDA forward)")
    p.add_argument("--learned-window", type=int, default=1024, help="window of sparse_k / dsa")
    p.add_argument("--top-k", type=int, default=2048, help="selected keys per query block (sparse_k / dsa)")
    p.add_argument("--query-block", type=int, default=128, help="query block of the learned selection")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prefill-lens", type=_positive_ints, default=[32768, 131072])
    p.add_argument("--decode-lens", type=_positive_ints, default=[32768, 131072])
    p.add_argument("--phases", default="prefill,decode", help="comma list of prefill, decode (default both)")
    p.add_argument("--decode-batch", type=int, default=1,
                   help="sequences decoded together (each with the full context; default 1)")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per length")
    p.add_argument("--warmup-steps", type=int, default=8, help="decode steps per warm-up round")
    p.add_argument("--max-warmup-rounds", type=int, default=6)
    p.add_argument("--decode-mode", choices=("eager", "compiled"), default="eager")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills per length (median)")
    p.add_argument("--check-len", type=int, default=5120, help="prompt length of the correctness check")
    p.add_argument("--no-profile", action="store_true", help="skip the profiler (kernel names, GPU time)")
    p.add_argument("--flat-memory-len", type=int, default=0,
                   help="also feed the streaming variant this many tokens in chunks through SparseCache (e.g. 1048576), "
                        "then decode: peak memory at each power of two shows whether it stays flat")
    p.add_argument("--chunk", type=int, default=32768, help="chunk length of --flat-memory-len")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every row and the environment here")
    return p


def _validate(args) -> None:
    for name in ("chunk", "window", "learned_window", "top_k", "query_block", "layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "decode_batch", "decode_steps",
                 "warmup_steps", "max_warmup_rounds", "repeats", "check_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"benchmark_e2e: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        raise SystemExit(f"benchmark_e2e: --heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if not phases or any(x not in ("prefill", "decode") for x in phases):
        raise SystemExit(f"benchmark_e2e: --phases takes prefill and/or decode, got {args.phases!r}")
    args.phases = phases
    if args.sinks < 0:
        raise SystemExit(f"benchmark_e2e: --sinks must be >= 0, got {args.sinks}")
    if args.text is not None and args.model is None:
        raise SystemExit("benchmark_e2e: --text needs --model (the prompt is tokenized with the model's tokenizer)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("benchmark_e2e: --device cuda but no CUDA device is visible; pass --device cpu")


def build_model(args):
    """The model on ``args.device`` (``eval()``, no grad): ``--model``'s checkpoint in ``--dtype`` (its tokenizer on
    ``args.tokenizer``), else a random-weight Llama of the requested shape (``args.tokenizer`` None)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.model is not None:
        from hf_sparse_attention.evaluation.models import load_model

        loaded = load_model(args.model, dtype=args.dtype, device=args.device)
        args.tokenizer = loaded.tokenizer
        return loaded.model.requires_grad_(False)
    args.tokenizer = None
    longest = max([*args.prefill_lens, *args.decode_lens, args.check_len]) + args.decode_steps * 4 + 1024
    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        vocab_size=args.vocab, max_position_embeddings=longest, rope_theta=500000.0, tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval().requires_grad_(False)


def apply_variant(model, name: str, args) -> None:
    """Switch ``model`` to variant ``name`` (attention implementation, sparse config, selectors)."""
    import hf_sparse_attention as hfsa
    from hf_sparse_attention.selectors import attach_selectors, create_selectors, detach_selectors

    spec = variant_spec(name, args)
    detach_selectors(model)
    if spec["impl"] == "sparse_k":
        params = dict(spec["sparse"])
        hfsa.configure(model, params.pop("pattern"), **params)
    model.set_attn_implementation(spec["impl"])
    if spec.get("selector"):
        gen = torch.random.fork_rng(devices=[])
        with gen:
            torch.manual_seed(1234)
            attach_selectors(model, create_selectors(model))


@contextmanager
def _backend(model, backend: str):
    """Temporarily run the sparse config with ``backend``."""
    cfg = getattr(model.config, "sparse_attention", None)
    if cfg is None:
        yield
        return
    model.config.sparse_attention = {**cfg, "backend": backend}
    try:
        yield
    finally:
        model.config.sparse_attention = cfg


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@torch.no_grad()
def _last_logits(model, ids) -> torch.Tensor:
    return model(ids, logits_to_keep=1).logits[:, -1].float()


@torch.no_grad()
def dense_noise(model, ids) -> float:
    """Relative gap of the last-token logits between sdpa and eager attention (two exact dense
    implementations in the model's dtype): the low-precision noise the checks are scaled by."""
    saved = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    a = _last_logits(model, ids)
    model.set_attn_implementation("eager")
    b = _last_logits(model, ids)
    model.set_attn_implementation(saved)
    return _rel_err(a, b)


@torch.no_grad()
def check_variant(model, name: str, ids, noise: float, args) -> dict:
    """The row gate: the variant's logits against its PyTorch path (module docstring)."""
    spec = variant_spec(name, args)
    got = _last_logits(model, ids)
    if spec["impl"] == "sparse_k":
        with _backend(model, "torch"):
            want = _last_logits(model, ids)
    else:
        model.set_attn_implementation("eager")
        want = _last_logits(model, ids)
        model.set_attn_implementation(spec["impl"])
    err = _rel_err(got, want)
    learned = spec.get("sparse", {}).get("pattern") in ("sparse_k", "dsa")
    bound = max(2 * noise + 1e-3, 5e-2 if learned else 0.0)
    return {"check_rel_err": err, "check_bound": bound, "check_ok": bool(err <= bound),
            "check_reason": "learned selection: a bf16 difference may swap a key at the selection boundary" if learned else
            "2 x (sdpa vs eager gap) + 1e-3"}


class CompileCounter:
    """Counts Triton JIT compilations and torch.compile graph compilations while active."""

    def __init__(self):
        self.triton = 0
        self._hook_set = False

    def __enter__(self):
        try:
            import triton.knobs as knobs

            self._prev = knobs.runtime.jit_post_compile_hook
            prev = self._prev

            def hook(*args, **kwargs):
                self.triton += 1
                return prev(*args, **kwargs) if prev is not None else None

            knobs.runtime.jit_post_compile_hook = hook
            self._hook_set = True
        except (ImportError, AttributeError):
            self._hook_set = False
        return self

    def __exit__(self, *exc):
        if self._hook_set:
            import triton.knobs as knobs

            knobs.runtime.jit_post_compile_hook = self._prev

    @staticmethod
    def dynamo_graphs() -> int:
        try:
            from torch._dynamo.utils import counters

            return int(counters["stats"]["unique_graphs"])
        except Exception:  # noqa: BLE001 - counters are private; missing means "not counted"
            return 0


#: Characters kept of a kernel's name in the rows (C++ template names run to thousands).
KERNEL_NAME_CHARS = 200


def _profile_kernels(fn, device, steps: int = 1) -> tuple[float | None, list, str | None, dict | None]:
    """(GPU ms per call, top kernels [(name, ms per call, launches per call)], attention kernel, every
    GPU operation {name: (launches per call, ms per call)}) of ``fn`` (profiler)."""
    if torch.device(device).type != "cuda":
        return None, [], None, None
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        _sync(device)
    kernels: dict[str, float] = {}
    counts: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:  # a kernel (or memcpy/memset) on the GPU
            t = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0)
            kernels[e.name] = kernels.get(e.name, 0.0) + t / steps / 1000
            counts[e.name] = counts.get(e.name, 0) + 1
    total = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:6]
    attention = None
    for key, label in ATTENTION_KERNELS:
        hits = [k for k in kernels if key.lower() in k.lower()]
        if hits:
            attention = f"{label} ({hits[0][:60]})"
            break
    # Inductor's kernel names share long prefixes: keep them whole (a cut name would merge different kernels).
    every = {k[:KERNEL_NAME_CHARS]: (counts[k] / steps, round(v, 4)) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])}
    return total, [(k[:KERNEL_NAME_CHARS], round(v, 4), counts[k] / steps) for k, v in top], attention, every


def planned_kernels(fn) -> str | None:
    """Run ``fn()`` once; the kernels ``sparse_k.attention.plan`` named for its attention launches, with counts
    (e.g. "cuda_sm90_structured x8"), or None when none went through ``sparse_k`` (sdpa, flex)."""
    from sparse_k.attention import plan

    with plan.recording() as seen:
        fn()
    counts: dict[str, int] = {}
    for p in seen:
        counts[p.kernel] = counts.get(p.kernel, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in counts.items()) or None


def prompt_ids(model, length: int, batch: int, seed: int, args) -> torch.Tensor:
    """``(batch, length)`` token ids on ``args.device``: random (seeded), or with ``--text`` the corpus's tokens from
    the start (row ``i`` from token ``i * length``; the corpus repeats when it is shorter)."""
    if args.text is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, model.config.vocab_size, (batch, length), generator=gen).to(args.device)
    tokens = corpus_tokens(args)
    need = batch * length
    reps = -(-need // tokens.numel())
    return tokens.repeat(reps)[:need].view(batch, length).to(args.device)


def corpus_tokens(args) -> torch.Tensor:
    """The ``--text`` corpus as one int64 token tensor (documents joined with a blank line; tokenized once)."""
    if getattr(args, "_corpus_tokens", None) is None:
        from hf_sparse_attention.evaluation.corpora import load_documents

        text = "\n\n".join(load_documents(args.text))
        ids = args.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
        if ids.numel() == 0:
            raise SystemExit(f"benchmark_e2e: --text {args.text!r} has no tokens")
        print(f"[e2e] prompts from --text {args.text}: {ids.numel()} tokens", flush=True)
        args._corpus_tokens = ids
    return args._corpus_tokens


@torch.no_grad()
def measure_prefill(model, name: str, length: int, args) -> dict:
    device = args.device
    ids = prompt_ids(model, length, 1, args.seed + length, args)

    def step():
        return model(ids, logits_to_keep=1, use_cache=False)

    planned = planned_kernels(step)  # warm-up: compiles, layout caches, allocator growth
    _sync(device)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = int(torch.cuda.max_memory_allocated()) if torch.device(device).type == "cuda" else None
    row = {"prefill_ms": 1e3 * statistics.median(times), "prefill_peak_gb": peak / 1e9 if peak is not None else None,
           "prefill_attention_kernel": planned}
    if not args.no_profile:
        gpu_ms, top, attention, _ = _profile_kernels(step, device)
        row.update(prefill_gpu_ms=gpu_ms, prefill_top_kernels=top, prefill_attention_kernel=planned or attention)
    return row


def _new_cache(model, name: str, args, length: int):
    spec = variant_spec(name, args)
    if args.decode_mode == "compiled":
        from transformers import StaticCache

        # every step measure_decode runs: warm-up rounds, two timed loops, host-issue and profiler steps
        steps = args.warmup_steps * args.max_warmup_rounds + 2 * args.decode_steps + 16
        return StaticCache(config=model.config, max_cache_len=length + steps)
    if spec["impl"] == "sparse_k":
        from hf_sparse_attention import SparseCache

        return SparseCache(model)
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _host_issue(step, device, steps: int = 5) -> tuple[float | None, float | None]:
    """``(host ms, GPU span ms)`` of one step, medians over ``steps``: the host time to issue the step while
    the GPU is kept busy by a sleep kernel queued first (so no issue waits on the GPU), and the GPU time
    from the step's first to its last kernel (gaps between kernels included). CUDA only."""
    if torch.device(device).type != "cuda":
        return None, None
    host, span = [], []
    for _ in range(steps):
        _sync(device)
        torch.cuda._sleep(50_000_000)  # tens of ms: longer than any step takes to issue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        step()
        host.append(1e3 * (time.perf_counter() - t0))
        end.record()
        _sync(device)
        span.append(start.elapsed_time(end))
    return statistics.median(host), statistics.median(span)


@torch.no_grad()
def measure_decode(model, name: str, length: int, args) -> dict:
    """Decode steps as a user's loop runs them: the next token and ``cache_position`` stay on the device
    (``cache_position + 1``, as ``generate`` advances it), so nothing in the loop waits for the GPU.

    ``ms/token`` times that loop (host and GPU overlap: the larger of the two per step). ``ms/token
    synced`` times the same loop with one ``synchronize`` per step, as ``generate``'s stopping check does
    (host and GPU add up). ``host ms`` is the host time to issue one step, ``GPU span`` its first to last
    kernel on the GPU (both with the GPU kept busy; compiled mode, where a step never waits on the GPU)."""
    device = args.device
    ids = prompt_ids(model, length, args.decode_batch, args.seed + 7 * length, args)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cache = _new_cache(model, name, args, length)
    out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    del ids
    nxt = out.logits[:, -1:].argmax(-1)
    cache_position = torch.tensor([length], device=device)
    forward = model.forward
    if args.decode_mode == "compiled":
        # Compiled code of earlier rows (another attention, another selector) is dropped: Dynamo's per-function
        # recompile limit would otherwise send this row's layers to eager once earlier rows used it up.
        torch._dynamo.reset()
        forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)

    def step():
        nonlocal nxt, cache_position
        o = forward(input_ids=nxt, past_key_values=cache, use_cache=True, cache_position=cache_position)
        nxt = o.logits[:, -1:].argmax(-1)
        cache_position = cache_position + 1

    def synced_step():
        step()
        _sync(device)

    rounds, compiled_in_warmup, planned = 0, 0, None

    def warm_round():
        for _ in range(args.warmup_steps):
            step()

    def timed(fn) -> float:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(args.decode_steps):
            fn()
        _sync(device)
        return 1e3 * (time.perf_counter() - t0) / args.decode_steps

    with CompileCounter() as cc:
        while rounds < args.max_warmup_rounds:
            before = cc.triton + cc.dynamo_graphs()
            if rounds == 0:  # the kernels of the decode steps (a replayed CUDA graph runs no Python)
                planned = planned_kernels(warm_round)
            else:
                warm_round()
            _sync(device)
            rounds += 1
            new = cc.triton + cc.dynamo_graphs() - before
            compiled_in_warmup += new
            if new == 0:
                break
        before = cc.triton + cc.dynamo_graphs()
        ms = timed(step)
        ms_synced = timed(synced_step)
        compiled_in_timed = cc.triton + cc.dynamo_graphs() - before
    peak = int(torch.cuda.max_memory_allocated()) if torch.device(device).type == "cuda" else None
    row = {"decode_ms_per_token": ms, "decode_tokens_per_s": 1e3 / ms, "decode_ms_per_token_synced": ms_synced,
           "decode_peak_gb": peak / 1e9 if peak is not None else None,
           "warmup_rounds": rounds, "compiles_in_warmup": compiled_in_warmup, "compiles_in_timed_steps": compiled_in_timed,
           "decode_mode": args.decode_mode, "batch": args.decode_batch, "decode_attention_kernel": planned}
    if args.decode_mode == "compiled":
        row["decode_host_ms"], row["decode_gpu_span_ms"] = _host_issue(step, device)
    if not args.no_profile:
        gpu_ms, top, attention, every = _profile_kernels(step, device, steps=4)
        row.update(decode_gpu_ms=gpu_ms, decode_top_kernels=top, decode_attention_kernel=planned or attention,
                   decode_kernels_per_step=sum(n for n, _ in every.values()) if every else None, decode_kernels=every,
                   decode_host_bound_ratio=ms / gpu_ms if gpu_ms else None,
                   decode_host_bound_ratio_synced=ms_synced / gpu_ms if gpu_ms else None)
    return row


@torch.no_grad()
def measure_flat_memory(model, args) -> dict:
    """Streaming over ``--flat-memory-len`` tokens: chunked prefill through ``SparseCache`` then decode
    steps; peak memory (``max_memory_allocated`` since the start, model weights included) each time the
    context passes a power of two, and the cache's kept length at the end."""
    from hf_sparse_attention import SparseCache

    apply_variant(model, "streaming", args)
    device, total = args.device, args.flat_memory_len
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cache = SparseCache(model)
    gen = torch.Generator().manual_seed(args.seed + 11)
    seen, marks, next_mark = 0, [], 1 << max(0, (min(args.chunk, total) - 1).bit_length())
    t0 = time.perf_counter()
    out = None
    while seen < total:
        n = min(args.chunk, total - seen)
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(device)
        pos = torch.arange(seen, seen + n, device=device)
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1, cache_position=pos)
        seen += n
        while seen >= next_mark:
            _sync(device)
            marks.append({"context": next_mark, "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if on_cuda else None})
            next_mark *= 2
    nxt = out.logits[:, -1:].argmax(-1)
    for _ in range(args.decode_steps):
        o = model(nxt, past_key_values=cache, use_cache=True, cache_position=torch.tensor([seen], device=device))
        nxt = o.logits[:, -1:].argmax(-1)
        seen += 1
    _sync(device)
    kept = cache.layers[0].keys.shape[-2] if getattr(cache.layers[0], "keys", None) is not None else None
    return {"variant": "streaming", "phase": "flat_memory", "length": total, "seconds": time.perf_counter() - t0,
            "peak_gb_by_context": marks, "final_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if on_cuda else None,
            "kept_keys_layer0": kept, "decode_steps_after": args.decode_steps}


def environment() -> dict:
    import transformers

    import sparse_k

    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(),
           "torch": torch.__version__, "transformers": transformers.__version__, "sparse_k": sparse_k.__version__,
           "argv": sys.argv}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict]) -> None:
    base_prefill = {r["length"]: r.get("prefill_ms") for r in rows if r["variant"] == "sdpa" and r["phase"] == "prefill"}
    base_decode = {r["length"]: r.get("decode_ms_per_token") for r in rows if r["variant"] == "flex_attention" and r["phase"] == "decode"}
    print("\n| variant | phase | length | ms | vs baseline | GPU ms | peak GB | check | attention kernel |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["phase"] == "prefill":
            ms, base, gpu, peak, kern = r.get("prefill_ms"), base_prefill.get(r["length"]), r.get("prefill_gpu_ms"), r.get("prefill_peak_gb"), r.get("prefill_attention_kernel")
        else:
            ms, base, gpu, peak, kern = r.get("decode_ms_per_token"), base_decode.get(r["length"]), r.get("decode_gpu_ms"), r.get("decode_peak_gb"), r.get("decode_attention_kernel")
        ratio = f"{ms / base:.2f}x" if ms is not None and base else "-"
        check = "ok" if r.get("check_ok") else f"FAILED ({r.get('check_rel_err', float('nan')):.2e})" if "check_ok" in r else r.get("error", "-")[:40]
        extra = ""
        if r["phase"] == "decode" and "compiles_in_timed_steps" in r:
            extra = f" [compiles in timed steps: {r['compiles_in_timed_steps']}]"
        length = f"{r['length']} (B={r['batch']})" if r.get("batch", 1) > 1 else r["length"]
        print(f"| {r['variant']} | {r['phase']} | {length} | {_fmt(ms, '.2f')} | {ratio} | {_fmt(gpu, '.2f')} | {_fmt(peak, '.2f')} | {check}{extra} | {kern or '-'} |")


def print_decode_table(rows: list[dict]) -> None:
    """The decode rows' host/GPU split: pipelined and synced ms/token, each over the GPU ms."""
    rows = [r for r in rows if r["phase"] == "decode" and r.get("decode_ms_per_token") is not None]
    if not rows:
        return
    base = {(r["length"], r.get("batch", 1)): r["decode_ms_per_token"] for r in rows if r["variant"] == "flex_attention"}
    print("\n| variant | context (batch) | ms/token | vs flex | synced ms/token | GPU ms | host ratio | synced host ratio"
          " | host ms/step | GPU span ms | GPU ops/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = base.get((r["length"], r.get("batch", 1)))
        vs = f"{r['decode_ms_per_token'] / b:.2f}x" if b else "-"
        print(f"| {r['variant']} | {r['length']} ({r.get('batch', 1)}) | {r['decode_ms_per_token']:.2f} | {vs} | "
              f"{_fmt(r.get('decode_ms_per_token_synced'), '.2f')} | {_fmt(r.get('decode_gpu_ms'), '.2f')} | "
              f"{_fmt(r.get('decode_host_bound_ratio'), '.2f')} | {_fmt(r.get('decode_host_bound_ratio_synced'), '.2f')} | "
              f"{_fmt(r.get('decode_host_ms'), '.2f')} | {_fmt(r.get('decode_gpu_span_ms'), '.2f')} | "
              f"{_fmt(r.get('decode_kernels_per_step'), '.0f')} |")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _validate(args)
    import hf_sparse_attention  # noqa: F401 - registers attn_implementation="sparse_k"

    model = build_model(args)
    check_ids = prompt_ids(model, args.check_len, 1, args.seed, args)
    noise = dense_noise(model, check_ids)
    print(f"[e2e] dense sdpa vs eager logits gap: {noise:.2e}", flush=True)
    rows = []
    for name in args.variants:
        try:
            apply_variant(model, name, args)
            check = check_variant(model, name, check_ids, noise, args)
        except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
            rows.append({"variant": name, "phase": "check", "length": args.check_len, "error": f"{type(e).__name__}: {e}"})
            print(f"[e2e] {name}: check raised {type(e).__name__}: {e}", flush=True)
            continue
        print(f"[e2e] {name}: check rel err {check['check_rel_err']:.2e} (bound {check['check_bound']:.2e})", flush=True)
        for phase, lengths, fn in (("prefill", args.prefill_lens, measure_prefill), ("decode", args.decode_lens, measure_decode)):
            if phase not in args.phases:
                continue
            for length in lengths:
                row = {"variant": name, "phase": phase, "length": length, **check}
                if check["check_ok"]:
                    try:
                        row.update(fn(model, name, length, args))
                    except Exception as e:  # noqa: BLE001 - e.g. out of memory for one baseline: report it
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    if torch.device(args.device).type == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
                print(f"[e2e] {json.dumps(row, default=str)}", flush=True)
    if args.flat_memory_len:
        try:
            row = measure_flat_memory(model, args)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            row = {"variant": "streaming", "phase": "flat_memory", "length": args.flat_memory_len, "error": f"{type(e).__name__}: {e}"}
        print(f"[e2e] {json.dumps(row, default=str)}", flush=True)
        rows.append(row)
    print_table([r for r in rows if r["phase"] in ("prefill", "decode")])
    print_decode_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "args": {k: v for k, v in vars(args).items()
                                                             if k not in ("tokenizer", "_corpus_tokens")}, "rows": rows}, f, indent=1, default=str)
    return 0 if all((r.get("check_ok", False) or r["phase"] == "flat_memory") and "error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
