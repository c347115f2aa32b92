"""The key table: every key queued or in flight, who waits for its answer, and a fair order
in which queued keys go out.

A subscriber is ``lookup ident << POS_BITS | position in the lookup's round`` (a round has
far fewer than 2**32 keys). Plain ints, not objects: under load every object the garbage
collector tracks costs time, and a dict holding only ints is not tracked at all.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from typing import Any, Protocol, TypeVar

from .. import _native

__all__ = [
    "BULK", "POS_BITS", "POS_MASK", "KeyTable", "Subscribers", "Waiter", "answer", "enter_keys",
    "fan_out", "subscribe_keys", "unsent",
]

Subscribers = int | list[int]
"""Who waits for one key's answer: one subscriber, or a list of them (the key is shared)."""
_MIN_SHARE = 32
"""A round's share of a dispatch is at least this many keys (a small round goes out whole,
in one step), or half of it when it takes fewer."""
BULK = 8
"""Rounds of at least this many open entries are tested against the cache and the key table
with a few whole-round calls first (a loop per key is cheaper below that)."""
POS_BITS = 32
POS_MASK = (1 << POS_BITS) - 1

_C: Any = _native.load("aio_mclookup._coordinator._table_c")
"""The compiled :func:`enter_keys`, :func:`subscribe_keys`, :func:`fan_out` and :func:`unsent`,
or ``None``: the Python ones."""


def enter_keys(
    waiting: dict[bytes, Subscribers], sending: set[bytes], keys: Sequence[bytes],
    subs: Sequence[int],
) -> tuple[list[bytes], int, int]:
    """Each key joins the subscribers ``waiting`` holds for it, or enters with its own; returns
    the keys to queue (the new ones, and those joined while queued: a round's share may pull
    them out), how many were new and how many joined. Its compiled twin is ``_table_c``."""
    to_send = []
    fresh = shared = 0
    for sub, key in zip(subs, keys):
        others = waiting.get(key)
        if others is None:
            waiting[key] = sub
            fresh += 1
            to_send.append(key)
            continue
        if isinstance(others, int):
            waiting[key] = [others, sub]
        else:
            others.append(sub)
        shared += 1
        if key not in sending:  # joined while queued
            to_send.append(key)
    return to_send, fresh, shared


def unsent(
    waiting: dict[bytes, Subscribers],
    sending: set[bytes],
    abandoned: set[bytes],
    keys: Sequence[bytes],
    pos: int,
    stop: int,
    room: int,
    wanted: Callable[[Subscribers], bool],
) -> tuple[list[bytes], int, int]:
    """The keys of a queued round's ``keys[pos:stop]`` still to send (waiting, not sending,
    each once), added to ``sending``; reading on past ``stop`` as keys are skipped, up to
    ``room`` keys kept. An ``abandoned`` key goes only when ``wanted`` says someone joined it
    since; otherwise it leaves ``abandoned`` and ``waiting``. Returns the keys kept, where the
    reading ended and how many keys left the table. Its compiled twin is ``_table_c``."""
    if pos < 0:
        raise ValueError("pos must be >= 0")
    want = min(stop - pos, room)
    kept: list[bytes] = []
    dropped = 0
    while pos < len(keys) and len(kept) < want:
        key = keys[pos]
        pos += 1
        if key in sending or key not in waiting:  # (taken by another round already)
            continue
        if key in abandoned:
            abandoned.discard(key)
            if not wanted(waiting[key]):
                del waiting[key]
                dropped += 1
                continue
        sending.add(key)  # (a round may list a key twice: the second is skipped)
        kept.append(key)
    return kept, pos, dropped


