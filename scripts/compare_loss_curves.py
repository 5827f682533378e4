#!/usr/bin/env python
"""Compare two ``log.jsonl`` loss curves written by ``scripts/train_selector.py`` (standard library only).

Used for the acceptance check "accelerate launch on both GPUs and on one (CUDA_VISIBLE_DEVICES=0)
gives loss curves that agree within 2% at every logged step after the first 10"::

    python scripts/compare_loss_curves.py runs/one/log.jsonl runs/two/log.jsonl --skip 10 --tolerance 0.02

Prints, per common step after ``--skip``, the two losses and their relative difference
``|a - b| / max(|a|, |b|)``, then the largest one; exits 0 when every step is within
``--tolerance``, 1 otherwise (2 when the logs share no step to compare). When a log holds a step
more than once (a resumed run), the last record counts.
"""

from __future__ import annotations

import argparse
import json
import sys


def read_curve(path: str) -> dict[int, float]:
    """``{step: loss}`` from a ``log.jsonl`` file."""
    curve: dict[int, float] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                curve[int(rec["step"])] = float(rec["loss"])
            except (ValueError, KeyError, TypeError) as exc:
                raise SystemExit(f"{path}:{n}: not a train_selector log record ({exc})") from exc
    return curve


def compare(a: dict[int, float], b: dict[int, float], skip: int) -> list[tuple[int, float, float, float]]:
    """``(step, loss_a, loss_b, relative difference)`` for every common step ``> skip``."""
    rows = []
    for step in sorted(set(a) & set(b)):
        if step <= skip:
            continue
        la, lb = a[step], b[step]
        scale = max(abs(la), abs(lb))
        rows.append((step, la, lb, abs(la - lb) / scale if scale > 0 else 0.0))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log_a")
    p.add_argument("log_b")
    p.add_argument("--skip", type=int, default=10, help="ignore steps <= this (default 10)")
    p.add_argument("--tolerance", type=float, default=0.02, help="largest allowed relative difference (default 0.02)")
    args = p.parse_args(argv)
    a, b = read_curve(args.log_a), read_curve(args.log_b)
    rows = compare(a, b, args.skip)
    if not rows:
        print(f"no common logged step after step {args.skip} ({len(a)} and {len(b)} records)")
        return 2
    print("| step | loss A | loss B | rel. diff |\n|---|---|---|---|")
    for step, la, lb, rel in rows:
        print(f"| {step} | {la:.5f} | {lb:.5f} | {rel:.4%} |")
    worst = max(rows, key=lambda r: r[3])
    ok = worst[3] <= args.tolerance
    print(f"\n{len(rows)} steps compared (after step {args.skip}); largest relative difference {worst[3]:.4%} "
          f"at step {worst[0]}; tolerance {args.tolerance:.2%}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
