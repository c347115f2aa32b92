"""The coordinator's native worker (``_coordinator/_worker_c.c``): it runs native jobs of
any maker (``_plan/_repeats_c``'s tests, ``_hashing/_chain_c``'s page chains) off the
event loop, hands each back once, refuses what is not a fresh job, and gives back at close
the tokens of the jobs it never handed back."""

from __future__ import annotations

import importlib
import importlib.util
import select
from typing import Any

import numpy as np
import pytest

NAMES = ("_coordinator._worker_c", "_plan._repeats_c", "_hashing._chain_c")
BUILT = all(importlib.util.find_spec(f"aio_mclookup.{name}") is not None for name in NAMES)
pytestmark = pytest.mark.skipif(not BUILT, reason="the C extensions are not built")
W, R, H = (importlib.import_module(f"aio_mclookup.{name}") if BUILT else None for name in NAMES)


def _collect_all(worker: Any, count: int) -> list[Any]:
    got: list[Any] = []
    while len(got) < count:
        readable, _, _ = select.select([worker.fileno()], [], [], 10)
        assert readable, "the worker stalled"
        got += worker.collect()
    return got


def test_jobs_of_both_makers_are_run_and_handed_back_once() -> None:
    rng = np.random.default_rng(3)
    ids = [rng.integers(0, 2**32, size=64 * int(p), dtype=np.uint32).tobytes()
           for p in rng.integers(0, 80, 20)]
    rows = [rng.integers(0, 256, size=(int(n), 32), dtype=np.uint8)
            for n in rng.integers(0, 3000, 20)]
    seeds = [b"", bytes(range(32))]
    pages = [H.pages_job(seeds[i % 2], body, 256) for i, body in enumerate(ids)]
    tests = [R.test_job(r) for r in rows]
    worker = W.NativeWorker()
    try:
        for i, job in enumerate(pages):
            worker.submit(job, ("pages", i))
        for i, job in enumerate(tests):
            worker.submit(job, ("test", i))
        got = _collect_all(worker, 40)
        assert sorted(got) == sorted([("pages", i) for i in range(20)]
                                     + [("test", i) for i in range(20)])
        assert worker.collect() == []
    finally:
        assert worker.close() == []
    for i, body in enumerate(ids):
        want = H.pages(seeds[i % 2], np.frombuffer(body, dtype=np.uint32), 256)
        assert H.page_digests(pages[i]) == b"".join(want)
    for job, r in zip(tests, rows):
        assert R.verdict(job) is (bool(len(np.unique(r, axis=0)) < len(r)) if len(r) else False)


def test_what_is_not_a_fresh_job_is_refused() -> None:
    worker = W.NativeWorker()
    try:
        for bad in ("job", None, np.zeros(4)):
            with pytest.raises(ValueError):
                worker.submit(bad, "t")
        job = R.test_job(np.zeros((3, 32), dtype=np.uint8))
        worker.submit(job, "t")
        with pytest.raises(ValueError, match="already submitted"):
            worker.submit(job, "again")
        assert _collect_all(worker, 1) == ["t"]
        assert R.verdict(job) is True
        with pytest.raises(TypeError, match="not a pages job"):
            H.page_digests(job)
        with pytest.raises(TypeError, match="not a repeated-hash test job"):
            R.verdict(H.pages_job(b"", b"\0" * 8, 4))
        with pytest.raises(RuntimeError, match="not run"):
            H.page_digests(H.pages_job(b"", b"\0" * 8, 4))
        with pytest.raises(TypeError, match="bytes"):
            H.pages_job(b"", bytearray(8), 4)  # (writable: the thread reads it unlocked)
        with pytest.raises(ValueError, match="whole number"):
            H.pages_job(b"", b"\0" * 9, 4)
        with pytest.raises(ValueError, match="shorter"):
            H.pages_job(b"", b"\0" * 9, 4, 3)
        with pytest.raises(ValueError, match=">= 0"):
            H.pages_job(b"", b"\0" * 8, 4, -2)

        class Bytes(bytes):
            pass

        with pytest.raises(TypeError, match="bytes"):
            H.pages_job(b"", Bytes(8), 4)  # (a subclass may hand out another buffer)
    finally:
        assert worker.close() == []
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(R.test_job(np.zeros((2, 2), dtype=np.uint8)), "t")
    with pytest.raises(TypeError):
        W.NativeWorker(1)


