"""Two calls timed in turn: the ratio of a kernel to a baseline when the GPU's clocks drift during a row.

Timing ours, then the baseline, once each, lets a change of clock or temperature between the two timings enter the
ratio (FA4's own time moved up to 4% between two calls on the H200). ``paired_times`` alternates them for a number
of rounds and reports the median of the per-round ratios with its range, so each ratio compares two timings taken
a moment apart.
"""

from __future__ import annotations

import statistics
from typing import Callable

__all__ = ["paired_times"]


def paired_times(ours: Callable[[], object], theirs: Callable[[], object], rounds: int,
                 timer: Callable[[Callable[[], object]], float]) -> dict:
    """Time ``ours`` and ``theirs`` in turn, ``rounds`` times, with ``timer`` (a callable -> milliseconds).

    Returns ``ours_ms`` and ``theirs_ms`` (the medians of each), ``ratio`` (the median of the per-round ratios
    ``theirs / ours``: above 1, ours is faster), ``ratio_min`` and ``ratio_max``.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r}: a positive int is required")
    t_ours, t_theirs = [], []
    for _ in range(rounds):
        t_ours.append(float(timer(ours)))
        t_theirs.append(float(timer(theirs)))
    bad = [t for t in t_ours + t_theirs if not t > 0]
    if bad:
        raise ValueError(f"timer returned {bad[0]!r}: positive milliseconds are required")
    ratios = [b / a for a, b in zip(t_ours, t_theirs)]
    return dict(ours_ms=statistics.median(t_ours), theirs_ms=statistics.median(t_theirs),
                ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
