"""PositiveCache: membership is validity; batches expire by their own time; the size bound.
KnownPrefixes: prefix trees of present chunks by hash rows, their expiry per row, branching
and bound."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_mclookup._coordinator import caches
from aio_mclookup._coordinator.caches import (
    RUN_OVERHEAD_ROWS,
    KnownPrefixes,
    NextChunk,
    PositiveCache,
)

LEAVES_RUN, LIKELY_ABSENT, LIKELY_PRESENT = (
    NextChunk.LEAVES_RUN, NextChunk.LIKELY_ABSENT, NextChunk.LIKELY_PRESENT
)


def test_keys_expire_at_their_expiry() -> None:
    cache = PositiveCache()
    cache.add([b"a", b"b"], expiry=15.0, max_keys=100)
    cache.expire(14.999)
    assert b"a" in cache and b"b" in cache.members
    cache.expire(15.0)
    assert b"a" not in cache and len(cache) == 0


def test_batches_added_out_of_order_expire_by_their_own_time() -> None:
    # RPC X sent at t=1 answers before RPC Y sent at t=0 (they run in parallel).
    cache = PositiveCache()
    cache.add([b"x"], expiry=6.0, max_keys=100)
    cache.add([b"y"], expiry=5.0, max_keys=100)
    cache.expire(5.0)
    assert b"y" not in cache and b"x" in cache
    cache.expire(6.0)
    assert len(cache) == 0


def test_a_key_in_two_batches_goes_with_the_first_to_expire() -> None:
    cache = PositiveCache()
    cache.add([b"k"], expiry=5.0, max_keys=100)
    cache.add([b"k"], expiry=8.0, max_keys=100)
    cache.expire(5.0)
    assert b"k" not in cache  # early, never late
    cache.expire(8.0)
    assert len(cache) == 0


def test_size_bound_drops_first_expiring_batches_to_ninety_percent() -> None:
    cache = PositiveCache()
    for i in range(11):
        cache.add([b"k%d" % i], expiry=60.0 + i, max_keys=10)
    assert len(cache) == 9
    assert b"k0" not in cache and b"k1" not in cache and b"k10" in cache


def test_a_late_batch_leaves_the_others_alone() -> None:
    """A slow RPC answered after thousands of later ones neither takes their keys with it
    (emptying the cache when it expires) nor touches them when added."""
    cache = PositiveCache()
    for i in range(4000):
        cache.add([b"%d-%d" % (i, j) for j in range(100)], expiry=10.0 + i, max_keys=10**7)
    cache.add([b"late"], expiry=5.0, max_keys=10**7)
    cache.expire(5.0)
    assert b"late" not in cache and len(cache) == 400_000


def test_leading_counts_cached_keys_up_to_the_first_miss_with_their_earliest_expiry() -> None:
    cache = PositiveCache()
    cache.add([b"a", b"b", b"d"], expiry=5.0, max_keys=100)
    cache.add([b"a"], expiry=7.0, max_keys=100)  # a later answer: a holds until 7
    assert cache.leading([b"a", b"b", b"c", b"d"]) == (2, 5.0)
    assert cache.leading([b"a", b"e"]) == (1, 7.0)
    assert cache.leading([b"c", b"a"]) == (0, math.inf)
    assert cache.leading([]) == (0, math.inf)
    assert cache.members[b"d"] == 5.0
    cache.add([], expiry=1.0, max_keys=100)
    assert len(cache) == 3


def _rows(*values: int, width: int = 4) -> np.ndarray:
    """One hash row per value (its bytes, little-endian)."""
    return np.array([list(v.to_bytes(width, "little")) for v in values], dtype=np.uint8)


SIG = (b"model@tp_rank:0@group:0@",)


def test_known_prefixes_count_the_rows_shared_with_a_stored_run() -> None:
    known = KnownPrefixes()
    known.add(SIG, _rows(1, 2, 3, 4), until=10.0, max_rows=1000)
    assert known.leading(SIG, _rows(1, 2, 3, 4, 5), now=0.0) == (4, 10.0)
    assert known.leading(SIG, _rows(1, 2, 9, 4), now=0.0) == (2, 10.0)  # diverges at row 2
    assert known.leading(SIG, _rows(1, 2), now=0.0) == (2, 10.0)
    assert known.leading(SIG, _rows(7, 2, 3), now=0.0) == (0, math.inf)  # another first hash
    assert known.leading(("other@",), _rows(1, 2, 3), now=0.0) == (0, math.inf)
    assert known.leading(SIG, _rows(), now=0.0) == (0, math.inf)
    assert known.leading(SIG, _rows(1, 2, width=8), now=0.0) == (0, math.inf)  # other width


def test_known_prefixes_take_the_run_key_from_the_caller() -> None:
    """A caller that has computed ``key_of`` the rows (the coordinator does, once per lookup)
    passes it instead of having it recomputed: same runs, same answers."""
    known = KnownPrefixes()
    rows = _rows(1, 2, 3, 4)
    key = KnownPrefixes.key_of(SIG, rows)
    assert key == (SIG, rows[0].tobytes())
    known.add(SIG, rows, until=10.0, max_rows=1000, key=key)
    assert known.leading(SIG, _rows(1, 2, 9), now=0.0) == (2, 10.0)
    assert known.leading(SIG, _rows(1, 2, 9), now=0.0, key=key) == (2, 10.0)
    assert known.leading(SIG, _rows(1, 2, 3, 4), now=0.0, key=(SIG, b"other")) == (0, math.inf)


def test_known_prefixes_expire_row_by_row_from_the_end() -> None:
    known = KnownPrefixes()
    known.add(SIG, _rows(1, 2), until=10.0, max_rows=1000)
    known.add(SIG, _rows(1, 2, 3, 4), until=5.0, max_rows=1000)  # extends; rows 0-1 keep 10
    assert known.leading(SIG, _rows(1, 2, 3, 4), now=0.0) == (4, 5.0)
    assert known.leading(SIG, _rows(1, 2, 3, 4), now=5.0) == (2, 10.0)  # 3 and 4 are stale
    assert known.leading(SIG, _rows(1, 2, 3, 4), now=10.0) == (0, math.inf)
    assert len(known) == 0  # a wholly stale run is dropped when met


def test_known_prefixes_keep_each_rows_latest_expiry_but_never_beyond_an_earlier_row() -> None:
    known = KnownPrefixes()
    known.add(SIG, _rows(1, 2, 3), until=5.0, max_rows=1000)
    known.add(SIG, _rows(1, 2), until=8.0, max_rows=1000)  # a prefix: refreshes rows 0-1
    assert known.leading(SIG, _rows(1, 2, 3), now=6.0) == (2, 8.0)
    known.add(SIG, _rows(1, 2, 3), until=4.0, max_rows=1000)  # older news changes nothing
    assert known.leading(SIG, _rows(1, 2, 3), now=0.0) == (3, 5.0)
    assert known.leading(SIG, _rows(1, 2, 3), now=5.5) == (2, 8.0)


def test_known_prefixes_branch_where_runs_diverge() -> None:
    """A run that parts from a stored one adds its own branch (sessions sharing a system
    prompt); both stay known, each with its own expiry."""
    known = KnownPrefixes()
    known.add(SIG, _rows(1, 2, 3, 4), until=10.0, max_rows=1000)
    known.add(SIG, _rows(1, 2, 8), until=6.0, max_rows=1000)
    assert len(known) == 5 + 3 * RUN_OVERHEAD_ROWS  # the common edge and two branches
    assert known.leading(SIG, _rows(1, 2, 8, 9), now=0.0) == (3, 6.0)
    assert known.leading(SIG, _rows(1, 2, 3, 4), now=0.0) == (4, 10.0)
    assert known.leading(SIG, _rows(1, 2, 3, 4), now=7.0) == (4, 10.0)
    assert known.leading(SIG, _rows(1, 2, 8), now=7.0) == (2, 10.0)  # its branch is stale
    assert len(known) == 4 + 2 * RUN_OVERHEAD_ROWS  # and dropped when met
    known.add(SIG, _rows(1, 2, 3, 5, 6), until=12.0, max_rows=1000)  # parts inside an edge
    assert known.leading(SIG, _rows(1, 2, 3, 5, 6), now=11.0) == (5, 12.0)
    assert known.leading(SIG, _rows(1, 2, 3, 4), now=0.0) == (4, 10.0)


def test_known_prefixes_keep_their_own_copy_of_the_rows() -> None:
    known = KnownPrefixes()
    rows = _rows(1, 2, 3)
    known.add(SIG, rows, until=10.0, max_rows=1000)
    rows[1] = 0
    assert known.leading(SIG, _rows(1, 2, 3), now=0.0) == (3, 10.0)


def test_known_prefixes_stay_within_max_rows_dropping_the_oldest_runs() -> None:
    known = KnownPrefixes()
    limit = 3 * (4 + RUN_OVERHEAD_ROWS)
    for first in range(1, 6):
        known.add(SIG, _rows(first, 100, 101, 102), until=10.0, max_rows=limit)
        assert len(known) <= limit
    assert known.leading(SIG, _rows(1, 100), now=0.0) == (0, math.inf)
    assert known.leading(SIG, _rows(5, 100), now=0.0) == (2, 10.0)
    known.add(SIG, _rows(9, *range(200, 260)), until=10.0, max_rows=limit)  # alone too big
    assert len(known) <= limit


def test_known_prefixes_of_empty_hashes() -> None:
    """vLLM accepts empty hashes (every key is then the same): rows of width 0 all match."""
    known = KnownPrefixes()
    empty = np.zeros((3, 0), dtype=np.uint8)
    known.add(SIG, empty, until=10.0, max_rows=1000)
    known.add(SIG, empty[:2], until=12.0, max_rows=1000)
    assert known.leading(SIG, np.zeros((5, 0), dtype=np.uint8), now=0.0) == (3, 10.0)


def test_known_prefixes_tell_what_the_chunk_after_a_match_likely_is() -> None:
    """A hint for the first probe after a known prefix: the chunk alone (likely absent) or a
    window (likely present). Answers never depend on it."""
    known = KnownPrefixes()
    rows = _rows(1, 2, 3)
    key = KnownPrefixes.key_of(SIG, rows)
    assert known.after(key, _rows(1, 2, 3, 4), 3) == LIKELY_ABSENT  # no run: nothing known
    known.add(SIG, rows, until=10.0, max_rows=1000, key=key, miss=(9).to_bytes(4, "little"))
    assert known.after(key, _rows(1, 7, 3), 1) == LEAVES_RUN  # its own continuation
    assert known.after(key, _rows(1, 2, 3), 1) == LIKELY_PRESENT  # as the run goes on
    assert known.after(key, _rows(1, 2, 3, 9), 3) == LIKELY_ABSENT  # the run's very miss
    assert known.after(key, _rows(1, 2, 3, 4), 3) == LIKELY_ABSENT  # never grown
    assert known.after(key, _rows(1, 2, 3), 3) == LIKELY_ABSENT  # nothing after the request
    assert known.after(None, _rows(1, 2, 3, 4), 3) == LIKELY_ABSENT


def test_known_prefixes_count_how_often_a_run_grew_past_its_end() -> None:
    """Requests that share a document up to different cuts: once a run has grown past its
    end, the chunk after it is more likely present than not (unless it is the last miss)."""
    known = KnownPrefixes()
    key = KnownPrefixes.key_of(SIG, _rows(1))
    known.add(SIG, _rows(1, 2), until=10.0, max_rows=1000, miss=(8).to_bytes(4, "little"))
    known.add(SIG, _rows(1, 2, 3), until=10.0, max_rows=1000, miss=(9).to_bytes(4, "little"))
    assert known.after(key, _rows(1, 2, 3, 4), 3) == LIKELY_PRESENT  # grown once
    assert known.after(key, _rows(1, 2, 3, 9), 3) == LIKELY_ABSENT  # the latest miss
    known.add(SIG, _rows(1, 2, 3), until=10.0, max_rows=1000, miss=(4).to_bytes(4, "little"))
    assert known.after(key, _rows(1, 2, 3, 4), 3) == LIKELY_ABSENT  # the same rows' newer miss
    assert known.after(key, _rows(1, 2, 3, 9), 3) == LIKELY_PRESENT
    known.add(SIG, _rows(1, 2, 5), until=10.0, max_rows=1000)  # diverges: a new branch
    assert known.after(key, _rows(1, 2, 5, 6), 3) == LIKELY_ABSENT  # it never grew
    assert known.after(key, _rows(1, 2, 3, 9), 3) == LIKELY_PRESENT  # the other one did
    assert known.after(key, _rows(1, 2, 7), 2) == LIKELY_PRESENT  # a branch point
    known.add(SIG, _rows(1, 2), until=10.0, max_rows=1000, miss=(7).to_bytes(4, "little"))
    assert known.after(key, _rows(1, 2, 7), 2) == LIKELY_PRESENT  # a prefix: no change


# ----------------------------------------------------------- the compiled reads, the same
@pytest.mark.skipif(caches._C is None, reason="the C extension is not built, or not loaded")
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_compiled_reads_answer_as_the_python_ones(data: st.DataObject) -> None:
    """Random runs added, read and aged on one tree: leading and after from the compiled walk
    (falling back where rows are out of date) and from the Python one, step by step, leave
    the same answers and the same trees (the Python walk drops what is out of date)."""
    compiled, pure = KnownPrefixes(), KnownPrefixes()
    short = st.lists(st.integers(0, 3), min_size=1, max_size=7)
    for _ in range(data.draw(st.integers(1, 25))):
        rows = _rows(*data.draw(short))
        key = KnownPrefixes.key_of(SIG, rows)
        step = data.draw(st.sampled_from(["add", "leading", "after"]))
        if step == "add":
            until = float(data.draw(st.integers(1, 9)))
            miss = data.draw(st.sampled_from([None, (1).to_bytes(4, "little")]))
            for known in (compiled, pure):
                known.add(SIG, rows, until, max_rows=60, miss=miss)
        elif step == "leading":
            now = float(data.draw(st.integers(0, 9)))
            got = compiled.leading(SIG, rows, now, key)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(caches, "_C", None)
                want = pure.leading(SIG, rows, now, key)
            assert got == want
        else:
            count = data.draw(st.integers(0, rows.shape[0]))
            got_after = compiled.after(key, rows, count)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(caches, "_C", None)
                assert got_after == pure.after(key, rows, count)
        assert _trees(compiled) == _trees(pure)


def _trees(known: KnownPrefixes) -> Any:
    def node(n: Any) -> Any:
        children = sorted((k, node(c)) for k, c in (n.children or {}).items())
        return (n.rows.tolist(), n.until.tolist(), children, n.miss, n.grown)

    return len(known), [(key, node(tree[0]), tree[1]) for key, tree in known._runs.items()]


@pytest.mark.skipif(caches._C is None, reason="the C extension is not built, or not loaded")
def test_the_compiled_reads_leave_to_python_what_they_do_not_read() -> None:
    known = KnownPrefixes()
    rows = _rows(1, 2, 3)
    key = KnownPrefixes.key_of(SIG, rows)
    known.add(SIG, rows, until=5.0, max_rows=1000, key=key)
    assert caches._C.leading(known._runs, key, rows, 1.0) == (3, 5.0)
    assert caches._C.leading(known._runs, key, rows, 5.0) is None  # (out of date)
    assert caches._C.leading(known._runs, key, rows[:, :2].copy(), 1.0) is None  # (widths)
    assert caches._C.after(known._runs, key, _rows(1, 9), 1) == 2
    for odd in (np.zeros(3), np.asfortranarray(_rows(1, 2, 3)), _rows(1, 2, 3).view(np.int8)):
        assert caches._C.leading(known._runs, key, odd, 1.0) is None
        assert caches._C.after(known._runs, key, odd, 1) is None
    assert known.after(key, np.asfortranarray(_rows(1, 9)), 1) == LEAVES_RUN  # (in Python)
