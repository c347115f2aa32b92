"""Master epochs in the coordinator, over the in-process fake store: nothing cached before a
new epoch answers a lookup after it, on asyncio, uvloop and trio (conftest's ``anyio_backend``:
trio runs the anyio shell); the breaker's pauses with and without a reachability signal.
(Against a real master: test_store_epochs.py.)"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import aio_mclookup as mcl
from aio_mclookup import FakeStore
from aio_mclookup._coordinator.breaker import Breaker
from aio_mclookup._coordinator.core import CoordinatorCore
from aio_mclookup._coordinator.epochs import EpochGuard
from aio_mclookup._coordinator.options import CoordinatorOptions
from aio_mclookup._observe.stats import CoordinatorStats
from helpers import chain
from v026_layouts import KVLayout, LookupCoordinator

FULL16 = KVLayout([mcl.FullAttention(16)], model="org/epochs", hash_block_size=16,
                  scheduler_block_size=16)



def core_of(**options: object) -> CoordinatorCore:
    return CoordinatorCore(CoordinatorOptions(**options), CoordinatorStats())  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_restarted_master_s_cached_presences_never_answer(anyio_backend: Any) -> None:
    hashes = chain(4, b"restart")
    store = FakeStore(FULL16.plan(64, hashes).keys)
    async with LookupCoordinator(FULL16, store) as coord:  # cache_ttl: the default 5 s
        assert await coord.lookup(64, hashes) == 64
        calls = len(store.calls)
        assert await coord.lookup(64, hashes) == 64
        assert len(store.calls) == calls  # from the cache
        store.restart()
        assert await coord.lookup(64, hashes) == 0  # asked again: the truth
        assert len(store.calls) > calls
        assert coord.stats().epoch_changes_total == 1
        store.restart()
        store.restart()  # two restarts with no lookup between: seen as one change
        assert await coord.lookup(64, hashes) == 0
        assert coord.stats().epoch_changes_total == 2


@pytest.mark.anyio
async def test_answers_of_an_rpc_sent_before_a_new_epoch_are_refused(anyio_backend: Any) -> None:
    old, new = chain(4, b"old"), chain(4, b"new")
    store = FakeStore(FULL16.plan(64, old).keys + FULL16.plan(64, new).keys, delay=0.05)
    errors: list[BaseException] = []

    async def pending() -> None:
        try:
            await coord.lookup(64, new)
        except mcl.StoreError as exc:
            errors.append(exc)

    async with LookupCoordinator(FULL16, store) as coord, anyio.create_task_group() as group:
        assert await coord.lookup(64, old) == 64  # something learned
        group.start_soon(pending)
        await anyio.sleep(0.01)  # its RPC is in flight
        store.epoch += 1  # the master went away (the keys happen to be still there)
        assert await coord.lookup(64, old) == 64  # noticed here: a new epoch, asked again
        await anyio.sleep(0.1)  # the pending lookup's RPC answers
        assert [getattr(e, "code", None) for e in errors] == [-900]
        assert await coord.lookup(64, new) == 64  # asked in the new epoch
        assert coord.stats().epoch_changes_total == 1


@pytest.mark.anyio
@pytest.mark.parametrize("on_error", ["raise", "absent"])
async def test_a_lost_master_code_drops_the_cache_before_the_fan_out(
    anyio_backend: Any, on_error: str
) -> None:
    hashes = chain(8, b"lost")
    store = FakeStore(FULL16.plan(128, hashes).keys)
    async with LookupCoordinator(FULL16, store, on_error=on_error,
                                 failure_backoff=0.01) as coord:
        assert await coord.lookup(64, hashes[:4]) == 64  # the first 4 blocks cached
        store.fail_with = -900
        store.discard(FULL16.plan(128, hashes).keys)  # (what a restart empty would do)
        # Its first 4 blocks come from the cache, the rest from a failing RPC: even under
        # "absent" it must not resolve on the cached ones.
        with pytest.raises(mcl.StoreError) as err:
            await coord.lookup(128, hashes)
        assert err.value.code == -900
        store.fail_with = None
        await anyio.sleep(0.05)
        assert await coord.lookup(128, hashes) == 0
        assert coord.stats().epoch_changes_total == 1


def test_new_epoch_forgets_and_fails_only_when_something_was_learned() -> None:
    core = core_of()
    first = core.begin(FULL16.plan(64, chain(4, b"e")), now=0.0)
    assert not core.new_epoch("test", -900)  # nothing answered yet: nothing to forget
    assert not first.done
    batches, _ = core.take_batches(0.0)
    core.settle_rpc(batches[0], 0.0, [1] * len(batches[0]), now=0.0)
    assert first.done and first.error is None
    second = core.begin(FULL16.plan(64, chain(4, b"e")), now=0.1)
    assert second.done and second.hit == 64  # from the cache
    third = core.begin(FULL16.plan(128, chain(8, b"e")), now=0.1)  # 4 cached, 4 asked
    assert not third.done
    assert core.new_epoch("test", -900)
    assert isinstance(third.error, mcl.StoreError) and third.error.code == -900
    assert core.stats.epoch_changes_total == 1
    fourth = core.begin(FULL16.plan(64, chain(4, b"e")), now=0.2)
    assert not fourth.done  # the cache is empty: it asks the store


def _learned(core: CoordinatorCore) -> None:
    """Something answered: a new epoch has something to forget."""
    core.begin(FULL16.plan(64, chain(4, b"g")), now=0.0)
    (batch,), _ = core.take_batches(0.0)
    core.settle_rpc(batch, 0.0, [1] * len(batch), now=0.0)


def test_the_guard_refuses_answers_sent_before_the_store_s_epoch_changed() -> None:
    core, store = core_of(), FakeStore()
    guard = EpochGuard(core, store)
    _learned(core)
    sent = guard.generation
    assert not guard.check()  # nothing changed
    assert guard.outcome([1, 0], sent) == [1, 0]
    store.restart()
    refused = guard.outcome([1, 0], sent)  # (it notices the change itself)
    assert isinstance(refused, mcl.StoreError) and refused.code == -900
    assert guard.generation == sent + 1 and core.stats.epoch_changes_total == 1
    assert guard.outcome([1], guard.generation) == [1]  # sent in the new epoch


@pytest.mark.parametrize("watched", [True, False])
def test_a_lost_master_code_begins_an_epoch(watched: bool) -> None:
    core = core_of()
    store: object = FakeStore() if watched else object()  # (object(): no epochs)
    guard = EpochGuard(core, store)
    _learned(core)
    failed = mcl.StoreError("gone", code=-900)
    assert guard.outcome(failed, 0) is failed
    assert core.stats.epoch_changes_total == 1
    assert guard.generation == 1  # the cache was dropped: RPCs sent before are refused
    guard.outcome(mcl.StoreError("again", code=-900), 1)  # nothing learned since
    assert core.stats.epoch_changes_total == 1
    # Without the store's epochs any lost-master code may be a new master: a new generation.
    assert guard.generation == (1 if watched else 2)


def test_the_breaker_without_a_reachability_signal_pauses_and_doubles() -> None:
    breaker = Breaker(1.0)
    breaker.failed(-900, 0.0)
    assert breaker.open(0.5) and not breaker.open(1.0)
    breaker.failed(-900, 1.0)
    assert breaker.retry_at == pytest.approx(3.0)
    for _ in range(40):  # the pause stops doubling at 8x (and never overflows)
        breaker.failed(-900, 10.0)
    assert breaker.retry_at == pytest.approx(18.0)


def test_the_breaker_with_a_reachability_signal() -> None:
    up: list[bool | None] = [True]
    breaker = Breaker(1.0, lambda: up[0])
    assert not breaker.open(0.0)
    breaker.failed(-900, 0.0)  # port up: likely a stale connection, retried soon
    assert breaker.open(0.05) and not breaker.open(1.0 / 16)
    breaker.succeeded(0.1)
    up[0] = False  # the port went down: fail fast, failed RPC or not
    assert breaker.open(0.2) and breaker.last_code == -900
    assert breaker.retry_at > 0.2  # when to look again
    up[0] = True
    assert not breaker.open(0.2)
    up[0] = None  # unknown: as without a signal
    breaker.failed(-901, 1.0)
    assert breaker.open(1.5) and not breaker.open(2.0)
