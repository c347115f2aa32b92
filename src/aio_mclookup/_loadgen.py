"""The load generator: fill a store with a synthetic cache, then measure lookups against it.

Each *run* is one way of looking up (``coordinator``: a fresh :class:`LookupCoordinator`;
``seed-naive``: vLLM 0.26's per-request loop, one ``batch_is_exist`` per request through the
loop's default executor, as Mooncake's own async wrapper does) at one concurrency, over the
same request sequence. Per-lookup latency is wall time around the awaited call, planning and
resolving included.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import platform
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from ._errors import Error, StoreError
from ._layout.layout import KVLayout
from ._store.codes import failed_rpc_code
from ._store.pool import client_config
from ._workload import Request, Workload, WorkloadSpec, build_workload, describe_layout

__all__ = ["LoadgenConfig", "LoadgenReport", "RunResult", "run_loadgen"]

COORDINATOR = "coordinator"
NAIVE = "seed-naive"

_WRITER_SEGMENT = 256 << 20
_WRITE_CHUNK = 20_000


@dataclass
class LoadgenConfig:
    """Everything one ``aio-mclookup loadgen`` invocation needs (already validated)."""

    layout: KVLayout
    layout_source: str
    spec: WorkloadSpec
    requests: int | None = None
    """Lookups per run (cycling over the workload's requests); None: each request once."""
    duration: float | None = None
    """Seconds per run instead of a request count."""
    concurrency: tuple[int, ...] = (1, 16, 64, 256)
    compare: bool = True
    master: str | None = None
    metadata: str | None = None
    write: bool = False
    local_hostname: str = "127.0.0.1"
    progress: bool = False
    timeout: float | None = None
    threads: int = 4
    max_keys_per_rpc: int = 1000
    max_rpcs_in_flight: int = 2
    cache_ttl: float | None = 5.0
    rounds: bool = True
    linger: float = 0.0

    @property
    def embedded(self) -> bool:
        return self.master is None


@dataclass
class RunResult:
    """What one run measured."""

    mode: str
    concurrency: int
    planned: int
    """Lookups the run was to issue (0 for a duration run)."""
    elapsed: float = 0.0
    positions: list[int] = field(default_factory=list)
    """Position in the request sequence of every successful lookup."""
    latencies: list[float] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    rpcs: int = 0
    keys_sent: int = 0
    keys_planned: int = 0
    cache_hits: int = 0
    dedup_hits: int = 0
    prompt_tokens: int = 0
    aligned_tokens: int = 0
    interrupted: bool = False

    @property
    def lookups(self) -> int:
        return len(self.latencies)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def hit_tokens(self) -> int:
        return sum(self.hits)

    def rate(self) -> float:
        return self.lookups / self.elapsed if self.elapsed > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        if not self.latencies:
            return math.nan
        return float(np.percentile(np.asarray(self.latencies), q)) * 1e3

    def to_dict(self) -> dict[str, Any]:
        n = self.lookups
        lat = np.asarray(self.latencies) * 1e3
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "lookups": n,
            "errors": self.error_count,
            "errors_by_type": dict(self.errors),
            "elapsed_s": round(self.elapsed, 6),
            "lookups_per_s": round(self.rate(), 3),
            "latency_ms": {
                "p50": _r(self.percentile_ms(50)),
                "p95": _r(self.percentile_ms(95)),
                "p99": _r(self.percentile_ms(99)),
                "mean": _r(float(lat.mean())) if n else None,
                "max": _r(float(lat.max())) if n else None,
            },
            "rpcs": self.rpcs,
            "keys_sent": self.keys_sent,
            "keys_planned": self.keys_planned,
            "cache_hits": self.cache_hits,
            "dedup_hits": self.dedup_hits,
            "rpcs_per_lookup": _r(self.rpcs / n) if n else None,
            "keys_per_lookup": _r(self.keys_sent / n) if n else None,
            "hit_tokens": self.hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "aligned_tokens": self.aligned_tokens,
            "hit_ratio": _r(self.hit_tokens / self.prompt_tokens) if self.prompt_tokens else None,
            "interrupted": self.interrupted,
        }


