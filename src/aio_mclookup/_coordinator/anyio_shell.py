"""The anyio shell around :class:`~._coordinator.core.CoordinatorCore`, for the async libraries
other than asyncio (trio): events, cancel scopes and a task group where the asyncio shell
(:mod:`.shell`) has futures, loop timers and tasks. :class:`LookupCoordinator` picks it when it
is entered under such a library; the probing logic is the core's, the same for both.

One ``await coordinator.lookup(...)``, as in the asyncio shell: plan (in the caller), admission
(arrival order, or :class:`Overloaded`), the core begins it, the dispatcher task sends queued
keys while RPC slots are free, answers go back to the core, settled lookups wake their callers.
The lookup's deadline is a cancel scope around its waits; at the deadline the core fails it.
Admission's bookkeeping, the master epochs and what follows a step of the core are shared with
the asyncio shell (:mod:`.admission`, :mod:`.epochs`, :mod:`.driving`).

The task group (the dispatcher, RPC tasks of an awaited store, retry timers) lives from
``async with coordinator`` to its end, in the task that entered it: under trio a coordinator
is used inside ``async with`` only. Each of its tasks runs in a cancel scope of its own, so
that :meth:`AnyioShell.aclose` can stop them from anywhere (the body of the ``async with``
runs inside the group's own scope, which must not be cancelled under it).
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from .._errors import ClosedError, Error, LookupTimeout, error_label
from .._observe.stats import CoordinatorStats
from .._plan.plan import LookupPlan
from .._store.protocol import CallbackStore, Store
from .admission import Admission
from .core import CoordinatorCore, LookupState
from .driving import CoreDriver
from .epochs import EpochGuard

__all__ = ["AnyioShell"]

logger = logging.getLogger("aio_mclookup")


class _Ticket:
    """A lookup waiting for admission: woken when admitted or when the coordinator closes."""

    __slots__ = ("admitted", "error", "event", "num_keys")

    def __init__(self, num_keys: int) -> None:
        self.num_keys = num_keys
        self.event = anyio.Event()
        self.admitted = False
        self.error: BaseException | None = None


class AnyioShell(CoreDriver):
    """Drive ``core`` for one :class:`~aio_mclookup.LookupCoordinator` under anyio (see the
    module doc): :meth:`start` and :meth:`aclose` in the task that enters the coordinator,
    :meth:`lookup` from any task; ``epochs`` is the coordinator's."""

    def __init__(
        self, core: CoordinatorCore, stats: CoordinatorStats, store: Store, epochs: EpochGuard
    ) -> None:
        self._core = core
        self._stats = stats
        self._store = store
        self._epochs = epochs
        self._submit: Any = store.batch_is_exist_then if isinstance(store, CallbackStore) else None
        self._calls_in_flight = 0  # RPCs through a CallbackStore, answer still to come
        self._waiters: collections.deque[_Ticket] = collections.deque()
        self._admission = Admission(core)
        self._wake_event = anyio.Event()
        self._group: anyio.abc.TaskGroup | None = None
        self._scopes: set[anyio.CancelScope] = set()  # one per running task of the group
        self._closed = False
        self._dispatching = False  # inside _dispatch: a call-back within it sends nothing more

    # ------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Open the task group and start the dispatcher (in the entering task)."""
        group = anyio.create_task_group()
        await group.__aenter__()
        self._group = group
        self._spawn(self._dispatch_forever)

    def aclose(self) -> None:
        """Fail every pending caller with :class:`ClosedError` and cancel the dispatcher and
        the RPC tasks (from any task; :meth:`wait_closed` waits for them)."""
        if self._closed:
            return
        self._closed = True
        error = ClosedError("the coordinator was closed")
        self._core.fail_all(error)
        self._deliver()
        for ticket in self._waiters:
            ticket.error = error
            ticket.event.set()
        for scope in self._scopes:
            scope.cancel()

    async def wait_closed(self) -> None:
        """After :meth:`aclose`: wait for the group's tasks to end and close the group (in the
        task that called :meth:`start`, at the end of its ``async with``)."""
        group, self._group = self._group, None
        if group is not None:
            await group.__aexit__(None, None, None)
        self._core.rpcs_in_flight = self._calls_in_flight  # (call-backs still to come)

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run ``fn(*args)`` in a task of the group, in a cancel scope :meth:`aclose`
        cancels."""
        assert self._group is not None
        self._group.start_soon(self._guarded, fn, args)

    async def _guarded(self, fn: Callable[..., Awaitable[None]], args: tuple[Any, ...]) -> None:
        if self._closed:  # (closed before the task began)
            return
        with anyio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                await fn(*args)
            finally:
                self._scopes.discard(scope)

    # --------------------------------------------------------------------------- lookups
    async def lookup(self, plan: LookupPlan, limit: float | None) -> LookupState:
        """Admit, probe and resolve one plan within ``limit`` seconds (None: no bound), with
        the lookup-level statistics; cleans up whatever way it ends."""
        if self._closed:
            raise ClosedError("the coordinator is closed")
        core = self._core
        self._check_epoch()
        stats = self._stats
        started = time.perf_counter()
        stats.lookup_planned(plan.num_keys, plan.token_len)
        if not plan.num_keys:
            empty = core.begin(plan, time.monotonic())  # (settles at once: vLLM's 0)
            core.finish(empty)
            self._deliver()
            stats.lookups_total += 1
            return empty
        deadline = math.inf if limit is None else anyio.current_time() + limit
        lookup: LookupState | None = None
        try:
            if self._waiters or not self._admission.has_room(plan.num_keys):
                await self._admit(plan.num_keys, deadline, limit)
                self._admission.release(plan.num_keys)
                if self._closed:  # (admitted, then closed before it ran)
                    raise ClosedError("the coordinator was closed")
            settled = anyio.Event()
            lookup = core.begin(plan, time.monotonic(), settled)
            self._after()
            if not lookup.done:
                with anyio.CancelScope(deadline=deadline) as scope:
                    await settled.wait()
                if scope.cancelled_caught:
                    core.fail(lookup, LookupTimeout(f"lookup did not finish within {limit} s"))
                    self._deliver()
            if lookup.error is not None:
                raise lookup.error
        except anyio.get_cancelled_exc_class():
            stats.lookups_cancelled_total += 1
            raise
        except Error as exc:
            stats.lookup_failed(error_label(exc))
            raise
        finally:
            if lookup is not None:
                core.finish(lookup)  # (may release a walker's followers: they go on now)
                self._after()
            if self._waiters:
                self._admit_next()
        stats.lookup_done(lookup.state.hit or 0, time.perf_counter() - started)
        return lookup

    def _deliver(self) -> None:
        """Wake the callers of the lookups the core settled (each reads its own outcome)."""
        core = self._core
        settled = core.settled
        if not settled:
            return
        core.settled = []
        for lookup in settled:
            if lookup.waiter is not None:
                lookup.waiter.set()

    def _wake_dispatcher(self) -> None:
        self._wake_event.set()

    # ------------------------------------------------------------------------- admission
    async def _admit(self, num_keys: int, deadline: float, limit: float | None) -> None:
        """Wait for room in arrival order until ``deadline`` (only the first in line is
        woken, when it fits), or raise :class:`Overloaded` after one checkpoint."""
        refusal = self._admission.refusal(len(self._waiters))
        if refusal is not None:
            await anyio.lowlevel.checkpoint()
            raise refusal
        ticket = _Ticket(num_keys)
        self._waiters.append(ticket)
        if len(self._waiters) == 1:
            self._admit_next()  # (room may have appeared while nobody waited)
        try:
            with anyio.CancelScope(deadline=deadline):
                await ticket.event.wait()
            if ticket.error is not None:
                raise ticket.error
            if not ticket.admitted:
                raise LookupTimeout(f"lookup did not finish within {limit} s")
        except BaseException:
            if ticket.admitted:
                self._admission.release(num_keys)  # admitted, then gave up before it ran
            elif ticket in self._waiters:  # gave up waiting (timeout, cancel)
                self._waiters.remove(ticket)
            self._admit_next()
            raise

    def _admit_next(self) -> None:
        """Admit waiters from the head of the line while they fit (first in, first out)."""
        waiters = self._waiters
        while waiters:
            ticket = waiters[0]
            if not self._admission.has_room(ticket.num_keys):
                return
            waiters.popleft()
            self._admission.reserve(ticket.num_keys)
            ticket.admitted = True
            ticket.event.set()

    # ------------------------------------------------------------------------ dispatching
    async def _dispatch_forever(self) -> None:
        while True:
            await self._wake_event.wait()
            self._wake_event = anyio.Event()
            linger = self._core.options.linger
            if linger:
                await anyio.sleep(linger)
            try:
                self._dispatch()
            except Exception:  # the dispatcher must outlive any bug in one dispatch
                logger.exception("aio_mclookup: dispatch failed")

    async def _wake_at(self, delay: float) -> None:
        await anyio.sleep(delay)
        self._wake_event.set()


    def _dispatch(self, whole_only: bool = False) -> None:
        """Send what the core says to send; while the store is down, come back when the
        breaker lets a probe through."""
        if self._group is None or self._closed:
            return
        self._check_epoch()  # (before queued keys may fail fast as absent)
        self._dispatching = True
        try:
            now = time.monotonic()
            batches, retry_at = self._core.take_batches(now, whole_only)
            if retry_at is not None:
                self._deliver()  # (queued keys failed fast)
                self._spawn(self._wake_at, max(0.0, retry_at - now))
                return
            submit = self._submit
            generation = self._epochs.generation
            for batch in batches:
                if submit is not None:
                    self._send(submit, batch, now, generation)
                else:
                    self._spawn(self._rpc, batch, now, generation)
        finally:
            self._dispatching = False

    async def _rpc(self, keys: tuple[bytes, ...], sent_at: float, generation: int) -> None:
        """One awaited ``batch_is_exist`` call; its outcome goes to the core. Cancelled only
        by :meth:`aclose`, which settles every caller."""
        started = time.perf_counter()
        outcome: Sequence[int] | BaseException
        try:
            outcome = await self._store.batch_is_exist(keys)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            outcome = exc
        finally:
            self._stats.rpc_seconds.observe(time.perf_counter() - started)
        self._settle(keys, sent_at, outcome, generation)

