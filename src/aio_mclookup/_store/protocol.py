"""The store interfaces the coordinator talks to.

:class:`Store` is awaited. A store that can also deliver answers by calling back on the event
loop's thread (:class:`CallbackStore`, as :class:`~aio_mclookup.MooncakeStore` does) saves the
coordinator one event-loop iteration per RPC: no task waits for the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["Answer", "CallbackStore", "Epochs", "Key", "Store", "as_bytes", "epochs_of"]

Key = bytes | str
"""A store key: ASCII bytes (what plans produce) or str; Mooncake takes both."""

Answer = Callable[[list[int] | BaseException], None]
"""What a :class:`CallbackStore` calls with the answers, or with the error the awaited form
would raise."""


def as_bytes(key: Key) -> bytes:
    """A key as bytes."""
    return key.encode() if isinstance(key, str) else bytes(key)


@runtime_checkable
class Store(Protocol):
    """Anything that answers a batch of keys with one int per key, as Mooncake's
    ``batch_is_exist`` does: ``1`` present, ``0`` absent, a negative Mooncake error code on
    failure. A failure of the whole call is raised as :class:`~aio_mclookup.StoreError`."""

    async def batch_is_exist(self, keys: Sequence[Key]) -> list[int]:
        """Answer each key, in order."""
        ...


@runtime_checkable
class CallbackStore(Store, Protocol):
    """A :class:`Store` that can also answer by calling back: ``batch_is_exist_then(keys,
    then)`` returns at once and later calls ``then(answers)`` (or ``then(error)``) on the
    thread of the event loop it was called from. It raises at once only when it cannot take
    the call at all (closed)."""

    def batch_is_exist_then(self, keys: Sequence[Key], then: Answer) -> None:
        """Start answering ``keys``; ``then`` gets the outcome on the loop's thread."""
        ...


@runtime_checkable
class Epochs(Protocol):
    """What a store may say of its master, as a plain attribute ``store.epochs`` (read by
    the coordinator on every lookup: attribute reads only).

    ``epoch`` grows by one whenever the master may have lost what it answered before (it
    restarted, or another one took over): the coordinator then forgets every presence it
    cached. ``reachable`` is True / False while the master's port is known up / down, None
    when unknown."""

    epoch: int
    reachable: bool | None


def epochs_of(store: object) -> Epochs | None:
    """The store's :class:`Epochs`, if it keeps them."""
    epochs = getattr(store, "epochs", None)
    return epochs if isinstance(epochs, Epochs) else None
