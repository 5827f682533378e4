"""End-to-end speed of a causal LM: prefill time, decode tokens/s and peak memory per length.

Prefill runs the prompt (random token ids, seeded) once with a cache; decode then feeds
``decode_tokens`` greedy tokens one at a time. On CUDA, times use ``torch.cuda.synchronize`` and
memory is ``torch.cuda.max_memory_allocated`` (bytes, reset per measurement). On CPU, memory is the
peak resident set size of the whole process during the measurement (model weights included),
sampled every 5 ms with ``psutil``; the allocator keeps freed memory, so CPU numbers never drop
below earlier peaks of the process (``memory_kind`` says which measure a row holds).
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

__all__ = ["MEMORY_LABELS", "MEMORY_NOTES", "benchmark_lengths", "measure_once"]

#: How each ``memory_kind`` is named in the report and the plot: what was measured, not just "memory".
MEMORY_LABELS = {
    "cpu_peak_rss": "peak RSS of the whole process (MiB)",
    "cuda_max_allocated": "peak CUDA memory allocated (MiB)",
}
#: One sentence per ``memory_kind`` for the report.
MEMORY_NOTES = {
    "cpu_peak_rss": "resident set size of the whole Python process during the measurement (model weights, tokenizer "
                    "and freed-but-kept allocator memory included; it never drops below an earlier peak), not the "
                    "attention's own memory",
    "cuda_max_allocated": "`torch.cuda.max_memory_allocated` during prefill and decode, reset before each measurement "
                          "(model weights included)",
}


class _RssPeak:
    """Peak resident set size (bytes) of this process while the context is open (CPU)."""

    def __init__(self, interval: float = 0.005):
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self.peak = 0

    def __enter__(self):
        self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self._interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_once(model, length: int, decode_tokens: int, *, seed: int = 0) -> dict:
    """One prefill of ``length`` random tokens then ``decode_tokens`` decode steps."""
    device = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(seed + length)
    ids = torch.randint(0, vocab, (1, length), generator=gen).to(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        tracker = None
    else:
        tracker = _RssPeak()
        tracker.__enter__()
    try:
        _sync(device)
        t0 = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        _sync(device)
        prefill = time.perf_counter() - t0
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        t1 = time.perf_counter()
        for _ in range(decode_tokens):
            out = model(nxt, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
        _sync(device)
        decode = time.perf_counter() - t1
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    if device.type == "cuda":
        peak, kind = int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    else:
        peak, kind = int(tracker.peak), "cpu_peak_rss"
    return {"prefill_seconds": prefill, "decode_seconds": decode,
            "decode_tokens_per_second": decode_tokens / decode if decode_tokens and decode > 0 else None,
            "peak_memory_bytes": peak, "memory_kind": kind}


def benchmark_lengths(model, lengths, *, decode_tokens: int = 16, repeats: int = 1,
                      seed: int = 0) -> list[dict]:
    """Median over ``repeats`` of ``measure_once`` at each length.

    Each length first gets one untimed run (prefill plus two decode steps), so that one-time
    costs at a new shape (Triton compilation, allocator growth, layout caches) stay out of the
    timed runs.
    """
    for name, value, low in (("decode_tokens", decode_tokens, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    rows = []
    for length in lengths:
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"lengths must be positive ints, got {length!r}")
        measure_once(model, length, min(decode_tokens, 2), seed=seed)
        runs = [measure_once(model, length, decode_tokens, seed=seed) for _ in range(repeats)]
        tps = [r["decode_tokens_per_second"] for r in runs if r["decode_tokens_per_second"] is not None]
        rows.append({
            "length": int(length),
            "prefill_seconds": statistics.median(r["prefill_seconds"] for r in runs),
            "decode_tokens_per_second": statistics.median(tps) if tps else None,
            "decode_tokens": decode_tokens,
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in runs),
            "memory_kind": runs[0]["memory_kind"],
            "repeats": repeats,
        })
    return rows
