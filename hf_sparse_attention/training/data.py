"""Training data of selector training: the texts (``load_texts``) and the token sequence of every
(global step, slot) (``TokenStream``: a chunk of training text, or a synthetic passkey sequence that
marks its answer queries). The flags and passkey styles are described in ``train_selector``.

A sequence depends only on (seed, step, slot), so every process of a multi-GPU run draws the same
global batch. ``datasets`` is imported only for a corpus other than the offline ``gutenberg`` texts.
"""

from __future__ import annotations

import random

import torch

from ..evaluation.corpora import gutenberg_files
from ..evaluation.retrieval import passkey_prompt

__all__ = ["LANDMARK_MIN_TOKENS", "TokenStream", "load_texts"]

#: The shortest landmark passkey prompt (tokens): ``--passkey-style landmark`` or ``mixed`` needs a ``--seq-len``
#: of at least this.
LANDMARK_MIN_TOKENS = 64


def load_texts(args) -> list[str]:
    """The training texts of ``args`` (``dataset``, ``dataset_config``, ``split``, ``text_column``,
    ``max_texts``; module docstring)."""
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
        answer = self._enc(f" {key}.")
        context = rng.randint(max(LANDMARK_MIN_TOKENS, self.seq_len * 3 // 4), self.seq_len) - len(answer)
        prompt = self.tokenizer(passkey_prompt(self.tokenizer, max(LANDMARK_MIN_TOKENS, context), rng.uniform(0.1, 0.9),
                                               key))["input_ids"]
        tail = (prompt + answer)[-self.seq_len :]
        n = len(tail)
        ids = torch.cat([chunk[: self.seq_len - n], torch.tensor(tail, dtype=torch.long)])
        ans = torch.zeros(self.seq_len, dtype=torch.bool)
        ans[self.seq_len - len(answer) - 1 : self.seq_len - 1] = True
        return ids, ans

