"""The coordinator's old code against its new code, paired in one sitting: what a change to the
hot path bought, measured as the same workloads on the same machine at the same time.

The old code is a git revision (``--old``, e.g. the commit before a change), checked out into a
temporary worktree with its compiled extensions built there; the new code is this checkout.
Each pair runs one repetition of ``bench_coalesce.py --only SCENARIO`` (or of
``bench_sglang.py``) once with each code, the order alternating from pair to pair, each in a
process of its own (``PYTHONPATH`` picks the code; the benchmark scripts are this checkout's).
Per code it reports the coordinator's CPU per lookup (this process's, as those scripts measure
it), its lookups/s, and its ratio to the per-request baseline (vLLM scenarios) or to SGLang's
own way (``sglang``) measured in the same repetition: medians over the pairs, with their range.
These machines drift (the same code gives figures up to twice apart an hour apart), which is
why both codes take turns.

Usage: ``python benchmarks/bench_paired.py --old REV [--only SCENARIO ...] [--pairs N]
[--no-write]``; scenarios are ``bench_coalesce``'s names and ``sglang``. It rewrites its own
section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__:
    from . import _timing
else:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _timing  # type: ignore[no-redef,import-not-found]

ROOT = Path(__file__).resolve().parent.parent
SECTION = "bench_paired"
DEFAULT_SCENARIOS = ("dsv4-0.33", "sessions-hybrid-0.33", "chat-0.33", "chat", "sglang")


@dataclass
class Runs:
    """One code's repetitions of one scenario."""

    cpu: list[float] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _number(text: str) -> float:
    return float(text.split()[0].replace(",", ""))


def parse(scenario: str, text: str) -> tuple[float, float, float]:
    """The coordinator's CPU us/lookup, its lookups/s, and its ratio to the baseline, from one
    repetition's table."""
    rows = {}
    for line in text.splitlines():
        cells = _cells(line) if line.startswith("|") else []
        if scenario == "sglang" and len(cells) == 10 and cells[1][:1].isdigit():
            rows[cells[0]] = (_number(cells[1]), _number(cells[6]))
        elif cells and cells[0] == scenario and len(cells) >= 14:
            rows[cells[3]] = (_number(cells[4]), _number(cells[10]))
    base = "seed-naive" if scenario == "sglang" else "per-request"
    if "coordinator" not in rows or base not in rows:
        raise SystemExit(f"{scenario}: no coordinator or {base} row in:\n{text}")
    rate, cpu = rows["coordinator"]
    return cpu, rate, rate / rows[base][0]


def run_once(scenario: str, src: Path) -> tuple[float, float, float]:
    """One repetition of ``scenario`` with the code in ``src``."""
    if scenario == "sglang":
        command = [sys.executable, str(ROOT / "benchmarks" / "bench_sglang.py")]
    else:
        command = [sys.executable, str(ROOT / "benchmarks" / "bench_coalesce.py"),
                   "--only", scenario]
    env = dict(os.environ, PYTHONPATH=str(src))
    done = subprocess.run([*command, "--reps", "1", "--no-write"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{scenario} failed ({src}):\n{done.stderr[-3000:]}")
    return parse(scenario, done.stdout)


def old_tree(rev: str, into: Path) -> str:
    """Check ``rev`` out into ``into`` and build its extensions there; says how it went."""
    subprocess.run(["git", "worktree", "add", "--detach", str(into), rev], cwd=ROOT, check=True,
                   capture_output=True)
    # Its setup.py, run beside its sources but away from its pyproject.toml (which the
    # virtualenv's setuptools may read otherwise than the isolated build that installed it).
    builder = into.parent / "build"
    builder.mkdir()
    shutil.copy(into / "setup.py", builder / "setup.py")
    (builder / "src").symlink_to(into / "src")
    built = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", "lib", "--build-temp",
         "tmp"], cwd=builder, capture_output=True, text=True,
    )
    extensions = list((builder / "lib").rglob("*.so"))
    for extension in extensions:  # (into the package, beside its modules)
        shutil.copy(extension, into / "src" / extension.relative_to(builder / "lib"))
    if built.returncode or not extensions:
        return "pure Python: its extensions did not build"
    return f"its {len(extensions)} extensions built"


def _median_range(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-" \
           f"{fmt.format(max(values))})"


def report(args: argparse.Namespace, old_how: str, results: dict[str, dict[str, Runs]],
           elapsed: float) -> str:
    m = _timing.machine()
    rows = [
        "| scenario | CPU us/lookup, old | new | new/old | lookups/s, old | new "
        "| vs baseline, old | new |",
        "|" + "---|" * 8,
    ]
    for scenario, both in results.items():
        old, new = both["old"], both["new"]
        change = statistics.median(new.cpu) / statistics.median(old.cpu)
        rows.append(
            f"| {scenario} | {_median_range(old.cpu, '{:,.0f}')} "
            f"| {_median_range(new.cpu, '{:,.0f}')} | {change:.2f} "
            f"| {_median_range(old.rate, '{:,.0f}')} | {_median_range(new.rate, '{:,.0f}')} "
            f"| {_median_range(old.ratio, '{:.1f}x')} | {_median_range(new.ratio, '{:.1f}x')} |"
        )
    command = f"python benchmarks/bench_paired.py --old {args.old}"
    if args.only:
        command += "".join(f" --only {s}" for s in args.only)
    return "\n".join([
        "## Compiled hot path: old code against new (bench_paired)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {m['nproc']} vCPU {m['cpu']}, {m['python']}, "
        f"against a real `mooncake_master` on 127.0.0.1. Command: `{command} --pairs "
        f"{args.pairs}` ({elapsed:.0f} s). Old code: `{args.old}` ({old_how}); new: this "
        f"checkout. {args.pairs} pairs, each one repetition of the scenario's benchmark "
        "(`bench_coalesce.py --only NAME`, or `bench_sglang.py` for sglang) with each code, in "
        "processes of their own, the order alternating. Medians over the pairs (ranges in "
        "brackets). CPU us/lookup: the coordinator's process, as its benchmark measures it; "
        "vs baseline: the coordinator's lookups/s over per-request's (SGLang: over SGLang's "
        "own way) in the same repetition.",
        "",
        *rows,
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the old code's git revision")
    parser.add_argument("--only", action="append", help="these scenarios (repeatable)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    scenarios = args.only or list(DEFAULT_SCENARIOS)
    started = time.perf_counter()
    results: dict[str, dict[str, Runs]] = {}
    with tempfile.TemporaryDirectory(prefix="aio-mclookup-old-") as tmp:
        tree = Path(tmp) / "tree"
        old_how = old_tree(args.old, tree)
        try:
            for scenario in scenarios:
                both = results[scenario] = {"old": Runs(), "new": Runs()}
                for pair in range(args.pairs):
                    order = ("new", "old") if pair % 2 == 0 else ("old", "new")
                    for which in order:
                        src = ROOT / "src" if which == "new" else tree / "src"
                        cpu, rate, ratio = run_once(scenario, src)
                        runs = both[which]
                        runs.cpu.append(cpu)
                        runs.rate.append(rate)
                        runs.ratio.append(ratio)
                        print(f"  {scenario} pair {pair} {which}: {cpu:,.0f} us/lookup, "
                              f"{rate:,.0f} lookups/s, {ratio:.1f}x", file=sys.stderr)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           capture_output=True)
    text = report(args, old_how, results, time.perf_counter() - started)
    print(text)
    if not args.no_write:
        _timing.write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
