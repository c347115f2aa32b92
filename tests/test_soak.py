"""A bounded soak against a real master with faults: 64 concurrent callers for about a minute
while the master is stopped (SIGSTOP) twice and killed and restarted once.

Every answer that arrives is exact for what the store held while it was asked: one that
differs from what was written counts as wrong unless the store's own answers, asked right
after, give the same lower hit (keys gone from the store: *lost*, counted and bounded), or a
hit between theirs and what was written (*stale*, counted and bounded: a key dropped between
the answer and the re-check, or one dropped within ``cache_ttl`` of a present answer, which
the positive cache still reports present, as documented). Before the crash, keys only leave
the store (leases lapse while the master hangs), so an answer taken at any moment of the
lookup, or from the cache, lies in that range; one outside it is wrong. Failures are typed
(StoreError, LookupTimeout) and bounded in time; afterwards nothing is left behind (pending
lookups, tasks, file descriptors). Runs in CI (``CI`` set) or with ``AIO_MCLOOKUP_SOAK=1``;
skipped otherwise, to keep the local suite quick.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from aio_mclookup import (
    FullAttention,
    KVLayout,
    LocalMaster,
    LookupCoordinator,
    LookupTimeout,
    MooncakeStore,
    StoreError,
    StoreWriter,
)
from helpers import chain

pytestmark = [
    pytest.mark.integration,
    pytest.mark.soak,
    pytest.mark.skipif(
        not (os.environ.get("CI") or os.environ.get("AIO_MCLOOKUP_SOAK")),
        reason="the soak runs in CI, or with AIO_MCLOOKUP_SOAK=1",
    ),
    pytest.mark.timeout(240),
]

LAYOUT = KVLayout([FullAttention(16)], model="soak", hash_block_size=16, scheduler_block_size=16)
PROMPTS = [chain(32, b"soak%d" % i) for i in range(48)]
STORED = [i * 2 // 3 for i in range(48)]  # prompt i has its first STORED[i] chunks written
PHASE_SECONDS = 15.0


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_soak_with_master_faults() -> None:
    pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine-non-cuda")
    plans = [LAYOUT.plan(512, p) for p in PROMPTS]
    written = [plan.keys[:n] for plan, n in zip(plans, STORED)]
    want = [plan.resolve([1] * n + [0] * (len(plan.keys) - n)) for plan, n in zip(plans, STORED)]
    fds_before = _open_fds()
    async with LocalMaster(startup_timeout=30.0, client_ttl=2) as master:
        writer = StoreWriter(master.master_address, master.metadata_server)
        store = MooncakeStore(master.master_address, master.metadata_server, rpc_timeout=0.5)
        await writer.open()
        await store.open()
        try:
            await writer.put_keys([k.decode() for keys in written for k in keys])
            tasks_before = len(asyncio.all_tasks())
            answers = wrong = failed = lost = stale = 0
            wrong_cases: list[tuple[int, int, int, int | None]] = []  # (prompt, hit, want, truth)
            slowest = 0.0
            stored = True  # false between the restart and the rewrite: nothing is present
            async with LookupCoordinator(LAYOUT, store, timeout=2.0, cache_ttl=1.0) as coord:

                async def caller(seed: int, until: float) -> None:
                    nonlocal answers, wrong, failed, lost, stale, slowest
                    i = seed
                    while time.monotonic() < until:
                        i = (i * 7 + 3) % len(PROMPTS)
                        expect_stored = stored
                        started = time.perf_counter()
                        try:
                            hit = await coord.lookup(512, PROMPTS[i])
                        except (StoreError, LookupTimeout):
                            failed += 1
                        else:
                            answers += 1
                            if expect_stored and stored and hit != want[i]:
                                try:  # what the store holds now (a dropped key stays dropped)
                                    truth = plans[i].resolve(await store.batch_is_exist(
                                        plans[i].keys
                                    ))
                                except StoreError:
                                    truth = None
                                if hit == truth and truth < want[i]:
                                    lost += 1
                                elif truth is not None and truth < hit < want[i]:
                                    stale += 1
                                else:
                                    wrong += 1
                                    wrong_cases.append((i, hit, want[i], truth))
                        slowest = max(slowest, time.perf_counter() - started)
                        await asyncio.sleep(0.001)

                async def faults(start: float) -> None:
                    nonlocal stored
                    assert master.pid is not None
                    for at in (3.0, 8.0):  # two hangs of a second each
                        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
                        os.kill(master.pid, signal.SIGSTOP)
                        await asyncio.sleep(1.0)
                        os.kill(master.pid, signal.SIGCONT)
                    await asyncio.sleep(max(0.0, start + PHASE_SECONDS - time.monotonic()))
                    stored = False
                    await master.kill()  # a crash: every key is gone
                    await master.restart()
                    for _ in range(100):  # the writer re-mounts by itself; retry until it has
                        try:
                            await writer.put_keys([k.decode() for keys in written for k in keys])
                            break
                        except StoreError:
                            await asyncio.sleep(0.2)
                    await asyncio.sleep(1.5)  # cached answers from before the crash expire
                    stored = True

                start = time.monotonic()
                until = start + 2 * PHASE_SECONDS
                await asyncio.gather(faults(start), *(caller(s, until) for s in range(64)))
                stats = coord.stats()
            assert wrong == 0, (
                f"{wrong} of {answers} answers were not vLLM's hit ({lost} lost, {stale} stale): "
                f"(prompt, hit, written, store's hit after) {wrong_cases[:10]}"
            )
            assert answers > 1000 and failed < answers and lost < answers // 2
            assert stale <= max(lost, answers // 1000), (stale, lost, answers)
            assert slowest < 2.5, f"a lookup took {slowest:.2f} s (timeout 2 s)"
            assert stats.pending_lookups == 0 and stats.rpcs_in_flight == 0
            await asyncio.sleep(0.1)
            assert len(asyncio.all_tasks()) <= tasks_before
        finally:
            await store.aclose()
            await writer.aclose()
    assert _open_fds() <= fds_before + 8
