"""SGLang HiCache lookups from token ids against a real Mooncake master on loopback: what a
router in front of an SGLang fleet asks, in three ways on the same requests and store.

* seed-naive: SGLang's own way, per request: every querying rank sends one ``batch_exists`` of
  its own keys (the scheduler's prefetch thread, one RPC per rank, here concurrent on the
  loop's executor as the ranks' processes would be), the hit the minimum over ranks;
* per-request: one request at a time with this project's planning (``layout.plan``, one
  ``batch_is_exist`` of all its keys, ``plan.resolve``);
* coordinator: ``LookupCoordinator(layout, store).lookup_tokens(token_ids)``, default options,
  a fresh coordinator per repetition: it hashes the pages on its worker thread.

Every mode hashes the request's token ids (``layout.page_hashes``, or the coordinator's
``lookup_tokens``), timed in. The
workload: SGLang 0.5.23, page size 64, ``Qwen/Qwen3-8B`` at TP 2 (MHA: four objects per page),
the default prefetch threshold (256 tokens); 32 documents of 4,096 tokens stored whole; 2,048
requests, each a document up to a random cut followed by its own tokens, 256 concurrent
callers. Every repetition checks that the three modes give identical hits.

Usage: ``python benchmarks/bench_sglang.py [--quick] [--reps N] [--no-write]``; it rewrites its
own section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

if __package__:
    from . import _timing
    from .bench_coalesce import _process_cpu
else:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _timing  # type: ignore[no-redef,import-not-found]
    from bench_coalesce import _process_cpu  # type: ignore[import-not-found,no-redef]

from aio_mclookup import LocalMaster, LookupCoordinator, MooncakeStore, SGLangLayout, StoreWriter
from aio_mclookup._loadgen.baseline import RawClient

SECTION = "bench_sglang"
LAYOUT = SGLangLayout(
    sglang_version="0.5.23", page_size=64, model_name="Qwen/Qwen3-8B", tp_size=2
)
DOCUMENTS, DOC_TOKENS, VOCAB = 32, 4096, 151_936
MODES = ("seed-naive", "per-request", "coordinator")


def workload(requests: int, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The stored documents and the requests' token ids."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, VOCAB, DOC_TOKENS, dtype=np.int64) for _ in range(DOCUMENTS)]
    out = []
    for _ in range(requests):
        doc = docs[int(rng.integers(DOCUMENTS))]
        cut = int(rng.integers(0, DOC_TOKENS + 1))
        tail = rng.integers(0, VOCAB, DOC_TOKENS - cut + int(rng.integers(1, 64)), dtype=np.int64)
        out.append(np.concatenate((doc[:cut], tail)))
    return docs, out


Lookup = Callable[[np.ndarray], Awaitable[int]]


async def drive(requests: list[np.ndarray], lookup: Lookup, concurrency: int) -> dict[str, Any]:
    """Run every request through ``lookup``, ``concurrency`` at a time: hits, latencies."""
    hits = [0] * len(requests)
    latencies: list[float] = []
    order = iter(range(len(requests)))

    async def worker() -> None:
        for i in order:
            started = time.perf_counter()
            hits[i] = await lookup(requests[i])
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    latencies.sort()
    return {
        "hits": hits,
        "rate": len(requests) / wall,
        "p50": latencies[len(latencies) // 2] * 1e3,
        "p99": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3,
    }


def baselines(raw: RawClient, counts: dict[str, int]) -> dict[str, Lookup]:
    """The seed-naive and per-request lookups on the plain Mooncake client."""
    client = raw.client
    loop = asyncio.get_running_loop()
    slots = [positions for _, positions in LAYOUT.rank_slots]
    per_page = LAYOUT.keys_per_page

    async def rpc(keys: list[bytes]) -> list[int]:
        counts["rpcs"] += 1
        counts["keys"] += len(keys)
        answers: list[int] = await loop.run_in_executor(None, client.batch_is_exist, keys)
        return answers

    async def seed_naive(tokens: np.ndarray) -> int:
        plan = LAYOUT.plan(len(tokens), LAYOUT.page_hashes(tokens))
        keys = plan.keys
        if not keys:
            return 0
        pages = len(keys) // per_page
        per_rank = [
            [keys[p * per_page + j] for p in range(pages) for j in mine] for mine in slots
        ]
        replies = await asyncio.gather(*(rpc(rank_keys) for rank_keys in per_rank))
        answers = [0] * len(keys)
        for mine, reply in zip(slots, replies):
            for at, answer in enumerate(reply):
                answers[(at // len(mine)) * per_page + mine[at % len(mine)]] = answer
        return plan.resolve(answers)  # (each rank's first miss, the minimum over ranks)

    async def per_request(tokens: np.ndarray) -> int:
        plan = LAYOUT.plan(len(tokens), LAYOUT.page_hashes(tokens))
        keys = plan.keys
        return plan.resolve(await rpc(keys)) if keys else 0

    return {"seed-naive": seed_naive, "per-request": per_request}


def coordinator_lookup(coordinator: LookupCoordinator) -> Lookup:
    """The coordinator's lookup from token ids: ``lookup_tokens``, or (the code before it, as
    bench_paired runs it) ``lookup`` of the page hashes."""
    if hasattr(coordinator, "lookup_tokens"):
        return coordinator.lookup_tokens

    async def lookup(tokens: np.ndarray) -> int:
        return await coordinator.lookup(len(tokens), LAYOUT.page_hashes(tokens))

    return lookup


async def main_async(args: argparse.Namespace) -> str:
    docs, requests = workload(2048 // (4 if args.quick else 1), seed=7)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    reference: list[int] | None = None
    started = time.perf_counter()
    async with LocalMaster() as master, StoreWriter(
        master.master_address, master.metadata_server, segment_size=256 << 20
    ) as writer:
        for doc in docs:
            plan = LAYOUT.plan(len(doc) + 1, LAYOUT.page_hashes(doc))
            await writer.put_keys([k.decode() for k in plan.keys])
        raw = RawClient(master.master_address, master.metadata_server, "127.0.0.1")
        raw.open_blocking()
        try:
            async with MooncakeStore(master.master_address, master.metadata_server) as store:
                pid = master.pid
                assert pid is not None
                for rep in range(args.reps):
                    shift = rep % len(MODES)
                    for mode in MODES[shift:] + MODES[:shift]:
                        counts = {"rpcs": 0, "keys": 0}
                        own, theirs = time.process_time(), _process_cpu(pid)
                        if mode == "coordinator":
                            async with LookupCoordinator(LAYOUT, store) as coordinator:
                                lookup = coordinator_lookup(coordinator)

                                run = await drive(requests, lookup, 256)
                                stats = coordinator.stats()
                            counts = {"rpcs": stats.rpcs_total, "keys": stats.keys_sent_total}
                        else:
                            run = await drive(requests, baselines(raw, counts)[mode], 256)
                        n = len(requests)
                        run["own_cpu"] = (time.process_time() - own) / n
                        run["master_cpu"] = (_process_cpu(pid) - theirs) / n
                        run["rpcs"] = counts["rpcs"] / n
                        run["keys"] = counts["keys"] / n
                        if reference is None:
                            reference = run["hits"]
                        if run["hits"] != reference:
                            raise SystemExit(f"{mode} gave different hits")
                        runs[mode].append(run)
                        print(f"  rep {rep} {mode}: {run['rate']:,.0f} lookups/s, "
                              f"{run['rpcs']:.3f} RPCs/lookup", file=sys.stderr)
        finally:
            raw.close_blocking()
    assert reference is not None
    elapsed = time.perf_counter() - started
    return report(args, runs, reference, requests, elapsed)


def report(
    args: argparse.Namespace,
    runs: dict[str, list[dict[str, Any]]],
    hits: list[int],
    requests: list[np.ndarray],
    elapsed: float,
) -> str:
    def med(mode: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[mode])

    rows = [
        "| mode | lookups/s (min-max) | p50 ms | p99 ms | RPCs/lookup | keys/lookup | "
        "CPU us/lookup, ours | CPU us/lookup, master | vs seed-naive | vs per-request |",
        "|" + "---|" * 10,
    ]
    for mode in MODES:
        rates = [run["rate"] for run in runs[mode]]
        ratios = []
        for base in ("seed-naive", "per-request"):
            if mode == base:
                ratios.append("1.0x")
            elif MODES.index(mode) < MODES.index(base):
                ratios.append("")
            else:
                paired = [a["rate"] / b["rate"] for a, b in zip(runs[mode], runs[base])]
                ratios.append(f"**{med(mode, 'rate') / med(base, 'rate'):.1f}x** "
                              f"({min(paired):.1f}-{max(paired):.1f}x)")
        rows.append(
            f"| {mode} | {med(mode, 'rate'):,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) | "
            f"{med(mode, 'p50'):.2f} | {med(mode, 'p99'):.2f} | {med(mode, 'rpcs'):.3f} | "
            f"{med(mode, 'keys'):.1f} | {med(mode, 'own_cpu') * 1e6:,.0f} | "
            f"{med(mode, 'master_cpu') * 1e6:,.0f} | {ratios[0]} | {ratios[1]} |"
        )
    m = _timing.machine()
    share = sum(hits) / sum(len(t) for t in requests)
    return "\n".join([
        "## SGLang HiCache lookups from token ids (bench_sglang)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {m['nproc']} vCPU {m['cpu']}, {m['python']}; "
        f"a real `mooncake_master` on 127.0.0.1; uvloop. Command: `python "
        f"benchmarks/bench_sglang.py{' --quick' if args.quick else ''} --reps {args.reps}` "
        f"({elapsed:.0f} s). {len(requests):,} requests, 256 concurrent; SGLang 0.5.23, page "
        "64, TP 2 (MHA), 32 stored documents of 4,096 tokens, each request a document up to a "
        "random cut, then its own tokens. Every mode hashes the token ids (the coordinator on its "
        "worker thread: `lookup_tokens`). Medians over "
        f"{args.reps} repetitions, the modes taking turns; in brackets the repetitions' range. "
        f"Hits identical in all {len(MODES) * args.reps} runs; hit tokens / request tokens = "
        f"{share:.1%}.",
        "",
        *rows,
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only")
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
    raise SystemExit(main())
