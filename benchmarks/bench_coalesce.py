"""Coordinator vs seed-naive against a real Mooncake master on loopback, in the same run.

Seed-naive is vLLM's per-request way: its key-building loop and hit search (the faithful ports
in ``aio_mclookup._reference``, for the layout's release) plus one ``batch_is_exist`` per
request through the loop's default executor, as Mooncake's own async wrapper does. The
coordinator runs with its default options, a fresh one per repetition (no cache outlives a
repetition). Both see the same requests on the same store; every repetition checks that both
give identical hits.

Scenarios (from the coalescing issue):

* chat: one full-attention group B=16; 64 cached 4,096-token system prompts; 2,048 requests
  that share a prompt up to a random cut and then diverge; 256 concurrent callers.
* dsv4: full 256 + SWA 64/W128 + SWA 4/W8 + SWA 8/W128 (h=4, L=256), 131,072-token requests
  sharing 4 cached documents up to a random cut; 32 concurrent callers.
* single caller (concurrency 1) on both layouts: latency.
* sessions: a GQA model at TP 4 with 8 KV heads (four keys per chunk), a cache prefix, 128
  agent/chat sessions sharing 4 system prompts, each at some turn of six, every turn extending
  the last by 512 tokens; the earlier turns are stored; 64 concurrent callers.
* sessions-hybrid: the same sessions on a hybrid (full attention 16 + sliding window 16/W1024,
  Gemma-3-like) at TP 4 with 16 KV heads (four keys per chunk and group).
* cold bursts (chat and DSv4-like): distinct long prompts, each stored up to a random cut,
  all arriving at once on a fresh coordinator: latency (p50/p99) and rounds per lookup.

Every scenario runs under vLLM 0.26's rules and again under 0.33's (``-0.33`` rows: the
seed-naive loop is then 0.33's, the literal port in ``aio_mclookup._reference.v033``), except
sessions-hybrid, which is a 0.33 scenario only.

Three modes on the same requests and store: seed-naive; per-request, one request at a time
with this project's planning (``layout.plan``, one ``batch_is_exist`` of all its keys,
``plan.resolve_result``: what a user who skips the coordinator gets); and the coordinator.
Under 0.33 the rows also give a lower bound of keys per lookup: the keys whose answers vLLM's
search relies on for its result (every present key it reads, and one absent key where each
full-attention prefix stops), which any exact client must learn (the absent keys that stop a
window's or Mamba's scan are not counted, so an exact client may need a few more).

For each scenario one more coordinator run records its RPCs, and those RPCs alone are then
replayed back to back (timed, with the master's CPU): the rate no client sending exactly these
RPCs could beat on this machine, beside the coordinator's own.

Usage: ``python benchmarks/bench_coalesce.py [--quick] [--reps N] [--no-write]``. It rewrites
its own section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import hashlib
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

if __package__:
    from . import _timing
else:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _timing  # type: ignore[no-redef,import-not-found]

from aio_mclookup import FullAttention, KVLayout, LocalMaster, MooncakeStore, StoreWriter
from aio_mclookup._loadgen.baseline import RawClient, per_request_lookup
from aio_mclookup._loadgen.results import PER_REQUEST, LoadgenConfig, RunResult
from aio_mclookup._loadgen.run import Progress, coordinator_run, drive, naive_run
from aio_mclookup._loadgen.workload import PRESETS, Request, WorkloadSpec
from aio_mclookup._plan.era_c import EraCPlan
from aio_mclookup._resolve.era_c import era_c_partial
from aio_mclookup._resolve.result import LookupResult

SECTION = "bench_coalesce"
REPLAY_THREADS = (4, 8, 16)
"""Threads that replay a run's RPCs, each count in turn; the ceiling is the best of them (4:
twice the coordinator's default RPCs in flight, as many as MooncakeStore's pool; more keep more
of the master's threads busy, and which count is fastest varies run to run)."""


@dataclass(frozen=True)
class Scenario:
    name: str
    preset: str
    documents: int
    doc_tokens: int
    requests: int
    concurrency: int
    kind: str = "shared"
    """``shared``: requests share cached documents up to a random cut; ``sessions``: turns
    of sessions extending each other; ``burst``: distinct prompts, all at once."""
    release: str = "0.26"
    """The layout's vLLM release (and so the seed-naive loop's)."""


