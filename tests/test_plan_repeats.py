"""Large plans' repeated-hash test off the event loop (``_plan/_repeats_c.c``, run by the
shell's native worker when it prepares plans): the native test, run as a job, agrees with
``_rows.rows_repeat``, and lookups through the worker (or inline, on the
pure-Python path and under trio) give the plan's own results."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import select
from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aio_mclookup as mcl
from aio_mclookup._coordinator import shell
from aio_mclookup._plan import era_c, probe
from aio_mclookup._plan.era_c import EraCPlan
from aio_mclookup._rows import rows_repeat
from helpers import chain

BUILT = all(
    importlib.util.find_spec(f"aio_mclookup.{name}") is not None
    for name in ("_plan._repeats_c", "_coordinator._worker_c")
)
needs_build = pytest.mark.skipif(not BUILT, reason="the C extensions are not built")
C: Any = importlib.import_module("aio_mclookup._plan._repeats_c") if BUILT else None
W: Any = importlib.import_module("aio_mclookup._coordinator._worker_c") if BUILT else None

DSV4_LIKE = mcl.KVLayout(
    [mcl.FullAttention(256), mcl.SlidingWindow(64, sliding_window=128),
     mcl.SlidingWindow(4, sliding_window=8), mcl.SlidingWindow(8, sliding_window=128)],
    model="deepseek-ai/DeepSeek-V4-Pro", hash_block_size=4, scheduler_block_size=256,
    vllm_version="0.33.0",
)


def _run(job: object) -> None:
    """Run a native job on a native worker of its own."""
    worker = W.NativeWorker()
    try:
        worker.submit(job, 0)
        assert select.select([worker.fileno()], [], [], 10)[0], "the worker stalled"
        assert worker.collect() == [0]
    finally:
        worker.close()


def _native_verdict(rows: np.ndarray[Any, np.dtype[np.uint8]]) -> bool | None:
    """The native test's answer for ``rows``, run as a job on a native worker."""
    job = C.test_job(rows)
    _run(job)
    verdict: bool | None = C.verdict(job)
    return verdict


