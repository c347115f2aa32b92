"""Hostile load on the coordinator: one huge lookup among many small ones, 10x overload of
admission, a retry loop without a sleep, misuse at the API edge. On the in-process fake
store and, for dispatch and admission, on a real master."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import aio_mclookup as mcl
from aio_mclookup import FakeStore, FullAttention, KVLayout, LookupCoordinator, Overloaded
from helpers import chain

FULL16 = KVLayout([FullAttention(16)], model="hostile", hash_block_size=16, scheduler_block_size=16)


class Heartbeat:
    """The longest gap between ticks of a task that wants to run every millisecond: how long
    the event loop was frozen."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.worst = max(self.worst, now - last)
            last = now

    async def __aenter__(self) -> Heartbeat:
        self._task = asyncio.ensure_future(self._beat())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def _huge_among_small(store: Any, small_present: set[bytes] | None) -> None:
    huge_hashes = chain(200_000, b"huge")  # 200,000 keys in one lookup
    smalls = [chain(16, b"small%d" % i) for i in range(64)]
    async with LookupCoordinator(FULL16, store, timeout=5.0, cache_ttl=None) as coord, \
            Heartbeat() as beat:
        huge = asyncio.ensure_future(coord.lookup(16 * 200_000, huge_hashes, timeout=60.0))
        await asyncio.sleep(0.01)  # the huge one has started probing
        started = time.perf_counter()
        hits = await asyncio.gather(*(coord.lookup(256, h) for h in smalls))
        small_time = time.perf_counter() - started
        huge.cancel()
        await asyncio.gather(huge, return_exceptions=True)
    if small_present is not None:
        want = [FULL16.plan(256, h).resolve([k in small_present for k in FULL16.plan(256, h).keys])
                for h in smalls]
        assert hits == want
    # First come, first served would put them behind 200 RPCs of the huge one's keys.
    assert small_time < 0.5, f"64 small lookups took {small_time:.2f} s beside a huge one"
    assert beat.worst < 0.5, f"the event loop froze for {beat.worst:.2f} s"


async def test_one_huge_lookup_does_not_stall_the_small_ones() -> None:
    store = FakeStore(delay=0.01)  # per RPC, as a loaded master
    present = {k for i in range(0, 64, 2) for k in FULL16.plan(256, chain(16, b"small%d" % i)).keys}
    store.add(present)
    await _huge_among_small(store, present)


@pytest.mark.integration
async def test_one_huge_lookup_does_not_stall_the_small_ones_on_a_real_master(
    mooncake_store: mcl.MooncakeStore,
) -> None:
    await _huge_among_small(mooncake_store, None)


async def _overload(store: Any) -> tuple[list[float], int]:
    """640 callers, room for 64: everyone served, in arrival order."""
    order: list[int] = []
    async with LookupCoordinator(
        FULL16, store, max_pending_lookups=64, when_full="wait", cache_ttl=None
    ) as coord:

        async def caller(i: int) -> float:
            started = time.perf_counter()
            await coord.lookup(64, chain(4, b"over%d" % i), timeout=30.0)
            order.append(i)
            return time.perf_counter() - started

        waits = await asyncio.gather(*(caller(i) for i in range(640)))
        stats = coord.stats()
    assert stats.lookups_total == 640 and stats.lookups_failed_total == 0
    # First in, first out: the first 64 to arrive all finish before any of the last 64.
    positions = {caller: pos for pos, caller in enumerate(order)}
    assert max(positions[i] for i in range(64)) < min(positions[i] for i in range(576, 640))
    return list(waits), len(order)


async def test_admission_is_first_in_first_out_under_ten_times_overload() -> None:
    waits, served = await _overload(FakeStore(delay=0.005))
    assert served == 640
    # 10 admissions of 64 at 5 ms each; waking every waiter on each release (the old way)
    # took seconds.
    assert max(waits) < 1.0, f"the last caller waited {max(waits):.2f} s"


@pytest.mark.integration
async def test_admission_is_first_in_first_out_on_a_real_master(
    mooncake_store: mcl.MooncakeStore,
) -> None:
    waits, served = await _overload(mooncake_store)
    assert served == 640 and max(waits) < 20.0


