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

from .. import _native
from .._backend import on_asyncio
from .._checks import integer
from .._errors import ClosedError, Error, InvalidRequest, LookupTimeout, StoreError, error_label
from .._layout.layout import KVLayout
from .._layout.sglang import SGLangLayout
from .._observe.stats import CoordinatorStats
from .._plan.hashes import HashInput
from .._plan.plan import LookupPlan
from .._resolve.result import LookupResult
from .._store.protocol import CallbackStore, Store
from .admission import Admission
from .core import CoordinatorCore, LookupState
from .driving import CoreDriver
from .epochs import EpochGuard
from .options import CoordinatorOptions, check_timeout

if TYPE_CHECKING:
    from .anyio_shell import AnyioShell

__all__ = ["LookupCoordinator"]

logger = logging.getLogger("aio_mclookup")

_WORKER: Any = _native.load("aio_mclookup._coordinator._worker_c")
"""The native worker's module (``_worker_c.c``), or ``None``: plans prepare inline."""

class _Default:
    """The type of :data:`DEFAULT`: "the coordinator's own setting" (distinct from None,
    which means "no bound")."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = _Default()


class _Start:
    """One lookup on its way into the core: its plan, the future its caller awaits (set when
    the lookup settles, or when it fails before it began), and what it holds meanwhile."""

    __slots__ = ("job", "limit", "lookup", "plan", "reserved", "waiter")

    def __init__(self, plan: LookupPlan, waiter: asyncio.Future[None], limit: float | None):
        self.plan = plan
        self.waiter = waiter
        self.limit = limit
        self.reserved = False
        """Admission holds room for its keys (released when it begins, or gives up)."""
        self.job: object = None
        """Its plan's native job, while on the worker."""
        self.lookup: LookupState | None = None
        """Its state in the core, once begun."""