def _frozen(hashes: list[bytes]) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The hashes as an array nobody can write to (a view of bytes): what the router passes."""
    return np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(len(hashes), -1)


# ------------------------------------------------------------------------- the native test
@needs_build
@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.one_of(st.integers(0, 300), st.integers(513, 5000)),
       width=st.integers(0, 40),
       values=st.sampled_from([2, 4, 256]), pad=st.integers(0, 3))
def test_the_native_test_agrees_with_rows_repeat(
    data: st.DataObject, n: int, width: int, values: int, pad: int
) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    wide = rng.integers(0, values, size=(n, width + pad), dtype=np.uint8)
    rows = wide[:, :width]  # (rows apart by more than their width when padded)
    if n > 2 and data.draw(st.booleans()):
        rows[rng.integers(n)] = rows[rng.integers(n)]
    assert _native_verdict(rows) is rows_repeat(rows)
    assert C.repeats(rows) is rows_repeat(rows)  # (the same test, run inline)


@needs_build
@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(0, 3000), repeat=st.booleans(), inline=st.booleans())
def test_duplicate_ids_are_the_same_inline_in_c_and_by_the_sort(
    data: st.DataObject, n: int, repeat: bool, inline: bool
) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    rows = rng.integers(0, 256, size=(n, 32), dtype=np.uint8)
    if repeat and n > 1:
        rows[rng.integers(n)] = rows[rng.integers(n)]
    items = [bytes(r) for r in rows]
    first: dict[bytes, int] = {}
    expected = [first.setdefault(h, i) for i, h in enumerate(items)]
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(probe, "_REPEATS", C if inline else None)
        got = probe.duplicate_ids(rows, [])
    if len(set(items)) == n:
        assert got is None
    else:
        assert got is not None and got.tolist() == expected


@needs_build
def test_rows_crafted_to_collide_get_no_verdict_at_bounded_cost() -> None:
    # width 16: the mix is ((s ^ w0) * M ^ w1) * M, so w1 = (s ^ w0) * M ^ c collides for all
    s, m = 0x9E3779B97F4A7C15, 0xFF51AFD7ED558CCD
    w0 = np.arange(1, 32769, dtype=np.uint64)
    with np.errstate(over="ignore"):
        w1 = ((np.uint64(s) ^ w0) * np.uint64(m)) ^ np.uint64(12345)
    rows = np.stack([w0, w1], axis=1).view(np.uint8).reshape(32768, 16)
    assert not rows_repeat(rows)
    assert _native_verdict(rows) is None  # (gave up after a bounded probe sequence)
    assert C.repeats(rows) is None
    assert probe.duplicate_ids(rows, []) is None  # (inline gave up: the sort answers)
    rows[2000] = rows[7]
    assert probe.duplicate_ids(rows, []) is not None


@needs_build
@pytest.mark.parametrize("repeat", [False, True])
def test_rows_whose_sieve_bits_all_collide_get_the_tables_verdict(repeat: bool) -> None:
    # width 16: the sieve folds a row to (w0 ^ rotl(w1, 23)) * M, so w1 = rotr(w0 ^ c, 23)
    # folds every row alike: every row is a suspect, and the table decides
    w0 = np.arange(1, 4097, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    x = w0 ^ np.uint64(0xDEADBEEF)
    w1 = (x >> np.uint64(23)) | (x << np.uint64(41))
    rows = np.stack([w0, w1], axis=1).view(np.uint8).reshape(4096, 16)
    if repeat:
        rows[3000] = rows[11]
    assert C.repeats(rows) is repeat
    assert _native_verdict(rows) is repeat
    assert rows_repeat(rows) is repeat


@needs_build
def test_the_native_test_refuses_other_shapes() -> None:
    for bad in (np.zeros(8, dtype=np.uint8), np.zeros((2, 2), dtype=np.uint16),
                np.zeros((4, 4), dtype=np.uint8)[::-1]):
        with pytest.raises(ValueError, match="2-D array of uint8"):
            C.test_job(bad)
        with pytest.raises(ValueError, match="2-D array of uint8"):
            C.repeats(bad)


# ------------------------------------------------------------------------------ as a job
@needs_build
def test_test_jobs_on_the_worker_give_the_tests_verdicts() -> None:
    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 256, size=(int(n), 32), dtype=np.uint8)
              for n in rng.integers(0, 5000, 40)]
    for i in range(0, 40, 3):
        if len(arrays[i]) > 1:
            arrays[i][-1] = arrays[i][0]
    jobs = [C.test_job(rows) for rows in arrays]
    with pytest.raises(RuntimeError, match="not run"):
        C.verdict(jobs[0])
    worker = W.NativeWorker()
    try:
        for i, job in enumerate(jobs):
            worker.submit(job, i)
        got: set[int] = set()
        while len(got) < len(arrays):
            readable, _, _ = select.select([worker.fileno()], [], [], 10)
            assert readable, "the worker stalled"
            got.update(worker.collect())
        assert [C.verdict(job) for job in jobs] == [rows_repeat(rows) for rows in arrays]
    finally:
        assert worker.close() == []


# ------------------------------------------------------------------------ through lookups
LOOPS = ["asyncio", "trio"]


def _expected(layout: mcl.KVLayout, num_tokens: int, hashes: list[bytes],
              store: mcl.FakeStore) -> mcl.LookupResult:
    plan = layout.plan(num_tokens, hashes)
    return plan.resolve_result([1 if key in store.present else 0 for key in plan.keys])


def _recording_verdicts(monkeypatch: pytest.MonkeyPatch) -> list[bool | None]:
    """The verdict of the test job every plan is prepared with, from now on (None: no job,
    or one that could not tell)."""
    verdicts: list[bool | None] = []
    prepare = EraCPlan.prepare

    def recorded(plan: EraCPlan, job: object | None = None) -> None:
        verdicts.append(None if job is None else C.verdict(job))
        prepare(plan, job)

    monkeypatch.setattr(EraCPlan, "prepare", recorded)
    return verdicts


def _settled(coord: mcl.LookupCoordinator) -> None:
    """Nothing left reserved by admission, nor waiting for the worker."""
    admission = coord._admission
    assert admission.reserved_lookups == admission.reserved_keys == 0
    assert not coord._preparing


@pytest.mark.parametrize("backend", LOOPS)
@pytest.mark.parametrize("repeated", [False, True])
def test_large_plans_prepared_off_the_loop_give_the_plans_own_results(
    backend: str, repeated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    verdicts = _recording_verdicts(monkeypatch)
    hashes = chain(8192, b"doc")
    if repeated:  # a hash repeated far from its first place: one round, vLLM's presence
        hashes[6000] = hashes[100]
    stored = DSV4_LIKE.plan(5000 * 4, hashes[:5000]).keys
    store = mcl.FakeStore(stored)
    lengths = [8192 * 4, 7000 * 4 + 3, 5000 * 4, 3000 * 4 + 17, 26000]
    want = [_expected(DSV4_LIKE, n, hashes, store) for n in lengths]

    async def main() -> None:
        async with mcl.LookupCoordinator(DSV4_LIKE, store) as coord:
            got = []
            for n in lengths:  # (an immutable array, one lookup at a time: prepared inline)
                got.append(await coord.lookup_result(n, _frozen(hashes[: n // 4 + 5])))
            results = await asyncio.gather(*(
                coord.lookup_result(n, _frozen(hashes)) for n in lengths
            )) if backend == "asyncio" else got
            worker = coord._worker
        assert got == want
        assert list(results) == want
        if backend == "asyncio":  # trio prepares inline; so does the pure-Python path
            assert bool(worker) == (shell._WORKER is not None)
            assert coord._worker is False  # (stopped at close)
            _settled(coord)
            # every plan prepared once, with the worker's verdict (None: tested inline): one
            # at a time (nothing else under way) inline, as the first of the gathered ones;
            # the others, while it is under way, on the worker
            alone = [min(n // 4 + 5, 8192) for n in lengths]
            want_verdicts = [None for count in alone if count >= 4096] + [None] + [
                repeated for _ in lengths[1:]
            ]
            if not worker or era_c._REPEATS is None:
                want_verdicts = [None] * len(want_verdicts)
            assert sorted(verdicts, key=str) == sorted(want_verdicts, key=str)
        else:  # (trio: each plan prepares inline, when it begins)
            assert verdicts == [None] * sum(min(n // 4 + 5, 8192) >= 4096 for n in lengths)

    anyio.run(main, backend=backend)


async def test_a_lookup_given_up_while_its_hashes_are_tested_hurts_no_other() -> None:
    hashes = chain(8192, b"doc")
    store = mcl.FakeStore(DSV4_LIKE.plan(4000 * 4, hashes[:4000]).keys)
    want = _expected(DSV4_LIKE, 8192 * 4, hashes, store)
    async with mcl.LookupCoordinator(DSV4_LIKE, store) as coord:
        rows = _frozen(hashes)
        tasks = [asyncio.create_task(coord.lookup_result(8192 * 4, rows)) for _ in range(6)]
        await asyncio.sleep(0)  # (each is waiting for its test, or past it)
        tasks[0].cancel()
        tasks[3].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(done[0], asyncio.CancelledError)
        assert isinstance(done[3], asyncio.CancelledError)
        assert [done[i] for i in (1, 2, 4, 5)] == [want] * 4
        before = coord.stats().rounds_total
        assert await coord.lookup_result(8192 * 4, rows) == want
        one = coord.stats().rounds_total - before  # (the rounds of one such lookup)
        if coord._worker:  # the deadline holds while the test runs on the worker (where
            # it goes while another lookup is under way)
            before = coord.stats().rounds_total
            other = asyncio.create_task(coord.lookup_result(8192 * 4, rows))
            await asyncio.sleep(0)
            with pytest.raises(mcl.LookupTimeout):
                await coord.lookup_result(8192 * 4, rows, timeout=1e-9)
            assert await other == want
            assert coord.stats().rounds_total - before == one  # (it never began probing)
        _settled(coord)


async def test_closing_while_hashes_are_tested_fails_those_lookups_with_closed_error() -> None:
    hashes = chain(8192, b"doc")
    store = mcl.FakeStore([])
    coord = mcl.LookupCoordinator(DSV4_LIKE, store)
    async with coord:
        tasks = [asyncio.create_task(coord.lookup(8192 * 4, _frozen(hashes))) for _ in range(4)]
        await asyncio.sleep(0)
        await coord.aclose()
        done = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(d, mcl.ClosedError) for d in done), done


def test_small_or_writable_hashes_are_tested_at_once() -> None:
    hashes = chain(8192, b"doc")
    assert DSV4_LIKE.plan(8192 * 4, _frozen(hashes)).needs_preparing
    if BUILT and era_c._REPEATS is not None:
        assert DSV4_LIKE.plan(8192 * 4, _frozen(hashes)).native_job() is not None
    writable = _frozen(hashes).copy()
    assert not DSV4_LIKE.plan(8192 * 4, writable).needs_preparing  # (read now: it may change)
    assert not DSV4_LIKE.plan(8192 * 4, hashes).needs_preparing  # (a list: read now)
    assert not DSV4_LIKE.plan(1000 * 4, _frozen(hashes[:1000])).needs_preparing  # (small)
    plan = DSV4_LIKE.plan(8192 * 4, _frozen(hashes))
    plan.prepare()
    assert not plan.needs_preparing and plan.hash_ids is None
    repeated = list(hashes)
    repeated[7000] = repeated[3]
    plan = DSV4_LIKE.plan(8192 * 4, _frozen(repeated))
    plan.prepare()  # (no job: the ids are found here)
    assert plan.hash_ids is not None and plan.hash_ids[7000] == 3


async def test_admission_holds_while_plans_are_prepared() -> None:
    hashes = chain(8192, b"doc")
    store = mcl.FakeStore(DSV4_LIKE.plan(4000 * 4, hashes[:4000]).keys, delay=0.002)
    want = _expected(DSV4_LIKE, 8192 * 4, hashes, store)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(coord._core.lookups))
            await asyncio.sleep(0)

    async with mcl.LookupCoordinator(DSV4_LIKE, store, max_pending_lookups=1) as coord:
        watcher = asyncio.create_task(watch())
        rows = _frozen(hashes)
        done = await asyncio.wait_for(
            asyncio.gather(*(coord.lookup_result(8192 * 4, rows) for _ in range(4))), 30
        )
        watcher.cancel()
        _settled(coord)
    assert done == [want] * 4
    assert peak == 1


async def test_views_the_worker_does_not_read_are_prepared_inline() -> None:
    hashes = chain(8192, b"doc")
    store = mcl.FakeStore(DSV4_LIKE.plan(4000 * 4, hashes[:4000]).keys)
    reversed_rows = _frozen(hashes[::-1])[::-1]  # (the hashes in order, a negative stride)
    assert reversed_rows.strides[0] < 0
    want = _expected(DSV4_LIKE, 8192 * 4, hashes, store)
    async with mcl.LookupCoordinator(DSV4_LIKE, store) as coord:
        assert await coord.lookup_result(8192 * 4, reversed_rows) == want


@pytest.mark.parametrize("seed", range(12))
async def test_cancels_timeouts_and_closes_around_the_worker_never_hang_or_mislead(
    seed: int,
) -> None:
    rng = random.Random(seed)
    docs = [chain(8192, b"d%d" % i) for i in range(3)]
    docs[2][7000] = docs[2][10]  # (a repeat: that plan probes in one round)
    store = mcl.FakeStore(
        [key for doc in docs for key in DSV4_LIKE.plan(5000 * 4, doc[:5000]).keys], delay=0.0005
    )
    cases = [(i, n) for i in range(3) for n in (8192 * 4, 6000 * 4 + 5, 4500 * 4, 20000)]
    wants = {(i, n): _expected(DSV4_LIKE, n, docs[i], store) for i, n in cases}
    frozen = [_frozen(doc) for doc in docs]
    coord = mcl.LookupCoordinator(DSV4_LIKE, store, max_pending_lookups=rng.choice([1, 4, 64]))
    async with coord:
        picked = rng.choices(cases, k=30)
        tasks = [
            asyncio.create_task(coord.lookup_result(
                n, frozen[i], timeout=rng.choice([None, 5.0, 1e-4])
            ))
            for i, n in picked
        ]
        await asyncio.sleep(rng.random() * 0.003)
        for task in tasks:
            if rng.random() < 0.2:
                task.cancel()
        if rng.random() < 0.3:
            await coord.aclose()
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    _settled(coord)
    for case, outcome in zip(picked, done):
        if isinstance(outcome, mcl.LookupResult):
            assert outcome == wants[case]
        else:
            assert isinstance(
                outcome, (asyncio.CancelledError, mcl.LookupTimeout, mcl.ClosedError)
            ), repr(outcome)


async def test_hashes_whose_mixes_collide_are_tested_inline_after_the_worker_gives_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 32-byte rows, all different, whose multiply-xor mixes are equal (the first two words
    # cancel): the worker stops after a bounded probe sequence and the plan sorts them itself.
    s, m = 0x9E3779B97F4A7C15, 0xFF51AFD7ED558CCD
    w0 = np.arange(1, 8193, dtype=np.uint64)
    with np.errstate(over="ignore"):
        w1 = ((np.uint64(s) ^ w0) * np.uint64(m)) ^ np.uint64(99)
    words = np.zeros((8192, 4), dtype=np.uint64)
    words[:, 0], words[:, 1] = w0, w1
    rows = np.frombuffer(words.tobytes(), dtype=np.uint8).reshape(8192, 32)
    hashes = [bytes(row) for row in rows]
    store = mcl.FakeStore(DSV4_LIKE.plan(5000 * 4, hashes[:5000]).keys)
    want = _expected(DSV4_LIKE, 8192 * 4, hashes, store)
    verdicts = _recording_verdicts(monkeypatch)
    async with mcl.LookupCoordinator(DSV4_LIKE, store) as coord:
        assert await coord.lookup_result(8192 * 4, rows) == want
        _settled(coord)
    assert verdicts == [None]
    if BUILT and era_c._REPEATS is not None:
        assert _native_verdict(rows) is None



@needs_build
def test_a_jobs_verdict_of_repeats_is_not_tested_again_when_the_plan_prepares() -> None:
    if era_c._REPEATS is None:
        pytest.skip("the extensions are not loaded (AIO_MCLOOKUP_NO_EXTENSIONS)")
    hashes = chain(4096, b"verdict")
    hashes[4000] = hashes[10]  # a repeat: the job finds it, and the ids are built from that
    plan = DSV4_LIKE.plan(4096 * 4, _frozen(hashes))
    assert isinstance(plan, EraCPlan) and plan.needs_preparing
    job = plan.native_job()
    assert job is not None
    _run(job)
    tested: list[object] = []
    with pytest.MonkeyPatch.context() as monkeypatch:  # (a test run here would be recorded)
        monkeypatch.setattr(probe, "_REPEATS", SimpleNamespace(repeats=tested.append))
        monkeypatch.setattr(probe, "rows_repeat", tested.append)
        plan.prepare(job)
    assert not tested
    ids = plan.hash_ids
    assert ids is not None and ids[4000] == ids[10] == 10