def subscribe_keys(
    waiting: dict[bytes, Subscribers],
    sending: set[bytes],
    cached: Mapping[bytes, float],
    answering: Mapping[bytes, float],
    keys: Sequence[bytes],
    subs: Sequence[int],
    present: MutableSequence[float] | Any,
    base: int,
) -> tuple[list[bytes], int, int, int, int]:
    """One round's keys (subscribers ``subs``, positions ``sub - base`` in ``present``): a
    key ``cached`` knows or ``answering`` has just answered gets that answer in ``present``;
    the others enter the table (:func:`enter_keys`). Returns the keys to queue, how many were
    new, joined, answered by the cache and answered by the RPC being fanned out. Its compiled
    twin is ``_table_c.subscribe``, which does it in one pass."""
    open_keys: list[bytes] = []
    open_subs: list[int] = []
    hits = just_answered = 0
    for sub, key in zip(subs, keys):
        until = cached.get(key)
        if until is not None:
            hits += 1
        elif answering:
            until = answering.get(key)
            if until is not None:
                just_answered += 1
        if until is None:
            open_keys.append(key)
            open_subs.append(sub)
        else:
            present[sub - base] = until
    to_send, fresh, shared = enter_keys(waiting, sending, open_keys, open_subs)
    return to_send, fresh, shared, hits, just_answered


class Waiter(Protocol):
    """What the fan-out reads and writes of a lookup (the core's ``LookupState``)."""

    done: bool
    """Settled: answers for it are dropped."""
    waiting: int
    """Answers of its round still to come."""
    round_present: Any
    """Its round's answers by position (a list of floats, or a float64 array)."""


W = TypeVar("W", bound=Waiter)


def fan_out(
    waiting: dict[bytes, Subscribers], lookups: Mapping[int, W], keys: Sequence[bytes],
    values: Sequence[float],
) -> list[W]:
    """One RPC's answers (``values[i]`` for ``keys[i]``) to the subscribers ``waiting`` holds
    for each key, whose entry leaves ``waiting``: each subscriber's lookup (skipped when gone
    or done) gets the value at its position and one answer less to wait for. Returns the
    lookups whose round is then complete: those of keys with one subscriber first, then
    those of shared keys. Its compiled twin is ``_table_c.fan_out``."""
    ready: list[W] = []
    shared: list[tuple[list[int], float]] = []
    for key, value in zip(keys, values):
        subscribers = waiting.pop(key, None)
        if subscribers is None:
            continue
        if isinstance(subscribers, int):
            answer(lookups, subscribers, value, ready)
        else:
            shared.append((subscribers, value))
    for subs, value in shared:
        answer(lookups, subs, value, ready)
    return ready


def answer(
    lookups: Mapping[int, W], subscribers: Subscribers, value: float, ready: list[W]
) -> None:
    """One key's answer for its ``subscribers``: each one's lookup (skipped when gone or done)
    gets ``value`` at its position; those whose round it completes are added to ``ready``."""
    for sub in (subscribers,) if isinstance(subscribers, int) else subscribers:
        lookup = lookups.get(sub >> POS_BITS)
        if lookup is not None and not lookup.done:
            lookup.round_present[sub & POS_MASK] = value
            lookup.waiting -= 1
            if not lookup.waiting:
                ready.append(lookup)


class _Round:
    """One round's keys to send, and how many of them were taken."""

    __slots__ = ("keys", "pos")

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = keys
        self.pos = 0


