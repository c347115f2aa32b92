"""The key table on its own: queued keys in fair shares, abandoned keys, clearing; the
compiled entry of keys, subscription, fan-out and reading of queued rounds (``_table_c``)
against the Python ones."""

from __future__ import annotations

import copy
import importlib
import importlib.util
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_mclookup._coordinator import table as table_module
from aio_mclookup._coordinator.table import KeyTable, Subscribers, enter_keys, unsent

TABLE_C = "aio_mclookup._coordinator._table_c"
C: Any = importlib.import_module(TABLE_C) if importlib.util.find_spec(TABLE_C) else None
needs_build = pytest.mark.skipif(C is None, reason="the C extension is not built")


def queue(table: KeyTable, tag: bytes, count: int, owner: int) -> list[bytes]:
    """A round of ``count`` new keys, entered the way the core enters them."""
    keys = [b"%s-%d" % (tag, i) for i in range(count)]
    assert table.enter(keys, [owner << 32 | i for i in range(count)]) == (count, 0)
    return keys


def everyone(_: Subscribers) -> bool:
    return True


def test_everything_that_fits_goes_in_one_take() -> None:
    table = KeyTable()
    a, b = queue(table, b"a", 3, 1), queue(table, b"b", 2, 2)
    assert table.queued == 5 and table.queued_keys() == a + b
    assert table.take(10, everyone) == (*a, *b)
    assert table.queued == 0 and not table.rounds
    assert set(table.waiting) == set(a + b)  # (in flight: still waiting for answers)


def test_a_huge_round_cannot_hold_back_a_small_one() -> None:
    table = KeyTable()
    huge = queue(table, b"huge", 1000, 1)
    small = queue(table, b"small", 5, 2)
    taken = table.take(100, everyone)
    assert set(small) <= set(taken) and len(taken) == 100
    assert table.queued == 905
    rest = table.take(2000, everyone)
    assert set(taken) | set(rest) == set(huge + small) and len(taken) + len(rest) == 1005
    assert table.queued == 0


def test_abandoned_keys_are_dropped_unless_someone_joined_them() -> None:
    table = KeyTable()
    gone = queue(table, b"gone", 4, 1)
    table.waiting[gone[1]] = [1 << 32 | 1, 2 << 32]  # lookup 2 joined this one
    table.abandoned.update(gone)
    alive = {2}

    def wanted(subscribers: Subscribers) -> bool:
        subs = [subscribers] if isinstance(subscribers, int) else subscribers
        return any(sub >> 32 in alive for sub in subs)

    assert table.take(10, wanted) == (gone[1],)
    assert set(table.waiting) == {gone[1]} and not table.abandoned and table.queued == 0


def test_a_joined_key_goes_out_with_the_first_round_that_lists_it() -> None:
    table = KeyTable()
    huge = queue(table, b"huge", 1000, 1)
    table.waiting[huge[900]] = [1 << 32 | 900, 2 << 32]  # a small round joined it, queued
    table._queue_round([huge[900]], 0)  # (as enter() lists it for that round)
    taken = table.take(64, everyone)
    assert huge[900] in taken and len(taken) == 64 and table.copies
    assert table.queued == 1000 - 64 and huge[900] in table.sending
    rest = table.take(2000, everyone)
    assert len(taken) + len(rest) == 1000 and set(taken) | set(rest) == set(huge)  # (once)
    table.answered(rest)
    assert table.sending == set(taken) and table.queued == 0 and not table.copies


def test_live_keys_leave_out_the_abandoned() -> None:
    table = KeyTable()
    keys = queue(table, b"k", 3, 1)
    table.abandoned.add(keys[0])
    assert table.queued == 3 and table.live == 2


def test_clear_queued_returns_only_the_queued_keys() -> None:
    table = KeyTable()
    keys = queue(table, b"k", 4, 1)
    in_flight = table.take(1, everyone)
    dropped = table.clear_queued()
    assert set(dropped) == set(keys) - set(in_flight)
    assert dropped[keys[2]] == 1 << 32 | 2
    assert set(table.waiting) == set(in_flight) and table.queued == 0 and not table.rounds
    table.clear()
    assert not table.waiting


