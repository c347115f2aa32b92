"""Serialised chain tuples ``(parent, tuple(block tokens), extra)`` for many blocks at once.

vLLM hashes one tuple per block, pickled (protocol 5) or canonical CBOR. Both encodings of a
tuple of non-negative ints follow fixed byte patterns per value range, so every block's bytes
are built here with numpy, except the parent digest, which the chain loop puts between a
block's *head* and *body*: ``payload = head + parent + body``. Per block (``W`` = digest
width, ``h`` = tokens):

* pickle: head ``80 05 95 <frame length, 8 bytes LE> 43 W``; body ``94 [28 if h > 3]``, the
  token records (``4b`` + 1 byte below 2**8, ``4d`` + 2 bytes below 2**16, ``4a`` + 4 bytes
  below 2**31, else ``8a n`` + n two's-complement bytes, n = bit_length // 8 + 1), ``74 94``
  (``85``/``86``/``87`` ``94`` for h = 1..3), the extra slot, ``87 94 2e``. The parent has memo
  index 0 and the token tuple 1, so the extra slot's encoding starts at memo index 2.
* CBOR: head ``83 58 20`` (``83 50`` for 16 bytes), the same for every block; body: the array
  head, shortest unsigned ints (below 24 in the head byte, else ``18``/``19``/``1a``/``1b`` + 1,
  2, 4 or 8 bytes big-endian), the extra slot.

How the bytes are placed: each token record, and each gap between two blocks' tokens (a
tail and the next opening), is an 8-byte word (two for records over 8 bytes) whose bytes past
the piece are zero. The blob holds the bodies back to back; the words are stored at their byte
offsets, in ascending order, through an unaligned uint64 view, so a word's zero overhang is
overwritten by the pieces that follow. numpy assigns a 1-D integer index in order; a probe
checks that once per process, and otherwise each piece's own bytes are stored one column at a
time (well defined, slower).
A pickle whose frame reaches 64 KiB gets a second FRAME opcode: :func:`build` returns ``None``
and such blocks go to the per-block path.

:func:`plain` is the same layout for blocks without extra keys and ids below ``2**31`` (pickle)
or ``2**32`` (CBOR), in fewer numpy calls (each has a fixed cost of microseconds, which a
4,096-token prompt feels): one table lookup by the id's float64 exponent and top mantissa bits
gives each record's length and opcode (an id out of range gives a length that flags it), one
running sum places them, one unaligned store writes them, one more writes the gaps, and
``struct`` cuts the bodies.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import Any, Final

import cbor2
import numpy as np
from numpy.typing import NDArray

__all__ = [
    "PICKLE_FRAME_LIMIT",
    "Payloads",
    "PlainLayout",
    "build",
    "cbor_head",
    "extra_encoding",
    "pickle_head",
    "pickle_heads",
    "plain",
    "plain_layout",
]

U8 = NDArray[np.uint8]
I64 = NDArray[np.int64]
U64 = NDArray[np.uint64]
Ints = NDArray[np.integer[Any]]

# A frame body below this is one frame (CPython starts another at 64 KiB).
PICKLE_FRAME_LIMIT: Final = 65_000

_PICKLE_END: Final = b"\x87\x94."  # TUPLE3, MEMOIZE, STOP
_PICKLE_HEAD: Final = b"\x80\x05\x95"  # PROTO 5, FRAME
_MAX_TABLE: Final = 1 << 12  # piece lengths with a precomputed struct code

# pickle, ids < 2**31: BININT1, BININT2, BININT
_PK_OP = np.array([0x4B, 0x4D, 0x4A], dtype=np.uint64)
_PK_LEN = np.array([2, 3, 5], dtype=np.int64)
# pickle LONG1 sizes for 2**31 <= id < 2**63, by bit length
_PK_LONG_BOUNDS = np.array([1 << 31, 1 << 39, 1 << 47, 1 << 55], dtype=np.uint64)
# CBOR, ids < 2**32, per class (below 24, 1, 2, 4 value bytes): the head byte above the
# value, the shift that brings the record's first byte to the top, the record length
_CB_HEAD_SHIFTED = np.array([0, 0x18 << 8, 0x19 << 16, 0x1A << 32], dtype=np.uint64)
_CB_LIFT = np.array([56, 48, 40, 24], dtype=np.uint64)
_CB_LEN = np.array([1, 2, 3, 5], dtype=np.int64)
# the same as small tables, for the one-word path (less memory to touch)
_PK_OP8 = _PK_OP.astype(np.uint8)
_PK_LEN8 = _PK_LEN.astype(np.uint8)
_CB_LIFT8 = _CB_LIFT.astype(np.uint8)
_CB_LEN8 = _CB_LEN.astype(np.uint8)

_U8_SHIFT = np.uint64(8)
_codes: list[NDArray[np.bytes_]] = []  # the struct codes "    0s" ... "4095s", built once
_heads: dict[int, dict[int, bytes]] = {}  # width -> body length -> pickle head


@dataclass(frozen=True)
class Payloads:
    """Block ``i``'s payload is ``heads[i] + parent + bodies[i]``; ``shared_head`` is the head
    when every block has the same (CBOR), else ``None``."""

    heads: list[bytes]
    bodies: list[bytes]
    shared_head: bytes | None = None


def pickle_head(width: int, body_length: int) -> bytes:
    """The pickle head of a payload whose body has ``body_length`` bytes: PROTO, FRAME
    (payload length - 11), BINBYTES of the parent's ``width``."""
    return _PICKLE_HEAD + (width + body_length + 2).to_bytes(8, "little") + b"C" + bytes([width])


