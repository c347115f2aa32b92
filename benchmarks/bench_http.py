"""Lookups over HTTP (a real uvicorn serving examples/fastapi_app.py) beside the in-process
coordinator, on the same workload, against the same real master, in the same run.

The workload is bench_coalesce's chat scenario (``bench_coalesce.build``): one full-attention
group, B=16; 64 cached 4,096-token system prompts; requests that share one up to a random cut and
then diverge. Each request is looked up as ``coordinator.lookup_result(token_len, hashes)`` in
process, and over HTTP as ``POST /v1/lookup`` with

* ``json``: ``{"token_len": ..., "block_hashes": [256 hex strings]}`` (about 17 KB), or
* ``frame``: ``application/octet-stream``, vLLM 0.33's lookup frame (``num_tokens`` u32 BE,
  ``hash_len`` u16 BE, the hashes; about 8 KB), answered with a u32 hit;

at 1, 16, 64 and 256 connections (HTTP/1.1 keep-alive, one request in flight per connection,
like as many callers in process). The server is ``uvicorn fastapi_app:app --no-access-log``
with httptools and uvloop, started by the script: one worker, and beside it the same server
with :data:`WORKERS` workers (``--workers``; the kernel spreads the connections over them,
each worker with its own coordinator); its CPU (every process of it) is read from /proc. The
one-worker server's RPCs are its own ``/metrics``; the several workers', which no one
worker's ``/metrics`` holds, the master's count of ``batch_is_exist`` calls. The
client is a small asyncio protocol on uvloop sending pre-encoded requests, in this process, each
connection writing its next request from the callback that read the last reply (no coroutine
per request: it shares the two vCPUs with the server); its own CPU time is reported beside the
server's. Every mode's hits are checked against the
in-process ones.

Each repetition runs every mode once per concurrency (order rotated), on a coordinator that has
served the whole workload once before (in process: a long-lived coordinator, warmed the same
way; over HTTP the server's own), both with a ``cache_ttl`` longer than the run (see
:data:`CACHE_TTL`). A figure is the median over the repetitions, with min-max.

Usage: ``python benchmarks/bench_http.py [--quick] [--reps N] [--no-write]``; it rewrites its own
section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

if __package__:
    from . import _timing
    from .bench_coalesce import Scenario, build
else:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _timing  # type: ignore[no-redef,import-not-found]
    from bench_coalesce import Scenario, build  # type: ignore[import-not-found,no-redef]

from aio_mclookup import BlockHasher, LocalMaster, LookupCoordinator, MooncakeStore, StoreWriter
from aio_mclookup._loadgen.workload import Request, preset_layout

SECTION = "bench_http"
CONCURRENCY = (1, 16, 64, 256)
MODES = ("in-process", "http-json", "http-frame", "workers-json", "workers-frame")
WORKERS = max(2, min(4, os.cpu_count() or 2))
"""Workers of the second server: one per vCPU (at least two, at most four)."""
TOKEN_CONCURRENCY = (64, 256)
TOKEN_MODES = ("in-process-tokens", "http-tokens")
HASH_SEED = "0"  # the server's AIO_MCLOOKUP_HASH_SEED (vLLM 0.26's chat preset needs one)
CACHE_TTL = 600.0
"""Both coordinators' ``cache_ttl`` (the server's by AIO_MCLOOKUP_CACHE_TTL): longer than the
run, so that after the warm-up every measured run of either side starts with its caches warm.
With the default (5 s) each side's known prefixes expire while the other side runs, and a run
that starts on expired ones re-probes them: the in-process rate then halves (4,300-5,500
against 8,500-11,500 lookups/s at 64 callers, measured apart), and which runs do depends on the
order of the modes, not on the path measured. A busy server is in the warm state: its entries
expire and are re-probed once per ``cache_ttl``, not once per run."""
TICK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- the client
class _Feed:
    """One HTTP run's shared state: the requests still to send (in order), what came back.

    The connections pull from it in their own callbacks: a reply read is the next request
    written, with no coroutine, future or task per request (the client shares the machine's
    two vCPUs with the server, so every microsecond it spends is one the server does not get).
    """

    def __init__(self, bodies: list[bytes], frame: bool, done: asyncio.Future[None]) -> None:
        self.bodies = bodies
        self.frame = frame
        self.next = 0
        self.hits = [0] * len(bodies)
        self.latencies = [0.0] * len(bodies)
        self.busy = 0  # connections with a request in flight
        self.done = done

    def fail(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)

    def idle(self) -> None:
        """A connection found nothing left to send: the run is over when none is busy."""
        self.busy -= 1
        if not self.busy and not self.done.done():
            self.done.set_result(None)


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request in flight at a time: it sends the
    feed's next request when the previous reply is whole."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.feed: _Feed | None = None
        self.index = -1
        self.sent_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)

    def start(self, feed: _Feed) -> None:
        """Begin pulling requests from ``feed``."""
        self.feed = feed
        feed.busy += 1
        self._send_next()

    def _send_next(self) -> None:
        feed = self.feed
        assert feed is not None and self.transport is not None
        i = feed.next
        if i == len(feed.bodies):
            self.index = -1
            feed.idle()
            return
        feed.next = i + 1
        self.index = i
        self.sent_at = time.perf_counter()
        self.transport.write(feed.bodies[i])

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            self.buf = buf
            return
        head = buf[:end].lower()
        at = head.find(b"content-length:")
        if at < 0:  # (the server always sends one: anything else is a failure to report)
            if self.feed is not None:
                self.feed.fail(RuntimeError(f"a reply without content-length: {head[:200]!r}"))
            return
        stop = head.find(b"\r\n", at)
        length = int(head[at + 15 : stop if stop >= 0 else None])
        need = end + 4 + length
        if len(buf) < need:
            self.buf = buf
            return
        self.buf = buf[need:]
        feed = self.feed
        if feed is None or self.index < 0:
            return
        body = buf[end + 4 : need]
        if head[9:12] != b"200":
            feed.fail(RuntimeError(f"HTTP {head[9:12]!r}: {body[:200]!r}"))
            return
        i = self.index
        feed.latencies[i] = time.perf_counter() - self.sent_at
        feed.hits[i] = (
            int.from_bytes(body[:4], "big") if feed.frame else int(body[body.index(b":") + 1 : -1])
        )
        self._send_next()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.feed is not None and self.index >= 0:
            self.feed.fail(ConnectionError(f"connection lost: {exc}"))


def _http_request(port: int, body: bytes, content_type: str) -> bytes:
    return (
        b"POST /v1/lookup HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: %s\r\n"
        b"content-length: %d\r\n\r\n" % (port, content_type.encode(), len(body))
    ) + body


def encode_json(port: int, req: Request) -> bytes:
    body = json.dumps(
        {"token_len": req.token_len, "block_hashes": [h.hex() for h in req.hash_list]}
    )
    return _http_request(port, body.encode(), "application/json")


def encode_frame(port: int, req: Request) -> bytes:
    # num_tokens = the aligned token_len: the same lookup as the JSON body's (on a vLLM 0.26
    # layout, with the leave-one-token rule applied to its answer).
    body = struct.pack(">IH", req.token_len, 32) + b"".join(req.hash_list)
    return _http_request(port, body, "application/octet-stream")


# --------------------------------------------------------------------------- one run
@dataclass
class Run:
    mode: str
    concurrency: int
    wall: float = 0.0
    lookups: int = 0
    latencies: list[float] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    rpcs: float = 0.0
    server_cpu: float = 0.0
    client_cpu: float = 0.0

    @property
    def rate(self) -> float:
        return self.lookups / self.wall


async def drive(
    count: int, concurrency: int, lookup: Callable[[int, int], Awaitable[int]]
) -> tuple[float, list[float], list[int]]:
    """``count`` lookups by ``concurrency`` callers (caller ``c`` takes the next index)."""
    hits = [0] * count
    latencies = [0.0] * count
    index = iter(range(count))

    async def caller(c: int) -> None:
        for i in index:
            t0 = time.perf_counter()
            hits[i] = await lookup(c, i)
            latencies[i] = time.perf_counter() - t0

    started = time.perf_counter()
    await asyncio.gather(*(caller(c) for c in range(concurrency)))
    return time.perf_counter() - started, latencies, hits


def _cpu_of(pid: int) -> float:
    """CPU seconds of process ``pid`` and every process below it (uvicorn's workers)."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stats[int(entry)] = (
                    Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                )
            except OSError:  # (a process that ended meanwhile)
                continue
    tree, total, grew = {pid}, 0.0, True
    while grew:
        grew = False
        for child, fields in stats.items():
            if child not in tree and int(fields[1]) in tree:
                tree.add(child)
                grew = True
    for member in tree:
        if member in stats:
            fields = stats[member]
            total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


