"""Probing a vLLM 0.32 / 0.33 plan in rounds (``aio_mclookup._plan.probing_era_c``): the
compiled bookkeeping of a round (``_probing_c``: the unit masks a state starts from,
:meth:`EraCProbeState.record` and the key indices :meth:`EraCProbeState.next_keys` hands out)
against the Python code, round by round on
the same random plans and answers: the same keys asked, the same arrays after every round, the
same result. (The rounds' results are checked against the literal 0.33 oracle
in ``test_hits_v033.py``, on whichever path the process has.)
"""

from __future__ import annotations

import importlib
import importlib.util
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import aio_mclookup as mcl
from aio_mclookup._plan import probing_era_c
from aio_mclookup._plan.probing_era_c import EraCProbeState
from aio_mclookup._plan.rounds import probe_state
from test_hits_v033 import Request, requests

PROBING_C = "aio_mclookup._plan._probing_c"
C_PROBING: Any = importlib.import_module(PROBING_C) if importlib.util.find_spec(PROBING_C) else None
needs_build = pytest.mark.skipif(C_PROBING is None, reason="the C extension is not built")


def _arrays(state: EraCProbeState) -> list[list[bool]]:
    return [a.tolist() for part in (state._answered, state._present, state._known_units,
                                    state._maybe_units) for a in part]


def _rounds(plan: mcl.LookupPlan, answers: list[bool], window: int | None, as_list: bool,
            compiled: bool, monkeypatch: pytest.MonkeyPatch, unit: int = 1) -> list[Any]:
    """Every round's keys, the arrays after it, and how it ended (compiled: every round
    recorded in C). With ``unit``, one answer per ``unit`` keys (a chunk's keys in every
    namespace, as the coordinator gives them: present when every key is)."""
    taken: list[bool] = []

    def record(*args: Any) -> bool:
        taken.append(C_PROBING.record(*args))
        return taken[-1]

    def keys_of(*args: Any) -> bytes | None:
        keys: bytes | None = C_PROBING.keys_of(*args)
        taken.append(keys is not None)
        return keys

    def unit_masks(*args: Any) -> bool:
        taken.append(C_PROBING.unit_masks(*args))
        return taken[-1]

    twin = SimpleNamespace(record=record, keys_of=keys_of, unit_masks=unit_masks)
    monkeypatch.setattr(probing_era_c, "_C", twin if compiled else None)
    state = probe_state(plan)
    trace: list[Any] = []
    if not isinstance(state, EraCProbeState):
        return trace
    present = np.array(answers, dtype=bool)
    for _ in range(plan.num_keys + 2):
        try:
            idx = state.next_keys(window)
        except mcl.InvalidRequest as exc:
            return [*trace, ("raises", str(exc))]
        got = list(idx)
        trace.append(got)
        if not got:
            break
        given_answers: Any = present[got].reshape(-1, unit).all(axis=1)
        given_answers = (given_answers * 7.5).tolist() if as_list else given_answers * 7.5
        state.record(idx, given_answers, unit)
        trace.append(_arrays(state))
    assert all(taken)
    return [*trace, state.hit]


@needs_build
@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(request=requests())
def test_the_compiled_rounds_go_as_the_python_ones_do(request: Request) -> None:
    cfg, num_tokens, hashes, _, seed = request
    layout = mcl.KVLayout.from_dict(cfg)
    try:
        plan = layout.plan(num_tokens, hashes)
    except mcl.InvalidRequest:
        return
    rng = random.Random(seed)
    answers = [rng.random() < 0.8 for _ in range(plan.num_keys)]
    with pytest.MonkeyPatch.context() as monkeypatch:
        units = sorted({1, plan._chunk_keys})  # (per key, and per item where it has them)
        for window in (None, 1, 8):
            for as_list in (True, False):
                for unit in units:
                    compiled = _rounds(plan, answers, window, as_list, True, monkeypatch, unit)
                    pure = _rounds(plan, answers, window, as_list, False, monkeypatch, unit)
                    assert compiled == pure


