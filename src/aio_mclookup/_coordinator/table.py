"""The key table: every key queued or in flight, who waits for its answer, and a fair order
in which queued keys go out.

A subscriber is ``lookup ident << POS_BITS | position in the lookup's round`` (a round has
far fewer than 2**32 keys). Plain ints, not objects: under load every object the garbage
collector tracks costs time, and a dict holding only ints is not tracked at all.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

__all__ = ["POS_BITS", "POS_MASK", "KeyTable", "Subscribers"]

Subscribers = int | list[int]
"""Who waits for one key's answer: one subscriber, or a list of them (the key is shared)."""
_MIN_SHARE = 32
"""A round's share of a dispatch is at least this many keys (a small round goes out whole,
in one step), or half of it when it takes fewer."""
POS_BITS = 32
POS_MASK = (1 << POS_BITS) - 1


class _Round:
    """One round's queued keys, and how many of them were taken."""

    __slots__ = ("keys", "pos")

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = keys
        self.pos = 0


class KeyTable:
    """``waiting`` maps every key queued or in flight to its :data:`Subscribers`, from the
    round that queues it until its RPC is over (a key is never queued twice, nor queued while
    in flight: later rounds join it there); ``answering`` holds the answers of the RPC being
    fanned out right now (a round that starts during the fan-out takes them, as if it had
    joined that RPC while in flight).

    The queued keys wait in :attr:`rounds`: each round's new keys (every queued key in
    exactly one round), in arrival order. :meth:`take` serves the rounds in turn, a share each
    (at least :data:`_MIN_SHARE` keys), so a huge round cannot hold back the small ones; a key
    a round joined goes out in the order of the round that queued it. Taking a key only
    slices those lists: its entry in ``waiting`` stays as it is.

    A lookup that ends while its keys are queued marks those nobody else waits for as
    :attr:`abandoned`; :meth:`take` asks again about those (someone may have joined them
    since) and drops the ones still unwanted instead of sending them."""

    __slots__ = ("abandoned", "answering", "queued", "rounds", "waiting")

    def __init__(self) -> None:
        self.waiting: dict[bytes, Subscribers] = {}
        self.answering: dict[bytes, float] = {}
        self.queued = 0
        """Keys queued, to be taken (abandoned ones included until taken)."""
        self.rounds: collections.deque[_Round] = collections.deque()
        self.abandoned: set[bytes] = set()

    def queue_round(self, keys: Sequence[bytes]) -> None:
        """A round queued ``keys``, each new to :attr:`waiting` (entered there already)."""
        self.rounds.append(_Round(keys))
        self.queued += len(keys)

    def take(self, limit: int, wanted: Callable[[Subscribers], bool]) -> tuple[bytes, ...]:
        """Up to ``limit`` queued keys, now in flight, sharing ``limit`` fairly between the
        rounds waiting (first come, first served within a share). An abandoned key goes only
        when ``wanted`` says someone still waits for it; otherwise it leaves the table."""
        rounds = self.rounds
        taken: list[bytes] = []
        if self.queued <= limit and not self.abandoned:  # everything fits: no order to keep
            for entry in rounds:
                taken += entry.keys[entry.pos :] if entry.pos else entry.keys
            rounds.clear()
            self.queued = 0
            return tuple(taken)  # tuples of keys: the GC stops tracking them after one look
        room = limit
        share = max(1, limit // len(rounds), min(_MIN_SHARE, limit // 2)) if rounds else 0
        while rounds and room > 0:
            entry = rounds.popleft()
            keys, pos = entry.keys, entry.pos
            stop = min(len(keys), pos + min(share, room))
            chunk = keys[pos:stop]
            self.queued -= stop - pos
            if self.abandoned:
                chunk = self._still_wanted(chunk, wanted)
            taken.extend(chunk)
            room -= len(chunk)
            if stop < len(keys):
                entry.pos = stop
                rounds.append(entry)  # to the back: the others go first
        if not rounds:
            self.queued = 0
            self.abandoned.clear()  # (only queued keys need the check)
        return tuple(taken)

    def _still_wanted(
        self, keys: Sequence[bytes], wanted: Callable[[Subscribers], bool]
    ) -> list[bytes]:
        """``keys`` but the abandoned ones nobody waits for (those leave the table)."""
        abandoned, waiting = self.abandoned, self.waiting
        kept = []
        for key in keys:
            if key in abandoned:
                abandoned.discard(key)
                subscribers = waiting.get(key)
                if subscribers is None or not wanted(subscribers):
                    waiting.pop(key, None)
                    continue
            kept.append(key)
        return kept

    def answered(self, keys: Sequence[bytes]) -> None:
        """An RPC of ``keys`` is over: none of them is abandoned any more."""
        if self.abandoned:
            self.abandoned.difference_update(keys)

    def queued_keys(self) -> list[bytes]:
        """The keys queued, in the order of their rounds."""
        keys: list[bytes] = []
        for entry in self.rounds:
            keys += entry.keys[entry.pos :]
        return keys

    def clear_queued(self) -> dict[bytes, Subscribers]:
        """Drop every queued key; returns them with their subscribers."""
        waiting = self.waiting
        dropped = {key: waiting.pop(key) for key in self.queued_keys() if key in waiting}
        self.rounds.clear()
        self.queued = 0
        self.abandoned.clear()
        return dropped

    def clear(self) -> None:
        """Forget every key, queued or in flight."""
        self.clear_queued()
        self.waiting.clear()
