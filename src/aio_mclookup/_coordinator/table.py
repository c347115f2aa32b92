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
from typing import cast

__all__ = ["POS_BITS", "POS_MASK", "KeyTable", "Subscribers"]

Subscribers = int | list[int]
"""Who waits for one key's answer: one subscriber, or a list of them (the key is shared)."""
_MIN_SHARE = 32
"""A round's share of a dispatch is at least this many keys (a small round goes out whole,
in one step), or half of it when it takes fewer."""
POS_BITS = 32
POS_MASK = (1 << POS_BITS) - 1


class KeyTable:
    """``queued`` and ``in_flight`` map each key to its :data:`Subscribers`; ``answering``
    holds the answers of the RPC being fanned out right now (a round that starts during the
    fan-out takes them, as if it had joined that RPC while in flight).

    Rounds that queued fresh keys wait in :attr:`rounds`, in arrival order; :meth:`take`
    serves them in turn, a share each (at least :data:`_MIN_SHARE` keys), so a huge round
    cannot hold back the small ones and the work is linear in the keys taken."""

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
        room = limit
        pop = queued.pop
        share = max(1, limit // len(rounds), min(_MIN_SHARE, limit // 2)) if rounds else 0
        while rounds and room > 0:
            entry = rounds.popleft()
            waiting: Sequence[bytes] = entry[0]  # type: ignore[assignment]
            pos: int = entry[1]  # type: ignore[assignment]
            stop = min(len(waiting), pos + min(share, room))
            chunk = waiting[pos:stop]
            subscribers = list(map(pop, chunk, itertools.repeat(None)))
            if None in subscribers:  # (shared with an earlier round, or answered meanwhile)
                chunk = [key for key, sub in zip(chunk, subscribers) if sub is not None]
                subscribers = [sub for sub in subscribers if sub is not None]
            in_flight.update(zip(chunk, cast("list[Subscribers]", subscribers)))
            taken.extend(chunk)
            room -= len(chunk)
            if stop < len(waiting):
                entry[1] = stop
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
