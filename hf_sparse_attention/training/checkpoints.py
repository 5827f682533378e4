"""Checkpoints of selector training: ``<output-dir>/checkpoint-<step>/`` holds the selectors
(``selectors.safetensors``, the selector file format), the optimizer and scheduler states
(``optim.pt``) and ``state.json`` (step and loss history); ``--resume latest`` continues from the newest.
``has_run`` tells whether a folder holds a run (its ``log.jsonl`` or a checkpoint); ``clear_run`` deletes the files
a run writes there (``--overwrite``), nothing else.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import torch

from ..selectors import SELECTOR_FILE, save_selectors

__all__ = ["CONFIG_FILE", "LOG_FILE", "checkpoints", "clear_run", "has_run", "save_checkpoint"]

#: The loss log and the ``config.sparse_attention`` dict a run writes in its output folder (beside ``SELECTOR_FILE``).
LOG_FILE = "log.jsonl"
CONFIG_FILE = "sparse_attention_config.json"


def checkpoints(output_dir: str) -> list[str]:
    """The ``checkpoint-<step>`` directories of ``output_dir``, oldest first."""
    return sorted(glob.glob(os.path.join(output_dir, "checkpoint-*")), key=lambda d: int(d.rsplit("-", 1)[1]))


def has_run(output_dir: str) -> bool:
    """Whether ``output_dir`` holds a run: its ``LOG_FILE`` or a ``checkpoint-<step>`` directory."""
    return os.path.exists(os.path.join(output_dir, LOG_FILE)) or bool(checkpoints(output_dir))


def clear_run(output_dir: str) -> None:
    """Delete what a run writes in ``output_dir``: ``LOG_FILE``, the checkpoints, ``SELECTOR_FILE`` and
    ``CONFIG_FILE``; other files stay."""
    for d in checkpoints(output_dir):
        shutil.rmtree(d)
    for name in (LOG_FILE, SELECTOR_FILE, CONFIG_FILE):
        path = os.path.join(output_dir, name)
        if os.path.isfile(path):
            os.remove(path)


def save_checkpoint(output_dir, step, selectors, optimizer, scheduler, pattern, history) -> str:
    """Write ``<output_dir>/checkpoint-<step>/`` (module docstring) and return its path."""
    d = os.path.join(output_dir, f"checkpoint-{step:06d}")
    os.makedirs(d, exist_ok=True)
    save_selectors(selectors, os.path.join(d, "selectors.safetensors"), pattern=pattern)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, os.path.join(d, "optim.pt"))
    with open(os.path.join(d, "state.json"), "w") as f:
        json.dump({"step": step, "history": history}, f)
    return d

