"""The coordinator under vLLM 0.32/0.33's rules: for random layouts (every new field), store
contents and arrival orders, ``lookup_result`` equals ``plan.resolve_result`` on the store's
answers and ``lookup`` its hit, with several lookups sharing keys concurrently; on asyncio,
uvloop and trio (through anyio)."""

from __future__ import annotations

import random

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aio_mclookup as mcl
from aio_mclookup._plan.rounds import probe_state
from helpers import chain, gather
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


# ---------------------------------------------------------------------- rounds, directly
DSV4_LIKE = mcl.KVLayout(
    [
        mcl.FullAttention(256),
        mcl.SlidingWindow(64, sliding_window=128),
        mcl.SlidingWindow(4, sliding_window=8),
        mcl.SlidingWindow(8, sliding_window=128),
    ],
    model="deepseek-ai/DeepSeek-V4-Pro",
    hash_block_size=4,
    scheduler_block_size=256,
)
HYBRID_TP4 = mcl.KVLayout(
    [mcl.FullAttention(16), mcl.SlidingWindow(16, sliding_window=128)],
    model="openai/gpt-oss-120b",
    hash_block_size=16,
    scheduler_block_size=16,
    tp_size=4,
    num_kv_heads=8,
)


def _stored(layout: mcl.KVLayout, hashes: list[bytes]) -> list[bytes]:
    """The keys of a prompt stored whole (what a lookup of all of it probes)."""
    return layout.plan(len(hashes) * layout.hash_block_size, hashes).keys


async def test_a_hybrid_probes_far_fewer_keys_than_one_round_with_the_same_result() -> None:
    # DSv4-like, 64K tokens, stored up to 24K (96 chunks): not the 5,376 keys of one round.
    hashes = chain(16384, b"doc")
    store = mcl.FakeStore(_stored(DSV4_LIKE, hashes[: 24576 // 4]))
    plan = DSV4_LIKE.plan(65536 + 100, hashes)
    answers = [1 if k in store.present else 0 for k in plan.keys]
    want = plan.resolve_result(answers)
    assert want.hit_length == 24576 and plan.num_keys == 5376
    # An idle store: latency first, two rounds (the full prefix and the windows at the end
    # it may reach, then the windows at the hit: 256 + 2 * 20 keys).
    async with mcl.LookupCoordinator(DSV4_LIKE, store) as coord:
        assert await coord.lookup_result(65536 + 100, hashes) == want
        stats = coord.stats()
    assert stats.keys_sent_total == 296 and stats.rounds_total == 2
    # A busy store's windows (16 chunks, doubling, with scouts): the prefix to its first
    # miss and the windows at the hit, close to the 117 keys an exact answer needs.
    state = probe_state(plan)
    present = np.array(answers) == 1
    sent = rounds = 0
    while len(idx := state.next_keys(16 << min(rounds, 20))):
        rounds += 1
        sent += len(idx)
        state.record(idx, present[np.asarray(idx)])
    assert state.result == want
    assert sent <= 117 * 1.25, sent


async def test_a_hybrid_takes_its_full_attention_prefix_from_the_known_prefixes() -> None:
    hashes = chain(256, b"prompt")
    store = mcl.FakeStore(_stored(HYBRID_TP4, hashes[:200]))
    plan = HYBRID_TP4.plan(256 * 16, hashes)
    want = plan.resolve_result([1 if k in store.present else 0 for k in plan.keys])
    async with mcl.LookupCoordinator(HYBRID_TP4, store, cache_ttl=60.0) as coord:
        assert await coord.lookup_result(256 * 16, hashes) == want
        first = coord.stats()
        sent, cached = first.keys_sent_total, first.cache_hits_total
        assert await coord.lookup_result(256 * 16, hashes) == want
        again = coord.stats()
    # The second lookup's full-attention prefix (200 chunks, 4 namespaces) comes from the
    # known prefixes without a key built; it probes only past them (an idle store: the rest
    # of the prefix the answer may rest on, in one round).
    assert again.cache_hits_total - cached >= 200 * 4
    assert again.keys_sent_total - sent <= (256 - 200) * 4 + 2 * 8 * 4
    assert len(coord._core._prefixes) >= 200  # (rows of the full-attention group's tree)


async def test_a_multi_group_plan_with_rank_namespaces_is_tracked_by_chunk() -> None:
    hashes = chain(64, b"items")
    store = mcl.FakeStore(_stored(HYBRID_TP4, hashes[:40]))
    plan = HYBRID_TP4.plan(64 * 16, hashes)
    assert plan._chunk_keys == 4  # (an item: a chunk's keys in every namespace)
    want = plan.resolve_result([1 if k in store.present else 0 for k in plan.keys])
    async with mcl.LookupCoordinator(HYBRID_TP4, store) as coord:
        assert await coord.lookup_result(64 * 16, hashes) == want
    assert all(len(call) % 4 == 0 for call in store.calls)
