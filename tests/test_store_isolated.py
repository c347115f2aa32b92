"""A Mooncake client in a child process of its own (``MooncakeStore(isolate=True)``, the
default for ``etcd://``), against the suite's real master: the same answers as in-process,
a close that is the child's exit, and a child that dies answering RPC_FAIL, not hanging."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import aio_mclookup as mcl
from aio_mclookup import LocalMaster, MooncakeStore, StoreWriter

pytestmark = pytest.mark.integration


async def test_the_isolated_client_answers_as_the_in_process_one(
    local_master: LocalMaster, store_writer: StoreWriter, mooncake_store: MooncakeStore
) -> None:
    keys = [f"isolated-{i}" for i in range(6)]
    assert await store_writer.put_keys(keys[:3]) == 3
    async with MooncakeStore(
        local_master.master_address, local_master.metadata_server, isolate=True
    ) as store:
        assert store.isolated and store.health_check() == 0
        pid = store._client.pid
        assert pid is not None and pid != os.getpid()
        assert await store.batch_is_exist(keys) == await mooncake_store.batch_is_exist(keys)
        assert await store.batch_is_exist(keys) == [1, 1, 1, 0, 0, 0]
        assert store.batch_is_exist_blocking(keys[:2], timeout=10) == [1, 1]
        closing = time.monotonic()
    assert time.monotonic() - closing < 3.0
    deadline = time.monotonic() + 5
    while True:  # the child is gone (and reaped)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the client's process outlived the close"
        await asyncio.sleep(0.02)


async def test_a_dead_child_answers_rpc_fail_at_once(local_master: LocalMaster) -> None:
    async with MooncakeStore(
        local_master.master_address, local_master.metadata_server, isolate=True
    ) as store:
        os.kill(store._client.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while store.health_check() == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(mcl.StoreError) as err:
            await store.batch_is_exist([b"k"])
        assert err.value.code == -900 and time.monotonic() - started < 1.0