class Server:
    """``uvicorn fastapi_app:app`` in a child process, on a free loopback port."""

    def __init__(self, layout_path: Path, master: LocalMaster, workers: int = 1) -> None:
        self.workers = workers
        self.master = master
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        env = {
            **os.environ,
            "AIO_MCLOOKUP_LAYOUT": str(layout_path),
            "MOONCAKE_MASTER": master.master_address,
            "MOONCAKE_METADATA": master.metadata_server,
            "AIO_MCLOOKUP_HASH_SEED": HASH_SEED,
            "AIO_MCLOOKUP_CACHE_TTL": str(CACHE_TTL),
            "PYTHONPATH": str(_timing.ROOT / "src"),
        }
        argv = [sys.executable, "-m", "uvicorn", "fastapi_app:app"]
        argv += ["--app-dir", str(_timing.ROOT / "examples"), "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--no-access-log", "--http", "httptools"]
        argv += ["--no-proxy-headers", "--no-server-header", "--loop", "uvloop"]
        argv += ["--log-level", "warning", "--backlog", "2048"]
        if workers > 1:
            argv += ["--workers", str(workers)]
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
        shown = [a for a in argv[3:] if a != str(self.port) and a != "--port"]
        shown[shown.index("--app-dir") + 1] = "examples"
        self.command = "uvicorn " + " ".join(shown)

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "uvicorn exited"
            try:
                if b" 200 " in (await self.get("/healthz"))[:20]:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError("uvicorn did not start")

    async def get(self, path: str, port: int | None = None) -> bytes:
        """One ``GET path`` on a new connection: to the server, or to loopback ``port``."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port or self.port)
        writer.write(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
        data = await reader.read(-1)
        writer.close()
        return data

    async def rpcs_and_lookups(self) -> tuple[float, float | None]:
        """RPCs and lookups so far: the worker's own ``/metrics``; with several workers, the
        master's ``batch_is_exist`` calls (nothing else calls it meanwhile) and no count of
        lookups (each worker counts its own)."""
        if self.workers == 1:
            text = (await self.get("/metrics")).decode()
            rpcs = _metric(text, "aio_mclookup_rpcs_total")
            return rpcs, _metric(text, "aio_mclookup_lookups_total")
        text = (await self.get("/metrics", self.master.metrics_port)).decode()
        return _metric(text, "master_batch_exist_key_requests_total"), None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def run_http(
    server: Server, bodies: list[bytes], concurrency: int, mode: str, frame: bool
) -> Run:
    loop = asyncio.get_running_loop()
    conns = []
    for _ in range(concurrency):
        _, proto = await loop.create_connection(_Conn, "127.0.0.1", server.port)
        conns.append(proto)

    rpcs0, lookups0 = await server.rpcs_and_lookups()
    cpu0, client0 = _cpu_of(server.proc.pid), time.process_time()
    feed = _Feed(bodies, frame, loop.create_future())
    started = time.perf_counter()
    for conn in conns:
        conn.start(feed)
    await feed.done
    wall, latencies, hits = time.perf_counter() - started, feed.latencies, feed.hits
    client_cpu, server_cpu = time.process_time() - client0, _cpu_of(server.proc.pid) - cpu0
    rpcs1, lookups1 = await server.rpcs_and_lookups()
    for conn in conns:
        assert conn.transport is not None
        conn.transport.close()
    if lookups0 is not None and lookups1 is not None:
        assert lookups1 - lookups0 == len(bodies), (lookups0, lookups1)
    return Run(
        mode,
        concurrency,
        wall,
        len(bodies),
        latencies,
        hits,
        (rpcs1 - rpcs0) / len(bodies),
        server_cpu,
        client_cpu,
    )


async def run_in_process(
    coordinator: LookupCoordinator, requests: list[Request], concurrency: int
) -> Run:
    async def lookup(c: int, i: int) -> int:
        req = requests[i]
        result = await coordinator.lookup_result(req.token_len, req.hashes)
        return result.hit_length  # what the JSON route answers for token_len

    rpcs0 = coordinator.stats().rpcs_total
    cpu0 = time.process_time()
    wall, latencies, hits = await drive(len(requests), concurrency, lookup)
    cpu = time.process_time() - cpu0
    rpcs = (coordinator.stats().rpcs_total - rpcs0) / len(requests)
    return Run("in-process", concurrency, wall, len(requests), latencies, hits, rpcs, cpu, 0.0)


def token_workload(
    count: int, seed: int, block: int, scheduler_block: int
) -> tuple[list[list[int]], list[list[int]]]:
    """bench_coalesce's chat shape with token ids: 64 cached 4,096-token system prompts and
    prompts that share one up to a random whole block, then diverge."""
    rng = random.Random(seed)
    docs = [[rng.randrange(150_000) for _ in range(4096)] for _ in range(64)]
    prompts = []
    for _ in range(count):
        doc = docs[rng.randrange(64)]
        cut = rng.randrange(0, 4096 // block + 1) * block
        extra = rng.randrange(0, scheduler_block)
        prompts.append(doc[:cut] + [rng.randrange(150_000) for _ in range(4096 - cut + extra)])
    return docs, prompts


def encode_tokens(port: int, ids: list[int]) -> bytes:
    return _http_request(port, json.dumps({"token_ids": ids}).encode(), "application/json")


async def run_in_process_tokens(
    coordinator: LookupCoordinator, hasher: BlockHasher, prompts: list[list[int]], c: int
) -> Run:
    """Hash, then vLLM's scheduler view of the lookup (what the token-id route answers)."""

    async def lookup(_: int, i: int) -> int:
        ids = prompts[i]
        return await coordinator.lookup(len(ids), hasher.hash(ids))

    rpcs0 = coordinator.stats().rpcs_total
    cpu0 = time.process_time()
    wall, latencies, hits = await drive(len(prompts), c, lookup)
    cpu = time.process_time() - cpu0
    rpcs = (coordinator.stats().rpcs_total - rpcs0) / len(prompts)
    return Run("in-process-tokens", c, wall, len(prompts), latencies, hits, rpcs, cpu, 0.0)


