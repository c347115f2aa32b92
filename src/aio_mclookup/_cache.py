"""The coordinator's positive-answer cache: keys the store recently answered present.

Membership is validity. Keys are kept in batches (one per RPC), each with its expiry (the RPC's
send time + ``cache_ttl``), in a heap; :meth:`PositiveCache.expire` drops every batch whose
time is up, so a lookup can test many keys at C speed (``dict.__contains__``) with no per-key
clock check. A key answered present by two RPCs goes with the first batch to expire: early,
never late.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping

__all__ = ["PositiveCache"]


class PositiveCache:
    """Keys answered present, each kept until the expiry given with it, and at most
    ``max_keys`` of them (past that the batches that expire first go, down to 90 %)."""

    __slots__ = ("_batches", "_keys", "_order")

    def __init__(self) -> None:
        self._keys: dict[bytes, None] = {}
        self._batches: list[tuple[float, int, tuple[bytes, ...]]] = []  # a heap by expiry
        self._order = itertools.count()  # ties: first added, first dropped

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    @property
    def members(self) -> Mapping[bytes, None]:
        """The cached keys, for fast ``key in members`` tests (call :meth:`expire` first)."""
        return self._keys

    def add(self, keys: Iterable[bytes], expiry: float, max_keys: int) -> None:
        """Remember ``keys`` until ``expiry`` (monotonic seconds), keeping at most
        ``max_keys`` keys."""
        keys = tuple(keys)  # kept as a tuple: the GC stops tracking it after one look
        if not keys:
            return
        heapq.heappush(self._batches, (expiry, next(self._order), keys))
        self._keys.update(dict.fromkeys(keys))
        if len(self._keys) > max_keys:
            target = max_keys - max_keys // 10
            while self._batches and len(self._keys) > target:
                self._drop(heapq.heappop(self._batches)[2])

    def expire(self, now: float) -> None:
        """Forget every batch whose expiry is ``<= now`` (monotonic seconds)."""
        batches = self._batches
        while batches and batches[0][0] <= now:
            self._drop(heapq.heappop(batches)[2])

    def leading(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys``, from the first, are cached (stops at the first that is not)."""
        return len(list(itertools.takewhile(self._keys.__contains__, keys)))

    def _drop(self, keys: tuple[bytes, ...]) -> None:
        pop = self._keys.pop
        for key in keys:
            pop(key, None)
