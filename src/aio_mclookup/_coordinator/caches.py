"""The coordinator's positive-answer caches: what the store recently answered present.

:class:`PositiveCache` holds keys; :class:`KnownPrefixes` holds runs of full-attention chunks
known present from a request's first chunk on, as prefix trees of raw hash rows, so that a
lookup sharing one skips those keys without building them.

PositiveCache: membership is validity. Keys are kept in batches (one per RPC), each with its
expiry (the RPC's send time + ``cache_ttl``), in a heap; :meth:`PositiveCache.expire` drops
every batch whose time is up, so a lookup can test many keys at C speed (``dict.get``) with no
per-key clock check. A key answered present by two RPCs goes with the first batch to expire:
early, never late. Each key also keeps the expiry of its latest answer, which is what a known
prefix built on it inherits.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import _native
from .._rows import common_rows

__all__ = ["KnownPrefixes", "NextChunk", "PositiveCache"]

_C: Any = _native.load("aio_mclookup._coordinator._prefixes_c")
"""The compiled reads of the known prefixes (``_prefixes_c.c``: :meth:`KnownPrefixes.leading`
and :meth:`KnownPrefixes.after` where no row is out of date), or ``None``."""

_NEVER = math.inf
RUN_OVERHEAD_ROWS = 8
"""What a run costs beyond its rows, in rows, against ``max_rows`` (small runs stay bounded)."""


class NextChunk(enum.Enum):
    """What :meth:`KnownPrefixes.after` says of the chunk right after a known prefix."""

    LIKELY_PRESENT = "likely present"
    LIKELY_ABSENT = "likely absent"
    LEAVES_RUN = "leaves the run"


_PRESENT = NextChunk.LIKELY_PRESENT
_ABSENT = NextChunk.LIKELY_ABSENT
_LEAVES = NextChunk.LEAVES_RUN
"""The members as globals, for :meth:`KnownPrefixes.after`: on Python 3.11 reading one off
the enum class goes through ``EnumType.__getattr__``'s slow path, several times a global's
cost."""
_VERDICTS = (_PRESENT, _ABSENT, _LEAVES)
"""The members by the compiled ``after``'s answer."""


class PositiveCache:
    """Keys answered present, each kept until the expiry given with it, and at most
    ``max_keys`` of them (past that the batches that expire first go, down to 90 %)."""

    __slots__ = ("_batches", "_keys", "_order")

    def __init__(self) -> None:
        self._keys: dict[bytes, float] = {}  # key -> expiry of its latest positive answer
        self._batches: list[tuple[float, int, tuple[bytes, ...]]] = []  # a heap by expiry
        self._order = itertools.count()  # ties: first added, first dropped

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    @property
    def members(self) -> Mapping[bytes, float]:
        """The cached keys, each with the expiry of its latest positive answer, for fast
        ``members.get(key)`` tests (call :meth:`expire` first)."""
        return self._keys

    def add(self, keys: Iterable[bytes], expiry: float, max_keys: int) -> None:
        """Remember ``keys`` until ``expiry`` (monotonic seconds), keeping at most
        ``max_keys`` keys."""
        keys = tuple(keys)  # kept as a tuple: the GC stops tracking it after one look
        if not keys:
            return
        heapq.heappush(self._batches, (expiry, next(self._order), keys))
        self._keys.update(zip(keys, itertools.repeat(expiry)))  # (no dict built in between)
        if len(self._keys) > max_keys:
            target = max_keys - max_keys // 10
            while self._batches and len(self._keys) > target:
                self._drop(heapq.heappop(self._batches)[2])

    def expire(self, now: float) -> None:
        """Forget every batch whose expiry is ``<= now`` (monotonic seconds)."""
        batches = self._batches
        while batches and batches[0][0] <= now:
            self._drop(heapq.heappop(batches)[2])

    def leading(self, keys: Sequence[bytes]) -> tuple[int, float]:
        """How many of ``keys``, from the first, are cached, and until when all of those are
        known present (``inf`` when none are)."""
        expiries = list(map(self._keys.get, keys))
        run = expiries.index(None) if None in expiries else len(expiries)
        known: list[float] = expiries[:run]  # type: ignore[assignment]  # no None before run
        return run, min(known, default=_NEVER)

    def _drop(self, keys: tuple[bytes, ...]) -> None:
        pop = self._keys.pop
        for key in keys:
            pop(key, None)


