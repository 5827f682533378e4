"""Launch a Triton kernel with fewer pipeline stages when its shared memory does not fit the GPU.

The launchers' stage counts are tuned for 16-bit inputs on the H100 (docs/history.md). Inputs of
4 bytes (float32) need twice the shared memory per stage, so a tuned configuration can exceed the
GPU's limit; Triton then refuses it at the first launch (``OutOfResources``), before anything runs.
The same kernel with fewer stages computes the same result, so ``launch`` retries with one stage
less down to one, remembers the count that fitted for that kernel and compile-time configuration,
and says so once. A kernel that does not fit even with one stage raises a ``ValueError`` naming the
configuration and what to change.
"""

from __future__ import annotations

import torch

from ...warn import warn_once

try:  # triton >= 3.0
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - older layouts of the module
    from triton.runtime.autotuner import OutOfResources

__all__ = ["launch"]

#: (kernel name, input dtype, compile-time options) -> the stage count that fitted.
_FITTED: dict[tuple, int] = {}


def _key(kernel, args, options) -> tuple:
    dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor)), None)
    consts = tuple(sorted((k, v) for k, v in options.items() if isinstance(v, (bool, int, float, str))))
    return getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", repr(kernel)), dtype, consts


def launch(kernel, grid, *args, num_stages: int, **options) -> None:
    """``kernel[grid](*args, num_stages=..., **options)``, with fewer stages where the first count
    needs more shared memory than the GPU has (module docstring). The common case (nothing ever
    refitted) costs one dict check on top of the launch."""
    if _FITTED:
        num_stages = _FITTED.get(_key(kernel, args, options), num_stages)
    try:
        kernel[grid](*args, num_stages=num_stages, **options)
    except OutOfResources:
        _refit(kernel, grid, args, options, num_stages)


def _refit(kernel, grid, args, options, tuned: int) -> None:
    key = _key(kernel, args, options)
    stages = tuned
    while True:
        if stages <= 1:
            raise ValueError(
                f"sparse_k: Triton kernel {key[0]} needs more shared memory than this GPU has even with one "
                f"pipeline stage (inputs {key[1]}, BLOCK_M={options.get('BLOCK_M')}, BLOCK_N={options.get('BLOCK_N')}, "
                f"HEAD_DIM={options.get('HEAD_DIM')}); use bfloat16 or float16 inputs")
        stages -= 1
        try:
            kernel[grid](*args, num_stages=stages, **options)
        except OutOfResources:
            continue
        _FITTED[key] = stages
        warn_once(f"sparse_k: Triton kernel {key[0]} with {key[1]} inputs runs {stages} pipeline stage(s) instead "
                  f"of {tuned}: the tuned count needs more shared memory than this GPU has (16-bit inputs run "
                  "the tuned count)")
        return
