"""Small shared helpers for the benchmark scripts: timing, repeated processes, the results doc.

Method (as in ``/work/shared/docs/vllm-timing.md``): ``gc.collect()`` before every timed call
(the collector stays enabled), warm-up calls, several timed calls, the median per process; the
whole measurement runs in several separate processes and a figure is the median of the
per-process medians, with their min-max.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"

__all__ = [
    "DOC",
    "ROOT",
    "Spread",
    "fmt_ms",
    "machine",
    "run_processes",
    "spread",
    "time_back_to_back",
    "time_interleaved",
    "time_phases",
    "timed_call",
    "write_section",
]


PhasedCall = Callable[[Callable[[], None]], Any]


def timed_call(call: PhasedCall) -> list[float]:
    """One call of ``call(mark)`` after ``gc.collect()``: the durations of its phases, in seconds.

    ``call`` calls ``mark()`` at the end of each phase; the result is
    ``[start->mark1, mark1->mark2, ...]``. Whatever ``call`` frees when it returns is freed
    after its last mark, outside the timed phases.
    """
    stamps: list[float] = []

    def mark() -> None:
        stamps.append(time.perf_counter())

    gc.collect()
    stamps.append(time.perf_counter())
    call(mark)
    return [b - a for a, b in itertools.pairwise(stamps)]


def time_phases(call: PhasedCall, *, warmup: int, runs: int) -> list[list[float]]:
    """``warmup`` untimed then ``runs`` timed calls of :func:`timed_call`."""
    for _ in range(warmup):
        timed_call(call)
    return [timed_call(call) for _ in range(runs)]


def time_interleaved(
    calls: dict[str, PhasedCall], *, warmup: int, runs: int
) -> dict[str, list[list[float]]]:
    """Like :func:`time_phases` for several contenders, taking turns call by call so that a
    slow phase of the machine hits them alike."""
    for _ in range(warmup):
        for call in calls.values():
            timed_call(call)
    out: dict[str, list[list[float]]] = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            out[name].append(timed_call(call))
    return out


def time_back_to_back(
    calls: dict[str, Callable[[], Any]], *, warmup: int, runs: int, batch: int
) -> dict[str, list[float]]:
    """Per-call seconds of each contender in steady use: ``batch`` calls back to back per
    sample, the collector left to run as it would (no forced collection); contenders take
    turns sample by sample. Returns each contender's ``runs`` samples (batch time / batch)."""
    for _ in range(warmup):
        for call in calls.values():
            for _ in range(batch):
                call()
    out: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            started = time.perf_counter()
            for _ in range(batch):
                call()
            out[name].append((time.perf_counter() - started) / batch)
    return out


@dataclass(frozen=True)
class Spread:
    """The median of per-process medians, with the min and max of those medians."""

    median: float
    low: float
    high: float


def spread(per_process: Sequence[float]) -> Spread:
    return Spread(statistics.median(per_process), min(per_process), max(per_process))


def fmt_ms(seconds: float) -> str:
    """Milliseconds with three significant digits."""
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.3f}"


def run_processes(script: Path, args: Sequence[str], count: int) -> list[Any]:
    """Run ``script args`` in ``count`` fresh interpreters, one after the other; each must print
    one JSON document as its last stdout line."""
    results = []
    env = dict(os.environ)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for i in range(count):
        proc = subprocess.run(
            [sys.executable, str(script), *args],
            check=False,
            capture_output=True,
            text=True,
            env=env,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"worker process {i + 1}/{count} failed ({proc.returncode}):\n{proc.stderr}"
            )
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"  process {i + 1}/{count} done", file=sys.stderr, flush=True)
    return results


def machine() -> dict[str, str]:
    """nproc, CPU model, OS, Python and numpy versions."""
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        import numpy

        numpy_version = numpy.__version__
    except ImportError:  # pragma: no cover
        numpy_version = "not installed"
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "os": f"{platform.system()} {platform.machine()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "numpy": numpy_version,
    }


def write_section(name: str, text: str, doc: Path = DOC) -> None:
    """Replace the text between ``<!-- name:start -->`` and ``<!-- name:end -->`` in ``doc``
    (appending the section when it is not there yet); every other section is left as is."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{text.strip()}\n{end}"
    current = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if start in current and end in current:
        before, rest = current.split(start, 1)
        current = before + block + rest.split(end, 1)[1]
    else:
        current = current.rstrip("\n") + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(current)
