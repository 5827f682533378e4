"""scripts/bench_page_stage.py on the CPU (Triton interpreter, checks only): every bounds configuration and top-k
variant is checked (an earlier revision's kernels beside, loaded from a file) and written to the JSON; bad arguments
fail before any kernel runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_page_stage.py"


def _run(args, tmp_path, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, check=False, env=dict(os.environ, TRITON_INTERPRET="1"))


def test_checks_every_configuration_on_the_cpu(tmp_path):
    before = tmp_path / "before_select_triton.py"
    before.write_text((ROOT / "kernel_src" / "selection" / "select_triton.py").read_text())
    out = tmp_path / "rows.json"
    proc = _run(["--device", "cpu", "--context", "1024", "--query-block", "16", "--chunk", "16", "--every", "2",
                 "--pages", "8", "--rows", "16", "64", "--programs", "1", "2048", "--topk-block", "16",
                 "--before", str(before),
                 "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["kernels"], r["stage"], r.get("rows"), r.get("programs")) for r in rows] == [
        ("this", "bounds", 16, 1), ("this", "bounds", 16, 2048), ("this", "bounds", 64, 1), ("this", "bounds", 64, 2048),
        ("before", "bounds", None, None), ("this, lengths", "topk", None, None), ("this, no lengths", "topk", None, None),
        ("this, lengths, block 16", "topk", None, None), ("before", "topk", None, None)]
    assert all(r["check_ok"] and r["ms"] is None for r in rows)  # checked, not timed on the CPU
    assert (data["chunks"], data["chunks_timed"]) == (4, 2)


def test_bad_arguments_fail_clearly(tmp_path):
    proc = _run(["--device", "cpu", "--context", "1000"], tmp_path)
    assert proc.returncode != 0 and "--context must be a multiple of the page (16), got 1000" in proc.stderr
    proc = _run(["--device", "cpu", "--every", "0"], tmp_path)
    assert proc.returncode != 0 and "--every must be >= 1, got 0" in proc.stderr