async def test_waiters_are_bounded_and_the_rest_get_overloaded() -> None:
    store = FakeStore(delay=0.05)
    async with LookupCoordinator(
        FULL16, store, max_pending_lookups=1, max_waiting_lookups=4, cache_ttl=None
    ) as coord:
        results = await asyncio.gather(
            *(coord.lookup(64, chain(4, b"bound%d" % i), timeout=5.0) for i in range(10)),
            return_exceptions=True,
        )
    overloaded = [r for r in results if isinstance(r, Overloaded)]
    served = [r for r in results if isinstance(r, int)]
    assert len(served) == 5 and len(overloaded) == 5  # one running, four waiting


async def test_overloaded_yields_so_a_retry_loop_cannot_freeze_the_loop() -> None:
    store = FakeStore(delay=0.05)
    async with LookupCoordinator(
        FULL16, store, max_pending_lookups=1, when_full="raise", cache_ttl=None
    ) as coord:
        busy = asyncio.ensure_future(coord.lookup(64, chain(4, b"busy")))
        await asyncio.sleep(0)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tick = asyncio.ensure_future(ticker())
        tries = 0
        while not busy.done() and tries < 100_000:  # a retry loop with no sleep
            tries += 1
            try:
                await coord.lookup(64, chain(4, b"retry"))
            except Overloaded:
                continue
        tick.cancel()
        await asyncio.gather(tick, return_exceptions=True)
        assert busy.done() and await busy == 0
        assert ticks > 10  # the other task ran while the loop retried


async def test_a_timed_out_waiter_leaves_the_line_and_the_next_goes_on() -> None:
    store = FakeStore(delay=0.2)
    async with LookupCoordinator(FULL16, store, max_pending_lookups=1, cache_ttl=None) as coord:
        first = asyncio.ensure_future(coord.lookup(64, chain(4, b"t0")))
        await asyncio.sleep(0)
        impatient = asyncio.ensure_future(coord.lookup(64, chain(4, b"t1"), timeout=0.05))
        patient = asyncio.ensure_future(coord.lookup(64, chain(4, b"t2"), timeout=5.0))
        with pytest.raises(mcl.LookupTimeout):
            await impatient
        assert await first == 0 and await patient == 0
        admission = coord._admission
        assert not coord._waiters and admission.reserved_lookups == admission.reserved_keys == 0


MISUSES: list[tuple[str, Callable[[LookupCoordinator], Awaitable[object]]]] = [
    ("layout", lambda c: c.lookup(64, chain(4, b"m"), layout="not a layout")),  # type: ignore[arg-type]
    ("timeout", lambda c: c.lookup(64, chain(4, b"m"), timeout="soon")),  # type: ignore[arg-type]
    ("timeout", lambda c: c.lookup(64, chain(4, b"m"), timeout=-1)),
    ("block_hashes", lambda c: c.lookup(64, np.zeros((4, 32), dtype=np.int64))),  # type: ignore[arg-type]
    ("block_hashes", lambda c: c.lookup(64, b"one blob")),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("field", "call"), MISUSES, ids=[m[0] for m in MISUSES])
async def test_misuse_at_the_api_edge_is_a_typed_error(
    field: str, call: Callable[[LookupCoordinator], Awaitable[object]]
) -> None:
    async with LookupCoordinator(FULL16, FakeStore()) as coord:
        with pytest.raises(mcl.InvalidRequest) as info:
            await call(coord)
    assert info.value.field == field


def test_bad_constructor_arguments_are_typed_errors() -> None:
    with pytest.raises(mcl.InvalidRequest) as info:
        LookupCoordinator("layout", FakeStore())  # type: ignore[arg-type]
    assert info.value.field == "layout"
    with pytest.raises(mcl.InvalidRequest):
        LookupCoordinator(FULL16, object())  # type: ignore[arg-type]
    with pytest.raises(mcl.InvalidRequest) as info:
        LookupCoordinator(FULL16, FakeStore(), max_keys_per_rpc=0)
    assert info.value.field == "max_keys_per_rpc"
    with pytest.raises(TypeError, match="max_key_per_rpc"):
        LookupCoordinator(FULL16, FakeStore(), max_key_per_rpc=10)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # (np.matrix itself)
async def test_an_array_subclass_of_hashes_reads_like_the_plain_array() -> None:
    rows = np.frombuffer(b"".join(chain(4, b"mat")), dtype=np.uint8).reshape(4, 32)
    store = FakeStore(FULL16.plan(64, rows).keys[:2])
    async with LookupCoordinator(FULL16, store) as coord:
        assert await coord.lookup(64, np.asmatrix(rows)) == await coord.lookup(64, rows)
