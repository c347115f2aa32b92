"""What one plan probes in one KV-cache group (:class:`GroupProbe`), and the hex and
repeated-hash helpers it is built on."""

from __future__ import annotations

import binascii
import contextlib
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import _native
from .._arrays import IntArray
from .._rows import rows_repeat

__all__ = ["GroupProbe", "duplicate_ids", "hex_rows"]


class GroupProbe:
    """What a plan probes in one KV-cache group.

    ``chunks`` are the probed chunk indices (ascending); key ``key_offset + j * k + n`` (``k``
    namespaces) is chunk ``chunks[j]`` in namespace ``n``. ``limit`` is how many chunks exist
    for this request. ``hash_rows`` holds the probed chunks' raw hashes, rows of bytes (None
    when of mixed widths: ``hex_items`` then holds them in hex); :attr:`hex_rows` encodes on first
    use, so a caller that needs only some keys (probing in rounds) encodes only those. Chunks
    not probed count as absent unless ``unprobed_ids`` maps them to a probed chunk with the
    same hash; :attr:`hash_ids` links probed chunks that share a hash (vLLM records presence
    per hash), computed on first use.

    ``gather`` (instead of ``hash_rows``): an immutable (n, width) array of the request's
    hashes and the index of each probed chunk's hash in it. The rows are then copied out only
    when :attr:`hash_rows` is first read; :meth:`rows_at` reads them where they are (a round
    builds a few keys of a group of thousands of chunks).
    """

    __slots__ = (
        "_gather", "_hash_ids", "_hash_ids_known", "_hex_rows", "_rows", "chunks", "group_id",
        "hex_items", "key_offset", "limit", "subset_of", "unprobed_ids",
    )

    def __init__(
        self,
        group_id: int,
        chunks: IntArray,
        limit: int,
        key_offset: int,
        hex_items: list[bytes],
        hash_rows: npt.NDArray[np.uint8] | None,
        unprobed_ids: IntArray | None,
        gather: tuple[npt.NDArray[np.uint8], IntArray] | None = None,
    ) -> None:
        self.group_id = group_id
        self.chunks = chunks
        self.limit = limit
        self.key_offset = key_offset
        self.hex_items = hex_items
        self._rows = hash_rows
        self._gather = gather
        self.unprobed_ids = unprobed_ids
        self.subset_of: GroupProbe | None = None
        """A group whose probed hashes include all of this one's (rows taken from its rows)."""
        self._hex_rows: npt.NDArray[np.uint8] | None = None
        self._hash_ids: IntArray | None = None
        self._hash_ids_known = False

    def __repr__(self) -> str:
        return (
            f"GroupProbe(group_id={self.group_id}, chunks={self.chunks.size}, "
            f"limit={self.limit}, key_offset={self.key_offset})"
        )

    @property
    def hash_rows(self) -> npt.NDArray[np.uint8] | None:
        """The probed chunks' raw hashes, (n, width), or None (mixed widths)."""
        gather = self._gather
        if gather is not None:
            source, units = gather
            self._rows = source.take(units, axis=0)
            self._gather = None
        return self._rows

    @property
    def has_rows(self) -> bool:
        """The hashes share one width (:attr:`hash_rows` is not None), gathered or not."""
        return self._gather is not None or self._rows is not None

    def rows_at(
        self, positions: range | list[int]
    ) -> tuple[npt.NDArray[np.uint8], range | list[int]]:
        """Rows holding the hashes of some probe positions, and where in them: the probe's
        own rows and the positions, or (not gathered) the request's hashes and the positions'
        indices there. Needs :attr:`has_rows`."""
        gather = self._gather
        if gather is None:
            assert self._rows is not None
            return self._rows, positions
        source, units = gather
        picked = (
            units[positions.start : positions.stop : positions.step]
            if isinstance(positions, range) else units[positions]
        )
        return source, picked.tolist()

    def key_rows_at(
        self, local: range | list[int], k: int
    ) -> tuple[npt.NDArray[np.uint8], range | list[int]]:
        """As :meth:`rows_at`, for group-local key indices of ``k`` namespaces (key ``i`` is
        row ``i // k``, namespace ``i % k``, in both the rows and the indices returned)."""
        gather = self._gather
        if gather is None or k == 1:  # (a key index is then a probe position)
            return self.rows_at(local)
        source, units = gather
        keys = (
            np.arange(local.start, local.stop, local.step, dtype=np.int64)
            if isinstance(local, range) else np.asarray(local, dtype=np.int64)
        )
        return source, (units[keys // k] * k + keys % k).tolist()

    @property
    def hex_rows(self) -> npt.NDArray[np.uint8] | None:
        """Every probed hash in hex, a read-only (n, 2 * width) uint8 array, not necessarily
        contiguous (None: mixed widths)."""
        if self._hex_rows is None and self.hash_rows is not None:
            self._hex_rows = hex_rows(self.hash_rows)
        return self._hex_rows

    @property
    def hex_if_encoded(self) -> npt.NDArray[np.uint8] | None:
        """:attr:`hex_rows` if every hash is encoded already, else None (encoding nothing)."""
        return self._hex_rows

    def hex_at(self, rows: IntArray) -> npt.NDArray[np.uint8]:
        """The hex of some probed hashes (by probe index), encoding only those unless every
        hash is encoded already."""
        if self._hex_rows is not None:
            return self._hex_rows[rows]
        assert self.hash_rows is not None
        return hex_rows(self.hash_rows[rows])

    @property
    def hash_ids(self) -> IntArray | None:
        """Ids equal exactly where probed hashes are equal; None when all differ."""
        if not self._hash_ids_known:
            superset = self.subset_of
            if superset is not None and superset.hash_ids is None:  # none repeat there
                self._hash_ids = None
            else:
                self._hash_ids = duplicate_ids(self.hash_rows, self.hex_items)
            self._hash_ids_known = True
        return self._hash_ids

    @property
    def dense(self) -> bool:
        """Every chunk < limit is probed (chunk index == probe index)."""
        return self.chunks.size == self.limit

    @property
    def shares_hashes(self) -> bool:
        return self.hash_ids is not None or self.unprobed_ids is not None


def hex_rows(rows: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Lower-case hex of each row, as a (n, 2 * width) uint8 array of ASCII: a read-only view
    whose rows sit ``2 * width + 1`` bytes apart (a plain array when there is nothing to
    encode)."""
    n, width = rows.shape
    if not n or not width:
        return np.zeros((n, 2 * width), dtype=np.uint8)
    # hexlify reads the array's buffer directly: a tobytes() copy would double the memory
    # traffic (and, at large sizes, the page faults). (A 65,536-entry table of hex digit
    # quads beat it only while the table sat in cache, never in the benchmarks.) A separator
    # after every row costs one byte per row but sends CPython 3.11's hexlify down its
    # grouped loop, about 25 % faster than the plain one on large inputs.
    text = binascii.hexlify(np.ascontiguousarray(rows).data, b"-", width)
    hexed: npt.NDArray[np.uint8] = np.ndarray(
        (n, 2 * width), dtype=np.uint8, buffer=text, strides=(2 * width + 1, 1)
    )
    return hexed


_REPEATS: Any = _native.load("aio_mclookup._plan._repeats_c")
"""The repeated-hash test in C (``_repeats_c.c``), or ``None``: run inline here, and as a
native job on the worker thread for large plans (``era_c``; docs/design.md, "Compiled
extensions")."""


def duplicate_ids(
    rows: npt.NDArray[np.uint8] | None, items: list[bytes], repeats: bool | None = None
) -> IntArray | None:
    """Ids that are equal exactly where hashes are equal, or None when all differ.
    ``repeats``: whether the rows repeat, when a test (a worker's job) already said so."""
    if rows is not None:
        if repeats is None and _REPEATS is not None:
            with contextlib.suppress(ValueError):  # (rows it does not read: a reversed or
                # column-strided view)
                repeats = _REPEATS.repeats(rows)  # (None: it could not tell)
        if repeats is None:
            repeats = rows_repeat(rows)
        if not repeats:
            return None
        items = [bytes(r) for r in rows]
    elif len(set(items)) == len(items):
        return None
    first: dict[bytes, int] = {}
    return np.array([first.setdefault(h, i) for i, h in enumerate(items)], dtype=np.int64)
