"""Probing in rounds: which of a plan's keys can still change its answer, given the answers so
far (:class:`ProbeState`, pure: no I/O, no clock)."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._arrays import EMPTY, BoolArray, IntArray, KeyIndices
from .._resolve.answers import first_false
from .._resolve.hits import longest_hit
from .._resolve.presence import merge
from .._resolve.result import LookupResult
from .plan import LookupPlan
from .probe import GroupProbe

__all__ = [
    "SCOUTS", "SCOUT_WINDOW", "ProbeState", "group_answers", "per_key", "position_keys",
]

SCOUT_WINDOW = 8
"""Prefix-mode rounds probing at least this many chunks also send scouts (see ProbeState)."""
SCOUTS = 4
"""Scouts a wide prefix-mode window carries: the last chunk of each quarter of the next."""


class ProbeState:
    """Probe a plan in rounds, sending only keys that can change the answer.

    :meth:`next_keys` runs vLLM's hit search on what is known so far, counting unknown chunks
    as present; the unknown chunks that answer rests on are probed next. Every hit rule is
    monotone, so once no answer rests on an unknown chunk the hit is exactly the one vLLM
    computes from all keys. Plans whose chunks share hashes are probed in one round, except a
    lone full-attention group (see :attr:`LookupPlan.probe_in_one_round`).

    A lone full-attention group (the common chat model) needs no search: its answer rests on
    the chunks after the known-present prefix, up to the first miss (*prefix mode*: two
    integers, the prefix and a bound). Each round probes a window of chunks after the prefix;
    a window of :data:`SCOUT_WINDOW` chunks or more also probes four *scouts*, the last chunk
    of each quarter of the next, twice as wide window. An absent scout bounds the first miss,
    so the next window stops there instead of running far past it (those keys would be
    wasted); a present scout is remembered with its answers, and a later window that covers
    it takes them from :attr:`answered_ahead` instead of probing it again.
    """

    __slots__ = (
        "_ahead", "_all_at_once", "_answered", "_bound", "_prefix", "_present",
        "_result", "_scouted", "_scouted_run", "answered_ahead", "hit", "plan", "rounds",
    )

    def __init__(self, plan: LookupPlan, rounds: bool = True) -> None:
        self.plan = plan
        self._all_at_once = not rounds or plan.probe_in_one_round
        self.hit: int | None = None
        self.rounds = 0
        self._prefix: int | None = None
        """Prefix mode: how many chunks from 0 are known present (None: the general search)."""
        self._bound = plan.groups[0].limit if plan.groups else 0
        """Prefix mode: the first chunk known absent (else the chunk count)."""
        self._scouted: IntArray | None = None
        """Prefix mode: the last key indices with scouts handed out, whose first
        ``_scouted_run`` are the window (so that :meth:`record` need not look for the end)."""
        self._scouted_run = 0
        self._ahead: list[tuple[int, list[Any]]] = []
        """Prefix mode: the chunks past the prefix that scouts found present (ascending), each
        with its keys' answers as recorded."""
        self.answered_ahead: tuple[list[int], list[Any]] = ([], [])
        """Positions in the last :meth:`next_keys` result whose keys are known present already
        (scouts of an earlier round), and their answers as recorded: the caller fills them in
        instead of probing them, and passes them back to :meth:`record` with the rest. Each
        is handed out once (a round that is never recorded probes them again)."""
        self._answered: tuple[BoolArray, ...] = ()  # per group (tuples: no GC tracking)
        self._present: tuple[BoolArray, ...] = ()
        self._result: LookupResult | None = None
        if plan.single_full_attention and not self._all_at_once:
            self._prefix = 0
        else:
            self._answered = tuple(np.zeros(p.chunks.size, dtype=bool) for p in plan.groups)
            self._present = tuple(np.zeros(p.chunks.size, dtype=bool) for p in plan.groups)

    @classmethod
    def leaving_prefix_mode(
        cls,
        plan: LookupPlan,
        rounds: int,
        prefix: int,
        bound: int,
        ahead_chunks: Sequence[int],
        answered_ahead: tuple[list[int], list[Any]],
    ) -> ProbeState:
        """The general state of a lone full-attention plan whose prefix mode (after
        ``rounds`` rounds: ``prefix``, ``bound``, the scouts' present chunks and the last
        hand-out) meets answers out of order: how the compiled prefix mode
        (``_prefix_probe_c.c``) hands over to this class."""
        state = cls(plan)
        state.rounds = rounds
        state._prefix, state._bound = prefix, bound
        state._ahead = [(chunk, []) for chunk in ahead_chunks]
        state.answered_ahead = answered_ahead
        state._leave_prefix_mode()
        return state

    @property
    def result(self) -> LookupResult | None:
        """vLLM's lookup result (hit and, vLLM 0.32+, tail-key boundaries) once :attr:`hit`
        is set, i.e. once :meth:`next_keys` returns nothing; None before."""
        if self.hit is None:
            return None
        if self._result is None:
            self._result = self.plan.result_for_hit(self.hit)
        return self._result

    @property
    def all_at_once(self) -> bool:
        """Every key goes in the first round (rounds off, or
        :attr:`LookupPlan.probe_in_one_round`)."""
        return self._all_at_once

    @property
    def known_prefix(self) -> int | None:
        """How many chunks from the first are known present (their keys answered present),
        or None outside the lone full-attention case (prefix mode)."""
        return self._prefix

    def leading_known(self, group: int) -> tuple[int, bool]:
        """How many chunks of ``plan.groups[group]`` from the first are known present, and
        whether the chunk after them is known absent."""
        if self._prefix is not None:
            return self._prefix, self._prefix < self.plan.groups[0].limit
        return _known_run(self._answered[group], self._present[group])

    def next_keys(self, window: int | None = None, ahead: int | None = None) -> KeyIndices:
        """Key indices to probe next (ascending); empty once :attr:`hit` is set.

        ``window`` caps how many of the unknown chunks each spec-group's answer rests on are
        probed this round (the lowest first): fewer keys per round, more rounds. ``ahead``
        asks for the next round's keys too, with that window, should this round's
        full-attention chunks all be absent (a vLLM 0.32 / 0.33 plan with other groups: see
        :meth:`EraCProbeState.next_keys`); these rules ignore it.
        """
        plan = self.plan
        if self.answered_ahead[0]:
            self.answered_ahead = ([], [])
        if self.hit is not None:
            return EMPTY
        if not plan.num_keys:  # vLLM answers 0 without an RPC
            self.hit = 0
            return EMPTY
        self.rounds += 1
        if self.rounds == 1 and self._all_at_once:
            return range(plan.num_keys)
        if self._prefix is not None:
            return self._next_prefix_keys(window)
        maybe: list[BoolArray] = []
        known: list[BoolArray] = []
        for probe, answered, present in zip(plan.groups, self._answered, self._present):
            optimistic = present | ~answered
            if probe.dense:
                maybe.append(optimistic)
                known.append(answered)
            else:
                m = np.zeros(probe.limit, dtype=bool)
                m[probe.chunks] = optimistic
                kn = np.ones(probe.limit, dtype=bool)
                kn[probe.chunks] = answered
                maybe.append(m)
                known.append(kn)
        search = longest_hit(
            plan.geometry, plan.token_len, merge(plan.geometry, maybe), merge(plan.geometry, known)
        )
        if search.exact:  # (a lone full-attention plan: its own rule, from its present prefix)
            self.hit = plan.prefix_hit(_leading(maybe[0])) if plan.single_full_attention else (
                search.hit
            )
            return EMPTY
        k = len(plan.geometry.namespaces)
        wanted: list[IntArray] = []
        for sg, chunks in zip(plan.geometry.spec_groups, search.depends):
            if not chunks.size:
                continue
            if window is not None:
                chunks = chunks[:window]
            for gid in sg.group_ids:
                probe = plan.groups[gid]
                pos = chunks if probe.dense else np.searchsorted(probe.chunks, chunks)
                wanted.append(position_keys(probe, pos, k))
        # Groups own disjoint key ranges and positions are unique: sorting is enough.
        return wanted[0] if len(wanted) == 1 else np.sort(np.concatenate(wanted))

    def _next_prefix_keys(self, window: int | None) -> KeyIndices:
        """Prefix mode: the chunks after the known-present prefix (at most ``window``, and
        never the known-absent bound), then scouts (see the class docstring)."""
        assert self._prefix is not None
        probe = self.plan.groups[0]
        start, bound = self._prefix, self._bound
        if start >= bound:  # every chunk is present, or the next one is known absent
            self.hit = self.plan.prefix_hit(start)
            return EMPTY
        stop = bound if window is None else min(bound, start + window)
        k = len(self.plan.geometry.namespaces)
        offset = probe.key_offset
        chunks = range(offset + start * k, offset + stop * k)
        if self._ahead:
            self._take_ahead(start, stop, k)
        if window is None or window < SCOUT_WINDOW or stop >= bound:
            return chunks
        quarter = window // 2  # of the next window, twice as wide
        keys = list(chunks)
        known = {chunk for chunk, _ in self._ahead}
        for chunk in range(stop + quarter - 1, min(bound, stop + SCOUTS * quarter), quarter):
            if chunk not in known:
                keys.extend(range(offset + chunk * k, offset + (chunk + 1) * k))
        self._scouted = np.array(keys, dtype=np.int64)
        self._scouted_run = len(chunks)
        return self._scouted

    def _take_ahead(self, start: int, stop: int, k: int) -> None:
        """Prefix mode: hand out the present scouts' answers within the window ``start`` to
        ``stop`` (chunks) as :attr:`answered_ahead`; forget those it passed."""
        positions: list[int] = []
        answers: list[Any] = []
        later = []
        for chunk, values in self._ahead:
            if chunk >= stop:
                later.append((chunk, values))
            elif chunk >= start:
                first = (chunk - start) * k
                positions.extend(range(first, first + k))
                answers.extend(values)
        self._ahead = later
        self.answered_ahead = (positions, answers)

    def record(
        self,
        key_indices: KeyIndices,
        present: Sequence[object] | npt.NDArray[Any],
        unit: int = 1,
    ) -> None:
        """Record answers (truthy = present) for ascending key indices that cover whole chunks
        (all namespaces), e.g. from :meth:`next_keys`: one answer per key, or with ``unit``
        one per ``unit`` consecutive keys (a chunk's keys as one item)."""
        if unit > 1:
            present = per_key(present, unit)
        count = len(key_indices)
        if self.hit is not None:
            return
        k = len(self.plan.geometry.namespaces)
        if self.rounds == 1 and count == self.plan.num_keys:  # every key at once
            self.hit = self.plan._resolve_present(np.asarray(present, dtype=bool))
            if self._prefix is not None:  # (a repeated hash may count more: vLLM's hit does)
                miss = first_false(present)
                self._prefix = (count if miss is None else miss) // k
            return
        if not count:
            return
        if self._prefix is not None:
            offset = self.plan.groups[0].key_offset
            first = int(key_indices[0]) - offset
            if first == self._prefix * k:
                if key_indices is self._scouted:  # our own window and scouts
                    filled = self._scouted_run
                else:
                    filled = _contiguous_run(key_indices)
                miss = first_false(present, filled)
                if miss is not None:
                    self._prefix += miss // k
                    self.hit = self.plan.prefix_hit(self._prefix)
                    return
                self._prefix += filled // k
                if filled < count:  # scouts: the first absent one bounds the first miss
                    self._note_scouts(key_indices[filled:], present[filled:], offset, k)
                return
            self._leave_prefix_mode()
        counts = (k,) * len(self.plan.groups)
        for group, pos, got in group_answers(self.plan.groups, counts, key_indices, present):
            self._answered[group][pos] = True
            self._present[group][pos] = got

    def record_present(self, key_indices: range) -> None:
        """Record that a run of keys covering whole chunks is present (known from a cache)."""
        prefix, count = self._prefix, len(key_indices)
        k = len(self.plan.geometry.namespaces)
        if (
            prefix is not None
            and self.hit is None
            and count
            and not (self.rounds == 1 and count == self.plan.num_keys)
            and key_indices.start - self.plan.groups[0].key_offset == prefix * k
        ):
            self._prefix = prefix + count // k  # what record() does here, without the scan
            return
        if count:
            self.record(key_indices, [True], count)  # (one answer for the run's keys)

    def _note_scouts(
        self,
        key_indices: KeyIndices,
        present: Sequence[object] | BoolArray,
        offset: int,
        k: int,
    ) -> None:
        """Prefix mode: remember the chunks the scouts found present before the first absent
        one, and lower the bound to that one."""
        miss = first_false(present)
        end = len(present) if miss is None else miss - miss % k  # (whole chunks before it)
        if end:
            answers = present.tolist() if isinstance(present, np.ndarray) else list(present)
            for at in range(0, end, k):
                chunk = (int(key_indices[at]) - offset) // k
                self._ahead.append((chunk, answers[at : at + k]))
            self._ahead.sort(key=operator.itemgetter(0))
        if miss is not None:
            self._bound = min(self._bound, (int(key_indices[miss]) - offset) // k)

    def _leave_prefix_mode(self) -> None:
        """Answers arrived out of order: keep them in per-chunk arrays from now on."""
        assert self._prefix is not None
        size = self.plan.groups[0].chunks.size
        answered = np.zeros(size, dtype=bool)
        answered[: self._prefix] = True
        present = answered.copy()
        if self._bound < size:  # known absent
            answered[self._bound] = True
        for chunk, _ in self._ahead:  # known present
            if chunk < size:
                answered[chunk] = present[chunk] = True
        self._ahead = []
        self._answered = (answered,)
        self._present = (present,)
        self._prefix = None


def per_key(
    present: Sequence[Any] | npt.NDArray[Any], unit: int
) -> list[Any] | npt.NDArray[Any]:
    """Answers given one per ``unit`` consecutive keys, as one per key."""
    if isinstance(present, np.ndarray):
        return np.repeat(present, unit)
    return [value for value in present for _ in range(unit)]


def group_answers(
    groups: Sequence[GroupProbe],
    key_counts: Sequence[int],
    key_indices: KeyIndices,
    present: Sequence[object] | npt.NDArray[Any],
) -> Iterator[tuple[int, IntArray, BoolArray]]:
    """Answers for ascending key indices that cover whole probe positions, per group: its
    index, the positions answered and whether each is present (every one of its
    ``key_counts[i]`` namespace keys answered truthy)."""
    indices = np.asarray(key_indices, dtype=np.int64)
    answers = np.asarray(present, dtype=bool)
    single = len(groups) == 1
    for i, (probe, k) in enumerate(zip(groups, key_counts)):
        if single:
            lo, hi = 0, indices.size
        else:
            lo = int(indices.searchsorted(probe.key_offset))
            hi = int(indices.searchsorted(probe.key_offset + probe.chunks.size * k))
        if hi <= lo:
            continue
        pos = (indices[lo:hi:k] - probe.key_offset) // k
        got: BoolArray = answers[lo:hi].reshape(-1, k).all(axis=1) if k > 1 else answers[lo:hi]  # type: ignore[assignment]
        yield i, pos, got


def position_keys(probe: GroupProbe, positions: IntArray, k: int) -> IntArray:
    """The key indices of a group's probe positions, each in its ``k`` namespaces."""
    if k == 1:
        return probe.key_offset + positions
    return probe.key_offset + (positions[:, None] * k + np.arange(k)[None, :]).ravel()


def _known_run(answered: BoolArray, present: BoolArray) -> tuple[int, bool]:
    """:meth:`ProbeState.leading_known` from one group's per-position answers."""
    run = _leading(answered & present)
    return run, run < answered.size and bool(answered[run])


def _leading(present: BoolArray) -> int:
    """How many entries from the first are True."""
    if not present.size:
        return 0
    miss = int(np.argmin(present))
    return present.size if present[miss] else miss


def _contiguous_run(indices: KeyIndices) -> int:
    """How many of the ascending ``indices``, from the first, are consecutive."""
    if isinstance(indices, range) or int(indices[-1]) - int(indices[0]) == len(indices) - 1:
        return len(indices)
    steps = np.diff(indices) != 1
    return int(steps.argmax()) + 1


