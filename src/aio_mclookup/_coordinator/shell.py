"""The asyncio shell around :class:`~._coordinator.core.CoordinatorCore`: futures, timers,
admission, the dispatcher task and the store calls. All probing logic is in the core.

Data flow of one ``await coordinator.lookup(...)``:

1. plan (in the caller: bad input fails here, before it can touch a shared batch);
2. admission (bounded pending work: wait in arrival order, or :class:`Overloaded`);
3. the core starts the lookup (caches, walkers, its first round);
4. the dispatcher sends queued keys while RPC slots are free (no linger by default), split
   into RPCs of at most ``max_keys_per_rpc`` keys, the rounds waiting served in turn;
5. answers go back to the core, which fans them out; settled lookups wake their callers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._backend import on_asyncio
from .._checks import integer
from .._errors import (
    ClosedError,
    Error,
    InvalidRequest,
    LookupTimeout,
    Overloaded,
    StoreError,
    error_label,
)
from .._layout.layout import KVLayout
from .._layout.sglang import SGLangLayout
from .._observe.stats import CoordinatorStats
from .._plan.hashes import HashInput
from .._plan.plan import LookupPlan
from .._resolve.result import LookupResult
from .._store.codes import INVALID_PARAMS, RPC_FAIL, RPC_TIMEOUT
from .._store.protocol import Answer, CallbackStore, Key, Store, epochs_of
from .core import CoordinatorCore, LookupState
from .options import CoordinatorOptions, check_timeout

if TYPE_CHECKING:
    from .anyio_shell import AnyioShell

__all__ = ["LookupCoordinator"]

logger = logging.getLogger("aio_mclookup")

_LOST_MASTER = frozenset((RPC_FAIL, RPC_TIMEOUT, INVALID_PARAMS))
"""Codes of a failed RPC that say the master may be gone, or another one: a new epoch."""


class _Default:
    """The type of :data:`DEFAULT`: "the coordinator's own setting" (distinct from None,
    which means "no bound")."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = _Default()


