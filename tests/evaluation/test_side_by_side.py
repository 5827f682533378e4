"""hf_sparse_attention.evaluation.side_by_side: the two calls alternate, the ratio is the median round's."""

from __future__ import annotations

import pytest

from hf_sparse_attention.evaluation.side_by_side import paired_times


def _timer(times):
    """A timer that runs the call and returns the next of ``times`` (ms)."""
    it = iter(times)

    def timer(fn):
        fn()
        return next(it)

    return timer


def test_calls_alternate_and_ratio_is_the_median_rounds():
    calls = []
    # rounds: (ours, theirs) = (1, 2), (2, 2), (4, 2): ratios 2, 1, 0.5 (the third a clock drop that hit ours only)
    t = paired_times(lambda: calls.append("o"), lambda: calls.append("t"), 3, _timer([1, 2, 2, 2, 4, 2]))
    assert calls == ["o", "t"] * 3
    assert t["ours_ms"] == 2 and t["theirs_ms"] == 2
    assert t["ratio"] == 1 and t["ratio_min"] == 0.5 and t["ratio_max"] == 2


def test_one_round_is_one_timing_each():
    t = paired_times(lambda: None, lambda: None, 1, _timer([4.0, 5.0]))
    assert t == dict(ours_ms=4.0, theirs_ms=5.0, ratio=1.25, ratio_min=1.25, ratio_max=1.25)


@pytest.mark.parametrize("rounds", [0, -1, 2.0, True, "3"])
def test_bad_rounds(rounds):
    with pytest.raises(ValueError, match="rounds="):
        paired_times(lambda: None, lambda: None, rounds, _timer([1.0] * 8))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_timer_must_return_positive_ms(bad):
    with pytest.raises(ValueError, match="positive milliseconds"):
        paired_times(lambda: None, lambda: None, 1, _timer([1.0, bad]))