class KeyTable:
    """``waiting`` maps every key queued or in flight to its :data:`Subscribers`, from the
    round that first wants it until its RPC is over (later rounds join it there); ``sending``
    holds the keys in flight; ``answering`` holds the answers of the RPC being fanned out
    right now (a round that starts during the fan-out takes them, as if it had joined that
    RPC while in flight).

    The queued keys wait in :attr:`rounds`, in arrival order: each round's new keys and the
    queued keys it joined (so that its share can pull them out), in its order. :meth:`take`
    serves the rounds in turn, a share each (at least :data:`_MIN_SHARE` keys), so a huge
    round cannot hold back the small ones. Taking a key only slices those lists and marks it
    sending: its entry in ``waiting`` stays as it is. While some round lists a key another
    one queued (:attr:`copies`), or keys are abandoned, the lists are read key by key instead,
    to skip the keys already taken (once none is queued, the lists left hold only such keys
    and are dropped).

    A lookup that ends while its keys are queued marks those nobody else waits for as
    :attr:`abandoned`; :meth:`take` asks again about those (someone may have joined them
    since) and drops the ones still unwanted instead of sending them."""

    __slots__ = ("abandoned", "answering", "copies", "queued", "rounds", "sending", "waiting")

    def __init__(self) -> None:
        self.waiting: dict[bytes, Subscribers] = {}
        self.sending: set[bytes] = set()
        self.answering: dict[bytes, float] = {}
        self.queued = 0
        """Keys queued, to be taken (abandoned ones included until taken: see :attr:`live`)."""
        self.rounds: collections.deque[_Round] = collections.deque()
        self.copies = False
        """Some round in :attr:`rounds` lists keys another round queued."""
        self.abandoned: set[bytes] = set()

    @property
    def live(self) -> int:
        """Keys queued that some lookup still waits for (as far as is known before taking
        them: an abandoned key someone joined since counts as not)."""
        return self.queued - len(self.abandoned)

    def fan_out(
        self, keys: Sequence[bytes], values: Sequence[float], lookups: Mapping[int, W]
    ) -> list[W]:
        """An RPC's answers to everyone waiting for them (:func:`fan_out`); returns the
        lookups whose round they complete."""
        if _C is not None:
            ready: list[W] = _C.fan_out(self.waiting, lookups, keys, values)
            return ready
        return fan_out(self.waiting, lookups, keys, values)

    def answered(self, keys: Sequence[bytes]) -> None:
        """An RPC of ``keys`` is over: they are no longer sending."""
        self.sending.difference_update(keys)

    def enter(self, keys: Sequence[bytes], subs: Sequence[int]) -> tuple[int, int]:
        """One round's open ``keys``, with their subscribers ``subs``: each joins the key
        queued or in flight, or is queued. Returns how many were queued and how many joined.

        A round of :data:`BULK` keys or more that nothing else wants (a cold round) is entered
        with one update; the others key by key."""
        waiting, sending = self.waiting, self.sending
        if not keys:
            return 0, 0
        if len(keys) >= BULK and (not waiting or waiting.keys().isdisjoint(keys)):
            before = len(waiting)
            waiting.update(zip(keys, subs))
            if len(waiting) - before == len(keys):
                self._queue_round(keys, len(keys))
                return len(keys), 0
            for key in keys:  # a key repeats in the round: one entry per position
                waiting.pop(key, None)  # (none of them was there before)
        if _C is not None:
            to_send, fresh, shared = _C.enter_keys(waiting, sending, keys, subs)
        else:
            to_send, fresh, shared = enter_keys(waiting, sending, keys, subs)
        if fresh:
            self._queue_round(to_send, fresh)
        return fresh, shared

    def subscribe(
        self,
        keys: Sequence[bytes],
        subs: Sequence[int],
        cached: Mapping[bytes, float],
        present: MutableSequence[float] | Any,
        base: int,
    ) -> tuple[int, int, int, int]:
        """One round's open ``keys`` (subscribers ``subs``): those ``cached`` knows, or
        :attr:`answering` holds, get that answer in ``present`` (at ``sub - base``); the others
        join a key queued or in flight, or are queued. Returns how many were queued, joined,
        answered by the cache, and answered by the RPC being fanned out.

        Compiled, one pass (:func:`subscribe_keys`); in Python a round of :data:`BULK` keys or
        more that neither the cache nor that RPC knows is entered whole (:meth:`enter`)."""
        answering = self.answering
        if _C is not None:
            to_send, fresh, shared, hits, just_answered = _C.subscribe(
                self.waiting, self.sending, cached, answering, keys, subs, present, base
            )
            if fresh:
                self._queue_round(to_send, fresh)
            return fresh, shared, hits, just_answered
        if (
            len(keys) >= BULK  # (a loop is cheaper than whole-round tests below that)
            and (not cached or cached.keys().isdisjoint(keys))
            and (not answering or answering.keys().isdisjoint(keys))
        ):
            return (*self.enter(keys, subs), 0, 0)
        to_send, fresh, shared, hits, just_answered = subscribe_keys(
            self.waiting, self.sending, cached, answering, keys, subs, present, base
        )
        if fresh:
            self._queue_round(to_send, fresh)
        return fresh, shared, hits, just_answered

    def _queue_round(self, keys: Sequence[bytes], fresh: int) -> None:
        """A round queued ``keys``: ``fresh`` of them new to :attr:`waiting` (entered there
        already), the others joined while queued."""
        self.rounds.append(_Round(keys))
        self.queued += fresh
        if fresh != len(keys):
            self.copies = True

    def take(self, limit: int, wanted: Callable[[Subscribers], bool]) -> tuple[bytes, ...]:
        """Up to ``limit`` queued keys, now sending, sharing ``limit`` fairly between the
        rounds waiting (first come, first served within a share). An abandoned key goes only
        when ``wanted`` says someone still waits for it; otherwise it leaves the table."""
        rounds = self.rounds
        taken: list[bytes] = []
        if self.queued <= limit and not self.abandoned and not self.copies:  # all of them:
            for entry in rounds:  # no order to keep
                taken += entry.keys[entry.pos :] if entry.pos else entry.keys
            rounds.clear()
            self.queued = 0
            self.sending.update(taken)
            return tuple(taken)  # tuples of keys: the GC stops tracking them after one look
        room = limit
        share = max(1, limit // len(rounds), min(_MIN_SHARE, limit // 2)) if rounds else 0
        while rounds and room > 0:
            entry = rounds.popleft()
            keys, pos = entry.keys, entry.pos
            stop = min(len(keys), pos + min(share, room))
            chunk: Sequence[bytes]
            if self.copies or self.abandoned:
                chunk, stop = self._unsent(keys, pos, stop, room, wanted)
            else:
                chunk = keys[pos:stop]
                self.sending.update(chunk)
            self.queued -= len(chunk)
            taken.extend(chunk)
            room -= len(chunk)
            if stop < len(keys):
                entry.pos = stop
                rounds.append(entry)  # to the back: the others go first
        if not rounds or not self.queued:  # (left: at most copies of keys taken already)
            rounds.clear()
            self.queued = 0
            self.copies = False
            self.abandoned.clear()  # (only queued keys need the check)
        return tuple(taken)

    def _unsent(
        self,
        keys: Sequence[bytes],
        pos: int,
        stop: int,
        room: int,
        wanted: Callable[[Subscribers], bool],
    ) -> tuple[list[bytes], int]:
        """The keys of ``keys[pos:stop]`` still queued (:func:`unsent`), now sending, and where
        the slice ended."""
        if _C is not None:
            kept, pos, dropped = _C.unsent(
                self.waiting, self.sending, self.abandoned, keys, pos, stop, room, wanted
            )
        else:
            kept, pos, dropped = unsent(
                self.waiting, self.sending, self.abandoned, keys, pos, stop, room, wanted
            )
        self.queued -= dropped
        return kept, pos

    def queued_keys(self) -> list[bytes]:
        """The keys queued (each once), in the order of their rounds."""
        waiting, sending = self.waiting, self.sending
        keys: dict[bytes, None] = {}
        for entry in self.rounds:
            for key in entry.keys[entry.pos :]:
                if key in waiting and key not in sending:
                    keys[key] = None
        return list(keys)

    def clear_queued(self) -> dict[bytes, Subscribers]:
        """Drop every queued key; returns them with their subscribers."""
        waiting = self.waiting
        dropped = {key: waiting.pop(key) for key in self.queued_keys()}
        self.rounds.clear()
        self.queued = 0
        self.copies = False
        self.abandoned.clear()
        return dropped

    def clear(self) -> None:
        """Forget every key, queued or in flight."""
        self.clear_queued()
        self.waiting.clear()
        self.sending.clear()
