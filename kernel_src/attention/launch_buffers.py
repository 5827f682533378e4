"""Host-side buffers the launchers keep across calls, made outside any CUDA-graph pool: the split-KV
merge's arrival counters (Triton split-KV forward and CUDA decode), cached placeholder tensors for
kernel arguments a launch never reads, and a ``TokenLayout`` as the Triton kernels' arguments."""

from __future__ import annotations

import threading

import torch

__all__ = ["placeholder", "selection_args", "split_counters"]

_COUNTERS: dict = {}
_RETIRED: list = []  # replaced counter buffers stay alive: a captured CUDA graph may still point at them


def split_counters(device, n: int) -> torch.Tensor | None:
    """Per-(device, stream) int32 arrival counters (at least ``n``) for the fused split merge.

    They are zero between launches: each launch's last arrival resets its tile's counter. One buffer
    per stream keeps launches on concurrent streams apart. ``None`` while a CUDA graph is captured on
    a stream without a large enough buffer (no allocation inside a capture: the caller launches the
    combine kernel instead); a graph captured on a stream that ran the same call before merges in place."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if buf is not None:
        _RETIRED.append(buf)
    buf = _outside_graph_pool(device, lambda: torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    _COUNTERS[key] = buf
    return buf


def _outside_graph_pool(device, make):
    """``make()`` for a buffer kept across calls, allocated where no CUDA-graph memory pool takes it.

    ``torch.compile(mode="reduce-overhead")`` (CUDA-graph trees) sends every allocation of the thread
    that warms up or records a graph into the graph's pool, and refuses pool memory that outlives the
    graph's outputs; so the buffer is made on a helper thread (then synchronised: a one-time cost)."""
    if torch.device(device).type != "cuda":
        return make()
    box: list = []

    def work():
        try:
            box.append(make())
            torch.cuda.synchronize(device)
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            box.append(e)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


_PLACEHOLDERS: dict = {}


def placeholder(dev, dtype, ndim: int) -> torch.Tensor:
    """A cached zero tensor of shape ``(1,) * ndim`` for kernel arguments that a launch never reads
    (no allocation or fill kernel per call: decode launches are short). Made outside any CUDA-graph
    pool (``_outside_graph_pool``); while tracing or capturing, an uncached empty tensor instead."""
    if torch.compiler.is_compiling():  # traced: a graph op (no guard on the cache's contents)
        return torch.empty((1,) * ndim, dtype=dtype, device=dev)
    key = (str(dev), dtype, ndim)
    t = _PLACEHOLDERS.get(key)
    if t is not None:
        return t
    if torch.device(dev).type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty((1,) * ndim, dtype=dtype, device=dev)
    t = _PLACEHOLDERS[key] = _outside_graph_pool(dev, lambda: torch.zeros((1,) * ndim, dtype=dtype, device=dev))
    return t


def selection_args(sel, dev):
    """Pointers, strides and sizes of a ``TokenLayout`` in the kernel's order (dummies without one)."""
    if sel is None:
        d = placeholder(dev, torch.int32, 4)
        return (d, d, d, placeholder(dev, torch.int64, 1), 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1)
    idx, cnt = sel.indices, sel.counts
    w = sel.weights if sel.weights is not None else idx
    fb = sel.first_block.to(device=dev, dtype=torch.int64).expand(idx.shape[0]).contiguous()
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    return (
        idx, cnt, w, fb, idx.stride(0), idx.stride(1), idx.stride(2), cnt.stride(0), cnt.stride(1), cnt.stride(2),
        w.stride(0), w.stride(1), w.stride(2), idx.shape[2], sel.query_block,
    )
