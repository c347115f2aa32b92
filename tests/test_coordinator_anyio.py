"""LookupCoordinator (and the FakeStore) under anyio's pytest plugin, on asyncio, uvloop and
trio (the ``anyio_backend`` fixture of conftest): callers in tasks of an anyio task group, the
same answers as the plans' own, and one caller's timeout, cancellation or failure hurting no
other. On trio it runs its anyio shell (``_coordinator/anyio_shell.py``), elsewhere the
asyncio one."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

import aio_mclookup as mcl
from aio_mclookup import FakeStore, LookupCoordinator
from helpers import chain, gather

pytestmark = pytest.mark.anyio

CHAT = mcl.KVLayout([mcl.FullAttention(16)], model="org/chat", hash_block_size=16,
                    scheduler_block_size=16)
DOCS = [chain(64, b"anyio%d" % d) for d in range(4)]


def filled(**kwargs: Any) -> FakeStore:
    """A fake store holding the first three documents' keys (the fourth is absent)."""
    store = FakeStore(**kwargs)
    for doc in DOCS[:3]:
        store.add(CHAT.plan(1024, doc).keys)
    return store


def want(store: FakeStore, num_tokens: int, hashes: list[bytes]) -> mcl.LookupResult:
    plan = CHAT.plan(num_tokens, hashes)
    return plan.resolve_result([1 if k in store.present else 0 for k in plan.keys])


def shell_of(coordinator: LookupCoordinator) -> str:
    return "anyio" if coordinator._other is not None else "asyncio"


