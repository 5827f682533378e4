"""Results files: ``results.json`` (validated against ``results.schema.json``), ``report.md`` and plots."""

from __future__ import annotations

import datetime as _dt
import json
import os
from collections import defaultdict

from .perplexity import perplexity_spread
from .plots import write_plots
from .speed import MEMORY_LABELS, MEMORY_NOTES


from .retrieval import TASK_COLUMNS, TASKS

__all__ = ["SCHEMA_PATH", "load_schema", "summarize_perplexity", "summarize_retrieval", "timestamped_dir",
           "validate_results", "write_outputs"]

SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results.schema.json")


def load_schema() -> dict:
    """The JSON schema of results files (kept in the repository beside this module)."""
    with open(SCHEMA_PATH) as f:
        return json.load(f)


def validate_results(results: dict) -> None:
    """Raise ``jsonschema.ValidationError`` when ``results`` does not follow the schema."""
    import jsonschema

    jsonschema.Draft202012Validator(load_schema()).validate(results)


def timestamped_dir(root: str = "results") -> str:
    """``root/<UTC timestamp>`` (created; a suffix keeps two runs in one second apart)."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path, n = os.path.join(root, stamp), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(root, f"{stamp}-{n}")
    os.makedirs(path)
    return path


def summarize_retrieval(rows: list[dict]) -> list[dict]:
    """Accuracy per (task, variant, context), in first-seen order."""
    groups: dict = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["variant"], r["context"])].append(bool(r["correct"]))
    return [{"task": t, "variant": v, "context": c, "correct": sum(g), "total": len(g), "accuracy": sum(g) / len(g)}
            for (t, v, c), g in groups.items()]


def summarize_perplexity(rows: list[dict]) -> list[dict]:
    """Spread over text windows per (variant, context), in first-seen order: ``perplexity_spread`` of
    the perplexities and of the per-window ratio to dense (``vs_dense``; None without a dense row)."""
    groups: dict = defaultdict(dict)
    dense = {(r["context"], r.get("window", 0)): r["perplexity"] for r in rows if r["pattern"] == "dense"}
    for r in rows:
        groups[(r["variant"], r["context"])][r.get("window", 0)] = r["perplexity"]
    out = []
    for (v, c), by_window in groups.items():
        ratios = [p / dense[(c, w)] for w, p in by_window.items() if (c, w) in dense]
        out.append({"variant": v, "context": c, **perplexity_spread(list(by_window.values())),
                    "vs_dense": perplexity_spread(ratios) if len(ratios) == len(by_window) else None})
    return out


def _spread_lines(results: dict) -> list[str]:
    lines = ["### Perplexity over text windows", "",
             "Mean ± sample standard deviation and min–max over disjoint text windows (offsets in tokens: "
             f"{results.get('corpus', {}).get('window_offsets')}); vs dense: the per-window ratio, mean ± std.", "",
             "| pattern | context | windows | perplexity | min–max | vs dense |", "|---|---|---|---|---|---|"]
    for s in results["perplexity_summary"]:
        rel = s["vs_dense"]
        rel_text = f"{rel['mean']:.3f}x ± {rel['std']:.3f}" if rel else "—"
        lines.append(f"| {s['variant']} | {s['context']} | {s['n']} | {s['mean']:.3f} ± {s['std']:.3f} | "
                     f"{s['min']:.3f}–{s['max']:.3f} | {rel_text} |")
    return lines + [""]


def _format_lines(results: dict) -> list[str]:
    """One row per (pattern, context): budget, then accuracy in the trained and the unseen formats."""
    summary = {(s["task"], s["variant"], s["context"]): s for s in results["retrieval_summary"]}
    budgets = {(b["variant"], b["context"]): b for b in results.get("budgets", [])}
    tasks = [t for t in TASKS if any(k[0] == t for k in summary)]
    lines = ["### Retrieval by prompt format", "",
             "passkey: the landmark prompt the selectors trained on; needle: the magic-number sentence in held-out "
             "Gutenberg text; unseen: other filler (synthetic prose or held-out play lines), other needle wording, "
             "question before or after the haystack; multi-key: several labelled needles, the asked one scored.", "",
             "| pattern | context | keys per query | fraction of pairs | " + " | ".join(TASK_COLUMNS[t] for t in tasks) + " |",
             "|---|---|---|---|" + "---|" * len(tasks)]
    for v, c in dict.fromkeys((k[1], k[2]) for k in summary):
        b = budgets.get((v, c))
        cells = [f"{summary[(t, v, c)]['correct']}/{summary[(t, v, c)]['total']}" if (t, v, c) in summary else "—"
                 for t in tasks]
        budget = f"{b['keys_per_query']} | {b['fraction']:.1%}" if b else "— | —"
        lines.append(f"| {v} | {c} | {budget} | " + " | ".join(cells) + " |")
    return lines + [""]


def _fmt_params(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "—"


def _budget_lines(results: dict) -> list[str]:
    rows = results.get("budgets") or []
    if not rows:
        return []
    lines = ["## Patterns and key budgets", "",
             "Every sparse pattern gets the same number of keys per query at a context (`--budget`, default a quarter "
             "of the context). *keys per query*: the most keys any query of a `context`-token sequence attends (the "
             "budget, far from the start); *mean keys per query*: over all its queries; *fraction*: allowed (query, "
             "key) pairs of all causal pairs (bigbird: layer 0, KV head 0).", ""]
    learned = sorted({r["pattern"] for r in rows if r["pattern"] in ("sparse_k", "dsa")})
    if learned:
        how = results["settings"].get("learned_selection", "training-free (no trained selector loaded)")
        notes = []
        if "training-free" in how:
            notes.append("without a trained selector each block selects keys with the training-free query-aware page "
                         "selection (the same keys for sparse_k and dsa); trained selectors: README, \"Learned selection\"")
        if "trained selectors" in how:
            notes.append("trained selectors were loaded (the package ships dsa and sparse_k selectors for "
                         "SmolLM2-135M)")
        note = "; ".join(notes)
        lines += [f"Learned selection ({', '.join(learned)}): **{how}**: {note}.", ""]
    lines += ["| pattern | context | parameters | keys per query | mean keys per query | fraction of causal pairs |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['context']} | {_fmt_params(r['params'])} | {r['keys_per_query']} | "
                     f"{r['mean_keys_per_query']:.1f} | {r['fraction']:.3f} |")
    return lines + [""]


def _markdown(results: dict) -> str:
    env, model = results["environment"], results["model"]
    gpus = ", ".join(g["name"] for g in env["gpus"]) or f"CPU only ({env['cpu_count']} cores)"
    lines = [
        "# hf_sparse_attention evaluation",
        "",
        f"- date (UTC): {env['timestamp_utc']}",
        f"- hardware: {gpus}; processes: {env['num_processes']}",
        f"- model: {model['name']} ({model['source']}, {model['parameters'] / 1e6:.1f} M parameters, {model['dtype']}, {model['device']})",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v),
        f"- git commit: {env['git']['commit'] or 'unknown'}{' (with local changes)' if env['git'].get('dirty') else ''}",
        f"- seed: {results['seed']}; command: `{' '.join(results['command'])}`",
        f"- wall time: {results['timing']['total_seconds']:.1f} s",
        "",
    ]
    lines += _budget_lines(results)
    if results.get("perplexity"):
        corpus = results.get("corpus", {})
        lines += ["## Perplexity", "",
                  f"Corpus: {corpus.get('name')} ({corpus.get('split')} split, {corpus.get('documents')} document(s), "
                  + (f"first {corpus.get('tokens')} tokens" if corpus.get("windows", 1) == 1 else
                   f"{corpus['windows']} disjoint windows of {corpus.get('tokens')} tokens")
                  + "); strided sliding windows of `context` tokens.", "",
                  "| pattern | context | stride | perplexity | vs dense | parameters | seconds | text window |",
                  "|---|---|---|---|---|---|---|---|"]
        dense = {(r["context"], r.get("window", 0)): r["perplexity"] for r in results["perplexity"] if r["pattern"] == "dense"}
        for r in sorted(results["perplexity"], key=lambda r: r["context"]):
            key = (r["context"], r.get("window", 0))
            rel = f"{r['perplexity'] / dense[key]:.3f}x" if key in dense else "—"
            lines.append(f"| {r['variant']} | {r['context']} | {r['stride']} | {r['perplexity']:.3f} | {rel} | "
                         f"{_fmt_params(r['params'])} | {r['seconds']:.1f} | {r.get('window', 0)} |")
        lines += [""]
        if any(s["n"] > 1 for s in results.get("perplexity_summary", [])):
            lines += _spread_lines(results)
        lines += ["![perplexity](perplexity.png)", ""]
    if results.get("retrieval_summary"):
        lines += ["## Retrieval (exact match)", "",
                  "| task | pattern | context | correct / trials | accuracy |", "|---|---|---|---|---|"]
        for s in results["retrieval_summary"]:
            lines.append(f"| {s['task']} | {s['variant']} | {s['context']} | {s['correct']} / {s['total']} | {s['accuracy']:.0%} |")
        lines += ["", *_format_lines(results)]
        for task in TASKS:
            if any(s["task"] == task for s in results["retrieval_summary"]):
                lines += ["", f"![{task}](retrieval_{task}.png)"]
        lines.append("")
    if results.get("speed"):
        kinds = list(dict.fromkeys(r["memory_kind"] for r in results["speed"]))
        header = MEMORY_LABELS[kinds[0]] if len(kinds) == 1 else "memory (MiB, see measure)"
        lines += ["## Speed", "",
                  f"| pattern | length | prefill (s) | decode tokens/s | {header} | memory measure |",
                  "|---|---|---|---|---|---|"]
        for r in results["speed"]:
            tps = f"{r['decode_tokens_per_second']:.1f}" if r["decode_tokens_per_second"] else "—"
            lines.append(f"| {r['variant']} | {r['length']} | {r['prefill_seconds']:.3f} | {tps} | "
                         f"{r['peak_memory_bytes'] / 2**20:.1f} | {r['memory_kind']} |")
        lines += [""] + [f"`{k}`: {MEMORY_NOTES[k]}." for k in kinds] + ["", "![speed](speed.png)", ""]
    return "\n".join(lines)


def write_outputs(results: dict, out_dir: str) -> dict:
    """Write plots, ``results.json`` (validated first) and ``report.md`` into ``out_dir``; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    if results.get("retrieval"):
        results["retrieval_summary"] = summarize_retrieval(results["retrieval"])
    if results.get("perplexity"):
        results["perplexity_summary"] = summarize_perplexity(results["perplexity"])
    results["plots"] = write_plots(results, out_dir)
    validate_results(results)
    paths = {"results": os.path.join(out_dir, "results.json"), "report": os.path.join(out_dir, "report.md")}
    with open(paths["results"], "w") as f:
        json.dump(results, f, indent=2)
    with open(paths["report"], "w") as f:
        f.write(_markdown(results))
    paths["plots"] = [os.path.join(out_dir, p) for p in results["plots"]]
    return paths
