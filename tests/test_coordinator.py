"""LookupCoordinator on the in-process FakeStore: batching, dedup, chunking, rounds, cache,
failures, cancellation, timeouts, backpressure and close; under anyio's pytest plugin on
asyncio, uvloop and trio (conftest's ``anyio_backend``: trio runs the anyio shell)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np
import pytest
import sniffio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aio_mclookup as mcl
from aio_mclookup import FakeStore
from aio_mclookup._backend import call_soon_threadsafe
from aio_mclookup._coordinator.core import _COLD_SHIFT
from aio_mclookup._plan.plan import LookupPlan
from helpers import chain, gather
from v026_layouts import KVLayout, LookupCoordinator  # these tests pin vLLM 0.26's rules

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is Linux-only
    uvloop = None

pytestmark = pytest.mark.anyio

_T = TypeVar("_T")

ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", [
    pytest.param(("asyncio", {}), id="asyncio"),
    *([pytest.param(("asyncio", {"loop_factory": uvloop.new_event_loop}), id="uvloop")]
      if uvloop is not None else []),
])
"""For the few tests of asyncio-only behaviour: asyncio and uvloop, not trio."""



def on_trio() -> bool:
    return bool(sniffio.current_async_library() == "trio")


async def settle(passes: int = 1) -> None:
    """Let the tasks started so far run until they wait: ``passes`` loop passes on asyncio (as
    many ``sleep(0)``); on trio, which runs ready tasks in any order, until all are blocked."""
    if on_trio():
        await anyio.wait_all_tasks_blocked()
        return
    for _ in range(passes):
        await anyio.lowlevel.checkpoint()


class Cancelled(Exception):
    """A :class:`Task`'s outcome when it was cancelled (its cancel scope caught the
    backend's cancellation: the call did not swallow it)."""


class Task(Generic[_T]):
    """``fn(*args, **kw)`` in a task of ``group`` in a cancel scope of its own: what
    ``asyncio.ensure_future`` gave these tests, on any backend."""

    def __init__(self, group: anyio.abc.TaskGroup, fn: Callable[..., Awaitable[_T]],
                 *args: Any, **kw: Any) -> None:
        self._scope = anyio.CancelScope()
        self._done = anyio.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        group.start_soon(self._run, fn, args, kw)

    async def _run(self, fn: Callable[..., Awaitable[_T]], args: Any, kw: Any) -> None:
        try:
            with self._scope:
                self._value = await fn(*args, **kw)
            if self._scope.cancelled_caught:
                self._error = Cancelled()
        except Exception as exc:
            self._error = exc
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        self._scope.cancel()

    async def outcome(self) -> _T | BaseException:
        """Its value, or the exception it raised (:class:`Cancelled` if cancelled)."""
        await self._done.wait()
        return self._error if self._error is not None else self._value  # type: ignore[no-any-return]

    async def result(self) -> _T:
        """Its value; what it raised is raised here."""
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[no-any-return]


def shell_of(coord: LookupCoordinator) -> Any:
    """The shell running ``coord``: the anyio one (trio) or the coordinator itself (asyncio);
    both keep ``_calls_in_flight``, ``_waiters`` and ``_admit_next``."""
    return coord._other if coord._other is not None else coord


def rpc_tasks(coord: LookupCoordinator) -> int:
    """RPC tasks of the shell: asyncio's set of them; the anyio shell's group's tasks (one cancel
    scope each) but the dispatcher, while the group is open (no retry timer runs here)."""
    shell = coord._other
    if shell is None:
        return len(coord._rpc_tasks)
    return len(shell._scopes) - (shell._group is not None and not shell._closed)


def dispatcher_running(coord: LookupCoordinator) -> bool:
    """The dispatcher task still runs: asyncio's task not done; the anyio shell's group open and
    not closed (under trio a task cannot die silently: its error would end the group)."""
    shell = coord._other
    if shell is None:
        return coord._dispatcher is not None and not coord._dispatcher.done()
    return shell._group is not None and not shell._closed and bool(shell._scopes)


def tasks_left(coord: LookupCoordinator) -> bool:
    """Any task of the shell left (dispatcher or RPC)."""
    shell = coord._other
    if shell is None:
        return bool(coord._rpc_tasks) or coord._dispatcher is None or not coord._dispatcher.done()
    return bool(shell._scopes) or shell._group is not None


CASES = [
    json.loads(line)
    for line in (Path(__file__).parent / "data" / "conformance_public.jsonl")
    .read_text()
    .splitlines()
    if line.strip()
]




FULL16 = KVLayout([mcl.FullAttention(16)], model="org/chat", hash_block_size=16,
                  scheduler_block_size=16)
HYBRID = KVLayout(
    [mcl.FullAttention(32), mcl.SlidingWindow(8, sliding_window=8)],
    model="hy", hash_block_size=8, scheduler_block_size=32,
)


def expected(layout: KVLayout, store: FakeStore, token_len: int, hashes: Any) -> int:
    plan = layout.plan(token_len, hashes)
    return plan.resolve([1 if k in store.present else 0 for k in plan.keys])


class SelectiveFailStore(FakeStore):
    """FakeStore that fails (with ``code``, after its ``delay``, as FakeStore's failures come)
    any RPC containing one of ``poison`` keys."""

    def __init__(self, poison: set[bytes], code: int = -900, **kw: Any) -> None:
        super().__init__(**kw)
        self.poison = poison
        self.code = code

    async def batch_is_exist(self, keys: Sequence[Any]) -> list[int]:
        if any(bytes(k) in self.poison for k in keys):
            self.calls.append([bytes(k) for k in keys])
            if self.delay:
                await anyio.sleep(self.delay)
            raise mcl.StoreError("poisoned RPC", code=self.code)
        return await super().batch_is_exist(keys)


async def test_hits_equal_plan_resolve_for_concurrent_callers() -> None:
    docs = [chain(64, bytes([d])) for d in range(4)]
    store = FakeStore()
    for d in docs[:3]:
        store.add(FULL16.plan(1024, d).keys)
    rng = random.Random(1)
    requests = []
    for i in range(60):
        doc = docs[i % 4]
        cut = rng.randrange(0, 65)
        hashes = doc[:cut] + chain(64 - cut, b"tail%d" % i)
        requests.append(hashes)
    async with LookupCoordinator(FULL16, store) as coord:
        hits = await gather(*(lambda h=h: coord.lookup(1024, h) for h in requests))
    assert hits == [expected(FULL16, store, 1024, h) for h in requests]
    assert any(hits) and not all(hits)


async def test_hashes_in_an_immutable_array_of_any_layout_answer_as_a_list_does() -> None:
    # (read where they are, rows a step apart or a hash's bytes apart: the same keys, the
    # same hits, the known prefixes too)
    docs = [chain(64, bytes([d])) for d in range(3)]
    store = FakeStore()
    for d in docs[:2]:
        store.add(FULL16.plan(1024, d).keys)

    def layouts(hashes: list[bytes]) -> list[Any]:
        raw = b"".join(hashes)
        rows = np.frombuffer(raw, dtype=np.uint8).reshape(len(hashes), 32)
        columns = np.frombuffer(bytes(rows.T.tobytes()), dtype=np.uint8).reshape(32, -1).T
        strided = np.frombuffer(b"".join(h + bytes(32) for h in hashes), dtype=np.uint8)
        return [hashes, rows, columns, strided.reshape(-1, 64)[:, :32]]

    async with LookupCoordinator(FULL16, store) as coord:
        for doc in docs:
            for cut in (0, 10, 64):
                hashes = doc[:cut] + chain(64 - cut, b"own")
                want = expected(FULL16, store, 1024, hashes)
                for given_hashes in layouts(hashes):
                    assert await coord.lookup(1024, given_hashes) == want


