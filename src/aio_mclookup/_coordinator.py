"""Coordinate: many concurrent lookups share deduplicated ``batch_is_exist`` RPCs.

Data flow of one ``await coordinator.lookup(...)``:

1. plan (in the caller: bad input fails here, before it can touch a shared batch);
2. admission (bounded pending work: wait, or :class:`Overloaded`);
3. known prefixes first (a lone full-attention group), then share the work of a *walker*
   probing the same prompt (see :meth:`LookupCoordinator._follow`);
4. probe rounds: :class:`ProbeState` names the keys whose answers can still change the hit;
   each key is answered from the positive-answer cache, joins a key already queued or in
   flight, or is queued;
5. the dispatcher sends queued keys at once while RPC slots are free (no linger by default);
   keys arriving while every slot is busy go out together in the next dispatch, split into
   RPCs of at most ``max_keys_per_rpc`` keys;
6. answers fan back out; a lookup whose round is complete starts its next round or resolves.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from ._arrays import KeyIndices
from ._cache import LEAVES_RUN, LIKELY_PRESENT, KnownPrefixes, PositiveCache, common_rows
from ._errors import (
    ClosedError,
    Error,
    InvalidRequest,
    LookupTimeout,
    Overloaded,
    StoreError,
)
from ._layout.groups import FullAttention
from ._layout.layout import KVLayout
from ._observe.stats import CoordinatorStats
from ._plan.hashes import HashInput
from ._plan.plan import LookupPlan
from ._plan.probing import ProbeState
from ._store.protocol import CallbackStore, Store

__all__ = ["LookupCoordinator"]

logger = logging.getLogger("aio_mclookup")

_UNSET: float = float("nan")
_EAGER_KEYS = 4096
"""Plans up to this many keys build them all at once; except a lone full-attention group,
which builds only the ranges its rounds probe (the caches answer most of its keys)."""
_NOTHING_CACHED: dict[bytes, float] = {}  # never written: a dict's get beats a proxy's
_PRESENT = 1.0
"""The mark of a present answer when no cache keeps it (``cache_ttl`` None): no expiry is
tracked, and as a time it is long past, so no known prefix is ever built on it."""


@dataclass(eq=False, slots=True)
class _Lookup:
    """One lookup in progress: its plan, probing state and the round being answered."""

    plan: LookupPlan
    state: ProbeState
    future: asyncio.Future[int]
    ident: int
    """Its number among the coordinator's lookups (>= 1), as used in :data:`_Subscribers`."""
    round_keys: KeyIndices = range(0)
    round_present: list[float] = field(default_factory=list)  # (set by every round)
    """Per key of the round: 0.0 absent, else until when it is known present (see _rpc;
    ``_PRESENT`` when the cache is off)."""
    waiting: int = 0
    likely_miss: bool = False
    """A cache knew a prefix and the chunk after it is likely absent (see
    :meth:`KnownPrefixes.after`): the first round probes that chunk alone."""
    own_way: bool = False
    """The request leaves the known run right after its known prefix: no walker can share
    its next chunk, so it does not look for one (see :meth:`LookupCoordinator._follow`)."""
    prefix_rows: npt.NDArray[np.uint8] | None = None
    """A lone full-attention group's hash rows, when its known-present prefix is to be
    remembered in the coordinator's :class:`KnownPrefixes` once the lookup settles."""
    prefix_from_runs: int = 0
    """Chunks the known prefixes answered at the start (nothing new to remember there)."""
    valid_until: float = math.inf
    """Until when every presence this lookup relied on holds (its earliest expiry)."""
    done: bool = False
    """Settled (result, error or cancelled): answers for it are dropped."""
    prompt: tuple[Hashable, bytes] | None = None
    """With ``prefix_rows``: the layout's key prefixes and the first hash, which find its
    known prefix and its walker."""
    walk: tuple[Hashable, bytes] | None = None
    """Set while it is the walker of a shared prefix (see ``LookupCoordinator._follow``)."""
    followers: list[_Lookup] | None = None
    """Lookups waiting for this walker's current round."""
    follow_until: int = 0
    """While following: the first chunk whose hash differs from the walker's."""


_Submit = Callable[[tuple[bytes, ...], Callable[[list[int] | BaseException], None]], None]
"""A store's call-back form of ``batch_is_exist`` (see :meth:`LookupCoordinator._send`)."""

_Subscribers = int | list[int]
"""Who waits for one key's answer: one subscriber, or a list of them (the key is shared). A
subscriber is ``lookup.ident << _POS_BITS | position in the lookup's round`` (a round has far
fewer than 2**32 keys). Plain ints, not objects: under load every object the garbage collector
tracks costs time, and a dict holding only ints is not tracked at all."""
_POS_BITS = 32
_POS_MASK = (1 << _POS_BITS) - 1