def cbor_head(width: int) -> bytes:
    """The constant CBOR head: a 3-array, then the parent's byte-string head."""
    return b"\x83" + _cbor_uint_head(2, width)


def _cbor_uint_head(major: int, value: int) -> bytes:
    """A CBOR head of major type ``major`` with the shortest argument for ``value``."""
    mt = major << 5
    if value < 24:
        return bytes([mt | value])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes([mt | info]) + value.to_bytes(size, "big")
    raise ValueError("CBOR argument beyond 64 bits")


def _body_open(block_size: int, cbor: bool) -> bytes:
    """The body's start, before the token records."""
    if cbor:
        return _cbor_uint_head(4, block_size)
    return b"\x94(" if block_size > 3 else b"\x94"  # MEMOIZE (the parent), MARK


def _body_close(block_size: int, cbor: bool) -> bytes:
    """What follows the token records, before the extra slot."""
    if cbor:
        return b""
    return (bytes([0x84 + block_size]) if block_size <= 3 else b"t") + b"\x94"


def extra_encoding(extra: object, width: int, cbor: bool) -> bytes:
    """The bytes the extra slot ``extra`` takes in a block's payload (memo indices from 2)."""
    if cbor:
        return cbor2.dumps(extra, canonical=True)
    dump = pickle.dumps((bytes(width), (0,), extra), protocol=pickle.HIGHEST_PROTOCOL)
    # header and parent (13 + width), MEMOIZE, then BININT1 0, TUPLE1, MEMOIZE; the end fixed.
    start = 13 + width + 1 + 4
    if dump[start - 4 : start] != b"\x4b\x00\x85\x94" or not dump.endswith(_PICKLE_END):
        raise ValueError("unexpected pickle layout for an extra slot")
    return dump[start : -len(_PICKLE_END)]