async def test_idle_coordinator_sends_at_once_and_concurrent_callers_share_rpcs() -> None:
    hashes = chain(8, b"a")
    store = FakeStore(FULL16.plan(128, hashes).keys, delay=0.01)
    async with LookupCoordinator(FULL16, store, cache_ttl=None) as coord:
        start = anyio.current_time()
        assert await coord.lookup(128, hashes) == 128
        assert anyio.current_time() - start < 0.5
        assert len(store.calls) == 1
        others = [chain(8, b"o%d" % i) for i in range(100)]
        await gather(*(lambda h=h: coord.lookup(128, h) for h in others))
        stats = coord.stats()
    assert stats.rpcs_total < 1 + 100 / 4
    assert stats.lookups_per_dispatch.count >= 1
    assert max(len(c) for c in store.calls) > 8  # keys of several lookups in one RPC


async def test_keys_are_deduplicated_across_callers() -> None:
    hashes = chain(32, b"same")
    store = FakeStore(FULL16.plan(512, hashes).keys, delay=0.005)
    async with LookupCoordinator(FULL16, store, cache_ttl=None) as coord:
        hits = await gather(*(lambda: coord.lookup(512, hashes) for _ in range(10)))
        stats = coord.stats()
    assert hits == [512] * 10
    assert stats.keys_sent_total == 32 and stats.rpcs_total == 1
    # every other caller's keys joined the first one's
    assert stats.dedup_hits_total >= 9 * 32


async def test_rpcs_are_split_at_max_keys_per_rpc() -> None:
    hashes = chain(2500, b"long")
    store = FakeStore(FULL16.plan(40000, hashes).keys)
    async with LookupCoordinator(FULL16, store, max_keys_per_rpc=1000) as coord:
        assert await coord.lookup(40000, hashes) == 40000
    assert len(store.calls) == 3 and max(len(c) for c in store.calls) <= 1000
    assert len({k for c in store.calls for k in c}) == 2500


async def test_rounds_send_fewer_keys_with_the_same_answer() -> None:
    hashes = chain(48, b"h")
    store = FakeStore(HYBRID.plan(384, hashes).keys)
    store.discard(HYBRID.plan(384, hashes).keys[5:])  # full hit stops early
    want = expected(HYBRID, store, 384, hashes)
    async with LookupCoordinator(HYBRID, store, cache_ttl=None) as coord:
        assert await coord.lookup(384, hashes) == want
        with_rounds = coord.stats().keys_sent_total
    store.calls.clear()
    async with LookupCoordinator(HYBRID, store, cache_ttl=None, rounds=False) as coord:
        assert await coord.lookup(384, hashes) == want
        all_keys = coord.stats().keys_sent_total
    assert all_keys == HYBRID.plan(384, hashes).num_keys
    assert with_rounds < all_keys


@pytest.mark.parametrize("cache_ttl", [None, 5.0])
@pytest.mark.parametrize("namespaces", [1, 4])
async def test_a_cold_burst_asks_no_key_twice(cache_ttl: float | None, namespaces: int) -> None:
    """Distinct prompts all at once on a busy store are probed in rounds with scouts; a
    present scout is filled in from the round that found it, not asked again (with or without
    the cache), and every hit is the one vLLM computes from all keys."""
    layout = KVLayout([mcl.FullAttention(16)], model="org/chat", hash_block_size=16,
                      scheduler_block_size=16, tp_size=namespaces, num_kv_heads=namespaces)
    rng = random.Random(11)
    prompts = [chain(200, b"burst-%d" % i) for i in range(40)]
    stored = []
    for hashes in prompts:
        cut = rng.randrange(0, 201)
        stored += layout.plan(16 * 200, hashes).keys[: cut * namespaces]
    store = FakeStore(stored, delay=0.002)
    async with LookupCoordinator(layout, store, cache_ttl=cache_ttl, probe_window=4) as coord:
        hits = await gather(*(lambda h=h: coord.lookup(16 * 200, h) for h in prompts))
        stats = coord.stats()
    assert hits == [expected(layout, store, 16 * 200, h) for h in prompts]
    sent = [key for call in store.calls for key in call]
    assert len(sent) == len(set(sent))
    assert stats.rounds_total > 2 * len(prompts)  # (probed in rounds: scouts went out)


@pytest.mark.parametrize("miss_at", [0, 3, 5, 9, None])
async def test_repeated_hashes_in_a_full_attention_prefix_are_probed_in_rounds(
    miss_at: int | None,
) -> None:
    """A lone full-attention group probes its prefix in rounds even when hashes repeat (a
    repeated key gets the same answer again), concurrent callers sharing the repeated keys."""
    base = chain(4, b"r")
    hashes = base + base + base[:2] + chain(6, b"tail")  # chunk 4..7 repeat 0..3, 8..9 too
    plan = FULL16.plan(16 * len(hashes), hashes)
    assert not plan.probe_in_one_round
    store = FakeStore(plan.keys)
    if miss_at is not None:
        store.discard([plan.keys[miss_at]])
    want = expected(FULL16, store, 16 * len(hashes), hashes)
    store.delay = 0.002
    async with (
        LookupCoordinator(FULL16, store, cache_ttl=None, probe_window=1) as coord,
        anyio.create_task_group() as group,
    ):
        busy = Task(group, coord.lookup, 64, chain(4, b"other"))
        await settle()  # its RPC is in flight: the lookups below probe in windows
        hits = await gather(
            *(lambda n=n: coord.lookup(16 * n, hashes[:n]) for n in (len(hashes), 9, 12,
                                                                       len(hashes)))
        )
        assert await busy.result() == 0
        stats = coord.stats()
    assert hits[0] == hits[3] == want
    for n, hit in zip((9, 12), hits[1:3]):
        assert hit == expected(FULL16, store, 16 * n, hashes[:n])
    first_window = 1 << _COLD_SHIFT  # (chunks: a cold prompt's first window is wider)
    if want > first_window * 16:  # past the first window: more rounds than lookups
        assert stats.rounds_total > 5


async def test_positive_cache_answers_repeat_lookups_and_can_be_disabled() -> None:
    hashes = chain(16, b"c")
    store = FakeStore(FULL16.plan(256, hashes).keys)
    async with LookupCoordinator(FULL16, store, cache_ttl=5.0) as coord:
        assert await coord.lookup(256, hashes) == 256
        calls = len(store.calls)
        assert await coord.lookup(256, hashes) == 256
        assert len(store.calls) == calls
        assert coord.stats().cache_hits_total == 16
    async with LookupCoordinator(FULL16, store, cache_ttl=None) as coord:
        await coord.lookup(256, hashes)
        await coord.lookup(256, hashes)
        assert coord.stats().rpcs_total == 2


async def test_cache_ttl_is_read_at_each_rpc() -> None:
    """Lowering cache_ttl (say, to follow a master with a shorter lease) or setting it to None
    on a running coordinator takes effect for the next answers."""
    hashes = chain(8, b"ttl")
    store = FakeStore(FULL16.plan(128, hashes).keys)
    async with LookupCoordinator(FULL16, store, cache_ttl=5.0) as coord:
        coord.options = coord.options.replace(cache_ttl=None)
        assert await coord.lookup(128, hashes) == 128
        assert await coord.lookup(128, hashes) == 128
        assert coord.stats().rpcs_total == 2 and coord.stats().cache_hits_total == 0
        coord.options = coord.options.replace(cache_ttl=0.05)
        assert await coord.lookup(128, hashes) == 128
        assert await coord.lookup(128, hashes) == 128
        assert coord.stats().rpcs_total == 3  # the fourth was answered from the cache
        await anyio.sleep(0.06)
        store.present.clear()
        assert await coord.lookup(128, hashes) == 0