def test_closing_returns_the_tokens_of_the_jobs_not_handed_back() -> None:
    big = np.random.default_rng(6).integers(0, 256, size=(200_000, 32), dtype=np.uint8)
    worker = W.NativeWorker()
    jobs = [R.test_job(big) for _ in range(20)]
    for i, job in enumerate(jobs):
        worker.submit(job, i)
    left = worker.close()
    assert sorted(left) == list(range(20))  # (none collected: all handed back here)
    assert worker.collect() == []
    del jobs, left  # (the jobs outlive the worker's hold on them, and are freed after)


def test_a_worker_dropped_with_jobs_queued_frees_them() -> None:
    body = np.arange(64 * 512, dtype=np.uint32).tobytes()
    worker = W.NativeWorker()
    for i in range(50):
        worker.submit(H.pages_job(b"", body, 256), i)
    del worker  # (joins the thread, releases every job: no crash, no hang)


def test_a_job_of_the_first_pages_reads_no_further() -> None:
    body = np.arange(64 * 10 + 7, dtype=np.uint32).tobytes()  # (10 pages and a part)
    job = H.pages_job(b"", body, 256, 6)
    worker = W.NativeWorker()
    try:
        worker.submit(job, 0)
        assert _collect_all(worker, 1) == [0]
    finally:
        worker.close()
    want = H.pages(b"", np.frombuffer(body[: 6 * 256], dtype=np.uint32), 256)
    assert H.page_digests(job) == b"".join(want)


def test_no_wake_is_lost_when_jobs_finish_while_others_are_collected() -> None:
    # (the worker writes to the pipe only for the first job done since a collect: every job
    # must still be handed back, whatever the interleaving of runs and collects)
    body = np.arange(64 * 4, dtype=np.uint32).tobytes()
    worker = W.NativeWorker()
    try:
        for round_ in range(300):
            for i in range(round_ % 4 + 1):
                worker.submit(H.pages_job(b"", body, 256), (round_, i))
            got = _collect_all(worker, round_ % 4 + 1)
            assert sorted(got) == [(round_, i) for i in range(round_ % 4 + 1)]
    finally:
        assert worker.close() == []


def test_closing_from_two_threads_at_once_returns_in_both() -> None:
    import threading

    big = np.random.default_rng(8).integers(0, 256, size=(100_000, 32), dtype=np.uint8)
    for _ in range(20):
        worker = W.NativeWorker()
        for i in range(4):
            worker.submit(R.test_job(big), i)
        left: list[list[Any]] = []

        def close(worker: Any = worker, left: list[list[Any]] = left) -> None:
            left.append(worker.close())

        threads = [threading.Thread(target=close) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert not any(thread.is_alive() for thread in threads), "a close hung"
        assert sorted(left[0] + left[1]) == [0, 1, 2, 3]  # (each token handed back once)


def test_an_ids_pages_job_holds_its_array_and_hashes_as_pages_does() -> None:
    rng = np.random.default_rng(9)
    arrays = [rng.integers(0, 2**31, size=64 * 40 + 7).astype(dtype)
              for dtype in (np.int64, np.uint64, np.int32, np.uint32) * 3]
    wants = [b"".join(H.pages(b"", a[: 64 * 40].astype("<u4").tobytes(), 256)) for a in arrays]
    jobs = [H.ids_pages_job(b"", a, 64, 40) for a in arrays]
    del arrays  # (each job holds its array's buffer until it is freed)
    worker = W.NativeWorker()
    try:
        for i, job in enumerate(jobs):
            worker.submit(job, i)
        assert sorted(_collect_all(worker, len(jobs))) == list(range(len(jobs)))
    finally:
        worker.close()
    assert [H.ids_page_digests(job) for job in jobs] == wants
