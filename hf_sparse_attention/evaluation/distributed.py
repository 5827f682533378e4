"""Work splitting across processes with ``accelerate`` (``accelerate launch``) and merged results.

Every evaluation is a list of independent work items. Process ``r`` of ``n`` takes items
``r, r + n, r + 2n, ...`` (interleaved, so expensive items spread out), runs them, and
``accelerate.utils.gather_object`` merges the results on every process, sorted back into the
original order: the merged list does not depend on the number of processes.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from typing import Callable

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

__all__ = ["process_state", "run_items", "warnings_above_bars"]


def process_state():
    """``accelerate.PartialState`` (one process without ``accelerate launch``/``torchrun``).

    Without CUDA it is created with ``cpu=True``, so CPU processes started by ``torchrun`` or
    ``accelerate launch --cpu`` join one gloo group.
    """
    import torch
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def _describe(item) -> str:
    """Short label of a work item for the progress bar (kind, variant, context)."""
    if not isinstance(item, dict):
        return ""
    variant = getattr(item.get("variant"), "label", "")
    context = item.get("context") or (item["items"][0].context if item.get("items") else "")
    return " ".join(str(x) for x in (item.get("kind", ""), variant, context) if x != "")


@contextlib.contextmanager
def warnings_above_bars():
    """Print warnings (``warnings.warn``) and Transformers' log records through ``tqdm.write``, so they
    appear on their own lines above the progress bars instead of breaking a bar's line."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n")
        tqdm.write(text, file=sys.stderr if file is None else file)

    warnings.showwarning = show
    try:
        with logging_redirect_tqdm(loggers=[logging.root, logging.getLogger("transformers")]):
            yield
    finally:
        warnings.showwarning = shown


def run_items(items: list, fn: Callable[[object], dict], *, state=None, desc: str = "work items",
              progress: bool = True, key=None) -> list[dict]:
    """Run ``fn`` on this process's share of ``items`` and return all results in item order.

    ``key(item)`` (optional) orders this process's share before running (e.g. by variant, so a model
    is reconfigured once per variant); results are still returned in the original order. With
    ``progress``, warnings print above the bar (``warnings_above_bars``).
    """
    state = state or process_state()
    n, rank = state.num_processes, state.process_index
    mine = list(range(rank, len(items), n))
    if key is not None:
        mine.sort(key=lambda i: key(items[i]))
    out = []
    bar = tqdm(mine, desc=desc if n == 1 else f"{desc} [rank {rank}/{n}]", disable=not progress)
    with warnings_above_bars() if progress else contextlib.nullcontext():
        for i in bar:
            bar.set_postfix_str(_describe(items[i]), refresh=False)
            res = fn(items[i])
            out.append({**res, "_index": i})
    if n > 1:
        from accelerate.utils import gather_object

        out = gather_object(out)
    out.sort(key=lambda r: r["_index"])
    if [r["_index"] for r in out] != list(range(len(items))):
        raise RuntimeError("merged results do not cover every work item exactly once")
    for r in out:
        del r["_index"]
    return out
