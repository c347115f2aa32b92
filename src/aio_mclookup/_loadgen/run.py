"""Runs: fill a store with a synthetic cache, then drive lookups (coordinator or seed-naive)
at each concurrency over the same request sequence; per-lookup latency is wall time around
the awaited call, planning and resolving included."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import math
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any, TextIO

from .._errors import Error, StoreError
from .._hashing import BlockHasher
from .._layout.sglang import SGLangLayout
from .._store.etcd import etcd_endpoints
from .baseline import Lookup, RawClient, naive_lookup
from .results import COORDINATOR, NAIVE, LoadgenConfig, LoadgenReport, RunResult
from .workload import (
    PageHasher,
    Request,
    Workload,
    build_workload,
    describe_hasher,
    describe_layout,
    sglang_token_note,
    workload_hasher,
)

__all__ = [
    "Progress",
    "compare_hits",
    "coordinator_run",
    "drive",
    "naive_run",
    "run_loadgen",
    "say",
]

_WRITER_SEGMENT = 256 << 20


_WRITE_CHUNK = 20_000
clock = time.perf_counter


class Progress:
    """Status lines on stderr, at most twice a second (``\\r`` rewrites on a terminal)."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = enabled and stream.isatty()
        self._last = 0.0
        self._shown = False

    def show(self, text: str, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.5:
            return
        self._last = now
        if self.tty:
            self.stream.write("\r\x1b[K" + text)
            self._shown = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self) -> None:
        if self.tty and self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False


def say(stream: TextIO, text: str) -> None:
    stream.write(text + "\n")
    stream.flush()


async def drive(
    requests: list[Request],
    lookup: Lookup,
    result: RunResult,
    cfg: LoadgenConfig,
    stop: asyncio.Event,
    progress: Progress,
) -> None:
    """Run ``cfg``'s lookups with ``result.concurrency`` workers; fill ``result``.

    A latency counts from the call, except in a burst (as many workers as lookups: they all
    arrive at once), where it counts from the run's start: a lookup issued at once but
    started only after the others' synchronous work (planning, key building) has waited for
    it all the same."""
    n = len(requests)
    total = result.planned
    burst = 0 < total <= result.concurrency
    deadline = math.inf if cfg.duration is None else time.perf_counter() + cfg.duration
    next_pos = 0
    errors = result.errors
    positions, latencies, hits = result.positions, result.latencies, result.hits
    clock = time.perf_counter

    async def worker() -> None:
        nonlocal next_pos
        while not stop.is_set():
            pos = next_pos
            if (total and pos >= total) or clock() >= deadline:
                return
            next_pos = pos + 1
            req = requests[pos % n]
            started = started_at if burst else clock()
            try:
                hit = await lookup(req)
            except Error as exc:
                label = type(exc).__name__
                if isinstance(exc, StoreError) and exc.code is not None:
                    label = f"StoreError({exc.code})"
                errors[label] = errors.get(label, 0) + 1
                continue
            latencies.append(clock() - started)
            positions.append(pos)
            hits.append(hit)
            result.prompt_tokens += req.num_tokens
            result.aligned_tokens += req.token_len

    async def report() -> None:
        label = f"{result.mode} c={result.concurrency}"
        last_done, last_t = 0, clock()
        while True:
            await asyncio.sleep(0.5)
            now = clock()
            done = len(latencies)
            rate = (done - last_done) / (now - last_t) if now > last_t else 0.0
            last_done, last_t = done, now
            of = f"/{total:,}" if total else f" ({now - started_at:.0f}/{cfg.duration:g} s)"
            progress.show(
                f"  {label}: {done:,}{of} lookups, {rate:,.0f} lookups/s, "
                f"{result.error_count} errors"
            )

    started_at = clock()
    reporter = asyncio.ensure_future(report()) if progress.enabled else None
    try:
        await asyncio.gather(*(worker() for _ in range(result.concurrency)))
    finally:
        result.elapsed = clock() - started_at
        result.interrupted = stop.is_set()
        if reporter is not None:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
        progress.clear()


