"""The pip package ships the whole module tree: every package folder of ``kernel_src/`` (``sparse_k``)
and ``hf_sparse_attention/`` is listed in ``pyproject.toml``, and so are the CUDA sources."""

from __future__ import annotations

import pathlib

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _packages(name: str, folder: pathlib.Path) -> set[str]:
    return {".".join((name, *p.parent.relative_to(folder).parts)) for p in folder.rglob("__init__.py")
            if "__pycache__" not in p.parts}


def test_pyproject_lists_every_package():
    found = _packages("sparse_k", ROOT / "kernel_src") | _packages("hf_sparse_attention", ROOT / "hf_sparse_attention")
    assert {"sparse_k.attention.cuda", "sparse_k.layouts", "hf_sparse_attention.evaluation"} <= found
    assert PYPROJECT["package-dir"]["sparse_k"] == "kernel_src"
    missing = sorted(found - set(PYPROJECT["packages"]))
    assert not missing, f"pyproject.toml [tool.setuptools] packages misses {missing}: pip would not install them"


def test_package_data_covers_the_cuda_sources():
    csrc = ROOT / "kernel_src" / "attention" / "cuda" / "csrc"
    sources = sorted(p for p in csrc.iterdir() if p.is_file())
    assert any(p.suffix == ".cu" for p in sources) and any(p.suffix == ".cuh" for p in sources)
    globs = PYPROJECT["package-data"]["sparse_k.attention.cuda"]
    uncovered = [p.name for p in sources if not any(p.relative_to(csrc.parent).match(g) for g in globs)]
    assert not uncovered, f"pyproject.toml package-data leaves out {uncovered}"
