"""Reading a request's block hashes: a 2-D uint8 array or a sequence of bytes, gathered by
index, slice or period without touching the hashes a plan does not need."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._arrays import IntArray
from .._errors import InvalidRequest
from .probe import duplicate_ids

__all__ = ["VLLM_HASH_WIDTHS", "HashInput", "RequestHashes", "check_width"]

HashInput = Sequence[bytes] | npt.NDArray[np.uint8]


class RequestHashes:
    """Uniform access to the request's hashes: a 2-D uint8 array or a sequence of bytes."""

    def __init__(self, block_hashes: object) -> None:
        self.array: npt.NDArray[np.uint8] | None = None
        self.items: Sequence[Any] | None = None
        self._duplicates: bool | None = None
        self._immutable: bool | None = None  # (see immutable_array)
        self.bytes_only: bool | None = None
        """Whether the items are all ``bytes`` (None: not checked yet, see :meth:`only_bytes`)."""
        if type(block_hashes) is list:  # the common case, without the ABC check below
            self.items = block_hashes
            self.count = len(block_hashes)
        elif isinstance(block_hashes, np.ndarray):
            if type(block_hashes) is not np.ndarray:  # (np.matrix, memmap: read as arrays)
                block_hashes = np.asarray(block_hashes)
            if block_hashes.ndim != 2 or block_hashes.dtype != np.uint8:
                raise InvalidRequest(
                    "block_hashes as an array must be 2-D uint8 (one row per hash), got "
                    f"shape {block_hashes.shape} dtype {block_hashes.dtype}",
                    field="block_hashes",
                )
            if block_hashes.shape[1] > 1 and block_hashes.strides[1] != 1:  # (a hash's bytes
                block_hashes = np.ascontiguousarray(block_hashes)  # apart: the C kernels read
                # a row's bytes in one piece)
            self.array = block_hashes if block_hashes.shape[1] else block_hashes[:0]
            self.count = int(self.array.shape[0])
        elif isinstance(block_hashes, (bytes, bytearray, memoryview, str)) or not isinstance(
            block_hashes, Sequence
        ):
            raise InvalidRequest(
                "block_hashes must be a sequence of bytes or a 2-D uint8 array, got "
                f"{type(block_hashes).__name__}",
                field="block_hashes",
            )
        else:
            self.items = block_hashes
            self.count = len(block_hashes)

    def only_bytes(self) -> bool:
        """Whether the hashes are a sequence of ``bytes`` and nothing else (checked once, in
        C): other bytes-likes may hash or compare otherwise than their bytes."""
        if self.bytes_only is None:
            items = self.items
            self.bytes_only = items is not None and set(map(type, items)) <= {bytes}
        return self.bytes_only

    @property
    def immutable_array(self) -> bool:
        """The hashes are an array nobody can write to (a view of ``bytes``): reading them
        later needs no copy. (Found once.)"""
        if self._immutable is None:
            self._immutable = self.array is not None and _immutable(self.array)
        return self._immutable

    def snapshot(self) -> RequestHashes:
        """These hashes as they are now, safe to read later: the caller may reuse its list or
        array once planning returns (a sequence is copied as a tuple, every other bytes-like
        as its bytes; an array unless it is a read-only view of immutable bytes)."""
        items = self.items
        if items is not None:
            if self.only_bytes():  # (the usual case)
                frozen = self if type(items) is tuple else RequestHashes(tuple(items))
                frozen.bytes_only = True
                return frozen
            return RequestHashes(tuple(map(_frozen, items)))
        assert self.array is not None
        if self.immutable_array:
            return self
        copy = RequestHashes.__new__(RequestHashes)
        copy.array, copy.items, copy.count = self.array.copy(), None, self.count
        copy._duplicates, copy.bytes_only = self._duplicates, False  # (an array)
        copy._immutable = False
        return copy

    def has_duplicates(self) -> bool:
        """Whether two of the request's hashes are equal (computed once)."""
        if self._duplicates is None:
            if self.array is not None:
                self._duplicates = duplicate_ids(self.array, []) is not None
            else:
                assert self.items is not None
                if self.only_bytes():
                    distinct = len(set(self.items))
                else:  # other bytes-likes: by their bytes
                    distinct = len({_frozen(h) for h in self.items})
                self._duplicates = distinct != self.count
        return self._duplicates

    def gather(
        self, units: IntArray | slice, period: tuple[int, int] | None = None
    ) -> tuple[npt.NDArray[np.uint8] | None, list[bytes]]:
        """The hashes at ``units`` (indices, or a slice of the hashes): a (n, width) array when
        they share one width, else bytes. ``period=(m, step)`` says the ascending indices
        repeat every ``m`` with a shift of ``step`` (a sliding window's masked-in tails): a
        list is then read with ``m`` strided slices, much faster than index by index (the
        caller has checked the period)."""
        if self.array is not None:
            if isinstance(units, slice):  # the plan must not see later writes: a copy
                sliced = self.array[units]
                return (sliced if self.immutable_array else sliced.copy()), []
            return self.array.take(units, axis=0), []
        assert self.items is not None
        items = self.items
        if isinstance(units, slice):
            if isinstance(items, (list, tuple)):  # other sequences: read index by index
                return self._joined(items[units], range(units.start, units.stop, units.step))
            units = np.arange(units.start, units.stop, units.step, dtype=np.int64)
        if units.size == 0:
            return np.zeros((0, 0), dtype=np.uint8), []
        if period is not None and isinstance(items, (list, tuple)):
            m, step = period
            stop = int(units[-1]) + 1
            slices = [items[start:stop:step] for start in units[:m].tolist()]
            rows = _interleaved_rows(slices, units.size)
            if rows is not None:
                return rows, []
            full = min(map(len, slices))  # the last period may be cut short
            picked = list(itertools.chain.from_iterable(zip(*slices)))
            picked += [part[full] for part in slices if len(part) > full]
            return self._joined(picked, units)
        picked = operator.itemgetter(*units.tolist())(items)
        return self._joined(picked if units.size > 1 else (picked,), units)

    @staticmethod
    def _joined(
        items: Sequence[Any], units: IntArray | range
    ) -> tuple[npt.NDArray[np.uint8] | None, list[bytes]]:
        """``items`` (the hashes at ``units``) as one (n, width) array when they share one
        width, else as bytes."""
        if not items:
            return np.zeros((0, 0), dtype=np.uint8), []
        try:
            joined = b"".join(items)
        except TypeError:
            for pos, item in zip(units, items):
                if not isinstance(item, (bytes, bytearray, memoryview)):
                    raise InvalidRequest(
                        f"block_hashes[{pos}] must be bytes, got {type(item).__name__}",
                        field=f"block_hashes.{pos}",
                    ) from None
            raise
        n, width = len(items), len(joined) // len(items)
        if len(joined) == n * width and list(map(len, items)).count(width) == n:  # one width
            return np.frombuffer(joined, dtype=np.uint8).reshape(n, width), []
        return None, [bytes(item) for item in items]


