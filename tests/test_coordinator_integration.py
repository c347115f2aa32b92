"""LookupCoordinator against a real mooncake_master on loopback (started by the suite), under
anyio's pytest plugin on asyncio, uvloop and trio (conftest's ``anyio_backend``)."""

from __future__ import annotations

import random
import time

import anyio
import numpy as np
import pytest

import aio_mclookup as mcl
from aio_mclookup import LocalMaster, MooncakeStore, StoreWriter
from helpers import chain, gather
from v026_layouts import KVLayout, LookupCoordinator  # these tests pin vLLM 0.26's rules

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

DSV4_SMALL = KVLayout(
    [
        mcl.FullAttention(256),
        mcl.SlidingWindow(64, sliding_window=128),
        mcl.SlidingWindow(4, sliding_window=8),
        mcl.SlidingWindow(8, sliding_window=128),
    ],
    model="deepseek-ai/DeepSeek-V4-Pro",
    hash_block_size=4,
    scheduler_block_size=256,
    tp_size=2,
    num_kv_heads=2,
)
CHAT = KVLayout([mcl.FullAttention(16)], model="Qwen/Qwen3-8B", hash_block_size=16,
                scheduler_block_size=16, cache_prefix="it")




def requests_for(layout: KVLayout, docs: list[list[bytes]], count: int, seed: int
                 ) -> list[tuple[int, list[bytes]]]:
    """Requests sharing a cached document up to a random cut, then diverging."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        doc = docs[i % len(docs)]
        cut = rng.randrange(0, len(doc) + 1)
        hashes = doc[:cut] + chain(len(doc) - cut, b"tail%d-%d" % (seed, i))
        out.append((len(doc) * layout.hash_block_size, hashes))
    return out


async def direct_hits(store: MooncakeStore, layout: KVLayout,
                      requests: list[tuple[int, list[bytes]]]) -> list[int]:
    """vLLM's way, one request at a time: all keys in one RPC, then resolve."""
    hits = []
    for token_len, hashes in requests:
        plan = layout.plan(token_len, hashes)
        answers: list[int] = []
        for i in range(0, plan.num_keys, 1000):
            answers += await store.batch_is_exist(plan.keys[i : i + 1000])
        hits.append(plan.resolve(answers))
    return hits


async def test_written_keys_are_found_with_vllm_hits(
    anyio_backend: object, store_writer: StoreWriter, mooncake_store: MooncakeStore
) -> None:
    docs = [chain(1024, b"doc%d" % d) for d in range(2)]  # 4,096 tokens each
    for doc in docs:
        await store_writer.put_keys(DSV4_SMALL.plan(4096, doc).keys)
    chat_docs = [chain(64, b"chat%d" % d) for d in range(3)]
    for doc in chat_docs[:2]:
        await store_writer.put_keys(CHAT.plan(1024, doc).keys)
    dsv4_requests = requests_for(DSV4_SMALL, docs, 12, seed=1)
    chat_requests = requests_for(CHAT, chat_docs, 30, seed=2)
    want_dsv4 = await direct_hits(mooncake_store, DSV4_SMALL, dsv4_requests)
    want_chat = await direct_hits(mooncake_store, CHAT, chat_requests)
    assert any(want_dsv4) and any(want_chat) and 0 in want_chat
    async with LookupCoordinator(DSV4_SMALL, mooncake_store, timeout=30) as coord:
        got = await gather(
            *(lambda t=t, h=h: coord.lookup(t, np.frombuffer(b"".join(h), np.uint8).reshape(-1, 32))
              for t, h in dsv4_requests),
            *(lambda t=t, h=h: coord.lookup(t, h, layout=CHAT) for t, h in chat_requests),
        )
        stats = coord.stats()
    assert got == want_dsv4 + want_chat
    assert stats.keys_sent_total < stats.keys_planned_total


async def test_concurrent_callers_share_rpcs(
    anyio_backend: object, store_writer: StoreWriter, mooncake_store: MooncakeStore
) -> None:
    docs = [chain(256, b"share%d" % d) for d in range(4)]
    for doc in docs:
        await store_writer.put_keys(CHAT.plan(4096, doc).keys)
    requests = requests_for(CHAT, docs, 128, seed=3)
    want = await direct_hits(mooncake_store, CHAT, requests)
    async with LookupCoordinator(CHAT, mooncake_store, timeout=30, cache_ttl=None) as coord:
        got = await gather(*(lambda t=t, h=h: coord.lookup(t, h) for t, h in requests))
        stats = coord.stats()
    assert got == want
    assert stats.rpcs_total < len(requests) / 4
    assert stats.lookups_per_dispatch.sum / stats.lookups_per_dispatch.count > 2


async def test_master_killed_midrun_bounded_errors_then_recovery(anyio_backend: object) -> None:
    hashes = chain(64, b"crash")
    plan = CHAT.plan(1024, hashes)
    async with (
        LocalMaster() as master,
        StoreWriter(master.master_address, master.metadata_server) as writer,
        MooncakeStore(master.master_address, master.metadata_server, rpc_timeout=1.0) as store,
        LookupCoordinator(
            CHAT, store, timeout=3.0, failure_backoff=0.2, cache_ttl=None
        ) as coord,
    ):
        await writer.put_keys(plan.keys)
        assert await coord.lookup(1024, hashes) == 1024
        sent = coord.stats().rpcs_total
        await master.kill()
        started = time.monotonic()
        for _ in range(4):
            with pytest.raises((mcl.StoreError, mcl.LookupTimeout)):
                await coord.lookup(1024, hashes)
        assert time.monotonic() - started < 4 * 3.0 + 1.0
        # The store's watch saw the master go: lookups fail fast, the store is not fed.
        assert coord.stats().rpcs_total - sent <= 1 and not coord.healthy
        await master.restart()
        deadline = time.monotonic() + 40
        while True:  # keys are gone with the old master: the writer puts them again
            try:
                await writer.put_keys(plan.keys)
                if await coord.lookup(1024, hashes) == 1024:
                    break
            except (mcl.StoreError, mcl.LookupTimeout):
                pass
            assert time.monotonic() < deadline, "no recovery after the master restart"
            await anyio.sleep(0.3)
        assert coord.healthy
        errors = coord.stats().errors_by_code
        assert set(errors) <= {"-900", "-901", "-200", "timeout", "exception"}