class LookupCoordinator(CoreDriver):
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
        self._admission = Admission(self._core)
        self._wake: asyncio.Event | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._dispatching = False  # inside _dispatch: a call-back within it sends nothing more
        self._other: AnyioShell | None = None  # the shell under anyio's other backends (trio)
        self._epochs = EpochGuard(self._core, store)
        self._worker: Any = None
        """The native thread running plans' preparation (:meth:`LookupPlan.native_job`),
        from the first such plan on; False where it cannot run (then plans prepare inline)."""
        self._preparing: set[_Start] = set()
        """The lookups whose job is on the worker."""
        self._worker_woken = True
        """No job queued on the worker since it was last woken (see :meth:`_prepare`)."""

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

            other = AnyioShell(self._core, self._stats, self.store, self._epochs)
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
        if self._worker:
            self._stop_worker()

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

    async def lookup_tokens(
        self,
        token_ids: object,
        *,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        layout: SGLangLayout | None = None,
        timeout: float | _Default | None = DEFAULT,
    ) -> int:
        """SGLang's L3 hit of a prompt from its token ids: :meth:`lookup` of ``(len(token_ids),
        layout.page_hashes(token_ids, extra_key, cache_salt))``, with the pages hashed on the
        coordinator's worker thread, off the event loop, where it can
        (:meth:`SGLangLayout.plan_tokens`). For an :class:`SGLangLayout` only (vLLM's block
        hashes: :class:`BlockHasher`, then :meth:`lookup`).

        A numpy array of token ids is read in place on that thread (``plan_tokens``'
        ``in_place``), not copied: do not write to it until this call returns. (A call that
        is cancelled or times out returns at once; whatever its job reads after that is
        dropped.)"""
        layout_ = self._layout_or_default(layout)
        if not isinstance(layout_, SGLangLayout):
            raise InvalidRequest(
                "lookup_tokens hashes SGLang pages; for a vLLM layout hash the prompt with "
                "BlockHasher and call lookup",
                field="layout",
            )
        plan = layout_.plan_tokens(token_ids, extra_key, cache_salt, in_place=True)
        hit = (await self._lookup(plan, timeout)).hit
        self._stats.count_model(_model_of(layout_), plan.token_len, hit)
        return hit

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
        self._check_epoch()
        started = time.perf_counter()
        stats = self._stats
        stats.lookup_planned(plan.num_keys, plan.token_len)
        if not plan.num_keys:
            empty = core.begin(plan, time.monotonic())  # (settles at once: vLLM's 0)
            core.finish(empty)
            self._deliver()
            stats.lookups_total += 1
            return empty
        deadline = None if limit is None else loop.time() + limit
        timer = None
        start = _Start(plan, loop.create_future(), limit)
        try:
            preparing = plan.needs_preparing
            # Admission holds room for its keys until it begins (the core counts them then).
            if self._waiters or not self._admission.has_room(plan.num_keys):  # (else no
                await self._admit(plan.num_keys, deadline, limit)  # coroutine; reserves)
                start.reserved = True
            elif preparing:  # (its work counts while the plan is prepared)
                self._admission.reserve(plan.num_keys)
                start.reserved = True
            if deadline is not None:  # a timer, not wait_for: no task
                timer = loop.call_at(deadline, self._expire, start)
            on_worker = preparing and not self._closed and self._prepare(start, deadline)
            if not on_worker:  # (else the worker's call-back begins it: see _jobs_done)
                self._begin(start)
                self._after()
            await start.waiter
        except asyncio.CancelledError:
            stats.lookups_cancelled_total += 1
            raise
        except Error as exc:
            stats.lookup_failed(error_label(exc))
            raise
        finally:
            if timer is not None:
                timer.cancel()
            waiter = start.waiter
            if not waiter.done():
                waiter.cancel()
            elif not waiter.cancelled():
                waiter.exception()  # mark retrieved, whoever stopped waiting
            self._release(start)
            if start.job is not None:  # (it gave up while on the worker: it prepares no more)
                self._preparing.discard(start)
            lookup = start.lookup
            if lookup is not None:
                core.finish(lookup)  # (may release a walker's followers: they go on now)
                self._after()
            if self._waiters:
                self._admit_next()
        lookup = start.lookup
        assert lookup is not None
        stats.lookup_done(lookup.state.hit or 0, time.perf_counter() - started)
        return lookup

    def _begin(self, start: _Start) -> None:
        """The lookup of a prepared plan starts in the core (the caller wakes when it settles);
        its admission's reservation ends (the core counts its keys from here)."""
        self._release(start)
        if self._closed:  # (admitted or prepared, then closed before it ran)
            start.waiter.set_exception(ClosedError("the coordinator was closed"))
            return
        start.lookup = self._core.begin(start.plan, time.monotonic(), start.waiter)

    def _release(self, start: _Start) -> None:
        if start.reserved:
            start.reserved = False
            self._admission.release(start.plan.num_keys)

    def _prepare(self, start: _Start, deadline: float | None) -> bool:
        """Prepare the plan (:meth:`LookupPlan.prepare`): True when its native job went to the
        worker thread (whose call-back prepares and begins it, :meth:`_jobs_done`) while the
        event loop goes on with other lookups; else prepared here, inline: where that thread
        cannot run, or when no other lookup or RPC is under way and the work is small
        (:attr:`LookupPlan.quick_to_prepare`). A lookup prepared inline past its deadline
        fails."""
        loop = self._loop
        assert loop is not None
        core = self._core
        plan = start.plan
        idle = not (core.lookups or core.rpcs_in_flight or self._preparing)
        if not (idle and plan.quick_to_prepare):  # (else the trip would be latency only)
            job = plan.native_job()
            worker = self._worker if self._worker is not None else self._start_worker()
            if worker and job is not None:
                start.job = job
                worker.submit(job, start, False)  # (woken once for all the jobs of this loop
                if self._worker_woken:  # turn: waking a waiting thread costs about what a job
                    loop.call_soon(self._wake_worker)  # does)
                    self._worker_woken = False
                self._preparing.add(start)
                return True
        plan.prepare()
        if deadline is not None and loop.time() >= deadline:
            raise LookupTimeout(f"lookup did not finish within {start.limit} s")
        return False

    def _start_worker(self) -> Any:
        """Start the native worker, or note (False) that it cannot run here."""
        loop = self._loop
        assert loop is not None
        worker: Any = False
        if _WORKER is not None:
            try:
                worker = _WORKER.NativeWorker()
                loop.add_reader(worker.fileno(), self._jobs_done)
            except (OSError, NotImplementedError) as exc:  # (no threads, or a loop without
                logger.warning("aio_mclookup: preparing plans inline: %r", exc)  # readers)
                if worker:
                    worker.close()
                worker = False
        self._worker = worker
        return worker

    def _wake_worker(self) -> None:
        self._worker_woken = True
        if self._worker:
            self._worker.wake()

    def _jobs_done(self) -> None:
        """Prepare and begin each lookup whose job the worker ran, unless it gave up waiting;
        then act on what the core left (one :meth:`_after` for them all). An error preparing
        or beginning one reaches only its caller, as if it had prepared inline."""
        try:
            for start in self._worker.collect():
                self._preparing.discard(start)
                if start.waiter.done():  # (cancelled, timed out or closed meanwhile)
                    continue
                job, start.job = start.job, None
                try:
                    start.plan.prepare(job)
                    self._begin(start)
                except Exception as exc:
                    self._release(start)
                    if start.lookup is None and not start.waiter.done():
                        if isinstance(exc, StopIteration):  # (a future refuses it)
                            exc = RuntimeError(f"preparing a plan raised {exc!r}")
                        start.waiter.set_exception(exc)
        finally:
            self._after()

    def _stop_worker(self) -> None:
        worker, self._worker = self._worker, False
        assert self._loop is not None
        self._loop.remove_reader(worker.fileno())
        try:
            worker.close()
        finally:
            for start in self._preparing:  # (the lookups still waiting for it)
                if not start.waiter.done():
                    start.waiter.set_exception(ClosedError("the coordinator was closed"))
            self._preparing.clear()

    def _expire(self, start: _Start) -> None:
        error = LookupTimeout(f"lookup did not finish within {start.limit} s")
        if start.lookup is None:  # (still being admitted or prepared)
            if not start.waiter.done():
                start.waiter.set_exception(error)
            return
        self._core.fail(start.lookup, error)
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

    def _wake_dispatcher(self) -> None:
        assert self._wake is not None
        self._wake.set()

    # ------------------------------------------------------------------------- admission
    async def _admit(self, num_keys: int, deadline: float | None, limit: float | None) -> None:
        """Wait for room in arrival order (only the first in line is woken, when it fits),
        or raise :class:`Overloaded` after yielding once (a retry loop cannot spin)."""
        refusal = self._admission.refusal(len(self._waiters))
        if refusal is not None:
            await asyncio.sleep(0)
            raise refusal
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
                self._admission.release(num_keys)  # admitted, then gave up before it ran
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
            if not self._admission.has_room(num_keys):
                return
            waiters.popleft()
            self._admission.reserve(num_keys)
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

    def _dispatch(self, whole_only: bool = False) -> None:
        """Send what the core says to send (``whole_only``: only whole RPCs, the rest left
        for the dispatcher); while the store is down, come back when the breaker lets a probe
        through."""
        loop = self._loop
        assert loop is not None and self._wake is not None
        self._check_epoch()  # (before queued keys may fail fast as absent)
        self._dispatching = True
        try:
            now = time.monotonic()
            batches, retry_at = self._core.take_batches(now, whole_only)
            if retry_at is not None:
                self._deliver()  # (queued keys failed fast)
                loop.call_at(loop.time() + (retry_at - now), self._wake.set)
                return
            submit = self._submit
            generation = self._epochs.generation
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