async def test_malformed_store_answers_fail_their_callers_without_hanging() -> None:
    class RowsStore(FakeStore):
        async def batch_is_exist(self, keys: Sequence[Any]) -> Any:
            self.calls.append(list(keys))
            return np.ones((len(keys), 2), dtype=np.int64)  # rows, not one int per key

    hashes = chain(4, b"rows")
    async with LookupCoordinator(FULL16, RowsStore(), timeout=5.0,
                                 failure_backoff=0.01) as coord:
        for _ in range(2):  # the second lookup must not join a stuck probe
            with pytest.raises(mcl.StoreError):
                await coord.lookup(64, hashes)
            await anyio.sleep(0.02)
        assert coord.stats().pending_lookups == 0


async def test_cache_keeps_only_positive_answers() -> None:
    hashes = chain(4, b"neg")
    store = FakeStore()
    async with LookupCoordinator(FULL16, store, cache_ttl=5.0) as coord:
        assert await coord.lookup(64, hashes) == 0
        store.add(FULL16.plan(64, hashes).keys)
        assert await coord.lookup(64, hashes) == 64


class CallBackFakeStore(FakeStore):
    """FakeStore that also offers the call-back form the coordinator prefers (as
    MooncakeStore does): ``then`` gets the answers or the error a loop iteration later (called
    soon on the loop, as MooncakeStore's threads do), from a task of the group that
    ``async with store.serving():`` runs (outside the coordinator's)."""

    def __init__(self, present: Sequence[bytes] = (), **kw: Any) -> None:
        super().__init__(present, **kw)
        self.closed = False
        self.group: anyio.abc.TaskGroup | None = None
        self.outstanding = 0  # calls not answered yet
        self.answered = anyio.Event()  # (set while none is outstanding)
        self.answered.set()
        self.called = anyio.Event()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        async with anyio.create_task_group() as group:
            self.group = group
            yield

    def batch_is_exist_then(self, keys: Sequence[Any], then: Any) -> None:
        if self.closed:
            raise mcl.ClosedError("closed")
        self.called.set()
        assert self.group is not None, "a CallBackFakeStore serves in 'async with serving()'"
        call_soon = call_soon_threadsafe()
        if not self.outstanding:
            self.answered = anyio.Event()
        self.outstanding += 1

        def answer(outcome: Any) -> None:
            try:
                then(outcome)
            finally:
                self.outstanding -= 1
                if not self.outstanding:
                    self.answered.set()

        async def call() -> None:
            try:
                outcome: Any = await self.batch_is_exist(keys)
            except mcl.Error as exc:
                outcome = exc
            call_soon(answer, outcome)

        self.group.start_soon(call)

    async def drained(self) -> None:
        """Wait (at most 5 s) until every call was answered."""
        with anyio.fail_after(5):
            await self.answered.wait()


class BeginCountingStore(CallBackFakeStore):
    """CallBackFakeStore that notes, at every call, how many lookups had been started."""

    def __init__(self, present: Sequence[bytes], started: list[int]) -> None:
        super().__init__(present)
        self.started = started
        self.started_at_call: list[int] = []

    def batch_is_exist_then(self, keys: Sequence[Any], then: Any) -> None:
        self.started_at_call.append(len(self.started))
        super().batch_is_exist_then(keys, then)


@pytest.mark.parametrize("linger", [0.0, 0.001])
async def test_a_whole_rpc_goes_out_while_the_rest_of_a_burst_is_planned(linger: float) -> None:
    docs = [chain(4, b"whole-%d" % i) for i in range(5)]
    started: list[int] = []
    store = BeginCountingStore([k for d in docs for k in FULL16.plan(64, d).keys], started)
    async with store.serving(), LookupCoordinator(
        FULL16, store, cache_ttl=None, rounds=False, max_keys_per_rpc=8, linger=linger
    ) as coord:

        async def one(hashes: list[bytes]) -> int:
            started.append(1)
            return await coord.lookup(64, hashes)

        assert await gather(*(lambda d=d: one(d) for d in docs)) == [64] * 5
    sizes = [len(call) for call in store.calls]
    if linger:  # the dispatcher waits for more work: everything planned first
        assert store.started_at_call[:2] == [5, 5]
    else:  # once whole RPCs fill both free slots (four lookups' keys), at once
        assert store.started_at_call[:2] == [4, 4]
    assert sizes == [8, 8, 4]


class ThenMarkingStore(CallBackFakeStore):
    """CallBackFakeStore that notes, at every call, whether it came from inside the call-back
    of an earlier call (an RPC sent while that RPC's answers fanned out)."""

    def __init__(self, present: Sequence[bytes]) -> None:
        super().__init__(present)
        self.in_call_back = False
        self.from_call_back: list[bool] = []

    def batch_is_exist_then(self, keys: Sequence[Any], then: Any) -> None:
        self.from_call_back.append(self.in_call_back)

        def marked(outcome: Any) -> None:
            self.in_call_back = True
            try:
                then(outcome)
            finally:
                self.in_call_back = False

        super().batch_is_exist_then(keys, marked)


async def test_the_next_whole_rpc_goes_out_as_an_rpcs_answers_fan_out() -> None:
    docs = [chain(8, b"next-%d" % i) for i in range(3)]
    store = ThenMarkingStore([k for d in docs for k in FULL16.plan(128, d).keys])
    async with store.serving(), LookupCoordinator(
        FULL16, store, cache_ttl=None, rounds=False, max_keys_per_rpc=8, max_rpcs_in_flight=1
    ) as coord:
        assert await gather(*(lambda d=d: coord.lookup(128, d) for d in docs)) == [128] * 3
    # The first at once (a whole RPC for the one slot), each next one from the call-back of
    # the RPC before it: no wait for the dispatcher's turn.
    assert store.from_call_back == [False, True, True]


class RaisingStore(FakeStore):
    """A call-back store that refuses every call at once (as a closed MooncakeStore does)."""

    def __init__(self) -> None:
        super().__init__()
        self.submits = 0

    def batch_is_exist_then(self, keys: Sequence[Any], then: Any) -> None:
        self.submits += 1
        raise mcl.ClosedError("closed")


