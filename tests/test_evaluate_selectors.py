"""scripts/evaluate_selectors.py: the variants it evaluates follow the selector files (no model run)."""

import pytest
import sparse_k
from helpers import load_script, tiny_llama


def _script():
    return load_script("evaluate_selectors")


def test_variants_use_each_files_pattern_and_label_its_run(tmp_path):
    from hf_sparse_attention.selectors import create_selectors, save_selectors

    mod = _script()
    model = tiny_llama()
    paths = {}
    for run, qb in (("init", 1), ("trained", 4)):
        pattern = sparse_k.DSA(sinks=4, window=256, top_k=256, query_block=qb, indexer_heads=2, indexer_dim=4)
        paths[run] = save_selectors(create_selectors(model, pattern, per_kv_head=True), str(tmp_path / run), pattern=pattern)
    args = mod.build_parser().parse_args(["--selector", f"dsa={paths['init']}", "--selector", f"dsa={paths['trained']}",
                                          "--training-free", "sparse_k"])
    rows = mod._variants(args)
    assert [r["label"] for r in rows] == ["dense", "streaming (516 keys)", "dsa (trained: init)", "dsa (trained: trained)",
                                         "sparse_k (training-free)"]
    assert [r["params"].get("query_block") for r in rows[2:4]] == [1, 4]
    assert rows[2]["params"]["indexer_heads"] == 2 and rows[4]["params"]["query_block"] == 64
    wrong = sparse_k.DSA(sinks=4, window=128, top_k=256)
    bad = save_selectors(create_selectors(model, wrong), str(tmp_path / "bad"), pattern=wrong)
    with pytest.raises(SystemExit, match="window=128"):
        mod._variants(mod.build_parser().parse_args(["--selector", f"dsa={bad}"]))
