"""Shared test configuration: the `gpu` marker skips cleanly without CUDA."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error ||out - ref|| / ||ref|| in float64 (0 when both are zero)."""
    out, ref = out.double(), ref.double()
    denom = ref.norm()
    if denom == 0:
        return float(out.norm())
    return float((out - ref).norm() / denom)
