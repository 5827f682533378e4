"""Settings of the training-free selection at the acceptance cells, in one process.

Runs ``hf_sparse_attention.evaluation.evaluate_selectors`` (dense and ``--training-free sparse_k``)
once per setting and cell, the model loaded once; a setting's page size and head reduction are set on
``sparse_k.selection.page_selection`` for its runs. Writes one JSON (every run's rows and table, the summary)
after each run and prints a summary with the acceptance check of the training-free default:
unseen-format retrieval >= ``--retrieval-bar`` of dense's count, and perplexity <= ``--ppl-bar``
above dense in every perplexity window (the spread considered: the worst window counts).

A cell is ``CONTEXT:SINKS:WINDOW:TOP_K``; a setting is
``qb=N,page=N,heads=sum|max|rank[,refine=F][,norm=full|static][,obs=N][,dense=A-B]``
(``refine``: ``page_selection.REFINE``, the two-stage selection; ``norm``: ``page_selection.REFINE_NORMALISER``, its
softmax normaliser, default full; ``obs``: ``page_selection.OBS``, the observation window; ``refine`` and ``obs``
default 0 and take integers >= 0; ``qb`` and ``page`` take integers >= 1, a page larger than a cell's ``top_k`` runs
at ``top_k``; ``dense=A-B``: layers A to B, ``0 <= A <= B``).
Arguments after ``--`` go to every ``evaluate_selectors`` run (its flags). Command line:
``scripts/sweep_training_free.py``. Example::

    python scripts/sweep_training_free.py --cells 4096:4:256:256 8192:4:508:512 \\
        --settings qb=64,page=16,heads=sum qb=16,page=16,heads=sum,dense=0-1 --output sweep.json \\
        -- --scoring teacher-forced --tasks unseen passkey --depths 0.1 0.3 0.5 0.7 0.9 --trials-per-depth 2
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import sys
import tempfile
import time


def _cell(text: str) -> dict:
    try:
        context, sinks, window, top_k = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a cell is CONTEXT:SINKS:WINDOW:TOP_K (integers), got {text!r}") from None
    return {"context": context, "sinks": sinks, "window": window, "top_k": top_k}


#: The smallest value of each integer field of a setting: a query block and a page hold at least one position.
_SETTING_MIN = {"qb": 1, "page": 1, "refine": 0, "obs": 0}


def _setting_int(name: str, value: str, low: int, text: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < low:
        raise argparse.ArgumentTypeError(f"{name}= takes an integer >= {low}, got {value!r} in {text!r}")
    return number


def _setting(text: str) -> dict:
    out = {"qb": 64, "page": 16, "heads": "sum", "refine": 0, "norm": "full", "obs": 0, "dense": []}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or name not in out:
            raise argparse.ArgumentTypeError(f"setting fields are qb=, page=, heads=, refine=, norm=, obs=, dense=A-B; "
                                             f"got {part!r} in {text!r}")
        if name == "dense":
            lo, _, hi = value.partition("-")
            first = _setting_int("dense", lo, 0, text)
            last = _setting_int("dense", hi, first, text) if hi else first
            out["dense"] = list(range(first, last + 1))
        elif name == "heads":
            if value not in ("sum", "max", "rank"):
                raise argparse.ArgumentTypeError(f"heads= takes sum, max or rank, got {value!r}")
            out["heads"] = value
        elif name == "norm":
            if value not in ("full", "static"):
                raise argparse.ArgumentTypeError(f"norm= takes full or static, got {value!r} in {text!r}")
            out["norm"] = value
        else:
            out[name] = _setting_int(name, value, _SETTING_MIN[name], text)
    out["name"] = text
    return out


def summary(runs: list[dict], retrieval_bar: float, ppl_bar: float) -> list[str]:
    """Markdown rows: per run the dense and training-free retrieval counts, perplexity ratios and the check."""
    lines = ["| cell | setting | unseen (dense) | trained format (dense) | multi-key (dense) | ppl vs dense: mean ± std (worst window) | fraction of pairs | meets both bars |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        dense, tf = run["rows"][0], run["rows"][-1]
        ratios = [p / d - 1 for p, d in zip(tf["perplexity_windows"], dense["perplexity_windows"])]
        mean = sum(ratios) / len(ratios)
        std = (sum((x - mean) ** 2 for x in ratios) / (len(ratios) - 1)) ** 0.5 if len(ratios) > 1 else 0.0

        def col(task, tf=tf, dense=dense):
            if task + "_trials" not in tf:
                return "—"
            return f"{tf[task + '_correct']}/{tf[task + '_trials']} ({dense[task + '_correct']})"

        ok_ret = "unseen_correct" in tf and tf["unseen_correct"] >= retrieval_bar * dense["unseen_correct"]
        ok_ppl = max(ratios) <= ppl_bar
        run["check"] = {"retrieval": bool(ok_ret), "perplexity": bool(ok_ppl), "ppl_ratio_mean": mean,
                        "ppl_ratio_std": std, "ppl_ratio_worst": max(ratios)}
        verdict = "yes" if ok_ret and ok_ppl else ("no: " + ", ".join(
            x for x, ok in (("retrieval", ok_ret), ("perplexity", ok_ppl)) if not ok))
        lines.append(f"| {run['cell']['context']}/{run['cell']['sinks'] + run['cell']['window'] + run['cell']['top_k']} "
                     f"| {run['setting']['name']} | {col('unseen')} | {col('passkey')} | {col('multikey')} "
                     f"| {mean * 100:+.1f}% ± {std * 100:.1f} ({max(ratios) * 100:+.1f}%) | {tf['pair_fraction']:.1%} | {verdict} |")
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", type=_cell, nargs="+", required=True)
    p.add_argument("--settings", type=_setting, nargs="+", required=True)
    p.add_argument("--output", required=True, help="JSON file, rewritten after every run")
    p.add_argument("--max-minutes", type=float, default=None, help="start no run after this many minutes")
    p.add_argument("--random-weights", default=None, help="load_model's random_weights (a dry run of the timing)")
    p.add_argument("--retrieval-bar", type=float, default=0.7)
    p.add_argument("--ppl-bar", type=float, default=0.05)
    args = p.parse_args(own)

    import sparse_k.selection.page_selection as ps

    from . import evaluate_selectors as evaluate

    real_load = evaluate.load_model

    @functools.lru_cache(maxsize=1)
    def cached(model, attn_implementation, dtype, device):  # evaluate_selectors sets the attention per variant
        return real_load(model, attn_implementation=attn_implementation, dtype=dtype, device=device,
                         random_weights=args.random_weights)

    evaluate.load_model = lambda model=None, *, attn_implementation="sdpa", dtype="auto", device="auto": \
        cached(model, attn_implementation, dtype, device)
    defaults = ps.DEFAULT_PAGE, ps.HEAD_REDUCE, ps.REFINE, ps.REFINE_NORMALISER, ps.OBS
    t0 = time.perf_counter()
    runs, skipped = [], []
    command = "python " + " ".join(shlex.quote(a) for a in ["scripts/sweep_training_free.py", *argv])
    try:
        for setting in args.settings:
            for cell in args.cells:
                if args.max_minutes is not None and time.perf_counter() - t0 > 60 * args.max_minutes:
                    skipped.append({"cell": cell, "setting": setting["name"]})
                    continue
                ps.DEFAULT_PAGE, ps.HEAD_REDUCE, ps.REFINE, ps.REFINE_NORMALISER, ps.OBS = \
                    setting["page"], setting["heads"], setting["refine"], setting["norm"], setting["obs"]
                run_argv = [*rest, "--context", str(cell["context"]), "--sinks", str(cell["sinks"]),
                            "--window", str(cell["window"]), "--top-k", str(cell["top_k"]),
                            "--query-block", str(setting["qb"]), "--training-free", "sparse_k", "--no-streaming"]
                if setting["dense"]:
                    run_argv += ["--dense-layers", *map(str, setting["dense"])]
                with tempfile.TemporaryDirectory() as tmp:
                    out = os.path.join(tmp, "run.json")
                    start = time.perf_counter()
                    evaluate.main([*run_argv, "--output", out])
                    with open(out) as fh:
                        res = json.load(fh)
                runs.append({"cell": cell, "setting": setting, "page": ps.DEFAULT_PAGE, "head_reduce": ps.HEAD_REDUCE,
                             "refine": ps.REFINE, "norm": ps.REFINE_NORMALISER, "obs": ps.OBS,
                             "evaluate_selectors_args": run_argv, "rows": res["rows"], "table": res["table"],
                             "seconds": time.perf_counter() - start})
                lines = summary(runs, args.retrieval_bar, args.ppl_bar)
                with open(args.output, "w") as fh:
                    json.dump({"command": command, "runs": runs, "skipped": skipped, "summary": "\n".join(lines)},
                              fh, indent=2, default=str)
                print(f"[sweep] {setting['name']} at {cell}: {runs[-1]['seconds']:.0f} s", flush=True)
    finally:  # the module settings and load_model go back even when a run fails
        ps.DEFAULT_PAGE, ps.HEAD_REDUCE, ps.REFINE, ps.REFINE_NORMALISER, ps.OBS = defaults
        evaluate.load_model = real_load
    lines = summary(runs, args.retrieval_bar, args.ppl_bar)
    with open(args.output, "w") as fh:
        json.dump({"command": command, "runs": runs, "skipped": skipped, "summary": "\n".join(lines)}, fh, indent=2, default=str)
    print("\n".join(lines + ([f"skipped (time): {skipped}"] if skipped else []) + ["", f"command: `{command}`"]))
    return 0

