"""What one plan probes in one KV-cache group (:class:`GroupProbe`), and the hex and
repeated-hash helpers it is built on."""

from __future__ import annotations

import binascii
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .._arrays import IntArray
from .._rows import rows_repeat

__all__ = ["GroupProbe", "duplicate_ids", "hex_rows"]


@dataclass(eq=False, slots=True)
class GroupProbe:
    """What a plan probes in one KV-cache group.

    ``chunks`` are the probed chunk indices (ascending); key ``key_offset + j * k + n`` (``k``
    namespaces) is chunk ``chunks[j]`` in namespace ``n``. ``limit`` is how many chunks exist
    for this request. ``hash_rows`` holds the probed chunks' raw hashes, C-contiguous (None
    when of mixed widths: ``hex_items`` then holds them in hex); :attr:`hex_rows` encodes on first
    use, so a caller that needs only some keys (probing in rounds) encodes only those. Chunks
    not probed count as absent unless ``unprobed_ids`` maps them to a probed chunk with the
    same hash; :attr:`hash_ids` links probed chunks that share a hash (vLLM records presence
    per hash), computed on first use.
    """

    group_id: int
    chunks: IntArray
    limit: int
    key_offset: int
    hex_items: list[bytes]
    hash_rows: npt.NDArray[np.uint8] | None
    unprobed_ids: IntArray | None
    subset_of: GroupProbe | None = field(default=None, init=False)
    """A group whose probed hashes include all of this one's (rows taken from its rows)."""
    _hex_rows: npt.NDArray[np.uint8] | None = field(default=None, init=False)
    _hash_ids: IntArray | None = field(default=None, init=False)
    _hash_ids_known: bool = field(default=False, init=False)

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


def duplicate_ids(rows: npt.NDArray[np.uint8] | None, items: list[bytes]) -> IntArray | None:
    """Ids that are equal exactly where hashes are equal, or None when all differ."""
    if rows is not None:
        if not rows_repeat(rows):
            return None
        items = [bytes(r) for r in rows]
    if len(set(items)) == len(items):
        return None
    first: dict[bytes, int] = {}
    return np.array([first.setdefault(h, i) for i, h in enumerate(items)], dtype=np.int64)
