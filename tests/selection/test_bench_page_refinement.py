"""scripts/bench_page_refinement.py on the CPU (Triton interpreter, checks only): every configuration of the sweep is
checked against the gather kernel and written to the JSON; bad arguments fail before any kernel runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_page_refinement.py"


def _run(args, tmp_path, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, check=False, env=dict(os.environ, TRITON_INTERPRET="1"))


def test_checks_every_configuration_on_the_cpu(tmp_path):
    out = tmp_path / "rows.json"
    proc = _run(["--device", "cpu", "--context", "640", "--queries", "18", "--pages-per-query", "6", "--rows", "16",
                 "64", "--block-n", "32", "--split", "128", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["lists"], r["rows"]) for r in rows] == [("random", 16), ("random", 64), ("clustered", 16),
                                                       ("clustered", 64)]
    for r in rows:
        assert r["check_ok"] and r["check_max_abs"] <= 1e-5 and r["queries"] == 18, r
        assert r["useful_tflops"] is None  # no timing on the CPU
    assert proc.stdout.count("check ok") == 4


def test_bad_arguments_fail_clearly(tmp_path):
    proc = _run(["--device", "cpu", "--context", "64", "--queries", "65"], tmp_path)
    assert proc.returncode != 0 and "--queries must be in [1, --context (64)], got 65" in proc.stderr
    proc = _run(["--device", "cpu", "--pages-per-query", "0"], tmp_path)
    assert proc.returncode != 0 and "--pages-per-query must be >= 1, got 0" in proc.stderr
