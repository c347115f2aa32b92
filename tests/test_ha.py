"""HA masters elected through a real etcd on loopback (Debian's etcd-server): the leader is
killed (kill -9) under 64 concurrent callers, with and without ``--enable_oplog``. Lookups are
exact again within 15 s, never above what the serving leader holds, fail with typed errors
meanwhile; nothing hangs, the event loop never stalls over 1 s, and close takes under 5 s."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

import aio_mclookup as mcl
from aio_mclookup import LocalMaster, LookupCoordinator, MooncakeStore
from aio_mclookup._local.etcd import LocalEtcd
from helpers import chain, stop_process
from v026_layouts import KVLayout  # these tests pin vLLM 0.26's rules

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("etcd") is None and not os.environ.get("CI"),
        reason="needs etcd (Debian: apt-get install etcd-server; run.sh installs it)",
    ),
    pytest.mark.timeout(120),
]

CHAT = KVLayout([mcl.FullAttention(16)], model="Qwen/Qwen3-8B", hash_block_size=16,
                scheduler_block_size=16, cache_prefix="ha")
CALLERS = 64
TOKENS = 128
PROMPTS = [chain(TOKENS // 16, f"ha-{i}".encode()) for i in range(CALLERS)]


async def _serving(*masters: LocalMaster, within: float = 30.0) -> LocalMaster:
    """The master that leads and serves (waiting for one, at most ``within`` seconds)."""
    deadline = time.monotonic() + within
    while True:
        for master in masters:
            health = await asyncio.to_thread(master.health)
            if health and health.get("role") == "leader" and health.get("service_ready"):
                return master
        assert time.monotonic() < deadline, "no HA master came to serve"
        await asyncio.sleep(0.1)


async def _writer(master: str, metadata: str) -> asyncio.subprocess.Process:
    """A key owner in a process of its own (tests/ha_writer.py)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).with_name("ha_writer.py")), master, metadata,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert line.strip() == b"ready", line
    return proc


async def _put(writer: asyncio.subprocess.Process, keys: list[str]) -> None:
    assert writer.stdin is not None and writer.stdout is not None
    writer.stdin.write(json.dumps(keys).encode() + b"\n")
    line = await asyncio.wait_for(writer.stdout.readline(), 30)
    assert line.startswith(b"ok "), line


@pytest.mark.parametrize("oplog", [False, True], ids=["no-oplog", "oplog"])
async def test_the_leader_killed_under_64_callers(oplog: bool) -> None:
    async with LocalEtcd() as etcd:
        masters = [LocalMaster(etcd=etcd.endpoint, oplog=oplog) for _ in range(2)]
        try:
            for master in masters:
                await master.start()
            await _serving(*masters)
            address, metadata = masters[0].ha_address, masters[0].metadata_server
            writer = await _writer(address, metadata)
            try:
                for hashes in PROMPTS:
                    await _put(writer, [k.decode() for k in CHAT.plan(TOKENS, hashes).keys])
                await _failover(masters, address, metadata, oplog)
            finally:
                assert writer.stdin is not None
                writer.stdin.close()
                await stop_process(writer, 10)
        finally:
            for master in masters:
                await master.stop()


async def _failover(masters: list[LocalMaster], address: str, metadata: str, oplog: bool
                    ) -> None:
    stalls: list[float] = []
    record: list[tuple[float, float, int | str]] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            before = time.monotonic()
            await asyncio.sleep(0.01)
            stalls.append(time.monotonic() - before - 0.01)

    async def caller(coord: LookupCoordinator, hashes: list[bytes]) -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                got: int | str = await coord.lookup(TOKENS, hashes)
            except mcl.Error as exc:  # typed errors only: anything else fails the test
                got = type(exc).__name__
            record.append((start, time.monotonic(), got))
            await asyncio.sleep(0.01)

    opened = time.monotonic()
    store = MooncakeStore(address, metadata)
    ticking = asyncio.ensure_future(ticker())
    await store.open()
    assert store.isolated and time.monotonic() - opened < 10
    coord = LookupCoordinator(CHAT, store, timeout=5.0)
    callers = [asyncio.ensure_future(caller(coord, h)) for h in PROMPTS]
    await asyncio.sleep(1.0)
    leader = await _serving(*masters)
    killed = time.monotonic()
    await leader.kill()
    standby = next(m for m in masters if m is not leader)
    await _serving(standby)  # (the standby leads and serves: etcd's lease, then 5 s warm-up)
    served = time.monotonic()
    await asyncio.sleep(3.0)
    truth = [CHAT.plan(TOKENS, h).resolve(await store.batch_is_exist(CHAT.plan(TOKENS, h).keys))
             for h in PROMPTS]
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*callers), 10)  # nothing hangs
    closing = time.monotonic()
    await coord.aclose()
    await store.aclose()
    closed = time.monotonic() - closing
    await asyncio.wait_for(ticking, 5)

    before = [got for start, end, got in record if end < killed]
    assert before and all(got == TOKENS for got in before)
    after = [(start, got) for start, _, got in record if start > killed]
    assert truth == [TOKENS if oplog else 0] * CALLERS, (oplog, truth)
    too_high = [(round(s - killed, 2), got) for s, got in after
                if isinstance(got, int) and got > (TOKENS if oplog else 0)]
    assert not too_high, f"hits above the serving leader's: {too_high[:5]}"
    wrong = [s for s, got in after if got != (TOKENS if oplog else 0)]
    exact_at = max(wrong, default=killed) - killed
    assert exact_at < 15.0, f"not exact until {exact_at:.1f} s after the kill"
    assert max(stalls) < 1.0, f"the event loop stalled {max(stalls):.2f} s"
    assert closed < 5.0, f"close took {closed:.2f} s"
    print(f"\noplog={oplog}: standby serving {served - killed:.1f} s after the kill, exact "
          f"{exact_at:.1f} s after it; {len(after)} lookups after the kill "
          f"({sum(isinstance(g, str) for _, g in after)} errors); longest loop stall "
          f"{max(stalls) * 1000:.0f} ms; close {closed * 1000:.0f} ms")
