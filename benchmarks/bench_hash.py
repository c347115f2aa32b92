"""Block hashing speed: ``BlockHasher.hash`` against vLLM's per-block loop, same tokens.

The baseline is vLLM's chain written from ``/work/shared/docs/block-hashing.md`` (section 1.3):
for every full block, ``hashlib.sha256(serialize((parent, tuple(block tokens), None)))``,
serialize being ``pickle.dumps(obj, protocol=5)`` (``sha256``) or
``cbor2.dumps(obj, canonical=True)`` (``sha256_cbor``), parent = NONE_HASH for block 0. Ours:
``BlockHasher(h, algo=..., seed="0").hash(tokens)``, with the tokens as the same Python list and
as a 1-D int64 array. Before timing, every process checks that all three give identical
hashes.

Workloads: H1 4,096 tokens, hash block 16 (256 hashes); H2 131,072 tokens, hash block 4
(32,768 hashes). Token ids are uniform in [0, 151,936) (a Qwen-sized vocabulary), so pickle
mixes BININT1, BININT2 and BININT records and CBOR mixes 1-, 2-, 3- and 5-byte ints.

Method, two regimes, both with the contenders taking turns (baseline, ours on the list, ours on
the array, SHA-256 alone): *back to back*, a router hashing prompt after prompt (samples of
``batch`` calls in a row, the collector left to run as it would), and *after a collection*,
``gc.collect()`` before each single call, which leaves the caches cold (fixed costs count most
there); the targets apply to both. Warm-up calls first; the median per process; 3 processes; each
figure is the median of the per-process medians (min-max).

Usage: ``python benchmarks/bench_hash.py [--quick] [--processes N] [--no-write]``. It rewrites
its own section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import cbor2
import numpy as np

if __package__:
    from . import _timing
else:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _timing  # type: ignore[no-redef,import-not-found]

from aio_mclookup import BlockHasher

SECTION = "bench_hash"
SCRIPT = Path(__file__).resolve()
VOCAB = 151_936
WORKLOADS: dict[str, dict[str, Any]] = {
    "H1": {
        "title": "H1 4,096 tok, h=16", "tokens": 4096, "block": 16,
        "warmup": 10, "runs": 61, "batch": 10,
    },
    "H2": {
        "title": "H2 131,072 tok, h=4", "tokens": 131_072, "block": 4,
        "warmup": 2, "runs": 11, "batch": 1,
    },
}
ALGOS: dict[str, dict[str, Any]] = {
    "sha256": {"target": 3.0},  # issue 35, in both regimes
    "sha256_cbor": {"target": 5.0},
}
CONTENDERS = ("baseline", "ours_list", "ours_array", "sha_only")
REGIMES = {
    "steady": "back to back",
    "cold": "after a collection",
}


def _pickle(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: object) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def vllm_loop(
    tokens: list[int], block: int, none_hash: bytes, serialize: Callable[[object], bytes]
) -> list[bytes]:
    """vLLM's chain, one block at a time (the baseline)."""
    out = []
    parent = none_hash
    for start in range(0, len(tokens) - block + 1, block):
        payload = serialize((parent, tuple(tokens[start : start + block]), None))
        parent = hashlib.sha256(payload).digest()
        out.append(parent)
    return out


# ------------------------------------------------------------------------------ worker side
def _no_mark() -> None:
    """The ``mark`` of a call timed whole (back to back)."""


