"""``attention.triton.fitting.launch``: a launch Triton refuses for shared memory (``OutOfResources``,
raised before anything runs, as float32 inputs with the tuned stage count on an H100) runs again with
fewer pipeline stages; the count that fitted is remembered per kernel and configuration."""

import warnings

import pytest

pytest.importorskip("triton")

import torch
from triton.runtime.errors import OutOfResources

from sparse_k.attention.triton import fitting


class FakeKernel:
    """``kernel[grid](*args, num_stages=..., **options)`` that fits only up to ``fits`` stages."""

    def __init__(self, name, fits):
        self.__name__, self.fits, self.calls = name, fits, []

    def __getitem__(self, grid):
        def run(*args, num_stages, **options):
            self.calls.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(245760, 232448, "shared memory")
            return grid, args, options

        return run


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(fitting, "_FITTED", {})


def test_tuned_count_runs_when_it_fits():
    k = FakeKernel("_fits_kernel", fits=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fitting.launch(k, (4, 2), torch.zeros(1, dtype=torch.bfloat16), num_stages=3, BLOCK_M=128, num_warps=8)
    assert k.calls == [3] and fitting._FITTED == {}


def test_fewer_stages_then_remembered():
    k = FakeKernel("_tight_kernel", fits=1)
    x = torch.zeros(1, dtype=torch.float32)
    with pytest.warns(UserWarning, match=r"_tight_kernel with torch.float32 inputs runs 1 pipeline stage\(s\) instead of 3"):
        fitting.launch(k, (4, 2), x, num_stages=3, BLOCK_M=128, BLOCK_N=128, HEAD_DIM=64)
    assert k.calls == [3, 2, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fitting.launch(k, (8, 2), x, num_stages=3, BLOCK_M=128, BLOCK_N=128, HEAD_DIM=64)  # same configuration
    assert k.calls == [3, 2, 1, 1]
    k.fits = 3
    fitting.launch(k, (8, 2), x, num_stages=3, BLOCK_M=64, BLOCK_N=64, HEAD_DIM=64)  # another configuration
    assert k.calls[-1] == 3


def test_no_stage_count_fits():
    k = FakeKernel("_huge_kernel", fits=0)
    with pytest.raises(ValueError, match=r"_huge_kernel needs more shared memory.*torch.float32.*BLOCK_M=128.*HEAD_DIM=256.*bfloat16"):
        fitting.launch(k, (1,), torch.zeros(1), num_stages=2, BLOCK_M=128, BLOCK_N=64, HEAD_DIM=256)
    assert k.calls == [2, 1]
