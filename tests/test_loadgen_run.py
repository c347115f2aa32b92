"""The load generator's driver (`_loadgen/run.py`): what a latency counts."""

from __future__ import annotations

import asyncio
import io
import time

import numpy as np

from aio_mclookup import FullAttention, KVLayout
from aio_mclookup._loadgen.results import LoadgenConfig, RunResult
from aio_mclookup._loadgen.run import Progress, drive
from aio_mclookup._loadgen.workload import Request, WorkloadSpec

WORK = 0.05  # seconds of synchronous work each lookup does before its first await


def _requests(n: int) -> list[Request]:
    rows = np.zeros((1, 32), dtype=np.uint8)
    return [Request(i, i, 0, 16, 16, rows, [bytes(32)]) for i in range(n)]


async def _latencies(n: int, concurrency: int) -> list[float]:
    layout = KVLayout(
        [FullAttention(16)], model="m", hash_block_size=16, scheduler_block_size=16
    )
    cfg = LoadgenConfig(layout=layout, layout_source="test", spec=WorkloadSpec())
    result = RunResult("test", concurrency, n)

    async def lookup(req: Request) -> int:
        time.sleep(WORK)  # noqa: ASYNC251 - planning-like work that holds the loop
        await asyncio.sleep(0)
        return 0

    await drive(_requests(n), lookup, result, cfg, asyncio.Event(), Progress(io.StringIO(), False))
    return sorted(result.latencies)


async def test_a_burst_counts_each_latency_from_the_runs_start() -> None:
    # all four are issued at once and none can answer before all four have done their
    # synchronous work, so each waited for all of it (counted from each task's own start,
    # the last one started would show only its own share)
    latencies = await _latencies(4, concurrency=4)
    assert latencies[0] >= 4 * WORK * 0.9


async def test_lookups_issued_one_after_another_count_from_their_call() -> None:
    latencies = await _latencies(4, concurrency=1)
    assert len(latencies) == 4
    # each only its own work (counted from the run's start, the last would show all four)
    assert latencies[-1] < 3.5 * WORK
