"""Key assembly: ``prefix@hex(hash)`` for some or all of a plan's keys, with numpy (many keys of
one width) or bytes concatenation (a few keys, or mixed widths).

:func:`hex_keys` and :func:`hex_join` (keys and items of hash rows, one object each) and
:func:`split_items` (an RPC's keys from its items) have a compiled twin, ``_keys_c``, which runs
when it was built and then builds every key and item the rounds ask for; their Python code is
the reference and the fallback (:mod:`.._native`), beside the numpy paths the pure-Python
rounds use."""

from __future__ import annotations

import binascii
import functools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import _native
from .._arrays import IntArray, KeyIndices
from .._layout.geometry import ITEM_END, Geometry, item_joiners
from .probe import GroupProbe, hex_rows

__all__ = [
    "COMPILED", "ITEM_END", "assemble", "assemble_items", "assemble_range", "build_key_array",
    "hex_join", "hex_keys", "ints", "item_joiners", "one_key", "split_items",
]

_C: Any = _native.load("aio_mclookup._plan._keys_c")
COMPILED = _C is not None
"""Whether :func:`hex_keys` and :func:`hex_join` run compiled (then they build every key and
item of a round: faster than the numpy paths at every size)."""

_FEW_KEYS = 48  # fewer keys than this are built by concatenation: faster than the array path
_SPLIT_KEYS = 96  # likewise, where one split builds them (one namespace; see _concatenate)
_FEW_ITEMS = 4  # fewer items than this are built by concatenation


def build_key_array(
    geometry: Geometry, groups: tuple[GroupProbe, ...], num_keys: int
) -> npt.NDArray[np.bytes_] | None:
    """``prefix@hex`` rows of every group in one buffer (None: widths differ)."""
    probes = [p for p in groups if p.chunks.size]
    widths = set()
    for probe in probes:
        prefix_rows = geometry.prefix_rows[probe.group_id]
        if prefix_rows is None or probe.hash_rows is None:
            return None
        widths.add(prefix_rows.shape[1] + 2 * probe.hash_rows.shape[1])
    if len(widths) != 1:
        return None
    width = widths.pop()
    buf = np.empty((num_keys, width), dtype=np.uint8)
    for probe in probes:
        prefix_rows = geometry.prefix_rows[probe.group_id]
        assert prefix_rows is not None and probe.hex_rows is not None
        k = prefix_rows.shape[0]
        n = probe.hex_rows.shape[0]
        part = buf[probe.key_offset : probe.key_offset + n * k].reshape(n, k, width)
        _glue(part, prefix_rows, probe.hex_rows[:, None, :])
    array: npt.NDArray[np.bytes_] = buf.view(f"S{width}").ravel()
    return array


