"""What the scheduler's client and its lookup service say to each other, and how a message is
framed on a byte stream (no I/O here: the transports in ``channels`` and ``sidecar`` move the
bytes).

A frame is a 4-byte big-endian length, then the pickled message. Both ends are this package
(the service is a child process the client started, or a thread of its own), so pickle is
safe here; :class:`FrameReader` still refuses a frame over :data:`MAX_FRAME` bytes rather than
buffer without bound.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass, field
from typing import Any, Final

from .._observe.stats import CoordinatorStats
from .._resolve.result import LookupResult

__all__ = [
    "MAX_FRAME",
    "Answers",
    "Close",
    "Closed",
    "Failed",
    "FrameError",
    "FrameReader",
    "Open",
    "Outcome",
    "Ready",
    "Reply",
    "Request",
    "Reset",
    "ResetDone",
    "Stats",
    "StatsRequest",
    "Submit",
    "boundary_pairs",
    "encode",
]

MAX_FRAME: Final = 1 << 30
"""Bytes: the largest frame either end accepts."""

_HEAD = struct.Struct(">I")


# ------------------------------------------------------------------ client -> service
@dataclass(frozen=True)
class Open:
    """The first message to a sidecar: what its lookup service needs (the layout as
    ``KVLayout.to_dict()``, the store's settings, ``CoordinatorOptions`` fields)."""

    layout: dict[str, Any]
    master_address: str
    metadata_server: str
    local_hostname: str
    tenant_id: str
    options: dict[str, Any]


@dataclass(frozen=True)
class Submit:
    """Start lookups and cancel others. Each lookup is ``(ticket, num_tokens, hashes,
    width)``: ``hashes`` the block hashes joined (each ``width`` bytes), or, with width 0, as
    the list the scheduler gave."""

    lookups: list[tuple[int, int, bytes | list[bytes], int]]
    discard: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Reset:
    """The store was wiped: start a fresh coordinator (answered by :class:`ResetDone`)."""


@dataclass(frozen=True)
class StatsRequest:
    """Ask for the coordinator's statistics (answered by :class:`Stats`)."""


@dataclass(frozen=True)
class Close:
    """Close the coordinator (and a sidecar's store), then answer :class:`Closed`."""


Request = Open | Submit | Reset | StatsRequest | Close


# ------------------------------------------------------------------ service -> client
Outcome = tuple[int, int, tuple[tuple[int, int], ...]] | tuple[int, None, str]
"""``(ticket, hit_length, tail-key boundaries as (group_id, num_tokens))``, or
``(ticket, None, what went wrong)``."""


def boundary_pairs(result: LookupResult) -> tuple[tuple[int, int], ...]:
    """A result's tail-key boundaries as an :data:`Outcome` carries them."""
    return tuple((b.group_id, b.num_tokens) for b in result.tail_key_boundaries)


@dataclass(frozen=True)
class Ready:
    """The service is up."""


@dataclass(frozen=True)
class Failed:
    """The service could not start (``message`` says why: the store's error)."""

    message: str


@dataclass(frozen=True)
class Answers:
    """Lookups that finished since the last :class:`Answers` (cancelled ones are not told)."""

    outcomes: list[Outcome]


@dataclass(frozen=True)
class ResetDone:
    """A fresh coordinator runs."""


@dataclass(frozen=True)
class Stats:
    stats: CoordinatorStats


@dataclass(frozen=True)
class Closed:
    """Everything is closed; nothing follows."""


Reply = Ready | Failed | Answers | ResetDone | Stats | Closed


# ------------------------------------------------------------------ framing
class FrameError(Exception):
    """A frame longer than :data:`MAX_FRAME`, or one that does not unpickle."""


def encode(message: Request | Reply) -> bytes:
    """One frame."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(body) > MAX_FRAME:
        raise FrameError(f"a message of {len(body)} bytes is over the {MAX_FRAME}-byte limit")
    return _HEAD.pack(len(body)) + body


class FrameReader:
    """Bytes in (as they arrive, in any pieces), whole messages out."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        """The messages completed by ``data``, in order."""
        buffer = self._buffer
        buffer += data
        out: list[Any] = []
        start = 0
        while len(buffer) - start >= _HEAD.size:
            (length,) = _HEAD.unpack_from(buffer, start)
            if length > MAX_FRAME:
                raise FrameError(f"a frame of {length} bytes is over the {MAX_FRAME}-byte limit")
            end = start + _HEAD.size + length
            if len(buffer) < end:
                break
            with memoryview(buffer) as view:
                try:
                    out.append(pickle.loads(view[start + _HEAD.size : end]))
                except Exception as exc:
                    raise FrameError(f"a frame that does not unpickle: {exc!r}") from None
            start = end
        if start:
            del buffer[:start]
        return out
