"""The selection's Triton kernel modules, imported on first use and kept (``KernelModule``)."""

from __future__ import annotations

import importlib
import os

import torch

__all__ = ["KernelModule", "interpreter_on"]


def interpreter_on() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's interpreter (kernels on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class KernelModule:
    """A Triton kernel module of this package (``name``, e.g. ``".select_triton"``), imported once by ``load()``
    (ImportError without triton) and kept in ``module``, so a traced call (``torch.compile``) reads the attribute
    instead of tracing an import, which Dynamo cannot. On a GPU machine without the interpreter the module is
    imported when this object is made, before any compiled call looks for it (CPU runs import it on first use,
    interpreted). ``kernel``: the name of one of its ``@triton.jit`` functions (``interpreted``)."""

    def __init__(self, name: str, kernel: str):
        self.name, self.kernel, self.module = name, kernel, None
        if not interpreter_on() and torch.cuda.is_available():
            try:
                self.load()
            except ImportError:
                pass

    def load(self):
        """The module (imported now if it was not)."""
        if self.module is None:
            self.module = importlib.import_module(self.name, __package__)
        return self.module

    def interpreted(self) -> bool:
        """Whether the module's kernels run under the interpreter (it was imported with ``TRITON_INTERPRET=1``)."""
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(getattr(self.load(), self.kernel), InterpretedFunction)
