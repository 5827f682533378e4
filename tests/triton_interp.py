"""Running the Triton kernel tests on a CPU-only machine under Triton's interpreter.

The interpreter is chosen when triton itself and the kernel modules are imported (triton's own
``tl.zeros`` & co. are jit functions too). So a test file imports its kernel modules through
``import_kernels``: on the CPU it sets ``TRITON_INTERPRET=1`` for the import only (nothing leaks to
other test files) and reloads a kernel module that was compiled-mode. If triton was imported
earlier in the session (e.g. through ``import sparse_k``), interpreting in this process is
impossible (``in_process`` False): the file's kernel tests (``KERNEL_TEST``) are then left out of
this session's collection, and its ``run_file_interpreted`` test runs the whole file in a fresh
interpreter with the variable set.

This module imports neither triton nor ``sparse_k`` at import time.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
#: The repository root (the subprocess runs there, as pytest does in CI).
ROOT = Path(__file__).resolve().parents[1]
#: Marks a file's kernel tests. Where its module's ``IN_PROCESS`` is False they cannot run in this
#: process, and ``tests/conftest.py`` takes them out of the collection (reported as deselected, with a
#: summary line saying where they run) instead of reporting them as skipped: the file's
#: ``test_interpreter_suite_in_subprocess`` runs them in a fresh interpreter.
KERNEL_TEST = pytest.mark.interpreted_kernel_test


#: Kernel modules that import the shared Triton device functions, and the modules that hold those.
ATTENTION_KERNELS = ("attention.triton.fwd", "attention.triton.bwd", "attention.triton.structured",
                     "attention.triton.structured_bwd")
SHARED_KERNEL_MODULES = ("attention.triton.rules",)


def _compiled_mode(module) -> bool:
    from triton.runtime.jit import JITFunction

    return any(isinstance(obj, JITFunction) for obj in vars(module).values())


def import_kernels(*names: str) -> tuple[bool, bool, list]:
    """Import ``sparse_k.<name>`` for each name, interpreted when there is no GPU.

    Returns ``(have_triton, in_process, modules)``: ``have_triton`` False when triton is missing
    (``modules`` is then empty); ``in_process`` True when the kernels run in this process
    (compiled on a GPU, or interpreted).
    """
    prev = os.environ.get("TRITON_INTERPRET")
    if not ON_GPU:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        # The attention kernels share the device functions of ``attention.triton.rules``: imported (and, where
        # needed, reloaded) first, so that the kernel modules bind the interpreted ones.
        shared = [n for n in SHARED_KERNEL_MODULES if n not in names and any(x in ATTENTION_KERNELS for x in names)]
        modules = [importlib.import_module(f"sparse_k.{name}") for name in (*shared, *names)]
        in_process = ON_GPU or isinstance(tl.zeros, InterpretedFunction)
        if in_process and not ON_GPU:
            modules = [importlib.reload(m) if _compiled_mode(m) else m for m in modules]
        return True, in_process, modules[len(shared):]
    except ImportError:  # pragma: no cover - triton missing
        return False, False, []
    finally:
        if prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prev


def run_file_interpreted(path: str, min_passed: int, *pytest_args: str, timeout: int = 900) -> None:
    """Run the test file ``path`` in a fresh interpreter with ``TRITON_INTERPRET=1`` set before triton
    loads; assert it passes and that at least ``min_passed`` tests ran there."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", "-x", *pytest_args],
        check=False, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
    )
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    passed = re.search(r"(\d+) passed", res.stdout.strip().splitlines()[-1])
    assert passed and int(passed.group(1)) >= min_passed, res.stdout[-2000:]
