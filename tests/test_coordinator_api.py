"""The public lookup methods mean the same on every release: ``lookup(num_tokens, ...)`` is vLLM's
scheduler's count for a request of ``num_tokens`` tokens, ``lookup_result`` the worker's reply
for it; both compared with the literal reference ports on the same store."""

from __future__ import annotations

import asyncio
import random

import pytest

import aio_mclookup as mcl
from aio_mclookup._reference.v026 import BaselineLookup
from aio_mclookup._reference.v033 import BaselineLookupV033
from helpers import chain

GROUPS = [mcl.FullAttention(16), mcl.SlidingWindow(16, sliding_window=32)]


def layout_of(release: str) -> mcl.KVLayout:
    return mcl.KVLayout(
        GROUPS, model="org/m", hash_block_size=16, scheduler_block_size=32, vllm_version=release
    )


def reference(
    layout: mcl.KVLayout, store: mcl.FakeStore, n: int, hashes: list[bytes]
) -> tuple[int, mcl.LookupResult]:
    """(the scheduler's count, the worker's reply) by the reference port of the release."""

    def exists(keys: list[str]) -> list[int]:
        return [1 if k.encode() in store.present else 0 for k in keys]

    block = layout.scheduler_block_size
    if layout.vllm_version == "0.26.0":
        token_len = max(n, 0) // block * block  # vLLM 0.26's scheduler aligns ...
        hit = BaselineLookup(layout.to_dict()).lookup(token_len, hashes, exists)
        count = max(0, (n - 1) // block * block) if hit == n else hit  # ... leaves a token
        return count, mcl.LookupResult(hit)
    got = BaselineLookupV033(layout.to_dict()).lookup(n, hashes, exists)
    bounds = tuple(mcl.TailKeyBoundary(*b) for b in got.tail_key_boundaries)
    return got.hit_length, mcl.LookupResult(got.hit_length, bounds)


@pytest.mark.parametrize("release", ["0.26", "0.32", "0.33"])
def test_lookup_is_the_schedulers_count_on_every_release(release: str) -> None:
    layout = layout_of(release)
    rng = random.Random(release)
    docs = [chain(20, b"doc%d" % i) for i in range(6)]
    store = mcl.FakeStore()
    for doc in docs:
        stored = rng.randrange(1, 21) * 16
        store.add(layout.plan(layout.align(stored), doc).keys)
    requests = []
    for _ in range(200):
        doc = docs[rng.randrange(len(docs))]
        n = rng.randrange(0, 20 * 16 + 1)  # unaligned lengths, whole-prefix hits included
        requests.append((n, doc[: -(-n // 16)] if rng.random() < 0.5 else doc))

    async def run() -> list[tuple[int, mcl.LookupResult, int]]:
        async with mcl.LookupCoordinator(layout, store) as coord:
            counts = await asyncio.gather(*(coord.lookup(n, h) for n, h in requests))
            results = await asyncio.gather(*(coord.lookup_result(n, h) for n, h in requests))
            aliased = await asyncio.gather(*(coord.lookup_request(n, h) for n, h in requests))
        return list(zip(counts, results, aliased))

    whole = 0
    for (n, hashes), (count, result, alias) in zip(requests, asyncio.run(run())):
        want_count, want_result = reference(layout, store, n, hashes)
        assert (count, result, alias) == (want_count, want_result, want_count), (n, release)
        assert count == layout.leave_one_token(result.hit_length, n)
        whole += result.hit_length != count
    if release == "0.26":
        assert whole > 0  # the scheduler's rule did lower some whole-prefix hits


def test_the_0_26_lookup_takes_unaligned_lengths_and_bad_input_stays_typed() -> None:
    layout = layout_of("0.26")
    doc = chain(8, b"doc")
    store = mcl.FakeStore(layout.plan(128, doc).keys)

    async def run() -> None:
        async with mcl.LookupCoordinator(layout, store) as coord:
            assert await coord.lookup(128, doc) == 96  # whole prompt cached: one block less
            assert await coord.lookup(130, doc) == 128
            assert (await coord.lookup_result(130, doc)).hit_length == 128
            assert await coord.lookup(31, doc) == 0  # shorter than a scheduler block
            for bad in (True, "128", 1.5):
                with pytest.raises(mcl.InvalidRequest):
                    await coord.lookup(bad, doc)  # type: ignore[arg-type]
                with pytest.raises(mcl.InvalidRequest):
                    await coord.lookup_result(bad, doc)  # type: ignore[arg-type]

    asyncio.run(run())
