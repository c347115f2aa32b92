"""The load generator's default run (`aio-mclookup loadgen`), its summary written into
docs/benchmarks.md: the coordinator beside the seed-naive way, measured in the same run.

Usage: ``python benchmarks/bench_loadgen.py [--no-write] [LOADGEN ARGS...]``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

if __package__:
    from . import _timing
else:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _timing  # type: ignore[no-redef,import-not-found]

SECTION = "bench_loadgen"


def main() -> int:
    args = sys.argv[1:]
    write = "--no-write" not in args
    args = [a for a in args if a != "--no-write"]
    command = [sys.executable, "-m", "aio_mclookup", "loadgen", *args]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        return done.returncode
    m = _timing.machine()
    shown = " ".join(["aio-mclookup", "loadgen", *args])
    text = "\n".join([
        "## Load generator, default run (bench_loadgen)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {m['nproc']} vCPU {m['cpu']}, {m['python']}. "
        f"Command: `{shown}` ({elapsed:.0f} s), run by `python benchmarks/bench_loadgen.py`; "
        "`--compare` (on by default) runs the seed-naive way on the same requests in the same "
        "run and checks both give the same hits. Its output, verbatim:",
        "",
        "```",
        done.stdout.rstrip(),
        "```",
    ])
    print(text)
    if write:
        _timing.write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
