"""The exception hierarchy: everything aio_mclookup raises derives from :class:`Error`."""

from __future__ import annotations

__all__ = [
    "ClosedError",
    "Error",
    "InternalError",
    "InvalidRequest",
    "LookupTimeout",
    "Overloaded",
    "StoreError",
    "UnsupportedLayout",
    "error_label",
]


class Error(Exception):
    """Base class of every exception raised by aio_mclookup."""


class InvalidRequest(Error, ValueError):
    """A request or layout is malformed; raised in the caller before it can join a batch.

    ``field`` names the offending input when one can be named (``"block_hashes"``,
    ``"groups.1.sliding_window"``, ``"timeout"``), else ``None``.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class UnsupportedLayout(InvalidRequest):
    """The running vLLM, or its KV-cache layout, is one whose lookup the library does not
    reproduce exactly (the vLLM plug-in then keeps vLLM's own lookup client)."""


class LookupTimeout(Error, TimeoutError):
    """A lookup did not finish within its timeout."""


class StoreError(Error):
    """The store failed to answer.

    ``code`` is the Mooncake ``ErrorCode`` (for example -600 client not set up, -900 RPC failed /
    master unreachable, -901 RPC timeout) or ``None`` when the failure was an exception.
    """

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class Overloaded(Error):
    """Too much work is pending; the caller asked not to wait for room."""


class ClosedError(Error):
    """The coordinator or store is closed, or was closed while the call was pending."""


class InternalError(Error, RuntimeError):
    """A bug in aio_mclookup itself (never the store's or the caller's fault); the message
    says where. Only the lookup it happened in fails."""


def error_label(exc: BaseException) -> str:
    """A short, stable label of a failure, for metrics and HTTP error bodies: a store error's
    Mooncake code (``"-900"``; ``"exception"`` when it has none), ``"timeout"``,
    ``"overloaded"``, ``"closed"``, ``"invalid_request"``, ``"internal"``, else the type's
    name."""
    if isinstance(exc, StoreError):
        return str(exc.code) if exc.code is not None else "exception"
    for kind, label in _LABELS:
        if isinstance(exc, kind):
            return label
    return type(exc).__name__


_LABELS: tuple[tuple[type[Error], str], ...] = (
    (LookupTimeout, "timeout"),
    (Overloaded, "overloaded"),
    (ClosedError, "closed"),
    (InvalidRequest, "invalid_request"),
    (InternalError, "internal"),
)
