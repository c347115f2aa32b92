"""Every public vLLM 0.26 conformance case (real vLLM 0.26.0 input -> output) through the
public API (the layouts say ``"vllm_version": "0.26.0"``, as check.py adds).

Each case runs exactly as ``/work/shared/conformance/check.py`` runs it:
``KVLayout.from_dict(config)`` -> ``layout.plan(token_len, hashes)`` -> ``plan.keys`` (ASCII
bytes, decoded) equal ``expected_keys`` -> ``plan.resolve(exists)`` equals ``expected_hit``;
error cases raise :class:`aio_mclookup.InvalidRequest` (a ``ValueError``). On top of that the
same cases run with the hashes as a 2-D ``uint8`` array (vLLM's zero-copy blob form) and with
probing in rounds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aio_mclookup as mcl
from aio_mclookup._plan.probing import ProbeState

CASES_FILE = Path(__file__).resolve().parent / "data" / "conformance_public.jsonl"
CASES: list[dict[str, Any]] = [
    json.loads(line) for line in CASES_FILE.read_text().splitlines() if line.strip()
]
for _case in CASES:  # vLLM 0.26 cases (layouts default to the latest release)
    _case["config"] = dict(_case["config"], vllm_version="0.26.0")
IDS = [case["id"] for case in CASES]


def _hashes(case: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(h) for h in case["block_hashes_hex"]]


def _blob(hashes: list[bytes]) -> np.ndarray | None:
    """The hashes as one (n, width) uint8 array, when they all have the same width."""
    widths = {len(h) for h in hashes}
    if not widths:
        return np.zeros((0, 32), dtype=np.uint8)
    if len(widths) != 1:
        return None
    return np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(len(hashes), widths.pop())


def _decoded(plan: mcl.LookupPlan) -> list[str]:
    keys = plan.keys
    assert all(isinstance(k, bytes) for k in keys)
    return [k.decode("ascii") for k in keys]


def _check(case: dict[str, Any], hashes: Any) -> mcl.LookupPlan | None:
    if case["error"]:
        with pytest.raises(mcl.InvalidRequest) as info:
            mcl.KVLayout.from_dict(case["config"]).plan(case["token_len"], hashes)
        assert isinstance(info.value, ValueError)
        return None
    layout = mcl.KVLayout.from_dict(case["config"])
    plan = layout.plan(case["token_len"], hashes)
    assert _decoded(plan) == case["expected_keys"]
    assert len(plan) == len(case["expected_keys"])
    if case["exists"] is not None:
        assert plan.resolve(case["exists"]) == case["expected_hit"]
    return plan


def test_case_file_is_complete() -> None:
    assert len(CASES) == 300
    assert len(set(IDS)) == len(IDS)
    assert sum(1 for c in CASES if c["error"]) == 8


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_case(case: dict[str, Any]) -> None:
    _check(case, _hashes(case))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_case_with_hash_array(case: dict[str, Any]) -> None:
    hashes = _hashes(case)
    blob = _blob(hashes)
    if blob is None:
        pytest.skip("mixed hash widths have no 2-D array form")
    _check(case, blob)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_case_with_numpy_answers(case: dict[str, Any]) -> None:
    if case["error"] or case["exists"] is None:
        pytest.skip("no answers")
    plan = mcl.KVLayout.from_dict(case["config"]).plan(case["token_len"], _hashes(case))
    assert plan.resolve(np.array(case["exists"], dtype=np.int64)) == case["expected_hit"]
    assert plan.resolve(np.array(case["exists"], dtype=np.int32)) == case["expected_hit"]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_case_in_rounds(case: dict[str, Any]) -> None:
    """Probing in rounds reaches the same hit as resolving every answer at once."""
    if case["error"] or case["exists"] is None:
        pytest.skip("no answers")
    plan = mcl.KVLayout.from_dict(case["config"]).plan(case["token_len"], _hashes(case))
    present = np.array([a == 1 for a in case["exists"]], dtype=bool)
    state = ProbeState(plan)
    probed: set[int] = set()
    while True:
        idx = np.asarray(state.next_keys())  # as an array, whatever next_keys gives
        if not idx.size:
            break
        assert not probed.intersection(idx.tolist())
        probed.update(idx.tolist())
        state.record(idx, present[idx])
    assert state.hit == plan.resolve(case["exists"]) == case["expected_hit"]
    assert len(probed) <= plan.num_keys


def test_upstream_swa_boundary_keys() -> None:
    """The §5.1 target: 6 keys, the SWA ones end in 6833, 6837, 683131 (hash indices 3, 7, 11)."""
    case = next(c for c in CASES if c["id"].endswith("checks_all_potential_swa_hit_boundaries"))
    plan = _check(case, _hashes(case))
    assert plan is not None
    keys = _decoded(plan)
    assert len(keys) == 6
    assert [k.rsplit("@", 2)[-2:] for k in keys[3:]] == [
        ["group:1", "6833"],
        ["group:1", "6837"],
        ["group:1", "683131"],
    ]