SESSION_LAYOUTS: dict[str, dict[str, Any]] = {
    "sessions": dict(PRESETS["sessions"]),
    "sessions-hybrid": {
        "model": "google/gemma-3-27b-it",
        "cache_prefix": "tenant-a",
        "hash_block_size": 16,
        "scheduler_block_size": 16,
        "tp_size": 4,
        "num_kv_heads": 16,
        "groups": [
            {"kind": "full_attention", "block_size": 16},
            {"kind": "sliding_window", "block_size": 16, "sliding_window": 1024},
        ],
    },
}
SYSTEM_TOKENS, TURN_TOKENS, TURNS = 1024, 512, 6
MODES = ("seed-naive", PER_REQUEST, "coordinator")


def layout_of(sc: Scenario) -> KVLayout:
    cfg = SESSION_LAYOUTS.get(sc.preset) or PRESETS[sc.preset]
    return KVLayout.from_dict(dict(cfg, vllm_version=sc.release))


def minimum_keys(plan: EraCPlan, stored: set[bytes]) -> int:
    """A lower bound of the keys an exact client must learn for this vLLM 0.32 / 0.33 lookup
    on this store: every present key vLLM's search relies on for its result (found as the keys
    the partial search asks for when exactly the absent keys are known), plus one absent key
    where each full-attention group's prefix stops short of its chunks (the absent keys other
    scans stop at are not counted)."""
    if not plan.num_keys:
        return 0
    geometry = plan.geometry
    present_key = np.fromiter((k in stored for k in plan.keys), bool, plan.num_keys)
    present, known = [], []
    for probe, units in zip(plan.groups, plan._units):
        k = len(geometry.prefix_bytes[probe.group_id])
        m = probe.chunks.size
        got = present_key[probe.key_offset : probe.key_offset + m * k].reshape(m, k).all(axis=1)
        by_unit = np.zeros(plan._hash_count, dtype=bool)
        by_unit[units] = got
        present.append(by_unit)
        known.append(~by_unit)  # the absent ones known, the present ones to be learnt
    needed = 0
    while True:
        found = era_c_partial(geometry, plan.num_tokens, present, known)
        if isinstance(found, LookupResult):
            break
        for probe, units in zip(plan.groups, found):
            known[probe.group_id][units] = True
            needed += units.size * len(geometry.prefix_bytes[probe.group_id])
    for probe, units in zip(plan.groups, plan._units):
        if isinstance(geometry.groups[probe.group_id], FullAttention):
            prefix = present[probe.group_id][units]
            if prefix.size and not prefix.all():
                needed += 1
    return needed


def chain(count: int, seed: bytes) -> list[bytes]:
    """Chained 32-byte block hashes (each covers its whole prefix, as vLLM's do)."""
    out, parent = [], hashlib.sha256(seed).digest()
    for i in range(count):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        out.append(parent)
    return out


def _request(layout: KVLayout, i: int, hashes: list[bytes], num_tokens: int) -> Request:
    rows = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(-1, 32)
    return Request(i, i, 0, num_tokens, layout.align(num_tokens), rows, hashes)


