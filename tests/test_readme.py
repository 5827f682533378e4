"""The README says what the code does: the pattern table's defaults, and its runnable examples."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import sparse_k as sk

README = Path(__file__).resolve().parents[1] / "README.md"
#: Pattern fields the table leaves out: the causal flag (its own column) and the selector weights file.
_NOT_IN_TABLE = {"causal", "selector"}


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

