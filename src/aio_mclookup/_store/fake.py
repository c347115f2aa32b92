"""An in-process FAKE store for unit tests and examples: a set of present keys, no Mooncake."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .._backend import sleep
from .._errors import StoreError
from .protocol import Key, as_bytes

__all__ = ["FakeStore"]


class FakeStore:
    """In-process FAKE store for unit tests and examples: a set of present keys, no Mooncake.

    It records every call (``calls``) so tests can check batching. ``delay`` adds latency per call;
    ``fail_with`` makes the next calls fail: an int raises :class:`StoreError` with that code
    (what :class:`MooncakeStore` raises when Mooncake answers every key with one error code),
    an exception is raised as it is.

    ``epochs`` is the fake itself: ``epoch`` and ``reachable`` (see
    :class:`~aio_mclookup.Epochs`); :meth:`restart` plays a master that restarted empty.
    """

    def __init__(self, present: Iterable[Key] = (), *, delay: float = 0.0) -> None:
        self.present: set[bytes] = {as_bytes(k) for k in present}
        self.delay = delay
        self.calls: list[list[bytes]] = []
        self.fail_with: int | BaseException | None = None
        self.answers: dict[bytes, int] = {}
        self.epoch = 0
        self.reachable: bool | None = None
        self.epochs = self

    def restart(self) -> None:
        """A master restarted empty: every key absent, a new epoch."""
        self.present.clear()
        self.epoch += 1

    def add(self, keys: Iterable[Key]) -> None:
        """Mark keys present."""
        self.present.update(as_bytes(k) for k in keys)

    def discard(self, keys: Iterable[Key]) -> None:
        """Mark keys absent."""
        self.present.difference_update(as_bytes(k) for k in keys)

    async def batch_is_exist(self, keys: Sequence[Key]) -> list[int]:
        batch = [as_bytes(k) for k in keys]
        self.calls.append(batch)
        if self.delay:
            await sleep(self.delay)
        failure = self.fail_with
        if isinstance(failure, BaseException):
            raise failure
        if failure is not None:
            raise StoreError(f"fake store RPC failed with code {failure}", code=failure)
        return [self.answers.get(k, 1 if k in self.present else 0) for k in batch]
