"""Checkpoints of selector training: ``<output-dir>/checkpoint-<step>/`` holds the selectors
(``selectors.safetensors``, the selector file format), the optimizer and scheduler states
(``optim.pt``) and ``state.json`` (step and loss history); ``--resume latest`` continues from the newest.
"""

from __future__ import annotations

import glob
import json
import os

import torch

from ..selectors import save_selectors

__all__ = ["checkpoints", "save_checkpoint"]


def checkpoints(output_dir: str) -> list[str]:
    """The ``checkpoint-<step>`` directories of ``output_dir``, oldest first."""
    return sorted(glob.glob(os.path.join(output_dir, "checkpoint-*")), key=lambda d: int(d.rsplit("-", 1)[1]))


def save_checkpoint(output_dir, step, selectors, optimizer, scheduler, pattern, history) -> str:
    """Write ``<output_dir>/checkpoint-<step>/`` (module docstring) and return its path."""
    d = os.path.join(output_dir, f"checkpoint-{step:06d}")
    os.makedirs(d, exist_ok=True)
    save_selectors(selectors, os.path.join(d, "selectors.safetensors"), pattern=pattern)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, os.path.join(d, "optim.pt"))
    with open(os.path.join(d, "state.json"), "w") as f:
        json.dump({"step": step, "history": history}, f)
    return d

