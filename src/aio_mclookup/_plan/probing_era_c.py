"""Probing a vLLM 0.32 / 0.33 plan in rounds (:class:`EraCProbeState`, pure: no I/O, no
clock): every plan but a lone block-aligned full-attention group probed in rounds, which
probes its prefix (:class:`~.probing.ProbeState`'s prefix mode)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import _native
from .._arrays import EMPTY, BoolArray, IntArray, KeyIndices
from .._errors import Error
from .._layout.groups import FullAttention
from .._resolve.era_c import era_c_partial
from .._resolve.result import LookupResult
from .era_c import EraCPlan
from .probing import SCOUT_WINDOW, SCOUTS, ProbeState, group_answers, per_key, position_keys

__all__ = ["EraCProbeState"]

_C: Any = _native.load("aio_mclookup._plan._probing_c")
"""The compiled bookkeeping of a round (``_probing_c.c``: the unit masks a state starts from,
:meth:`EraCProbeState.record` and the key indices :meth:`EraCProbeState.next_keys` hands
out), or ``None``."""


class EraCProbeState(ProbeState):
    """Probe a vLLM 0.32 / 0.33 plan in rounds, sending only keys that can change its
    :class:`LookupResult` (hit and tail-key boundaries).

    Each round runs vLLM's search on what is known so far, unknown keys counting as present
    (:func:`~.._resolve.era_c.era_c_partial`): the unknown hash units its answer rests on (the
    full-attention prefix up to the first miss, each other group's window at the running
    hit, the tail keys at the hit) are probed next, at most ``window`` per spec-group, and
    only full attention's while it is unsettled (a full-attention window also carries scouts,
    as :class:`~.probing.ProbeState`'s prefix mode does). Once nothing unknown is read, the
    result is the one vLLM computes from every key. Plans that cannot follow vLLM in rounds
    (too few hashes for the length, repeated hashes, or rounds off) send every key in one
    round.

    Per store group it keeps, by probe position (a probed chunk, or hash unit in fine-grained
    mode), whether the position is answered and present (the parent's arrays), and the same
    by hash unit for the search.
    """

    __slots__ = ("_flat_keys", "_groups_codes", "_known_units", "_maybe_units")

    plan: EraCPlan

    def __init__(self, plan: EraCPlan, rounds: bool = True) -> None:
        super().__init__(plan, rounds)  # (per group and position: _answered, _present)
        self._groups_codes: bytes | None = None  # (see _codes)
        self._flat_keys: tuple[BoolArray, BoolArray] | None = None
        """One-round mode: (answered, present) per key."""
        if self._all_at_once:
            self._flat_keys = (
                np.zeros(plan.num_keys, dtype=bool), np.zeros(plan.num_keys, dtype=bool)
            )
        # Per store group, by hash index: known yet, and present or unknown. A unit the group
        # does not probe is known absent (vLLM's presence set holds only probed keys; plans
        # whose hashes repeat are not probed in rounds).
        self._known_units: tuple[BoolArray, ...] = ()
        self._maybe_units: tuple[BoolArray, ...] = ()
        if not self._all_at_once:  # (one array for every group of both: one allocation)
            both = np.empty((2, len(plan._units), plan._hash_count), dtype=bool)
            known, maybe = tuple(both[0]), tuple(both[1])
            if _C is None or not _C.unit_masks(known, maybe, plan._units):
                both[0] = True
                for row, units in zip(both[0], plan._units):
                    row[units] = False
                np.logical_not(both[0], out=both[1])
            self._known_units = known
            self._maybe_units = maybe

    def _codes(self) -> bytes:
        """Per group its key offset, namespaces and positions, as ``_probing_c`` reads them."""
        codes = self._groups_codes
        if codes is None:
            plan = self.plan
            prefixes = plan.geometry.prefix_bytes
            codes = self._groups_codes = np.array(
                [(p.key_offset, len(prefixes[p.group_id]), p.chunks.size) for p in plan.groups],
                dtype=np.int64,
            ).tobytes()
        return codes

    def _settle(self, result: LookupResult) -> None:
        self._result = result
        self.hit = result.hit_length

    def next_keys(self, window: int | None = None, ahead: int | None = None) -> KeyIndices:
        """Key indices to probe next (ascending); empty once :attr:`hit` is set. ``window``
        caps the unknown units probed per spec-group this round (the lowest first).

        ``ahead`` marks a round testing a likely miss (the full-attention chunk after a
        known prefix, at ``window`` 1): it also probes what the next round would, with window
        ``ahead``, were this round's full-attention units absent (the other groups' windows
        at the hit that would leave), which saves a round trip when the miss is one and asks
        those keys for nothing when it is not; with full attention settled already, the
        round is simply one of window ``ahead``. The answers stay exact either way: every key
        asked is answered and recorded."""
        plan = self.plan
        if self.hit is not None:
            return EMPTY
        if not plan.num_keys:  # vLLM answers 0 without an RPC
            self._settle(LookupResult(0))
            return EMPTY
        if self._flat_keys is not None:
            answered, present = self._flat_keys
            if answered.all():
                self._settle(plan._resolve_present_result(present))
                return EMPTY
            self.rounds += 1
            return np.flatnonzero(~answered) if answered.any() else range(plan.num_keys)
        found = self._search(window)
        if isinstance(found, LookupResult):
            self._settle(found)
            return EMPTY
        if ahead is not None:
            found = self._and_next(found, ahead)
        self.rounds += 1
        if _C is not None:
            keys = _C.keys_of(self._codes(), found, plan._units)
            if keys is not None:
                return np.frombuffer(keys, np.int64)
        wanted: list[IntArray] = []
        prefixes = plan.geometry.prefix_bytes
        for probe, units, probed_units in zip(plan.groups, found, plan._units):
            if not units.size:
                continue
            k = len(prefixes[probe.group_id])
            wanted.append(position_keys(probe, np.searchsorted(probed_units, units), k))
        # Groups own disjoint key ranges and positions are unique: sorting is enough.
        return wanted[0] if len(wanted) == 1 else np.sort(np.concatenate(wanted))

    def _search(self, window: int | None) -> list[IntArray] | LookupResult:
        """vLLM's search on what is known: the hit, or the units it rests on that a round of
        ``window`` (with scouts past a wide one) asks (``era_c_partial``)."""
        plan = self.plan
        scouts = SCOUTS if window is not None and window >= SCOUT_WINDOW else 0
        return era_c_partial(
            plan.geometry, plan.num_tokens, self._maybe_units, self._known_units, window, scouts
        )

    def _and_next(self, found: list[IntArray], window: int) -> list[IntArray]:
        """A likely miss's round: ``found`` (the search's units at this round's window) and the
        units it would ask next, with ``window``, were the full-attention ones among them all
        absent (marked so while it runs, then unknown again). When full attention is settled
        already there is no likely miss to test: the round of ``window`` instead."""
        plan = self.plan
        groups = plan.geometry.groups
        marked = [
            (gid, units) for gid, units in enumerate(found)
            if units.size and isinstance(groups[gid], FullAttention)
        ]
        known, maybe = self._known_units, self._maybe_units
        try:
            for gid, units in marked:
                known[gid][units] = True
                maybe[gid][units] = False
            after = self._search(window)
        except Error:  # (vLLM would raise there: the rounds get to it, if it comes)
            return found
        finally:
            for gid, units in marked:
                known[gid][units] = False
                maybe[gid][units] = True
        if isinstance(after, LookupResult):
            return found
        if not marked:  # (the same search, a wider window: its units include found's)
            return after
        return [_merged(now, then) for now, then in zip(found, after)]

    def record(
        self,
        key_indices: KeyIndices,
        present: Sequence[object] | npt.NDArray[Any],
        unit: int = 1,
    ) -> None:
        """Record answers (truthy = present) for ascending key indices that cover whole
        probe positions (every namespace of their group): one per key, or with ``unit`` one
        per ``unit`` consecutive keys."""
        if self.hit is not None or not len(key_indices):
            return
        plan = self.plan
        if _C is not None and self._flat_keys is None:  # (False: not recorded there; the
            # Python below records them, or raises)
            indices = (
                np.arange(key_indices.start, key_indices.stop, dtype=np.int64)
                if isinstance(key_indices, range)
                else np.asarray(key_indices, dtype=np.int64)
            )
            if _C.record(
                self._codes(), indices, present, self._answered, self._present, plan._units,
                self._known_units, self._maybe_units, unit,
            ):
                return
        if unit > 1:
            present = per_key(present, unit)
        if self._flat_keys is not None:
            answered, known_present = self._flat_keys
            idx: slice | IntArray = (
                slice(key_indices.start, key_indices.stop)
                if isinstance(key_indices, range)
                else np.asarray(key_indices)
            )
            answered[idx] = True
            known_present[idx] = np.asarray(present, dtype=bool)
            return
        prefixes = plan.geometry.prefix_bytes
        counts = [len(prefixes[probe.group_id]) for probe in plan.groups]
        for group, pos, got in group_answers(plan.groups, counts, key_indices, present):
            self._answered[group][pos] = True
            self._present[group][pos] = got
            at = plan._units[group][pos]
            self._known_units[group][at] = True
            self._maybe_units[group][at] = got


def _merged(first: IntArray, second: IntArray) -> IntArray:
    """The units of two ascending arrays, ascending and each once (usually one is empty:
    ``np.union1d``'s cost per call is many times a round's)."""
    if not second.size:
        return first
    if not first.size:
        return second
    both = np.concatenate((first, second))
    both.sort()
    keep = np.empty(both.size, dtype=bool)
    keep[0] = True
    np.not_equal(both[1:], both[:-1], out=keep[1:])
    return both[keep]
