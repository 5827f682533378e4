"""Retrieval prompts in formats the selectors never saw in training: ``unseen`` and ``multikey``.

The trained formats are the landmark passkey prompt (grass/sky filler, "The pass key is N") and
pass-key sentences in Gutenberg training text (``scripts/train_selector.py --passkey-style``); the
``needle`` task's "special magic number" sentence in held-out Gutenberg text is the format the
patterns were tuned on. The formats here change all three parts:

* **filler** (``FILLERS``): ``prose``, seeded synthetic sentences ("The quiet miller carried the
  lantern past the old mill before dawn.") that never repeat the way the grass/sky lines do and
  contain no digits; or ``play``, lines of the held-out Shakespeare plays (the needle task's
  haystack; never in training);
* **needle wording** (``WORDINGS``): e.g. "Remember this: the secret code of the archive is N.";
* **question position** (``QUESTION_POSITIONS``): ``before`` the haystack (the prompt opens with
  the question and ends with the answer cue) or ``after`` it.

A trial's format follows its ``form`` index (``item_format``): question position ``form % 2``,
filler ``form // 2 % 2``, wording ``form % 3``, so any 4 consecutive trials cover both fillers and
both positions. ``multikey`` puts ``needles`` sentences "The code for the <colour> door is N." at
seeded depths, the asked one at the trial's ``depth``, and asks for one colour; it is scored on the
asked key only (``answered_other`` records an answer that is another door's key).

Length: the filler is cut to whole sentences (``play``: whole lines), the most that keep the prompt
within ``context`` tokens, so a prompt is at most ``context`` tokens and at least ``context`` minus
one filler sentence. Depth: the needle sits at the sentence boundary nearest to ``depth`` of the
filler's tokens (within half a filler sentence of it).
"""

from __future__ import annotations

import random

__all__ = [
    "COLOURS",
    "FILLERS",
    "QUESTION_POSITIONS",
    "WORDINGS",
    "item_format",
    "multikey_keys",
    "multikey_prompt",
    "prose_sentences",
    "unseen_prompt",
]

FILLERS = ("prose", "play")
QUESTION_POSITIONS = ("after", "before")
#: (needle sentence, question, answer cue): none appears in training or in the other tasks.
WORDINGS = (
    ("Remember this: the secret code of the archive is {key}.",
     "What is the secret code of the archive?", "The secret code of the archive is"),
    ("Note for later: the combination of the blue safe is {key}.",
     "Which combination opens the blue safe?", "The combination of the blue safe is"),
    ("One line here matters: the ticket number of the lost parcel is {key}.",
     "What is the ticket number of the lost parcel?", "The ticket number of the lost parcel is"),
)
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple")
MULTIKEY_NEEDLE = "The code for the {colour} door is {key}."
MULTIKEY_QUESTION = "What is the code for the {colour} door?"
MULTIKEY_CUE = "The code for the {colour} door is"
INTRO = "Read the document below."
INTRO_WITH_QUESTION = "Read the document below, then answer this question: {question}"

_ADJ = ("quiet", "old", "young", "tired", "cheerful", "careful", "stubborn", "gentle", "curious", "patient")
_WHO = ("miller", "sailor", "weaver", "gardener", "clerk", "baker", "shepherd", "painter", "tailor", "carter")
_VERB = ("carried", "mended", "found", "sold", "painted", "counted", "polished", "wrapped", "lost", "hid")
_WHAT = ("lantern", "basket", "ladder", "blanket", "kettle", "map", "rope", "barrel", "bell", "saddle")
_WHERE = ("past the old mill", "across the bridge", "behind the chapel", "along the river", "near the market",
          "under the elm tree", "beside the harbour", "through the orchard", "over the hill", "inside the barn")
_WHEN = ("before dawn", "after supper", "in the rain", "at midday", "on a windy morning", "late in the evening",
         "during the fair", "once the snow had melted", "while the bells rang", "as the tide turned")


