"""``scripts/tune_decode.py --part static`` (the timing probe of a learned layer's StaticCache decode launch) in its
CPU dry run: every launch row (the former and current key tiles, fewer splits, the static part alone, the adapter's
whole call) runs under the interpreter on a slot-masked cache with the query's geometry on the device, with and
without SparseK weights, and matches the PyTorch path; the token-layout prefill parts (``--part token``,
``--part token_blocks``) likewise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tune_decode.py"


def test_static_part_dry_run_rows_are_checked(tmp_path):
    out = tmp_path / "static.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--part", "static", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["part"] == "static" for r in rows)
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    whats = {(r["what"], r["weights"]) for r in rows}
    for what in ("old default: 64-key tiles, index prefetch, per-split merge", "new default",
                 "adapter call (geometry + launch)"):
        assert {(what, True), (what, False)} <= whats, whats
    assert any(r["what"].startswith("static part") for r in rows)
    for r in rows:
        if not r["what"].startswith("static part"):
            assert r["err"] < 1e-2, r  # fp16 operands against the PyTorch path (design §10)
    assert {r["splits"] for r in rows if r["what"] == "new default, 8 splits"} == {8}
    assert "| B | kv_len |" in proc.stdout


def test_sass_part_reports_registers_and_spills(tmp_path):
    """``--part sass`` compiles the decode kernel for sm_90a here (no GPU) and reads its resource usage."""
    pytest.importorskip("triton.backends.nvidia")
    out = tmp_path / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--part", "sass", "--sass-dir", str(tmp_path),
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    if "error" in row:
        pytest.skip(f"no sm_90 compile here: {row['error']}")
    assert 0 < row["registers"] <= 255 and row["spill_stack"] >= 0 and row["sass_instructions"] > 1000, row


def test_token_parts_dry_run_rows_are_checked(tmp_path):
    """``--part token`` (the token-layout prefill variants) and ``--part token_blocks`` (short selection blocks, every
    query tile height) in the CPU dry run: every row runs under the interpreter and matches the PyTorch path, the
    plan's tile among them."""
    out = tmp_path / "token.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--part", "token,token_blocks", "--token-shapes",
                           "9:3:64", "--token-query-blocks", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    token = [r for r in rows if r["part"] == "token" and "bm" in r]
    blocks = [r for r in rows if r["part"] == "token_blocks"]
    assert len(token) == 2 and {r["rows"] for r in blocks} == {16, 32, 64, 128}, rows
    assert sum(r["plan"] for r in blocks) == 1
    for r in token + blocks:
        assert r["err"] < 1e-2, r  # fp16 operands against the PyTorch path (design §10)
    assert "| heads | D | query_block | rows |" in proc.stdout