def _r(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


@dataclass
class LoadgenReport:
    """The whole invocation: setup facts, every run, the hit comparison."""

    config: LoadgenConfig
    workload: Workload | None = None
    runs: list[RunResult] = field(default_factory=list)
    store: dict[str, Any] = field(default_factory=dict)
    compared: int = 0
    mismatches: int = 0
    mismatch_examples: list[dict[str, Any]] = field(default_factory=list)
    interrupted: bool = False
    failure: str | None = None
    loop_name: str = "asyncio"
    wall_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        cfg = self.config
        workload: dict[str, Any] = {"spec": cfg.spec.to_dict()}
        if self.workload is not None:
            workload.update(self.workload.summary())
        return {
            "tool": "aio-mclookup loadgen",
            "version": _version(),
            "layout_source": cfg.layout_source,
            "layout": cfg.layout.to_dict(),
            "alignment": (
                "each request's num_tokens is aligned with layout.align(num_tokens) (floored to "
                f"the {cfg.layout.scheduler_block_size}-token scheduler block, as vLLM's "
                "scheduler does) before the lookup"
            ),
            "workload": workload,
            "requests_per_run": (
                None
                if cfg.duration is not None
                else cfg.requests
                if cfg.requests is not None
                else len(self.workload.requests)
                if self.workload is not None
                else None
            ),
            "duration_per_run_s": cfg.duration,
            "concurrency": list(cfg.concurrency),
            "compare": cfg.compare,
            "coordinator_options": {
                "max_keys_per_rpc": cfg.max_keys_per_rpc,
                "max_rpcs_in_flight": cfg.max_rpcs_in_flight,
                "cache_ttl": cfg.cache_ttl,
                "rounds": cfg.rounds,
                "linger": cfg.linger,
                "timeout": cfg.timeout,
                "store_threads": cfg.threads,
            },
            "store": self.store,
            "runs": [r.to_dict() for r in self.runs],
            "hits_check": {
                "compared": self.compared,
                "mismatches": self.mismatches,
                "equal": self.mismatches == 0,
                "examples": self.mismatch_examples,
            },
            "interrupted": self.interrupted,
            "failure": self.failure,
            "wall_seconds": round(self.wall_seconds, 3),
            "environment": {
                "python": platform.python_version(),
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "event_loop": self.loop_name,
            },
        }


def _version() -> str:
    from . import __version__

    return __version__


# ------------------------------------------------------------------------------- progress
class _Progress:
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


def _say(stream: TextIO, text: str) -> None:
    stream.write(text + "\n")
    stream.flush()


# -------------------------------------------------------------------------- seed-naive client
class _RawClient:
    """A plain ``MooncakeDistributedStore`` used exactly as Mooncake's async wrapper uses it:
    ``await loop.run_in_executor(None, client.batch_is_exist, keys)``."""

    def __init__(self, master: str, metadata: str, local_hostname: str) -> None:
        self.config = client_config(master, metadata, local_hostname)
        self.client: Any = None

    def open_blocking(self) -> None:
        from mooncake.store import MooncakeDistributedStore

        os.environ.setdefault("MC_TCP_BIND_ADDRESS", str(self.config["local_hostname"]))
        client = MooncakeDistributedStore()
        rc = client.setup(dict(self.config))
        if rc != 0:
            with contextlib.suppress(Exception):
                client.close()
            raise StoreError(f"Mooncake setup() for the seed-naive client returned {rc}", rc)
        self.client = client

    def close_blocking(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()


# ------------------------------------------------------------------------------------ runs
Lookup = Callable[[Request], Awaitable[int]]


async def _drive(
    requests: list[Request],
    lookup: Lookup,
    result: RunResult,
    cfg: LoadgenConfig,
    stop: asyncio.Event,
    progress: _Progress,
) -> None:
    """Run ``cfg``'s lookups with ``result.concurrency`` workers; fill ``result``."""
    n = len(requests)
    total = result.planned
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
            started = clock()
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


async def _coordinator_run(
    store: Any,
    requests: list[Request],
    cfg: LoadgenConfig,
    concurrency: int,
    stop: asyncio.Event,
    progress: _Progress,
) -> RunResult:
    from ._coordinator.shell import LookupCoordinator

    result = RunResult(COORDINATOR, concurrency, _planned(cfg, requests))
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

    async def lookup(req: Request) -> int:
        return await coordinator.lookup(req.token_len, req.hashes)

    async with coordinator:
        await _drive(requests, lookup, result, cfg, stop, progress)
        stats = coordinator.stats()
    result.rpcs = stats.rpcs_total
    result.keys_sent = stats.keys_sent_total
    result.keys_planned = stats.keys_planned_total
    result.cache_hits = stats.cache_hits_total
    result.dedup_hits = stats.dedup_hits_total
    return result


def _naive_lookup(layout: KVLayout, raw: _RawClient, result: RunResult) -> Lookup:
    """vLLM 0.26's per-request lookup: build keys, one executor-hopped RPC, resolve."""
    from ._reference.v026 import BaselineLookup

    baseline = BaselineLookup(layout.to_dict())
    client = raw.client
    loop = asyncio.get_running_loop()

    async def lookup(req: Request) -> int:
        keys, meta = baseline.build_keys(req.token_len, req.hash_list)
        result.keys_planned += len(keys)
        if not keys:
            return 0
        result.rpcs += 1
        result.keys_sent += len(keys)
        answers: list[int] = await loop.run_in_executor(None, client.batch_is_exist, keys)
        code = failed_rpc_code(answers)
        if code is not None:
            raise StoreError(f"batch_is_exist failed with code {code}", code=code)
        return baseline.resolve(req.token_len, req.hash_list, meta, answers)

    return lookup


async def _naive_run(
    raw: _RawClient,
    requests: list[Request],
    cfg: LoadgenConfig,
    concurrency: int,
    stop: asyncio.Event,
    progress: _Progress,
) -> RunResult:
    result = RunResult(NAIVE, concurrency, _planned(cfg, requests))
    lookup = _naive_lookup(cfg.layout, raw, result)
    await _drive(requests, lookup, result, cfg, stop, progress)
    return result


def _planned(cfg: LoadgenConfig, requests: list[Request]) -> int:
    if cfg.duration is not None:
        return 0
    return cfg.requests if cfg.requests is not None else len(requests)


# ---------------------------------------------------------------------------------- checks
def _compare_hits(report: LoadgenReport) -> None:
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


# ---------------------------------------------------------------------------------- runner
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
    progress = _Progress(err, cfg.progress)
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
    _compare_hits(report)
    return report


async def _run(
    cfg: LoadgenConfig,
    report: LoadgenReport,
    stop: asyncio.Event,
    progress: _Progress,
    err: TextIO,
) -> None:
    from ._local.master import LocalMaster

    t0 = time.perf_counter()
    workload = build_workload(cfg.layout, cfg.spec)
    report.workload = workload
    report.store["workload_build_s"] = round(time.perf_counter() - t0, 3)
    _say(err, f"layout: {describe_layout(cfg.layout)} ({cfg.layout_source})")
    s = workload.summary()
    _say(
        err,
        f"workload: {s['requests']:,} requests from {s['sessions']:,} sessions "
        f"({s['warm_sessions']:,} warm), prompts {s['prompt_tokens_min']:,}-"
        f"{s['prompt_tokens_max']:,} tokens, built in {report.store['workload_build_s']:.2f} s",
    )
    async with contextlib.AsyncExitStack() as stack:
        if cfg.master is None:
            t0 = time.perf_counter()
            master = await stack.enter_async_context(LocalMaster())
            address, metadata = master.master_address, master.metadata_server
            report.store.update(kind="embedded LocalMaster", master=address, metadata=metadata)
            report.store["master_start_s"] = round(time.perf_counter() - t0, 3)
            _say(err, f"store: started a local mooncake_master on {address}")
        else:
            assert cfg.metadata is not None
            address, metadata = cfg.master, cfg.metadata
            report.store.update(kind="external", master=address, metadata=metadata)
            _say(err, f"store: using the Mooncake master at {address}")
        if stop.is_set():
            return
        if cfg.embedded or cfg.write:
            await _fill(cfg, workload, address, metadata, stack, report, stop, progress, err)
        else:
            report.store["keys_written"] = 0
            _say(err, "store: read-only (no keys written; pass --write to fill it)")
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
    progress: _Progress,
    err: TextIO,
) -> None:
    from ._local.writer import StoreWriter

    t0 = time.perf_counter()
    keys = workload.store_keys()
    report.store["keys_build_s"] = round(time.perf_counter() - t0, 3)
    writer = await stack.enter_async_context(
        StoreWriter(
            address,
            metadata,
            segment_size=_WRITER_SEGMENT,
            local_hostname=cfg.local_hostname,
        )
    )
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
    _say(
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
    progress: _Progress,
    err: TextIO,
) -> None:
    from ._store.mooncake import MooncakeStore

    store = await stack.enter_async_context(
        MooncakeStore(address, metadata, threads=cfg.threads, local_hostname=cfg.local_hostname)
    )
    raw: _RawClient | None = None
    if cfg.compare:
        raw = _RawClient(address, metadata, cfg.local_hostname)
        await asyncio.to_thread(raw.open_blocking)
        stack.push_async_callback(_close_raw, raw)
    requests = workload.requests
    # Warm-up: one lookup each way (connections, first-call costs); not measured.
    await _coordinator_run(store, requests[:1], _one(cfg), 1, stop, _Progress(err, False))
    if raw is not None:
        await _naive_run(raw, requests[:1], _one(cfg), 1, stop, _Progress(err, False))
    for concurrency in cfg.concurrency:
        modes = [COORDINATOR, NAIVE] if raw is not None else [COORDINATOR]
        for mode in modes:
            if stop.is_set():
                return
            if mode == COORDINATOR:
                result = await _coordinator_run(store, requests, cfg, concurrency, stop, progress)
            else:
                assert raw is not None
                result = await _naive_run(raw, requests, cfg, concurrency, stop, progress)
            report.runs.append(result)
            _say(
                err,
                f"  {mode:<11} c={concurrency:<4} {result.lookups:>8,} lookups "
                f"{result.rate():>10,.0f}/s  p50 {result.percentile_ms(50):.2f} ms"
                + (f"  {result.error_count} errors" if result.errors else ""),
            )


def _one(cfg: LoadgenConfig) -> LoadgenConfig:
    return dataclasses.replace(cfg, requests=1, duration=None)


async def _close_raw(raw: _RawClient) -> None:
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


# ---------------------------------------------------------------------------------- output
def format_summary(report: LoadgenReport) -> str:
    """The human summary: setup lines, one table row per run, savings, the hit check."""
    cfg = report.config
    lines: list[str] = []
    lines.append(f"aio-mclookup loadgen  layout: {describe_layout(cfg.layout)}")
    wl = report.workload
    if wl is not None:
        s = wl.summary()
        spec = cfg.spec
        lines.append(
            f"workload: {s['requests']:,} distinct requests, one per chat session caught at a "
            f"random turn (of up to {spec.turns}); {spec.system_prompts} shared system prompts; "
            f"{s['warm_sessions']:,} warm sessions whose earlier turns are stored (hit ratio "
            f"{spec.hit_ratio:g}); seed {spec.seed}"
        )
        lines.append(
            f"          prompts {s['prompt_tokens_min']:,}-{s['prompt_tokens_max']:,} tokens "
            f"(mean {s['prompt_tokens_mean']:,.0f}); each lookup uses "
            f"token_len = layout.align(num_tokens), floored to the "
            f"{cfg.layout.scheduler_block_size}-token scheduler block as vLLM's scheduler does"
        )
    st = report.store
    if st:
        where = f"{st.get('kind', '?')} {st.get('master', '')}".strip()
        written = st.get("keys_written")
        fill = f", {written:,} keys written in {st.get('fill_s', 0):.1f} s" if written else ""
        lines.append(f"store: {where}{fill}")
    per_run = (
        f"{cfg.requests:,} lookups per run"
        if cfg.requests is not None
        else f"{cfg.duration:g} s per run"
        if cfg.duration is not None
        else "each request once per run"
    )
    if wl is not None and cfg.requests is not None and cfg.requests > len(wl.requests):
        per_run += f" (the {len(wl.requests):,} distinct requests repeat)"
    elif wl is not None and cfg.duration is not None:
        per_run += f" (cycling over the {len(wl.requests):,} distinct requests)"
    lines.append(f"runs: {per_run}; event loop {report.loop_name}; {os.cpu_count()} CPUs")
    lines.append("")
    header = (
        f"{'mode':<11} {'conc':>5} {'lookups':>8} {'errors':>6} {'lookups/s':>10} "
        f"{'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'RPCs/lookup':>11} {'keys/lookup':>11} "
        f"{'hit/prompt tokens':>17}"
    )
    if report.runs:
        lines.append(header)
        lines.append("-" * len(header))
    else:
        lines.append("nothing was measured")
    for run in report.runs:
        n = run.lookups
        ratio = f"{run.hit_tokens / run.prompt_tokens:.1%}" if run.prompt_tokens else "-"
        lines.append(
            f"{run.mode:<11} {run.concurrency:>5} {n:>8,} {run.error_count:>6} "
            f"{run.rate():>10,.0f} {_ms(run.percentile_ms(50))} {_ms(run.percentile_ms(95))} "
            f"{_ms(run.percentile_ms(99))} {_per(run.rpcs, n, 11, 3)} "
            f"{_per(run.keys_sent, n, 11, 1)} "
            f"{ratio:>17}" + ("  (interrupted)" if run.interrupted else "")
        )
    savings = _savings(report)
    if savings:
        lines.append("")
        lines.extend(savings)
    lines.append("")
    if report.compared:
        what = (
            "coordinator and seed-naive runs"
            if cfg.compare and any(r.mode == NAIVE for r in report.runs)
            else "all runs"
        )
        if report.mismatches:
            lines.append(
                f"hits: MISMATCH in {report.mismatches:,} of {report.compared:,} compared lookups "
                f"across {what}; first: {report.mismatch_examples[:2]}"
            )
        else:
            lines.append(
                f"hits: identical across {what} ({report.compared:,} lookups compared "
                "request by request)"
            )
    elif report.runs:
        lines.append("hits: nothing to compare (one run only)")
    if report.interrupted:
        lines.append("interrupted: the table shows what was measured before Ctrl-C")
    if report.failure:
        lines.append(f"FAILED: {report.failure}")
    lines.append(f"wall time: {report.wall_seconds:.1f} s")
    return "\n".join(lines)


def _ms(value: float) -> str:
    return f"{'-':>7}" if math.isnan(value) else f"{value:>7.2f}"


def _per(total: int, n: int, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if not n else f"{total / n:>{width}.{digits}f}"


def _savings(report: LoadgenReport) -> list[str]:
    out: list[str] = []
    by_key = {(r.mode, r.concurrency): r for r in report.runs}
    for conc in report.config.concurrency:
        co, na = by_key.get((COORDINATOR, conc)), by_key.get((NAIVE, conc))
        if co is None or na is None or not co.lookups or not na.lookups or not na.rate():
            continue
        out.append(
            f"saving at concurrency {conc}: {co.rate() / na.rate():.1f}x lookups/s, "
            f"{co.rpcs / co.lookups:.3f} vs {na.rpcs / na.lookups:.3f} RPCs/lookup, "
            f"{co.keys_sent / co.lookups:.1f} vs {na.keys_sent / na.lookups:.1f} keys/lookup, "
            f"p50 {co.percentile_ms(50):.2f} vs {na.percentile_ms(50):.2f} ms"
        )
    coord = [r for r in report.runs if r.mode == COORDINATOR and r.lookups]
    planned = sum(r.keys_planned for r in coord)
    if planned:
        n = sum(r.lookups + r.error_count for r in coord)
        sent = sum(r.keys_sent for r in coord)
        cached = sum(r.cache_hits for r in coord)
        shared = sum(r.dedup_hits for r in coord)
        skipped = max(planned - sent - cached - shared, 0)
        ttl = report.config.cache_ttl
        cache = f"{cached / planned:.0%} answered by the {ttl:g} s positive cache" if ttl else ""
        out.append(
            f"coordinator keys per lookup: {planned / n:.1f} planned (what vLLM sends) -> "
            f"{sent / n:.1f} sent; of the planned keys {skipped / planned:.0%} were skipped by "
            f"probing in rounds, {shared / planned:.0%} shared with concurrent lookups"
            + (f", {cache}" if cache else "")
        )
    return out


def write_json(report: LoadgenReport, target: str, stdout: TextIO) -> None:
    """The report as JSON to a file, or to ``stdout`` for ``-``."""
    text = json.dumps(report.to_dict(), indent=2)
    if target == "-":
        stdout.write(text + "\n")
        stdout.flush()
    else:
        with open(target, "w", encoding="utf-8") as f:
            f.write(text + "\n")


def write_png(report: LoadgenReport, path: str) -> str | None:
    """Latency distribution and throughput against concurrency; returns why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'aio-mclookup[report]'); no PNG written"
    runs = [r for r in report.runs if r.lookups]
    if not runs:
        return "nothing was measured; no PNG written"
    fig, (ax_lat, ax_tput) = plt.subplots(1, 2, figsize=(13, 5))
    levels = sorted({r.concurrency for r in runs})
    colours = plt.get_cmap("viridis")(np.linspace(0.0, 0.85, max(len(levels), 1)))
    for run in runs:
        lat = np.sort(np.asarray(run.latencies)) * 1e3
        frac = np.arange(1, lat.size + 1) / lat.size
        style = "-" if run.mode == COORDINATOR else "--"
        colour = colours[levels.index(run.concurrency)]
        ax_lat.plot(lat, frac, style, color=colour, label=f"{run.mode} c={run.concurrency}")
    ax_lat.set_xscale("log")
    ax_lat.set_xlabel("lookup latency (ms, log scale)")
    ax_lat.set_ylabel("fraction of lookups <= latency")
    ax_lat.set_title("Latency distribution (CDF; solid: coordinator, dashed: seed-naive)")
    ax_lat.grid(True, which="both", alpha=0.3)
    ax_lat.legend(fontsize=8)
    for mode, marker in ((COORDINATOR, "o"), (NAIVE, "s")):
        pts = sorted((r.concurrency, r.rate()) for r in runs if r.mode == mode)
        if pts:
            xs, ys = zip(*pts)
            ax_tput.plot(xs, ys, marker=marker, label=mode)
    ax_tput.set_xscale("log", base=2)
    ax_tput.set_xticks(levels, [str(c) for c in levels])
    ax_tput.minorticks_off()
    ax_tput.set_xlabel("concurrent callers (log scale)")
    ax_tput.set_ylabel("lookups / s")
    ax_tput.set_title("Throughput against concurrency")
    ax_tput.grid(True, which="both", alpha=0.3)
    ax_tput.legend()
    ax_tput.set_ylim(bottom=0)
    cfg = report.config
    fig.suptitle(
        f"aio-mclookup loadgen: {cfg.layout.model} ({cfg.layout_source}), "
        f"{os.cpu_count()} CPUs, {report.loop_name}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
