"""The lookup service: one coordinator on an event loop, driven by :mod:`.messages`. It runs
in the scheduler's sidecar process (``sidecar``) or, over an in-process store, on a thread of
its own (``channels``); it does no I/O of its own but the coordinator's store calls."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from .._coordinator.options import CoordinatorOptions
from .._coordinator.shell import LookupCoordinator
from .._layout.layout import KVLayout
from .._resolve.result import LookupResult
from .._store.protocol import Store
from .messages import (
    Answers,
    Outcome,
    Reply,
    Reset,
    ResetDone,
    Stats,
    StatsRequest,
    Submit,
    boundary_pairs,
)

__all__ = ["LookupService"]


def _hash_rows(hashes: bytes | list[bytes], width: int) -> Any:
    """The lookup's block hashes as the coordinator takes them: joined ones as a 2-D uint8
    array (its fast form); a list as it came. A blob that is not whole rows is refused."""
    if not width:
        return hashes
    assert isinstance(hashes, bytes)
    if len(hashes) % width:
        raise ValueError(f"{len(hashes)} bytes of hashes are not rows of {width}")
    return np.frombuffer(hashes, dtype=np.uint8).reshape(-1, width)


class LookupService:
    """Answers :class:`Submit` lookups through one coordinator; every reply goes to ``emit``
    (on the loop's thread), answers batched: one :class:`Answers` per loop iteration.

    :meth:`handle` takes :class:`Submit`, :class:`StatsRequest` and :class:`Reset` (whose
    sender waits for :class:`ResetDone` before it sends more); :meth:`aclose` ends it (closing
    is the transport's: :class:`~.messages.Close` never reaches here)."""

    def __init__(
        self,
        layout: KVLayout,
        store: Store,
        options: CoordinatorOptions,
        emit: Callable[[Reply], None],
    ) -> None:
        self._layout = layout
        self._store = store
        self._options = options
        self._emit = emit
        self._coordinator: LookupCoordinator | None = None
        self._tasks: dict[int, asyncio.Task[LookupResult]] = {}
        self._outbox: list[Outcome] = []
        self._resetting: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._coordinator = await self._new_coordinator()

    async def _new_coordinator(self) -> LookupCoordinator:
        coordinator = LookupCoordinator(self._layout, self._store, options=self._options)
        await coordinator.__aenter__()
        return coordinator

    def handle(self, request: Submit | StatsRequest | Reset) -> None:
        """Take one request (on the loop's thread)."""
        if isinstance(request, Submit):
            self._submit(request)
        elif isinstance(request, StatsRequest):
            assert self._coordinator is not None
            self._emit(Stats(self._coordinator.stats()))
        elif isinstance(request, Reset):
            self._resetting = asyncio.ensure_future(self._reset())
        else:
            raise TypeError(f"not a lookup-service request: {type(request).__name__}")

    def _submit(self, request: Submit) -> None:
        for ticket in request.discard:
            task = self._tasks.pop(ticket, None)
            if task is not None:
                task.cancel()
        coordinator = self._coordinator
        assert coordinator is not None
        for ticket, num_tokens, hashes, width in request.lookups:
            try:
                rows = _hash_rows(hashes, width)
            except ValueError as exc:
                self._finished((ticket, None, repr(exc)))
                continue
            task = asyncio.ensure_future(coordinator.lookup_result(num_tokens, rows))
            self._tasks[ticket] = task
            task.add_done_callback(functools.partial(self._settle, ticket))

    def _settle(self, ticket: int, task: asyncio.Task[LookupResult]) -> None:
        if self._tasks.get(ticket) is task:
            del self._tasks[ticket]
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._finished((ticket, None, repr(exc)))
            return
        result = task.result()
        self._finished((ticket, result.hit_length, boundary_pairs(result)))

    def _finished(self, outcome: Outcome) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._send_answers)
        self._outbox.append(outcome)

    def _send_answers(self) -> None:
        outcomes, self._outbox = self._outbox, []
        if outcomes:
            self._emit(Answers(outcomes))

    def _cancel_all(self) -> None:
        tasks, self._tasks = self._tasks, {}
        for task in tasks.values():
            task.cancel()

    async def _reset(self) -> None:
        self._cancel_all()
        old, self._coordinator = self._coordinator, await self._new_coordinator()
        if old is not None:
            await old.aclose()
        self._emit(ResetDone())

    async def aclose(self) -> None:
        """Cancel every lookup and close the coordinator (the store is the caller's)."""
        self._cancel_all()
        coordinator, self._coordinator = self._coordinator, None
        if coordinator is not None:
            await coordinator.aclose()