class LookupCoordinator:
    """Answer many concurrent prefix lookups with shared, deduplicated store RPCs.

    ``await coordinator.lookup(num_tokens, block_hashes)`` returns the engine's scheduler's
    count for a request of ``num_tokens`` tokens, on the store's answers; ``lookup_result`` the
    worker's whole reply (see each method). ``layout=`` per call takes another
    :class:`KVLayout` or an :class:`SGLangLayout` (its page hashes instead of block hashes),
    all in the same rounds and RPCs. The coordinator uses the store but does not open or close
    it.

    Options come as a :class:`CoordinatorOptions` (``options=``) or as its fields by keyword
    (``timeout=0.5``); see :class:`CoordinatorOptions` and ``docs/coordinator.md``.

    On asyncio (and uvloop) it starts on first use; under another anyio backend (trio) it
    runs only inside ``async with coordinator:``, its tasks in a task group of the entering
    task (:mod:`.anyio_shell`).
    """

    def __init__(
        self,
        layout: KVLayout | SGLangLayout,
        store: Store,
        *,
        options: CoordinatorOptions | None = None,
        **option_fields: Any,
    ) -> None:
        if not isinstance(layout, (KVLayout, SGLangLayout)):
            raise InvalidRequest(
                f"layout must be a KVLayout or an SGLangLayout, got {type(layout).__name__}",
                field="layout",
            )
        if not callable(getattr(store, "batch_is_exist", None)):
            raise InvalidRequest(
                f"store must have an async batch_is_exist(keys), got {type(store).__name__}",
                field="store",
            )
        if options is None:
            unknown = set(option_fields) - set(CoordinatorOptions.__dataclass_fields__)
            if unknown:
                raise TypeError(f"unknown coordinator option(s): {', '.join(sorted(unknown))}")
            options = CoordinatorOptions(**option_fields)
        elif option_fields:
            options = options.replace(**option_fields)
        self.layout: KVLayout | SGLangLayout = layout
        """The default layout of lookups that name none."""
        self.store = store
        self._options = options
        self._stats = CoordinatorStats()
        self._core = CoordinatorCore(options, self._stats)
        self._submit: Any = store.batch_is_exist_then if isinstance(store, CallbackStore) else None
        self._rpc_tasks: set[asyncio.Task[None]] = set()
        self._calls_in_flight = 0  # RPCs through a CallbackStore, answer still to come
        self._waiters: collections.deque[tuple[asyncio.Future[None], int]] = collections.deque()
        self._reserved = [0, 0]  # lookups, keys: admitted waiters not yet registered
        self._wake: asyncio.Event | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._dispatching = False  # inside _dispatch: a call-back within it sends nothing more
        self._other: AnyioShell | None = None  # the shell under anyio's other backends (trio)
        self._epochs = epochs = epochs_of(store)
        self._epoch_seen = 0 if epochs is None else epochs.epoch
        self._generation = 0
        """Bumped at each possible change of master: an RPC sent before must not answer
        (each RPC is tagged with it when sent)."""
        if epochs is not None:
            self._core.breaker.reachable = lambda: epochs.reachable

    @property
    def options(self) -> CoordinatorOptions:
        """The options in force; assign a new :class:`CoordinatorOptions` (for example
        ``coordinator.options = coordinator.options.replace(cache_ttl=None)``) to change them
        while it runs: they hold from the next round and the next RPC on."""
        return self._options

    @options.setter
    def options(self, options: CoordinatorOptions) -> None:
        if not isinstance(options, CoordinatorOptions):
            raise InvalidRequest(
                f"options must be a CoordinatorOptions, got {type(options).__name__}",
                field="options",
            )
        self._options = options
        self._core.options = options
        self._core.breaker.backoff = options.failure_backoff

    # ------------------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> LookupCoordinator:
        if on_asyncio():
            self._start()
        elif self._other is None:
            if self._closed:
                raise ClosedError("the coordinator is closed")
            from .anyio_shell import AnyioShell

            other = AnyioShell(self._core, self._stats, self.store)
            await other.start()
            self._other = other
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
        if self._other is not None:
            await self._other.wait_closed()

    def _start(self) -> None:
        if self._closed:
            raise ClosedError("the coordinator is closed")
        if self._dispatcher is not None:
            return
        if not on_asyncio():
            raise ClosedError(
                "under this async library the coordinator runs inside 'async with "
                "LookupCoordinator(...)' only (it has not been entered)"
            )
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._dispatcher = self._loop.create_task(self._dispatch_forever())

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        """Stop: every pending caller gets :class:`ClosedError`; in-flight RPC tasks are
        cancelled and awaited (the store finishes or abandons its own calls)."""
        if self._closed:
            return
        self._closed = True
        if self._other is not None:  # (its tasks end by the end of the async with)
            self._other.aclose()
            return
        self._core.fail_all(ClosedError("the coordinator was closed"))
        self._deliver()
        for waiter, _ in self._waiters:
            if not waiter.done():
                waiter.set_exception(ClosedError("the coordinator was closed"))
        tasks = [t for t in (self._dispatcher, *self._rpc_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._rpc_tasks.clear()  # (a task cancelled before it started never removes itself)
        self._core.rpcs_in_flight = self._calls_in_flight  # (call-backs still to come)

    # --------------------------------------------------------------------------- lookups
    async def lookup(
        self,
        num_tokens: int,
        block_hashes: HashInput,
        *,
        layout: KVLayout | SGLangLayout | None = None,
        timeout: float | _Default | None = DEFAULT,
    ) -> int:
        """How many tokens of a request of ``num_tokens`` tokens the engine's scheduler counts
        as found in the store, for the layout's release: on vLLM 0.32+ the worker's answer for
        ``num_tokens`` (it aligns and leaves a token to compute itself); on vLLM 0.26 the
        worker's answer for the aligned length (:meth:`KVLayout.align`), lowered by the
        scheduler's leave-one-token rule (:meth:`KVLayout.leave_one_token`); for an
        :class:`SGLangLayout`, SGLang's L3 hit from the request's page hashes
        (:meth:`SGLangLayout.plan`). What a scheduler or router wants; ``num_tokens`` need not
        be aligned.

        ``layout`` lets one coordinator serve several models and engines; ``timeout``
        overrides the coordinator's for this call (None: no bound).
        """
        layout = self._layout_or_default(layout)
        plan, legacy = _request_plan(layout, num_tokens, block_hashes)
        hit = (await self._lookup(plan, timeout)).hit
        self._stats.count_model(_model_of(layout), plan.token_len, hit)
        if legacy:
            assert isinstance(layout, KVLayout)
            return layout.leave_one_token(hit, num_tokens)
        return hit

    async def lookup_result(
        self,
        num_tokens: int,
        block_hashes: HashInput,
        *,
        layout: KVLayout | SGLangLayout | None = None,
        timeout: float | _Default | None = DEFAULT,
    ) -> LookupResult:
        """The worker's reply to the lookup of the same request as :meth:`lookup`, whole:
        :meth:`LookupPlan.resolve_result` on the store's answers. On vLLM 0.32+ (and SGLang)
        its ``hit_length`` is :meth:`lookup`'s answer, and on vLLM it carries the tail-key
        boundaries. On vLLM 0.26 it is the worker's reply for the aligned length (no
        boundaries), before the scheduler's rule: ``lookup(n) ==
        layout.leave_one_token(result.hit_length, n)`` on every vLLM release (that rule is
        the identity on 0.32+).
        """
        layout = self._layout_or_default(layout)
        plan, _ = _request_plan(layout, num_tokens, block_hashes)
        state = await self._lookup(plan, timeout)
        result = state.state.result
        assert result is not None
        self._stats.count_model(_model_of(layout), plan.token_len, state.hit)
        return result

    lookup_request = lookup
    """A plain alias of :meth:`lookup` (its former name)."""

    def _layout_or_default(
        self, layout: KVLayout | SGLangLayout | None
    ) -> KVLayout | SGLangLayout:
        if layout is None:
            return self.layout
        if not isinstance(layout, (KVLayout, SGLangLayout)):
            raise InvalidRequest(
                f"layout must be a KVLayout or an SGLangLayout, got {type(layout).__name__}",
                field="layout",
            )
        return layout

    async def _lookup(self, plan: LookupPlan, timeout: float | _Default | None) -> LookupState:
        """Admit, probe and resolve one plan, with the lookup-level statistics; cleans up
        whatever way it ends. (One coroutine per lookup: each await level costs.)"""
        if self._closed:
            raise ClosedError("the coordinator is closed")
        limit = self._options.timeout if timeout is DEFAULT else check_timeout("timeout", timeout)
        if self._other is not None:
            return await self._other.lookup(plan, limit)
        if self._dispatcher is None:
            self._start()
        loop = self._loop
        assert loop is not None
        core = self._core
        epochs = self._epochs
        if epochs is not None and epochs.epoch != self._epoch_seen:
            self._store_epoch_changed()
        started = time.perf_counter()
        stats = self._stats
        stats.keys_planned_total += plan.num_keys
        stats.requested_tokens_total += max(plan.token_len, 0)
        if not plan.num_keys:
            empty = core.begin(plan, time.monotonic())  # (settles at once: vLLM's 0)
            core.finish(empty)
            self._deliver()
            stats.lookups_total += 1
            return empty
        deadline = None if limit is None else loop.time() + limit
        timer = None
        waiter: asyncio.Future[None] | None = None
        lookup: LookupState | None = None
        try:
            if self._waiters or not self._has_room(plan.num_keys):  # else no coroutine
                await self._admit(plan.num_keys, deadline, limit)
                self._reserved[0] -= 1
                self._reserved[1] -= plan.num_keys
                if self._closed:  # (admitted, then closed before it ran)
                    raise ClosedError("the coordinator was closed")
            waiter = loop.create_future()
            lookup = core.begin(plan, time.monotonic(), waiter)
            if deadline is not None and not lookup.done:  # a timer, not wait_for: no task
                timer = loop.call_at(deadline, self._expire, lookup, limit)
            self._after()
            await waiter
        except asyncio.CancelledError:
            stats.lookups_cancelled_total += 1
            raise
        except Error as exc:
            stats.lookups_total += 1
            stats.lookups_failed_total += 1
            stats.count_error(error_label(exc))
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if waiter is not None:
                if not waiter.done():
                    waiter.cancel()
                elif not waiter.cancelled():
                    waiter.exception()  # mark retrieved, whoever stopped waiting
            if lookup is not None:
                core.finish(lookup)  # (may release a walker's followers: they go on now)
                self._after()
            if self._waiters:
                self._admit_next()
        assert lookup is not None
        stats.lookups_total += 1
        stats.hit_tokens_total += lookup.state.hit or 0
        stats.lookup_seconds.observe(time.perf_counter() - started)
        return lookup

    def _store_epoch_changed(self) -> None:
        """The store saw its master go (restart, failover): a new epoch."""
        assert self._epochs is not None
        self._epoch_seen = self._epochs.epoch
        self._generation += 1
        self._core.new_epoch("the store's master went away or was replaced", RPC_FAIL)
        self._deliver()

    def _expire(self, lookup: LookupState, limit: float | None) -> None:
        self._core.fail(lookup, LookupTimeout(f"lookup did not finish within {limit} s"))
        self._deliver()

    def _deliver(self) -> None:
        """Wake the callers of the lookups the core settled."""
        core = self._core
        settled = core.settled
        if not settled:
            return
        core.settled = []
        for lookup in settled:
            waiter = lookup.waiter
            if waiter is None or waiter.done():
                continue
            if lookup.error is None:
                waiter.set_result(None)  # (not the lookup: no reference cycle for the GC)
            else:
                waiter.set_exception(lookup.error)

    def _after(self) -> None:
        """After the core ran: wake settled callers, send the whole RPCs queued (if slots are
        free), and wake the dispatcher for the rest."""
        self._deliver()
        core = self._core
        if core.fresh_keys:
            core.fresh_keys = False
            self._send_whole_rpcs()  # (the store works on them while more are planned)
            assert self._wake is not None
            self._wake.set()

    # ------------------------------------------------------------------------- admission
    def _has_room(self, num_keys: int) -> bool:
        lookups = self._core.lookups
        pending = len(lookups) + self._reserved[0]
        if not pending:
            return True  # one lookup always fits, however large
        options = self.options
        return (
            pending < options.max_pending_lookups
            and self._pending_keys() + num_keys <= options.max_pending_keys
        )

    def _pending_keys(self) -> int:
        return self._core.pending_keys + self._reserved[1]

    async def _admit(self, num_keys: int, deadline: float | None, limit: float | None) -> None:
        """Wait for room in arrival order (only the first in line is woken, when it fits),
        or raise :class:`Overloaded` after yielding once (a retry loop cannot spin)."""
        options = self.options
        if options.when_full == "raise" or len(self._waiters) >= options.max_waiting_lookups:
            await asyncio.sleep(0)
            raise Overloaded(
                f"{len(self._core.lookups)} lookups / {self._pending_keys()} keys pending "
                f"(max {options.max_pending_lookups} / {options.max_pending_keys}), "
                f"{len(self._waiters)} waiting"
            )
        assert self._loop is not None
        ticket: asyncio.Future[None] = self._loop.create_future()
        entry = (ticket, num_keys)
        self._waiters.append(entry)
        if len(self._waiters) == 1:
            self._admit_next()  # (room may have appeared while nobody waited)
        try:
            if deadline is None:
                await ticket
            else:
                await asyncio.wait_for(asyncio.shield(ticket), deadline - self._loop.time())
        except BaseException as exc:
            if ticket.done() and not ticket.cancelled() and ticket.exception() is None:
                self._reserved[0] -= 1  # admitted, then gave up before it ran
                self._reserved[1] -= num_keys
            elif not ticket.done():  # gave up waiting (timeout, cancel)
                self._waiters.remove(entry)
                ticket.cancel()
            self._admit_next()
            if isinstance(exc, asyncio.TimeoutError):
                raise LookupTimeout(f"lookup did not finish within {limit} s") from None
            raise

    def _admit_next(self) -> None:
        """Admit waiters from the head of the line while they fit (first in, first out)."""
        waiters = self._waiters
        while waiters:
            ticket, num_keys = waiters[0]
            if ticket.done():
                waiters.popleft()
                continue
            if not self._has_room(num_keys):
                return
            waiters.popleft()
            self._reserved[0] += 1
            self._reserved[1] += num_keys
            ticket.set_result(None)

    # ------------------------------------------------------------------------ dispatching
    async def _dispatch_forever(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.options.linger:
                await asyncio.sleep(self.options.linger)
            try:
                self._dispatch()
            except Exception:  # the dispatcher must outlive any bug in one dispatch
                logger.exception("aio_mclookup: dispatch failed")

    def _send_whole_rpcs(self) -> None:
        """Send whole RPCs now, without waiting for the dispatcher's turn, when the keys
        queued fill every free RPC slot (see :meth:`CoordinatorCore.whole_rpcs_queued`); not
        from a call-back inside a dispatch, which would recurse once per RPC."""
        if self._dispatching or not self._core.whole_rpcs_queued():
            return
        try:
            self._dispatch(whole_only=True)
        except Exception:  # (as the dispatcher does: a bug here must not reach a caller)
            logger.exception("aio_mclookup: dispatch failed")

    def _dispatch(self, whole_only: bool = False) -> None:
        """Send what the core says to send (``whole_only``: only whole RPCs, the rest left
        for the dispatcher); while the store is down, come back when the breaker lets a probe
        through."""
        loop = self._loop
        assert loop is not None and self._wake is not None
        epochs = self._epochs
        if epochs is not None and epochs.epoch != self._epoch_seen:
            self._store_epoch_changed()  # (before queued keys may fail fast as absent)
        self._dispatching = True
        try:
            now = time.monotonic()
            batches, retry_at = self._core.take_batches(now, whole_only)
            if retry_at is not None:
                self._deliver()  # (queued keys failed fast)
                loop.call_at(loop.time() + (retry_at - now), self._wake.set)
                return
            submit = self._submit
            generation = self._generation
            for batch in batches:
                if submit is not None:
                    self._send(submit, batch, now, generation)
                else:
                    task = loop.create_task(self._rpc(batch, now, generation))
                    self._rpc_tasks.add(task)
        finally:
            self._dispatching = False

    async def _rpc(self, keys: tuple[bytes, ...], sent_at: float, generation: int) -> None:
        """One awaited ``batch_is_exist`` call; its outcome goes to the core."""
        started = time.perf_counter()
        outcome: Sequence[int] | BaseException
        try:
            outcome = await self.store.batch_is_exist(keys)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            cancelling = getattr(task, "cancelling", None)
            if cancelling is None or cancelling():
                raise  # we are being cancelled (aclose): it settles every caller
            outcome = StoreError(f"store call was cancelled: {exc!r}")  # the store's own doing
        except Exception as exc:
            outcome = exc
        finally:
            self._stats.rpc_seconds.observe(time.perf_counter() - started)
            task = asyncio.current_task()
            if task is not None:
                self._rpc_tasks.discard(task)
        self._settle(keys, sent_at, outcome, generation)

    def _send(
        self,
        submit: Any,
        keys: tuple[bytes, ...],
        sent_at: float,
        generation: int,
    ) -> None:
        """:meth:`_rpc` through a :class:`CallbackStore`: the answers fan out as soon as the
        loop picks them up, one loop iteration before an awaiting task would resume."""
        started = time.perf_counter()
        settled = False  # one outcome per RPC, even from a store that answers and then raises

        def answered(outcome: list[int] | BaseException) -> None:
            nonlocal settled
            if settled:
                return
            settled = True
            self._calls_in_flight -= 1
            if self._closed:
                self._core.rpcs_in_flight -= 1
                return  # close settled every caller
            self._stats.rpc_seconds.observe(time.perf_counter() - started)
            self._settle(keys, sent_at, outcome, generation)

        then: Answer = answered
        batch: Sequence[Key] = keys
        self._calls_in_flight += 1
        try:
            submit(batch, then)
        except Exception as exc:  # (closed meanwhile): a failed RPC, answered at once
            answered(exc)

    def _settle(
        self,
        keys: tuple[bytes, ...],
        sent_at: float,
        outcome: Sequence[int] | BaseException,
        generation: int,
    ) -> None:
        core = self._core
        epochs = self._epochs
        if epochs is not None and epochs.epoch != self._epoch_seen:
            self._store_epoch_changed()
        if isinstance(outcome, StoreError) and outcome.code in _LOST_MASTER:
            # Before the fan-out: under on_error="absent" it would resolve lookups on
            # presences the master may have lost.
            # An RPC answered after this one (sent before it failed) is refused too, unless
            # the store watches its master: then nothing changed unless its epoch did.
            changed = core.new_epoch(f"an RPC failed with code {outcome.code}", outcome.code)
            if changed or epochs is None:
                self._generation += 1
            if changed:
                self._deliver()
        elif generation != self._generation and not isinstance(outcome, BaseException):
            outcome = StoreError(
                "answered in an earlier master epoch (the master went away meanwhile)",
                code=RPC_FAIL,
            )
        core.settle_rpc(keys, sent_at, outcome, time.monotonic())
        self._deliver()
        core.fresh_keys = False
        self._send_whole_rpcs()  # (the store works on them while another RPC fans out)
        assert self._wake is not None
        self._wake.set()  # a slot is free: queued keys may go out

    # ---------------------------------------------------------------------- observability
    @property
    def healthy(self) -> bool:
        """False while the coordinator fails fast after store errors (and once closed); once
        the pause is over it lets a probe RPC through and counts as healthy again."""
        return not self._closed and not self._core.breaker.open(time.monotonic())

    def stats(self) -> CoordinatorStats:
        """A snapshot of counters and histograms (see :class:`CoordinatorStats`)."""
        stats = self._stats
        core = self._core
        stats.pending_lookups = len(core.lookups)
        stats.pending_keys = core.table.live
        stats.rpcs_in_flight = core.rpcs_in_flight
        stats.store_healthy = self.healthy
        last_ok = core.breaker.last_ok
        stats.last_rpc_ok_age = None if last_ok is None else time.monotonic() - last_ok
        return stats.snapshot()



def _request_plan(
    layout: KVLayout | SGLangLayout, num_tokens: int, block_hashes: HashInput
) -> tuple[LookupPlan, bool]:
    """The plan of a request's lookup (raises :class:`InvalidRequest`), and whether its hit
    is then lowered by vLLM 0.26's leave-one-token rule (the worker looked up the aligned
    length)."""
    if isinstance(layout, KVLayout) and layout.vllm_version == "0.26.0":
        n = integer("num_tokens", num_tokens)
        return layout.plan(layout.align(n), block_hashes), True
    return layout.plan(num_tokens, block_hashes), False


def _model_of(layout: KVLayout | SGLangLayout) -> str:
    """The model a layout's lookups are counted under (the per-model metrics)."""
    if isinstance(layout, KVLayout):
        return layout.model
    return layout.model_name or ""