async def coordinator_run(
    store: Any,
    requests: list[Request],
    cfg: LoadgenConfig,
    concurrency: int,
    stop: asyncio.Event,
    progress: Progress,
    hasher: BlockHasher | PageHasher | None = None,
) -> RunResult:
    """One coordinator run. With ``hasher`` (a token-id workload) each lookup first hashes its
    request's token ids, timed into ``result.hash_times`` and included in its latency; for
    SGLang (a :class:`PageHasher`) each lookup is ``lookup_tokens`` of the ids instead, which
    hashes the pages on the coordinator's worker thread (``result.hashed_in_lookup``)."""
    from .._coordinator.shell import LookupCoordinator

    result = RunResult(COORDINATOR, concurrency, planned(cfg, requests))
    coordinator = LookupCoordinator(
        cfg.layout,
        store,
        timeout=cfg.timeout,
        max_keys_per_rpc=cfg.max_keys_per_rpc,
        max_rpcs_in_flight=cfg.max_rpcs_in_flight,
        linger=cfg.linger,
        cache_ttl=cfg.cache_ttl,
        rounds=cfg.rounds,
    )

    lookup: Lookup
    if hasher is None:

        async def lookup(req: Request) -> int:
            return await coordinator.lookup(req.num_tokens, req.hashes)

    elif isinstance(hasher, PageHasher):
        result.hashed_in_lookup = True

        async def lookup(req: Request) -> int:
            return await coordinator.lookup_tokens(req.token_ids)

    else:
        hash_ids = hasher.hash
        hash_times = result.hash_times

        async def lookup(req: Request) -> int:
            started = clock()
            assert req.token_ids is not None
            hashes = hash_ids(req.token_ids)
            hash_times.append(clock() - started)
            return await coordinator.lookup(req.num_tokens, hashes)

    async with coordinator:
        await drive(requests, lookup, result, cfg, stop, progress)
        stats = coordinator.stats()
    result.rpcs = stats.rpcs_total
    result.rounds = stats.rounds_total
    result.keys_sent = stats.keys_sent_total
    result.keys_planned = stats.keys_planned_total
    result.cache_hits = stats.cache_hits_total
    result.dedup_hits = stats.dedup_hits_total
    return result


async def naive_run(
    raw: RawClient,
    requests: list[Request],
    cfg: LoadgenConfig,
    concurrency: int,
    stop: asyncio.Event,
    progress: Progress,
    hasher: BlockHasher | PageHasher | None = None,
) -> RunResult:
    """One seed-naive run (``hasher``: as :func:`coordinator_run`)."""
    result = RunResult(NAIVE, concurrency, planned(cfg, requests))
    lookup = naive_lookup(cfg.layout, raw, result, hasher)
    await drive(requests, lookup, result, cfg, stop, progress)
    return result


def planned(cfg: LoadgenConfig, requests: list[Request]) -> int:
    if cfg.duration is not None:
        return 0
    return cfg.requests if cfg.requests is not None else len(requests)


def compare_hits(report: LoadgenReport) -> None:
    """Every run must find the same hit for the same request position."""
    reference: dict[int, tuple[int, str]] = {}
    compared = mismatches = 0
    for run in report.runs:
        name = f"{run.mode} c={run.concurrency}"
        for pos, hit in zip(run.positions, run.hits):
            known = reference.get(pos)
            if known is None:
                reference[pos] = (hit, name)
                continue
            compared += 1
            if known[0] != hit:
                mismatches += 1
                if len(report.mismatch_examples) < 5:
                    report.mismatch_examples.append(
                        {"position": pos, known[1]: known[0], name: hit}
                    )
    report.compared = compared
    report.mismatches = mismatches


@contextlib.asynccontextmanager
async def _sigint_stops(stop: asyncio.Event, err: TextIO) -> AsyncIterator[None]:
    """First Ctrl-C: stop issuing lookups (in-flight ones finish); second: cancel."""
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    presses = 0

    def on_sigint() -> None:
        nonlocal presses
        presses += 1
        if presses == 1:
            err.write("\ninterrupted: finishing in-flight lookups (Ctrl-C again to abort)\n")
            err.flush()
            stop.set()
        elif main_task is not None:
            main_task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        installed = True
    except (NotImplementedError, RuntimeError, ValueError):
        installed = False
    try:
        yield
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


