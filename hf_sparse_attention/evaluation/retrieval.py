"""Long-context retrieval: passkey (landmark attention's prompt) and needle-in-a-haystack on
Gutenberg text, both scored by exact match of the first number the model generates.

Passkey prompt (Mohtashami & Jaggi, "Landmark Attention", 2023)::

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize them.
    I will quiz you about the important information there.
    The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. (x n)
    The pass key is N. Remember it. N is the pass key.
    The grass is green. ... (x m)
    What is the pass key? The pass key is

``depth`` is the fraction of the filler placed before the key line; ``n + m`` fills the context
length (in tokens of the model's tokenizer) as far as whole filler sentences allow.

Needle-in-a-haystack: a window of a held-out Gutenberg text of the right length, the sentence
"The special magic number is N." inserted at the line break nearest to ``depth``, then the question
"What is the special magic number mentioned in the text above? The special magic number is".

Unseen formats (``unseen``: other filler, needle wording and question position; ``multikey``:
several labelled needles, one asked for) are built in ``formats.py``; a trial's ``form`` (its index
in its context's grid) picks its filler, wording and question position.

Keys come from a generator seeded by (seed, task, context, depth, trial), so every variant and
every process split sees the same prompts.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass

import torch

from .formats import item_format, multikey_keys, multikey_prompt, unseen_prompt

__all__ = [
    "FILLER",
    "RetrievalItem",
    "build_prompt",
    "needle_prompt",
    "passkey_prompt",
    "retrieval_items",
    "run_retrieval_batch",
    "run_retrieval_item",
    "run_retrieval_teacher_forced",
    "score_answer",
]

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
NEEDLE = "The special magic number is {key}."
NEEDLE_QUESTION = "What is the special magic number mentioned in the text above? The special magic number is"
TASKS = ("passkey", "needle", "unseen", "multikey")
#: Tasks in the formats the selectors trained or were tuned on, and tasks in formats they never saw.
TRAINED_FORMAT_TASKS = ("passkey", "needle")
UNSEEN_FORMAT_TASKS = ("unseen", "multikey")
#: Column heading of each task in the tables that set the formats side by side.
TASK_COLUMNS = {"passkey": "trained format (passkey)", "needle": "tuned format (needle)",
                "unseen": "unseen format", "multikey": "multi-key (unseen)"}


@dataclass(frozen=True)
class RetrievalItem:
    """One trial: ``task`` in ``TASKS``, target ``context`` tokens, needle ``depth`` in [0, 1].

    ``form``: the trial's index in its context's grid (picks the unseen formats' filler, wording
    and question position); ``needles``: needles of a ``multikey`` trial (0 for the other tasks).
    """

    task: str
    context: int
    depth: float
    trial: int
    key: int
    form: int = 0
    needles: int = 0

    def to_dict(self) -> dict:
        d = {"task": self.task, "context": self.context, "depth": self.depth, "trial": self.trial, "key": self.key}
        if self.task in UNSEEN_FORMAT_TASKS:
            d.update(item_format(self.task, self.form), form=self.form)
        if self.task == "multikey":
            d["distractor_keys"] = [n["key"] for n in multikey_keys(self.key, self.depth, self.form, self.needles)[1:]]
        return d


def retrieval_items(task: str, contexts, depths, trials_per_depth: int, seed: int = 0,
                    needles: int = 4) -> list[RetrievalItem]:
    """The grid ``contexts x depths x trials_per_depth`` with seeded 5-digit keys (``needles``: per
    ``multikey`` trial, 2 to 8)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if isinstance(trials_per_depth, bool) or not isinstance(trials_per_depth, int) or trials_per_depth < 1:
        raise ValueError(f"trials_per_depth must be a positive int, got {trials_per_depth!r}")
    for d in depths:
        if not 0.0 <= float(d) <= 1.0:
            raise ValueError(f"needle depths must lie in [0, 1], got {d}")
    for c in contexts:
        if isinstance(c, bool) or not isinstance(c, int) or c < 64:
            raise ValueError(f"context lengths must be ints >= 64, got {c!r}")
    if task == "multikey":
        multikey_keys(10000, 0.5, 0, needles)  # validates needles
    items = []
    for c in contexts:
        for i, d in enumerate(depths):
            for t in range(trials_per_depth):
                rng = random.Random(f"{seed}-{task}-{c}-{float(d):.4f}-{t}")
                items.append(RetrievalItem(task, int(c), float(d), t, rng.randint(10000, 99999),
                                           form=i * trials_per_depth + t,
                                           needles=needles if task == "multikey" else 0))
    return items


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=True)["input_ids"])


