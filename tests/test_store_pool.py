"""The client pool's edges against a real master: a hung master fails ``open()`` fast without
freezing the loop, the ``MC_*`` settings never leak into the process environment, a preset
``MC_RPC_TIMEOUT_MS`` is reported; and the local master's children: a stopped master is
killed at once, the metadata server starts isolated from the caller's directory."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aio_mclookup import LocalMaster, MooncakeStore, StoreError

pytestmark = pytest.mark.integration

MC_SETTINGS = ("MC_RPC_TIMEOUT_MS", "MC_STORE_CLIENT_SETUP_RETRIES", "MC_TCP_BIND_ADDRESS")


@pytest.fixture
def own_master() -> Iterator[LocalMaster]:
    pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine-non-cuda")
    master = LocalMaster(startup_timeout=30.0)
    master.start_blocking()
    try:
        yield master
    finally:
        if master.pid is not None:
            os.kill(master.pid, signal.SIGCONT)
        master.stop_blocking()


async def test_open_against_a_hung_master_fails_fast_without_freezing_the_loop(
    own_master: LocalMaster,
) -> None:
    assert own_master.pid is not None
    os.kill(own_master.pid, signal.SIGSTOP)
    worst, stop = 0.0, False

    async def beat() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now

    beating = asyncio.ensure_future(beat())
    store = MooncakeStore(own_master.master_address, own_master.metadata_server,
                          setup_timeout=1.0)
    started = time.perf_counter()
    with pytest.raises(StoreError) as info:
        await store.open()
    took = time.perf_counter() - started
    stop = True
    await beating
    assert info.value.code == -901 and "does not answer" in str(info.value)
    assert took < 3.0, f"open() took {took:.2f} s against a hung master"
    assert worst < 0.5, f"the loop froze for {worst:.2f} s"
    assert store.closed


async def test_a_live_master_passes_the_liveness_probe(own_master: LocalMaster) -> None:
    async with MooncakeStore(own_master.master_address, own_master.metadata_server) as store:
        assert await store.batch_is_exist([b"nothing-here"]) == [0]


async def test_client_settings_do_not_leak_into_the_environment(
    own_master: LocalMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in MC_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    async with MooncakeStore(own_master.master_address, own_master.metadata_server) as store:
        assert [name for name in MC_SETTINGS if name in os.environ] == []
        assert await store.batch_is_exist([b"k"]) == [0]


async def test_a_preset_rpc_timeout_is_reported(
    own_master: LocalMaster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "5000")
    with caplog.at_level(logging.WARNING):
        async with MooncakeStore(own_master.master_address, own_master.metadata_server,
                                 rpc_timeout=0.3):
            pass
    assert any("MC_RPC_TIMEOUT_MS=5000" in r.getMessage() for r in caplog.records)
    assert os.environ["MC_RPC_TIMEOUT_MS"] == "5000"  # the user's own setting stays


def test_stopping_a_stopped_master_kills_it_at_once() -> None:
    pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine-non-cuda")
    master = LocalMaster(startup_timeout=30.0, stop_timeout=5.0)
    master.start_blocking()
    assert master.pid is not None
    os.kill(master.pid, signal.SIGSTOP)
    started = time.perf_counter()
    master.stop_blocking()
    assert time.perf_counter() - started < 1.5  # not the 5 s grace for a SIGTERM
    assert master.pid is None


def test_the_metadata_server_ignores_a_mooncake_package_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine-non-cuda")
    marker = tmp_path / "hijacked"
    fake = tmp_path / "mooncake"
    fake.mkdir()
    (fake / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (fake / "http_metadata_server.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    master = LocalMaster(startup_timeout=30.0)
    master.start_blocking()
    try:
        assert master.metadata_pid is not None
    finally:
        master.stop_blocking()
    assert not marker.exists()