async def run_loadgen(
    cfg: LoadgenConfig, *, err: TextIO | None = None, loop_name: str = "asyncio"
) -> LoadgenReport:
    """Fill (when embedded or ``cfg.write``), then run every (concurrency, mode) pair.

    Never raises for a Ctrl-C or a store failure: what was measured is in the report, with
    ``interrupted`` / ``failure`` set.
    """
    err = err if err is not None else sys.stderr
    report = LoadgenReport(cfg, loop_name=loop_name)
    stop = asyncio.Event()
    progress = Progress(err, cfg.progress)
    started = time.perf_counter()
    try:
        async with _sigint_stops(stop, err):
            await _run(cfg, report, stop, progress, err)
    except asyncio.CancelledError:
        report.interrupted = True
        task = asyncio.current_task()
        if task is not None and hasattr(task, "uncancel"):
            task.uncancel()
    except (Error, OSError) as exc:
        report.failure = f"{type(exc).__name__}: {exc}"
    finally:
        progress.clear()
        report.interrupted = report.interrupted or stop.is_set()
        report.wall_seconds = time.perf_counter() - started
    compare_hits(report)
    return report


async def _run(
    cfg: LoadgenConfig,
    report: LoadgenReport,
    stop: asyncio.Event,
    progress: Progress,
    err: TextIO,
) -> None:
    from .._local.master import LocalMaster

    t0 = time.perf_counter()
    workload = build_workload(cfg.layout, cfg.spec)
    report.workload = workload
    report.store["workload_build_s"] = round(time.perf_counter() - t0, 3)
    say(err, f"layout: {describe_layout(cfg.layout)} ({cfg.layout_source})")
    s = workload.summary()
    say(
        err,
        f"workload: {s['requests']:,} requests from {s['sessions']:,} sessions "
        f"({s['warm_sessions']:,} warm), prompts {s['prompt_tokens_min']:,}-"
        f"{s['prompt_tokens_max']:,} tokens, built in {report.store['workload_build_s']:.2f} s",
    )
    if cfg.spec.token_ids and isinstance(cfg.layout, SGLangLayout):
        say(err, f"token ids: {sglang_token_note(cfg.layout)}")
    elif cfg.spec.token_ids:
        say(
            err,
            f"token ids: every lookup hashes its prompt first "
            f"({describe_hasher(cfg.layout)}), in its latency",
        )
    async with contextlib.AsyncExitStack() as stack:
        if cfg.master is None:
            t0 = time.perf_counter()
            master = await stack.enter_async_context(LocalMaster())
            address, metadata = master.master_address, master.metadata_server
            report.store.update(kind="embedded LocalMaster", master=address, metadata=metadata)
            report.store["master_start_s"] = round(time.perf_counter() - t0, 3)
            say(err, f"store: started a local mooncake_master on {address}")
        else:
            assert cfg.metadata is not None
            address, metadata = cfg.master, cfg.metadata
            report.store.update(kind="external", master=address, metadata=metadata)
            say(err, f"store: using the Mooncake master at {address}")
        if stop.is_set():
            return
        if cfg.embedded or cfg.write:
            await _fill(cfg, workload, address, metadata, stack, report, stop, progress, err)
        else:
            report.store["keys_written"] = 0
            say(err, "store: read-only (no keys written; pass --write to fill it)")
        if stop.is_set():
            return
        await _measure(cfg, workload, address, metadata, stack, report, stop, progress, err)


async def _fill(
    cfg: LoadgenConfig,
    workload: Workload,
    address: str,
    metadata: str,
    stack: contextlib.AsyncExitStack,
    report: LoadgenReport,
    stop: asyncio.Event,
    progress: Progress,
    err: TextIO,
) -> None:
    from .._local.writer import StoreWriter

    t0 = time.perf_counter()
    keys = workload.store_keys()
    report.store["keys_build_s"] = round(time.perf_counter() - t0, 3)
    opened = StoreWriter(
        address, metadata, segment_size=_WRITER_SEGMENT, local_hostname=cfg.local_hostname
    )
    if closes_holding_the_gil(address):  # (kept open: see closes_holding_the_gil)
        writer = await opened.__aenter__()
        LEFT_OPEN.append(writer)
    else:
        writer = await stack.enter_async_context(opened)
    t0 = time.perf_counter()
    written = 0
    for start in range(0, len(keys), _WRITE_CHUNK):
        if stop.is_set():
            break
        chunk = [k.decode() for k in keys[start : start + _WRITE_CHUNK]]
        written += await writer.put_keys(chunk)
        progress.show(f"  writing keys: {written:,}/{len(keys):,}")
    progress.clear()
    elapsed = time.perf_counter() - t0
    report.store.update(keys_written=written, fill_s=round(elapsed, 3))
    say(
        err,
        f"store: wrote {written:,} keys in {elapsed:.1f} s "
        f"({elapsed / max(written, 1) * 1e6:.1f} us/key); they live while this run's writer does",
    )


