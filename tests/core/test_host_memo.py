"""layouts.host_memo: geometry tensors built once per host-known key and shared by the layers of a forward."""

from __future__ import annotations

import torch

from sparse_k.layouts import host_memo as hm
from sparse_k.layouts.geometry import row_geometry


def test_same_key_same_tensors_and_separate_inference_mode(monkeypatch):
    monkeypatch.setattr(hm, "_MEMO", type(hm._MEMO)())
    built = []

    def build():
        built.append(1)
        return torch.arange(3)

    a = hm.host_memo(("k", 1), "cpu", build)
    assert hm.host_memo(("k", 1), "cpu", build) is a and len(built) == 1
    assert hm.host_memo(("k", 2), "cpu", build) is not a and len(built) == 2
    with torch.inference_mode():
        b = hm.host_memo(("k", 1), "cpu", build)
    assert b is not a and b.is_inference() and not a.is_inference()  # an inference tensor cannot be saved for backward


def test_keeps_the_last_keys_within_its_bytes_and_nothing_while_tracing(monkeypatch):
    monkeypatch.setattr(hm, "_MEMO", type(hm._MEMO)())
    for i in range(hm.MEMO_SIZE + 5):
        hm.host_memo(("k", i), "cpu", lambda: torch.zeros(1))
    assert len(hm._MEMO) == hm.MEMO_SIZE
    monkeypatch.setattr(hm, "MEMO_BYTES", 100)
    hm.host_memo(("big",), "cpu", lambda: torch.zeros(26))  # 104 bytes: not kept
    assert all(key[0] != ("big",) for key in hm._MEMO)
    for i in range(3):
        hm.host_memo(("mid", i), "cpu", lambda: (torch.zeros(10), [torch.zeros(2, dtype=torch.float64)]))  # 56 bytes
    kept = [key[0] for key in hm._MEMO]
    assert kept == [("mid", 2)], kept  # the older ones dropped to stay within the bytes
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    first = hm.host_memo(("traced",), "cpu", lambda: torch.zeros(1))
    assert hm.host_memo(("traced",), "cpu", lambda: torch.zeros(1)) is not first
    assert all(key[0] != ("traced",) for key in hm._MEMO)


def test_row_geometry_with_host_offsets_is_shared_and_with_a_mask_is_not():
    g1, g2 = row_geometry(2, 5, 9), row_geometry(2, 5, 9)
    assert g1 is g2 and g1.host == ([4], [0], [9])
    assert row_geometry(2, 5, 9, q_start=3) is not g1 and row_geometry(2, 5, 9, q_start=3).host == ([3], [0], [9])
    mask = torch.ones(2, 9, dtype=torch.bool)
    assert row_geometry(2, 5, 9, mask) is not row_geometry(2, 5, 9, mask)