def _frozen(item: object) -> object:
    """A hash item as ``bytes`` when it is a buffer (a bytearray, a memoryview, a numpy row,
    an ``array.array``), else as it is (the planner's checks refuse it where it is read)."""
    if type(item) is bytes:
        return item
    try:
        return memoryview(item).tobytes()  # type: ignore[arg-type]
    except TypeError:
        return item


def _immutable(array: npt.NDArray[Any]) -> bool:
    """Whether nobody can write to the array's memory: a view of a ``bytes`` object (how
    the HTTP routes decode hashes), which holds still without a copy."""
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
    return type(base) is bytes


def _interleaved_rows(
    slices: Sequence[Sequence[Any]], count: int
) -> npt.NDArray[np.uint8] | None:
    """The first ``count`` hashes taken in turn from ``slices`` (one per offset of a period,
    the longest first), as a (count, width) array; None unless every item is bytes-like with
    one length (the caller's general path then sorts out mixed widths and errors).

    Each slice is joined on its own and written into its column of a (periods, m, width)
    array: no Python-level interleaving. Every item's width is checked, since a join's length
    alone cannot tell one width from a mix."""
    out: npt.NDArray[np.uint8] | None = None
    width = 0
    for j, part in enumerate(slices):
        n = len(part)
        try:
            joined = b"".join(part)
        except TypeError:
            return None
        if out is None:
            width = len(joined) // n
            out = np.empty((n, len(slices), width), dtype=np.uint8)
        if len(joined) != n * width or list(map(len, part)).count(width) != n:
            return None
        out[:n, j] = np.frombuffer(joined, dtype=np.uint8).reshape(n, width)
    assert out is not None
    return out.reshape(out.shape[0] * out.shape[1], width)[:count]  # (width may be 0)


VLLM_HASH_WIDTHS = (32, 16)
"""The widths, in bytes, of vLLM's block hashes: 32 for ``sha256`` (the default) and
``sha256_cbor``, 16 for ``xxhash`` and ``xxhash_cbor`` (docs/routers.md)."""


def check_width(block_hashes: object, widths: tuple[int, ...], field: str = "block_hashes") -> None:
    """Raise :class:`InvalidRequest` (``field``) unless every hash is one of ``widths`` bytes
    wide, all of one width: a hash of another algorithm finds nothing, silently."""
    if isinstance(block_hashes, np.ndarray):
        rows = block_hashes.ndim == 2 and len(block_hashes)
        found = {int(block_hashes.shape[1])} if rows else set()
    elif isinstance(block_hashes, Sequence) and not isinstance(block_hashes, (str, bytes)):
        try:
            found = set(map(len, block_hashes))
        except TypeError:
            return  # not hashes at all: planning says so
    else:
        return
    if len(found) > 1:
        raise InvalidRequest(
            f"the block hashes of one request must have one width, got {len(found)} widths "
            f"({', '.join(map(str, sorted(found)))} bytes)",
            field=field,
        )
    if found and not found <= set(widths):
        expected = " or ".join(map(str, widths))
        raise InvalidRequest(
            f"the block hashes are {found.pop()} bytes wide, not {expected}: the engines' hash "
            "algorithm gives other hashes (sha256 and sha256_cbor: 32 bytes, xxhash and "
            "xxhash_cbor: 16)",
            field=field,
        )
