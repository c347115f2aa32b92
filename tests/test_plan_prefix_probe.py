"""A lone full-attention group probed in rounds (``aio_mclookup._plan.rounds``): the compiled
prefix mode (``_prefix_probe_c.PrefixProbe``) against :class:`ProbeState`'s, step by step on the
same random plans, windows, answers and orders: the same keys handed out, the same known
prefix, scouts, hit and result after every step, including answers out of order (which leave
prefix mode). (The hits themselves are checked against vLLM's and SGLang's rules in
``test_hits.py``, ``test_hits_v033.py`` and the conformance tests, on whichever path the
process has.)
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import random
import sys
from typing import Any

import numpy as np
import pytest

import aio_mclookup as mcl
from aio_mclookup._plan import rounds
from aio_mclookup._plan.probing import ProbeState
from aio_mclookup._resolve.answers import first_false

PREFIX_PROBE = "aio_mclookup._plan._prefix_probe_c"
C_PROBE: Any = (
    importlib.import_module(PREFIX_PROBE) if importlib.util.find_spec(PREFIX_PROBE) else None
)
needs_build = pytest.mark.skipif(C_PROBE is None, reason="the C extension is not built")
if C_PROBE is not None and rounds._C is None:  # (this process runs pure Python: the twin is
    rounds.configure(C_PROBE)  # compared all the same)

LAYOUTS: list[mcl.KVLayout | mcl.SGLangLayout] = [
    mcl.KVLayout([mcl.FullAttention(16)], model="m", hash_block_size=16,
                 scheduler_block_size=16, vllm_version="0.26"),
    mcl.KVLayout([mcl.FullAttention(32)], model="m", hash_block_size=16,
                 scheduler_block_size=32, tp_size=2, num_kv_heads=2, vllm_version="0.26",
                 use_eagle=True),
    mcl.KVLayout([mcl.FullAttention(16)], model="m", hash_block_size=16,
                 scheduler_block_size=16),
    mcl.KVLayout([mcl.FullAttention(16)], model="m", hash_block_size=16,
                 scheduler_block_size=16, tp_size=4, num_kv_heads=4),
    mcl.SGLangLayout(sglang_version="0.5.23", page_size=4, prefetch_threshold=12),
    mcl.SGLangLayout(sglang_version="0.5.23", page_size=16, model_name="m", tp_size=2),
]


def _plan(rng: random.Random, layout: mcl.KVLayout | mcl.SGLangLayout) -> Any:
    if isinstance(layout, mcl.SGLangLayout):
        tokens = [rng.randrange(50_000) for _ in range(rng.choice([3, 40, 200, 700]))]
        return layout.plan(len(tokens), layout.page_hashes(tokens))
    blocks = rng.choice([1, 2, 7, 30, 90])
    hashes = [bytes([i % 251, i // 251]) * 16 for i in range(blocks)]
    return layout.plan(layout.align(blocks * 16 + rng.choice([0, 1, 5])), hashes)


def _snapshot(state: Any) -> tuple[Any, ...]:
    positions, answers = state.answered_ahead
    return (state.hit, state.rounds, state.known_prefix, state.all_at_once,
            state.leading_known(0) if state.plan.groups else None,
            list(positions), [bool(a) for a in answers], state.result)


def _keys(indices: Any) -> list[int]:
    return [int(i) for i in indices]


def _drive(state: Any, plan: Any, seed: int) -> list[Any]:
    """Drive ``state`` through a random run fixed by ``seed``; return everything observed."""
    rng = random.Random(seed)
    k = len(plan.geometry.namespaces)
    odds = rng.choice([0.5, 0.9, 0.99])
    present_chunks = [rng.random() < odds for _ in range(plan.num_keys // k + 1)]
    trace: list[Any] = [_snapshot(state)]
    for _ in range(40):
        action = rng.random()
        if action < 0.08 and plan.num_keys:  # a cache's run of present chunks somewhere
            start = rng.randrange(plan.num_keys // k) * k
            count = rng.randrange(0, (plan.num_keys - start) // k + 1) * k
            if rng.random() < 0.6 and state.known_prefix is not None:  # usually at the prefix
                start = plan.groups[0].key_offset + min(state.known_prefix * k, plan.num_keys)
                count = min(count, plan.num_keys - start)
            state.record_present(range(start, start + count))
            trace.append(("present", _snapshot(state)))
            continue
        window = rng.choice([None, 1, 2, 3, 8, 9, 16, 33, 0])
        keys = state.next_keys(window)
        trace.append(("next", window, _keys(keys), _snapshot(state)))
        if not len(keys):
            if state.hit is not None:
                break
            continue
        if rng.random() < 0.1:  # a round never recorded (its lookup went away)
            continue
        values = [present_chunks[(int(i) - plan.groups[0].key_offset) // k] for i in keys]
        if rng.random() < 0.05:  # one namespace's key missing
            values[rng.randrange(len(values))] = False
        unit = 1
        if k > 1 and rng.random() < 0.3:  # one answer per chunk (the coordinator's items)
            unit = k
            values = [all(values[at : at + k]) for at in range(0, len(values), k)]
        kind = rng.choice(["floats", "bools", "array", "bool array", "strided", "ints"])
        answers: Any = (
            [1.5 if v else 0.0 for v in values] if kind == "floats"
            else values if kind == "bools"
            else np.array([2.0 if v else 0.0 for v in values]) if kind == "array"
            else np.array(values, dtype=bool) if kind == "bool array"
            else np.repeat(np.array([3.0 if v else -0.0 for v in values]), 2)[::2]
            if kind == "strided"
            else [int(v) for v in values]
        )
        if rng.random() < 0.08 and len(keys) > k:  # answers out of order: a later part first
            cut = rng.randrange(1, len(keys) // k) * k
            later = np.asarray(_keys(keys)[cut:], dtype=np.int64)
            state.record(later, answers[cut // unit :], unit)
            trace.append(("late", _snapshot(state)))
            state.record(np.asarray(_keys(keys)[:cut], dtype=np.int64), answers[: cut // unit],
                         unit)
        else:
            state.record(keys, answers, unit)
        trace.append(("record", _snapshot(state)))
    return trace


@needs_build
@pytest.mark.parametrize("seed", range(400))
def test_compiled_prefix_mode_is_probe_states(seed: int) -> None:
    rng = random.Random(seed)
    layout = LAYOUTS[seed % len(LAYOUTS)]
    plan = _plan(rng, layout)
    if not plan.single_full_attention or plan.probe_in_one_round:  # (no keys: nothing to
        assert not plan.num_keys and type(rounds.probe_state(plan)) is ProbeState  # probe)
        return
    reference = ProbeState(plan)
    assert reference.known_prefix is not None or not plan.groups
    compiled = C_PROBE.PrefixProbe(plan)
    assert _drive(compiled, plan, seed) == _drive(reference, plan, seed)


@needs_build
def test_probe_state_picks_the_compiled_prefix_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = LAYOUTS[0]
    plan = layout.plan(160, [bytes([i]) * 32 for i in range(10)])
    monkeypatch.setattr(rounds, "_C", C_PROBE)
    assert type(rounds.probe_state(plan)) is C_PROBE.PrefixProbe
    assert type(rounds.probe_state(plan, rounds=False)) is ProbeState  # (one round)
    monkeypatch.setattr(rounds, "_C", None)
    assert type(rounds.probe_state(plan)) is ProbeState


@needs_build
def test_leaving_prefix_mode_hands_over_to_a_general_state() -> None:
    layout = LAYOUTS[0]
    plan = layout.plan(160, [bytes([i]) * 32 for i in range(10)])
    compiled, reference = C_PROBE.PrefixProbe(plan), ProbeState(plan)
    for state in (compiled, reference):
        assert _keys(state.next_keys(None)) == list(range(10))
        state.record(np.array([6, 7]), [True, True])  # chunks 6 and 7 first
        assert state.known_prefix is None
        state.record(range(0, 6), [True, True, True, False, True, True])
        assert not len(state.next_keys(None))
    assert compiled.hit == reference.hit == plan.prefix_hit(3)
    assert compiled.result == reference.result


@needs_build
def test_errors_raise_through(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(Exception):
        pass

    def prefix_hit(self: Any, chunks: int) -> int:
        raise Broken

    layout = LAYOUTS[0]
    plan = layout.plan(160, [bytes([i]) * 32 for i in range(10)])
    state = C_PROBE.PrefixProbe(plan)
    state.next_keys(4)
    with pytest.raises(TypeError, match="no truth"):  # (an answer's truth, read in C)
        state.record(range(0, 4), [1.0, _NoTruth(), 0.0, 1.0])
    monkeypatch.setattr(type(plan), "prefix_hit", prefix_hit)
    with pytest.raises(Broken):
        state.record(range(0, 4), [1.0, 1.0, 0.0, 1.0])
    assert state.hit is None


@needs_build
def test_odd_plans_are_refused() -> None:
    with pytest.raises(TypeError):
        C_PROBE.PrefixProbe()
    with pytest.raises(AttributeError):
        C_PROBE.PrefixProbe(object())


class _NoTruth:
    def __bool__(self) -> bool:
        raise TypeError("no truth")


def _small_plan() -> Any:
    return LAYOUTS[0].plan(160, [bytes([i]) * 32 for i in range(10)])


@needs_build
@pytest.mark.parametrize("window", [sys.maxsize, 2**70, math.inf, math.nan, 10.0, -3, 0, True])
def test_any_window_is_probe_states(window: Any) -> None:
    plan = _small_plan()
    outs = []
    for state in (C_PROBE.PrefixProbe(plan), ProbeState(plan)):
        state.record_present(range(0, 2))  # (a prefix known: start + window past any bound)
        try:
            outs.append(_keys(state.next_keys(window)))
        except TypeError as exc:
            outs.append(type(exc))
    assert outs[0] == outs[1]


@needs_build
def test_first_false_reads_arrays_as_truth_values() -> None:
    for values in ([1.0, -1.0, 0.0, 1.0], [1.0, math.nan, 0.0, 1.0], [2, -1, 0]):
        assert first_false(np.array(values)) == 2 == first_false(values)
    plan = _small_plan()
    states = [C_PROBE.PrefixProbe(plan), ProbeState(plan)]
    for state in states:
        state.next_keys(4)
        state.record(range(0, 4), np.array([1.0, -2.0, 0.0, 1.0]))
    assert states[0].known_prefix == states[1].known_prefix == 2


@needs_build
def test_uninitialised_or_refused_states_raise() -> None:
    state = C_PROBE.PrefixProbe.__new__(C_PROBE.PrefixProbe)
    assert state.plan is None
    for read in (lambda: state.hit, lambda: state.answered_ahead, lambda: state.next_keys(),
                 lambda: state.record_present(range(4)), lambda: state.record(range(1), [1])):
        with pytest.raises(RuntimeError, match="not initialised"):
            read()
    ready = C_PROBE.PrefixProbe(_small_plan())
    with pytest.raises(AttributeError):
        ready.__init__(object())
    with pytest.raises(RuntimeError, match="not initialised"):
        ready.next_keys()
    hybrid = mcl.KVLayout([mcl.FullAttention(16), mcl.SlidingWindow(16, 32)], model="m",
                          hash_block_size=16, scheduler_block_size=16)
    with pytest.raises(ValueError, match="one group"):
        C_PROBE.PrefixProbe(hybrid.plan(160, [bytes([i]) * 32 for i in range(10)]))
    with pytest.raises(MemoryError):  # (a unit past any list's size)
        C_PROBE.PrefixProbe(_small_plan()).record(range(4), [1.0] * 4, 2**62)


@needs_build
def test_odd_records_are_probe_states() -> None:
    plan = LAYOUTS[0].plan(1600, [bytes([i]) * 32 for i in range(100)])
    outs = []
    for state in (C_PROBE.PrefixProbe(plan), ProbeState(plan)):
        keys = state.next_keys(8)
        assert len(keys) > 8  # (a window with scouts)
        with pytest.raises(IndexError):  # answers past the keys
            state.record(keys, [1.0] * (len(keys) + 1))
        done = ProbeState(plan) if isinstance(state, ProbeState) else C_PROBE.PrefixProbe(plan)
        done.next_keys(None)
        done.record(range(100), [1.0] * 100)
        done.record_present([0, 1])  # (settled: a list is read as Python reads it)
        done.record_present(np.arange(0))
        outs.append((_snapshot(state), _snapshot(done)))
    assert outs[0] == outs[1]


@needs_build
def test_reading_the_keys_may_leave_prefix_mode() -> None:
    """Python code run while the compiled state reads a round's scouts (a key list's
    ``__getitem__``) may record answers out of order: it leaves prefix mode without crashing.
    (ProbeState reads the scouts through a slice, which runs no such code.)"""

    class Keys(list):  # type: ignore[type-arg]
        def __getitem__(self, index: Any) -> Any:
            if index == 9 and not done:
                done.append(True)
                state.record(np.array([60, 61]), [True, True])
            return super().__getitem__(index)

    plan = LAYOUTS[0].plan(1600, [bytes([i]) * 32 for i in range(100)])
    state = C_PROBE.PrefixProbe(plan)
    done: list[bool] = []
    keys = Keys(_keys(state.next_keys(8)))
    state.record(keys, [True] * len(keys))
    assert done and state.known_prefix is None and state.hit is None
