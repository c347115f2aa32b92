"""The key table: every key queued or in flight, who waits for its answer, and a fair order
in which queued keys go out.

A subscriber is ``lookup ident << POS_BITS | position in the lookup's round`` (a round has
far fewer than 2**32 keys). Plain ints, not objects: under load every object the garbage
collector tracks costs time, and a dict holding only ints is not tracked at all.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence

__all__ = ["POS_BITS", "POS_MASK", "KeyTable", "Subscribers"]

Subscribers = int | list[int]
"""Who waits for one key's answer: one subscriber, or a list of them (the key is shared)."""
POS_BITS = 32
POS_MASK = (1 << POS_BITS) - 1


class KeyTable:
    """``queued`` and ``in_flight`` map each key to its :data:`Subscribers`; ``answering``
    holds the answers of the RPC being fanned out right now (a round that starts during the
    fan-out takes them, as if it had joined that RPC while in flight).

    Rounds that queued fresh keys wait in :attr:`rounds`, in arrival order; :meth:`take`
    serves them in turn, a share each, so a huge round cannot hold back the small ones and
    the work is linear in the keys taken."""

    __slots__ = ("answering", "in_flight", "queued", "rounds")

    def __init__(self) -> None:
        self.queued: dict[bytes, Subscribers] = {}
        self.in_flight: dict[bytes, Subscribers] = {}
        self.answering: dict[bytes, float] = {}
        self.rounds: collections.deque[list[object]] = collections.deque()
        """``[keys, next position]`` per round with keys queued (keys it shares with other
        rounds or found answered are skipped when taken)."""

    def queue_round(self, keys: Sequence[bytes]) -> None:
        """A round queued some of ``keys`` (the others were answered or shared)."""
        self.rounds.append([keys, 0])

    def take(self, limit: int) -> tuple[bytes, ...]:
        """Move up to ``limit`` queued keys in flight, sharing ``limit`` fairly between the
        rounds waiting (first come, first served within a share)."""
        queued = self.queued
        if len(queued) <= limit:  # everything fits: no order to keep
            keys = tuple(queued)  # tuples of keys: the GC stops tracking them after one look
            self.in_flight.update(queued)
            self.queued = {}
            self.rounds.clear()
            return keys
        taken: list[bytes] = []
        in_flight = self.in_flight
        rounds = self.rounds
        while rounds and len(taken) < limit:
            share = max(1, (limit - len(taken)) // len(rounds))
            entry = rounds.popleft()
            waiting: Sequence[bytes] = entry[0]  # type: ignore[assignment]
            pos: int = entry[1]  # type: ignore[assignment]
            stop = len(waiting)
            got = 0
            while pos < stop and got < share:
                key = waiting[pos]
                pos += 1
                subscribers = queued.pop(key, None)
                if subscribers is not None:
                    in_flight[key] = subscribers
                    taken.append(key)
                    got += 1
            if pos < stop:
                entry[1] = pos
                rounds.append(entry)  # to the back: the others go first
        if len(taken) < limit and queued:  # (keys no round lists: never left behind)
            for key in list(itertools.islice(queued, limit - len(taken))):
                in_flight[key] = queued.pop(key)
                taken.append(key)
        return tuple(taken)

    def clear_queued(self) -> dict[bytes, Subscribers]:
        """Drop every queued key; returns them with their subscribers."""
        queued, self.queued = self.queued, {}
        self.rounds.clear()
        return queued