@needs_build
def test_the_compiled_record_hands_back_what_it_does_not_take() -> None:
    codes = np.array([(0, 2, 2)], dtype=np.int64).tobytes()
    answered, present = (np.zeros(2, dtype=bool),), (np.zeros(2, dtype=bool),)
    units = (np.array([1, 3], dtype=np.int64),)
    known, maybe = (np.zeros(4, dtype=bool),), (np.ones(4, dtype=bool),)
    keys = np.array([2, 3], dtype=np.int64)
    args = (answered, present, units, known, maybe)
    assert C_PROBING.record(codes, keys, [1.0, 0.0], *args) is True
    assert answered[0].tolist() == [False, True] and present[0].tolist() == [False, False]
    assert known[0].tolist() == [False, False, False, True]
    assert maybe[0].tolist() == [True, True, True, False]
    assert C_PROBING.record(codes, keys, np.array([2.0, 1.0]), *args) is True
    assert present[0].tolist() == [False, True] and maybe[0][3]
    # Not whole positions, a position past the probes, answers of another kind: nothing done.
    assert C_PROBING.record(codes, keys[:1], [1.0], *args) is False
    assert C_PROBING.record(codes, np.array([4, 5]), [1.0, 1.0], *args) is False
    assert C_PROBING.record(codes, keys, ["yes", 1.0], *args) is False
    assert C_PROBING.record(codes, keys, [1.0], *args) is False
    frozen = np.zeros(2, dtype=bool)
    frozen.flags.writeable = False
    assert C_PROBING.record(codes, keys, [1.0, 1.0], (frozen,), *args[1:]) is False
    # One answer per unit of keys: a position's 2 keys as one answer; not whole units: refused.
    assert C_PROBING.record(codes, keys, [0.0], *args, 2) is True
    assert present[0].tolist() == [False, False] and not maybe[0][3]
    assert C_PROBING.record(codes, keys, np.array([True]), *args, 2) is True
    assert present[0].tolist() == [False, True] and maybe[0][3]
    assert C_PROBING.record(codes, keys, [1.0, 1.0], *args, 2) is False
    assert C_PROBING.record(codes, keys, [1.0], *args, 3) is False
    assert C_PROBING.record(codes, keys, [1.0], *args, 0) is False
    for odd in (-2, 2**62, 2**64, 2.0, "2", None):  # (not a unit it takes: not recorded)
        assert C_PROBING.record(codes, keys, [1.0], *args, odd) is False


@needs_build
def test_unit_masks_set_every_unit_known_but_the_probed_ones() -> None:
    both = np.empty((2, 2, 5), dtype=bool)
    known, maybe = tuple(both[0]), tuple(both[1])
    units = (np.array([1, 3], dtype=np.int64), np.array([], dtype=np.int64))
    assert C_PROBING.unit_masks(known, maybe, units) is True
    assert both[0].tolist() == [[True, False, True, False, True], [True] * 5]
    assert both[1].tolist() == [[False, True, False, True, False], [False] * 5]
    # A unit past the arrays, a group short, a read-only array: nothing written.
    both[:] = False
    assert C_PROBING.unit_masks(known, maybe, (units[0], np.array([5]))) is False
    assert C_PROBING.unit_masks(known, maybe, units[:1]) is False
    frozen = np.zeros(5, dtype=bool)
    frozen.flags.writeable = False
    assert C_PROBING.unit_masks((known[0], frozen), maybe, units) is False
    assert not both.any()


@needs_build
def test_keys_of_maps_units_to_their_keys() -> None:
    codes = np.array([(0, 1, 3), (3, 2, 2)], dtype=np.int64).tobytes()
    units = (np.array([0, 2, 4], dtype=np.int64), np.array([1, 3], dtype=np.int64))
    found = [np.array([2, 4], dtype=np.int64), np.array([3], dtype=np.int64)]
    keys = C_PROBING.keys_of(codes, found, units)
    assert np.frombuffer(keys, np.int64).tolist() == [1, 2, 5, 6]
    assert C_PROBING.keys_of(codes, found[:1], units) is None  # (a group short)
    overlapping = np.array([(0, 1, 3), (1, 2, 2)], dtype=np.int64).tobytes()
    late = [np.array([4], dtype=np.int64), np.array([1], dtype=np.int64)]
    assert C_PROBING.keys_of(overlapping, late, units) is None  # (keys 2, then 1: not ascending)


@needs_build
def test_what_the_second_review_found() -> None:
    """Inputs an independent review found the first bookkeeping twin took otherwise than the
    Python code: now handed back."""
    huge = np.array([(0, 2**61, 1)], dtype=np.int64).tobytes()  # (a namespace count past any)
    one = (np.array([0], dtype=np.int64),)
    assert C_PROBING.keys_of(huge, [np.array([0], dtype=np.int64)], one) is None
    # A round of no units (a window of 0): the Python code says what it is (it raises).
    layout = mcl.KVLayout([mcl.FullAttention(4), mcl.SlidingWindow(4, sliding_window=8)],
                          model="m", hash_block_size=4, scheduler_block_size=4)
    plan = layout.plan(32, [b"h%d" % i for i in range(8)])
    with pytest.raises(ValueError):
        probe_state(plan).next_keys(0)
    codes = np.array([(2, 1, 3)], dtype=np.int64).tobytes()
    arrays = ((np.zeros(3, dtype=bool),), (np.zeros(3, dtype=bool),),
              (np.arange(3, dtype=np.int64),), (np.zeros(3, dtype=bool),),
              (np.zeros(3, dtype=bool),))
    assert C_PROBING.record(codes, np.array([-2**63], dtype=np.int64), [1.0], *arrays) is False


def test_merged_units_are_the_union_ascending_each_once() -> None:
    from aio_mclookup._plan.probing_era_c import _merged

    rng = np.random.default_rng(3)
    for _ in range(200):
        a = np.unique(rng.integers(0, 40, rng.integers(0, 8)))
        b = np.unique(rng.integers(0, 40, rng.integers(0, 8)))
        assert _merged(a, b).tolist() == np.union1d(a, b).tolist()