async def _measure(
    cfg: LoadgenConfig,
    workload: Workload,
    address: str,
    metadata: str,
    stack: contextlib.AsyncExitStack,
    report: LoadgenReport,
    stop: asyncio.Event,
    progress: Progress,
    err: TextIO,
) -> None:
    from .._store.mooncake import MooncakeStore

    store = await stack.enter_async_context(
        MooncakeStore(address, metadata, threads=cfg.threads, local_hostname=cfg.local_hostname)
    )
    raw: RawClient | None = None
    if cfg.compare:
        raw = RawClient(address, metadata, cfg.local_hostname)
        await asyncio.to_thread(raw.open_blocking)
        if closes_holding_the_gil(address):  # (kept open: see there)
            LEFT_OPEN.append(raw)
        else:
            stack.push_async_callback(_close_raw, raw)
    requests = workload.requests
    hasher = workload_hasher(cfg.layout) if cfg.spec.token_ids else None
    # Warm-up: one lookup each way (connections, first-call costs); not measured.
    quiet = Progress(err, False)
    await coordinator_run(store, requests[:1], _one(cfg), 1, stop, quiet, hasher)
    if raw is not None:
        await naive_run(raw, requests[:1], _one(cfg), 1, stop, quiet, hasher)
    for concurrency in cfg.concurrency:
        modes = [COORDINATOR, NAIVE] if raw is not None else [COORDINATOR]
        for mode in modes:
            if stop.is_set():
                return
            if mode == COORDINATOR:
                result = await coordinator_run(
                    store, requests, cfg, concurrency, stop, progress, hasher
                )
            else:
                assert raw is not None
                result = await naive_run(raw, requests, cfg, concurrency, stop, progress, hasher)
            report.runs.append(result)
            hashing = ""
            if result.hash_times:
                hashing = f" (hashing {result.hash_ms_median():.2f} ms of it)"
            say(
                err,
                f"  {mode:<11} c={concurrency:<4} {result.lookups:>8,} lookups "
                f"{result.rate():>10,.0f}/s  p50 {result.percentile_ms(50):.2f} ms{hashing}"
                + (f"  {result.error_count} errors" if result.errors else ""),
            )


def _one(cfg: LoadgenConfig) -> LoadgenConfig:
    return dataclasses.replace(cfg, requests=1, duration=None)


LEFT_OPEN: list[Any] = []
"""In-process clients of an ``etcd://`` master, referenced until the process ends (see
:func:`closes_holding_the_gil`)."""


def closes_holding_the_gil(address: str) -> bool:
    """Whether the wheel's in-process clients of this master hold the GIL ~30 s when they
    close, or when their last reference goes (an ``etcd://`` address; docs/mooncake.md). The
    load generator's seed-naive client and writer are then kept open in :data:`LEFT_OPEN`,
    and the CLI ends with ``os._exit`` once its output is written. (Its lookups'
    ``MooncakeStore`` runs its client in a child process, which closes at once.)"""
    return etcd_endpoints(address) is not None


async def _close_raw(raw: RawClient) -> None:
    """Close the seed-naive client once no call of it can still be running."""
    # Calls abandoned by a cancelled caller may still run on the default executor; closing the
    # client under them would crash the wheel, so let the executor drain first.
    loop = asyncio.get_running_loop()
    with contextlib.suppress(RuntimeError):
        await loop.shutdown_default_executor()
    closer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="naive-close")
    try:
        await loop.run_in_executor(closer, raw.close_blocking)
    finally:
        closer.shutdown(wait=False)
