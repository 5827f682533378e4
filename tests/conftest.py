"""Shared test configuration: the `gpu` marker skips cleanly without CUDA; Triton kernel tests that
cannot run in this process are left out of it (they run in a fresh interpreter, see
``tests/triton_interp.py``) and a summary line says so.

Test files sit in one folder per feature (``core``, ``attention_kernels``, ``decode``, ``selection``,
``integration``, ``hub``, ``evaluation``, ``docs``), without ``__init__.py``: pytest's default import
mode puts each file's folder and ``tests/`` (this file's) on ``sys.path``, so file names must stay
unique across folders and shared code lives in ``helpers.py``, ``triton_interp.py`` or a folder's
non-test module (``integration/tiny_models.py``, ``selection/selection_reference.py``), never in
another test file."""

from collections import Counter

import pytest
import torch

_ELSEWHERE = pytest.StashKey[Counter]()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "interpreted_kernel_test: a Triton kernel test that runs under TRITON_INTERPRET on the CPU "
        "(in this process, or in its file's test_interpreter_suite_in_subprocess)"
    )


def pytest_collection_modifyitems(config, items):
    elsewhere = [it for it in items
                 if it.get_closest_marker("interpreted_kernel_test") and not getattr(it.module, "IN_PROCESS", True)]
    if elsewhere:
        ids = {id(it) for it in elsewhere}
        items[:] = [it for it in items if id(it) not in ids]
        config.hook.pytest_deselected(items=elsewhere)
        config.stash[_ELSEWHERE] = Counter(it.path.name for it in elsewhere)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts = config.stash.get(_ELSEWHERE, None)
    if counts:
        files = ", ".join(f"{name} ({n})" for name, n in sorted(counts.items()))
        terminalreporter.write_line(
            f"{sum(counts.values())} Triton kernel tests were deselected here and run inside their file's "
            f"test_interpreter_suite_in_subprocess instead (triton was imported before TRITON_INTERPRET=1 could be "
            f"set in this process): {files}"
        )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error ||out - ref|| / ||ref|| in float64 (0 when both are zero)."""
    out, ref = out.double(), ref.double()
    denom = ref.norm()
    if denom == 0:
        return float(out.norm())
    return float((out - ref).norm() / denom)


@pytest.fixture(params=["gathered", "matmul"])
def refine_logits(request, monkeypatch):
    """Both ways ``page_selection.refine_probabilities`` computes the block queries' logits: gathered at the keys a
    block reads, or one matmul with every key read there (``page_selection._dense_refine`` forced either way)."""
    from sparse_k.selection import page_selection

    monkeypatch.setattr(page_selection, "_dense_refine", lambda *a: request.param == "matmul")
    return request.param