def _token_words(tokens: U64, cbor: bool) -> tuple[U64, I64]:
    """Each token's record as ``(n, 1)`` or ``(n, 2)`` uint64 words (little-endian bytes, zero
    beyond the record), and the record lengths."""
    n = tokens.size
    tokens = tokens.astype(np.uint64, copy=False)
    big = int(tokens.max()) >= (1 << 32 if cbor else 1 << 31)
    if not cbor:
        cls = (tokens > 0xFF).view(np.uint8)
        cls += tokens > 0xFFFF
        small = (tokens << _U8_SHIFT) | _PK_OP.take(cls)
        if not big:
            return small.reshape(n, 1), _PK_LEN.take(cls)
        long_rows = tokens >= np.uint64(1 << 31)
        nbytes = np.searchsorted(_PK_LONG_BOUNDS, tokens, side="right").astype(np.uint64) + 4
        words = np.zeros((n, 2), dtype=np.uint64)
        long_first = np.uint64(0x8A) | (nbytes << _U8_SHIFT) | (tokens << np.uint64(16))
        words[:, 0] = np.where(long_rows, long_first, small)
        words[:, 1] = np.where(long_rows, tokens >> np.uint64(48), np.uint64(0))
        lengths = np.where(long_rows, nbytes.astype(np.int64) + 2, _PK_LEN.take(cls))
        return words, lengths
    cls = (tokens > 23).view(np.uint8)
    cls += tokens > 0xFF
    cls += tokens > 0xFFFF
    # the record (head byte, then the value big-endian) moved to the top bytes, then swapped
    first = ((_CB_HEAD_SHIFTED.take(cls) | tokens) << _CB_LIFT.take(cls)).byteswap()
    lengths = _CB_LEN.take(cls)
    if not big:
        return first.reshape(n, 1), lengths
    huge = tokens > np.uint64(0xFFFFFFFF)  # 1b + 8 bytes
    words = np.zeros((n, 2), dtype=np.uint64)
    top = ((tokens >> _U8_SHIFT) | np.uint64(0x1B << 56)).byteswap()
    words[:, 0] = np.where(huge, top, first)
    words[:, 1] = np.where(huge, tokens & np.uint64(0xFF), np.uint64(0))
    lengths[huge] = 9
    return words, lengths


def _probe_in_order() -> bool:
    """Whether overlapping unaligned words assigned through a 1-D index land in index order."""
    blob = np.zeros(24, dtype=np.uint8)
    view = np.ndarray((17,), dtype=np.uint64, buffer=blob, strides=(1,))
    view[np.array([0, 2, 3, 9], dtype=np.int64)] = np.array(
        [0x0807060504030201, 0x0B0A, 0x0F0E0D0C, 0x11], dtype=np.uint64
    )
    want = bytes([1, 2, 10, 12, 13, 14, 15, 0, 0, 17]) + bytes(14)
    return blob.tobytes() == want


_IN_ORDER: Final = _probe_in_order()


def _place(blob: U8, at: I64, words: U64, lengths: Ints) -> None:
    """Store piece ``i``, ``lengths[i]`` bytes held little-endian in ``words[i]``, at byte
    ``at[i]`` of ``blob`` (ascending, not overlapping; 16 spare bytes at the end)."""
    if words.shape[1] == 1:
        cells = at
    else:
        cells = (at[:, None] + np.arange(0, 8 * words.shape[1], 8, dtype=np.int64)).reshape(-1)
    if _IN_ORDER:  # a word's zero overhang is overwritten by the pieces after it
        view = np.ndarray((blob.size - 7,), dtype=np.uint64, buffer=blob, strides=(1,))
        view[cells] = words.reshape(-1)
        return
    data = words.astype("<u8").view(np.uint8).reshape(at.size, -1)
    for j in range(data.shape[1]):  # only the pieces' own bytes, one column at a time
        mine = lengths > j
        blob[at[mine] + j] = data[mine, j]


def _piece_codes() -> NDArray[np.bytes_]:
    if not _codes:  # struct ignores the spaces between codes
        _codes.append(np.array([f"{i:>5d}s".encode() for i in range(_MAX_TABLE)], dtype="S6"))
    return _codes[0]


def _split(blob: U8, lengths: I64, longest: int) -> tuple[bytes, ...]:
    """``blob`` cut into consecutive pieces of ``lengths`` bytes (none over ``longest``)."""
    if longest < _MAX_TABLE or int(lengths.max()) < _MAX_TABLE:
        fmt = _piece_codes().take(lengths).tobytes().decode("ascii")
        return struct.Struct(fmt).unpack_from(blob.data)
    data = blob.tobytes()
    ends = np.cumsum(lengths).tolist()
    return tuple(data[s:e] for s, e in zip([0, *ends[:-1]], ends))