def build_sessions(
    layout: KVLayout, sc: Scenario, seed: int
) -> tuple[list[list[bytes]], list[Request]]:
    """Sessions at turns 1-5 of 6; what is stored: each session's previous turn (and so every
    turn before it); the requests: every turn of each session up to its current one."""
    h = layout.hash_block_size
    rng = random.Random(seed)
    systems = [chain(SYSTEM_TOKENS // h, b"system-%d" % s) for s in range(4)]
    stored: list[list[bytes]] = []
    requests: list[Request] = []
    for s in range(sc.documents):
        current = 1 + s % (TURNS - 1)
        prompt = systems[s % len(systems)]
        turns = []
        for turn in range(current + 1):  # turn k's prompt extends turn k-1's
            prompt = prompt + chain(TURN_TOKENS // h, b"session-%d-turn-%d" % (s, turn))
            turns.append(prompt)
        stored.append(turns[current - 1])
        for turn in range(1, current + 1):
            num_tokens = len(turns[turn]) * h + rng.randrange(0, h)
            requests.append(_request(layout, len(requests), turns[turn], num_tokens))
    rng.shuffle(requests)
    return stored, requests[: sc.requests]


def build_burst(
    layout: KVLayout, sc: Scenario, seed: int
) -> tuple[list[list[bytes]], list[Request]]:
    """Distinct prompts, each stored up to a random cut (what is stored: those prefixes)."""
    h = layout.hash_block_size
    per_prompt = sc.doc_tokens // h
    rng = random.Random(seed)
    stored, requests = [], []
    for i in range(sc.requests):
        hashes = chain(per_prompt, b"%s-burst-%d-%d" % (sc.name.encode(), seed, i))
        cut = rng.randrange(0, per_prompt + 1)
        stored.append(hashes[: cut - cut % (layout.scheduler_block_size // h)])
        requests.append(_request(layout, i, hashes, sc.doc_tokens))
    return stored, requests


def build(layout: KVLayout, sc: Scenario, seed: int) -> tuple[list[list[bytes]], list[Request]]:
    """What is stored (hash lists, each planned and written whole), and the requests."""
    if sc.kind == "sessions":
        return build_sessions(layout, sc, seed)
    if sc.kind == "burst":
        return build_burst(layout, sc, seed)
    h = layout.hash_block_size
    per_doc = sc.doc_tokens // h
    docs = [chain(per_doc, b"%s-doc-%d" % (sc.name.encode(), d)) for d in range(sc.documents)]
    rng = random.Random(seed)
    requests = []
    for i in range(sc.requests):
        doc = docs[rng.randrange(sc.documents)]
        cut = rng.randrange(0, per_doc + 1)
        hashes = doc[:cut] + chain(per_doc - cut, b"%s-tail-%d-%d" % (sc.name.encode(), seed, i))
        num_tokens = sc.doc_tokens + rng.randrange(0, layout.scheduler_block_size)
        requests.append(_request(layout, i, hashes, num_tokens))
    return docs, requests


def _process_cpu(pid: int) -> float:
    """CPU seconds that process ``pid``'s threads have run so far, in nanoseconds' resolution
    (each thread's ``schedstat``; ``stat`` counts in 10 ms ticks, too coarse for a run of a
    few dozen lookups)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # (a thread that ended meanwhile)
            continue
    return total / 1e9


@dataclass
class Measured:
    """One run and the CPU it took: this process's (the client side, Mooncake client threads
    included) and the master's, per lookup."""

    run: RunResult
    own_cpu: float
    master_cpu: float


async def measured(master: LocalMaster, run: Awaitable[RunResult]) -> Measured:
    pid = master.pid
    assert pid is not None
    own, theirs = time.process_time(), _process_cpu(pid)
    result = await run
    lookups = max(result.lookups, 1)
    return Measured(
        result,
        (time.process_time() - own) / lookups,
        (_process_cpu(pid) - theirs) / lookups,
    )


class Recording:
    """The coordinator's store in one extra, unmeasured run: it records every batch the
    coordinator sends (for :func:`replay`) and passes it on."""

    def __init__(self, store: MooncakeStore) -> None:
        self.store = store
        self.batches: list[list[bytes]] = []

    async def batch_is_exist(self, keys: Sequence[bytes]) -> list[int]:
        self.batches.append(list(keys))
        return await self.store.batch_is_exist(keys)

    def batch_is_exist_then(self, keys: Sequence[bytes], then: Any) -> None:
        self.batches.append(list(keys))
        self.store.batch_is_exist_then(keys, then)


def replay(raw: RawClient, batches: list[list[bytes]], threads: int) -> float:
    """Send ``batches`` again, back to back on ``threads`` threads of the seed-naive's plain
    client, nothing else done: the seconds they take (the store-bound floor of a run that
    sends exactly these RPCs)."""
    client = raw.client

    def send(part: list[list[bytes]]) -> None:
        for batch in part:
            client.batch_is_exist(batch)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(send, [batches[i::threads] for i in range(threads)]))
    return time.perf_counter() - started


def ordered_hits(result: RunResult) -> list[int]:
    """A run's hits in request order."""
    return [h for _, h in sorted(zip(result.positions, result.hits))]


def summarize(measured_runs: list[Measured]) -> dict[str, Any]:
    """Medians over repetitions."""
    runs = [m.run for m in measured_runs]
    return {
        "own_cpu": statistics.median(m.own_cpu for m in measured_runs),
        "master_cpu": statistics.median(m.master_cpu for m in measured_runs),
        "rate": statistics.median(r.rate() for r in runs),
        "rates": [r.rate() for r in runs],
        "p50": statistics.median(r.percentile_ms(50) for r in runs),
        "p99": statistics.median(r.percentile_ms(99) for r in runs),
        "rpcs": statistics.median(r.rpcs / max(r.lookups, 1) for r in runs),
        "keys": statistics.median(r.keys_sent / max(r.lookups, 1) for r in runs),
        "asked": statistics.median(
            (r.keys_sent + r.cache_hits + r.dedup_hits) / max(r.lookups, 1) for r in runs
        ),
        "rounds": statistics.median(r.rounds / max(r.lookups, 1) for r in runs),
        "errors": sum(r.error_count for r in runs),
    }


async def per_request_run(
    raw: RawClient, requests: list[Request], cfg: LoadgenConfig, concurrency: int,
    stop: asyncio.Event, progress: Progress,
) -> RunResult:
    """One run of the per-request baseline (this project's planning, one RPC per request)."""
    result = RunResult(PER_REQUEST, concurrency, len(requests))
    await drive(requests, per_request_lookup(cfg.layout, raw, result), result, cfg, stop, progress)
    return result


async def run_scenario(
    sc: Scenario, reps: int, master: LocalMaster, out: list[str]
) -> dict[str, dict[str, Any]]:
    layout = layout_of(sc)
    docs, requests = build(layout, sc, seed=7)
    concurrency = sc.concurrency if sc.kind != "burst" else len(requests)
    cfg = LoadgenConfig(layout=layout, layout_source=sc.preset, spec=WorkloadSpec(),
                        concurrency=(concurrency,))
    stop, progress = asyncio.Event(), Progress(sys.stderr, False)
    stored: set[bytes] = set()
    async with StoreWriter(master.master_address, master.metadata_server,
                           segment_size=256 << 20) as writer:
        for doc in docs:
            if doc:
                plan = layout.plan(layout.align(len(doc) * layout.hash_block_size), doc)
                stored.update(plan.keys)
                await writer.put_keys([k.decode() for k in plan.keys])
        raw = RawClient(master.master_address, master.metadata_server, "127.0.0.1")
        raw.open_blocking()
        try:
            async with MooncakeStore(master.master_address, master.metadata_server) as store:
                runs: dict[str, list[Measured]] = {mode: [] for mode in MODES}
                reference: list[int] | None = None
                for rep in range(reps):
                    shift = rep % len(MODES)  # each mode in each position in turn
                    for mode in MODES[shift:] + MODES[:shift]:
                        if mode == "coordinator":
                            go = coordinator_run(store, requests, cfg, concurrency, stop, progress)
                        elif mode == PER_REQUEST:
                            go = per_request_run(raw, requests, cfg, concurrency, stop, progress)
                        else:
                            go = naive_run(raw, requests, cfg, concurrency, stop, progress)
                        run = await measured(master, go)
                        runs[mode].append(run)
                        result = run.run
                        hits = ordered_hits(result)
                        if reference is None:
                            reference = hits
                        if hits != reference or result.error_count:
                            raise SystemExit(
                                f"{sc.name}: {mode} gave different hits or errors "
                                f"({result.errors})"
                            )
                        print(f"  {sc.name} rep {rep} {mode}: {result.rate():,.0f} lookups/s, "
                              f"p50 {result.percentile_ms(50):.2f} ms, "
                              f"{result.keys_sent / max(result.lookups, 1):,.1f} keys/lookup",
                              file=sys.stderr)
                # The store-bound floor: one more coordinator run, its RPCs recorded, then
                # those RPCs alone, replayed (timed like the runs, with the master's CPU).
                recording = Recording(store)
                result = await coordinator_run(
                    recording, requests, cfg, concurrency, stop, progress
                )
                hits = ordered_hits(result)
                if hits != reference or result.error_count:
                    raise SystemExit(f"{sc.name}: the recorded run gave different hits")
                walls: dict[int, list[float]] = {t: [] for t in REPLAY_THREADS}
                master_cpus: dict[int, list[float]] = {t: [] for t in REPLAY_THREADS}
                pid = master.pid
                assert pid is not None
                for _ in range(reps):
                    for threads in REPLAY_THREADS:
                        theirs = _process_cpu(pid)
                        walls[threads].append(await asyncio.to_thread(
                            replay, raw, recording.batches, threads
                        ))
                        master_cpus[threads].append((_process_cpu(pid) - theirs) / len(requests))
        finally:
            raw.close_blocking()
    assert reference is not None
    hit_share = sum(reference) / sum(r.token_len for r in requests)
    out.append(f"{sc.name}: hits identical in all {len(MODES) * reps + 1} runs; "
               f"hit tokens / looked-up tokens = {hit_share:.1%}")
    summaries = {mode: summarize(measured_runs) for mode, measured_runs in runs.items()}
    naive = summaries["seed-naive"]
    if layout.vllm_version != "0.26.0":
        plans = [layout.plan(r.num_tokens, r.hashes) for r in requests]
        minimum = statistics.mean(
            minimum_keys(p, stored) if isinstance(p, EraCPlan) else 0 for p in plans
        )
        summaries["coordinator"]["minimum"] = minimum
    rates = {t: len(requests) / statistics.median(walls[t]) for t in REPLAY_THREADS}
    best = max(rates, key=rates.__getitem__)
    ceiling = rates[best]
    others = ", ".join(
        f"{rate / naive['rate']:.1f}x on {t}" for t, rate in rates.items() if t != best
    )
    summaries["coordinator"]["ceiling"] = ceiling
    out.append(
        f"{sc.name}: the coordinator's {len(recording.batches)} RPCs of one run, replayed back "
        f"to back with nothing else to do, take at best (on {best} threads) the time "
        f"of {ceiling:,.0f} lookups/s ({ceiling / naive['rate']:.1f}x seed-naive's rate; "
        f"{others}; the master's CPU {statistics.median(master_cpus[best]) * 1e6:,.0f} us per "
        "lookup): the most any client sending these RPCs could reach here"
    )
    return summaries


def table(results: dict[str, dict[str, dict[str, Any]]], scenarios: list[Scenario]) -> str:
    head = ("| scenario | requests | concurrency | mode | lookups/s (min-max) | p50 ms | p99 ms "
            "| RPCs/lookup | keys/lookup: sent / asked (lower bound) | rounds/lookup "
            "| CPU us/lookup, ours | CPU us/lookup, master | vs seed-naive | vs per-request |"
            "\n|" + "---|" * 14)
    rows = [head]
    for sc in scenarios:
        res = results[sc.name]
        concurrency = sc.requests if sc.kind == "burst" else sc.concurrency
        for mode in MODES:
            m = res[mode]
            ratios = []
            for base_mode in ("seed-naive", PER_REQUEST):
                base = res[base_mode]
                if mode == base_mode:
                    ratios.append("1.0x")
                elif mode == "seed-naive":
                    ratios.append("")
                elif sc.kind == "burst":  # a burst is about latency: the baseline's p99 over ours
                    ratios.append(f"**{base['p99'] / m['p99']:.1f}x** (p99)")
                else:
                    ratios.append(f"**{m['rate'] / base['rate']:.1f}x** ({_paired(m, base)})")
            keys = f"{m['keys']:,.1f}"
            if mode == "coordinator":
                keys += f" / {m['asked']:,.1f}"
                if "minimum" in m:
                    keys += f" ({m['minimum']:,.1f})"
            rows.append(
                f"| {sc.name} | {sc.requests:,} | {concurrency} | {mode} | "
                f"{m['rate']:,.0f} ({min(m['rates']):,.0f}-{max(m['rates']):,.0f}) | "
                f"{m['p50']:.2f} | {m['p99']:.2f} | {m['rpcs']:.3f} | "
                f"{keys} | {m['rounds']:.2f} | {m['own_cpu'] * 1e6:,.0f} | "
                f"{m['master_cpu'] * 1e6:,.0f} | {ratios[0]} | {ratios[1]} |"
            )
    return "\n".join(rows)


def _paired(mode: dict[str, Any], base: dict[str, Any]) -> str:
    """The spread of a ratio: each repetition's rate over the baseline's of the same one."""
    pairs = [a / b for a, b in zip(mode["rates"], base["rates"])]
    return f"{min(pairs):.1f}-{max(pairs):.1f}x"


def machine() -> str:
    m = _timing.machine()
    return f"{m['nproc']} vCPU {m['cpu']}, {m['python']}, numpy {m['numpy']}"


async def main_async(args: argparse.Namespace) -> str:
    scale = 4 if args.quick else 1
    base = [
        Scenario("chat", "chat", 64, 4096, 2048 // scale, 256),
        Scenario("dsv4", "dsv4", 4, 131072, 128 // scale, 32),
        Scenario("chat-single", "chat", 64, 4096, 400 // scale, 1),
        Scenario("dsv4-single", "dsv4", 4, 131072, 24 // scale, 1),
        Scenario("sessions", "sessions", 128, 0, 448 // scale, 64, "sessions"),
        Scenario("chat-burst", "chat", 0, 8192, 200 // scale, 0, "burst"),
        Scenario("dsv4-burst", "dsv4", 0, 131072, 32 // scale, 0, "burst"),
    ]
    scenarios = [
        *base,
        *(dataclasses.replace(sc, name=f"{sc.name}-0.33", release="0.33") for sc in base),
        Scenario("sessions-hybrid-0.33", "sessions-hybrid", 128, 0, 448 // scale, 64,
                 "sessions", release="0.33"),
    ]
    if args.only:
        scenarios = [sc for sc in scenarios if sc.name in args.only]
    notes: list[str] = []
    results: dict[str, dict[str, dict[str, Any]]] = {}
    started = time.perf_counter()
    async with LocalMaster() as master:
        for sc in scenarios:
            results[sc.name] = await run_scenario(sc, args.reps, master, notes)
    elapsed = time.perf_counter() - started
    return "\n".join([
        "## Coalescing against a real master (bench_coalesce)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {machine()}; a real `mooncake_master` on "
        f"127.0.0.1 started by the script; uvloop. Command: "
        f"`python benchmarks/bench_coalesce.py{' --quick' if args.quick else ''} "
        f"--reps {args.reps}` ({elapsed:.0f} s).",
        f"Each row is the median over {args.reps} repetitions (lookups/s also gives their "
        "min-max); the three modes take turns in the same process, on the same requests and "
        "store. A ratio is the median lookups/s over the baseline's (in brackets: the min-max "
        "of the repetitions' own ratios; bursts: the baseline's p99 over ours).",
        "Seed-naive: vLLM's per-request loop for the layout's release (0.26 unless the "
        "scenario says 0.33; `aio_mclookup._reference`) + one "
        "`batch_is_exist` per request via the loop's default executor. Per-request: the same "
        "with this project's planning (`layout.plan`, `plan.resolve_result`). Coordinator: "
        "default options, fresh per repetition. The lower bound (0.33 rows): the keys "
        "vLLM's search relies on (every present key it reads, one absent key where a "
        "full-attention prefix stops), which any exact client must learn; asked: the keys "
        "the coordinator's rounds asked for, whether the store, its positive cache or another "
        "lookup's probe answered them.",
        "CPU per lookup: this process's CPU time over the run (the caller side: the Mooncake "
        "client's threads, planning or seed-naive's key loop, the coordinator) and the master "
        "process's (the sum over its threads' schedstat), each divided by the lookups (read "
        "from /proc around each run). On this "
        "2-vCPU machine the two together bound the rate: lookups/s cannot exceed 2 s of CPU "
        "per second over their sum.",
        "",
        table(results, scenarios),
        "",
        *(f"- {n}" for n in notes),
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--only", action="append", help="run only these scenarios (repeatable)")
    args = parser.parse_args()
    try:
        import uvloop

        text = uvloop.run(main_async(args))
    except ImportError:
        text = asyncio.run(main_async(args))
    print(text)
    if not args.no_write:
        _timing.write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
