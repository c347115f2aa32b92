"""Counters and histograms: buckets are not cumulative (``cumulative`` is), quantiles are
upper bounds, and a snapshot is a copy that later counting does not change."""

from __future__ import annotations

import math

import pytest

from aio_mclookup import CoordinatorStats, Histogram, InvalidRequest


def test_histogram_buckets_cumulative_and_quantiles() -> None:
    hist = Histogram((1.0, 2.0, 5.0))
    for value in (0.5, 1.0, 1.5, 4.0, 9.0):
        hist.observe(value)
    assert hist.counts == [2, 1, 1, 1]  # <=1, (1,2], (2,5], >5
    assert hist.cumulative() == [2, 3, 4, 5]
    assert hist.count == 5 and hist.sum == pytest.approx(16.0)
    assert hist.quantile(0.4) == 1.0
    assert hist.quantile(0.6) == 2.0
    assert hist.quantile(1.0) == math.inf
    assert math.isnan(Histogram((1.0,)).quantile(0.5))
    with pytest.raises(InvalidRequest):
        hist.quantile(1.5)


def test_a_snapshot_does_not_move_with_the_live_counters() -> None:
    stats = CoordinatorStats()
    stats.lookups_total = 3
    stats.lookup_seconds.observe(0.01)
    stats.count_error("-900")
    snap = stats.snapshot()
    stats.lookups_total += 1
    stats.lookup_seconds.observe(0.02)
    stats.count_error("-900")
    assert snap.lookups_total == 3 and snap.lookup_seconds.count == 1
    assert snap.errors_by_code == {"-900": 1}
    assert stats.errors_by_code == {"-900": 2}
