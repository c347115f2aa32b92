"""Planning speed: ``layout.plan`` + ``plan.keys`` + ``plan.resolve`` against vLLM 0.26's lookup.

The reference is ``aio_mclookup._reference.BaselineLookup``, the literal pure-Python port of vLLM
0.26.0's worker-side lookup (validated on every public conformance case): ``build_keys`` (the
candidate-key loop) then ``resolve`` (the exists set + the coordinator's hit search), with the
hashes as a ``list[bytes]``, its faster input form. Ours is measured twice in the same run: on
the same ``list[bytes]``, and on a 2-D ``uint8`` array (the zero-copy blob form vLLM's lookup
server receives).

Workloads (as ``/work/shared/docs/vllm-timing.md``):

* W1: one full-attention group B=16, h=L=16, 4,096 tokens, 256 hashes;
* W2: DSv4-like (full 256, SWA 64/W128, SWA 4/W8, SWA 8/W128, h=4, L=256), 131,072 tokens,
  32,768 hashes;
* W3: the same at 1,048,576 tokens, 262,144 hashes.

Hashes are 32 random bytes. The store answers for a 50 % prefix hit: a producer stored, densely,
every chunk of every group ending within the first half of the request (answer 1 for a key whose
hash unit index is < token_len / 2 / h, else 0). Before timing, every process checks that both
sides build the same keys and find the same hit, token_len / 2.

Method: ``gc.collect()`` before each call (collector enabled), warm-up calls, then timed calls,
each contender's in a block (``--interleave``: taking turns call by call); the median per
process; 3 processes; each figure is the median of the per-process medians (min-max in
parentheses).

Usage: ``python benchmarks/bench_plan.py [--quick] [--processes N] [--no-write]``. It rewrites
its own section of ``docs/benchmarks.md``.

``--vllm 0.33`` runs the same workloads with vLLM 0.33 layouts (``"vllm_version": "0.33.0"``,
the request's ``num_tokens`` = token_len + 1, unaligned) against
``aio_mclookup._reference.v033.BaselineLookupV033``, the slow port of vLLM 0.33.0's lookup
written from its specification (validated on every public 0.33 and 0.32 conformance case); ours
is ``layout.plan(num_tokens, hashes)`` + ``plan.keys`` + ``plan.resolve_result(answers)``. It
writes its own section (``bench_plan_v033``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

if __package__:
    from . import _timing
else:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _timing  # type: ignore[no-redef,import-not-found]

from aio_mclookup import KVLayout
from aio_mclookup._loadgen.workload import PRESETS
from aio_mclookup._reference.v026 import BaselineLookup
from aio_mclookup._reference.v033 import BaselineLookupV033

SECTION = "bench_plan"
SECTION_V033 = "bench_plan_v033"
SCRIPT = Path(__file__).resolve()

# full 256, SWA 64/W128, SWA 4/W8, SWA 8/W128; h=4, L=256 (these workloads are vLLM 0.26's:
# layouts default to the latest release)
DSV4 = dict(PRESETS["dsv4"], vllm_version="0.26.0")
WORKLOADS: dict[str, dict[str, Any]] = {
    "W1": {
        "title": "W1 single full B=16, h=L=16, 4,096 tok",
        "config": {
            "model": "test-model",
            "hash_block_size": 16,
            "scheduler_block_size": 16,
            "groups": [{"kind": "full_attention", "block_size": 16}],
            "vllm_version": "0.26.0",
        },
        "token_len": 4096,
        "warmup": 5,
        "runs": 31,
        "target": 3.0,
    },
    "W2": {
        "title": "W2 DSv4-like, 131,072 tok",
        "config": DSV4,
        "token_len": 131_072,
        "warmup": 3,
        "runs": 15,
        "target": 10.0,
    },
    "W3": {
        "title": "W3 DSv4-like, 1,048,576 tok",
        "config": DSV4,
        "token_len": 1_048_576,
        "warmup": 2,
        "runs": 9,
        "target": 10.0,
    },
}
CONTENDERS = ("reference", "ours_list", "ours_array")
V033 = "0.33"
"""``--vllm 0.33``: the same workloads on vLLM 0.33 layouts, against the 0.33 oracle."""


def workload_config(name: str, vllm: str) -> dict[str, Any]:
    cfg: dict[str, Any] = dict(WORKLOADS[name]["config"])
    if vllm == V033:
        cfg["vllm_version"] = "0.33.0"
    return cfg
HASH_WIDTH = 32


# ------------------------------------------------------------------------------ worker side
def make_hashes(name: str, count: int) -> tuple[list[bytes], np.ndarray]:
    """``count`` random 32-byte hashes, as a list of bytes and as a (count, 32) uint8 array."""
    rng = np.random.default_rng(sum(map(ord, name)) * 7919)
    rows = rng.integers(0, 256, size=(count, HASH_WIDTH), dtype=np.uint8)
    blob = rows.tobytes()
    hashes = [blob[i : i + HASH_WIDTH] for i in range(0, len(blob), HASH_WIDTH)]
    return hashes, rows


def prefix_answers(layout: KVLayout, token_len: int, hashes: Any) -> list[int]:
    """The store's answers, per key in plan order, for a producer that stored every chunk of
    every group ending within the first half of the request."""
    plan = layout.plan(token_len, hashes)
    h = layout.hash_block_size
    cutoff = token_len // 2 // h
    parts = []
    for probe in plan.groups:
        k = len(layout.key_prefixes[probe.group_id])
        stride = layout.groups[probe.group_id].block_size // h
        units = probe.chunks * stride + (stride - 1)
        parts.append(np.repeat(units < cutoff, k))
    answers: list[int] = np.concatenate(parts).astype(np.int64).tolist()
    return answers


def contenders(
    layout: KVLayout,
    ref: BaselineLookup | BaselineLookupV033,
    token_len: int,
    hashes: list[bytes],
    rows: np.ndarray,
    answers: list[int],
) -> dict[str, Callable[[Callable[[], None]], Any]]:
    """The reference loop and ours (list and array input), each timed in two phases: keys,
    then resolve (vLLM 0.33's whole result where the reference is 0.33's)."""
    whole_result = isinstance(ref, BaselineLookupV033)

    def reference(mark: Callable[[], None]) -> None:
        _keys, meta = ref.build_keys(token_len, hashes)
        mark()
        ref.resolve(token_len, hashes, meta, answers)
        mark()

    def ours(block_hashes: Any) -> Callable[[Callable[[], None]], None]:
        def call(mark: Callable[[], None]) -> None:
            plan = layout.plan(token_len, block_hashes)
            plan.keys  # noqa: B018 - assembling the keys is part of the work
            mark()
            if whole_result:
                plan.resolve_result(answers)
            else:
                plan.resolve(answers)
            mark()

        return call

    return {"reference": reference, "ours_list": ours(hashes), "ours_array": ours(rows)}


def verify(
    layout: KVLayout,
    ref: BaselineLookup,
    token_len: int,
    hashes: list[bytes],
    rows: np.ndarray,
    answers: list[int],
) -> dict[str, int]:
    """Both sides build the same keys and find the same hit, token_len / 2."""
    ref_keys, meta = ref.build_keys(token_len, hashes)
    want = token_len // 2
    for form in (hashes, rows):
        plan = layout.plan(token_len, form)
        if [k.decode() for k in plan.keys] != ref_keys:
            raise SystemExit("keys differ from the reference")
        if plan.resolve(answers) != want:
            raise SystemExit(f"our hit {plan.resolve(answers)} != {want}")
    if ref.resolve(token_len, hashes, meta, answers) != want:
        raise SystemExit("the reference hit is not token_len / 2")
    return {"keys": len(ref_keys), "hashes": len(hashes), "hit": want}


def verify_v033(
    layout: KVLayout,
    ref: BaselineLookupV033,
    num_tokens: int,
    hashes: list[bytes],
    rows: np.ndarray,
    answers: list[int],
) -> dict[str, int]:
    """Both sides build the same keys and find the same result, a hit of token_len / 2."""
    ref_keys, meta = ref.build_keys(num_tokens, hashes)
    want = ref.resolve(num_tokens, hashes, meta, answers)
    if want.hit_length != (num_tokens - 1) // 2:
        raise SystemExit(f"the reference hit {want.hit_length} is not token_len / 2")
    for form in (hashes, rows):
        plan = layout.plan(num_tokens, form)
        if [k.decode() for k in plan.keys] != ref_keys:
            raise SystemExit("keys differ from the reference")
        if plan.resolve_result(answers).to_bytes() != want.to_bytes():
            raise SystemExit("our result differs from the reference")
    return {"keys": len(ref_keys), "hashes": len(hashes), "hit": want.hit_length}


def worker(names: list[str], quick: bool, interleave: bool, vllm: str = "0.26") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        wl = WORKLOADS[name]
        cfg, token_len = workload_config(name, vllm), wl["token_len"]
        layout = KVLayout.from_dict(cfg)
        hashes, rows = make_hashes(name, token_len // cfg["hash_block_size"])
        warmup, runs = (1, 3) if quick else (wl["warmup"], wl["runs"])
        if vllm == V033:
            num_tokens = token_len + 1  # what vLLM 0.33's scheduler sends: unaligned
            ref33 = BaselineLookupV033(cfg)
            answers = prefix_answers(layout, num_tokens, hashes)
            facts = verify_v033(layout, ref33, num_tokens, hashes, rows, answers)
            calls = contenders(layout, ref33, num_tokens, hashes, rows, answers)
        else:
            ref = BaselineLookup(cfg)
            answers = prefix_answers(layout, token_len, hashes)
            facts = verify(layout, ref, token_len, hashes, rows, answers)
            calls = contenders(layout, ref, token_len, hashes, rows, answers)
        if interleave:
            timings = _timing.time_interleaved(calls, warmup=warmup, runs=runs)
        else:
            timings = {
                who: _timing.time_phases(call, warmup=warmup, runs=runs)
                for who, call in calls.items()
            }
        medians = {
            who: {
                "keys": statistics.median(t[0] for t in runs_),
                "resolve": statistics.median(t[1] for t in runs_),
                "total": statistics.median(t[0] + t[1] for t in runs_),
            }
            for who, runs_ in timings.items()
        }
        out[name] = {"facts": facts, "medians": medians, "runs": runs, "warmup": warmup}
    return out


# ------------------------------------------------------------------------------ parent side
def _cell(values: list[float]) -> str:
    s = _timing.spread(values)
    return f"**{_timing.fmt_ms(s.median)}** ({_timing.fmt_ms(s.low)}-{_timing.fmt_ms(s.high)})"


def report(
    results: list[dict[str, Any]],
    names: list[str],
    command: str,
    elapsed: float,
    interleave: bool,
    vllm: str = "0.26",
) -> str:
    m = _timing.machine()
    first = results[0]

    def per_process(name: str, who: str, phase: str) -> list[float]:
        return [r[name]["medians"][who][phase] for r in results]

    def ratio(name: str, who: str, phase: str = "total") -> float:
        ref = statistics.median(per_process(name, "reference", phase))
        return ref / statistics.median(per_process(name, who, phase))

    if vllm == V033:
        return report_v033(results, names, command, elapsed, per_process, ratio)
    lines = [
        "## Planning (bench_plan)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {m['nproc']} vCPU {m['cpu']} ({m['os']}), "
        f"{m['python']}, numpy {m['numpy']}. Command: `{command}` ({elapsed:.0f} s).",
        "",
        "Both sides were measured in the same run, in the same processes, on the same inputs ("
        + ("taking turns call by call" if interleave else "each contender's calls in a block: "
           "reference, ours on `list[bytes]`, ours on the array")
        + "). **Reference**: `aio_mclookup._reference.BaselineLookup`, the "
        "literal port of vLLM 0.26.0's worker lookup (`build_keys` + `resolve`), hashes as "
        "`list[bytes]` (its faster form). **Ours**: `layout.plan(token_len, hashes)` + "
        "`plan.keys` + `plan.resolve(answers)`, with the same `list[bytes]` and with a 2-D "
        "`uint8` array (the zero-copy blob form). Store answers: a 50 % prefix (every chunk of "
        "every group ending in the first half stored); every process checked that both sides "
        "build the same keys and find the same hit, token_len / 2, before timing.",
        "",
        "Method: `gc.collect()` before each call (collector enabled); per contender "
        + ", ".join(f"{n} {first[n]['warmup']} warm-up + {first[n]['runs']} timed" for n in names)
        + f" calls; median per process; {len(results)} separate processes; each cell is the "
        "median of the "
        "per-process medians (min-max). Times in ms; x is the reference's median over ours.",
        "",
        "| workload | hashes | keys | hit | reference (vLLM 0.26 port) | ours, list[bytes] | x "
        "| ours, 2-D uint8 | x | target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        facts = first[name]["facts"]
        target = WORKLOADS[name]["target"]
        met = ", ".join(
            f"{form} {'met' if ratio(name, who) >= target else '**missed**'}"
            for form, who in (("list", "ours_list"), ("array", "ours_array"))
        )
        lines.append(
            f"| {WORKLOADS[name]['title']} | {facts['hashes']:,} | {facts['keys']:,} "
            f"| {facts['hit']:,} | {_cell(per_process(name, 'reference', 'total'))} "
            f"| {_cell(per_process(name, 'ours_list', 'total'))} "
            f"| {ratio(name, 'ours_list'):.1f} "
            f"| {_cell(per_process(name, 'ours_array', 'total'))} "
            f"| {ratio(name, 'ours_array'):.1f} | >= {target:g}x ({met}) |"
        )
    lines += [
        "",
        "Per phase (median of per-process medians, ms): *keys* is the reference's `build_keys` "
        "vs our `plan` + `keys`; *resolve* is the answers → hit part.",
        "",
        "| workload | phase | reference | ours, list[bytes] | x | ours, 2-D uint8 | x |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += _phase_rows(names, per_process, ratio)
    return "\n".join(lines)


def _phase_rows(
    names: list[str],
    per_process: Callable[[str, str, str], list[float]],
    ratio: Callable[..., float],
) -> list[str]:
    """The per-phase table's rows (keys, resolve) of every workload."""
    rows = []
    for name in names:
        for phase in ("keys", "resolve"):
            cells = {
                who: statistics.median(per_process(name, who, phase)) for who in CONTENDERS
            }
            rows.append(
                f"| {name} | {phase} | {_timing.fmt_ms(cells['reference'])} "
                f"| {_timing.fmt_ms(cells['ours_list'])} | {ratio(name, 'ours_list', phase):.1f} "
                f"| {_timing.fmt_ms(cells['ours_array'])} "
                f"| {ratio(name, 'ours_array', phase):.1f} |"
            )
    return rows


