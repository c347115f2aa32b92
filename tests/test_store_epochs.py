"""Master epochs against a real mooncake_master on loopback: a master that restarts empty
(killed while lookups run, or silently between two lookups) never leaves a stale hit behind
it, and lookups answer again soon after it is back."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

import aio_mclookup as mcl
from aio_mclookup import LocalMaster, MooncakeStore, StoreWriter
from helpers import chain
from v026_layouts import KVLayout, LookupCoordinator  # these tests pin vLLM 0.26's rules

pytestmark = pytest.mark.integration

CHAT = KVLayout([mcl.FullAttention(16)], model="Qwen/Qwen3-8B", hash_block_size=16,
                scheduler_block_size=16, cache_prefix="epochs")
CALLERS = 64
TOKENS = 128  # 8 blocks per prompt, all written: the hit before a restart


@dataclass
class Record:
    """What the callers saw: (start, end, hit or the error's type name) per lookup."""

    lookups: list[tuple[float, float, int | str]] = field(default_factory=list)

    def first_error(self) -> float | None:
        ends = [end for _, end, got in self.lookups if isinstance(got, str)]
        return min(ends, default=None)

    def first_answer_after(self, t: float) -> float | None:
        """When the first lookup started after ``t`` returned a hit (not an error)."""
        ends = [end for start, end, got in self.lookups if start > t and isinstance(got, int)]
        return min(ends, default=None)


async def _callers(
    coord: LookupCoordinator, prompts: list[list[bytes]], record: Record, stop: asyncio.Event
) -> None:
    async def caller(i: int) -> None:
        hashes = prompts[i]
        while not stop.is_set():
            start = time.monotonic()
            try:
                got: int | str = await coord.lookup(TOKENS, hashes)
            except mcl.Error as exc:
                got = type(exc).__name__
            record.lookups.append((start, time.monotonic(), got))
            await asyncio.sleep(0.005)

    await asyncio.gather(*(caller(i) for i in range(CALLERS)))


async def _written(writer: StoreWriter) -> list[list[bytes]]:
    prompts = [chain(TOKENS // 16, f"epoch-{i}".encode()) for i in range(CALLERS)]
    for hashes in prompts:
        await writer.put_keys(CHAT.plan(TOKENS, hashes).keys)
    return prompts


async def test_a_master_killed_while_lookups_run_leaves_no_stale_hit() -> None:
    async with (
        LocalMaster() as master,
        StoreWriter(master.master_address, master.metadata_server) as writer,
        MooncakeStore(master.master_address, master.metadata_server) as store,
        LookupCoordinator(CHAT, store, timeout=5.0) as coord,  # cache_ttl: the default 5 s
    ):
        prompts = await _written(writer)
        record, stop = Record(), asyncio.Event()
        callers = asyncio.ensure_future(_callers(coord, prompts, record, stop))
        await asyncio.sleep(0.5)  # warm: every prompt cached
        killed = time.monotonic()
        await master.kill()
        await asyncio.sleep(0.5)
        await master.restart()  # empty: every key is gone with the old master
        back = time.monotonic()
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.wait_for(callers, 10)
        stats = coord.stats()
    before = [got for start, end, got in record.lookups if end < killed]
    assert before and all(got == TOKENS for got in before)
    first_error = record.first_error()
    assert first_error is not None and first_error >= killed
    stale = [
        (start - killed, got) for start, _, got in record.lookups
        if start > first_error and isinstance(got, int) and got > 0
    ]
    assert not stale, f"{len(stale)} stale hits after the first store error: {stale[:5]}"
    answered = record.first_answer_after(back)
    assert answered is not None and answered - back < 1.0, answered and answered - back
    assert stats.epoch_changes_total >= 1
    print(f"\nkilled under {CALLERS} callers: first store error {first_error - killed:.3f} s "
          f"after the kill, answers again {answered - back:.3f} s after the return; "
          f"{stats.epoch_changes_total} epochs")


async def test_a_silent_restart_leaves_no_stale_hit_and_lookups_answer_at_once() -> None:
    async with (
        LocalMaster() as master,
        StoreWriter(master.master_address, master.metadata_server) as writer,
        MooncakeStore(master.master_address, master.metadata_server) as store,
        LookupCoordinator(CHAT, store, timeout=5.0) as coord,
    ):
        prompts = await _written(writer)
        warm = await asyncio.gather(*(coord.lookup(TOKENS, h) for h in prompts))
        assert warm == [TOKENS] * CALLERS
        assert coord.stats().cache_hits_total == 0
        warm = await asyncio.gather(*(coord.lookup(TOKENS, h) for h in prompts))
        assert warm == [TOKENS] * CALLERS and coord.stats().cache_hits_total > 0  # cached
        killed = time.monotonic()
        await master.kill()
        await master.restart()  # no lookup meanwhile
        back = time.monotonic()
        outage = back - killed
        record, stop = Record(), asyncio.Event()
        callers = asyncio.ensure_future(_callers(coord, prompts, record, stop))
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.wait_for(callers, 10)
        stats = coord.stats()
    assert outage < 1.0, f"the restart took {outage:.2f} s"
    stale = [(start - back, got) for start, _, got in record.lookups
             if isinstance(got, int) and got > 0]
    assert not stale, f"{len(stale)} stale hits after a {outage:.2f} s restart: {stale[:5]}"
    answered = record.first_answer_after(back)
    assert answered is not None and answered - back < 1.0, answered and answered - back
    print(f"\nsilent {outage:.2f} s restart: answers again {answered - back:.3f} s after the "
          f"return; {stats.epoch_changes_total} epochs")
    # One for the restart; one more when an RPC on a connection to the old master fails
    # after another one has answered (the client repairs its connections one at a time).
    assert 1 <= stats.epoch_changes_total <= 3


async def test_the_watch_counts_an_epoch_per_restart_and_tells_reachability() -> None:
    async with (
        LocalMaster() as master,
        MooncakeStore(master.master_address, master.metadata_server) as store,
    ):
        epochs = store.epochs
        assert (epochs.epoch, epochs.reachable) == (0, True)
        await master.kill()
        deadline = time.monotonic() + 2
        while epochs.epoch == 0:
            assert time.monotonic() < deadline, "the watch did not see the master go"
            await asyncio.sleep(0.005)
        assert epochs.reachable is False
        await master.restart()
        deadline = time.monotonic() + 2
        while not epochs.reachable:
            assert time.monotonic() < deadline, "the watch did not see the master back"
            await asyncio.sleep(0.005)
        assert epochs.epoch == 1
    assert not store.epochs._thread.is_alive()  # stopped with the store