def assemble(
    geometry: Geometry, probe: GroupProbe, local: IntArray | list[int] | None
) -> list[bytes]:
    """``prefix@hex`` for a group's keys (all, or the group-local key indices given,
    ascending), hex-encoding only the hashes they need."""
    k = len(geometry.prefix_bytes[probe.group_id])
    if local is None:
        return assemble_range(geometry, probe, 0, probe.chunks.size * k)
    if COMPILED and probe.has_rows:
        return _compiled_keys(geometry, probe, ints(local))
    local = np.asarray(local, dtype=np.int64)
    prefix_rows = geometry.prefix_rows[probe.group_id]
    if prefix_rows is None or probe.hash_rows is None or local.size < _few(geometry, probe):
        return concatenate(geometry, probe, local)
    hexed = probe.hex_at(local // k)
    plen = prefix_rows.shape[1]
    width = plen + hexed.shape[1]
    flat = np.empty((local.size, width), dtype=np.uint8)
    _glue(flat, prefix_rows if k == 1 else prefix_rows[local % k], hexed)
    keys: list[bytes] = flat.view(f"S{width}").ravel().tolist()
    return keys


def assemble_range(geometry: Geometry, probe: GroupProbe, lo: int, hi: int) -> list[bytes]:
    """A group's keys ``lo`` to ``hi`` (group-local key indices), from slices of its
    hashes."""
    if COMPILED and probe.has_rows:
        return _compiled_keys(geometry, probe, range(lo, hi))
    prefix_rows = geometry.prefix_rows[probe.group_id]
    if prefix_rows is None or probe.hash_rows is None or hi - lo < _few(geometry, probe):
        return concatenate(geometry, probe, range(lo, hi))
    k, plen = prefix_rows.shape
    first, last = lo // k, (hi - 1) // k + 1
    encoded = probe.hex_if_encoded
    if encoded is not None:
        hexed = encoded[first:last]
    else:
        hexed = hex_rows(probe.hash_rows[first:last])
    n, width = last - first, plen + hexed.shape[1]
    buf = np.empty((n, k, width), dtype=np.uint8)
    _glue(buf, prefix_rows, hexed[:, None, :])
    flat = buf.reshape(n * k, width)[lo - first * k : hi - first * k]
    keys: list[bytes] = flat.view(f"S{width}").ravel().tolist()
    return keys


def _compiled_keys(
    geometry: Geometry, probe: GroupProbe, local: range | list[int]
) -> list[bytes]:
    """:func:`hex_keys` of a group's keys at group-local key indices (compiled only)."""
    gid = probe.group_id
    heads = geometry.prefix_bytes[gid]
    rows, index = probe.key_rows_at(local, len(heads))
    return hex_keys(rows, index, heads, geometry.key_tails[gid])


def _few(geometry: Geometry, probe: GroupProbe) -> int:
    """Below this many keys, :meth:`_concatenate` beats the array path."""
    return _SPLIT_KEYS if geometry.key_separators[probe.group_id] else _FEW_KEYS


def one_key(geometry: Geometry, probe: GroupProbe, local: int) -> bytes:
    """The key at one group-local key index."""
    prefixes = geometry.prefix_bytes[probe.group_id]
    k = len(prefixes)
    raw = probe.hash_rows
    if raw is None:
        return prefixes[local % k] + probe.hex_items[local // k]
    row: bytes = raw[local // k].tobytes()
    return prefixes[local % k] + row.hex().encode()


def concatenate(geometry: Geometry, probe: GroupProbe, local: range | IntArray) -> list[bytes]:
    """``prefix@hex`` by bytes concatenation (group-local key indices, ascending): for a
    few keys, prefixes of different widths, or hashes of different widths.

    One C call hex-encodes the hashes. With one namespace it puts a separator (a byte in
    no prefix) between them; replacing each separator by itself plus the prefix and then
    splitting there makes every key in C, one object each. Otherwise each key is the
    prefix plus a slice of the hex."""
    prefixes = geometry.prefix_bytes[probe.group_id]
    k = len(prefixes)
    raw = probe.hash_rows
    if raw is None:
        items = probe.hex_items
        return [prefixes[i % k] + items[i // k] for i in ints(local)]
    if len(local) == 1:
        return [one_key(geometry, probe, int(local[0]))]
    if not len(local):
        return []
    if COMPILED:
        return _compiled_keys(geometry, probe, ints(local))
    w = 2 * raw.shape[1]
    if not w:  # empty hashes: the key is its prefix
        return [prefixes[i % k] for i in ints(local)]
    if isinstance(local, range):
        first = local.start // k
        rows: slice | IntArray = slice(first, (local.stop - 1) // k + 1)
    else:
        first = 0
        rows = local // k if k > 1 else local
    encoded = probe.hex_if_encoded
    sep = geometry.key_separators[probe.group_id]
    if sep is not None and encoded is None:  # (one namespace)
        prefix = prefixes[0]
        hexed = binascii.hexlify(np.ascontiguousarray(raw[rows]).data, sep, raw.shape[1])
        return (prefix + hexed.replace(sep, sep + prefix)).split(sep)
    if encoded is not None:
        text = encoded[rows].tobytes()
    else:
        text = binascii.hexlify(np.ascontiguousarray(raw[rows]).data)  # (a strided slice of
        # an immutable array is read where it is: rows a step apart)
    if k == 1:  # one key per row of text
        prefix = prefixes[0]
        return [prefix + text[j : j + w] for j in range(0, len(text), w)]
    if isinstance(local, range):
        return [
            prefixes[i % k] + text[(i // k - first) * w : (i // k - first + 1) * w]
            for i in local
        ]
    return [
        prefixes[i % k] + text[j * w : (j + 1) * w] for j, i in enumerate(local.tolist())
    ]


def assemble_items(
    geometry: Geometry, probe: GroupProbe, chunks: range | list[int] | IntArray
) -> list[bytes]:
    """One *item* per chunk (probe indices, ascending): the chunk's keys in every rank
    namespace, each followed by :data:`ITEM_END`, as one ``bytes``. The coordinator tracks
    such a chunk as one entry instead of one per namespace. Needs ``prefix_rows`` and
    ``hash_rows`` (keys of one width)."""
    prefix_rows = geometry.prefix_rows[probe.group_id]
    assert prefix_rows is not None and probe.has_rows
    if COMPILED:
        rows, index = probe.rows_at(ints(chunks))
        return hex_join(rows, index, geometry.item_joiners[probe.group_id])
    raw = probe.hash_rows
    assert raw is not None
    if len(chunks) < _FEW_ITEMS:  # (the usual round of a known prompt: its likely miss)
        prefixes = geometry.prefix_bytes[probe.group_id]
        few = []
        for chunk in ints(chunks):
            tail = raw[chunk].tobytes().hex().encode() + ITEM_END
            few.append(b"".join([prefix + tail for prefix in prefixes]))
        return few
    k, plen = prefix_rows.shape
    if isinstance(chunks, range):
        encoded = probe.hex_if_encoded
        if encoded is not None:
            hexed = encoded[chunks.start : chunks.stop]
        else:
            hexed = hex_rows(raw[chunks.start : chunks.stop])
    else:
        hexed = probe.hex_at(np.asarray(chunks, dtype=np.int64))
    n, hlen = hexed.shape
    width = plen + hlen + 1
    buf = np.empty((n, k, width), dtype=np.uint8)
    _glue(buf[..., : width - 1], prefix_rows, hexed[:, None, :])
    buf[..., width - 1] = ITEM_END[0]
    items: list[bytes] = buf.reshape(n, k * width).view(f"S{k * width}").ravel().tolist()
    return items


def hex_keys(
    rows: npt.NDArray[np.uint8],
    index: range | list[int],
    heads: Sequence[bytes],
    tails: Sequence[bytes],
) -> list[bytes]:
    """For each key index ``j`` of ``index``, with ``k = len(heads)``: ``heads[j % k] +
    hex(rows[j // k]) + tails[j % k]`` (``rows``: hash rows; ``tails`` as many as ``heads``)."""
    if _C is not None:
        return _C.hex_keys(rows, index, heads, tails)  # type: ignore[no-any-return]
    k = len(heads)
    if not k or len(tails) != k:
        raise ValueError("heads and tails must be as many, at least one")
    if len(index) and not 0 <= min(index) <= max(index) < len(rows) * k:
        raise IndexError("index out of range")
    return [heads[j % k] + rows[j // k].tobytes().hex().encode() + tails[j % k] for j in index]


def hex_join(
    rows: npt.NDArray[np.uint8], index: range | list[int], joiners: Sequence[bytes]
) -> list[bytes]:
    """For each row index ``i`` of ``index``: ``hex(rows[i]).join(joiners)`` (an item's keys
    around its hash, see ``Geometry.item_joiners``; at least two joiners)."""
    if _C is not None:
        return _C.hex_join(rows, index, joiners)  # type: ignore[no-any-return]
    if len(joiners) < 2:
        raise ValueError("joiners must hold at least 2 bytes")
    if len(index) and not 0 <= min(index) <= max(index) < len(rows):
        raise IndexError("index out of range")
    return [rows[operator.index(i)].tobytes().hex().encode().join(joiners) for i in index]


def split_items(entries: Sequence[bytes]) -> tuple[list[bytes], list[int]]:
    """The keys of key-table entries, and where each entry's keys start: an item (an entry
    ending with :data:`ITEM_END`, see :func:`assemble_items`) gives its keys, any other entry
    is a key."""
    if _C is not None:
        return _C.split_items(entries, ITEM_END)  # type: ignore[no-any-return]
    keys: list[bytes] = []
    starts: list[int] = []
    for entry in entries:
        starts.append(len(keys))
        if entry.endswith(ITEM_END):
            keys += entry.split(ITEM_END)[:-1]
        else:
            keys.append(entry)
    return keys, starts


def ints(indices: KeyIndices | list[int]) -> range | list[int]:
    """Key indices as Python ints (a range or a list stays as it is)."""
    return indices if isinstance(indices, (range, list)) else indices.tolist()


def _glue(
    out: npt.NDArray[np.uint8], prefixes: npt.NDArray[np.uint8], hexed: npt.NDArray[np.uint8]
) -> None:
    """``out[..., :plen] = prefixes`` and ``out[..., plen:] = hexed`` (broadcast). From
    :data:`_RECORDS_FROM` keys on, each prefix and each hex is copied as one void item:
    numpy then moves whole byte strings (a memcpy each) instead of running a byte-wide loop
    per row, about 15 % faster on large plans."""
    plen, width = prefixes.shape[-1], out.shape[-1]
    if plen in (0, width) or out.size < _RECORDS_FROM * width:  # (or nothing to split)
        out[..., :plen] = prefixes
        out[..., plen:] = hexed
        return
    records = out.view(_key_fields(plen, width))[..., 0]
    records["p"] = prefixes.view(f"V{plen}")[..., 0]
    records["h"] = hexed.view(f"V{width - plen}")[..., 0]


_RECORDS_FROM = 1024
"""Keys from which :func:`_glue` copies void items: below it, setting up the structured
views costs more than the byte-wide loop saves (measured at 4,096-token prompts, W1 of
docs/benchmarks.md)."""


@functools.lru_cache(maxsize=64)
def _key_fields(plen: int, width: int) -> np.dtype[np.void]:
    """A key row as two void fields: the prefix, then the hex."""
    return np.dtype(
        {"names": ["p", "h"], "formats": [f"V{plen}", f"V{width - plen}"],
         "offsets": [0, plen], "itemsize": width}
    )
