"""What the master-epoch check costs a warm chat lookup, against a real master on loopback.

The chat scenario of bench_coalesce, warm: 64 stored 4,096-token system prompts, requests
sharing one up to a random cut and then diverging; every request was looked up once before
(the known prefixes hold the prompts). Each repetition runs the same requests twice on the
same coordinator, in turn with the epoch check (the default: the coordinator reads
``store.epochs`` on every lookup and every RPC answer) and without it (the coordinator's
``EpochGuard`` replaced by one on no epochs), so both see the same caches and the same store.
Reports the median time per lookup of each, concurrent (256 callers) and one caller at a time,
and the check alone (``timeit`` of the guard's ``check``).

Usage: ``python benchmarks/bench_epochs.py [--reps N] [--requests N]``; prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import statistics
import time
import timeit

from aio_mclookup import (
    FullAttention,
    KVLayout,
    LocalMaster,
    LookupCoordinator,
    MooncakeStore,
    StoreWriter,
)
from aio_mclookup._coordinator.epochs import EpochGuard

CHAT = KVLayout([FullAttention(16)], model="Qwen/Qwen3-8B", hash_block_size=16,
                scheduler_block_size=16)
PROMPT_BLOCKS = 256  # 4,096 tokens


def _chain(count: int, seed: bytes) -> list[bytes]:
    out, parent = [], hashlib.sha256(seed).digest()
    for i in range(count):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        out.append(parent)
    return out


def _requests(docs: list[list[bytes]], count: int) -> list[tuple[int, list[bytes]]]:
    rng = random.Random(7)
    out = []
    for i in range(count):
        doc = rng.choice(docs)
        cut = rng.randrange(1, PROMPT_BLOCKS)
        tail = _chain(rng.randrange(1, 64), f"tail-{i}".encode())
        hashes = doc[:cut] + tail
        out.append((len(hashes) * 16, hashes))
    return out


def _set_check(coord: LookupCoordinator, store: object | None) -> None:
    """Turn the coordinator's epoch check on (a guard on the store's epochs) or off (a guard
    on no epochs: what a store without them gets)."""
    core = coord._core
    core.breaker.reachable = None
    coord._epochs = EpochGuard(core, object() if store is None else store)


async def _concurrent(coord: LookupCoordinator, requests: list[tuple[int, list[bytes]]]) -> float:
    queue = list(reversed(requests))

    async def caller() -> None:
        while queue:
            n, hashes = queue.pop()
            await coord.lookup(n, hashes)

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(256)))
    return (time.perf_counter() - started) / len(requests)


async def _sequential(coord: LookupCoordinator, requests: list[tuple[int, list[bytes]]]) -> float:
    started = time.perf_counter()
    for n, hashes in requests:
        await coord.lookup(n, hashes)
    return (time.perf_counter() - started) / len(requests)


async def main(reps: int, count: int) -> None:
    docs = [_chain(PROMPT_BLOCKS, f"doc-{d}".encode()) for d in range(64)]
    requests = _requests(docs, count)
    async with (
        LocalMaster() as master,
        StoreWriter(master.master_address, master.metadata_server) as writer,
        MooncakeStore(master.master_address, master.metadata_server) as store,
    ):
        for doc in docs:
            await writer.put_keys(CHAT.plan(PROMPT_BLOCKS * 16, doc).keys)
        # cache_ttl long enough for the whole run: every repetition is warm.
        async with LookupCoordinator(CHAT, store, cache_ttl=9.0) as coord:
            results: dict[tuple[str, bool], list[float]] = {}
            for rep in range(reps):
                await _concurrent(coord, requests)  # (re-)warm: the caches expire
                for check in (True, False) if rep % 2 else (False, True):  # (either first)
                    _set_check(coord, store if check else None)
                    results.setdefault(("256 callers", check), []).append(
                        await _concurrent(coord, requests))
                    results.setdefault(("1 caller", check), []).append(
                        await _sequential(coord, requests[:256]))
            _set_check(coord, store)
            assert coord.stats().epoch_changes_total == 0
            guard = coord._epochs
            alone = min(timeit.repeat(guard.check, number=200_000, repeat=5)) / 200_000
    print(f"{count} warm chat lookups, {reps} repetitions (median us per lookup)")
    print("| callers | with the check | without | difference |")
    print("|---|---:|---:|---:|")
    for callers in ("256 callers", "1 caller"):
        on = statistics.median(results[(callers, True)]) * 1e6
        off = statistics.median(results[(callers, False)]) * 1e6
        print(f"| {callers} | {on:.2f} | {off:.2f} | {(on - off) / off * 100:+.1f} % |")
    print(f"the check alone (per call, timeit): {alone * 1e9:.0f} ns")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--requests", type=int, default=2048)
    args = parser.parse_args()
    asyncio.run(main(args.reps, args.requests))