def report_v033(
    results: list[dict[str, Any]],
    names: list[str],
    command: str,
    elapsed: float,
    per_process: Callable[[str, str, str], list[float]],
    ratio: Callable[..., float],
) -> str:
    m = _timing.machine()
    first = results[0]
    lines = [
        "## Planning, vLLM 0.33 (bench_plan --vllm 0.33)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {m['nproc']} vCPU {m['cpu']} ({m['os']}), "
        f"{m['python']}, numpy {m['numpy']}. Command: `{command}` ({elapsed:.0f} s).",
        "",
        "The workloads of the section above on vLLM 0.33 layouts (`\"vllm_version\": "
        "\"0.33.0\"`), each request's `num_tokens` one more than the aligned length (as vLLM "
        "0.33's scheduler sends it). **Reference**: "
        "`aio_mclookup._reference.v033.BaselineLookupV033`, a faithful, unoptimised port of "
        "vLLM 0.33.0's worker lookup written from its specification (`build_keys` + "
        "`resolve`), hashes as `list[bytes]`. **Ours**: `layout.plan(num_tokens, hashes)` + "
        "`plan.keys` + `plan.resolve_result(answers)` (hit and tail-key boundaries), on the "
        "same `list[bytes]` and on a 2-D `uint8` array. Same store answers (a 50 % prefix) and "
        "method as above; every process checked that both sides build the same keys and the "
        "same result (wire bytes) before timing; "
        + ", ".join(f"{n} {first[n]['warmup']} warm-up + {first[n]['runs']} timed" for n in names)
        + f" calls, {len(results)} processes. Times in ms; x is the reference's median over ours.",
        "",
        "| workload | hashes | keys | hit | reference (vLLM 0.33 port) | ours, list[bytes] | x "
        "| ours, 2-D uint8 | x |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        facts = first[name]["facts"]
        lines.append(
            f"| {WORKLOADS[name]['title']} | {facts['hashes']:,} | {facts['keys']:,} "
            f"| {facts['hit']:,} | {_cell(per_process(name, 'reference', 'total'))} "
            f"| {_cell(per_process(name, 'ours_list', 'total'))} "
            f"| {ratio(name, 'ours_list'):.1f} "
            f"| {_cell(per_process(name, 'ours_array', 'total'))} "
            f"| {ratio(name, 'ours_array'):.1f} |"
        )
    lines += [
        "",
        "| workload | phase | reference | ours, list[bytes] | x | ours, 2-D uint8 | x |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += _phase_rows(names, per_process, ratio)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke mode: 1 process, 1 warm-up + 3 timed calls, no doc update")
    parser.add_argument("--processes", type=int, default=None,
                        help="separate processes (default 3, 1 with --quick)")
    parser.add_argument("--only", action="append", choices=sorted(WORKLOADS),
                        help="run only these workloads (repeatable)")
    parser.add_argument("--interleave", action="store_true",
                        help="take turns call by call instead of timing each contender's calls "
                        "in a block (each call then starts with caches the other one filled)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--vllm", choices=("0.26", V033), default="0.26",
                        help="whose lookup rules: 0.26 (default) or 0.33, against that "
                        "release's oracle (its own section of docs/benchmarks.md)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = args.only or list(WORKLOADS)
    if args.worker:
        print(json.dumps(worker(names, args.quick, args.interleave, args.vllm)))
        return 0
    processes = args.processes or (1 if args.quick else 3)
    worker_args = ["--worker", *(f"--only={n}" for n in names)]
    if args.quick:
        worker_args.append("--quick")
    if args.interleave:
        worker_args.append("--interleave")
    if args.vllm != "0.26":
        worker_args.append(f"--vllm={args.vllm}")
    started = time.perf_counter()
    results = _timing.run_processes(SCRIPT, worker_args, processes)
    elapsed = time.perf_counter() - started
    command = "python benchmarks/bench_plan.py" + "".join(
        f" {a}" for a in sys.argv[1:] if a != "--no-write"
    )
    text = report(results, names, command, elapsed, args.interleave, args.vllm)
    print(text)
    if not (args.no_write or args.quick):
        _timing.write_section(SECTION_V033 if args.vllm == V033 else SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