@pytest.mark.parametrize("on_error", ["raise", "absent"])
async def test_a_store_refusing_every_call_at_once_fails_its_rpcs_without_recursing(
    on_error: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store = RaisingStore()
    async with LookupCoordinator(
        FULL16, store, cache_ttl=None, rounds=False, max_keys_per_rpc=1, max_rpcs_in_flight=1,
        failure_backoff=1e-9, on_error=on_error, timeout=10,
    ) as coord:
        if on_error == "raise":
            with pytest.raises(mcl.StoreError):
                await coord.lookup(16 * 3000, chain(3000, b"refused"))
        else:
            assert await coord.lookup(16 * 3000, chain(3000, b"refused")) == 0
        stats = coord.stats()
    assert stats.rpcs_in_flight == 0 and shell_of(coord)._calls_in_flight == 0
    assert store.submits == stats.rpcs_total
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # (no RecursionError)


class AnsweringThenRaisingStore(FakeStore):
    """A call-back store that answers inside the call and then raises anyway."""

    def batch_is_exist_then(self, keys: Sequence[Any], then: Any) -> None:
        self.calls.append(list(keys))
        then([1 if k in self.present else 0 for k in keys])
        raise mcl.ClosedError("closed after answering")


async def test_an_rpc_gets_one_outcome_from_a_store_that_answers_and_then_raises() -> None:
    doc = chain(8, b"twice")
    store = AnsweringThenRaisingStore(FULL16.plan(128, doc).keys)
    async with LookupCoordinator(
        FULL16, store, cache_ttl=None, rounds=False, max_keys_per_rpc=4, timeout=10
    ) as coord:
        assert await coord.lookup(128, doc) == 128  # the answers, not the error after them
        stats = coord.stats()
    assert stats.rpcs_in_flight == 0 and shell_of(coord)._calls_in_flight == 0
    assert stats.rpcs_total == len(store.calls) == 2 and stats.rpc_errors_total == 0


async def test_a_failing_early_dispatch_is_logged_and_the_dispatcher_sends_the_keys(
    caplog: pytest.LogCaptureFixture,
) -> None:
    doc = chain(16, b"logged")
    store = CallBackFakeStore(FULL16.plan(256, doc).keys)
    async with store.serving(), LookupCoordinator(
        FULL16, store, cache_ttl=None, rounds=False, max_keys_per_rpc=8, timeout=10
    ) as coord:
        core = coord._core
        take = core.take_batches

        def broken(now: float, whole_only: bool = False) -> Any:
            if whole_only:
                raise RuntimeError("a bug in the early dispatch")
            return take(now, whole_only)

        core.take_batches = broken  # type: ignore[method-assign]
        assert await coord.lookup(256, doc) == 256  # the caller never sees the bug
    assert any("dispatch failed" in r.getMessage() for r in caplog.records)


class AnsweringAtOnceStore(FakeStore):
    """A call-back store that answers inside the call itself (not later, as the protocol
    says; a store answering from memory might)."""

    def batch_is_exist_then(self, keys: Sequence[Any], then: Any) -> None:
        self.calls.append(list(keys))
        then([1 if k in self.present else 0 for k in keys])


@pytest.mark.parametrize("on_error", ["raise", "absent"])
async def test_a_store_answering_inside_the_call_gives_the_same_hits(on_error: Any) -> None:
    doc = chain(3000, b"at-once")
    plan = FULL16.plan(16 * 3000, doc)
    store = AnsweringAtOnceStore(plan.keys)
    async with LookupCoordinator(
        FULL16, store, cache_ttl=None, rounds=False, max_keys_per_rpc=10, on_error=on_error,
        timeout=10,
    ) as coord:
        assert await coord.lookup(16 * 3000, doc) == plan.resolve([1] * plan.num_keys)
        stats = coord.stats()
    assert stats.rpcs_in_flight == 0 and shell_of(coord)._calls_in_flight == 0
    assert len(store.calls) == stats.rpcs_total == 300


async def test_a_lookup_admitted_just_before_close_fails_instead_of_hanging() -> None:
    store = CallBackFakeStore(delay=0.01)
    coord = LookupCoordinator(FULL16, store, cache_ttl=None, max_pending_lookups=1)
    async with store.serving(), coord, anyio.create_task_group() as group:
        first = Task(group, coord.lookup, 64, chain(4, b"first"))
        await settle()
        second = Task(group, coord.lookup, 64, chain(4, b"second"), timeout=None)
        await settle()
        shell = shell_of(coord)
        assert shell._waiters  # the second waits for room
        admit = shell._admit_next
        closed: list[bool] = []

        def admit_then_close() -> None:
            waiting = len(shell._waiters)
            admit()
            if waiting and not shell._waiters and not closed:  # admitted: close before it runs
                closing = coord.aclose()
                with contextlib.suppress(StopIteration):
                    closing.send(None)  # aclose() up to its first await: closed from here on
                closing.close()  # (what is left: awaiting the tasks it cancelled)
                closed.append(True)

        shell._admit_next = admit_then_close
        await first.result()
        assert closed and coord.closed
        with anyio.fail_after(5):
            assert isinstance(await second.outcome(), mcl.ClosedError)


async def test_a_call_back_store_needs_no_rpc_task_and_gives_the_same_hits() -> None:
    doc = chain(64, b"call-back")
    store = CallBackFakeStore(FULL16.plan(1024, doc).keys, delay=0.02)
    requests = [doc[:cut] + chain(64 - cut, b"cb-%d" % cut) for cut in (0, 7, 30, 64)]
    async with (
        store.serving(), LookupCoordinator(FULL16, store) as coord,
        anyio.create_task_group() as group,
    ):
        runs = [Task(group, coord.lookup, 1024, r) for r in requests * 3]
        with anyio.fail_after(5):
            await store.called.wait()  # the dispatcher sent the first RPC
        assert coord.stats().rpcs_in_flight >= 1 and not rpc_tasks(coord)
        hits = [await run.result() for run in runs]
        assert coord.stats().rpcs_in_flight == 0
    assert hits == [expected(FULL16, store, 1024, r) for r in requests * 3]
    assert hits[:4] == [0, 112, 480, 1024]


@pytest.mark.parametrize("on_error", ["raise", "absent"])
async def test_a_call_back_store_failure_reaches_its_callers(on_error: Any) -> None:
    store = CallBackFakeStore(HYBRID.plan(64, chain(8, b"cbf")).keys)
    store.fail_with = -900
    async with store.serving(), LookupCoordinator(HYBRID, store, on_error=on_error) as coord:
        if on_error == "raise":
            with pytest.raises(mcl.StoreError) as info:
                await coord.lookup(64, chain(8, b"cbf"))
            assert info.value.code == -900
        else:
            assert await coord.lookup(64, chain(8, b"cbf")) == 0
        assert not coord.healthy  # failing fast now


async def test_a_closed_call_back_store_fails_the_rpc_not_the_dispatcher() -> None:
    store = CallBackFakeStore()
    store.closed = True
    async with store.serving(), LookupCoordinator(FULL16, store) as coord:
        with pytest.raises(mcl.StoreError):
            await coord.lookup(64, chain(4, b"closed"))
        assert dispatcher_running(coord)


async def test_closing_with_call_back_rpcs_in_flight_ignores_their_late_answers() -> None:
    store = CallBackFakeStore(delay=0.05)
    coord = LookupCoordinator(FULL16, store)
    async with store.serving(), anyio.create_task_group() as group:
        async with coord:
            pending = Task(group, coord.lookup, 64, chain(4, b"late"))
            await anyio.sleep(0.01)
            assert coord.stats().rpcs_in_flight == 1
        with pytest.raises(mcl.ClosedError):
            await pending.result()
        await store.drained()  # the answer arrives after close: ignored
    assert coord.stats().rpcs_in_flight == 0


async def test_known_prefixes_skip_a_shared_prefix_without_building_its_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A settled lookup's present prefix is remembered by hash rows: a later request sharing
    it sends only the chunks after the shared part (an idle store gets them all at once) and
    builds no key of the shared part."""
    doc = chain(64, b"doc")
    store = FakeStore(FULL16.plan(1024, doc).keys)
    async with LookupCoordinator(FULL16, store, cache_ttl=5.0) as coord:
        assert await coord.lookup(1024, doc) == 1024
        rows = np.frombuffer(b"".join(doc[:40] + chain(24, b"tail")), np.uint8).reshape(64, 32)
        want_keys = FULL16.plan(1024, rows).keys[40:]
        built: list[int] = []
        keys_at = LookupPlan._keys_at

        def recording_keys_at(plan: LookupPlan, indices: Any) -> list[bytes]:
            built.extend(np.asarray(indices).tolist())
            return keys_at(plan, indices)

        monkeypatch.setattr(LookupPlan, "_keys_at", recording_keys_at)
        monkeypatch.setattr(LookupPlan, "key_array", lambda plan: pytest.fail("built them all"))
        assert await coord.lookup(1024, rows) == 640
        assert sorted(built) == list(range(40, 64))
        assert store.calls[-1] == want_keys  # one RPC
        assert coord.stats().cache_hits_total == 40


def _followers(coord: LookupCoordinator) -> int:
    """How many lookups wait for a walker right now."""
    return sum(len(walker.followers or ()) for walker in coord._core._walkers.values())


async def test_a_lookup_sharing_a_walkers_chunks_waits_then_starts_past_its_run() -> None:
    """Two concurrent lookups of one document: the second does not subscribe to the first's
    keys one by one; it waits for the first (the walker) to settle, then starts from the run
    of chunks the walker found present."""
    doc = chain(64, b"walk")
    store = FakeStore(FULL16.plan(1024, doc).keys, delay=0.01)
    short = doc[:20] + chain(44, b"short-tail")
    async with (
        LookupCoordinator(FULL16, store, cache_ttl=5.0) as coord,
        anyio.create_task_group() as group,
    ):
        walker = Task(group, coord.lookup, 1024, short)
        await settle()
        follower = Task(group, coord.lookup, 1024, doc)
        await settle()
        assert _followers(coord) == 1
        assert [await walker.result(), await follower.result()] == [320, 1024]
        stats = coord.stats()
        assert stats.dedup_hits_total == 0  # it joined none of the walker's keys
        assert stats.cache_hits_total == 20  # it took the walker's run
        assert not coord._core._walkers
    doc_keys = FULL16.plan(1024, doc).keys
    assert store.calls[0] == FULL16.plan(1024, short).keys  # the walker's RPC
    assert [k for call in store.calls[1:] for k in call] == doc_keys[20:]


async def test_a_lookup_whose_next_chunk_differs_from_the_walkers_does_not_wait() -> None:
    doc = chain(64, b"nowait")
    store = FakeStore(FULL16.plan(1024, doc).keys, delay=0.01)
    async with (
        LookupCoordinator(FULL16, store, cache_ttl=5.0) as coord,
        anyio.create_task_group() as group,
    ):
        assert await coord.lookup(1024, doc[:10] + chain(54, b"first")) == 160  # known: 10
        walker = Task(group, coord.lookup, 1024, doc)  # walks on from chunk 10
        await settle()
        assert len(coord._core._walkers) == 1
        other = Task(group, coord.lookup, 1024, doc[:10] + chain(54, b"other"))
        await settle()
        assert _followers(coord) == 0  # its chunk 10 is not the walker's: it probes at once
        assert [await walker.result(), await other.result()] == [1024, 160]
        assert not coord._core._walkers


@pytest.mark.parametrize("how", ["cancel", "timeout", "store_error"])
async def test_followers_go_on_when_their_walker_ends_badly(how: str) -> None:
    doc = chain(32, b"bad-walker")
    keys = FULL16.plan(512, doc).keys
    walker_rows = doc[:24] + chain(8, b"walker-tail")
    poison = {FULL16.plan(512, walker_rows).keys[-1]}
    store = SelectiveFailStore(poison if how == "store_error" else set(), delay=0.02)
    store.add(keys)
    async with (
        LookupCoordinator(FULL16, store, cache_ttl=5.0, failure_backoff=1e-6) as coord,
        anyio.create_task_group() as group,
    ):
        walker = Task(
            group, coord.lookup, 512, walker_rows, timeout=0.005 if how == "timeout" else None
        )
        await settle()
        followers = [Task(group, coord.lookup, 512, doc) for _ in range(3)]
        await settle()
        assert _followers(coord) == 3
        if how == "cancel":
            walker.cancel()
        results = [await walker.outcome()]
        expected_error = {
            "cancel": Cancelled, "timeout": mcl.LookupTimeout,
            "store_error": mcl.StoreError,
        }[how]
        assert isinstance(results[0], expected_error)
        await anyio.sleep(0.001)  # past the failure pause
        assert [await f.result() for f in followers] == [512] * 3
        assert not coord._core._walkers and not coord._core.lookups


async def test_a_follower_times_out_alone() -> None:
    doc = chain(32, b"late-follower")
    store = FakeStore(FULL16.plan(512, doc).keys, delay=0.05)
    async with (
        LookupCoordinator(FULL16, store, cache_ttl=5.0) as coord,
        anyio.create_task_group() as group,
    ):
        walker = Task(group, coord.lookup, 512, doc)
        await settle()
        late = Task(group, coord.lookup, 512, doc, timeout=0.01)
        with pytest.raises(mcl.LookupTimeout):
            await late.result()
        assert await walker.result() == 512
        assert await coord.lookup(512, doc) == 512
        assert not coord._core._walkers and not coord._core.lookups


class GatedStore(FakeStore):
    """FakeStore whose calls each wait until the test opens them (``open(n)``: the n-th
    call to arrive, counting from 0; ``arrived_keys[n]`` its keys). RPC tasks started
    together arrive in the order sent on asyncio, in any order on trio."""

    def __init__(self, present: Sequence[bytes]) -> None:
        super().__init__(present)
        self.gates: list[anyio.Event] = []
        self.arrived_keys: list[list[bytes]] = []
        self.arrived = anyio.Condition()

    async def batch_is_exist(self, keys: Sequence[Any]) -> list[int]:
        gate = anyio.Event()
        async with self.arrived:
            self.gates.append(gate)
            self.arrived_keys.append([bytes(k) for k in keys])
            self.arrived.notify_all()
        await gate.wait()
        return await super().batch_is_exist(keys)

    async def called(self, n: int) -> None:
        """Wait until call ``n`` (from 0) has arrived."""
        async with self.arrived:
            await self.arrived.wait_for(lambda: len(self.gates) > n)

    async def open(self, n: int) -> None:
        await self.called(n)
        self.gates[n].set()
        await settle(5)  # let its answers fan out

    async def open_until(self, task: Task[Any], n: int) -> int:
        """Open calls ``n``, ``n + 1``, ... until ``task`` is done; the next call's number."""
        while not task.done:
            await self.open(n)
            n += 1
        return n


async def test_a_follower_waits_for_one_round_of_its_walker_not_for_all_of_it() -> None:
    """A follower is released after every round of its walker: one that shares only chunk 0
    with a long walk goes on by itself once the walker's first round is in."""
    doc = chain(64, b"long-walk")
    store = GatedStore(FULL16.plan(1024, doc).keys)
    async with (
        LookupCoordinator(FULL16, store, cache_ttl=5.0, probe_window=1) as coord,
        anyio.create_task_group() as group,
    ):
        busy = Task(group, coord.lookup, 64, chain(4, b"busy"))  # call 0, held
        await store.called(0)
        walker = Task(group, coord.lookup, 1024, doc)  # call 1: chunk 0 alone
        await settle()
        short = Task(group, coord.lookup, 64, doc[:1] + chain(3, b"own-tail"))
        await settle()
        assert _followers(coord) == 1
        await store.open(1)  # the walker's first round: chunk 0 present
        assert _followers(coord) == 0  # released: its chunk 1 is its own
        await store.open(2)  # the walker's second round, with the short lookup's chunk 1
        assert await short.result() == 16
        assert not walker.done  # on to its next rounds (windows grow 1, 2, 4, ...)
        await store.open_until(walker, 3)
        assert await walker.result() == 1024
        await store.open(0)
        assert await busy.result() == 0
        assert not coord._core._walkers


async def test_the_first_round_after_a_known_prefix_follows_the_likely_answer() -> None:
    """While the store is busy, the chunk right after a known prefix is probed alone when it is
    likely absent (the request went its own way, or the run never grew past its end), and a
    window of chunks is probed at once when the run has grown past its end before."""
    doc = chain(64, b"grown")
    store = GatedStore(FULL16.plan(1024, doc).keys)
    async with (
        LookupCoordinator(FULL16, store, cache_ttl=5.0) as coord,
        anyio.create_task_group() as group,
    ):
        busy = Task(group, coord.lookup, 64, chain(4, b"busy"))  # call 0, held
        await store.called(0)
        call, first_rounds = 1, []
        for cut in (10, 20, 30, 5):
            hashes = doc[:cut] + chain(64 - cut, b"tail-%d" % cut)
            task = Task(group, coord.lookup, 1024, hashes)
            opened = len(store.calls)
            call = await store.open_until(task, call)
            assert await task.result() == cut * 16
            first_rounds.append(len(store.calls[opened]))
        # cut 10: no run yet; 20: the run (10 rows) never grew; 30: it grew (to 20 rows);
        # 5: the request leaves the run at chunk 5
        assert first_rounds[1] == 1 and first_rounds[2] > 1 and first_rounds[3] == 1
        await store.open(0)
        assert await busy.result() == 0


async def test_a_lookup_leaving_the_known_run_does_not_become_a_walker() -> None:
    """Its next chunk is its own: nobody could follow it, so it probes without registering
    as its prompt's walker; a lookup going on past the run's end does register."""
    doc = chain(64, b"own-way")
    store = GatedStore(FULL16.plan(1024, doc).keys)
    async with (
        LookupCoordinator(FULL16, store, cache_ttl=5.0) as coord,
        anyio.create_task_group() as group,
    ):
        first = Task(group, coord.lookup, 1024, doc[:40] + chain(24, b"t40"))
        call = await store.open_until(first, 0)
        assert await first.result() == 640
        leaving = Task(group, coord.lookup, 1024, doc[:10] + chain(54, b"t10"))
        await store.called(call)
        assert not coord._core._walkers
        call = await store.open_until(leaving, call)
        assert await leaving.result() == 160
        going_on = Task(group, coord.lookup, 1024, doc)
        await store.called(call)
        assert [w.plan.num_keys for w in coord._core._walkers.values()] == [64]
        await store.open_until(going_on, call)
        assert await going_on.result() == 1024


async def test_a_follower_waits_across_walker_rounds_while_they_share_its_chunks() -> None:
    doc = chain(64, b"in-step")
    store = GatedStore(FULL16.plan(1024, doc).keys)
    async with (
        LookupCoordinator(FULL16, store, cache_ttl=5.0, probe_window=1) as coord,
        anyio.create_task_group() as group,
    ):
        busy = Task(group, coord.lookup, 64, chain(4, b"busy2"))  # call 0, held
        await store.called(0)
        walker = Task(group, coord.lookup, 1024, doc)  # windows 4, 8, 16, ...
        await settle()
        mine = doc[:40] + chain(24, b"mine")
        follower = Task(group, coord.lookup, 1024, mine)
        await settle()
        for call in (1, 2, 3):  # the walker's rounds up to chunk 27: still all shared
            assert _followers(coord) == 1
            await store.open(call)
        n = await store.open_until(follower, 4)
        assert await follower.result() == 640
        assert coord.stats().dedup_hits_total == 0  # it never joined a key of the walker
        await store.open_until(walker, n)
        assert await walker.result() == 1024
        await store.open(0)
        assert await busy.result() == 0


async def test_followers_stop_waiting_once_the_walkers_rounds_outgrow_one_rpc() -> None:
    doc = chain(64, b"outgrow")
    store = GatedStore(FULL16.plan(1024, doc).keys)
    async with LookupCoordinator(
        FULL16, store, cache_ttl=5.0, probe_window=1, max_keys_per_rpc=12
    ) as coord, anyio.create_task_group() as group:
        busy = Task(group, coord.lookup, 64, chain(4, b"busy3"))  # call 0, held
        await store.called(0)
        walker = Task(group, coord.lookup, 1024, doc)  # 4, 8 (+4 scouts), 16, ...
        await settle()
        follower = Task(group, coord.lookup, 1024, doc[:40] + chain(24, b"mine"))
        await settle()
        waits, n = 0, 1
        while not follower.done:
            for w in coord._core._walkers.values():
                if w.followers:
                    waits += 1
                    assert len(w.round_keys) <= 12  # never on a round of several RPCs
            await store.open(n)
            n += 1
        assert waits >= 2  # it did wait, round after round, while the rounds were small
        assert await follower.result() == 640
        await store.open_until(walker, n)
        assert await walker.result() == 1024
        await store.open(0)
        assert await busy.result() == 0


async def test_no_waiting_for_a_walker_round_of_several_rpcs() -> None:
    """A walker's round split over several RPCs could wait on the slowest of them: a lookup
    then probes by itself, and one RPC held back does not hold it up."""
    doc = chain(64, b"several")
    store = GatedStore(FULL16.plan(1024, doc).keys)
    async with LookupCoordinator(
        FULL16, store, cache_ttl=5.0, max_keys_per_rpc=8, max_rpcs_in_flight=4
    ) as coord, anyio.create_task_group() as group:
        walker = Task(group, coord.lookup, 1024, doc)  # idle: all 64 keys at once
        await store.called(3)  # calls 0-3: its first 32 keys (4 slots of 8), the rest queued
        short = Task(group, coord.lookup, 64, doc[:1] + chain(3, b"short"))
        await settle()
        assert _followers(coord) == 0
        chunk0 = FULL16.plan(1024, doc).keys[0]
        held = max(n for n in range(4) if chunk0 not in store.arrived_keys[n])  # asyncio: 3
        for n in range(4):  # one of them carries chunk 0; call ``held`` stays held for now
            if n != held:
                await store.open(n)
        await store.open_until(short, 4)
        assert await short.result() == 16
        assert not walker.done  # still waits for call ``held``
        await store.open(held)
        await store.open_until(walker, 4)  # (the walker's later calls come in turn with others')
        assert await walker.result() == 1024


async def test_close_leaves_no_rpc_task_behind() -> None:
    for spins in range(4):  # whenever the close comes, even before an RPC task started
        coord = LookupCoordinator(FULL16, FakeStore(delay=0.01))
        async with anyio.create_task_group() as group, coord:
            task = Task(group, coord.lookup, 64, chain(4, b"close%d" % spins))
            for _ in range(spins):
                await anyio.lowlevel.checkpoint()
            await coord.aclose()
            await task.outcome()
        assert not rpc_tasks(coord)
        assert coord.stats().rpcs_in_flight == 0


async def test_no_walkers_without_the_cache() -> None:
    doc = chain(32, b"no-cache")
    store = FakeStore(FULL16.plan(512, doc).keys, delay=0.01)
    async with (
        LookupCoordinator(FULL16, store, cache_ttl=None) as coord,
        anyio.create_task_group() as group,
    ):
        tasks = [Task(group, coord.lookup, 512, doc) for _ in range(3)]
        await settle()
        assert _followers(coord) == 0 and not coord._core._walkers
        assert [await t.result() for t in tasks] == [512] * 3
        assert coord.stats().dedup_hits_total > 0  # they shared keys instead


async def test_empty_hashes_are_looked_up_again_and_again() -> None:
    layout = KVLayout([mcl.FullAttention(16)], model="m", hash_block_size=16,
                      scheduler_block_size=16)
    store = FakeStore(layout.plan(48, [b""] * 3).keys)
    async with LookupCoordinator(layout, store, cache_ttl=5.0) as coord:
        for _ in range(3):  # the later ones through the known prefix of empty rows
            assert await coord.lookup(48, [b""] * 3) == 48


async def test_known_prefixes_expire_with_the_answers_they_rest_on() -> None:
    doc = chain(16, b"exp")
    store = FakeStore(FULL16.plan(256, doc).keys)
    async with LookupCoordinator(FULL16, store, cache_ttl=0.05) as coord:
        assert await coord.lookup(256, doc) == 256
        store.present.clear()
        assert await coord.lookup(256, doc) == 256  # still within the TTL: known present
        await anyio.sleep(0.06)
        assert await coord.lookup(256, doc) == 0


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**16),
    window=st.sampled_from([None, 1, 2, 8, 16]),
    namespaces=st.sampled_from([1, 2, 4]),
    concurrency=st.sampled_from([1, 8, 64]),
)
def test_property_chat_prefixes_equal_plan_resolve(
    anyio_backend: tuple[str, dict[str, Any]], seed: int, window: int | None, namespaces: int,
    concurrency: int,
) -> None:
    """Chat-like requests (documents shared up to a random cut, some chunks missing from the
    store) through the caches, scouts and rounds: every answer equals plan.resolve."""
    rng = random.Random(seed)
    layout = KVLayout([mcl.FullAttention(16)], model="org/chat", hash_block_size=16,
                      scheduler_block_size=16, tp_size=namespaces, num_kv_heads=namespaces)
    docs = [chain(48, b"d%d-%d" % (seed, d)) for d in range(3)]
    store = FakeStore()
    for doc in docs:
        keys = layout.plan(16 * 48, doc).keys
        store.add(k for k in keys if rng.random() < 0.97)
    requests = []
    for i in range(60):
        doc = rng.choice(docs)
        cut = rng.randrange(0, 49)
        hashes = doc[:cut] + chain(48 - cut, b"t%d-%d" % (seed, i))
        requests.append((16 * rng.randrange(1, 49), hashes))

    async def run() -> list[int]:
        sem = anyio.Semaphore(concurrency)
        async with LookupCoordinator(layout, store, cache_ttl=5.0, probe_window=window) as coord:
            async def one(token_len: int, hashes: list[bytes]) -> int:
                async with sem:
                    await anyio.sleep(rng.random() * 0.001)
                    return await coord.lookup(token_len, hashes)

            return await gather(*(lambda t=t, h=h: one(t, h) for t, h in requests))

    hits = anyio.run(run, backend=anyio_backend[0], backend_options=anyio_backend[1])
    assert hits == [expected(layout, store, t, h) for t, h in requests]


