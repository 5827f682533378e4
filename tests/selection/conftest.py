"""Fixtures of the selection tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["gathered", "matmul"])
def refine_logits(request, monkeypatch):
    """Both ways ``page_selection.refine_probabilities`` computes the block queries' logits: gathered at the keys a
    block reads, or one matmul with every key read there (``page_selection._dense_refine`` forced either way)."""
    from sparse_k.selection import page_selection

    monkeypatch.setattr(page_selection, "_dense_refine", lambda *a: request.param == "matmul")
    return request.param
