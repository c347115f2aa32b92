"""Integration tests of the real Mooncake store adapter against a real master on loopback."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from aio_mclookup import CallbackStore, LocalMaster, MooncakeStore, Store, StoreWriter
from aio_mclookup._errors import ClosedError, InvalidRequest, StoreError

pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine-non-cuda")

pytestmark = pytest.mark.integration

_T = TypeVar("_T")


def _keys(n: int, tag: str = "") -> list[str]:
    """``n`` unique vLLM-like keys."""
    run = uuid.uuid4().hex
    return [f"Qwen3-0.6B@tp_rank:0@pcp0@dcp0@pp_rank:0@{run}{tag}{i:06d}" for i in range(n)]


# ---- listening sockets of a process, from /proc (no psutil, no ss) ---------------------------


def _decode_addr(hex_addr: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    # /proc prints the address as host-order 32-bit words.
    swapped = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(swapped)
    return ip, int(port, 16)


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state held by ``pid``."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ip, port = _decode_addr(fields[1])
                found.add((str(ip), port))
    return found


def _is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _assert_loopback_only(master: LocalMaster) -> None:
    assert master.pid is not None and master.metadata_pid is not None
    master_socks = _listening(master.pid)
    metadata_socks = _listening(master.metadata_pid)
    assert ("127.0.0.1", master.rpc_port) in master_socks
    assert ("127.0.0.1", master.metrics_port) in master_socks
    assert ("127.0.0.1", master.metadata_port) in metadata_socks
    for addr, port in master_socks | metadata_socks:
        assert _is_loopback(addr), f"{addr}:{port} is not loopback"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _gone(pid: int) -> bool:
    """The process has exited (gone, or a zombie awaiting a reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


# ---- LocalMaster ---------------------------------------------------------------------------


def test_local_master_listens_on_loopback_only(local_master: LocalMaster) -> None:
    assert local_master.master_address == f"127.0.0.1:{local_master.rpc_port}"
    assert local_master.metadata_server == (
        f"http://127.0.0.1:{local_master.metadata_port}/metadata"
    )
    _assert_loopback_only(local_master)
    assert local_master.master_log is not None and local_master.master_log.exists()


def test_children_die_with_their_parent(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from aio_mclookup import LocalMaster
        m = LocalMaster(startup_timeout=30)
        m.start_blocking()
        print(m.pid, m.metadata_pid, m.log_dir, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline().decode().split()
        assert len(line) == 3, line
        pids = [int(p) for p in line[:2]]
        log_dir = Path(line[2])
        assert not any(_gone(p) for p in pids)
    finally:
        parent.kill()
        parent.wait(10)
        if parent.stdout is not None:
            parent.stdout.close()
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(log_dir, ignore_errors=True)  # its owner died before it could clean up
    alive = [p for p in pids if not _gone(p)]
    for p in alive:  # do not leak them if the check fails
        os.kill(p, signal.SIGKILL)
    assert not alive, "children outlived their SIGKILLed parent"


# ---- MooncakeStore against the session master ----------------------------------------------


async def test_store_satisfies_protocol(mooncake_store: MooncakeStore) -> None:
    assert isinstance(mooncake_store, Store)
    assert isinstance(mooncake_store, CallbackStore)  # the coordinator's call-back path
    assert mooncake_store.max_concurrency == 4
    assert mooncake_store.health_check() == 0


async def test_present_and_absent_keys(
    store_writer: StoreWriter, mooncake_store: MooncakeStore
) -> None:
    present = _keys(5, "p")
    absent = _keys(5, "a")
    assert await store_writer.put_keys(present + present[:2]) == 5  # duplicates collapse
    assert await store_writer.put_keys(present) == 5  # already present: fine
    assert await mooncake_store.batch_is_exist(present + absent) == [1] * 5 + [0] * 5
    # bytes keys match their UTF-8 str twins
    assert await mooncake_store.batch_is_exist([k.encode() for k in present[:2]]) == [1, 1]
    assert await mooncake_store.batch_is_exist([absent[0].encode()]) == [0]
    # duplicates inside one batch are answered one by one
    batch = [present[0], present[0], absent[0], absent[0], present[1]]
    assert await mooncake_store.batch_is_exist(batch) == [1, 1, 0, 0, 1]
    assert await mooncake_store.batch_is_exist([]) == []


async def test_writer_bulk_put_and_remove(
    store_writer: StoreWriter, mooncake_store: MooncakeStore
) -> None:
    keys = _keys(2500, "bulk")
    assert await store_writer.put_keys(iter(keys)) == 2500  # more than one chunk
    chunks = [keys[i : i + 1000] for i in range(0, 2500, 1000)]
    answers = await asyncio.gather(*(mooncake_store.batch_is_exist(c) for c in chunks))
    assert [sum(a) for a in answers] == [1000, 1000, 500]
    # the lookups above granted leases: only a forced remove succeeds now
    assert await store_writer.remove_keys(keys[:10] + _keys(3, "never"), force=True) == 10
    assert await mooncake_store.batch_is_exist(keys[:12]) == [0] * 10 + [1, 1]


async def test_client_exception_becomes_store_error(mooncake_store: MooncakeStore) -> None:
    with pytest.raises(StoreError) as info:
        await mooncake_store.batch_is_exist([1, 2])  # type: ignore[list-item]
    assert info.value.code is None
    assert isinstance(info.value.__cause__, TypeError)
    assert mooncake_store.in_flight == 0
    with pytest.raises(InvalidRequest):  # list("key") would look up "k", "e", "y"
        await mooncake_store.batch_is_exist("key")


async def test_call_back_form_answers_like_batch_is_exist(
    store_writer: StoreWriter, mooncake_store: MooncakeStore
) -> None:
    """The coordinator's form (no awaiting task): the same answers, errors as values, on the
    loop's thread."""
    present, absent = _keys(3, "cb-p"), _keys(2, "cb-a")
    await store_writer.put_keys(present)
    loop = asyncio.get_running_loop()
    got: asyncio.Future[tuple[object, int]] = loop.create_future()

    def then(outcome: object) -> None:
        got.set_result((outcome, threading.get_ident()))

    mooncake_store.batch_is_exist_then([k.encode() for k in present + absent], then)
    outcome, thread = await asyncio.wait_for(got, 10)
    assert outcome == [1, 1, 1, 0, 0]
    assert thread == threading.get_ident()
    failed: asyncio.Future[object] = loop.create_future()
    mooncake_store.batch_is_exist_then([1, 2], failed.set_result)  # type: ignore[list-item]
    error = await asyncio.wait_for(failed, 10)
    assert isinstance(error, StoreError) and error.code is None
    assert mooncake_store.in_flight == 0


async def test_blocking_form_answers_like_batch_is_exist(
    store_writer: StoreWriter, mooncake_store: MooncakeStore
) -> None:
    """A synchronous caller's form (the vLLM plug-in's synchronous mode), from a thread."""
    present, absent = _keys(3, "bl-p"), _keys(2, "bl-a")
    await store_writer.put_keys(present)
    got = await asyncio.to_thread(mooncake_store.batch_is_exist_blocking, present + absent, 10.0)
    assert got == [1, 1, 1, 0, 0]
    assert mooncake_store.batch_is_exist_blocking([]) == []
    with pytest.raises(StoreError) as info:
        mooncake_store.batch_is_exist_blocking([1, 2])  # type: ignore[list-item]
    assert info.value.code is None
    assert mooncake_store.in_flight == 0


async def test_closed_store_raises_closed_error(local_master: LocalMaster) -> None:
    store = MooncakeStore(local_master.master_address, local_master.metadata_server, threads=2)
    with pytest.raises(ClosedError):  # before open: the wheel would segfault
        await store.batch_is_exist(["k"])
    assert store.health_check() == 1
    async with store:
        assert await store.batch_is_exist(["k"]) == [0]
    assert store.closed
    with pytest.raises(ClosedError):  # after close: the wheel would segfault
        await store.batch_is_exist(["k"])
    with pytest.raises(ClosedError):
        await store.batch_is_exist([])
    with pytest.raises(ClosedError):  # the coordinator's call-back form too
        store.batch_is_exist_then(["k"], lambda outcome: None)
    assert store.health_check() == 1
    await store.aclose()  # idempotent
    with pytest.raises(ClosedError):
        await store.open()


async def test_aclose_waits_for_in_flight_calls(
    store_writer: StoreWriter, local_master: LocalMaster
) -> None:
    keys = _keys(1000, "c")
    await store_writer.put_keys(keys[::2])
    expected = [1, 0] * 500
    store = MooncakeStore(local_master.master_address, local_master.metadata_server, threads=4)
    await store.open()
    calls = 0

    async def hammer() -> None:
        nonlocal calls
        while True:
            try:
                answer = await store.batch_is_exist(keys)
            except ClosedError:
                return
            assert answer == expected
            calls += 1

    tasks = [asyncio.create_task(hammer()) for _ in range(8)]
    await asyncio.sleep(0.1)
    assert store.in_flight > 0
    await asyncio.wait_for(store.aclose(), 30)
    assert store.in_flight == 0
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert calls > 0
    with pytest.raises(ClosedError):
        await store.batch_is_exist(keys)


async def test_cancelled_callers_keep_accounting(local_master: LocalMaster) -> None:
    keys = _keys(50_000, "x")
    store = MooncakeStore(local_master.master_address, local_master.metadata_server, threads=1)
    async with store:
        # one call running on the thread, two queued behind it; cancel them all
        tasks = [asyncio.create_task(store.batch_is_exist(keys)) for _ in range(3)]
        await asyncio.sleep(0.005)
        assert store.in_flight == 3
        for t in tasks:
            t.cancel()
        for t in tasks:
            with pytest.raises(asyncio.CancelledError):
                await t
        deadline = time.monotonic() + 10
        while store.in_flight:  # the running call finishes on its thread; its result is dropped
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert await store.batch_is_exist(keys[:3]) == [0, 0, 0]
        # a caller cancelled while its call runs does not keep close from finishing
        task = asyncio.create_task(store.batch_is_exist(keys))
        await asyncio.sleep(0.005)
        task.cancel()
    assert store.in_flight == 0
    assert task.cancelled()


async def test_dead_master_fails_fast(local_master: LocalMaster) -> None:
    port = _free_port()
    store = MooncakeStore(f"127.0.0.1:{port}", local_master.metadata_server, setup_timeout=5)
    start = time.monotonic()
    with pytest.raises(StoreError) as info:
        async with store:
            pass
    assert info.value.code == -900
    assert time.monotonic() - start < 5  # not the ~90 s of setup() retries
    assert store.closed
    with pytest.raises(ClosedError):
        await store.batch_is_exist(["k"])


# ---- master crash and restart (a master of its own) ------------------------------------------


async def _until_ok(make_call: Callable[[], Awaitable[_T]], timeout: float) -> _T:
    """Retry an awaitable factory while it raises StoreError, for at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await asyncio.wait_for(make_call(), 10)
        except StoreError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_master_kill_and_restart() -> None:
    keys = _keys(20, "r")
    async with LocalMaster(client_ttl=5) as master:
        ports = (master.rpc_port, master.metrics_port, master.metadata_port)
        address, metadata = master.master_address, master.metadata_server
        old_pid, metadata_pid = master.pid, master.metadata_pid
        async with (
            StoreWriter(address, metadata, segment_size=16 << 20) as writer,
            MooncakeStore(address, metadata) as store,
        ):
            assert await writer.put_keys(keys) == 20
            assert await store.batch_is_exist(keys) == [1] * 20

            await master.kill()
            assert master.pid is None
            assert master.metadata_pid == metadata_pid  # the metadata server stays
            with pytest.raises(StoreError) as info:
                await asyncio.wait_for(store.batch_is_exist(keys), 10)
            assert info.value.code in (-900, -901)

            await master.restart()
            assert (master.rpc_port, master.metrics_port, master.metadata_port) == ports
            assert master.master_address == address and master.metadata_server == metadata
            assert master.pid not in (None, old_pid)
            _assert_loopback_only(master)

            # the same store object answers again; the master lost every key
            answer = await _until_ok(lambda: store.batch_is_exist(keys), 20)
            assert answer == [0] * 20
            # the writer re-mounts by itself (puts fail with -900/-200 until then)
            assert await _until_ok(lambda: writer.put_keys(keys), 20) == 20
            assert await store.batch_is_exist(keys) == [1] * 20
    assert master.pid is None and master.metadata_pid is None
    assert _gone(old_pid or 0) and _gone(metadata_pid or 0)