async def test_failed_rpc_reaches_only_its_callers() -> None:
    bad = chain(4, b"bad")
    good = chain(4, b"good")
    poison = set(FULL16.plan(64, bad).keys)
    store = SelectiveFailStore(poison, code=-901)
    store.add(FULL16.plan(64, good).keys)
    store.add(poison)
    async with LookupCoordinator(FULL16, store, max_keys_per_rpc=4, failure_backoff=0.05) as coord:
        results = await gather(
            lambda: coord.lookup(64, bad), lambda: coord.lookup(64, good), return_exceptions=True
        )
        failed, ok = results
        assert isinstance(failed, mcl.StoreError) and failed.code == -901
        assert ok == 64
        assert coord.stats().errors_by_code == {"-901": 1}


async def test_on_error_absent_counts_failed_keys_absent() -> None:
    layout = KVLayout([mcl.ChunkedLocalAttention(16, attention_chunk_size=32)], model="m",
                      hash_block_size=16, scheduler_block_size=16)
    hashes = chain(5, b"cl")
    store = FakeStore(fail_keys := layout.plan(80, hashes).keys)
    store.fail_with = -900
    async with LookupCoordinator(layout, store, on_error="absent") as coord:
        # vLLM: blocks before the current 32-token chunk count unchecked -> 64, not 0.
        assert await coord.lookup(80, hashes) == 64
    async with LookupCoordinator(layout, store, on_error="raise") as coord:
        with pytest.raises(mcl.StoreError) as err:
            await coord.lookup(80, hashes)
        assert err.value.code == -900
    assert fail_keys


