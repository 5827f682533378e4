"""State that a learned selection keeps from one call of a generation to the next, in buffers written in place.

A decode step that starts inside a query block needs that block's *first query*, which an earlier
call saw (the training-free page selection, ``page_selection``, and the DSA indexer,
``selectors._dsa_block_queries``). The caller keeps that state in a plain ``dict`` (per layer, or on
the indexer); this module keeps every tensor in it as a *buffer*:

* allocated once, outside any traced graph, filled with a neutral value (block ids ``-1``: nothing
  matches), and marked with ``torch._dynamo.mark_static_address`` (as Transformers' ``StaticCache``
  marks its key/value tensors);
* later calls write it with ``copy_`` and never store a new tensor in the dict.

Why: under ``torch.compile(mode="reduce-overhead")`` a decode step is a replayed CUDA graph whose
outputs live in memory the next replay overwrites. State that *held* an output of one step (a new
tensor stored in the dict while tracing) is read by the next step after it was overwritten
(``RuntimeError: accessing tensor output of CUDAGraphs that has been overwritten``). A buffer that
the graph reads and then writes in place is a static graph input the graph mutates, which CUDA
graphs support. A buffer missing while tracing (the first call of a generation was itself
compiled) is allocated by ``_allocate``, which ``torch.compiler.disable`` runs eagerly: one graph
break on that traced call only; later calls find the buffers and trace as one graph.
"""

from __future__ import annotations

import torch

__all__ = ["buffers_fit", "new_state_dict", "state_buffers"]

#: ``name -> (shape, dtype, fill)`` of the buffers one call needs.
Spec = dict


def buffers_fit(state: dict, spec: Spec, device: torch.device) -> bool:
    """Whether every ``spec`` entry of ``state`` is a tensor of that shape and dtype on ``device`` (reads no device value)."""
    for name, (shape, dtype, _) in spec.items():
        t = state.get(name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
            return False
    return True


@torch.compiler.disable
def _allocate(state: dict, spec: Spec, device: torch.device) -> None:
    with torch.inference_mode(False):  # a normal tensor: writable in and outside inference mode
        for name, (shape, dtype, fill) in spec.items():
            buf = torch.full(tuple(shape), fill, dtype=dtype, device=device)
            torch._dynamo.mark_static_address(buf)
            state[name] = buf


def state_buffers(state: dict, spec: Spec, device: torch.device) -> bool:
    """Make ``state[name]`` a buffer of every ``spec`` entry (``name -> (shape, dtype, fill)``) on ``device``.

    Returns True when the buffers were already there (they hold what the previous call wrote), False
    when they were (re)allocated and hold their ``fill`` values (first call, or another batch size,
    dtype or device). Callers write them with ``copy_`` only.
    """
    if buffers_fit(state, spec, device):
        return True
    _allocate(state, spec, device)
    return False


@torch.compiler.disable
def new_state_dict(owner, attr: str) -> dict:
    """``owner.attr`` when it is a dict, else a new empty dict stored there (in ``owner.__dict__``, outside any
    traced graph: call it only when the attribute is missing, so that a traced call that finds it needs no break)."""
    state = owner.__dict__.get(attr)
    if not isinstance(state, dict):
        state = owner.__dict__[attr] = {}
    return state
