"""The coordinator under vLLM 0.32/0.33's rules: for random layouts (every new field), store
contents and arrival orders, ``lookup_result`` equals ``plan.resolve_result`` on the store's
answers and ``lookup`` its hit, with several lookups sharing keys concurrently; on asyncio,
uvloop and trio (through anyio)."""

from __future__ import annotations

import random

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aio_mclookup as mcl
from helpers import gather
from test_hits_v033 import requests

try:
    import uvloop
except ImportError:  # pragma: no cover - Linux-only
    uvloop = None

LOOPS = ["asyncio"] + (["uvloop"] if uvloop is not None else []) + ["trio"]


def _run(loop_name: str, coro_fn: object) -> object:
    if loop_name == "uvloop":
        assert uvloop is not None
        options = {"loop_factory": uvloop.new_event_loop}
        return anyio.run(coro_fn, backend="asyncio", backend_options=options)  # type: ignore[arg-type]
    return anyio.run(coro_fn, backend=loop_name)  # type: ignore[arg-type]


@pytest.mark.parametrize("loop_name", LOOPS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(requests(), min_size=1, max_size=4), seed=st.integers(0, 2**32))
def test_coordinator_results_equal_the_plans_own(
    loop_name: str, batch: list[tuple], seed: int
) -> None:
    rng = random.Random(seed)
    cases = []
    for cfg, num_tokens, hashes, _mode, _s in batch:
        try:
            layout = mcl.KVLayout.from_dict(cfg)
            plan = layout.plan(num_tokens, hashes)
        except mcl.InvalidRequest:
            continue
        cases.append((layout, num_tokens, hashes, plan))
    if not cases:
        return
    every = sorted({k for *_, plan in cases for k in plan.keys})
    present = {k for k in every if rng.random() < 0.7}
    want = []
    for *_, plan in cases:
        try:
            want.append(plan.resolve_result([1 if k in present else 0 for k in plan.keys]))
        except mcl.InvalidRequest as exc:
            want.append(exc)
    order = list(range(len(cases))) * 2  # each lookup twice: shared keys, cached answers
    rng.shuffle(order)

    async def main() -> list[object]:
        store = mcl.FakeStore(present, delay=0.001)
        async with mcl.LookupCoordinator(cases[0][0], store, probe_window=2) as coord:

            async def one(i: int) -> object:
                layout, n, hashes, _ = cases[i]
                await anyio.sleep(rng.random() * 0.003)
                try:
                    result = await coord.lookup_result(n, hashes, layout=layout)
                except mcl.InvalidRequest as exc:
                    return exc
                assert await coord.lookup(n, hashes, layout=layout) == result.hit_length
                return result

            return await gather(*(lambda i=i: one(i) for i in order))

    got = _run(loop_name, main)
    for i, result in zip(order, got):  # type: ignore[call-overload]
        if isinstance(want[i], Exception):
            assert isinstance(result, mcl.InvalidRequest)
        else:
            assert result == want[i]
