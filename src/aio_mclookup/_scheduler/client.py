"""The scheduler's lookup client, coalescing: vLLM's ``LookupKeyClient`` contract on top of a
:class:`~aio_mclookup.LookupCoordinator` that runs on an event-loop thread of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._coordinator.options import CoordinatorOptions
from .._coordinator.shell import LookupCoordinator
from .._errors import InvalidRequest
from .._layout.layout import KVLayout
from .._observe.stats import CoordinatorStats
from .._resolve.result import LookupResult
from .._store.protocol import Store
from .loop import LoopThread

__all__ = ["CoalescingLookupClient", "PLUGIN_DEFAULTS"]

logger = logging.getLogger("aio_mclookup.vllm")

PLUGIN_DEFAULTS: Mapping[str, Any] = {"timeout": 5.0, "cache_ttl": None}
"""Coordinator options the plug-in changes from the library's defaults: a lookup gives up
(hit 0, logged) after 5 s, as vLLM's scheduler must never wait on a dead master; and no
positive-answer cache, so every answer is the store's at probe time, as vLLM's worker gives
it. ``kv_connector_extra_config["aio_mclookup"]`` overrides either."""

_CLOSE_TIMEOUT = 10.0
"""Seconds :meth:`CoalescingLookupClient.close` waits for the store's close and the thread."""

_MARGIN = 1.0
"""Seconds a blocking :meth:`~CoalescingLookupClient.lookup` waits beyond the lookup's own
timeout before it gives up on the loop thread itself."""


_Unsent = tuple["concurrent.futures.Future[LookupResult]", int, list[bytes]]
"""A lookup submitted in this scheduler step, not started yet: its future, n, hashes."""


def _settle(
    future: concurrent.futures.Future[LookupResult],
    answered: threading.Event,
    task: asyncio.Task[LookupResult],
) -> None:
    """Copy a finished lookup task's outcome to the caller's future (on the loop thread)."""
    answered.set()
    if future.done():
        return
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())


def _cancel_task(
    loop: LoopThread, task: asyncio.Task[Any], future: concurrent.futures.Future[Any]
) -> None:
    """The caller cancelled (discard): cancel the lookup on the loop."""
    if future.cancelled():
        loop.call_soon(task.cancel)