class LookupCoordinator:
    """Answer many concurrent prefix lookups with shared, deduplicated store RPCs.

    ``await coordinator.lookup(token_len, block_hashes)`` returns exactly what
    ``layout.plan(token_len, block_hashes).resolve(answers)`` gives on the store's answers
    (vLLM 0.26's hit). The coordinator uses the store but does not open or close it.

    Options:

    * ``timeout``: seconds each lookup may take (None: no bound); ``lookup(timeout=...)``
      overrides it per call. A late lookup raises :class:`LookupTimeout`.
    * ``on_error``: ``"raise"`` gives callers whose keys were in a failed RPC a
      :class:`StoreError`; ``"absent"`` (vLLM's behaviour) counts those keys as absent.
    * ``max_keys_per_rpc`` (1000: bigger RPCs stall ~40 ms on loopback), ``max_rpcs_in_flight``
      (2: parallel RPCs on the store's threads; fewer, larger RPCs measured faster than more
      parallel ones on 2 vCPUs), ``linger`` (seconds to wait for more work before a dispatch;
      0 sends at once).
    * ``max_pending_lookups`` / ``max_pending_keys``: bounds on admitted work; past them
      callers wait (``when_full="wait"``) or get :class:`Overloaded` (``"raise"``).
    * ``cache_ttl``: seconds a positive answer is reused, counted from when its RPC was sent;
      keep it below the master's ``default_kv_lease_ttl`` (10 s by default), which pins a
      present object that long. None disables the cache. See ``docs/coordinator.md``.
    * ``rounds``: probe only keys that can change the answer, in rounds (fewer keys, more
      RPC round trips); False sends every planned key in one round, as vLLM does.
    * ``probe_window``: while the store is busy, each round probes at most this many of the
      unknown chunks an answer rests on per spec-group (doubling every round); an idle
      coordinator probes them all at once. None: never limit.
    * ``failure_backoff``: after a failed RPC the coordinator fails fast for this long, then
      lets one probe RPC through (doubling the pause, up to 8x, while the store stays down).
    """

    def __init__(
        self,
        layout: KVLayout,
        store: Store,
        *,
        timeout: float | None = None,
        on_error: Literal["raise", "absent"] = "raise",
        max_keys_per_rpc: int = 1000,
        max_rpcs_in_flight: int = 2,
        linger: float = 0.0,
        max_pending_lookups: int = 4096,
        max_pending_keys: int = 2_000_000,
        when_full: Literal["wait", "raise"] = "wait",
        cache_ttl: float | None = 5.0,
        cache_max_keys: int = 1_000_000,
        rounds: bool = True,
        probe_window: int | None = 16,
        failure_backoff: float = 1.0,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidRequest(f"layout must be a KVLayout, got {type(layout).__name__}")
        if on_error not in ("raise", "absent"):
            raise InvalidRequest(f"on_error must be 'raise' or 'absent', got {on_error!r}")
        if when_full not in ("wait", "raise"):
            raise InvalidRequest(f"when_full must be 'wait' or 'raise', got {when_full!r}")
        for name, value in (
            ("max_keys_per_rpc", max_keys_per_rpc),
            ("max_rpcs_in_flight", max_rpcs_in_flight),
            ("max_pending_lookups", max_pending_lookups),
            ("max_pending_keys", max_pending_keys),
            ("cache_max_keys", cache_max_keys),
            ("probe_window", 1 if probe_window is None else probe_window),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequest(f"{name} must be a positive int, got {value!r}")
        for name, seconds in (("timeout", timeout), ("cache_ttl", cache_ttl)):
            if seconds is not None and not seconds > 0:
                raise InvalidRequest(f"{name} must be > 0 or None, got {seconds!r}")
        if not linger >= 0 or not failure_backoff > 0:
            raise InvalidRequest("linger must be >= 0 and failure_backoff > 0")
        self.layout = layout
        self.store = store
        self.timeout = timeout
        self.on_error = on_error
        self.max_keys_per_rpc = max_keys_per_rpc
        self.max_rpcs_in_flight = max_rpcs_in_flight
        self.linger = linger
        self.max_pending_lookups = max_pending_lookups
        self.max_pending_keys = max_pending_keys
        self.when_full = when_full
        self.cache_ttl = cache_ttl
        self.cache_max_keys = cache_max_keys
        self.rounds = rounds
        self.probe_window = probe_window
        self.failure_backoff = failure_backoff

        self._stats = CoordinatorStats()
        self._queued: dict[bytes, _Subscribers] = {}
        self._in_flight: dict[bytes, _Subscribers] = {}
        self._answering: dict[bytes, float] = {}
        """The answers of the RPC being fanned out right now (marks as in ``round_present``).
        A round that starts during the fan-out takes them as if it had joined that RPC while
        in flight: what deduplication does anyway, just a moment later."""
        self._cache = PositiveCache()  # filled only while cache_ttl is set
        self._prefixes = KnownPrefixes()  # likewise
        self._walkers: dict[tuple[Hashable, bytes], _Lookup] = {}  # see _follow
        self._lookups: dict[int, _Lookup] = {}  # by ident: the subscribers' registry
        self._idents = itertools.count(1)
        self._dispatch_lookups: set[_Lookup] = set()
        self._admission_queue: collections.deque[object] = collections.deque()  # FIFO tickets
        self._pending_keys = 0
        self._rpc_tasks: set[asyncio.Task[None]] = set()
        self._calls_in_flight = 0  # RPCs through a store that calls back (see _send)
        self._submit: _Submit | None = (
            store.batch_is_exist_then if isinstance(store, CallbackStore) else None
        )
        self._wake: asyncio.Event | None = None
        self._room: asyncio.Condition | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        # Circuit breaker: while time < _retry_at, fail fast; then one probe RPC at a time.
        self._failures = 0
        self._retry_at = 0.0
        self._last_code: int | None = None
        self._last_ok: float | None = None

    # ------------------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> LookupCoordinator:
        self._start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _start(self) -> None:
        if self._closed:
            raise ClosedError("the coordinator is closed")
        if self._dispatcher is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._room = asyncio.Condition()
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
        for lookup in list(self._lookups.values()):
            self._fail(lookup, ClosedError("the coordinator was closed"))
        self._queued.clear()
        tasks = [t for t in (self._dispatcher, *self._rpc_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._rpc_tasks.clear()  # (a task cancelled before it started never removes itself)
        self._in_flight.clear()
        if self._room is not None:
            async with self._room:
                self._room.notify_all()

    # --------------------------------------------------------------------------- lookups
    async def lookup(
        self,
        token_len: int,
        block_hashes: HashInput,
        *,
        layout: KVLayout | None = None,
        timeout: float | None = _UNSET,
    ) -> int:
        """The prefix hit, in tokens, of one request (vLLM 0.26's answer on the store).

        ``token_len`` must be a multiple of the layout's scheduler block (see
        :meth:`KVLayout.align`); ``layout`` lets one coordinator serve several models.
        """
        plan = (layout or self.layout).plan(token_len, block_hashes)  # raises InvalidRequest
        if self._closed:
            raise ClosedError("the coordinator is closed")
        if self._dispatcher is None:
            self._start()
        limit = self.timeout if timeout is _UNSET else timeout
        if limit is not None and not limit > 0:
            raise InvalidRequest(f"timeout must be > 0 or None, got {limit!r}")
        started = time.perf_counter()
        stats = self._stats
        stats.keys_planned_total += plan.num_keys
        stats.requested_tokens_total += max(plan.token_len, 0)
        try:
            hit = await self._run(plan, limit)
        except asyncio.CancelledError:
            stats.lookups_cancelled_total += 1
            raise
        except Error as exc:
            stats.lookups_total += 1
            stats.lookups_failed_total += 1
            stats.count_error(_error_label(exc))
            raise
        stats.lookups_total += 1
        stats.hit_tokens_total += hit
        stats.lookup_seconds.observe(time.perf_counter() - started)
        return hit

    async def _run(self, plan: LookupPlan, limit: float | None) -> int:
        """Admit, probe and resolve one plan within ``limit`` seconds; cleans up whatever way
        it ends."""
        if not plan.num_keys:
            return 0
        loop = self._loop
        assert loop is not None
        deadline = None if limit is None else loop.time() + limit
        if self._admission_queue or not self._has_room(plan.num_keys):  # else no coroutine
            await self._admit(plan.num_keys, deadline, limit)
        lookup = _Lookup(
            plan, ProbeState(plan, self.rounds), loop.create_future(), next(self._idents)
        )
        timer = None
        if deadline is not None:  # a timer, not wait_for: no extra task per lookup
            timer = loop.call_at(deadline, self._expire, lookup, limit)
        self._lookups[lookup.ident] = lookup
        self._pending_keys += plan.num_keys
        try:
            prefix_mode = lookup.state.known_prefix is not None
            if not prefix_mode and plan.num_keys <= _EAGER_KEYS:
                _build_keys(plan)  # one vectorised build beats several partial ones
            if (
                self.rounds
                and (self.cache_ttl is not None or self._cache or self._prefixes)
                and not plan.probe_in_one_round
            ):
                self._prefill_from_cache(lookup, prefix_mode)
            if lookup.prefix_rows is None or lookup.own_way or not self._follow(lookup):
                self._next_round(lookup)
            return await lookup.future
        finally:
            if lookup.walk is not None:
                self._end_walk(lookup)
            if timer is not None:
                timer.cancel()
            lookup.done = True
            if not lookup.future.done():
                lookup.future.cancel()
            elif not lookup.future.cancelled():
                lookup.future.exception()  # mark retrieved, whoever stopped waiting
            del self._lookups[lookup.ident]
            self._pending_keys -= plan.num_keys
            if lookup.waiting:
                self._forget(lookup)
            if self._admission_queue:
                assert self._room is not None
                async with self._room:
                    self._room.notify_all()

    async def _admit(self, num_keys: int, deadline: float | None, limit: float | None) -> None:
        """Admission in arrival order: while anyone waits, newcomers queue behind them."""
        if not self._admission_queue and self._has_room(num_keys):
            return
        if self.when_full == "raise":
            raise Overloaded(
                f"{len(self._lookups)} lookups / {self._pending_keys} keys pending "
                f"(max {self.max_pending_lookups} / {self.max_pending_keys})"
            )
        assert self._room is not None and self._loop is not None
        ticket = object()
        self._admission_queue.append(ticket)
        try:
            if deadline is None:
                await self._wait_for_room(ticket, num_keys)
            else:
                await asyncio.wait_for(
                    self._wait_for_room(ticket, num_keys),
                    max(0.0, deadline - self._loop.time()),
                )
        except asyncio.TimeoutError:
            raise LookupTimeout(f"lookup did not finish within {limit} s") from None
        finally:
            self._admission_queue.remove(ticket)
            if self._admission_queue:  # the next in line may fit now
                self._loop.create_task(self._wake_waiters())

    async def _wait_for_room(self, ticket: object, num_keys: int) -> None:
        assert self._room is not None
        async with self._room:
            while not (self._admission_queue[0] is ticket and self._has_room(num_keys)):
                await self._room.wait()
                if self._closed:
                    raise ClosedError("the coordinator was closed")

    async def _wake_waiters(self) -> None:
        assert self._room is not None
        async with self._room:
            self._room.notify_all()

    def _expire(self, lookup: _Lookup, limit: float | None) -> None:
        self._fail(lookup, LookupTimeout(f"lookup did not finish within {limit} s"))

    def _has_room(self, num_keys: int) -> bool:
        if not self._lookups:
            return True  # one lookup always fits, however large
        return (
            len(self._lookups) < self.max_pending_lookups
            and self._pending_keys + num_keys <= self.max_pending_keys
        )

    def _next_round(self, lookup: _Lookup) -> None:
        """Queue the keys of the lookup's next round, or settle it when none are left."""
        state = lookup.state
        while not lookup.done and not lookup.future.done():
            window = self.probe_window
            if window is not None and (self._rpc_tasks or self._calls_in_flight or self._queued):
                if lookup.likely_miss and not state.rounds:
                    window = 1  # test the likely miss alone first
                else:
                    window <<= min(state.rounds, 20)
            else:  # an idle store: latency first, probe everything the answer rests on
                window = None
            wanted = state.next_keys(window)
            count = len(wanted)
            if not count:
                assert state.hit is not None
                lookup.done = True
                if not lookup.future.done():
                    lookup.future.set_result(state.hit)
                    if lookup.prefix_rows is not None:
                        self._remember_prefix(lookup)
                return
            self._stats.rounds_total += 1
            lookup.round_keys = wanted
            lookup.round_present = [0.0] * count
            lookup.waiting = count
            if self._subscribe(lookup, lookup.plan.keys_at(wanted)):
                return  # answers will arrive from the store
            self._record_round(lookup)

    def _record_round(self, lookup: _Lookup) -> None:
        """Every answer of the round is in: record them (and how long they hold)."""
        if lookup.prefix_rows is not None:
            until = min(filter(None, lookup.round_present), default=math.inf)
            if until < lookup.valid_until:
                lookup.valid_until = until
        lookup.state.record(lookup.round_keys, lookup.round_present)

    def _remember_prefix(self, lookup: _Lookup) -> None:
        """A lone full-attention lookup settled: remember its present prefix by hash rows."""
        assert lookup.prefix_rows is not None
        known = lookup.state.known_prefix
        if (
            known is not None
            and known > lookup.prefix_from_runs
            and lookup.valid_until > time.monotonic()
        ):
            rows = lookup.prefix_rows
            miss = rows[known].tobytes() if known < lookup.plan.groups[0].limit else None
            self._prefixes.add(
                lookup.plan.geometry.prefix_bytes[0],
                rows[:known],
                lookup.valid_until,
                self.cache_max_keys,
                lookup.prompt,
                miss,
            )

    def _subscribe(self, lookup: _Lookup, keys: Sequence[bytes]) -> bool:
        """Answer what the cache knows, join shared probes, queue the rest.

        Returns True when some answers are still to come.
        """
        stats = self._stats
        cached: Mapping[bytes, float] = _NOTHING_CACHED
        if self._cache:
            self._cache.expire(time.monotonic())
            cached = self._cache.members
        queued = self._queued
        in_flight = self._in_flight
        answering = self._answering
        present = lookup.round_present
        base = lookup.ident << _POS_BITS
        fresh = hits = shared = just_answered = 0
        for pos, key in enumerate(keys):
            until = cached.get(key)
            if until is not None:
                present[pos] = until
                hits += 1
                continue
            if answering:  # answered by the RPC whose answers are being fanned out
                answer = answering.get(key)
                if answer is not None:
                    present[pos] = answer
                    just_answered += 1
                    continue
            table = in_flight
            subscribers = in_flight.get(key)
            if subscribers is None:
                table = queued
                subscribers = queued.get(key)
                if subscribers is None:
                    queued[key] = base | pos
                    fresh += 1
                    continue
            if isinstance(subscribers, int):
                table[key] = [subscribers, base | pos]
            else:
                subscribers.append(base | pos)
            shared += 1
        stats.dedup_hits_total += shared + just_answered
        stats.cache_hits_total += hits
        lookup.waiting -= hits + just_answered
        if fresh:
            self._dispatch_lookups.add(lookup)
            assert self._wake is not None
            self._wake.set()
        return lookup.waiting > 0

    def _subscribed(self, subscribers: _Subscribers) -> Iterator[tuple[_Lookup, int]]:
        """The unsettled lookups among ``subscribers``, with their positions."""
        lookups = self._lookups
        for sub in (subscribers,) if isinstance(subscribers, int) else subscribers:
            lookup = lookups.get(sub >> _POS_BITS)
            if lookup is not None and not lookup.done:
                yield lookup, sub & _POS_MASK

    def _answer(self, subscribers: _Subscribers, present: float) -> None:
        for lookup, pos in self._subscribed(subscribers):  # skips lookups settled meanwhile
            lookup.round_present[pos] = present
            lookup.waiting -= 1
            if lookup.waiting == 0:
                self._advance(lookup)

    def _advance(self, lookup: _Lookup) -> None:
        """A round is answered: record it and go on. Runs inside a shared RPC task, so a
        failure (vLLM's own IndexError cases surface as InvalidRequest) ends only this lookup."""
        try:
            self._record_round(lookup)
            self._next_round(lookup)
        except Exception as exc:
            self._fail(lookup, exc if isinstance(exc, Error) else StoreError(repr(exc)))
        if lookup.followers:  # a walker's round is over: its followers go on from there
            self._release(lookup, settled=lookup.done)

    @staticmethod
    def _fail(lookup: _Lookup, error: BaseException) -> None:
        # A cancelled caller's future is done before its task marks the lookup done.
        if not lookup.done and not lookup.future.done():
            lookup.future.set_exception(error)
        lookup.done = True

    def _prefill_from_cache(self, lookup: _Lookup, prefix_mode: bool) -> None:
        """Answer the full-attention chunks the caches know, before the first round, so the
        first probe starts where the cached prefix ends.

        A lone full-attention group first asks the known prefixes (one compare of hash rows,
        no keys built); then, for every full-attention group, the key cache is read a block
        at a time from there, so a short cached prefix costs little.
        """
        plan = lookup.plan
        cache = self._cache
        now = time.monotonic()
        cache.expire(now)
        k = len(plan.geometry.namespaces)
        for probe in plan.groups:
            if not probe.chunks.size or not isinstance(
                plan.geometry.groups[probe.group_id], FullAttention
            ):
                continue
            span = plan.key_span(probe)
            run = 0
            likely_miss = True
            if prefix_mode and probe.hash_rows is not None:
                signature = plan.geometry.prefix_bytes[0]
                prompt = KnownPrefixes.key_of(signature, probe.hash_rows)
                if self.cache_ttl is not None:  # remember its prefix once it settles
                    lookup.prefix_rows = probe.hash_rows
                    lookup.prompt = prompt
                chunks, lookup.valid_until = self._prefixes.leading(
                    signature, probe.hash_rows, now, prompt
                )
                lookup.prefix_from_runs = chunks
                run = chunks * k
                if chunks:
                    after = self._prefixes.after(prompt, probe.hash_rows, chunks)
                    likely_miss = after != LIKELY_PRESENT
                    lookup.own_way = after == LEAVES_RUN
            if cache and not run:  # (else the first round reads the key cache as it goes)
                block = k
                while run < len(span):
                    stop = min(span.stop, span.start + run + block)
                    got, until = cache.leading(plan.keys_at(range(span.start + run, stop)))
                    run += got
                    lookup.valid_until = min(lookup.valid_until, until)
                    if span.start + run < stop:
                        break
                    block *= 8
            cached = run - run % k
            if cached:
                lookup.likely_miss = likely_miss
                self._stats.cache_hits_total += cached
                lookup.state.record_present(range(span.start, span.start + cached))

    def _follow(self, lookup: _Lookup) -> bool:
        """A lone full-attention lookup about to probe past its known prefix: share the work
        of the lookup probing the same prompt (its *walker*, found by the layout's key prefixes
        and the first hash) instead of subscribing to the same keys chunk by chunk.

        It takes the walker's answers for the chunks both share (same hash rows, so the same
        keys and answers). If it is then at the walker's current chunk, with the same hash
        there, and the walker's round fits one RPC, it waits for that round (see
        :meth:`_release`) and returns True: a wait no longer than joining the walker's keys
        would be. Otherwise it probes by itself (False), and becomes the walker if there is
        none."""
        rows, key = lookup.prefix_rows, lookup.prompt
        start = lookup.state.known_prefix
        if rows is None or key is None or start is None or start >= rows.shape[0]:
            return False
        walker = self._walkers.get(key)
        if walker is lookup:
            return False
        walked = None if walker is None else walker.state.known_prefix
        theirs = None if walker is None else walker.prefix_rows
        if walker is not None and walked is not None and walked > start:
            start = self._take_walked(lookup, walker, start, walked)  # (settled or not)
        if walker is None or walker.done:
            self._walkers[key] = lookup
            lookup.walk = key
            return False
        if theirs is None or walked != start or start >= min(theirs.shape[0], rows.shape[0]):
            return False  # not at the walker's chunk: nothing more to share
        if theirs[start].tobytes() != rows[start].tobytes():
            return False  # our next chunk is not theirs
        if len(walker.round_keys) > self.max_keys_per_rpc:
            return False  # a round of several RPCs: do not wait for the slowest of them
        lookup.follow_until = start + common_rows(theirs[start:], rows[start:])
        if walker.followers is None:
            walker.followers = []
        walker.followers.append(lookup)
        return True

    def _take_walked(self, lookup: _Lookup, walker: _Lookup, start: int, walked: int) -> int:
        """Record the walker's present chunks ``start`` to ``walked`` that the lookup shares
        (as if it had joined the walker's keys); returns its new known prefix."""
        theirs, rows = walker.prefix_rows, lookup.prefix_rows
        assert theirs is not None and rows is not None
        if start >= min(theirs.shape[0], rows.shape[0]) or (
            theirs[start].tobytes() != rows[start].tobytes()  # (the usual miss, found cheaply)
        ):
            return start
        shared = common_rows(theirs[start:walked], rows[start:walked])
        if shared:
            k = len(lookup.plan.geometry.namespaces)
            offset = lookup.plan.groups[0].key_offset
            lookup.valid_until = min(lookup.valid_until, walker.valid_until)
            self._stats.cache_hits_total += shared * k
            lookup.state.record_present(range(offset + start * k, offset + (start + shared) * k))
            lookup.likely_miss = (
                start + shared < walked  # it went its own way within the walker's chunks
                or self._prefixes.after(lookup.prompt, rows, start + shared) != LIKELY_PRESENT
            )
        return start + shared

    def _end_walk(self, walker: _Lookup) -> None:
        """A walker settled (whichever way): no longer the walker; release its followers."""
        assert walker.walk is not None
        if self._walkers.get(walker.walk) is walker:
            del self._walkers[walker.walk]
        walker.walk = None
        if walker.followers:
            self._release(walker, settled=True)

    def _release(self, walker: _Lookup, settled: bool) -> None:
        """The walker finished a round (or settled): followers whose chunks it has not yet
        passed keep waiting; the others take what it found and follow again, or probe by
        themselves."""
        followers, walker.followers = walker.followers or (), None
        walked = None if settled else walker.state.known_prefix
        if len(walker.round_keys) > self.max_keys_per_rpc:
            walked = None  # its next round needs several RPCs: no waiting for it
        for lookup in followers:
            if lookup.done or lookup.future.done():
                continue
            if walked is not None and walked < lookup.follow_until:
                if walker.followers is None:  # still sharing its next chunk: wait on
                    walker.followers = []
                walker.followers.append(lookup)
                continue
            try:
                if not self._follow(lookup):
                    self._next_round(lookup)
            except Exception as exc:
                self._fail(lookup, exc if isinstance(exc, Error) else StoreError(repr(exc)))

    def _forget(self, lookup: _Lookup) -> None:
        """Drop a finished lookup's queued probes that nobody else waits for."""
        if not lookup.waiting or not self._queued:
            return
        for key in lookup.plan.keys_at(lookup.round_keys):
            subscribers = self._queued.get(key)
            if subscribers is not None and not any(self._subscribed(subscribers)):
                del self._queued[key]

    # ------------------------------------------------------------------------ dispatching
    async def _dispatch_forever(self) -> None:
        assert self._wake is not None and self._loop is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.linger:
                await asyncio.sleep(self.linger)
            try:
                self._dispatch()
            except Exception:  # the dispatcher must outlive any bug in one dispatch
                logger.exception("aio_mclookup: dispatch failed")

    def _dispatch(self) -> None:
        """Send queued keys while RPC slots are free; fail fast while the store is down."""
        assert self._loop is not None
        if not self._queued:
            return
        now = time.monotonic()
        if self._failures and now < self._retry_at:
            self._fail_queued(now)
            return
        busy = len(self._rpc_tasks) + self._calls_in_flight
        slots = self.max_rpcs_in_flight - busy
        if self._failures:
            slots = min(slots, 1) if not busy else 0  # half-open: one probe RPC
        if slots <= 0:
            return
        queued = self._queued
        keys = tuple(queued)  # tuples of keys: the GC stops tracking them after one look
        if len(keys) > slots * self.max_keys_per_rpc:
            keys = keys[: slots * self.max_keys_per_rpc]
            taken = {key: queued.pop(key) for key in keys}
        else:
            taken, self._queued = queued, {}
        self._in_flight.update(taken)
        # Split evenly over the free slots, each RPC at most max_keys_per_rpc keys.
        count = min(slots, -(-len(keys) // self.max_keys_per_rpc))
        size = -(-len(keys) // count)
        submit = self._submit
        for start in range(0, len(keys), size):
            if submit is not None:
                self._send(submit, keys[start : start + size])
                continue
            task = self._loop.create_task(self._rpc(keys[start : start + size]))
            self._rpc_tasks.add(task)
        self._stats.dispatches_total += 1
        self._stats.lookups_per_dispatch.observe(len(self._dispatch_lookups))
        self._dispatch_lookups.clear()

    def _fail_queued(self, now: float) -> None:
        """The store is failing: answer queued keys now instead of feeding it."""
        queued, self._queued = self._queued, {}
        self._dispatch_lookups.clear()
        code = self._last_code
        for key, subscribers in queued.items():
            self._settle_failed(key, subscribers, code, "store unavailable; failing fast")
        assert self._loop is not None and self._wake is not None
        wake = self._wake
        self._loop.call_at(self._loop.time() + (self._retry_at - now), wake.set)

    def _settle_failed(
        self, key: bytes, subscribers: _Subscribers, code: int | None, why: str
    ) -> None:
        if self.on_error == "absent":
            self._answer(subscribers, 0.0)
            return
        for lookup, _ in self._subscribed(subscribers):
            self._fail(lookup, StoreError(f"{why} (code {code})", code=code))

    async def _rpc(self, keys: tuple[bytes, ...]) -> None:
        """One ``batch_is_exist`` call and the fan-out of its answers."""
        stats = self._stats
        sent_at, started = self._count_sent(keys)
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
            stats.rpc_seconds.observe(time.perf_counter() - started)
            task = asyncio.current_task()
            if task is not None:
                self._rpc_tasks.discard(task)
            assert self._wake is not None
            self._wake.set()
        self._settle_rpc(keys, sent_at, outcome)

    def _count_sent(self, keys: tuple[bytes, ...]) -> tuple[float, float]:
        """Count an RPC of ``keys`` as sent; when (monotonic: cache expiry counts from it) and
        its start (``perf_counter``: its duration)."""
        stats = self._stats
        stats.rpcs_total += 1
        stats.keys_sent_total += len(keys)
        stats.keys_per_rpc.observe(len(keys))
        return time.monotonic(), time.perf_counter()

    def _send(self, submit: _Submit, keys: tuple[bytes, ...]) -> None:
        """:meth:`_rpc` through a store that calls back instead of being awaited (see
        :class:`CallbackStore`): the answers fan out as soon as the loop
        picks them up, one loop iteration before an awaiting task would resume."""
        stats = self._stats
        sent_at, started = self._count_sent(keys)
        self._calls_in_flight += 1

        def answered(outcome: list[int] | BaseException) -> None:
            self._calls_in_flight -= 1
            if self._closed:
                return  # close settled every caller
            stats.rpc_seconds.observe(time.perf_counter() - started)
            assert self._wake is not None
            self._wake.set()
            self._settle_rpc(keys, sent_at, outcome)

        try:
            submit(keys, answered)
        except Exception as exc:  # (closed meanwhile): a failed RPC, answered at once
            answered(exc)

    def _settle_rpc(
        self, keys: tuple[bytes, ...], sent_at: float, outcome: Sequence[int] | BaseException
    ) -> None:
        """An RPC sent at ``sent_at`` is over: fan its answers out (and cache them), or fail
        its keys."""
        error, present = None, None
        if isinstance(outcome, BaseException):
            error = outcome
        elif len(outcome) != len(keys):
            error = StoreError(f"store answered {len(outcome)} values for {len(keys)} keys")
        else:  # vLLM: only 1 is present. A present key is marked with until when that holds.
            mark = _PRESENT if self.cache_ttl is None else sent_at + self.cache_ttl
            try:
                present = [mark if answer == 1 else 0.0 for answer in outcome]
            except Exception as exc:  # (answers that are not ints)
                error = StoreError(f"store answered something other than ints: {exc!r}")
        in_flight = self._in_flight
        if error is not None or present is None:
            self._record_failure(error)
            code = error.code if isinstance(error, StoreError) else None
            for key in keys:
                subscribers = in_flight.pop(key, None)
                if subscribers:
                    self._settle_failed(key, subscribers, code, f"store RPC failed: {error}")
            return
        self._record_success()
        if self.cache_ttl is not None:  # before the fan-out: next rounds may read it
            self._cache.add(
                tuple(itertools.compress(keys, present)),
                sent_at + self.cache_ttl,
                self.cache_max_keys,
            )
        pop = in_flight.pop
        lookups = self._lookups
        # Next rounds started by this fan-out take these answers too, wherever they are.
        self._answering = dict(zip(keys, present))
        try:
            for key, is_present in zip(keys, present):  # _answer, inlined: this loop is hot
                subscribers = pop(key, None)
                if subscribers is None:
                    continue
                for sub in (subscribers,) if isinstance(subscribers, int) else subscribers:
                    lookup = lookups.get(sub >> _POS_BITS)
                    if lookup is not None and not lookup.done:
                        lookup.round_present[sub & _POS_MASK] = is_present
                        lookup.waiting -= 1
                        if not lookup.waiting:
                            self._advance(lookup)
        finally:
            self._answering = {}

    def _record_failure(self, error: BaseException | None) -> None:
        stats = self._stats
        stats.rpc_errors_total += 1
        code = error.code if isinstance(error, StoreError) else None
        stats.last_error = f"{type(error).__name__}: {error}"
        self._last_code = code
        self._failures += 1
        pause = self.failure_backoff * min(2 ** (self._failures - 1), 8)
        self._retry_at = time.monotonic() + pause

    def _record_success(self) -> None:
        self._failures = 0
        self._last_ok = time.monotonic()

    # ---------------------------------------------------------------------- observability
    @property
    def healthy(self) -> bool:
        """False while the coordinator fails fast after store errors (and once closed); once
        the pause is over it lets a probe RPC through and counts as healthy again."""
        if self._closed:
            return False
        return not self._failures or time.monotonic() >= self._retry_at

    def stats(self) -> CoordinatorStats:
        """A snapshot of counters and histograms (see :class:`CoordinatorStats`)."""
        stats = self._stats
        stats.pending_lookups = len(self._lookups)
        stats.pending_keys = len(self._queued)
        stats.rpcs_in_flight = len(self._rpc_tasks) + self._calls_in_flight
        stats.store_healthy = self.healthy
        stats.last_rpc_ok_age = (
            None if self._last_ok is None else time.monotonic() - self._last_ok
        )
        return stats.snapshot()


def _build_keys(plan: LookupPlan) -> None:
    """Build every key of the plan at once (cached by the plan), as one array if it can."""
    if plan.key_array() is None:
        plan.keys  # noqa: B018 - builds and caches the list


def _error_label(exc: Error) -> str:
    """The ``errors_by_code`` label of a failed lookup."""
    if isinstance(exc, StoreError):
        return str(exc.code) if exc.code is not None else "exception"
    if isinstance(exc, LookupTimeout):
        return "timeout"
    if isinstance(exc, Overloaded):
        return "overloaded"
    if isinstance(exc, ClosedError):
        return "closed"
    return type(exc).__name__
