"""scripts/benchmark_e2e.py on a tiny random Llama on the CPU: every row is gated by its check,
rows carry the fields the README table is made of, bad flags fail before any model is built."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmark_e2e.py"
TINY = ["--device", "cpu", "--dtype", "float32", "--layers", "2", "--hidden", "64", "--intermediate", "128",
        "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--vocab", "256", "--window", "48", "--sinks", "2",
        "--learned-window", "16", "--top-k", "16", "--query-block", "16", "--repeats", "1", "--decode-steps", "3",
        "--warmup-steps", "2", "--check-len", "160"]


def _run(args, tmp_path, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, check=False)


@pytest.mark.slow
def test_tiny_model_rows_are_checked_and_complete(tmp_path):
    out = tmp_path / "e2e.json"
    proc = _run([*TINY, "--variants", "sdpa,streaming,sparse_k,dsa", "--prefill-lens", "130",
                 "--decode-lens", "130", "--flat-memory-len", "400", "--chunk", "128", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = [r for r in data["rows"] if r["phase"] != "flat_memory"]
    (flat,) = [r for r in data["rows"] if r["phase"] == "flat_memory"]
    assert flat["kept_keys_layer0"] == 2 + 48 - 1  # sinks + window - 1: the bounded cache stays bounded
    assert [m["context"] for m in flat["peak_gb_by_context"]] == [128, 256]
    assert {(r["variant"], r["phase"]) for r in rows} == {
        (v, p) for v in ("sdpa", "streaming", "sparse_k", "dsa") for p in ("prefill", "decode")}
    for r in rows:
        assert r["check_ok"] and r["check_rel_err"] <= r["check_bound"], r
        assert r["length"] == 130
        if r["phase"] == "prefill":
            assert r["prefill_ms"] > 0
        else:
            assert r["decode_ms_per_token"] > 0 and r["compiles_in_timed_steps"] == 0
        # The kernel label comes from sparse_k.attention.plan: on the CPU every sparse call runs the PyTorch path
        # (one plan per layer); sdpa goes around sparse_k (no plan) and the CPU run has no profiler.
        kernel = r[f"{r['phase']}_attention_kernel"]
        assert kernel == (None if r["variant"] == "sdpa" else f"torch x{2 if r['phase'] == 'prefill' else 4}"), r
    assert data["environment"]["torch"] and "| variant | phase |" in proc.stdout


def _rows(args, tmp_path):
    """Run the script with ``args`` (+ ``--json``): its stdout and the JSON rows; the run must succeed."""
    out = tmp_path / "e2e.json"
    proc = _run([*args, "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())["rows"]


def test_block_diagonal_bigbird_dilated_and_l2_aligned_rows(tmp_path):
    names = ("block_diagonal", "bigbird", "dilated", "l2_aligned")
    _, rows = _rows([*TINY, "--variants", ",".join(names), "--bigbird-block", "16", "--phases", "prefill",
                     "--prefill-lens", "150", "--no-profile"], tmp_path)
    assert [(r["variant"], r["phase"]) for r in rows] == [(n, "prefill") for n in names]
    for r in rows:
        assert r["check_ok"] and r["check_rel_err"] <= r["check_bound"] and r["prefill_ms"] > 0, r
        assert r["prefill_attention_kernel"] == "torch x2", r


def test_batched_decode_rows(tmp_path):
    stdout, rows = _rows([*TINY, "--variants", "streaming,sparse_k", "--phases", "decode", "--decode-lens", "100",
                          "--decode-batch", "3", "--no-profile"], tmp_path)
    assert [(r["variant"], r["phase"], r["batch"]) for r in rows] == [("streaming", "decode", 3), ("sparse_k", "decode", 3)]
    assert all(r["check_ok"] and r["decode_ms_per_token"] > 0 and r["decode_ms_per_token_synced"] > 0 for r in rows)
    assert "| 100 (B=3) |" in stdout
    assert "| streaming | 100 (3) |" in stdout  # the decode table: pipelined and synced ms/token


@pytest.mark.parametrize("bad, message", [
    (["--variants", "sdpa,dense2"], "unknown variant"),
    (["--prefill-lens", "0"], "positive ints"),
    (["--heads", "6", "--kv-heads", "4"], "multiple of --kv-heads"),
    (["--top-k", "0"], "--top-k must be >= 1"),
    (["--decode-batch", "0"], "--decode-batch must be >= 1"),
    (["--text", "gutenberg"], "--text needs --model"),
])
def test_bad_flags_fail_with_one_line(tmp_path, bad, message):
    proc = _run([*TINY, *bad], tmp_path, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_real_model_on_real_text(tmp_path):
    """``--model`` (the embedded SmolLM2-135M GGUF) with ``--text gutenberg``: the prompt is the corpus's tokens, the
    training-free rows stay training-free on a model whose shipped selectors would otherwise attach, every row is
    checked."""
    pytest.importorskip("gguf")
    from hf_sparse_attention.evaluation.corpora import load_documents
    from hf_sparse_attention.evaluation.models import load_model

    out = tmp_path / "e2e.json"
    proc = _run(["--model", "smollm2-135m", "--text", "gutenberg", "--device", "cpu", "--dtype", "float32",
                 "--variants", "sdpa,default,per_query", "--phases", "prefill", "--prefill-lens", "600",
                 "--check-len", "600", "--repeats", "1", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["phase"], r["length"]) for r in rows] == [
        ("sdpa", "prefill", 600), ("default", "prefill", 600), ("per_query", "prefill", 600)]
    for r in rows:
        assert r["check_ok"] and r["prefill_ms"] > 0, r
    assert "smollm2_135m_instruct" not in proc.stderr  # no shipped selector attached: the rows stayed training-free
    tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32").tokenizer
    n_tokens = len(tokenizer("\n\n".join(load_documents("gutenberg")), add_special_tokens=False).input_ids)
    assert f"[e2e] prompts from --text gutenberg: {n_tokens} tokens" in proc.stdout