def test_entering_joins_what_is_there_and_lists_the_queued_keys_joined() -> None:
    table = KeyTable()
    first = queue(table, b"k", 3, 1)
    table.take(1, everyone)  # first[0] in flight
    assert table.enter([first[0], first[1], b"new"], [2 << 32, 2 << 32 | 1, 2 << 32 | 2]) == (1, 2)
    assert table.rounds[-1].keys == [first[1], b"new"] and table.copies  # (not first[0])
    assert table.waiting[first[0]] == [1 << 32, 2 << 32] and table.queued == 3


_KEYS = st.sampled_from([b"k%d" % i for i in range(12)])
_WAITING = st.dictionaries(_KEYS, st.one_of(
    st.integers(0, 2**40), st.lists(st.integers(0, 2**40), min_size=2, max_size=4)
))
"""A key table's ``waiting``: subscribers as one int or a list of them."""


@needs_build
@settings(max_examples=400, deadline=None)
@given(
    waiting=_WAITING,
    sending=st.sets(_KEYS),
    keys=st.lists(_KEYS, max_size=20),
    subs=st.lists(st.integers(0, 2**40), max_size=22),
)
def test_the_compiled_entry_of_keys_is_the_python_one(
    waiting: dict[bytes, Subscribers], sending: set[bytes], keys: list[bytes], subs: list[int]
) -> None:
    py_waiting, c_waiting = copy.deepcopy(waiting), copy.deepcopy(waiting)
    lists = {key: value for key, value in c_waiting.items() if isinstance(value, list)}
    got = C.enter_keys(c_waiting, set(sending), keys, subs)
    assert got == enter_keys(py_waiting, set(sending), keys, subs)
    assert c_waiting == py_waiting
    for key, value in lists.items():  # (lists already there grow in place)
        assert c_waiting[key] is value


@needs_build
def test_the_compiled_entry_of_keys_fails_as_the_python_one() -> None:
    for bad_keys in ([[1]], [b"a", {}]):
        with pytest.raises(TypeError):
            enter_keys({}, set(), bad_keys, [1, 2])  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            C.enter_keys({}, set(), bad_keys, [1, 2])
    with pytest.raises(TypeError):
        C.enter_keys({}, [], [b"a"], [1])  # (sending is a set)
    with pytest.raises(TypeError):
        C.enter_keys([], set(), [b"a"], [1])  # (waiting is a dict)


def test_the_table_runs_the_path_its_environment_asks_for() -> None:
    from aio_mclookup import _native

    built = importlib.util.find_spec(TABLE_C) is not None
    assert (table_module._C is not None) == (built and not _native.disabled())


@needs_build
@settings(max_examples=400, deadline=None)
@given(
    waiting=_WAITING,
    sending=st.sets(_KEYS),
    cached=st.dictionaries(_KEYS, st.floats(1.0, 9.0)),
    answering=st.dictionaries(_KEYS, st.sampled_from([0.0, 2.5])),
    keys=st.lists(_KEYS, max_size=20),
    as_range=st.booleans(),
    as_array=st.booleans(),
)
def test_the_compiled_subscription_is_the_python_one(
    waiting: dict[bytes, Subscribers], sending: set[bytes], cached: dict[bytes, float],
    answering: dict[bytes, float], keys: list[bytes], as_range: bool, as_array: bool,
) -> None:
    base = 5 << 32
    subs: range | list[int] = range(base, base + len(keys))
    if not as_range:
        subs = list(subs)
    outs = []
    for subscribe in (C.subscribe, table_module.subscribe_keys):
        table = copy.deepcopy(waiting)
        present: Any = np.zeros(len(keys)) if as_array else [0.0] * len(keys)
        got = subscribe(table, set(sending), cached, answering, keys, subs, present, base)
        outs.append((got, table, list(present)))
    assert outs[0] == outs[1]
    to_send, fresh, shared, hits, just_answered = outs[0][0]
    assert hits + just_answered + fresh + shared == len(keys)
    assert hits == sum(key in cached for key in keys)
    assert fresh <= len(to_send) <= fresh + shared  # (the new keys, and joined queued ones)


