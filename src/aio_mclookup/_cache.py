"""The coordinator's positive-answer cache: keys the store recently answered present.

Membership is validity. Keys are kept in batches (one per RPC), each expiring at its RPC's
send time + ttl; :meth:`PositiveCache.expire` drops whole expired batches, so a lookup can test
many keys at C speed (``dict.__contains__``) with no per-key clock check. Batches stay ordered
by expiry: a batch added after one that expires later takes that one's keys with it (they
expire early, which is always safe).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Mapping

__all__ = ["PositiveCache"]


class PositiveCache:
    """Keys answered present, each kept at most ``ttl`` seconds from when its RPC was sent, and
    at most ``max_keys`` of them (past that the oldest batches go, down to 90 %)."""

    __slots__ = ("_batches", "_keys", "max_keys", "ttl")

    def __init__(self, ttl: float, max_keys: int) -> None:
        self.ttl = ttl
        self.max_keys = max_keys
        self._keys: dict[bytes, None] = {}
        self._batches: collections.deque[tuple[float, list[bytes]]] = collections.deque()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    @property
    def members(self) -> Mapping[bytes, None]:
        """The cached keys, for fast ``key in members`` tests (call :meth:`expire` first)."""
        return self._keys

    def add(self, keys: list[bytes], sent_at: float) -> None:
        """Remember ``keys`` (answered present by an RPC sent at ``sent_at``, monotonic)."""
        if not keys:
            return
        expiry = sent_at + self.ttl
        batches = self._batches
        while batches and batches[-1][0] > expiry:  # keep expiries ordered: merge, expire early
            keys = keys + batches.pop()[1]
        batches.append((expiry, keys))
        self._keys.update(dict.fromkeys(keys))
        if len(self._keys) > self.max_keys:
            target = self.max_keys - self.max_keys // 10
            while batches and len(self._keys) > target:
                self._drop(batches.popleft()[1])

    def expire(self, now: float) -> None:
        """Forget every batch whose expiry is ``<= now`` (monotonic seconds)."""
        batches = self._batches
        while batches and batches[0][0] <= now:
            self._drop(batches.popleft()[1])

    def leading(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys``, from the first, are cached (stops at the first that is not)."""
        return len(list(itertools.takewhile(self._keys.__contains__, keys)))

    def _drop(self, keys: list[bytes]) -> None:
        pop = self._keys.pop
        for key in keys:
            pop(key, None)
