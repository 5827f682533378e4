"""PNG plots of a results dict: perplexity by pattern, retrieval heatmaps, speed vs length."""

from __future__ import annotations

import os
from collections import defaultdict

from .speed import MEMORY_LABELS

__all__ = ["write_plots"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _perplexity_plot(rows, path):
    plt = _plt()
    contexts = sorted({r["context"] for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    runs = defaultdict(list)
    for r in rows:
        runs[(r["variant"], r["context"])].append(r["perplexity"])
    table = {k: sum(v) / len(v) for k, v in runs.items()}  # mean over text windows
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(variants) * max(1, len(contexts)) ** 0.5 + 2), 4))
    width = 0.8 / len(contexts)
    for k, c in enumerate(contexts):
        xs = [i + (k - (len(contexts) - 1) / 2) * width for i in range(len(variants))]
        ys = [table.get((v, c), float("nan")) for v in variants]
        bars = ax.bar(xs, ys, width, label=f"context {c}")
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(variants)), variants, rotation=30, ha="right")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title("Perplexity by attention pattern")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _retrieval_plot(rows, task, path):
    plt = _plt()
    rows = [r for r in rows if r["task"] == task]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(1, len(variants), figsize=(2.6 * len(variants) + 1, 3.2), squeeze=False)
    image = None
    for ax, v in zip(axes[0], variants):
        mine = [r for r in rows if r["variant"] == v]
        contexts = sorted({r["context"] for r in mine})
        depths = sorted({r["depth"] for r in mine})
        acc = defaultdict(list)
        for r in mine:
            acc[(r["depth"], r["context"])].append(r["correct"])
        grid = [[(sum(acc[(d, c)]) / len(acc[(d, c)])) if acc[(d, c)] else float("nan") for c in contexts] for d in depths]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, d in enumerate(depths):
            for j, c in enumerate(contexts):
                if acc[(d, c)]:
                    ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(contexts)), [str(c) for c in contexts], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_xlabel("context")
        ax.set_title(v, fontsize=9)
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    fig.suptitle(f"{task} retrieval accuracy", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _speed_plot(rows, path):
    plt = _plt()
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for v in variants:
        mine = sorted((r for r in rows if r["variant"] == v), key=lambda r: r["length"])
        xs = [r["length"] for r in mine]
        axes[0].plot(xs, [r["prefill_seconds"] for r in mine], marker="o", label=v)
        axes[1].plot(xs, [r["decode_tokens_per_second"] or float("nan") for r in mine], marker="o", label=v)
        axes[2].plot(xs, [r["peak_memory_bytes"] / 2**20 for r in mine], marker="o", label=v)
    memory = MEMORY_LABELS.get(rows[0]["memory_kind"], "memory (MiB)") if rows else ""
    for ax, title in zip(axes, ("prefill time (s)", "decode tokens/s", memory)):
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(results: dict, out_dir: str) -> list[str]:
    """Write the plots the results allow into ``out_dir``; returns their file names."""
    names = []
    if results.get("perplexity"):
        _perplexity_plot(results["perplexity"], os.path.join(out_dir, "perplexity.png"))
        names.append("perplexity.png")
    for task in ("passkey", "needle", "unseen", "multikey"):
        if any(r["task"] == task for r in results.get("retrieval", [])):
            name = f"retrieval_{task}.png"
            _retrieval_plot(results["retrieval"], task, os.path.join(out_dir, name))
            names.append(name)
    if results.get("speed"):
        _speed_plot(results["speed"], os.path.join(out_dir, "speed.png"))
        names.append("speed.png")
    return names
