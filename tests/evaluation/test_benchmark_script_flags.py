"""The command lines of the GPU benchmarks ``scripts/benchmark_kernels.py`` and ``scripts/bench_selection.py`` on the
CPU: bad flags end with an ``error:`` line (exit status 2) before anything runs, and without a GPU the scripts say
that they need one (no traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the message printed on a machine without a GPU")


def _run(script, args, cwd):
    return subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, check=False)


@pytest.mark.parametrize("args, message", [
    (["--section", "fwd", "--patterns", "dense,nope"],
     "argument --patterns: unknown pattern(s) ['nope'] for --section fwd; a comma list of dense, sliding_window, "
     "streaming, bigbird, block_diagonal, dilated, l2_aligned, token"),
    (["--section", "bwd", "--patterns", "token"], "unknown pattern(s) ['token'] for --section bwd"),
    (["--section", "l2", "--patterns", "streaming"],
     "unknown pattern(s) ['streaming'] for --section l2; a comma list of dense, sliding_window, l2_aligned"),
    (["--section", "fwd", "--window", "2"], "--window 2 / --sinks 128: dilated: `window` must be >= 1, got 0"),
])
def test_benchmark_kernels_checks_its_patterns(tmp_path, args, message):
    proc = _run("benchmark_kernels.py", args, tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@no_gpu
@pytest.mark.parametrize("args", [["--section", "fwd", "--patterns", "l2_aligned,token"], ["--section", "l2"],
                                  ["--section", "padded", "--patterns", "l2_aligned"]])
def test_benchmark_kernels_accepts_l2_aligned_then_needs_a_gpu(tmp_path, args):
    proc = _run("benchmark_kernels.py", args, tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == "benchmark_kernels.py needs a CUDA GPU", proc.stderr


def test_bench_selection_checks_its_flags(tmp_path):
    for args, message in ((["--reps", "0"], "argument --reps: expected a positive integer, got '0'"),
                          (["--contexts", "4096", "-1"], "argument --contexts: expected a positive integer, got '-1'")):
        proc = _run("bench_selection.py", args, tmp_path)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@no_gpu
def test_bench_selection_needs_a_gpu(tmp_path):
    proc = _run("bench_selection.py", ["--contexts", "4096"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "bench_selection.py: error: needs a CUDA GPU" in proc.stderr
