"""The scheduler's sidecar (``_scheduler.channels.SidecarChannel`` and the
``_scheduler.sidecar`` process) against a real master on loopback: the answers of the
in-process path, one message per step, failures that stay bounded, and no process or thread
left behind."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from aio_mclookup import (
    CoordinatorOptions,
    LocalMaster,
    MooncakeStore,
    StoreError,
    StoreWriter,
)
from aio_mclookup._scheduler.channels import SidecarChannel, opening
from aio_mclookup._scheduler.client import PLUGIN_DEFAULTS, CoalescingLookupClient
from aio_mclookup._scheduler.loop import run_once
from test_scheduler_client import H, _hashes, _layout, _result

pytestmark = pytest.mark.integration

def _channel(master: LocalMaster, **options: Any) -> SidecarChannel:
    opts = CoordinatorOptions(**{**PLUGIN_DEFAULTS, **options})
    return SidecarChannel(
        opening(
            _layout(),
            opts,
            master_address=master.master_address,
            metadata_server=master.metadata_server,
            local_hostname="127.0.0.1",
            tenant_id="default",
        ),
        30.0,
    )


class Sidecar:
    """A client over a sidecar, and a blocking path through ``store`` (if given)."""

    def __init__(self, master: LocalMaster, store: MooncakeStore | None, **options: Any):
        self.channels: list[SidecarChannel] = []

        def open_channel() -> SidecarChannel:
            channel = _channel(master, **options)
            self.channels.append(channel)
            return channel

        self.client = CoalescingLookupClient(
            _layout(),
            open_channel,
            make_result=_result,
            reset_store=lambda: True,
            options=CoordinatorOptions(**{**PLUGIN_DEFAULTS, **options}),
            exist_blocking=store.batch_is_exist_blocking if store is not None else None,
        )

    def step(self, timeout: float = 10.0) -> None:
        """One scheduler step's end: send, then wait (idle) until an answer is in."""
        self.client.flush()
        deadline = time.monotonic() + timeout
        while self.client._sent and time.monotonic() < deadline:
            self.client.wait_for_answers(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aio-mclookup")]


_tags = iter(range(1 << 30))


@pytest.fixture
def prompts(
    store_writer: StoreWriter, mooncake_store: MooncakeStore
) -> Iterator[list[tuple[int, list[bytes], Any]]]:
    """(num_tokens, hashes, the result of the in-process path) for stored prefixes of several
    lengths (none, one block, three, all; one prompt not a block multiple)."""
    layout = _layout()
    cases = []
    for i, stored in enumerate([0, 1, 3, 8, 8]):
        hashes = _hashes(b"sidecar-%d-%d" % (os.getpid(), next(_tags)), 8)
        if stored:
            plan = layout.plan(stored * H, hashes[:stored])
            assert asyncio.run(store_writer.put_keys([k.decode() for k in plan.keys])) == stored
        n = 8 * H - (i == 4)
        plan = layout.plan(n, hashes)
        result = plan.resolve_result(mooncake_store.batch_is_exist_blocking(list(plan.keys), 5.0))
        cases.append(
            (n, hashes, (result.hit_length, tuple(tuple(b) for b in result.tail_key_boundaries)))
        )
    assert len({want[0] for _, _, want in cases}) >= 3  # hits of several lengths
    yield cases


def test_sidecar_answers_are_the_in_process_ones(
    local_master: LocalMaster, prompts: list[tuple[int, list[bytes], Any]]
) -> None:
    side = Sidecar(local_master, None)
    try:
        ids = [f"r{i}" for i in range(len(prompts))]
        for req_id, (n, hashes, _) in zip(ids, prompts):
            assert side.client.lookup(req_id, n, hashes, non_block=True) is None
        assert all(side.client.pending(r) for r in ids)
        side.step()
        got = [side.client.lookup(r, n, h, non_block=True) for r, (n, h, _) in zip(ids, prompts)]
        assert got == [want for _, _, want in prompts]
        assert side.client.stats().rpcs_total <= 2  # one step's lookups share RPCs
        n, hashes, want = prompts[2]
        assert side.client.lookup("blocking", n, hashes) == want  # sent and awaited
    finally:
        side.client.close()
    pid = side.channels[0].pid
    assert not _alive(pid) and _threads() == []


def test_reset_and_bad_input_in_the_sidecar(
    local_master: LocalMaster,
    mooncake_store: MooncakeStore,
    prompts: list[tuple[int, list[bytes], Any]],
) -> None:
    side = Sidecar(local_master, None, cache_ttl=60.0)
    try:
        n, hashes, (hit, _) = prompts[3]
        assert hit > 0
        assert side.client.lookup("a", n, hashes)[0] == hit
        assert side.client.lookup("bad", n, [b"short"] * 8, non_block=True) is None
        assert side.client.lookup("mixed", n, [hashes[0], b"x"], non_block=True) is None
        side.step()
        assert side.client.lookup("bad", n, [b"short"] * 8) == (0, ())
        mixed = _layout().plan(n, [hashes[0], b"x"])  # (sent as a list: planned as given)
        answers = mooncake_store.batch_is_exist_blocking(list(mixed.keys), 5.0)
        assert side.client.lookup("mixed", n, [hashes[0], b"x"])[0] == mixed.resolve(answers)
        assert side.client.reset() is True
        assert side.client.stats().lookups_total == 0  # a fresh coordinator
        assert side.client.lookup("b", n, hashes)[0] == hit
    finally:
        side.client.close()


def test_a_killed_sidecar_fails_its_lookups_then_the_blocking_path_answers(
    local_master: LocalMaster,
    mooncake_store: MooncakeStore,
    prompts: list[tuple[int, list[bytes], Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    side = Sidecar(local_master, mooncake_store)
    n, hashes, (hit, _) = prompts[2]
    assert hit > 0
    try:
        assert side.client.lookup("before", n, hashes, non_block=True) is None
        side.step()
        assert side.client.lookup("before", n, hashes, non_block=True)[0] == hit
        os.kill(side.channels[0].pid, signal.SIGKILL)
        assert side.client.lookup("lost", n, hashes, non_block=True) is None
        with caplog.at_level(logging.ERROR, logger="aio_mclookup.vllm"):
            started = time.monotonic()
            side.step()
            assert time.monotonic() - started < 5.0
            assert side.client.lookup("lost", n, hashes, non_block=True) == (0, ())
            # later lookups: exact, on the blocking path, even when asked not to block
            assert side.client.lookup("after", n, hashes, non_block=True)[0] == hit
        assert caplog.text.count("lookups now block the scheduler") == 1  # said once
        assert side.client.direct_rpcs == 1
    finally:
        side.client.close()
    assert not _alive(side.channels[0].pid)


def test_a_stalled_sidecar_gives_a_hit_of_zero_after_the_time_limit(
    local_master: LocalMaster, prompts: list[tuple[int, list[bytes], Any]]
) -> None:
    side = Sidecar(local_master, None, timeout=1.0)
    n, hashes, (hit, _) = prompts[2]
    pid = side.channels[0].pid
    try:
        os.kill(pid, signal.SIGSTOP)
        assert side.client.lookup("stalled", n, hashes, non_block=True) is None
        started = time.monotonic()
        side.step(timeout=10.0)
        assert 1.9 < time.monotonic() - started < 5.0  # its timeout, then the margin
        assert side.client.lookup("stalled", n, hashes, non_block=True) == (0, ())
        os.kill(pid, signal.SIGCONT)
        assert side.client.lookup("later", n, hashes)[0] == hit  # served again
    finally:
        os.kill(pid, signal.SIGCONT)
        side.client.close()


def test_a_stalled_sidecar_never_blocks_the_scheduler(
    local_master: LocalMaster, prompts: list[tuple[int, list[bytes], Any]]
) -> None:
    """Sends are queued, not waited for (a step far larger than the socket's buffer); stats,
    reset and close wait at most their bounds."""
    side = Sidecar(local_master, None, timeout=1.0)
    pid = side.channels[0].pid
    big = _hashes(b"big", 2000)
    try:
        os.kill(pid, signal.SIGSTOP)
        for i in range(100):
            assert side.client.lookup(f"big{i}", 2000 * H, big, non_block=True) is None
        started = time.monotonic()
        side.client.flush()
        side.client.wait_for_answers(0.05)
        assert time.monotonic() - started < 1.0
        started = time.monotonic()
        assert side.client.stats().lookups_total == 0  # no reply: zeros, the service lost
        assert time.monotonic() - started < 1.0 + 1.0 + 0.5  # timeout + margin
        assert side.client.lookup("big0", 2000 * H, big, non_block=True) == (0, ())
    finally:
        with contextlib.suppress(ProcessLookupError):  # (lost, hence killed)
            os.kill(pid, signal.SIGCONT)
        side.client.close()
    assert not _alive(pid)


def test_close_on_a_stopped_sidecar_is_bounded(local_master: LocalMaster) -> None:
    channel = _channel(local_master)
    os.kill(channel.pid, signal.SIGSTOP)
    started = time.monotonic()
    channel.close(1.0)
    assert time.monotonic() - started < 1.0 + 2.0 + 0.5  # its bound, then the kill's
    assert channel._process.poll() is not None


def test_nothing_starts_after_close_and_bad_hashes_fail_alone(
    local_master: LocalMaster,
    prompts: list[tuple[int, list[bytes], Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    side = Sidecar(local_master, None)
    n, hashes, want = prompts[2]
    try:
        with caplog.at_level(logging.ERROR, logger="aio_mclookup.vllm"):
            assert side.client.lookup("odd", n, [1, 2], non_block=True) == (0, ())  # type: ignore[list-item]
        assert "lookup failed for odd" in caplog.text
        views = [memoryview(h) for h in hashes[:2]] + [b"short"]  # mixed widths: sent as a list
        assert side.client.lookup("views", n, views, non_block=True) is None  # type: ignore[arg-type]
        assert side.client.lookup("good", n, hashes, non_block=True) is None
        side.step()
        assert side.client.lookup("good", n, hashes, non_block=True) == want
        assert side.client.lookup("views", n, views, non_block=True) is not None  # type: ignore[arg-type]
        assert side.client.lookup("late", n, hashes, non_block=True) is None
        side.client.discard("late")
    finally:
        side.client.close()
    side.client.flush()  # (the discard) after close: no new sidecar
    assert len(side.channels) == 1 and not _alive(side.channels[0].pid)


def test_the_sidecar_ends_when_the_scheduler_goes_away(local_master: LocalMaster) -> None:
    channel = _channel(local_master)
    pid = channel.pid
    channel._socket.close()  # what the scheduler process's exit does to its end
    deadline = time.monotonic() + 20.0
    while _alive(pid) and time.monotonic() < deadline:
        if channel._process.poll() is not None:
            break
        time.sleep(0.05)
    assert channel._process.poll() is not None, "the sidecar outlived its scheduler"


def test_an_unreachable_master_fails_the_sidecar_at_start() -> None:
    pytest.importorskip("mooncake.store")
    opts = CoordinatorOptions(**PLUGIN_DEFAULTS)
    started = time.monotonic()
    with pytest.raises(StoreError, match="could not start"):
        SidecarChannel(
            opening(
                _layout(),
                opts,
                master_address="127.0.0.1:9",
                metadata_server="http://127.0.0.1:9/metadata",
                local_hostname="127.0.0.1",
                tenant_id="default",
            ),
            60.0,
        )
    assert time.monotonic() - started < 30.0


def test_a_dead_master_never_blocks_beyond_the_timeout() -> None:
    """A real master, killed: both paths answer a hit of 0 within the lookup timeout."""
    pytest.importorskip("mooncake.store")
    master = LocalMaster(startup_timeout=30.0)
    master.start_blocking()
    store = MooncakeStore(master.master_address, master.metadata_server, rpc_timeout=1.0)
    try:
        run_once(store.open, 30.0)
        side = Sidecar(master, store, timeout=2.0)
        try:
            hashes = _hashes(b"d", 4)
            assert side.client.lookup("alive", 4 * H, hashes) == (0, ())  # the blocking path
            asyncio.run(master.kill())
            started = time.monotonic()
            assert side.client.lookup("dead", 4 * H, hashes) == (0, ())
            assert side.client.lookup("dead-async", 4 * H, hashes, non_block=True) is None
            side.step(timeout=2.0 + 1.0 + 0.5)
            assert side.client.lookup("dead-async", 4 * H, hashes, non_block=True) == (0, ())
            assert time.monotonic() - started < 2 * (2.0 + 1.0) + 0.5
        finally:
            side.client.close()
            run_once(store.aclose, 30.0)
        assert _threads() == []
    finally:
        master.stop_blocking()