# --------------------------------------------------------------------------- the bench
def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] * 1e3


async def main_async(args: argparse.Namespace) -> str:
    layout = preset_layout("chat")
    count = 512 if args.quick else 2048
    sc = Scenario("chat", "chat", 64, 4096, count, 64)
    docs, requests = build(layout, sc, seed=7)
    hasher = BlockHasher(
        layout.hash_block_size, algo="sha256", seed=HASH_SEED, vllm_version=layout.vllm_version
    )
    token_docs, prompts = token_workload(
        count // 2, 11, layout.hash_block_size, layout.scheduler_block_size
    )
    started = time.perf_counter()
    runs: dict[tuple[str, int], list[Run]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        layout_path = Path(tmp) / "chat.json"
        layout_path.write_text(json.dumps(layout.to_dict()))
        async with (
            LocalMaster() as master,
            StoreWriter(
                master.master_address, master.metadata_server, segment_size=256 << 20
            ) as writer,
        ):
            for doc in docs:
                plan = layout.plan(sc.doc_tokens, doc)
                await writer.put_keys([k.decode() for k in plan.keys])
            for ids in token_docs:
                plan = layout.plan(len(ids), hasher.hash(ids))
                await writer.put_keys([k.decode() for k in plan.keys])
            server = Server(layout_path, master)
            servers = Server(layout_path, master, WORKERS)
            try:
                await server.wait_ready()
                await servers.wait_ready()
                bodies = {
                    "http-json": [encode_json(server.port, r) for r in requests],
                    "http-frame": [encode_frame(server.port, r) for r in requests],
                    "workers-json": [encode_json(servers.port, r) for r in requests],
                    "workers-frame": [encode_frame(servers.port, r) for r in requests],
                }
                token_bodies = [encode_tokens(server.port, ids) for ids in prompts]
                async with (
                    MooncakeStore(master.master_address, master.metadata_server) as store,
                    LookupCoordinator(layout, store, cache_ttl=CACHE_TTL) as coordinator,
                ):
                    # Warm the coordinators with the whole workload (their caches then hold
                    # for the whole run: CACHE_TTL); the workers' twice, each worker seeing
                    # only the connections the kernel gave it.
                    await run_in_process(coordinator, requests, 64)
                    await run_http(server, bodies["http-json"], 64, "warm-up", False)
                    for _ in range(2):
                        await run_http(servers, bodies["workers-json"], 64, "warm-up", False)
                    await run_in_process_tokens(coordinator, hasher, prompts, 64)
                    await run_http(server, token_bodies, 64, "warm-up", False)
                    for rep in range(args.reps):
                        for concurrency in CONCURRENCY:
                            n = len(requests) if concurrency > 1 else len(requests) // 4
                            turn = rep % len(MODES)
                            for mode in MODES[turn:] + MODES[:turn]:
                                if mode == "in-process":
                                    run = await run_in_process(
                                        coordinator, requests[:n], concurrency
                                    )
                                else:
                                    run = await run_http(
                                        servers if mode.startswith("workers") else server,
                                        bodies[mode][:n],
                                        concurrency,
                                        mode,
                                        mode.endswith("frame"),
                                    )
                                runs.setdefault((mode, concurrency), []).append(run)
                                report_run(run)
                        for concurrency in TOKEN_CONCURRENCY:
                            for mode in TOKEN_MODES[rep % 2 :] + TOKEN_MODES[: rep % 2]:
                                if mode == "in-process-tokens":
                                    run = await run_in_process_tokens(
                                        coordinator, hasher, prompts, concurrency
                                    )
                                else:
                                    run = await run_http(
                                        server, token_bodies, concurrency, mode, False
                                    )
                                runs.setdefault((mode, concurrency), []).append(run)
                                report_run(run)
            finally:
                server.stop()
                servers.stop()
    elapsed = time.perf_counter() - started
    # Every mode must give the in-process hits (the frame's answer is the scheduler view of
    # the same lookup: vLLM 0.26's leave-one-token rule applied to it).
    for (mode, concurrency), mode_runs in runs.items():
        if mode in TOKEN_MODES:
            base = runs[("in-process-tokens", concurrency)][0].hits
        else:
            base = runs[("in-process", concurrency)][0].hits
        if mode.endswith("frame"):
            base = [layout.leave_one_token(h, r.token_len) for h, r in zip(base, requests)]
        for run in mode_runs:
            if run.hits != base:
                raise SystemExit(f"{mode} at {concurrency} connections gave different hits")
    return report(runs, args, elapsed, server.command, count)


def report_run(run: Run) -> None:
    print(
        f"  c={run.concurrency} {run.mode}: {run.rate:,.0f} lookups/s, {run.rpcs:.3f} "
        f"RPCs/lookup, server CPU {run.server_cpu / run.lookups * 1e6:.0f} us/lookup",
        file=sys.stderr,
        flush=True,
    )


def targets(runs: dict[tuple[str, int], list[Run]]) -> str:
    """Where the issue's targets stand in this run."""

    def ratio(mode: str, c: int) -> float:
        pairs = zip(runs[(mode, c)], runs[("in-process", c)])
        return statistics.median(r.rate / b.rate for r, b in pairs)

    rpcs = {
        c: max(statistics.median(r.rpcs for r in runs[(m, c)]) for m in MODES[1:])
        for c in (64, 256)
    }
    return (
        f"Targets at 64 connections: one worker serves JSON hex at {ratio('http-json', 64):.2f} "
        f"of the in-process lookups/s (target 0.35) and the compact frame at "
        f"{ratio('http-frame', 64):.2f} (target 0.50); {WORKERS} workers at "
        f"{ratio('workers-json', 64):.2f} and {ratio('workers-frame', 64):.2f}. At 256 "
        f"connections: {ratio('http-json', 256):.2f} and {ratio('http-frame', 256):.2f} "
        f"(one worker), {ratio('workers-json', 256):.2f} and "
        f"{ratio('workers-frame', 256):.2f} ({WORKERS} workers). RPCs per lookup over HTTP at "
        f"most {rpcs[64]:.3f} at 64 connections and {rpcs[256]:.3f} at 256 (target 0.25)."
    )


def ratios(runs: list[Run], base: list[Run]) -> str:
    """The mode's lookups/s over the in-process rate of the same repetition: median (min-max)."""
    values = [r.rate / b.rate for r, b in zip(runs, base)]
    s = _timing.spread(values)
    return f"**{s.median:.2f}** ({s.low:.2f}-{s.high:.2f})"


def report(
    runs: dict[tuple[str, int], list[Run]],
    args: argparse.Namespace,
    elapsed: float,
    command: str,
    count: int,
) -> str:
    def med(values: list[float]) -> str:
        s = _timing.spread(values)
        return f"{s.median:,.0f} ({s.low:,.0f}-{s.high:,.0f})"

    rows = [
        "| connections | mode | lookups/s (min-max) | vs in-process | p50 ms | p99 ms "
        "| RPCs/lookup | server CPU µs/lookup | client CPU µs/lookup |",
        "|" + "---|" * 9,
    ]
    for concurrency in CONCURRENCY:
        for mode in MODES:
            rs = runs[(mode, concurrency)]
            ratio = (
                "1.00" if mode == "in-process" else ratios(rs, runs[("in-process", concurrency)])
            )
            client = (
                "-"
                if mode == "in-process"
                else f"{statistics.median(r.client_cpu / r.lookups for r in rs) * 1e6:.0f}"
            )
            label = mode.replace("workers-", "http-") + (
                f", {WORKERS} workers" if mode.startswith("workers") else ""
            )
            rows.append(
                f"| {concurrency} | {label} | {med([r.rate for r in rs])} | {ratio} | "
                f"{statistics.median(pct(r.latencies, 50) for r in rs):.2f} | "
                f"{statistics.median(pct(r.latencies, 99) for r in rs):.2f} | "
                f"{statistics.median(r.rpcs for r in rs):.3f} | "
                f"{statistics.median(r.server_cpu / r.lookups for r in rs) * 1e6:.0f} | {client} |"
            )
    token_rows = [
        "| connections | mode | lookups/s (min-max) | vs in-process | p50 ms | p99 ms "
        "| RPCs/lookup | server CPU µs/lookup | client CPU µs/lookup |",
        "|" + "---|" * 9,
    ]
    for concurrency in TOKEN_CONCURRENCY:
        for mode in TOKEN_MODES:
            rs = runs[(mode, concurrency)]
            base_runs = runs[("in-process-tokens", concurrency)]
            ratio = "1.00" if mode == "in-process-tokens" else ratios(rs, base_runs)
            client = (
                "-"
                if mode == "in-process-tokens"
                else f"{statistics.median(r.client_cpu / r.lookups for r in rs) * 1e6:.0f}"
            )
            token_rows.append(
                f"| {concurrency} | {mode} | {med([r.rate for r in rs])} | {ratio} | "
                f"{statistics.median(pct(r.latencies, 50) for r in rs):.2f} | "
                f"{statistics.median(pct(r.latencies, 99) for r in rs):.2f} | "
                f"{statistics.median(r.rpcs for r in rs):.3f} | "
                f"{statistics.median(r.server_cpu / r.lookups for r in rs) * 1e6:.0f} | {client} |"
            )
    m = _timing.machine()
    return "\n".join(
        [
            "## Lookups over HTTP (bench_http)",
            "",
            f"Measured {time.strftime('%Y-%m-%d')} on {m['nproc']} vCPU {m['cpu']}, "
            f"{m['python']}; a real `mooncake_master` on 127.0.0.1. Command: "
            f"`python benchmarks/bench_http.py{' --quick' if args.quick else ''} "
            f"--reps {args.reps}` ({elapsed:.0f} s). Server: `{command}` (one worker), and "
            f'beside it the same with `--workers {WORKERS}` (rows "{WORKERS} workers": each '
            "worker a process with its own coordinator, the kernel spreading the connections "
            "over them; their RPCs counted by the master, their CPU summed). "
            f"Workload: bench_coalesce's chat scenario, {count:,} requests of 4,096 tokens "
            "(256 hashes of 32 bytes) sharing 64 cached system prompts; a quarter of them at 1 "
            "connection. Each figure is the median over "
            f"{args.reps} repetitions (min-max); the modes alternate within each "
            "repetition on the same master. Every coordinator (the servers' and the "
            f"in-process one) runs with `cache_ttl={CACHE_TTL:g}` after a warm-up pass of "
            "the whole workload (two for the workers), so every measured run starts with "
            "its caches warm "
            "(the state of a busy server; with the default 5 s, which side's prefixes had "
            "expired at a run's start depended on the order of the modes, and an in-process "
            "run starting on expired ones ran at half the rate). The frame carries "
            "num_tokens = the JSON body's "
            "token_len (the same lookup; its answer is the scheduler view). "
            "\"vs in-process\" is the mode's lookups/s over the in-process coordinator's at "
            "the same concurrency in the same repetition (median and min-max of those ratios). "
            "In-process rows: the "
            "coordinator in this process, its CPU in the server column. HTTP rows: server CPU "
            "is uvicorn's processes (HTTP, FastAPI, the coordinator and its Mooncake client), "
            "client CPU the load generator's own. Hits were identical to the in-process ones "
            "in every run.",
            "",
            *rows,
            "",
            targets(runs),
            "",
            f'Token-id bodies (`{{"token_ids": [...]}}`, hashed by the server with '
            '`BlockHasher(16, algo="sha256", seed="0")`), the same shape with token ids: 64 '
            f"cached 4,096-token prompts, {count // 2:,} prompts sharing one up to a random "
            "block. In process: the same hasher, then the scheduler view of the lookup, on the "
            "same coordinator. Hits identical in every run.",
            "",
            *token_rows,
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="512 requests instead of 2,048")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--note", default="", help="a paragraph to append (e.g. other runs)")
    args = parser.parse_args()
    import uvloop

    text = uvloop.run(main_async(args))
    if args.note:
        text += "\n\n" + args.note
    print(text)
    if not args.no_write:
        _timing.write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