async def test_fail_fast_while_store_is_down_then_recover() -> None:
    hashes = chain(4, b"ff")
    store = FakeStore(FULL16.plan(64, hashes).keys)
    store.fail_with = -900
    async with LookupCoordinator(FULL16, store, failure_backoff=0.2, cache_ttl=None) as coord:
        with pytest.raises(mcl.StoreError):
            await coord.lookup(64, hashes)
        assert not coord.healthy
        calls = len(store.calls)
        for _ in range(5):
            with pytest.raises(mcl.StoreError):
                await coord.lookup(64, hashes)
        assert len(store.calls) == calls  # not fed while down
        store.fail_with = None
        await anyio.sleep(0.25)
        assert await coord.lookup(64, hashes) == 64
        assert coord.healthy


async def test_cancelled_caller_leaves_others_alone() -> None:
    a, b = chain(8, b"a"), chain(8, b"b")
    store = FakeStore(FULL16.plan(128, a).keys + FULL16.plan(128, b).keys, delay=0.05)
    async with LookupCoordinator(FULL16, store) as coord, anyio.create_task_group() as group:
        ta = Task(group, coord.lookup, 128, a)
        tb = Task(group, coord.lookup, 128, b)
        await anyio.sleep(0.01)
        ta.cancel()
        assert await tb.result() == 128
        with pytest.raises(Cancelled):
            await ta.result()
        await anyio.sleep(0.06)
        core = coord._core
        assert not core.lookups and not core.table.queued and not core.table.waiting
        assert coord.stats().lookups_cancelled_total == 1