class _Lookup:
    def __init__(self, size: int, done: bool, as_array: bool) -> None:
        self.done = done
        self.round_present: Any = np.zeros(size) if as_array else [0.0] * size
        self.waiting = size


@needs_build
@settings(max_examples=400, deadline=None)
@given(
    owners=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3), max_size=16),
    done=st.sets(st.integers(1, 4)),
    missing=st.sets(st.integers(1, 4)),
    as_array=st.booleans(),
    answers=st.lists(st.sampled_from([0.0, 1.0, 7.5]), min_size=16, max_size=16),
)
def test_the_compiled_fan_out_is_the_python_one(
    owners: list[list[int]], done: set[int], missing: set[int], as_array: bool,
    answers: list[float],
) -> None:
    """Keys with one subscriber or several (lookups 1-4, some done, some gone): the same
    answers land at the same positions, the same counts, the same ready lookups in order."""
    keys = [b"k%d" % i for i in range(len(owners))]
    results = []
    for fan in (C.fan_out, table_module.fan_out):
        positions = {ident: 0 for ident in range(1, 5)}
        waiting: dict[bytes, Subscribers] = {}
        for key, idents in zip(keys, owners):
            subs = []
            for ident in idents:
                subs.append(ident << 32 | positions[ident])
                positions[ident] += 1
            waiting[key] = subs[0] if len(subs) == 1 else subs
        waiting[b"other"] = 1 << 32  # (not answered: stays)
        lookups = {
            ident: _Lookup(positions[ident], ident in done, as_array)
            for ident in range(1, 5) if ident not in missing
        }
        ready = fan(waiting, lookups, keys, answers)
        results.append((
            [next(i for i, lk in lookups.items() if lk is r) for r in ready],
            {i: (list(lk.round_present), lk.waiting) for i, lk in lookups.items()},
            waiting,
        ))
    assert results[0] == results[1]
    ready_idents, states, left = results[0]
    assert left == {b"other": 1 << 32}
    for ident in ready_idents:
        assert states[ident][1] == 0 and ident not in done


@needs_build
def test_the_compiled_fan_out_fails_as_the_python_one() -> None:
    lookup = _Lookup(1, False, False)
    for fan in (C.fan_out, table_module.fan_out):
        with pytest.raises(IndexError):  # (a position past the round's answers)
            fan({b"k": 1 << 32 | 3}, {1: lookup}, [b"k"], [1.0])
        with pytest.raises(TypeError):
            fan({b"k": "not a subscriber"}, {1: lookup}, [b"k"], [1.0])


@needs_build
def test_the_compiled_subscription_fails_as_the_python_one_and_leaves_the_table() -> None:
    """An answer for a position past the round's (either end) raises IndexError on both paths,
    before any key of the round enters the table."""
    base = 5 << 32
    for present in ([0.0] * 4, np.zeros(4)):
        for subscribe in (C.subscribe, table_module.subscribe_keys):
            waiting: dict[bytes, Subscribers] = {}
            with pytest.raises(IndexError):  # (b"k0" is open; b"k1" cached, at position -6)
                subscribe(waiting, set(), {b"k1": 1.0}, {}, [b"k0", b"k1"], [base, base - 6],
                          present, base)
            assert waiting == {} and list(present) == [0.0] * 4


