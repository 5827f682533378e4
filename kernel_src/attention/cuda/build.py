"""Building the Hopper CUDA extensions (``csrc/*.cu``) with torch's extension tooling, once.

Each extension is compiled on first use with nvcc for ``sm_90a`` (wgmma and setmaxnreg need the
``a`` target) into ``$SPARSE_K_CUDA_CACHE`` or ``~/.cache/sparse_k``, in a folder named by the hash
of its sources, the shared headers and the flags: later processes load the cached build (under a
second), a changed source builds anew. An extension compiles only the kernels a call can request
(bf16 and fp16 of each default; no tuning variants), its binding includes only the torch headers it
needs (``csrc/sm90_torch.h``), and ninja compiles its files in parallel (the decode kernels in one
file per element type), so the first call waits for its slowest file (timings: docs/history.md).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib

import torch

__all__ = ["CUDA_SRC_DIR", "is_sm90", "load_sm90_extension", "sm90_available"]

#: The CUDA sources shipped with the package.
CUDA_SRC_DIR = pathlib.Path(__file__).resolve().parent / "csrc"
_HEADERS = (
    "sm90_common.cuh", "sm90_fwd_mainloop.cuh", "sm90_tma_host.h", "sm90_selection_host.h", "sm90_view_host.h",
    "sm90_torch.h", "decode_sm90.cuh", "sm90_work_order.h",
)
_CUDA_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a", "-O3", "-lineinfo")


def is_sm90(device) -> bool:
    """Whether ``device`` (a CUDA device) has compute capability 9.0 (H100, H200)."""
    return torch.cuda.get_device_capability(device) == (9, 0)


def sm90_available(device=None) -> bool:
    """Whether the device is an sm_90 GPU and nvcc is there to build the kernels."""
    if not torch.cuda.is_available():
        return False
    from torch.utils import cpp_extension

    dev = torch.device("cuda") if device is None else torch.device(device)
    return is_sm90(dev) and cpp_extension.CUDA_HOME is not None


@functools.cache
def load_sm90_extension(name: str, sources: tuple[str, ...]):
    """Build (or load from the cache folder) the extension ``name`` from ``sources`` (file names in
    ``CUDA_SRC_DIR``) and return its module; RuntimeError saying why when there is no CUDA device or
    no nvcc, and the compiler's error when the build fails."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"{name} needs a CUDA device (torch.cuda.is_available() is False)")
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError(f"{name} needs nvcc: CUDA_HOME not found (set CUDA_HOME or put nvcc on PATH)")
    digest = hashlib.sha256()
    for file in sources + _HEADERS:
        digest.update((CUDA_SRC_DIR / file).read_bytes())
    digest.update(" ".join(_CUDA_FLAGS).encode())
    tag = digest.hexdigest()[:12]
    root = pathlib.Path(os.environ.get("SPARSE_K_CUDA_CACHE", pathlib.Path.home() / ".cache" / "sparse_k"))
    build = root / f"{name}_{tag}"
    build.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=f"sk_{name}_{tag}",
        sources=[str(CUDA_SRC_DIR / file) for file in sources],
        extra_cflags=["-O3"],
        extra_cuda_cflags=[*_CUDA_FLAGS, f"-I{CUDA_SRC_DIR}"],
        build_directory=str(build),
        verbose=False,
    )