async def test_concurrent_callers_get_the_plans_answers_from_shared_rpcs(
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    store = filled(delay=0.002)
    requests = [(1024 - 16 * (i % 5), DOCS[i % 4][: 40 + i % 24]) for i in range(48)]
    async with LookupCoordinator(CHAT, store) as coord:
        assert shell_of(coord) == ("anyio" if anyio_backend[0] == "trio" else "asyncio")
        results = await gather(
            *(lambda n=n, h=h: coord.lookup_result(n, h) for n, h in requests)
        )
        hits = await gather(*(lambda n=n, h=h: coord.lookup_request(n, h) for n, h in requests))
        stats = coord.stats()
    assert results == [want(store, n, h) for n, h in requests]
    assert hits == [r.hit_length for r in results]
    assert any(hits) and 0 in hits
    assert stats.lookups_total == 2 * len(requests) and stats.lookups_failed_total == 0
    assert stats.rpcs_total < len(requests) / 4  # shared, deduplicated RPCs


async def test_a_timeout_fails_its_caller_only(anyio_backend: Any) -> None:
    store = filled(delay=0.3)
    async with LookupCoordinator(CHAT, store) as coord:

        async def short() -> BaseException | int:
            try:
                return await coord.lookup_request(1024, DOCS[0], timeout=0.05)
            except mcl.LookupTimeout as exc:
                return exc

        started = time.monotonic()
        timed_out, hit = await gather(short, lambda: coord.lookup_request(1024, DOCS[0]))
        elapsed = time.monotonic() - started
        stats = coord.stats()
    assert isinstance(timed_out, mcl.LookupTimeout)
    assert hit == want(store, 1024, DOCS[0]).hit_length == 1008
    assert elapsed < 2.0
    assert stats.errors_by_code == {"timeout": 1}


async def test_a_cancelled_caller_leaves_the_others_alone(anyio_backend: Any) -> None:
    store = filled(delay=0.1)
    hits: list[int] = []
    async with LookupCoordinator(CHAT, store) as coord, anyio.create_task_group() as group:

        async def doomed() -> None:
            with anyio.move_on_after(0.02):
                await coord.lookup_request(1024, DOCS[1])
            hits.append(-1)

        async def patient() -> None:
            hits.append(await coord.lookup_request(1024, DOCS[1]))

        group.start_soon(doomed)
        group.start_soon(patient)
    assert sorted(hits) == [-1, 1008]
    assert coord.stats().lookups_cancelled_total == 1


async def test_admission_waits_in_order_or_refuses(anyio_backend: Any) -> None:
    store = filled(delay=0.01)
    async with LookupCoordinator(CHAT, store, max_pending_lookups=1) as coord:
        hits = await gather(*(lambda d=d: coord.lookup_request(1024, d) for d in DOCS * 2))
    assert hits == [1008, 1008, 1008, 0] * 2
    async with LookupCoordinator(CHAT, store, max_pending_lookups=1, when_full="raise") as coord:

        async def one(doc: list[bytes]) -> object:
            try:
                return await coord.lookup_request(1024, doc)
            except mcl.Overloaded as exc:
                return exc

        got = await gather(*(lambda d=d: one(d) for d in DOCS))
    admitted = [(i, g) for i, g in enumerate(got) if not isinstance(g, mcl.Overloaded)]
    assert len(admitted) == 1  # (trio starts tasks in any order: one of them, the others 429)
    assert admitted[0][1] == (0 if admitted[0][0] == 3 else 1008)


async def test_waiting_for_admission_times_out(anyio_backend: Any) -> None:
    store = filled(delay=0.3)
    async with LookupCoordinator(CHAT, store, max_pending_lookups=1) as coord:

        async def queued() -> object:
            await anyio.sleep(0.01)  # (second in line)
            try:
                return await coord.lookup_request(1024, DOCS[2], timeout=0.05)
            except mcl.LookupTimeout as exc:
                return exc

        first, second = await gather(lambda: coord.lookup_request(1024, DOCS[0]), queued)
        assert first == 1008 and isinstance(second, mcl.LookupTimeout)
        assert await coord.lookup_request(1024, DOCS[2]) == 1008  # (room again)


async def test_closing_fails_pending_callers(anyio_backend: Any) -> None:
    store = filled(delay=5.0)
    outcomes: list[object] = []
    async with LookupCoordinator(CHAT, store) as coord:
        async with anyio.create_task_group() as group:

            async def pending(doc: list[bytes]) -> None:
                try:
                    outcomes.append(await coord.lookup_request(1024, doc))
                except mcl.ClosedError as exc:
                    outcomes.append(exc)

            for doc in DOCS:
                group.start_soon(pending, doc)
            await anyio.sleep(0.05)
            started = time.monotonic()
            await coord.aclose()
        assert time.monotonic() - started < 1.0
        assert coord.closed
        with pytest.raises(mcl.ClosedError):
            await coord.lookup_request(1024, DOCS[0])
    assert len(outcomes) == 4 and all(isinstance(o, mcl.ClosedError) for o in outcomes)


async def test_store_errors_fail_fast_then_recover(anyio_backend: Any) -> None:
    store = filled()
    store.fail_with = -900
    async with LookupCoordinator(CHAT, store, failure_backoff=0.05, cache_ttl=None) as coord:
        with pytest.raises(mcl.StoreError) as info:
            await coord.lookup_request(1024, DOCS[0])
        assert info.value.code == -900
        assert not coord.healthy
        with pytest.raises(mcl.StoreError):  # the breaker: no RPC while it is open
            await coord.lookup_request(1024, DOCS[1])
        calls = len(store.calls)
        store.fail_with = None
        await anyio.sleep(0.1)
        assert await coord.lookup_request(1024, DOCS[1]) == 1008  # the probe goes through
        assert coord.healthy and len(store.calls) > calls


async def test_linger_gathers_callers_into_one_rpc(anyio_backend: Any) -> None:
    store = filled()
    async with LookupCoordinator(CHAT, store, linger=0.02, rounds=False) as coord:
        hits = await gather(*(lambda d=d: coord.lookup_request(1024, d) for d in DOCS))
    assert hits == [1008, 1008, 1008, 0]
    assert len(store.calls) == 1


async def test_bad_input_fails_before_any_shared_batch(anyio_backend: Any) -> None:
    store = filled(delay=0.01)
    async with LookupCoordinator(CHAT, store) as coord:

        async def bad() -> object:
            try:
                return await coord.lookup_request("1024", DOCS[0])  # type: ignore[arg-type]
            except mcl.InvalidRequest as exc:
                return exc

        got = await gather(bad, lambda: coord.lookup_request(1024, DOCS[0]))
    assert isinstance(got[0], mcl.InvalidRequest) and got[1] == 1008


@pytest.mark.parametrize("anyio_backend", [pytest.param(("trio", {}), id="trio")])
async def test_under_trio_the_coordinator_runs_inside_async_with(anyio_backend: Any) -> None:
    coord = LookupCoordinator(CHAT, filled())
    with pytest.raises(mcl.ClosedError, match="async with"):
        await coord.lookup_request(1024, DOCS[0])
    async with coord:
        assert await coord.lookup_request(1024, DOCS[0]) == 1008


@pytest.mark.integration
async def test_real_master_from_any_backend(
    anyio_backend: Any, local_master: mcl.LocalMaster, store_writer: mcl.StoreWriter
) -> None:
    """A MooncakeStore opened, looked up through (its answers called back onto the
    backend's loop from the client's threads) and closed on the backend."""
    docs = [chain(32, b"real-%s-%d" % (repr(anyio_backend).encode(), d)) for d in range(3)]
    for doc in docs[:2]:
        await store_writer.put_keys(CHAT.plan(512, doc).keys)
    requests = [(512 - 16 * (i % 3), docs[i % 3][: 20 + i % 12]) for i in range(30)]
    async with mcl.MooncakeStore(local_master.master_address, local_master.metadata_server) as s:
        direct = []
        for n, h in requests:  # vLLM's way: one RPC per request
            plan = CHAT.plan(n, h)
            direct.append(plan.resolve_result(await s.batch_is_exist(plan.keys)))
        async with LookupCoordinator(CHAT, s, timeout=30, cache_ttl=None) as coord:
            got = await gather(*(lambda n=n, h=h: coord.lookup_result(n, h) for n, h in requests))
            stats = coord.stats()
    assert got == direct and any(r.hit_length for r in got)
    assert stats.rpcs_total < len(requests)


async def test_a_dead_master_fails_open_fast_on_any_backend(anyio_backend: Any) -> None:
    """The store's master probe (asyncio's sockets, or anyio's under trio): a refused connect
    is ``StoreError(code=-900)`` at once, before the Mooncake client is built."""
    store = mcl.MooncakeStore("127.0.0.1:1", "http://127.0.0.1:2/metadata", setup_timeout=2.0)
    started = time.monotonic()
    with pytest.raises(mcl.StoreError, match=r"127\.0\.0\.1:1 is not reachable") as info:
        await store.open()
    assert info.value.code == -900 and time.monotonic() - started < 2.0
    assert store.closed
