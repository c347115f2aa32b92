"""Probe targets: which chunks (and so which hashes) each group probes for one request length,
sliding-window masks applied before any hash is read; cached per layout, since lengths repeat."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from .._arrays import IntArray
from .._layout.geometry import Geometry
from .._layout.groups import SlidingWindow, window_blocks

__all__ = ["ProbeTarget", "probe_targets"]


@dataclass(frozen=True, slots=True, eq=False)
class ProbeTarget:
    """Which hashes one group probes, for one request length and chunk limits.

    ``units`` are the hash indices of the probed ``chunks`` (a slice when every chunk is
    probed); ``period=(m, step)`` when they repeat every ``m`` with a shift of ``step``. When
    another group probes every one of these hashes too, ``source`` names it and
    ``positions`` are these hashes' rows among its own: one read of the request serves both.
    """

    chunks: IntArray
    units: IntArray | slice
    period: tuple[int, int] | None
    source: int | None = None
    positions: IntArray | None = None

    @property
    def nbytes(self) -> int:
        """Memory held by its arrays."""
        size = self.chunks.nbytes + (self.positions.nbytes if self.positions is not None else 0)
        return size + (self.units.nbytes if isinstance(self.units, np.ndarray) else 0)


class _TargetCache:
    """One layout's probe targets by (token_len, chunk limits), oldest dropped first."""

    __slots__ = ("entries", "nbytes")

    def __init__(self) -> None:
        self.entries: dict[tuple[int, tuple[int, ...]], tuple[ProbeTarget, ...]] = {}
        self.nbytes = 0


_CACHES: dict[int, _TargetCache] = {}
"""Each live layout's cache, by ``id``: a plain dict read (a WeakKeyDictionary's ``get`` runs
Python code on every plan); a finalizer drops the entry when the layout goes."""


def _new_cache(layout: Geometry) -> _TargetCache:
    """A new, empty cache for the layout, dropped when the layout goes."""
    key = id(layout)
    cache = _CACHES[key] = _TargetCache()
    weakref.finalize(layout, _CACHES.pop, key, None)
    return cache


def probe_targets(
    layout: Geometry, token_len: int, limits: tuple[int, ...]
) -> tuple[ProbeTarget, ...]:
    """Every group's :class:`ProbeTarget` (cached per layout: request lengths repeat)."""
    cache = _CACHES.get(id(layout))
    if cache is None:
        cache = _new_cache(layout)
    entries = cache.entries
    key = (token_len, limits)
    targets = entries.get(key)
    if targets is None:
        targets = _plan_targets(layout, token_len, limits)
        size = sum(t.nbytes for t in targets)
        while entries and (
            len(entries) >= _PROBE_CACHE_ENTRIES or cache.nbytes + size > _PROBE_CACHE_BYTES
        ):
            oldest = entries.pop(next(iter(entries)))
            cache.nbytes -= sum(t.nbytes for t in oldest)
        if size <= _PROBE_CACHE_BYTES:
            entries[key] = targets
            cache.nbytes += size
    return targets


def cached_targets(layout: Geometry) -> tuple[int, int]:
    """How many entries and bytes the layout's target cache holds (for tests)."""
    cache = _CACHES.get(id(layout))
    return (0, 0) if cache is None else (len(cache.entries), cache.nbytes)


_PROBE_CACHE_ENTRIES = 256
_PROBE_CACHE_BYTES = 64 << 20
"""Bounds on a layout's cache of probe targets (oldest entries go first): request lengths
repeat, but one entry of a 1M-token DeepSeek-V4-like request holds about 1.4 MB."""


def _plan_targets(
    layout: Geometry, token_len: int, limits: tuple[int, ...]
) -> tuple[ProbeTarget, ...]:
    """:func:`probe_targets`, computed: the masks, then which groups' hashes are a subset of
    another group's (a sliding window's tails often include the full-attention hashes)."""
    h = layout.hash_block_size
    own: list[ProbeTarget] = []
    every: list[IntArray] = []
    for gid, (spec, limit) in enumerate(zip(layout.groups, limits)):
        stride = spec.block_size // h
        chunks = _masked_chunks(layout, gid, limit, token_len)
        chunks.flags.writeable = False
        units = chunks * stride + (stride - 1)
        every.append(units)
        if chunks.size == limit:  # dense: every stride-th hash, sliced
            own.append(ProbeTarget(chunks, slice(stride - 1, limit * stride, stride), None))
            continue
        period = None  # a sliding window's tails: the same offsets in every scheduler block
        if chunks.size:
            segment = _chunks_per_segment(layout, gid)
            m = int(np.searchsorted(chunks, chunks[0] + segment))
            if units.size > m and (units[m:] - units[:-m] == segment * stride).all():
                period = (m, segment * stride)
        own.append(ProbeTarget(chunks, units, period))
    targets = list(own)
    sources: list[int] = []  # groups read on their own, largest first
    for gid in sorted(range(len(own)), key=lambda g: -every[g].size):
        units = every[gid]
        for src in sources:
            pos = np.searchsorted(every[src], units)
            if units.size and (pos < every[src].size).all() and (every[src][pos] == units).all():
                pos.flags.writeable = False
                mine = own[gid]  # (its own reading stays, for a source of mixed widths)
                targets[gid] = ProbeTarget(mine.chunks, mine.units, mine.period, src, pos)
                break
        else:
            sources.append(gid)
    return tuple(targets)


def _chunks_per_segment(layout: Geometry, gid: int) -> int:
    """Chunks of group ``gid`` per scheduler block (the period of a sliding window's mask)."""
    return max(1, layout.scheduler_block_size // layout.groups[gid].block_size)


def _masked_chunks(layout: Geometry, gid: int, limit: int, token_len: int) -> IntArray:
    """Chunk indices a group probes: all of them, or a sliding window's masked-in tails."""
    spec = layout.groups[gid]
    if not isinstance(spec, SlidingWindow):
        return np.arange(limit, dtype=np.int64)
    eagle = layout.use_eagle
    need = window_blocks(spec, eagle)
    per_segment = layout.scheduler_block_size // spec.block_size
    if need >= per_segment:
        return np.arange(limit, dtype=np.int64)
    shift = 1 if eagle else 0
    # mask[i] = i >= shift and (i - shift) % per_segment >= per_segment - need
    limit = min(limit, token_len // spec.block_size)
    offsets = np.arange(per_segment - need, per_segment, dtype=np.int64) + shift
    segments = np.arange(0, limit + per_segment, per_segment, dtype=np.int64)
    chunks = (segments[:, None] + offsets[None, :]).ravel()
    return chunks[chunks < limit]