def pickle_heads(width: int, lengths: list[int]) -> list[bytes]:
    """The pickle head of each body length: PROTO, FRAME (payload length - 11), BINBYTES W."""
    lo, hi = min(lengths), max(lengths)
    table = _heads.setdefault(width, {})
    for n in range(lo, hi + 1):
        if n not in table:
            table[n] = pickle_head(width, n)
    return list(map(table.__getitem__, lengths))


def _small_records(grid: Ints, cbor: bool, words: U64, lengths: Ints) -> None:
    """Records of ids below 2**31 (pickle) or 2**32 (CBOR), one word each, into ``words``
    and their lengths into ``lengths`` (views of the same shape as ``grid``)."""
    if cbor:
        cls = (grid > 23).view(np.uint8)
        cls += grid > 0xFF
        cls += grid > 0xFFFF
        np.bitwise_or(_CB_HEAD_SHIFTED.take(cls), grid, out=words)
        words <<= _CB_LIFT8.take(cls)
        words.byteswap(inplace=True)
        lengths[...] = _CB_LEN8.take(cls)
        return
    cls = (grid > 0xFF).view(np.uint8)
    cls += grid > 0xFFFF
    np.left_shift(grid, _U8_SHIFT, out=words)
    words |= _PK_OP8.take(cls)
    lengths[...] = _PK_LEN8.take(cls)


def build(
    tokens: U64,
    block_size: int,
    width: int,
    cbor: bool,
    extras: bytes | list[bytes],
    top: int | None = None,
) -> Payloads | None:
    """Heads and bodies of the ``tokens.size // block_size`` full blocks.

    ``extras`` is the extra slot's encoding (:func:`extra_encoding`), one for all blocks or
    one per block; ``top`` the largest id, if known. ``None`` when a pickle frame would reach
    :data:`PICKLE_FRAME_LIMIT`.
    """
    h = block_size
    nb = tokens.size // h
    if nb == 0:
        return Payloads([], [])
    tokens = tokens[: nb * h]
    if top is None:
        top = int(tokens.max())
    opening = _body_open(h, cbor)
    closing = _body_close(h, cbor)
    end = b"" if cbor else _PICKLE_END
    if isinstance(extras, bytes):
        gaps = [closing + extras + end + opening]
    else:
        gaps = [closing + e + end + opening for e in extras]
    small = top < (1 << 32 if cbor else 1 << 31)
    # Pieces in blob order: the first opening, then per block h records and the gap (the
    # block's tail and the next opening). units: their lengths; starts: their offsets.
    count = nb * (h + 1) + 1
    one_word = small and len(gaps) == 1 and len(gaps[0]) <= 8
    # the common case keeps the lengths in bytes: less memory to go through
    units = np.empty(count, dtype=np.uint8 if one_word else np.int64)
    units[0] = len(opening)
    grid = units[1:].reshape(nb, h + 1)
    if len(gaps) == 1:
        grid[:, h] = len(gaps[0])
    else:
        grid[:, h] = np.fromiter(map(len, gaps), dtype=np.int64, count=nb)
    if one_word:
        cells = np.empty(count, dtype=np.uint64)  # one word per piece, placed in one go
        cells[0] = int.from_bytes(opening, "little")
        cell_grid = cells[1:].reshape(nb, h + 1)
        cell_grid[:, h] = int.from_bytes(gaps[0], "little")
        _small_records(tokens.reshape(nb, h), cbor, cell_grid[:, :h], grid[:, :h])
        words = None
    else:
        words, tok_len = _token_words(tokens, cbor)
        grid[:, :h] = tok_len.reshape(nb, h)
    starts = np.empty(count, dtype=np.int64)
    starts[0] = 0
    np.cumsum(units[:-1], dtype=np.int64, out=starts[1:])
    body_len = grid.sum(axis=1, dtype=np.int64)  # records + gap = opening + records + tail
    record_max = 5 if small else 10  # BININT / 32-bit CBOR, else LONG1 (10) or 64-bit (9)
    longest = len(opening) + record_max * h + max(map(len, gaps))  # a bound on body_len
    if (
        not cbor
        and longest + 2 + width >= PICKLE_FRAME_LIMIT
        and int(body_len.max()) + 2 + width >= PICKLE_FRAME_LIMIT
    ):
        return None
    total = int(starts[-1]) + int(units[-1]) - len(opening)
    blob = np.zeros(total + len(opening) + 16, dtype=np.uint8)
    if words is None:
        _place(blob, starts, cells.reshape(-1, 1), units)
    else:
        piece_grid = starts[1:].reshape(nb, h + 1)
        _place(blob, piece_grid[:, :h].reshape(-1), words, grid[:, :h].reshape(-1))
        blob[: len(opening)] = np.frombuffer(opening, dtype=np.uint8)
        gap_at = piece_grid[:, h]
        gap_len = grid[:, h]
        joined = np.frombuffer(b"".join(gaps), dtype=np.uint8)
        if len(gaps) == 1:
            blob[gap_at[:, None] + np.arange(joined.size)] = joined
        else:
            shift = gap_at - (np.cumsum(gap_len) - gap_len)
            blob[np.arange(joined.size) + np.repeat(shift, gap_len)] = joined
    bodies = list(_split(blob[:total], body_len, longest))
    if cbor:
        head = cbor_head(width)
        return Payloads([head] * nb, bodies, head)
    return Payloads(pickle_heads(width, body_len.tolist()), bodies)