@dataclass(eq=False, slots=True)
class _Node:
    """One edge of a prefix tree: a run of chunks known present, and the runs that branch off
    after it (a radix tree: a node holds rows until the first point where stored runs part)."""

    rows: npt.NDArray[np.uint8]
    """Raw hashes of the edge's chunks."""
    until: npt.NDArray[np.float64]
    """Per row: until when every row from the tree's first to it is known present
    (non-increasing along every path)."""
    children: dict[bytes, _Node] | None = None
    """The runs that go on after the last row, by their first row's bytes."""
    miss: bytes | None = None
    """The hash found absent right after the rows, by the lookup that stored them (None:
    unknown). A hint for how to probe, never an answer: absent answers are not cached."""
    grown: int = 0
    """How often a lookup found present chunks right after the rows (and grew them)."""


def _size(node: _Node) -> int:
    """Rows held by ``node`` and every node below it, each node counting
    :data:`RUN_OVERHEAD_ROWS` more."""
    total: int = node.rows.shape[0] + RUN_OVERHEAD_ROWS
    if node.children:
        for child in node.children.values():
            total += _size(child)
    return total


class KnownPrefixes:
    """Runs of full-attention chunks known present from a request's first chunk on, as prefix
    trees of hash rows.

    A tree is found by its key signature (the key prefixes of the group's rank namespaces: the
    same hash rows then make the same keys) and its first hash. Its edges hold the chunks' raw
    hash rows; a lookup compares its own rows with an edge's in one vectorised step, edge after
    edge where stored runs branch (multi-turn sessions that share a system prompt, each turn
    extending the last), instead of building and testing a key per chunk. Only the leading
    part of a run can matter (a full-attention hit stops at the first miss), so each row keeps
    the earliest expiry of the rows up to it. A request that diverges from the stored runs
    adds its own branch from the divergence on. Rows out of date are dropped when next met, or
    pushed out by newer trees: at most ``max_rows`` rows in all, each edge counting
    :data:`RUN_OVERHEAD_ROWS` more (the trees stored or refreshed longest ago go first).
    """

    __slots__ = ("_rows", "_runs")

    def __init__(self) -> None:
        self._runs: dict[tuple[Hashable, bytes], list[Any]] = {}  # key -> [root, its size]
        self._rows = 0

    def __len__(self) -> int:
        """Rows held, over all trees (each edge counting ``RUN_OVERHEAD_ROWS`` more)."""
        return self._rows

    @staticmethod
    def key_of(signature: Hashable, rows: npt.NDArray[np.uint8]) -> tuple[Hashable, bytes]:
        """The key of the tree ``rows`` (at least one) belong to: signature and first hash."""
        return signature, rows[0].tobytes()

    def leading(
        self,
        signature: Hashable,
        rows: npt.NDArray[np.uint8],
        now: float,
        key: tuple[Hashable, bytes] | None = None,
    ) -> tuple[int, float]:
        """How many of ``rows`` (a request's chunk hashes, from the first) are known present
        at ``now``, and until when all of those are (``inf`` when none are). ``key`` is
        :meth:`key_of` the rows, if the caller has it already."""
        n = rows.shape[0]
        if not n:
            return 0, _NEVER
        if key is None:
            key = (signature, rows[0].tobytes())
        if _C is not None:
            found: tuple[int, float] | None = _C.leading(self._runs, key, rows, now)
            if found is not None:  # (else rows out of date: dropped below as they are met)
                return found
        tree = self._runs.get(key)
        if tree is None:
            return 0, _NEVER
        node: _Node = tree[0]
        if node.until[0] <= now:  # the whole tree is out of date
            del self._runs[key]
            self._rows -= tree[1]
            return 0, _NEVER
        depth = 0
        until = _NEVER
        while True:
            edge = node.until.shape[0]
            m = min(edge, n - depth)
            times = node.until
            stale = times[m - 1] <= now
            if stale:  # its tail is out of date
                m = int(np.count_nonzero(times[:m] > now))
            count = common_rows(rows[depth:], node.rows, m) if m else 0
            if count:
                until = float(times[count - 1])
            depth += count
            children = node.children
            if stale or count < edge or depth >= n or not children:
                return depth, until
            child = children.get(rows[depth].tobytes())
            if child is None:
                return depth, until
            if child.until[0] <= now:  # a branch wholly out of date: drop it
                del children[rows[depth].tobytes()]
                dropped = _size(child)
                tree[1] -= dropped
                self._rows -= dropped
                return depth, until
            node = child

    def add(
        self,
        signature: Hashable,
        rows: npt.NDArray[np.uint8],
        until: float,
        max_rows: int,
        key: tuple[Hashable, bytes] | None = None,
        miss: bytes | None = None,
    ) -> None:
        """Remember that ``rows`` (chunk hashes from a request's first) are present until
        ``until`` (monotonic seconds). ``key`` as for :meth:`leading`; ``miss`` is the hash
        found absent right after ``rows``, if any (see :meth:`after`)."""
        count = rows.shape[0]
        if not count:
            return
        if key is None:
            key = (signature, rows[0].tobytes())
        tree = self._runs.pop(key, None)  # re-added last: the newest trees go last
        if tree is None:
            node = _Node(np.array(rows, dtype=np.uint8), np.full(count, until), None, miss)
            self._store(key, [node, count + RUN_OVERHEAD_ROWS], max_rows)
            return
        self._rows -= tree[1]
        node = tree[0]
        depth = 0
        while True:
            edge = node.until.shape[0]
            common = common_rows(rows[depth:], node.rows, min(edge, count - depth))
            np.maximum(node.until[:common], until, out=node.until[:common])
            depth += common
            if depth == count:  # the request's rows end here: refreshed
                if common == edge and miss is not None and not node.children:
                    node.miss = miss  # the latest miss after the same rows
                break
            rest = np.array(rows[depth:], dtype=np.uint8)
            added = _Node(rest, np.full(count - depth, until), None, miss)
            if common < edge:  # diverges inside the edge: split it there
                tail = _Node(
                    node.rows[common:], node.until[common:], node.children, node.miss,
                    node.grown,
                )
                node.rows, node.until = node.rows[:common], node.until[:common]
                node.children = {tail.rows[0].tobytes(): tail, rest[0].tobytes(): added}
                node.miss, node.grown = None, 0
                tree[1] += added.rows.shape[0] + RUN_OVERHEAD_ROWS * 2
                break
            children = node.children
            if children is None:  # found present right after a leaf: it grows
                node.rows = np.concatenate((node.rows, rest))
                node.until = np.concatenate((node.until, added.until))
                node.miss = miss
                node.grown += 1
                tree[1] += rest.shape[0]
                break
            child = children.get(rest[0].tobytes())
            if child is None:
                children[rest[0].tobytes()] = added
                tree[1] += rest.shape[0] + RUN_OVERHEAD_ROWS
                break
            node = child
        self._store(key, tree, max_rows)

    def after(
        self, key: tuple[Hashable, bytes] | None, rows: npt.NDArray[np.uint8], count: int
    ) -> NextChunk:
        """What is likely of a request's chunk ``count``, right after the ``count`` rows it
        shares with the tree at ``key`` (as :meth:`leading` found them): a hint for whether
        the first probe after a known prefix is that chunk alone or a wider window.

        * ``LEAVES_RUN``: the request differs from a stored run inside it (its own
          continuation, which is likely absent);
        * ``LIKELY_ABSENT``: it is the stored run's very miss, or nothing better is known;
        * ``LIKELY_PRESENT``: the request goes on exactly like a stored run (rows known
          present, though out of date), it parts from the stored runs where they branch
          (other requests found their own continuations present there: turns of sessions
          sharing a prompt), or the run has grown past its end before (requests sharing a
          document up to different cuts)."""
        if _C is not None and count >= 0:
            verdict: int | None = _C.after(self._runs, key, rows, count)
            if verdict is not None:
                return _VERDICTS[verdict]
        tree = None if key is None else self._runs.get(key)
        if tree is None or count >= rows.shape[0]:
            return _ABSENT
        node: _Node = tree[0]
        depth = 0
        while True:
            edge = node.until.shape[0]
            if count < depth + edge:  # chunk ``count`` is inside this edge
                stored = node.rows[count - depth].tobytes()
                if rows[count].tobytes() != stored:
                    return _LEAVES
                return _PRESENT
            depth += edge
            children = node.children
            if depth == count:
                if children:
                    return _PRESENT  # a branch point (whichever branch)
                if node.miss == rows[count].tobytes() or not node.grown:
                    return _ABSENT
                return _PRESENT
            child = None if not children else children.get(rows[depth].tobytes())
            if child is None:
                return _ABSENT  # (the request parted before ``count``)
            node = child

    def _store(self, key: tuple[Hashable, bytes], tree: list[Any], max_rows: int) -> None:
        self._runs[key] = tree
        self._rows += tree[1]
        while self._rows > max_rows and self._runs:
            oldest = next(iter(self._runs))
            self._rows -= self._runs.pop(oldest)[1]

