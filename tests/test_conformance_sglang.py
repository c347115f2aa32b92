"""Every public SGLang HiCache conformance case (real SGLang 0.5.17 / 0.5.20 / 0.5.23 input ->
output) through the public API, as ``/work/shared/conformance/check_sglang.py`` runs it:
``SGLangLayout.from_dict(layout)`` -> ``page_hashes`` -> ``plan`` -> ``keys`` (a multiset) and
``resolve(exists)``; error cases raise :class:`aio_mclookup.InvalidRequest`. On top of that the
same cases run with the token ids and hashes as numpy arrays, probed in rounds
(:class:`ProbeState`, as the coordinator probes), and through a :class:`LookupCoordinator`
over a :class:`FakeStore` holding the case's answers.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aio_mclookup as mcl
from aio_mclookup._plan.probing import ProbeState

CASES_FILE = Path(__file__).resolve().parent / "data" / "sglang_public.jsonl"
CASES: list[dict[str, Any]] = [
    json.loads(line) for line in CASES_FILE.read_text().splitlines() if line.strip()
]
IDS = [case["id"] for case in CASES]
GOOD = [case for case in CASES if not case["error"]]


def _plan(case: dict[str, Any], as_arrays: bool = False) -> mcl.LookupPlan:
    layout = mcl.SGLangLayout.from_dict(case["layout"])
    tokens: Any = case["token_ids"]
    if as_arrays:
        tokens = np.array(tokens, dtype=np.uint64 if max(tokens, default=0) >= 1 << 63 else None)
    hashes = layout.page_hashes(tokens, extra_key=case["extra_key"], cache_salt=case["cache_salt"])
    assert [h.hex() for h in hashes] == case["expected_page_hashes_hex"]
    if as_arrays:
        blob = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(-1, 32)
        return layout.plan(len(case["token_ids"]), blob)
    return layout.plan(len(case["token_ids"]), hashes)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_case(case: dict[str, Any]) -> None:
    if case["error"]:
        with pytest.raises(mcl.InvalidRequest):
            _plan(case)
        return
    plan = _plan(case)
    keys = [k.decode() for k in plan.keys]
    assert collections.Counter(keys) == collections.Counter(case["expected_keys"])
    assert plan.pages == case["query_pages"]
    assert plan.resolve([case["exists"][k] for k in keys]) == case["expected_hit_tokens"]
    if case["sglang"]["queried"]:  # each rank's own result, from its slots of every page
        layout = mcl.SGLangLayout.from_dict(case["layout"])
        slots = dict(layout.rank_slots)
        k = layout.keys_per_page
        for rank in case["sglang"]["ranks"]:
            mine = slots[rank["tp_rank"], rank["pp_rank"]]
            assert len(mine) == rank["keys_per_page"]
            present = [
                all(case["exists"][keys[page * k + j]] == 1 for j in mine)
                for page in range(plan.pages)
            ]
            assert [*present, False].index(False) == rank["hit_pages"]


@pytest.mark.parametrize("case", GOOD, ids=[c["id"] for c in GOOD])
def test_case_from_arrays_and_in_rounds(case: dict[str, Any]) -> None:
    plan = _plan(case, as_arrays=True)
    keys = [k.decode() for k in plan.keys]
    assert collections.Counter(keys) == collections.Counter(case["expected_keys"])
    exists = case["exists"]
    for window in (None, 1, 3, 16):
        state = ProbeState(plan)
        probed = 0
        while len(wanted := state.next_keys(window)):
            round_keys = plan._keys_at(wanted)
            assert round_keys == [plan.keys[i] for i in np.asarray(wanted).tolist()]
            probed += len(round_keys)
            state.record(wanted, [exists[k.decode()] == 1 for k in round_keys])
        assert state.hit == case["expected_hit_tokens"], window
        if window is None:  # (an idle store: every key the answer rests on, at once)
            assert probed == plan.num_keys


async def test_every_case_through_a_coordinator() -> None:
    """Each case's answers in a fake store, one coordinator per case with the defaults (busy
    rounds, items of a page's keys): SGLang's hit, with fewer keys sent than planned when a
    page is missing early."""
    for case in GOOD:
        store = mcl.FakeStore()
        store.answers = {k.encode(): v for k, v in case["exists"].items()}
        layout = mcl.SGLangLayout.from_dict(case["layout"])
        hashes = layout.page_hashes(
            case["token_ids"], extra_key=case["extra_key"], cache_salt=case["cache_salt"]
        )
        kv = mcl.KVLayout([mcl.FullAttention(16)], model="m", hash_block_size=16,
                          scheduler_block_size=16)
        async with mcl.LookupCoordinator(kv, store, timeout=10) as coordinator:
            hit = await coordinator.lookup(len(case["token_ids"]), hashes, layout=layout)
            again = await coordinator.lookup_request(
                len(case["token_ids"]), hashes, layout=layout
            )
        assert hit == again == case["expected_hit_tokens"], case["id"]
        sent = [k for call in store.calls for k in call]
        assert set(sent) <= {k.encode() for k in case["expected_keys"]}