# ------------------------------------------------------------------------------ plain blocks
_FAR: Final = 1 << 40  # a record length that marks an id out of the table's range
_EIGHT = np.uint64(8)


@dataclass(frozen=True)
class _Table:
    """Per id class, indexed by ``float64(id).bits >> 49`` (exponent, 3 mantissa bits):
    the record length, the record's first byte and (CBOR) the right shift that brings the
    byte-swapped id's value bytes next to it."""

    length: I64
    first: NDArray[np.uint8]
    shift: NDArray[np.uint8]


def _table(cbor: bool) -> _Table:
    """The class table (built once per encoding)."""
    if cbor in _tables:
        return _tables[cbor]
    index = np.arange(1 << 14, dtype=np.int64)
    power = (index >> 3) - 1023
    # the smallest id of each index (exact for ids below 2**53; 0 has index 0)
    usable = (power >= 0) & (power <= 40)
    low = np.where(usable, (1 << power.clip(0, 62)) + ((index & 7) << power.clip(0, 62)) // 8, 0)
    if cbor:  # below 24, 2**8, 2**16, 2**32
        bounds = np.array([24, 1 << 8, 1 << 16, 1 << 32], dtype=np.int64)
        lengths, firsts, shifts = [1, 2, 3, 5], [0, 0x18, 0x19, 0x1A], [56, 48, 40, 24]
    else:  # BININT1, BININT2, BININT (below 2**31)
        bounds = np.array([1 << 8, 1 << 16, 1 << 31], dtype=np.int64)
        lengths, firsts, shifts = [2, 3, 5], [0x4B, 0x4D, 0x4A], [0, 0, 0]
    cls = np.searchsorted(bounds, low, side="right")
    ok = (usable | (index == 0)) & (cls < len(lengths))
    cls = np.where(ok, cls, 0)
    table = _Table(
        np.where(ok, np.array(lengths, dtype=np.int64)[cls], _FAR),
        np.array(firsts, dtype=np.uint8)[cls],
        np.array(shifts, dtype=np.uint8)[cls],
    )
    _tables[cbor] = table
    return table


_tables: dict[bool, _Table] = {}


def _store_bytes(blob: U8, at: I64, data: bytes) -> None:
    """Write ``data`` at each offset ``at`` of ``blob``, no byte beyond (8, 4, 2, 1 at a time)."""
    done = 0
    for size, dtype in ((8, np.uint64), (4, np.uint32), (2, np.uint16), (1, np.uint8)):
        while len(data) - done >= size:
            view = np.ndarray((blob.size - size + 1,), dtype=dtype, buffer=blob, strides=(1,))
            view[at + done if done else at] = int.from_bytes(data[done : done + size], "little")
            done += size


@dataclass(frozen=True)
class PlainLayout:
    """What :func:`plain` needs for one block size, digest width and encoding (made once)."""

    block_size: int
    cbor: bool
    gap: bytes  # between two blocks' records: a body's tail, then the next body's opening
    skip: int  # bytes of the first gap before the first body (its tail closes no block)
    table: _Table
    ok: bool  # False: bodies may be too long for the struct codes (or pickle's one frame)


def plain_layout(block_size: int, width: int, cbor: bool) -> PlainLayout:
    """The :class:`PlainLayout` of plain blocks (extra slot ``None``)."""
    opening = _body_open(block_size, cbor)
    tail = _body_close(block_size, cbor) + extra_encoding(None, width, cbor)
    if not cbor:
        tail += _PICKLE_END
    gap = tail + opening
    longest = 5 * block_size + len(gap)  # 5-byte records (BININT / 32-bit CBOR)
    ok = longest < _MAX_TABLE and longest + 2 + width < PICKLE_FRAME_LIMIT
    return PlainLayout(block_size, cbor, gap, len(tail), _table(cbor), ok and _IN_ORDER)


def plain(
    tokens: NDArray[np.unsignedinteger[Any]], layout: PlainLayout
) -> tuple[bytes, ...] | None:
    """The bodies of the ``tokens.size // block_size`` full blocks whose extra slot is ``None``;
    the head of each is :func:`pickle_head` (by the body's length) or :func:`cbor_head`.

    ``None`` when an id is beyond the fast range (``2**31`` pickle, ``2**32`` CBOR) or the
    layout is not covered: the caller then uses :func:`build`.
    """
    h = layout.block_size
    nb = tokens.size // h
    n = nb * h
    if nb == 0 or not layout.ok:
        return None
    if n != tokens.size:
        tokens = tokens[:n]
    table = layout.table
    gap = layout.gap
    g = len(gap)
    cls = tokens.astype(np.float64).view(np.int64)
    cls >>= 49
    # Gap i (a body's tail, then the next body's opening; the first tail closes no block)
    # sits at starts[i*h], token j's record at g + starts[j]; gap nb ends the blob.
    starts = np.empty(n + 1, dtype=np.int64)
    starts[0] = 0
    table.length.take(cls, out=starts[1:])
    starts[h::h] += g
    np.add.accumulate(starts, out=starts)
    total = int(starts[n])
    if total >= _FAR:
        return None
    if layout.cbor:  # the value big-endian right after its head byte: bswap64(id) >> shift
        words = tokens.astype(">u8").view(np.uint64)
        words >>= table.shift.take(cls)
        words |= table.first.take(cls)
    else:  # the opcode, then the value little-endian
        words = tokens << _EIGHT
        words |= table.first.take(cls)
    blob = np.empty(total + g + 8, dtype=np.uint8)
    view = np.ndarray((total,), dtype=np.uint64, buffer=blob, offset=g, strides=(1,))
    view[starts[:n]] = words  # in order: each word's zero overhang is overwritten next
    gaps = starts[::h]
    if g == 8:
        np.ndarray((total + 1,), dtype=np.uint64, buffer=blob, strides=(1,))[gaps] = (
            int.from_bytes(gap, "little")
        )
    elif g == 2:
        pairs = np.ndarray((total + 1,), dtype=np.uint16, buffer=blob, strides=(1,))
        pairs[gaps] = int.from_bytes(gap, "little")
    else:
        _store_bytes(blob, gaps, gap)
    fmt = _piece_codes().take(gaps[1:] - gaps[:-1]).tobytes()
    return struct.unpack_from(fmt, blob.data, layout.skip)
