"""The vLLM 0.26 speed baseline must itself reproduce vLLM 0.26 exactly.

``aio_mclookup._reference`` (the benchmarks' vLLM 0.26 baseline) is only a fair speed
reference if it computes the same keys and hit lengths as vLLM 0.26.0. This runs it over
every case of the conformance file (produced by the real vLLM code).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from aio_mclookup._reference.v026 import BaselineLookup  # noqa: E402

_CANDIDATES = [
    ROOT / "tests" / "data" / "conformance_public.jsonl",
    ROOT.parent / "shared" / "conformance" / "public.jsonl",
    Path("/work/shared/conformance/public.jsonl"),
]


def _cases_file() -> Path | None:
    for path in _CANDIDATES:
        if path.is_file():
            return path
    return None


def _load_cases() -> list[dict]:
    path = _cases_file()
    if path is None:
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


CASES = _load_cases()


@pytest.mark.skipif(not CASES, reason="no conformance case file available")
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_baseline_matches_vllm026(case: dict) -> None:
    hashes = [bytes.fromhex(h) for h in case["block_hashes_hex"]]
    if case["error"]:
        with pytest.raises((AssertionError, ValueError)):
            BaselineLookup(case["config"]).build_keys(case["token_len"], hashes)
        return

    base = BaselineLookup(case["config"])
    keys, meta = base.build_keys(case["token_len"], hashes)
    assert keys == case["expected_keys"]

    calls: list[list[str]] = []
    if case["exists"] is None:

        def failing_store(batch: list[str]) -> list[int]:
            calls.append(batch)
            raise ConnectionError("store unavailable")

        assert base.lookup(case["token_len"], hashes, failing_store) == 0
        assert len(calls) == (1 if keys else 0)
        return

    answers = list(case["exists"])
    assert len(answers) == len(keys)
    assert base.resolve(case["token_len"], hashes, meta, answers) == case["expected_hit"]

    def store(batch: list[str]) -> list[int]:
        calls.append(batch)
        return answers

    assert base.lookup(case["token_len"], hashes, store) == case["expected_hit"]
    assert len(calls) == (1 if keys else 0)
    if keys:
        assert calls[0] == case["expected_keys"]


def test_cases_were_found() -> None:
    if _cases_file() is None:
        pytest.skip("no conformance case file available")
    assert len(CASES) >= 1
