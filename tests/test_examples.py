"""The examples run as documented: ``python examples/async_scheduler.py`` on a loopback master."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# The hits the scheduler example prints for its eleven requests (see EXPECTED_HITS there).
SCHEDULER_HITS = [3584, 2560, 1280, 1024, 0, 0, 3584, 1792, 3584, 1280, 2304]


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_async_scheduler_example_prints_expected_hits() -> None:
    pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine-non-cuda")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "async_scheduler.py")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=EXAMPLES.parent,
        stdin=subprocess.DEVNULL,
    )
    output = f"stdout:\n{proc.stdout}\nstderr (tail):\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, output
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("hits: "), output
    assert ast.literal_eval(lines[-1].removeprefix("hits: ")) == SCHEDULER_HITS, output
    assert "vLLM check: ok" in proc.stdout, output
    stats = next(line for line in lines if line.startswith("coordinator: "))
    assert "11 lookups" in stats, output  # (the one shorter than a block makes no RPC: 0 keys)