async def test_cancel_before_dispatch_drops_queued_keys() -> None:
    hashes = chain(8, b"q")
    store = FakeStore(delay=0.05)
    async with (
        LookupCoordinator(FULL16, store, max_rpcs_in_flight=1) as coord,
        anyio.create_task_group() as group,
    ):
        first = Task(group, coord.lookup, 128, chain(8, b"first"))
        await anyio.sleep(0.01)  # the only slot is busy
        queued = Task(group, coord.lookup, 128, hashes)
        await settle()
        queued.cancel()
        await first.result()
        await anyio.sleep(0.06)
    sent = {k for c in store.calls for k in c}
    assert not sent & set(FULL16.plan(128, hashes).keys)


async def test_timeout_bounds_a_lookup_without_hurting_others() -> None:
    store = FakeStore(delay=0.3)
    async with LookupCoordinator(FULL16, store) as coord:
        results = await gather(
            lambda: coord.lookup(64, chain(4, b"s"), timeout=0.05),
            lambda: coord.lookup(64, chain(4, b"p")),
            return_exceptions=True,
        )
        assert isinstance(results[0], mcl.LookupTimeout)
        assert isinstance(results[0], TimeoutError)
        assert results[1] == 0
        assert coord.stats().errors_by_code.get("timeout") == 1


async def test_backpressure_raise_and_wait() -> None:
    store = FakeStore(delay=0.05)
    async with LookupCoordinator(FULL16, store, max_pending_lookups=2, when_full="raise") as c:
        results = await gather(
            *(lambda i=i: c.lookup(64, chain(4, bytes([i]))) for i in range(3)),
            return_exceptions=True,
        )
        assert sum(isinstance(r, mcl.Overloaded) for r in results) == 1
    async with LookupCoordinator(FULL16, store, max_pending_lookups=2, when_full="wait") as c:
        results = await gather(*(lambda i=i: c.lookup(64, chain(4, bytes([i]))) for i in range(6)))
        assert results == [0] * 6
        assert c.stats().pending_lookups == 0


async def test_close_settles_pending_callers() -> None:
    store = FakeStore(delay=1.0)
    coord = LookupCoordinator(FULL16, store)
    async with anyio.create_task_group() as group:
        async with coord:
            pending = [Task(group, coord.lookup, 64, chain(4, bytes([i]))) for i in range(3)]
            await anyio.sleep(0.01)
        results = [await p.outcome() for p in pending]
    assert all(isinstance(r, mcl.ClosedError) for r in results)
    with pytest.raises(mcl.ClosedError):
        await coord.lookup(64, chain(4, b"late"))
    assert not tasks_left(coord)


async def test_bad_input_fails_in_caller_before_batching() -> None:
    store = FakeStore(delay=0.01)
    async with LookupCoordinator(FULL16, store) as coord, anyio.create_task_group() as group:
        good = Task(group, coord.lookup, 64, chain(4, b"ok"))
        with pytest.raises(mcl.InvalidRequest):
            await coord.lookup(63, chain(4, b"x"))  # unaligned
        with pytest.raises(mcl.InvalidRequest):
            await coord.lookup(64, [b"ok", 7])  # type: ignore[list-item]
        with pytest.raises(mcl.InvalidRequest):
            await coord.lookup(True, chain(4, b"x"))
        assert await good.result() == 0
    assert len(store.calls) == 1


async def test_one_coordinator_serves_several_layouts() -> None:
    other = KVLayout([mcl.FullAttention(16)], model="org/other", hash_block_size=16,
                     scheduler_block_size=16)
    hashes = chain(4, b"shared")
    store = FakeStore(other.plan(64, hashes).keys)
    async with LookupCoordinator(FULL16, store, cache_ttl=None) as coord:
        hits = await gather(lambda: coord.lookup(64, hashes),
                            lambda: coord.lookup(64, hashes, layout=other))
        assert hits == [0, 64]
        assert coord.stats().rpcs_total == 1


