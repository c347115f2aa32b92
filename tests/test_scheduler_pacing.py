"""LoadPacer (``aio_mclookup._scheduler.pacing``): hits handed out within a window of work."""

from __future__ import annotations

import pytest

from aio_mclookup._scheduler.pacing import LoadPacer


def test_results_wait_once_the_work_ahead_reaches_the_window() -> None:
    pacer = LoadPacer(1000)
    for i in range(4):
        assert pacer.admits(f"r{i}")
        pacer.handed(f"r{i}", 256)
    assert pacer.tokens == 1024 and len(pacer) == 4
    assert not pacer.admits("r4")  # (1,024 tokens ahead: the window is full)
    assert pacer.admits("r2")  # asked again: it has its result already
    pacer.started(["r0", "unknown"])
    assert pacer.tokens == 768 and pacer.admits("r4")


def test_a_request_longer_than_the_window_goes_alone() -> None:
    pacer = LoadPacer(100)
    assert pacer.admits("long")
    pacer.handed("long", 5000)
    assert not pacer.admits("next")
    pacer.started(["long"])
    assert pacer.tokens == 0 and pacer.admits("next")


def test_handing_twice_counts_once_and_started_forgets() -> None:
    pacer = LoadPacer(10)
    pacer.handed("a", 4)
    pacer.handed("a", 4)
    assert pacer.tokens == 4 and len(pacer) == 1
    pacer.handed("b", -3)  # (a hit past the prompt: nothing to compute)
    assert pacer.tokens == 4
    pacer.started(["a", "b", "a"])
    assert pacer.tokens == 0 and len(pacer) == 0


def test_a_window_of_zero_paces_nothing() -> None:
    pacer = LoadPacer(0)
    pacer.handed("a", 10**9)
    assert pacer.admits("b")
    with pytest.raises(ValueError, match=">= 0 tokens"):
        LoadPacer(-1)


def test_full_says_the_window_is_filled() -> None:
    pacer = LoadPacer(100)
    assert not pacer.full
    pacer.handed("a", 100)
    assert pacer.full
    pacer.started(["a"])
    assert not pacer.full
    off = LoadPacer(0)
    off.handed("a", 10**6)
    assert not off.full  # (no window: never full)
