"""How the coordinator's knobs move throughput, against a real master: the evidence behind
the defaults (``max_rpcs_in_flight=2``, ``max_keys_per_rpc=1000``, ``probe_window=16``,
``linger=0``).

Workloads from ``bench_coalesce``: chat (one full-attention group, 2,048 requests sharing 64
cached 4,096-token prompts up to a random cut, 256 concurrent callers) and dsv4 (128
131,072-token requests over 4 cached documents, 32 callers). One knob varies at a time, the
others at their defaults; each setting runs ``--reps`` times (fresh coordinator each time),
interleaved with the others, and the median lookups/s is reported.

Usage: ``python benchmarks/bench_knobs.py [--reps N] [--no-write]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__:
    from . import _timing
    from .bench_coalesce import Scenario, build
else:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _timing  # type: ignore[no-redef,import-not-found]
    from bench_coalesce import Scenario, build  # type: ignore[import-not-found,no-redef]

from aio_mclookup import LocalMaster, LookupCoordinator, MooncakeStore, StoreWriter
from aio_mclookup._loadgen.results import LoadgenConfig, RunResult
from aio_mclookup._loadgen.run import Progress, drive
from aio_mclookup._loadgen.workload import WorkloadSpec, preset_layout

SECTION = "bench_knobs"
DEFAULTS: dict[str, Any] = {
    "max_rpcs_in_flight": 2,
    "max_keys_per_rpc": 1000,
    "probe_window": 16,
    "linger": 0.0,
}
SWEEPS: dict[str, list[Any]] = {
    "max_rpcs_in_flight": [1, 2, 4, 8],
    "max_keys_per_rpc": [250, 1000, 4000],
    "probe_window": [None, 4, 16, 64],
    "linger": [0.0, 0.0005, 0.002],
}


async def one_run(store: MooncakeStore, sc: Scenario, requests: list[Any], cfg: LoadgenConfig,
                  options: dict[str, Any]) -> RunResult:
    result = RunResult("coordinator", sc.concurrency, len(requests))
    coordinator = LookupCoordinator(cfg.layout, store, **options)

    async def lookup(req: Any) -> int:
        return await coordinator.lookup(req.num_tokens, req.hashes)

    async with coordinator:
        await drive(requests, lookup, result, cfg, asyncio.Event(), Progress(sys.stderr, False))
        stats = coordinator.stats()
    result.rpcs, result.keys_sent = stats.rpcs_total, stats.keys_sent_total
    if result.error_count:
        raise SystemExit(f"errors with {options}: {result.errors}")
    return result


async def sweep(sc: Scenario, reps: int, master: LocalMaster) -> list[str]:
    layout = preset_layout(sc.preset)
    docs, requests = build(layout, sc, seed=11)
    cfg = LoadgenConfig(layout=layout, layout_source=sc.preset, spec=WorkloadSpec(),
                        concurrency=(sc.concurrency,))
    settings = [dict(DEFAULTS)]
    for knob, values in SWEEPS.items():
        settings += [dict(DEFAULTS, **{knob: v}) for v in values if v != DEFAULTS[knob]]
    rates: dict[int, list[float]] = {i: [] for i in range(len(settings))}
    extra: dict[int, tuple[float, float]] = {}
    async with StoreWriter(master.master_address, master.metadata_server,
                           segment_size=256 << 20) as writer:
        for doc in docs:
            await writer.put_keys([k.decode() for k in layout.plan(sc.doc_tokens, doc).keys])
        async with MooncakeStore(master.master_address, master.metadata_server) as store:
            for _ in range(reps):
                for i, options in enumerate(settings):
                    result = await one_run(store, sc, requests, cfg, options)
                    rates[i].append(result.rate())
                    extra[i] = (result.rpcs / result.lookups, result.keys_sent / result.lookups)
    base = statistics.median(rates[0])
    rows = [f"**{sc.name}** ({sc.requests:,} requests, {sc.concurrency} callers)", "",
            "| setting | lookups/s | vs defaults | RPCs/lookup | keys/lookup |",
            "|---|---|---|---|---|"]
    for i, options in enumerate(settings):
        changed = [f"{k}={v}" for k, v in options.items() if v != DEFAULTS[k]] or ["defaults"]
        rate = statistics.median(rates[i])
        rows.append(f"| {', '.join(changed)} | {rate:,.0f} | {rate / base:.2f}x | "
                    f"{extra[i][0]:.3f} | {extra[i][1]:.1f} |")
    return rows


async def main_async(reps: int) -> str:
    scenarios = [
        Scenario("chat", "chat", 64, 4096, 2048, 256),
        Scenario("dsv4", "dsv4", 4, 131072, 128, 32),
    ]
    started = time.perf_counter()
    parts: list[str] = []
    async with LocalMaster() as master:
        for sc in scenarios:
            parts += [*await sweep(sc, reps, master), ""]
    m = _timing.machine()
    return "\n".join([
        "## Coordinator knobs (bench_knobs)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {m['nproc']} vCPU {m['cpu']}, {m['python']}; "
        f"real `mooncake_master` on 127.0.0.1; command `python benchmarks/bench_knobs.py "
        f"--reps {reps}` ({time.perf_counter() - started:.0f} s). One knob at a time, the others "
        f"at their defaults ({', '.join(f'{k}={v}' for k, v in DEFAULTS.items())}); median of "
        f"{reps} interleaved runs each; 'vs defaults' is measured in the same run.",
        "",
        *parts,
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    try:
        import uvloop

        text = uvloop.run(main_async(args.reps))
    except ImportError:
        text = asyncio.run(main_async(args.reps))
    print(text)
    if not args.no_write:
        _timing.write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