def passkey_prompt(tokenizer, context: int, depth: float, key: int) -> str:
    """The landmark-attention passkey prompt of at most ``context`` tokens (module docstring)."""
    key_line = KEY_LINE.format(key=key)
    fixed = _n_tokens(tokenizer, " ".join([TASK, key_line, QUESTION]))
    per_filler = max(1, _n_tokens(tokenizer, " ".join([FILLER] * 8)) // 8)
    n = max(0, (context - fixed) // per_filler)

    def build(total: int) -> str:
        before = round(depth * total)
        parts = [TASK] + [FILLER] * before + [key_line] + [FILLER] * (total - before) + [QUESTION]
        return " ".join(parts)

    prompt = build(n)
    while n > 0 and _n_tokens(tokenizer, prompt) > context:
        n -= 1
        prompt = build(n)
    return prompt


def needle_prompt(tokenizer, haystack_ids: list[int], context: int, depth: float, key: int, offset: int) -> str:
    """A needle sentence in a window of Gutenberg text (token ids ``haystack_ids``), at most ``context`` tokens.

    ``offset`` picks where in the document the window starts (wrapped to fit).
    """
    needle = NEEDLE.format(key=key)
    room = context - _n_tokens(tokenizer, needle + "\n" + "\n" + NEEDLE_QUESTION) - 2
    if room < 16:
        raise ValueError(f"context {context} is too short for the needle task")
    if len(haystack_ids) < room:
        raise ValueError(f"the haystack has {len(haystack_ids)} tokens; context {context} needs {room}")
    while True:
        start = offset % max(1, len(haystack_ids) - room + 1)
        text = tokenizer.decode(haystack_ids[start:start + room], skip_special_tokens=True)
        breaks = [m.start() for m in re.finditer("\n", text)] or [len(text)]
        cut = min(breaks, key=lambda b: abs(b - depth * len(text)))
        prompt = text[:cut] + "\n" + needle + text[cut:] + "\n\n" + NEEDLE_QUESTION
        if _n_tokens(tokenizer, prompt) <= context or room < 16:
            return prompt
        room -= 8


def build_prompt(tokenizer, item: RetrievalItem, haystack_ids: list[int] | None = None) -> str:
    """Prompt text of one item; the needle task and the ``play`` filler need ``haystack_ids``."""
    if item.task == "passkey":
        return passkey_prompt(tokenizer, item.context, item.depth, item.key)
    if item.task == "unseen":
        return unseen_prompt(tokenizer, item.context, item.depth, item.key, item.form, haystack_ids)
    if item.task == "multikey":
        return multikey_prompt(tokenizer, item.context, item.depth, item.key, item.form, item.needles, haystack_ids)
    if haystack_ids is None:
        raise ValueError("the needle task needs haystack token ids")
    offset = random.Random(f"offset-{item.key}-{item.trial}").randrange(1 << 30)
    return needle_prompt(tokenizer, haystack_ids, item.context, item.depth, item.key, offset)


def score_answer(generated: str, key: int | str) -> bool:
    """Exact match: the first integer in the generated text equals the key."""
    m = re.search(r"\d+", generated)
    return m is not None and m.group(0) == str(key)


@torch.no_grad()
def run_retrieval_batch(model, tokenizer, items: list[RetrievalItem], haystack_ids=None,
                        max_new_tokens: int = 7) -> list[dict]:
    """Greedy-generate the answers to several items in one left-padded batch and score each.

    One ``generate`` call serves the whole batch (the prompts are padded on the left, so each row's
    answer starts right after its own prompt). Each record's ``seconds`` is the batch's wall time
    divided by the batch size; ``batch_size`` says how many trials shared the call. A tokenizer
    without a pad token gets its EOS token as the pad token (padding needs one).
    """
    if not items:
        return []
    prompts = [build_prompt(tokenizer, it, haystack_ids) for it in items]
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(device)
    lengths = enc["attention_mask"].sum(-1).tolist()
    t0 = time.perf_counter()
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                         temperature=None, top_p=None, top_k=None)
    seconds = (time.perf_counter() - t0) / len(items)
    width = enc["input_ids"].shape[1]
    records = []
    for row, (it, n) in enumerate(zip(items, lengths)):
        generated = tokenizer.decode(out[row, width:], skip_special_tokens=True)
        rec = {**it.to_dict(), "prompt_tokens": int(n), "prediction": generated.strip(),
               "correct": score_answer(generated, it.key), "seconds": seconds, "batch_size": len(items)}
        if it.task == "multikey":
            rec["answered_other"] = any(score_answer(generated, k) for k in rec["distractor_keys"])
        records.append(rec)
    return records


def run_retrieval_item(model, tokenizer, item: RetrievalItem, haystack_ids=None, max_new_tokens: int = 7) -> dict:
    """Greedy-generate the answer to one item and score it; a JSON-friendly record."""
    return run_retrieval_batch(model, tokenizer, [item], haystack_ids, max_new_tokens)[0]


@torch.no_grad()
def run_retrieval_teacher_forced(model, tokenizer, item: RetrievalItem, haystack_ids=None) -> dict:
    """Score one item in a single forward pass: correct when every token of `` <key>`` is the argmax
    given the prompt and the answer's earlier tokens.

    That is what greedy decoding produces first (when decoding equals recomputing, which every
    pattern keeps), without the decode steps; stricter than ``run_retrieval_item`` (an answer that
    starts with another token, e.g. a quote, before the key counts as wrong). Same record fields.
    """
    prompt = build_prompt(tokenizer, item, haystack_ids)
    p_ids = tokenizer(prompt)["input_ids"]
    a_ids = tokenizer(" " + str(item.key), add_special_tokens=False)["input_ids"]
    device = next(model.parameters()).device
    ids = torch.tensor([p_ids + a_ids], device=device)
    t0 = time.perf_counter()
    logits = model(ids, logits_to_keep=len(a_ids) + 1).logits[0, :-1]
    pred = logits.argmax(-1).cpu()
    correct = bool((pred == torch.tensor(a_ids)).all())
    generated = tokenizer.decode(pred.tolist(), skip_special_tokens=True)
    rec = {**item.to_dict(), "prompt_tokens": len(p_ids), "prediction": generated.strip(), "correct": correct,
           "seconds": time.perf_counter() - t0, "batch_size": 1, "scoring": "teacher-forced"}
    if item.task == "multikey":
        rec["answered_other"] = any(score_answer(generated, k) for k in rec["distractor_keys"])
    return rec