@needs_build
def test_the_compiled_kernels_read_snapshots_of_what_python_code_may_change() -> None:
    """Python code run from inside a kernel (a subscriber's append, a lookup's property) may
    change the caller's containers: the kernel reads what it was given, and holds what it uses."""
    base = 5 << 32
    keys = [b"k%d" % i for i in range(4)]

    class Shrinking(list[int]):
        def append(self, sub: int) -> None:
            del keys[:]

    got = C.subscribe({b"k0": Shrinking()}, set(), {}, {}, keys, list(range(base, base + 4)),
                      [0.0] * 4, base)
    assert got[1:] == (3, 1, 0, 0)
    lookups: dict[int, Any] = {}

    class Leaving:
        def __init__(self) -> None:
            self.round_present = [0.0]
            self.waiting = 1

        @property
        def done(self) -> bool:
            lookups.clear()  # (its only other reference)
            return False

    lookups[5] = Leaving()
    ready = C.fan_out({b"a": base}, lookups, [b"a"], [1.0])
    assert len(ready) == 1 and ready[0].round_present == [1.0] and ready[0].waiting == 0


def _joined(subscribers: Subscribers) -> bool:
    return isinstance(subscribers, list)


@needs_build
@settings(max_examples=400, deadline=None)
@given(
    waiting=_WAITING,
    sending=st.sets(_KEYS),
    abandoned=st.sets(_KEYS),
    keys=st.lists(_KEYS, max_size=20),
    pos=st.integers(0, 22),
    width=st.integers(0, 22),
    room=st.integers(0, 22),
)
def test_the_compiled_reading_of_a_queued_round_is_the_python_one(
    waiting: dict[bytes, Subscribers], sending: set[bytes], abandoned: set[bytes],
    keys: list[bytes], pos: int, width: int, room: int,
) -> None:
    abandoned &= set(waiting)  # (only keys in the table are abandoned)
    outs = []
    for read in (C.unsent, unsent):
        tables = copy.deepcopy(waiting), set(sending), set(abandoned)
        got = read(*tables, keys, pos, pos + width, room, _joined)
        outs.append((got, tables))
    assert outs[0] == outs[1]
    (kept, end, dropped), (after, now_sending, _) = outs[0]
    assert len(kept) == len(set(kept)) <= min(width, room)
    assert end == len(keys) or len(kept) == min(width, room) or pos > len(keys)
    assert set(kept) <= now_sending and not set(kept) & sending
    assert dropped == len(waiting) - len(after)


@needs_build
def test_the_compiled_reading_fails_as_the_python_one() -> None:
    def broken(_: Subscribers) -> bool:
        raise RuntimeError("no")

    for read in (C.unsent, unsent):
        with pytest.raises(RuntimeError):
            read({b"a": 1}, set(), {b"a"}, [b"a"], 0, 1, 1, broken)
        with pytest.raises(TypeError):
            read({b"a": 1}, set(), set(), [[1]], 0, 1, 1, everyone)  # (unhashable key)
    with pytest.raises(TypeError):
        C.unsent({}, [], set(), [b"a"], 0, 1, 1, everyone)  # (sending is a set)


@needs_build
def test_the_compiled_reading_reads_a_key_again_after_python_code_ran() -> None:
    """Dropping an abandoned key compares it with the set's others, which may run Python code
    that takes the key out of ``waiting``: both readings then raise ``KeyError``, as reading
    ``waiting[key]`` does."""
    key = b"k" * 8

    class Evil:
        def __init__(self, waiting: dict[bytes, Subscribers]) -> None:
            self.waiting, self.armed = waiting, False

        def __hash__(self) -> int:
            return hash(key)

        def __eq__(self, other: object) -> bool:
            if self.armed:
                self.waiting.pop(key, None)
            return False

    for read in (C.unsent, unsent):
        waiting: dict[bytes, Subscribers] = {key: 10**12}
        evil = Evil(waiting)
        abandoned: set[Any] = {evil, key}
        evil.armed = True
        with pytest.raises(KeyError):
            read(waiting, set(), abandoned, [key], 0, 1, 1, everyone)


@needs_build
def test_the_compiled_reading_refuses_what_the_python_one_refuses() -> None:
    for read in (C.unsent, unsent):
        with pytest.raises(ValueError, match="pos"):
            read({b"a": 1}, set(), set(), [b"a"], -1, 1, 1, everyone)
        with pytest.raises((TypeError, AttributeError)):  # (sending must be a set)
            read({b"a": 1}, frozenset(), set(), [b"a"], 0, 1, 1, everyone)
