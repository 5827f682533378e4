"""``scripts/cuda_build_and_time.py ab``'s command line on the CPU: ``--rows`` and the source folders are checked
before anything is built or launched, and without a GPU the command says so (the timing itself needs an sm_90 GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cuda_build_and_time.py"


def _ab(args, cwd):
    return subprocess.run([sys.executable, str(SCRIPT), "ab", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, check=False)


def _folder(tmp_path, *names):
    folder = tmp_path / "csrc"
    folder.mkdir()
    for name in names:
        (folder / name).write_text("// a source file\n")
    return folder


def test_rows_must_name_known_groups(tmp_path):
    folder = _folder(tmp_path, "structured_bwd_sm90.cu")
    for bad in ("--rows=bogus", "--rows=bwd,", "--rows", "--rows=", "--rowsbwd"):
        proc = _ab([bad, f"before={folder}"], tmp_path)
        assert proc.returncode != 0, (bad, proc.stdout, proc.stderr)
        assert f"ab: {bad!r}: expected --rows= and a comma list of fwd, bwd, token" in proc.stderr, (bad, proc.stderr)


def test_a_folder_needs_the_sources_of_a_picked_group(tmp_path):
    folder = _folder(tmp_path, "structured_fwd_sm90.cu")
    proc = _ab(["--rows=bwd,token", f"before={folder}"], tmp_path)
    assert proc.returncode != 0
    assert "a csrc folder holding the sources of one of bwd, token" in proc.stderr, proc.stderr
    proc = _ab([f"before={tmp_path}"], tmp_path)
    assert proc.returncode != 0
    assert "the sources of one of fwd, bwd, token" in proc.stderr, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message printed on a machine without a GPU")
def test_good_arguments_need_a_gpu_here(tmp_path):
    folder = _folder(tmp_path, "structured_bwd_sm90.cu", "token_fwd_sm90.cu")
    proc = _ab(["--rows=bwd,token", f"before={folder}"], tmp_path)
    assert proc.returncode != 0 and "ab: needs an sm_90 GPU" in proc.stderr, proc.stderr


def test_names_must_be_new(tmp_path):
    folder = _folder(tmp_path, "structured_bwd_sm90.cu")
    for specs in ([f"tree={folder}"], [f"a={folder}", f"a={folder}"], [str(folder)]):
        proc = _ab(["--rows=bwd", *specs], tmp_path)
        assert proc.returncode != 0 and "is not name=dir with a new name (not 'tree')" in proc.stderr, (specs,
                                                                                                         proc.stderr)


def _run(args, cwd):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          check=False)


def test_help_and_unknown_commands(tmp_path):
    for flag in ("--help", "-h"):
        proc = _run([flag], tmp_path)
        assert proc.returncode == 0 and "First-call build times" in proc.stdout and "``ab``" in proc.stdout, proc.stderr
    for args, message in ((["nope"], "got unknown command 'nope'"), ([], "got no command"),
                          (["bench", "x"], "bench: takes no arguments, got ['x']")):
        proc = _run(args, tmp_path)
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message printed on a machine without a GPU")
def test_bench_needs_a_gpu_here(tmp_path):
    proc = _run(["bench"], tmp_path)
    assert proc.returncode != 0 and "bench: needs an sm_90 GPU" in proc.stderr and "Traceback" not in proc.stderr