def item_format(task: str, form: int) -> dict:
    """Filler, question position and wording index of trial ``form`` of ``task`` (module docstring)."""
    out = {"filler": FILLERS[(form // 2) % len(FILLERS)], "question": QUESTION_POSITIONS[form % 2]}
    if task == "unseen":
        out["wording"] = form % len(WORDINGS)
    return out


def prose_sentences(seed: str, count: int) -> list[str]:
    """``count`` seeded synthetic filler sentences (no digits; consecutive sentences differ)."""
    rng = random.Random(f"prose-{seed}")
    out: list[str] = []
    while len(out) < count:
        s = (f"The {rng.choice(_ADJ)} {rng.choice(_WHO)} {rng.choice(_VERB)} the {rng.choice(_WHAT)} "
             f"{rng.choice(_WHERE)} {rng.choice(_WHEN)}.")
        if not out or s != out[-1]:
            out.append(s)
    return out


def _play_lines(tokenizer, haystack_ids: list[int], context: int, seed: str) -> list[str]:
    """Non-empty lines of a window of the held-out play text with more tokens than ``context``."""
    span = min(len(haystack_ids), 2 * context + 256)
    if span < context:
        raise ValueError(f"the play haystack has {len(haystack_ids)} tokens; context {context} needs more")
    start = random.Random(f"play-{seed}").randrange(len(haystack_ids) - span + 1)
    text = tokenizer.decode(haystack_ids[start:start + span], skip_special_tokens=True)
    lines = [ln.strip() for ln in text.split("\n") if ln.strip() and not any(ch.isdigit() for ch in ln)]
    return lines[1:]  # the first line may start mid-word


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=True)["input_ids"])


def _assemble(head: str, filler: list[str], lengths: list[int], sep: str, needles: list[tuple[float, str]],
              tail: str) -> str:
    """``head``, the filler with each ``(depth, sentence)`` needle at the sentence boundary nearest to
    ``depth`` of the filler's tokens (``lengths``: tokens per sentence), ``tail``."""
    n = len(filler)
    cum = [0]
    for x in lengths[:n]:
        cum.append(cum[-1] + x)
    slots: dict[int, list[str]] = {}
    for depth, text in needles:
        slot = min(range(n + 1), key=lambda i: abs(cum[i] - depth * cum[n]))
        slots.setdefault(slot, []).append(text)
    body: list[str] = []
    for i in range(n + 1):
        body += slots.get(i, [])
        if i < n:
            body.append(filler[i])
    return head + "\n\n" + sep.join(body) + "\n\n" + tail


def _fit(tokenizer, context: int, head: str, sentences: list[str], sep: str, needles, tail: str) -> str:
    """The prompt with the most leading ``sentences`` that keep it within ``context`` tokens."""
    fixed = _n_tokens(tokenizer, _assemble(head, [], [], sep, needles, tail))
    if fixed > context:
        raise ValueError(f"context {context} is too short for the prompt's fixed text ({fixed} tokens)")
    lengths = [len(ids) for ids in tokenizer([sep + s for s in sentences], add_special_tokens=False)["input_ids"]]

    def build(k: int) -> str:
        return _assemble(head, sentences[:k], lengths, sep, needles, tail)

    n, total = 0, fixed
    while n < len(sentences) and total + lengths[n] <= context:
        total += lengths[n]
        n += 1
    while n < len(sentences) and _n_tokens(tokenizer, build(n + 1)) <= context:
        n += 1
    while n > 0 and _n_tokens(tokenizer, build(n)) > context:
        n -= 1
    if n == len(sentences) and n:
        raise ValueError(f"ran out of filler ({n} sentences) before reaching {context} tokens")
    return build(n)


def _filler(tokenizer, filler: str, context: int, seed: str, haystack_ids) -> tuple[list[str], str]:
    if filler == "prose":
        return prose_sentences(seed, context // 4 + 16), " "
    if filler == "play":
        if haystack_ids is None:
            raise ValueError("the 'play' filler needs haystack token ids (the held-out plays)")
        return _play_lines(tokenizer, haystack_ids, context, seed), "\n"
    raise ValueError(f"filler must be one of {FILLERS}, got {filler!r}")


def _frame(question: str, cue: str, position: str) -> tuple[str, str]:
    if position == "before":
        return INTRO_WITH_QUESTION.format(question=question), f"Answer: {cue}"
    if position == "after":
        return INTRO, f"Question: {question}\nAnswer: {cue}"
    raise ValueError(f"question position must be one of {QUESTION_POSITIONS}, got {position!r}")


def unseen_prompt(tokenizer, context: int, depth: float, key: int, form: int, haystack_ids=None) -> str:
    """Single-needle prompt of trial ``form`` (module docstring), at most ``context`` tokens."""
    fmt = item_format("unseen", form)
    needle, question, cue = WORDINGS[fmt["wording"]]
    sentences, sep = _filler(tokenizer, fmt["filler"], context, f"unseen-{key}-{form}", haystack_ids)
    head, tail = _frame(question, cue, fmt["question"])
    return _fit(tokenizer, context, head, sentences, sep, [(depth, needle.format(key=key))], tail)


def multikey_keys(key: int, depth: float, form: int, needles: int) -> list[dict]:
    """The ``needles`` needles of a multikey trial: the asked one first (``key`` at ``depth``), then
    distractors with distinct seeded keys, colours and depths: ``[{"colour", "key", "depth"}]``."""
    if isinstance(needles, bool) or not isinstance(needles, int) or not 2 <= needles <= len(COLOURS):
        raise ValueError(f"needles must be an int in [2, {len(COLOURS)}], got {needles!r}")
    rng = random.Random(f"multikey-{key}-{form}-{needles}")
    colours = rng.sample(COLOURS, needles)
    keys = [key]
    while len(keys) < needles:
        k = rng.randint(10000, 99999)
        if k not in keys:
            keys.append(k)
    depths = [depth] + [rng.random() for _ in range(needles - 1)]
    return [{"colour": c, "key": k, "depth": d} for c, k, d in zip(colours, keys, depths)]


def multikey_prompt(tokenizer, context: int, depth: float, key: int, form: int, needles: int = 4,
                    haystack_ids=None) -> str:
    """Several labelled needles, one asked for (module docstring), at most ``context`` tokens."""
    fmt = item_format("multikey", form)
    spec = multikey_keys(key, depth, form, needles)
    asked = spec[0]["colour"]
    sentences, sep = _filler(tokenizer, fmt["filler"], context, f"multikey-{key}-{form}", haystack_ids)
    head, tail = _frame(MULTIKEY_QUESTION.format(colour=asked), MULTIKEY_CUE.format(colour=asked), fmt["question"])
    placed = [(s["depth"], MULTIKEY_NEEDLE.format(colour=s["colour"], key=s["key"])) for s in spec]
    return _fit(tokenizer, context, head, sentences, sep, placed, tail)