async def test_store_answer_of_wrong_length_is_a_store_error() -> None:
    class ShortStore(FakeStore):
        async def batch_is_exist(self, keys: Sequence[Any]) -> list[int]:
            return [1]

    async with LookupCoordinator(FULL16, ShortStore()) as coord:
        with pytest.raises(mcl.StoreError):
            await coord.lookup(64, chain(4, b"w"))


def _case_requests() -> list[tuple[KVLayout, int, list[bytes], set[bytes]]]:
    out = []
    for case in CASES:
        if case["error"] or case["exists"] is None:
            continue
        layout = KVLayout.from_dict(case["config"])
        hashes = [bytes.fromhex(h) for h in case["block_hashes_hex"]]
        answers: dict[str, set[int]] = {}
        for key, ans in zip(case["expected_keys"], case["exists"]):
            answers.setdefault(key, set()).add(ans)
        if any(len(v) > 1 for v in answers.values()):
            continue  # conflicting answers for one key cannot come from one store
        present = {k.encode() for k, v in answers.items() if v == {1}}
        out.append((layout, case["token_len"], hashes, present))
    return out


CASE_REQUESTS = _case_requests()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    picks=st.lists(st.integers(0, len(CASE_REQUESTS) - 1), min_size=1, max_size=40),
    seed=st.integers(0, 2**16),
    rounds=st.booleans(),
    max_keys=st.sampled_from([1, 7, 1000]),
    cache=st.sampled_from([None, 5.0]),
)
def test_property_coordinator_equals_plan_resolve(
    anyio_backend: tuple[str, dict[str, Any]], picks: list[int], seed: int, rounds: bool,
    max_keys: int, cache: float | None,
) -> None:
    """Random real-vLLM cases, one store holding all their present keys, random arrival
    order and delays: every coordinator answer equals plan.resolve on that store."""
    chosen = [CASE_REQUESTS[i] for i in picks]
    store = FakeStore()
    for _, _, _, present in chosen:
        store.add(present)
    rng = random.Random(seed)

    async def one(layout: KVLayout, token_len: int, hashes: list[bytes],
                  coord: LookupCoordinator) -> int:
        await anyio.sleep(rng.random() * 0.002)
        return await coord.lookup(token_len, hashes, layout=layout)

    async def run() -> list[int]:
        async with LookupCoordinator(chosen[0][0], store, rounds=rounds,
                                     max_keys_per_rpc=max_keys, cache_ttl=cache) as coord:
            return await gather(
                *(lambda lay=lay, t=t, h=h: one(lay, t, h, coord) for lay, t, h, _ in chosen)
            )

    hits = anyio.run(run, backend=anyio_backend[0], backend_options=anyio_backend[1])
    assert hits == [expected(lay, store, t, h) for lay, t, h, _ in chosen]


async def test_array_and_list_hashes_give_the_same_hit() -> None:
    hashes = chain(32, b"arr")
    store = FakeStore(HYBRID.plan(256, hashes).keys)
    async with LookupCoordinator(HYBRID, store) as coord:
        arr = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(-1, 32)
        assert (await coord.lookup(256, hashes), await coord.lookup(256, arr)) == (256, 256)


@pytest.mark.parametrize("rounds", [True, False])
async def test_vllm_index_error_case_fails_only_its_caller(rounds: bool) -> None:
    """full16 + SWA32/W32 with EAGLE and 3 hashes for 64 tokens: with every key present vLLM
    0.26 raises IndexError; that caller gets InvalidRequest, the shared RPC's others answer."""
    layout = KVLayout(
        [mcl.FullAttention(16), mcl.SlidingWindow(32, sliding_window=32)],
        model="m", hash_block_size=16, scheduler_block_size=32, use_eagle=True,
    )
    short = [b"a", b"b", b"c"]
    ok = [b"x", b"y", b"z", b"w"]
    store = FakeStore(layout.plan(64, short).keys + layout.plan(64, ok).keys, delay=0.01)
    async with LookupCoordinator(layout, store, rounds=rounds) as coord:
        results = await gather(
            lambda: coord.lookup(64, short), lambda: coord.lookup(64, ok), return_exceptions=True
        )
    assert isinstance(results[0], mcl.InvalidRequest)
    assert results[1] == expected(layout, store, 64, ok)


async def test_caller_cancelled_as_its_rpc_fails_leaves_others_and_keys_usable() -> None:
    """Regression (review): Task.cancel() settles the future before the lookup's task runs
    again (asyncio); the failed RPC's fan-out must not trip over it."""

    class GatedFailingStore(FakeStore):
        def __init__(self) -> None:
            super().__init__()
            self.gate = anyio.Event()

        async def batch_is_exist(self, keys: Sequence[Any]) -> list[int]:
            await self.gate.wait()
            raise mcl.StoreError("boom", code=-900)

    store = GatedFailingStore()
    async with (
        LookupCoordinator(FULL16, store, failure_backoff=0.01) as coord,
        anyio.create_task_group() as group,
    ):
        ta = Task(group, coord.lookup, 64, chain(4, b"a"))
        tb = Task(group, coord.lookup, 64, chain(4, b"b"))
        await anyio.sleep(0.01)
        store.gate.set()
        ta.cancel()  # same loop iteration as the RPC's failure
        with pytest.raises(mcl.StoreError), anyio.fail_after(2):
            await tb.result()
        assert not coord._core.table.waiting
        await anyio.sleep(0.02)
        with pytest.raises(mcl.StoreError), anyio.fail_after(2):  # its keys are not stranded
            await coord.lookup(64, chain(4, b"b"))
        assert dispatcher_running(coord)
    with pytest.raises(Cancelled):
        await ta.result()


@ASYNCIO_ONLY  # asyncio's CancelledError is an exception a store may raise; trio's is not
async def test_store_raising_cancelled_error_is_a_store_failure() -> None:
    class CancellingStore(FakeStore):
        async def batch_is_exist(self, keys: Sequence[Any]) -> list[int]:
            raise asyncio.CancelledError()

    async with LookupCoordinator(FULL16, CancellingStore()) as coord:
        with pytest.raises(mcl.StoreError):
            await asyncio.wait_for(coord.lookup(64, chain(4, b"c")), 2)
        assert not coord._core.table.waiting


async def test_admission_is_first_come_first_served() -> None:
    """A big lookup waiting for room is not starved by small ones that would fit."""
    store = FakeStore(delay=0.002)
    async with (
        LookupCoordinator(FULL16, store, max_pending_keys=8, cache_ttl=None) as coord,
        anyio.create_task_group() as group,
    ):
        stop = False
        counter = iter(range(10**9))

        async def small_client() -> None:
            while not stop:
                await coord.lookup(64, chain(4, b"s%d" % next(counter)))

        clients = [Task(group, small_client) for _ in range(3)]
        await anyio.sleep(0.02)
        big = Task(group, coord.lookup, 160, chain(10, b"big"))
        with anyio.fail_after(2):
            assert await big.result() == 0
        stop = True
        with anyio.fail_after(2):
            for client in clients:
                await client.result()


async def test_healthy_again_once_the_failure_pause_is_over() -> None:
    store = FakeStore()
    store.fail_with = -900
    async with LookupCoordinator(FULL16, store, failure_backoff=0.05) as coord:
        with pytest.raises(mcl.StoreError):
            await coord.lookup(64, chain(4, b"h"))
        assert not coord.healthy and not coord.stats().store_healthy
        await anyio.sleep(0.06)
        assert coord.healthy


async def test_per_call_timeout_is_validated() -> None:
    async with LookupCoordinator(FULL16, FakeStore()) as coord:
        for bad in (0, -1, float("nan")):
            with pytest.raises(mcl.InvalidRequest):
                await coord.lookup(64, chain(4, b"t"), timeout=bad)
