"""The synchronous scheduler's coalescing client (``_scheduler.client``): vLLM's
LookupKeyClient contract, its service on a thread over the in-process FakeStore (the sidecar
process against a real master: test_scheduler_sidecar)."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aio_mclookup import (
    CoordinatorOptions,
    FakeStore,
    FullAttention,
    InvalidRequest,
    KVLayout,
    StoreError,
)
from aio_mclookup._scheduler.channels import ThreadChannel
from aio_mclookup._scheduler.client import HEAD_START, PLUGIN_DEFAULTS, CoalescingLookupClient
from aio_mclookup._scheduler.config import (
    LOAD_WINDOW_STEPS,
    SIDECAR_MIN_CPUS,
    choose_service,
    load_window,
    store_settings,
)

H = 16


def _layout() -> KVLayout:
    return KVLayout(
        [FullAttention(H)],
        model="m",
        hash_block_size=H,
        scheduler_block_size=H,
        vllm_version="0.33.0",
    )


def _hashes(tag: bytes, n: int) -> list[bytes]:
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + tag + i.to_bytes(4, "big")).digest()
        out.append(prev)
    return out


def _result(
    hit: int, bounds: tuple[tuple[int, int], ...]
) -> tuple[int, tuple[tuple[int, int], ...]]:
    return hit, bounds


def _client(
    store: Any, *, resets: list[int] | None = None, direct: bool = False, **options: Any
) -> CoalescingLookupClient:
    async def open_store() -> Any:
        return store

    async def close_store(_store: Any) -> None:
        return None

    def reset_store() -> bool:
        if resets is not None:
            resets.append(1)
        return True

    opts = CoordinatorOptions(**{**PLUGIN_DEFAULTS, **options})
    return CoalescingLookupClient(
        _layout(),
        lambda: ThreadChannel(_layout(), open_store, close_store, opts, 10.0),
        make_result=_result,
        reset_store=reset_store,
        options=opts,
        exist_blocking=_blocking(store) if direct else None,
    )


def _blocking(store: FakeStore) -> Any:
    def exist(keys: list[bytes], timeout: float | None) -> list[int]:
        store.calls.append(list(keys))
        if store.fail_with is not None:
            raise StoreError("fake store RPC failed", code=-900)
        return [1 if k in store.present else 0 for k in keys]

    return exist


def _client_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aio-mclookup")]


@pytest.fixture
def stored() -> Iterator[tuple[FakeStore, list[bytes]]]:
    layout = _layout()
    hashes = _hashes(b"p", 8)
    plan = layout.plan(8 * H, hashes[:5])
    store = FakeStore(plan.keys)  # the first five chunks are stored
    yield store, hashes


def _poll(client: CoalescingLookupClient, req_id: str, n: int, hashes: list[bytes]) -> Any:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        out = client.lookup(req_id, n, hashes, non_block=True)
        if out is not None:
            return out
        time.sleep(0.002)
    raise AssertionError("no answer within 10 s")


def test_blocking_lookup_is_vllms_result(stored: tuple[FakeStore, list[bytes]]) -> None:
    store, hashes = stored
    client = _client(store)
    try:
        expected = (
            _layout()
            .plan(8 * H, hashes)
            .resolve_result(
                [1 if k in store.present else 0 for k in _layout().plan(8 * H, hashes).keys]
            )
        )
        got = client.lookup("r1", 8 * H, hashes)
        assert got == (expected.hit_length, tuple(tuple(b) for b in expected.tail_key_boundaries))
        assert got[0] == 5 * H
    finally:
        client.close()


@pytest.mark.parametrize("direct", [False, True], ids=["loop", "direct"])
def test_both_blocking_paths_agree(stored: tuple[FakeStore, list[bytes]], direct: bool) -> None:
    store, hashes = stored
    client = _client(store, direct=direct, failure_backoff=0.05)
    try:
        cases = [
            (8 * H, hashes),
            (8 * H - 3, hashes),
            (3 * H, hashes[:3]),
            (8 * H, _hashes(b"x", 8)),
        ]
        got = [client.lookup(f"r{i}", n, h) for i, (n, h) in enumerate(cases)]
        assert got == [
            (5 * H, ((0, 5 * H),)),
            (5 * H, ((0, 5 * H),)),
            (2 * H, ((0, 2 * H),)),
            (0, ()),
        ]
        assert (client.stats().rpcs_total == 0) is direct  # the direct path skips the loop
        assert client.direct_rpcs == (4 if direct else 0)
        store.fail_with = -900
        assert client.lookup("failing", 8 * H, hashes) == (0, ())
    finally:
        client.close()


def test_non_blocking_lookups_of_a_step_start_together(
    stored: tuple[FakeStore, list[bytes]],
) -> None:
    store, hashes = stored
    client = _client(store)
    try:
        ids = [f"r{i}" for i in range(40)]
        assert all(client.lookup(r, 8 * H, hashes, non_block=True) is None for r in ids)
        assert store.calls == []  # nothing starts before the step ends
        assert client.pending("r0") and not client.pending("unknown")
        client.flush()
        results = [_poll(client, r, 8 * H, hashes) for r in ids]
        assert {r[0] for r in results} == {5 * H}
        assert not client.pending("r0")  # answered and forgotten
        assert len(store.calls) < 5  # 40 lookups, a handful of shared RPCs
    finally:
        client.close()


def test_an_idle_step_waits_for_an_answer_but_not_beyond_its_bound(
    stored: tuple[FakeStore, list[bytes]],
) -> None:
    store, hashes = stored
    client = _client(store)
    try:
        started = time.monotonic()
        client.wait_for_answers(5.0)  # nothing pending: at once
        assert time.monotonic() - started < 1.0
        store.delay = 0.3
        assert client.lookup("slow", 8 * H, hashes, non_block=True) is None
        client.flush()
        started = time.monotonic()
        client.wait_for_answers(0.05)  # pending, not answered within the bound
        assert 0.04 < time.monotonic() - started < 0.25
        client.wait_for_answers(5.0)  # returns when the answer is in, long before 5 s
        assert time.monotonic() - started < 2.0
        assert client.lookup("slow", 8 * H, hashes, non_block=True) == (5 * H, ((0, 5 * H),))
    finally:
        client.close()


def test_a_bursts_first_lookups_go_ahead_of_the_rest(
    stored: tuple[FakeStore, list[bytes]],
) -> None:
    store, hashes = stored
    store.delay = 0.05
    client = _client(store)
    try:
        ids = [f"r{i}" for i in range(HEAD_START + 30)]
        assert all(client.lookup(r, 8 * H, hashes, non_block=True) is None for r in ids)
        client.flush()  # nothing out: the first HEAD_START go now
        assert len(client._sent) == HEAD_START and len(client._unsent) == 30
        client.flush()  # some out: the rest go together
        assert len(client._sent) == HEAD_START + 30 and not client._unsent
        results = [_poll(client, r, 8 * H, hashes) for r in ids]
        assert {r[0] for r in results} == {5 * H}
        # a blocking lookup never waits behind the head start
        more = [f"b{i}" for i in range(HEAD_START + 1)]
        assert all(client.lookup(r, 8 * H, hashes, non_block=True) is None for r in more)
        assert client.lookup(more[-1], 8 * H, hashes)[0] == 5 * H
    finally:
        client.close()


def test_the_first_poll_of_a_step_takes_in_answers_that_came_meanwhile(
    stored: tuple[FakeStore, list[bytes]],
) -> None:
    store, hashes = stored
    client = _client(store)
    try:
        assert client.lookup("a", 8 * H, hashes, non_block=True) is None
        assert client.lookup("b", 8 * H, hashes, non_block=True) is None
        client.flush()  # the step ends; the model runs meanwhile and the answers come in
        deadline = time.monotonic() + 10
        while not client._channel._replies and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.002)
        # the next step's first poll finds "a" answered: scheduled now, not a step later
        assert client.pending("a") is False
        assert client.pending("b") is False  # (taken in by the same poll)
        assert client.lookup("a", 8 * H, hashes, non_block=True) == (5 * H, ((0, 5 * H),))
    finally:
        client.close()


def test_stats_nowait_never_waits_and_follows_the_coordinator(
    stored: tuple[FakeStore, list[bytes]],
) -> None:
    store, hashes = stored
    client = _client(store)
    try:
        assert client.stats_nowait() is None  # asks; nothing came yet
        assert _poll(client, "r", 8 * H, hashes)[0] == 5 * H
        deadline = time.monotonic() + 10
        snapshot = None
        while time.monotonic() < deadline:
            started = time.monotonic()
            snapshot = client.stats_nowait(every=0.0)
            assert time.monotonic() - started < 0.1
            if snapshot is not None and snapshot.lookups_total:
                break
            time.sleep(0.005)
        assert snapshot is not None and snapshot.lookups_total == 1
        assert snapshot.rpcs_total == len(store.calls)
    finally:
        client.close()


def test_the_service_is_chosen_by_the_cpus_unless_set() -> None:
    assert choose_service({}, cpus=2) == (
        "thread",
        f"auto: 2 CPUs, the sidecar from {SIDECAR_MIN_CPUS}",
    )
    assert choose_service({}, cpus=SIDECAR_MIN_CPUS)[0] == "sidecar"
    assert choose_service({"aio_mclookup_service": "sidecar"}, cpus=1)[0] == "sidecar"
    assert choose_service({"aio_mclookup_service": "thread"}, cpus=64)[0] == "thread"
    assert choose_service({})[0] in ("thread", "sidecar")  # (this process's affinity)
    with pytest.raises(InvalidRequest, match="aio_mclookup_service"):
        choose_service({"aio_mclookup_service": "process"})


def test_the_load_window_is_steps_of_the_token_budget() -> None:
    assert load_window({}, 4096) == int(LOAD_WINDOW_STEPS * 4096)
    assert load_window({"aio_mclookup_load_window": 0.5}, 4096) == 2048
    assert load_window({"aio_mclookup_load_window": 0}, 4096) == 0  # (pacing off)
    assert load_window({"aio_mclookup_load_window": 1e-9}, 4096) == 1  # (on: at least 1)
    assert load_window({"aio_mclookup_load_window": 1e6}, 4096) == 4096 * 10**6
    for bad in (-1, "2", None, True, float("nan"), float("inf"), 1e300):
        with pytest.raises(InvalidRequest, match="aio_mclookup_load_window"):
            load_window({"aio_mclookup_load_window": bad}, 4096)


def test_answered_says_an_answer_waits_to_be_collected(
    stored: tuple[FakeStore, list[bytes]],
) -> None:
    store, hashes = stored
    client = _client(store)
    try:
        assert not client.answered("r")  # (never asked)
        assert client.lookup("r", 8 * H, hashes, non_block=True) is None
        client.flush()
        assert client.wait_for_answers(5.0)
        while client.pending("r"):
            client.wait_for_answers(0.05)
        assert client.answered("r")
        assert client.lookup("r", 8 * H, hashes, non_block=True)[0] == 5 * H
        assert not client.answered("r")  # (collected)
    finally:
        client.close()


def _answer_in(client: CoalescingLookupClient, req_id: str) -> None:
    deadline = time.monotonic() + 10
    while not client.answered(req_id):
        assert time.monotonic() < deadline, "no answer within 10 s"
        client.wait_for_answers(0.05)


def test_refresh_asks_again_what_was_held_and_keeps_the_old_answer_meanwhile(
    stored: tuple[FakeStore, list[bytes]],
) -> None:
    store, hashes = stored
    client = _client(store)
    try:
        assert client.lookup("r", 8 * H, hashes, non_block=True) is None
        client.flush()
        _answer_in(client, "r")
        assert client.refresh(60.0) == 0  # (not that old)
        store.add(_layout().plan(8 * H, hashes[:7]).keys)  # the store changes meanwhile
        assert client.refresh(0.0) == 1  # asked again at the next flush
        assert client.answered("r") and not client.pending("r")  # (the old answer stays)
        client.flush()
        deadline = time.monotonic() + 10
        while client._answered_at.get(client._tickets["r"]) is None:  # the new one is in
            assert time.monotonic() < deadline, "no refreshed answer within 10 s"
            client.wait_for_answers(0.05)
        assert client.lookup("r", 8 * H, hashes, non_block=True)[0] == 7 * H  # the fresh one
        assert not client.answered("r") and client.refresh(0.0) == 0
    finally:
        client.close()


def test_an_answer_collected_while_its_refresh_is_out_cancels_it(
    stored: tuple[FakeStore, list[bytes]],
) -> None:
    store, hashes = stored
    client = _client(store)
    try:
        assert client.lookup("r", 8 * H, hashes, non_block=True) is None
        client.flush()
        _answer_in(client, "r")
        assert client.refresh(0.0) == 1
        assert client.lookup("r", 8 * H, hashes, non_block=True)[0] == 5 * H  # the old one
        assert client._unsent == [] and client._asked == {}  # (the refresh was dropped)
        client.flush()
        client.wait_for_answers(0.1)
        assert not client.answered("r") and client._answers == {}
    finally:
        client.close()


def test_a_second_poll_starts_an_unflushed_lookup(stored: tuple[FakeStore, list[bytes]]) -> None:
    store, hashes = stored
    client = _client(store)
    try:
        assert client.lookup("r", 8 * H, hashes, non_block=True) is None
        assert _poll(client, "r", 8 * H, hashes)[0] == 5 * H  # no flush: the poll starts it
    finally:
        client.close()


def test_the_result_is_given_once_then_forgotten(stored: tuple[FakeStore, list[bytes]]) -> None:
    store, hashes = stored
    client = _client(store)
    try:
        client.lookup("r", 8 * H, hashes)
        calls = len(store.calls)
        store.present.clear()
        assert client.lookup("r", 8 * H, hashes)[0] == 0  # a new lookup, not the old answer
        assert len(store.calls) > calls
    finally:
        client.close()


def test_discard_before_the_step_ends_sends_nothing(
    stored: tuple[FakeStore, list[bytes]],
) -> None:
    store, hashes = stored
    client = _client(store)
    try:
        assert client.lookup("gone", 8 * H, hashes, non_block=True) is None
        client.discard("gone")
        client.flush()
        client.lookup("other", 8 * H, _hashes(b"q", 3))
        assert all(k not in store.present for batch in store.calls for k in batch)
    finally:
        client.close()


def test_a_store_error_gives_a_hit_of_zero_logged(
    stored: tuple[FakeStore, list[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    store, hashes = stored
    store.fail_with = -900
    client = _client(store, failure_backoff=0.05)
    try:
        with caplog.at_level(logging.ERROR, logger="aio_mclookup.vllm"):
            assert client.lookup("r", 8 * H, hashes) == (0, ())
        assert "lookup failed for r" in caplog.text
        store.fail_with = None
        time.sleep(0.1)  # past the coordinator's fail-fast back-off
        assert client.lookup("r2", 8 * H, hashes)[0] == 5 * H  # the next lookup is unaffected
    finally:
        client.close()


def test_bad_input_fails_only_its_own_lookup(stored: tuple[FakeStore, list[bytes]]) -> None:
    store, hashes = stored
    client = _client(store)
    try:
        assert client.lookup("bad", 8 * H, [b"short"] * 8, non_block=True) is None
        assert client.lookup("good", 8 * H, hashes, non_block=True) is None
        client.flush()
        assert _poll(client, "bad", 8 * H, hashes) == (0, ())
        assert _poll(client, "good", 8 * H, hashes)[0] == 5 * H
    finally:
        client.close()


def test_reset_wipes_what_the_coordinator_learned(stored: tuple[FakeStore, list[bytes]]) -> None:
    store, hashes = stored
    resets: list[int] = []
    client = _client(store, resets=resets, cache_ttl=60.0)
    try:
        assert client.lookup("a", 8 * H, hashes)[0] == 5 * H
        store.present.clear()  # what vLLM's reset does to the store (remove_all)
        assert client.reset() is True and resets == [1]
        assert client.lookup("b", 8 * H, hashes)[0] == 0  # the positive cache did not survive
    finally:
        client.close()


def test_close_leaves_no_thread_and_answers_zero_after(
    stored: tuple[FakeStore, list[bytes]],
) -> None:
    store, hashes = stored
    client = _client(store)
    assert _client_threads() == ["aio-mclookup-vllm"]
    assert client.lookup("pending", 8 * H, hashes, non_block=True) is None
    client.close()
    assert _client_threads() == []
    assert client.lookup("late", 8 * H, hashes) == (0, ())
    client.close()  # idempotent


def test_options_from_the_extra_config() -> None:
    assert CoalescingLookupClient.options_from({}).timeout == PLUGIN_DEFAULTS["timeout"]
    assert CoalescingLookupClient.options_from({}).cache_ttl is None
    opts = CoalescingLookupClient.options_from({"aio_mclookup": {"cache_ttl": 2.0}})
    assert opts.cache_ttl == 2.0
    with pytest.raises(InvalidRequest, match="unknown option") as info:
        CoalescingLookupClient.options_from({"aio_mclookup": {"cache_tll": 2.0}})
    assert info.value.field == "aio_mclookup"
    with pytest.raises(InvalidRequest, match="must be a mapping"):
        CoalescingLookupClient.options_from({"aio_mclookup": 3})


def test_store_settings_read_the_workers_config(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps(
            {
                "master_server_address": "127.0.0.1:1",
                "metadata_server": "http://x/metadata",
                "tenant_id": "  team-a ",
            }
        )
    )
    settings = store_settings({"MOONCAKE_CONFIG_PATH": str(path)})
    assert (settings.master_address, settings.tenant_id) == ("127.0.0.1:1", "team-a")
    path.write_text(
        json.dumps({"master_server_address": "m:1", "metadata_server": "x", "tenant_id": None})
    )
    assert store_settings({"MOONCAKE_CONFIG_PATH": str(path)}).tenant_id == "default"
    with pytest.raises(InvalidRequest, match="not set"):
        store_settings({})
    path.write_text("{")
    with pytest.raises(InvalidRequest, match="cannot be read"):
        store_settings({"MOONCAKE_CONFIG_PATH": str(path)})
    path.write_text(json.dumps({"metadata_server": "x"}))
    with pytest.raises(InvalidRequest) as info:
        store_settings({"MOONCAKE_CONFIG_PATH": str(path)})
    assert info.value.field == "master_server_address"
