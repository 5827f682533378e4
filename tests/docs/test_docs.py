"""The documentation keeps its shape: a short README without dated session logs (those live in
docs/benchmarks.md and docs/history.md), code comments without measurement dates, and every
"design §N" the code cites exists in docs/design.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"

#: Longest README allowed: a user's guide, not a lab notebook.
README_MAX_LINES = 300

#: Markers of dated session logs, which belong in docs/ (case-insensitive).
DATED_MARKERS = {
    "session number": re.compile(r"\bsession[- ]\d", re.IGNORECASE),
    "UTC time": re.compile(r"\b\d\d:\d\d(?:[–-]\d\d:\d\d)? UTC\b"),
    "issue number": re.compile(r"\bissue \d", re.IGNORECASE),
}

#: In code, a calendar date marks a measurement history too (README's performance table may date itself).
CODE_DATED_MARKERS = {**DATED_MARKERS, "date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")}

#: Folders whose code must say what and why, not when it was measured.
UNDATED_CODE_DIRS = ("kernel_src", "hf_sparse_attention", "scripts")

#: "design §6", "design notes §4", "design §6-§7", "Design §4".
DESIGN_REF = re.compile(r"design(?: notes)? §(\d+)(?:\s*[-–]\s*§?(\d+))?", re.IGNORECASE)

CODE_DIRS = ("kernel_src", "hf_sparse_attention", "tests", "scripts")
CODE_SUFFIXES = {".py", ".cu", ".cuh", ".cpp", ".h", ".sh", ".toml"}


def design_sections(text: str) -> set[int]:
    """Numbers of the ``## N. Title`` sections of a design page."""
    return {int(m) for m in re.findall(r"^## (\d+)\.", text, re.MULTILINE)}


def design_refs(text: str) -> list[int]:
    """Every section number a text cites as "design §N" (both ends of a range "§6-§7")."""
    out = []
    for m in DESIGN_REF.finditer(text):
        out.append(int(m.group(1)))
        if m.group(2):
            out.append(int(m.group(2)))
    return out


def dated_markers(text: str, markers: dict[str, re.Pattern] = DATED_MARKERS) -> list[str]:
    """``"line N: marker kind: matched text"`` for every dated-session marker in ``text``."""
    hits = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for kind, rx in markers.items():
            hits += [f"line {lineno}: {kind}: {m.group(0)!r}" for m in rx.finditer(line)]
    return hits


def code_files(dirs=CODE_DIRS):
    """Source files of the package, tests and scripts (this file excluded: its self-checks cite on purpose)."""
    for d in dirs:
        for path in sorted((ROOT / d).rglob("*")):
            if path.is_file() and path.suffix in CODE_SUFFIXES and path != Path(__file__).resolve():
                yield path


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}); move measurements to docs/"


def test_readme_has_no_dated_session_logs():
    hits = dated_markers(README.read_text())
    assert not hits, "dated session logs belong in docs/benchmarks.md or docs/history.md:\n" + "\n".join(hits)


def test_code_has_no_dated_measurements():
    hits = []
    for path in code_files(UNDATED_CODE_DIRS):
        hits += [f"{path.relative_to(ROOT)}: {h}" for h in dated_markers(path.read_text(errors="replace"), CODE_DATED_MARKERS)]
    assert not hits, ("code comments say what and why, not when it was measured; move dated numbers to "
                      "docs/history.md or docs/benchmarks.md:\n" + "\n".join(hits))


def test_readme_gives_the_ci_test_command():
    command = "bash scripts/run_tests.sh"
    assert command in README.read_text(), f"README.md must give the test command {command!r}"
    assert command in (ROOT / ".ci" / "run").read_text(), f".ci/run must call the README's test command {command!r}"


@pytest.mark.parametrize("name", ["design.md", "benchmarks.md", "history.md", "usage.md"])
def test_docs_pages_exist_and_are_linked(name):
    assert (ROOT / "docs" / name).is_file(), f"docs/{name} is missing"
    assert f"docs/{name}" in README.read_text(), f"README.md does not link docs/{name}"


def test_every_design_reference_exists():
    sections = design_sections(DESIGN.read_text())
    assert sections, "docs/design.md has no '## N. Title' sections"
    missing, seen = [], 0
    for path in [*code_files(), README, *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            for n in design_refs(line):
                seen += 1
                if n not in sections:
                    missing.append(f"{path.relative_to(ROOT)}:{lineno}: design §{n}")
    assert seen > 0, "no 'design §N' reference found: the pattern no longer matches the code's citations"
    assert not missing, f"sections missing from docs/design.md (has {sorted(sections)}):\n" + "\n".join(missing)


def test_no_reference_to_files_outside_the_repository():
    stale = []
    for path in [*code_files(), README]:
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if re.search(r"\bMETHOD\.md\b|cuda/NOTES\.md|shared/docs/", line):
                stale.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not stale, "references to documents that are not in the repository:\n" + "\n".join(stale)


def test_the_checks_catch_what_they_look_for():
    # The helpers above must fire on the markers and references they exist to catch.
    assert design_sections("## 3. Shapes\ntext\n## 10. Tolerances\n") == {3, 10}
    assert design_refs("see design §6-§7 and Design §4, design notes §12") == [6, 7, 4, 12]
    assert len(dated_markers("Session 5 at 16:09–16:12 UTC for issue 4")) == 3
    assert dated_markers("sessions of training; 4096 keys; tissue 4") == []
    assert len(dated_markers("timed on 2026-11-22 (session 6)", CODE_DATED_MARKERS)) == 2
    assert dated_markers("timed on 2026-11-22", DATED_MARKERS) == []
    assert dated_markers("version 2026.11, shape 2048-128-64, date (UTC)", CODE_DATED_MARKERS) == []
