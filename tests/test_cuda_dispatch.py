"""When the structured forward hands a call to the Hopper CUDA kernel (``sparse_k.cuda_dispatch``).

CPU tests of the rules; the kernel itself is tested on the GPU in ``test_cuda_structured.py``."""

import pytest
import torch

from sparse_k import cuda_dispatch, row_geometry
from sparse_k.cuda_dispatch import cuda_enabled, cuda_structured_applies, plain_geometry, try_cuda_structured


def test_env_switch(monkeypatch):
    monkeypatch.delenv(cuda_dispatch.CUDA_ENV, raising=False)
    assert cuda_enabled()
    monkeypatch.setenv(cuda_dispatch.CUDA_ENV, "0")
    assert not cuda_enabled()
    monkeypatch.setenv(cuda_dispatch.CUDA_ENV, "1")
    assert cuda_enabled()
    monkeypatch.setenv(cuda_dispatch.CUDA_ENV, "yes")
    with pytest.raises(ValueError, match="SPARSE_K_CUDA='yes'"):
        cuda_enabled()


@pytest.mark.parametrize(
    "q_len, kv_len, mask_row, expected",
    [
        (37, 37, None, True),  # plain self-attention
        (5, 37, None, False),  # chunked prefill: queries bottom-right, q_start = 32
        (37, 37, [0, 0] + [1] * 35, False),  # left padding: k_start = 2 for row 1
        (37, 37, [1] * 37, False),  # any mask: offsets known on the device only, not read (no sync)
    ],
)
def test_plain_geometry(q_len, kv_len, mask_row, expected):
    mask = None
    if mask_row is not None:
        mask = torch.ones(2, kv_len, dtype=torch.long)
        mask[1] = torch.tensor(mask_row)
    geo = row_geometry(2, q_len, kv_len, mask)
    assert plain_geometry(geo, q_len, kv_len) is expected


def test_custom_op_geometry_without_host_offsets_is_not_plain():
    from types import SimpleNamespace

    z = torch.zeros(1, dtype=torch.long)
    assert not plain_geometry(SimpleNamespace(q_start=z, k_start=z, k_end=z + 8), 8, 8)


def test_cpu_calls_stay_on_triton():
    q, k, v = torch.randn(1, 4, 40, 128), torch.randn(1, 2, 40, 128), torch.randn(1, 2, 40, 128)
    geo = row_geometry(1, 40, 40, None)
    assert not cuda_structured_applies(q, k, v, geo, pattern_id=1, causal=True)
    assert try_cuda_structured(q, k, v, geo, pattern_id=1, params=(16, 0, 0, 0), causal=True, scale=0.1) is None
