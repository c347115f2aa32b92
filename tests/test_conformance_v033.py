"""Every public vLLM 0.33 and 0.32 conformance case through the public API, as
``/work/shared/conformance/check_v033.py`` runs them: ``KVLayout.from_dict(config +
vllm_version)`` -> ``layout.plan(num_tokens, hashes)`` -> ``plan.keys`` -> ``resolve_result``
(hit, tail-key boundaries, wire reply) and ``resolve``; vLLM's errors raise
:class:`aio_mclookup.InvalidRequest`. The same cases also run with the hashes as a 2-D
``uint8`` array, with numpy answers and through :meth:`LookupPlan.probing`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aio_mclookup as mcl
from aio_mclookup._plan.rounds import probe_state

DATA = Path(__file__).resolve().parent / "data"
CASES: list[dict[str, Any]] = [
    json.loads(line)
    for name in ("v033_public.jsonl", "v032_public.jsonl")
    for line in (DATA / name).read_text().splitlines()
    if line.strip()
]
IDS = [f"{c['vllm_version']}-{c['id']}" for c in CASES]


def _layout(case: dict[str, Any]) -> mcl.KVLayout:
    return mcl.KVLayout.from_dict(dict(case["config"], vllm_version=case["vllm_version"]))


def _hashes(case: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(h) for h in case["block_hashes_hex"]]


def _check(case: dict[str, Any], hashes: Any) -> None:
    plan = _layout(case).plan(case["num_tokens"], hashes)
    assert [k.decode("ascii") for k in plan.keys] == case["expected_keys"]
    assert plan.token_len == case["token_len"] or not case["expected_keys"]
    if case["error"]:
        with pytest.raises(mcl.InvalidRequest):
            plan.resolve_result(case["exists"])
        return
    res = plan.resolve_result(case["exists"])
    assert isinstance(res, mcl.LookupResult)
    assert res.hit_length == case["expected_hit"]
    assert [list(b) for b in res.tail_key_boundaries] == case["expected_tail_boundaries"]
    assert all(isinstance(b, mcl.TailKeyBoundary) for b in res.tail_key_boundaries)
    assert res.to_bytes().hex() == case["expected_response_hex"]
    if case["exists"] is not None:
        assert plan.resolve(case["exists"]) == case["expected_hit"]


def test_case_files_are_complete() -> None:
    assert len(CASES) == 591
    assert sum(1 for c in CASES if c["error"]) == 6


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_case(case: dict[str, Any]) -> None:
    _check(case, _hashes(case))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_case_with_hash_array(case: dict[str, Any]) -> None:
    hashes = _hashes(case)
    widths = {len(h) for h in hashes}
    if len(widths) > 1:
        pytest.skip("mixed hash widths have no 2-D array form")
    width = widths.pop() if widths else 32
    _check(case, np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(len(hashes), width))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_case_probed(case: dict[str, Any]) -> None:
    """Probing (in rounds where the plan allows) settles on vLLM's result."""
    if case["error"] or case["exists"] is None:
        pytest.skip("no answers")
    answer_of: dict[str, int] = {}
    for key, answer in zip(case["expected_keys"], case["exists"]):
        if answer_of.setdefault(key, answer) != answer:
            pytest.skip("one key answered both ways: no store probed in rounds does that")
    plan = _layout(case).plan(case["num_tokens"], _hashes(case))
    answers = np.array(case["exists"], dtype=np.int64)
    assert plan.resolve(answers) == case["expected_hit"]
    present = answers == 1
    state = probe_state(plan)
    probed: set[int] = set()
    while True:
        idx = np.asarray(state.next_keys(2))
        if not idx.size:
            break
        assert not probed.intersection(idx.tolist())
        probed.update(idx.tolist())
        state.record(idx, present[idx])
    assert state.result is not None
    assert state.result.hit_length == state.hit == case["expected_hit"]
    assert state.result.to_bytes().hex() == case["expected_response_hex"]