class CoalescingLookupClient:
    """``lookup(req_id, num_tokens, block_hashes, non_block)``, ``discard``, ``reset``,
    ``close``: the contract of vLLM's ``LookupKeyClient``, answered by one coordinator.

    The first :meth:`lookup` of a request id submits its lookup; with ``non_block`` every call
    returns None until the answer is in, then the result (once: the id is then forgotten, as
    vLLM's client does). All lookups pending together share ``batch_is_exist`` RPCs. A failed
    or timed-out lookup is logged and gives a hit of 0. ``make_result(hit_length, boundaries)``
    builds the caller's result type (vLLM's ``MooncakeLookupResult``); ``boundaries`` is a
    tuple of ``(group_id, num_tokens)``.

    A blocking lookup (vLLM's synchronous mode, where nothing can coalesce) skips the loop
    when ``exist_blocking(keys, timeout)`` is given: the calling thread plans, asks the store
    and resolves, as vLLM's worker does, with no thread hop but the store's own.

    ``open_store`` is awaited once on the loop thread and returns the opened store;
    ``close_store`` is awaited at :meth:`close`. ``reset`` (the store wiped) is delegated to
    ``reset_store`` and then starts a fresh coordinator, so nothing learned before the wipe is
    kept.
    """

    def __init__(
        self,
        layout: KVLayout,
        open_store: Callable[[], Any],
        close_store: Callable[[Store], Any],
        *,
        make_result: Callable[[int, tuple[tuple[int, int], ...]], Any],
        reset_store: Callable[[], bool],
        options: CoordinatorOptions,
        open_timeout: float,
        exist_blocking: Callable[[list[bytes], float | None], list[int]] | None = None,
    ) -> None:
        self.layout = layout
        self._make_result = make_result
        self._reset_store = reset_store
        self._exist_blocking = exist_blocking
        self.direct_rpcs = 0
        """RPCs of blocking lookups made in the caller's thread (not in :meth:`stats`)."""
        self._options = options
        self._close_store = close_store
        self._futures: dict[str, concurrent.futures.Future[LookupResult]] = {}
        self._unsent: list[_Unsent] = []
        self._answered = threading.Event()  # set on the loop each time a lookup settles
        self._loop = LoopThread("aio-mclookup-vllm")
        self._closed = False
        try:
            self._store: Store = self._loop.submit(open_store()).result(open_timeout)
            self._coordinator = self._loop.submit(self._start_coordinator()).result(open_timeout)
        except BaseException:
            self._loop.stop(_CLOSE_TIMEOUT)
            raise

    @staticmethod
    def options_from(extra: Mapping[str, Any]) -> CoordinatorOptions:
        """The plug-in's coordinator options: :data:`PLUGIN_DEFAULTS`, then the
        ``"aio_mclookup"`` mapping of the connector's extra config (any
        :class:`CoordinatorOptions` field)."""
        own = extra.get("aio_mclookup", {})
        if not isinstance(own, Mapping):
            raise InvalidRequest(
                f"kv_connector_extra_config['aio_mclookup'] must be a mapping, got {own!r}",
                field="aio_mclookup",
            )
        unknown = set(own) - set(CoordinatorOptions.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(
                f"kv_connector_extra_config['aio_mclookup'] has unknown option(s) "
                f"{', '.join(sorted(unknown))} (the fields of CoordinatorOptions are allowed)",
                field="aio_mclookup",
            )
        return CoordinatorOptions(**{**PLUGIN_DEFAULTS, **own})

    async def _start_coordinator(self) -> LookupCoordinator:
        coordinator = LookupCoordinator(self.layout, self._store, options=self._options)
        await coordinator.__aenter__()
        return coordinator

    # ------------------------------------------------------------------ vLLM's contract
    def lookup(
        self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes], non_block: bool = False
    ) -> Any:
        """The request's lookup result, or None while it is pending and ``non_block``.

        A non-blocking lookup is started at the next :meth:`flush` (the end of the scheduler
        step), so all the lookups of one step start together and share RPCs; a blocking one
        (or a second call while still unsent) starts at once."""
        future = self._futures.get(req_id)
        if future is None:
            if self._closed:
                return self._make_result(0, ())
            if not non_block and self._exist_blocking is not None:
                return self._direct(req_id, num_tokens, block_hashes)
            future = concurrent.futures.Future()
            self._futures[req_id] = future
            self._unsent.append((future, num_tokens, list(block_hashes)))
            if non_block:
                return None
            self.flush()
        elif not future.done() and self._unsent:
            self.flush()
        if non_block and not future.done():
            return None
        try:
            result = future.result(self._wait_limit())
        except BaseException as exc:  # vLLM's contract: log, then a hit of 0
            future.cancel()
            logger.error("aio-mclookup lookup failed for %s: %r", req_id, exc)
            return self._make_result(0, ())
        finally:
            self._futures.pop(req_id, None)
        return self._vllm_result(result)

    def pending(self, req_id: str) -> bool:
        """Whether ``req_id``'s non-blocking lookup is submitted and its answer not in yet
        (then :meth:`lookup` would return None): the scheduler's cheap poll."""
        future = self._futures.get(req_id)
        return future is not None and not future.done()

    def wait_for_answers(self, timeout: float) -> None:
        """Block (the GIL released) until a pending lookup is answered, at most ``timeout``
        seconds; at once if none is pending or one is answered already. For a scheduler step
        that scheduled nothing: rather than spin through empty steps, polling, it lets the
        loop thread work."""
        self._answered.clear()
        done = [f.done() for f in self._futures.values()]
        if done and not any(done):  # (an answer not yet collected: the next step takes it)
            self._answered.wait(timeout)

    def _direct(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes]) -> Any:
        """One blocking lookup in the calling thread: plan, ask (in chunks of the
        coordinator's ``max_keys_per_rpc``), resolve; a failure is logged and gives 0."""
        assert self._exist_blocking is not None
        options = self._options
        try:
            plan = self.layout.plan(num_tokens, list(block_hashes))
            keys, step = list(plan.keys), options.max_keys_per_rpc
            answers: list[int] = []
            for start in range(0, len(keys), step):
                self.direct_rpcs += 1
                answers += self._exist_blocking(keys[start : start + step], options.timeout)
            result = plan.resolve_result(answers)
        except Exception as exc:  # vLLM's contract: log, then a hit of 0
            logger.error("aio-mclookup lookup failed for %s: %r", req_id, exc)
            return self._make_result(0, ())
        return self._vllm_result(result)

    def flush(self) -> None:
        """Start every lookup submitted since the last flush, together (vLLM's connector calls
        this once per scheduler step, from ``build_connector_meta``)."""
        if self._unsent:
            batch, self._unsent = self._unsent, []
            self._loop.call_soon(self._start_all, batch)

    def _start_all(self, batch: list[_Unsent]) -> None:
        """On the loop: one task per lookup, all created in the same loop iteration."""
        coordinator = self._coordinator
        for future, num_tokens, hashes in batch:
            if not future.set_running_or_notify_cancel():
                continue  # discarded before it started
            task = asyncio.ensure_future(coordinator.lookup_result(num_tokens, hashes))
            task.add_done_callback(functools.partial(_settle, future, self._answered))
            future.add_done_callback(functools.partial(_cancel_task, self._loop, task))

    def _vllm_result(self, result: LookupResult) -> Any:
        bounds = tuple((b.group_id, b.num_tokens) for b in result.tail_key_boundaries)
        return self._make_result(result.hit_length, bounds)

    def _wait_limit(self) -> float | None:
        timeout = self._options.timeout
        return None if timeout is None else timeout + _MARGIN

    def discard(self, req_id: str) -> None:
        """Forget a request's lookup (finished or aborted), cancelling it if still pending."""
        future = self._futures.pop(req_id, None)
        if future is not None:
            future.cancel()

    def reset(self) -> bool:
        """Wipe the store (vLLM's own reset, on its worker) and start a fresh coordinator."""
        ok = self._reset_store()
        for req_id in list(self._futures):
            self.discard(req_id)
        self._unsent.clear()
        self._coordinator = self._loop.submit(self._restart()).result(_CLOSE_TIMEOUT)
        return ok

    async def _restart(self) -> LookupCoordinator:
        await self._coordinator.aclose()
        return await self._start_coordinator()

    def close(self) -> None:
        """Cancel pending lookups, close the coordinator and the store, end the thread."""
        if self._closed:
            return
        self._closed = True
        for req_id in list(self._futures):
            self.discard(req_id)
        self._unsent.clear()
        try:
            self._loop.submit(self._shutdown()).result(_CLOSE_TIMEOUT)
        except BaseException as exc:
            logger.warning("aio-mclookup: closing the lookup client: %r", exc)
        if not self._loop.stop(_CLOSE_TIMEOUT):
            logger.warning("aio-mclookup: the lookup thread did not end in %s s", _CLOSE_TIMEOUT)

    async def _shutdown(self) -> None:
        try:
            await self._coordinator.aclose()
        finally:
            await self._close_store(self._store)

    # ------------------------------------------------------------------- observability
    def stats(self) -> CoordinatorStats:
        """A snapshot of the coordinator's statistics (RPCs, keys, lookups), taken on its
        thread."""
        return self._loop.submit(self._stats()).result(_CLOSE_TIMEOUT)

    async def _stats(self) -> CoordinatorStats:
        return self._coordinator.stats()