def worker(names: list[str], algos: list[str], quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        wl = WORKLOADS[name]
        rng = np.random.default_rng(sum(map(ord, name)) * 7919)
        array = rng.integers(0, VOCAB, size=wl["tokens"], dtype=np.int64)
        tokens = array.tolist()
        for algo in algos:
            hasher = BlockHasher(wl["block"], algo=algo, seed="0")
            serialize = _cbor if algo.endswith("_cbor") else _pickle
            want = vllm_loop(tokens, wl["block"], hasher.none_hash, serialize)
            for form in (tokens, array):
                if [bytes(row) for row in hasher.hash(form)] != want:
                    raise SystemExit(f"{name} {algo}: hashes differ from vLLM's loop")

            def baseline(
                mark: Callable[[], None],
                ids: list[int] = tokens,
                block: int = wl["block"],
                none_hash: bytes = hasher.none_hash,
                s: Callable[[object], bytes] = serialize,
            ) -> None:
                vllm_loop(ids, block, none_hash, s)
                mark()

            def ours(form: Any, h: BlockHasher = hasher) -> Callable[[Callable[[], None]], None]:
                def call(mark: Callable[[], None]) -> None:
                    h.hash(form)
                    mark()

                return call

            # about the floor of any chain that calls hashlib once per block: the same
            # payloads, already serialised (with the right parents), hashed one after another
            parents = [hasher.none_hash, *want[:-1]]
            payloads = [
                serialize((p, tuple(tokens[i * wl["block"] : (i + 1) * wl["block"]]), None))
                for i, p in enumerate(parents)
            ]

            def sha_only(mark: Callable[[], None], ps: list[bytes] = payloads) -> None:
                sha256 = hashlib.sha256
                for p in ps:
                    sha256(p).digest()
                mark()

            calls = {
                "baseline": baseline,
                "ours_list": ours(tokens),
                "ours_array": ours(array),
                "sha_only": sha_only,
            }
            warmup, runs = (1, 3) if quick else (wl["warmup"], wl["runs"])
            batch = 1 if quick else wl["batch"]
            steady = _timing.time_back_to_back(
                {who: functools.partial(fn, _no_mark) for who, fn in calls.items()},
                warmup=warmup,
                runs=runs,
                batch=batch,
            )
            cold = _timing.time_interleaved(calls, warmup=warmup, runs=runs)
            out[f"{name}/{algo}"] = {
                "hashes": len(want),
                "warmup": warmup,
                "runs": runs,
                "batch": batch,
                "medians": {
                    "steady": {who: statistics.median(ts) for who, ts in steady.items()},
                    "cold": {
                        who: statistics.median(t[0] for t in ts) for who, ts in cold.items()
                    },
                },
            }
    return out


# ------------------------------------------------------------------------------ parent side
def _cell(values: list[float]) -> str:
    s = _timing.spread(values)
    return f"**{_timing.fmt_ms(s.median)}** ({_timing.fmt_ms(s.low)}-{_timing.fmt_ms(s.high)})"


def report(results: list[dict[str, Any]], keys: list[str], command: str, elapsed: float) -> str:
    m = _timing.machine()
    first = results[0]

    def per_process(regime: str, key: str, who: str) -> list[float]:
        return [r[key]["medians"][regime][who] for r in results]

    def ratios(regime: str, key: str, who: str) -> list[float]:
        return [
            r[key]["medians"][regime]["baseline"] / r[key]["medians"][regime][who]
            for r in results
        ]

    def table(regime: str, with_target: bool) -> list[str]:
        rows = [
            "| workload | algo | hashes | baseline (vLLM loop) | ours, list | x | ours, array | x "
            + ("| target " if with_target else "")
            + "| SHA-256 calls alone | x bound |",
            "|---|---|---|---|---|---|---|---|" + ("---|" if with_target else "") + "---|---|",
        ]
        for key in keys:
            name, algo = key.split("/")
            target = ALGOS[algo]["target"]
            base = statistics.median(per_process(regime, key, "baseline"))
            cells = []
            met = []
            for who, form in (("ours_list", "list"), ("ours_array", "array")):
                x = base / statistics.median(per_process(regime, key, who))
                rs = ratios(regime, key, who)
                cells.append(
                    f"{_cell(per_process(regime, key, who))} | {x:.2f} "
                    f"({min(rs):.2f}-{max(rs):.2f})"
                )
                met.append(f"{form} {'met' if x >= target else '**missed**'}")
            goal = f"| >= {target:g}x ({', '.join(met)}) " if with_target else ""
            rows.append(
                f"| {WORKLOADS[name]['title']} | `{algo}` | {first[key]['hashes']:,} "
                f"| {_cell(per_process(regime, key, 'baseline'))} | {cells[0]} | {cells[1]} "
                f"{goal}| {_cell(per_process(regime, key, 'sha_only'))} "
                f"| {statistics.median(ratios(regime, key, 'sha_only')):.2f} |"
            )
        return rows

    lines = [
        "## Block hashing (bench_hash)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {m['nproc']} vCPU {m['cpu']} ({m['os']}), "
        f"{m['python']}, numpy {m['numpy']}, cbor2 {metadata.version('cbor2')}. "
        f"Command: `{command}` ({elapsed:.0f} s). Path: {_path()}.",
        "",
        "Both sides in the same run, the same processes, on the same tokens, taking turns. "
        "**Baseline**: vLLM's per-block chain written from the recipe "
        "(`hashlib.sha256(serialize((parent, tuple(block tokens), None)))` per block, "
        "`pickle.dumps(..., protocol=5)` or `cbor2.dumps(..., canonical=True)`), tokens as a "
        "Python list. **Ours**: `BlockHasher(h, algo=..., seed='0').hash(tokens)` on the same "
        "list, and on the same ids as a 1-D int64 array (which skips converting the list). "
        "Token ids uniform in [0, 151,936). Every process checked that the three give identical "
        "hashes before timing. *SHA-256 calls alone* times only the "
        "`hashlib.sha256(payload).digest()` calls over the same payloads, serialised "
        "beforehand: about the floor of any chain that hashes block by block in Python, so "
        "*x bound* (baseline over it) is about the most such a chain can reach.",
        "",
        "Two regimes, the targets applying to both. **Back to back** (a router hashing prompt "
        "after prompt): samples of "
        + " and ".join(
            f"{first[k]['batch']} ({name})"
            for name, k in {k.split("/")[0]: k for k in keys}.items()
        )
        + " calls in a row, the collector left to run as in use (no forced collection), the "
        "contenders taking turns sample by sample. **After a collection**: `gc.collect()` "
        "before each single call, the contenders taking turns call by call; the collection "
        "leaves the caches cold, so every call pays its first-touch costs (numpy's dispatch, "
        "OpenSSL's code), which weigh most on a short prompt. Per regime and contender "
        + ", ".join(
            f"{k} {first[k]['warmup']} warm-up + {first[k]['runs']} timed" for k in keys
        )
        + f" samples; median per process; {len(results)} separate processes; each cell is "
        "the median of the per-process medians (min-max). Times in ms per call; x is the "
        "baseline's median over ours (min-max of the per-process ratios in parentheses).",
        "",
        "Back to back:",
        "",
        *table("steady", with_target=True),
        "",
        "After a collection (cold caches):",
        "",
        *table("cold", with_target=True),
        "",
        "Time beyond the SHA-256 calls, back to back (median of per-process medians minus "
        "*SHA-256 calls alone*, ms; per block in parentheses, in us): what each side spends "
        "serialising, converting and looping.",
        "",
        "| workload | algo | baseline | ours, list | ours, array |",
        "|---|---|---|---|---|",
    ]
    for key in keys:
        name, algo = key.split("/")
        floor = statistics.median(per_process("steady", key, "sha_only"))
        blocks = first[key]["hashes"]
        cells = []
        for who in ("baseline", "ours_list", "ours_array"):
            extra = statistics.median(per_process("steady", key, who)) - floor
            cells.append(f"{_timing.fmt_ms(extra)} ({extra / blocks * 1e6:.2f})")
        lines.append(f"| {WORKLOADS[name]['title']} | `{algo}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _path() -> str:
    """Which of BlockHasher's two paths this run took (docs/design.md, "Compiled extensions")."""
    from aio_mclookup._hashing import _hasher

    if _hasher._C is not None:
        return "compiled (the C chain, `_hashing/_chain_c.c`)"
    return "pure Python (`AIO_MCLOOKUP_NO_EXTENSIONS=1` or not built)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke mode: 1 process, 1 warm-up + 3 timed calls, no doc update")
    parser.add_argument("--processes", type=int, default=None,
                        help="separate processes (default 3, 1 with --quick)")
    parser.add_argument("--only", action="append", choices=sorted(WORKLOADS),
                        help="run only these workloads (repeatable)")
    parser.add_argument("--algo", action="append", choices=sorted(ALGOS),
                        help="run only these algorithms (repeatable)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = args.only or list(WORKLOADS)
    algos = args.algo or list(ALGOS)
    if args.worker:
        print(json.dumps(worker(names, algos, args.quick)))
        return 0
    processes = args.processes or (1 if args.quick else 3)
    worker_args = ["--worker", *(f"--only={n}" for n in names), *(f"--algo={a}" for a in algos)]
    if args.quick:
        worker_args.append("--quick")
    started = time.perf_counter()
    results = _timing.run_processes(SCRIPT, worker_args, processes)
    elapsed = time.perf_counter() - started
    command = "python benchmarks/bench_hash.py" + "".join(
        f" {a}" for a in sys.argv[1:] if a != "--no-write"
    )
    keys = [f"{n}/{a}" for n in names for a in algos]
    text = report(results, keys, command, elapsed)
    print(text)
    if not (args.no_write or args.quick):
        _timing.write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
