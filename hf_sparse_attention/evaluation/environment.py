"""The environment recorded in every results file: hardware, library versions, git commit, seed."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import random
import subprocess
import sys

import torch

__all__ = ["environment_record", "set_seed"]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def environment_record(num_processes: int = 1) -> dict:
    """GPU(s), CPU, Python/torch/transformers/package versions and the git commit."""
    import hf_sparse_attention

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "memory_bytes": int(p.total_memory),
                         "capability": f"{p.major}.{p.minor}"})
    return {
        "timestamp_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpus": gpus,
        "cuda": torch.version.cuda,
        "num_processes": int(num_processes),
        "versions": {
            "hf_sparse_attention": hf_sparse_attention.__version__,
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "triton": _version("triton"),
            "accelerate": _version("accelerate"),
            "datasets": _version("datasets"),
            "evaluate": _version("evaluate"),
            "kernels": _version("kernels"),
        },
        "git": _git_commit(),
    }


def set_seed(seed: int) -> None:
    """Seed Python, NumPy (when present) and torch (all devices)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)
