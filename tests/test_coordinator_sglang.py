"""SGLang layouts beside vLLM ones in one :class:`LookupCoordinator`: every lookup gets its own
plan's resolve over all its keys, over a fake store and over a real master on loopback.

The SGLang layouts cover a page's keys as one coordinator item (MHA with TP and PP), plain
keys (MLA without PP: one key per page), items of keys of different widths (16 TP ranks), and
the three releases; each store holds prefixes of shared documents with a key missing here and
there (a rank's ``v`` of one page), so hits stop early, on some rank, or run to the end.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest

import aio_mclookup as mcl
from aio_mclookup import FakeStore, LookupCoordinator, SGLangLayout
from helpers import chain

VLLM = mcl.KVLayout([mcl.FullAttention(16)], model="Qwen/Qwen3-8B", hash_block_size=16,
                    scheduler_block_size=16, tp_size=2, num_kv_heads=8)
SGLANG = [
    SGLangLayout(sglang_version="0.5.23", page_size=16, model_name="Qwen/Qwen3-8B", tp_size=2,
                 pp_size=2, prefetch_threshold=32),
    SGLangLayout(sglang_version="0.5.20", page_size=8, model_name="deepseek-ai/DeepSeek-V3",
                 tp_size=4, mla=True, prefetch_threshold=0, extra_backend_tag="prod"),
    SGLangLayout(sglang_version="0.5.17", page_size=4, model_name="Qwen/Qwen3-8B", tp_size=16,
                 eagle=True, prefetch_threshold=4),
    SGLangLayout(sglang_version="0.5.23", page_size=4, model_name="Qwen/Qwen3-8B", tp_size=2,
                 tp_lcm_size=4, hicache_mem_layout="page_head", prefetch_threshold=64),
]
Request = tuple[Any, int, Any]  # (layout, num_tokens, hashes)


def _sglang_requests(rng: random.Random, store_keys: set[bytes]) -> list[Request]:
    """Per SGLang layout: documents stored up to a cut (a hole in some), requests that share
    a document's prefix and then differ."""
    out: list[Request] = []
    for n, layout in enumerate(SGLANG):
        docs = [[rng.randrange(1, 50_000) for _ in range(600)] for _ in range(3)]
        for d, doc in enumerate(docs):
            hashes = layout.page_hashes(doc, extra_key="lora-a" if d == 1 else None)
            keys = layout.plan(len(doc), hashes).keys
            stored = keys[: len(keys) * (d + 1) // 3]
            if d == 2:  # one rank's object of a page missing: the hit stops there
                stored = [k for i, k in enumerate(stored) if i != len(stored) // 2]
            store_keys.update(stored)
        for i in range(40):
            d = i % 3
            cut = rng.randrange(0, 600)
            tokens = docs[d][:cut] + [rng.randrange(1, 50_000) for _ in range(rng.randrange(0, 90))]
            hashes = layout.page_hashes(tokens, extra_key="lora-a" if d == 1 else None)
            out.append((layout, len(tokens), hashes))
        out.append((layout, 0, []))  # (no pages: 0 without an RPC)
        del n
    return out


def _vllm_requests(rng: random.Random, store_keys: set[bytes]) -> list[Request]:
    docs = [chain(40, b"vdoc%d" % d) for d in range(2)]
    for doc in docs:
        store_keys.update(VLLM.plan(len(doc) * 16, doc[:30]).keys)
    out: list[Request] = []
    for i in range(40):
        doc = docs[i % 2]
        cut = rng.randrange(0, 41)
        hashes = doc[:cut] + chain(40 - cut, b"vtail%d" % i)
        out.append((VLLM, 40 * 16, hashes))
    return out


def _workload(seed: int) -> tuple[list[Request], set[bytes]]:
    rng = random.Random(seed)
    keys: set[bytes] = set()
    requests = _sglang_requests(rng, keys) + _vllm_requests(rng, keys)
    rng.shuffle(requests)
    return requests, keys


async def _expected(store: Any, requests: list[Request]) -> list[int]:
    """Each plan's own resolve over the answers to all its keys (one request at a time)."""
    hits = []
    for layout, n, hashes in requests:
        plan = layout.plan(n, hashes)
        answers: list[int] = []
        for i in range(0, plan.num_keys, 1000):
            answers += await store.batch_is_exist(plan.keys[i : i + 1000])
        hits.append(plan.resolve(answers))
    return hits


async def _coordinated(coordinator: LookupCoordinator, requests: list[Request]) -> list[int]:
    return list(
        await asyncio.gather(
            *(coordinator.lookup(n, hashes, layout=layout) for layout, n, hashes in requests)
        )
    )


def test_the_layouts_cover_items_plain_keys_and_mixed_widths() -> None:
    plans = [layout.plan(600, layout.page_hashes(list(range(600)))) for layout in SGLANG]
    assert [p._chunk_keys for p in plans] == [8, 1, 32, 8]
    assert plans[2].key_array() is None  # ("_9_k" and "_10_k": two widths)
    assert plans[0].key_array() is not None


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"cache_ttl": None},
        {"probe_window": 1, "max_keys_per_rpc": 64},
        {"rounds": False},
        {"probe_window": None},
    ],
    ids=["defaults", "no-cache", "narrow", "one-round", "no-window"],
)
async def test_mixed_lookups_over_a_fake_store(options: dict[str, Any]) -> None:
    requests, keys = _workload(seed=7)
    store = FakeStore(keys)
    store.answers = {k: -1 for k in list(keys)[:5]}  # a few Mooncake errors: absent
    want = await _expected(store, requests)
    assert len(set(want)) > 10 and 0 in want
    store.calls.clear()
    async with LookupCoordinator(VLLM, store, timeout=30, **options) as coordinator:
        assert await _coordinated(coordinator, requests) == want
        assert await _coordinated(coordinator, requests) == want  # (caches warm)
    if "max_keys_per_rpc" not in options:  # coalesced: fewer RPCs than lookups
        assert len(store.calls) < 2 * len(requests)


async def test_one_sglang_lookup_fails_alone() -> None:
    requests, keys = _workload(seed=3)
    store = FakeStore(keys)
    want = await _expected(store, requests)
    async with LookupCoordinator(VLLM, store, timeout=30) as coordinator:
        bad = coordinator.lookup(600, [b"short"] * 200, layout=SGLANG[0])
        results = await asyncio.gather(bad, _coordinated(coordinator, requests),
                                       return_exceptions=True)
    assert isinstance(results[0], mcl.InvalidRequest)
    assert results[1] == want


async def test_an_sglang_layout_as_the_default() -> None:
    layout = SGLANG[0]
    tokens = list(range(7, 7 + 200))
    hashes = layout.page_hashes(tokens)
    plan = layout.plan(len(tokens), hashes)
    store = FakeStore(plan.keys[: 6 * layout.keys_per_page])  # six pages on every rank
    want = plan.resolve([1 if k in store.present else 0 for k in plan.keys])
    assert want == 6 * 16
    async with LookupCoordinator(layout, store) as coordinator:
        assert coordinator.layout is layout
        assert await coordinator.lookup(len(tokens), hashes) == want
        assert await coordinator.lookup_request(len(tokens), hashes) == want


async def test_a_layout_of_another_kind_is_refused() -> None:
    with pytest.raises(mcl.InvalidRequest, match="a KVLayout or an SGLangLayout"):
        LookupCoordinator(SGLANG[0].to_dict(), FakeStore())  # type: ignore[arg-type]
    async with LookupCoordinator(VLLM, FakeStore()) as coordinator:
        with pytest.raises(mcl.InvalidRequest, match="a KVLayout or an SGLangLayout"):
            await coordinator.lookup(16, [], layout=SGLANG[0].to_dict())  # type: ignore[arg-type]


@pytest.mark.integration
async def test_mixed_lookups_over_a_real_master(
    store_writer: mcl.StoreWriter, mooncake_store: mcl.MooncakeStore
) -> None:
    requests, keys = _workload(seed=11)
    await store_writer.put_keys(sorted(keys))
    want = await _expected(mooncake_store, requests)
    assert len(set(want)) > 10 and 0 in want
    async with LookupCoordinator(VLLM, mooncake_store, timeout=30) as coordinator:
        assert await _coordinated(coordinator, requests) == want
        assert await _coordinated(coordinator, requests) == want


# -------------------------------------------------------------------- lookups of token ids
def _token_requests(seed: int) -> tuple[list[tuple[SGLangLayout, list[int], str | None]],
                                        set[bytes]]:
    """Prompts of every SGLang layout, long enough that most are hashed off the loop."""
    rng = random.Random(seed)
    keys: set[bytes] = set()
    out = []
    for layout in SGLANG:
        docs = [[rng.randrange(1, 50_000) for _ in range(1200)] for _ in range(2)]
        for d, doc in enumerate(docs):
            plan = layout.plan(len(doc), layout.page_hashes(doc, extra_key="x" if d else None))
            keys.update(plan.keys[: plan.num_keys * (d + 1) // 3])
        for i in range(12):
            d = i % 2
            cut = rng.randrange(0, 1200)
            tokens = docs[d][:cut] + [rng.randrange(1, 50_000) for _ in range(rng.randrange(90))]
            out.append((layout, tokens, "x" if d else None))
    return out, keys


@pytest.mark.parametrize("ids", ["list", "array"])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_lookups_of_token_ids_are_lookups_of_their_page_hashes(backend: str, ids: str) -> None:
    import anyio

    requests, keys = _token_requests(seed=11)
    if ids == "array":  # (read in place by the worker's job: every integer width)
        dtypes = [np.int64, np.uint32, np.int32, np.uint64]
        requests = [(layout, np.array(t, dtype=dtypes[i % 4]), x)  # type: ignore[misc]
                    for i, (layout, t, x) in enumerate(requests)]
    store = FakeStore(keys)

    async def main() -> tuple[list[int], list[int]]:
        async with LookupCoordinator(VLLM, store, timeout=30) as coordinator:
            want = [
                await coordinator.lookup(len(t), layout.page_hashes(t, extra_key=x),
                                         layout=layout)
                for layout, t, x in requests
            ]
            got: list[int] = [0] * len(requests)

            async def one(i: int) -> None:
                layout, tokens, extra = requests[i]
                got[i] = await coordinator.lookup_tokens(tokens, extra_key=extra, layout=layout)

            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(one, i)
            if backend == "asyncio":
                assert not coordinator._preparing
        return got, want

    got, want = anyio.run(main, backend=backend)
    assert got == want and len(set(want)) > 5


async def test_token_ids_on_a_vllm_layout_or_bad_ids_are_refused_alone() -> None:
    requests, keys = _token_requests(seed=12)
    store = FakeStore(keys)
    async with LookupCoordinator(SGLANG[0], store, timeout=30) as coordinator:
        with pytest.raises(mcl.InvalidRequest, match="BlockHasher"):
            await coordinator.lookup_tokens([1, 2, 3], layout=VLLM)  # type: ignore[arg-type]
        good = [coordinator.lookup_tokens(t, extra_key=x, layout=layout)
                for layout, t, x in requests]
        bad = [
            coordinator.lookup_tokens([5] * 300 + [-1] * 300),
            # (read in place on the worker: refused when prepared, failing only its caller)
            coordinator.lookup_tokens(np.array([5] * 3000 + [-1] * 300, dtype=np.int64)),
            coordinator.lookup_tokens(np.array([5] * 3000 + [-1] * 300, dtype=np.int32)),
        ]
        results = await asyncio.gather(*bad, *good, return_exceptions=True)
        want = [await coordinator.lookup(len(t), layout.page_hashes(t, extra_key=x),
                                         layout=layout) for layout, t, x in requests]
    assert all(isinstance(r, mcl.InvalidRequest) and "negative" in str(r)
               for r in results[:3]), results[:3]
    assert list(results[3:]) == want


async def test_wide_ids_of_an_array_read_in_place_get_wide_pages() -> None:
    # (the worker's job finds an id past 32 bits and leaves the pages to the Python path)
    layout = SGLangLayout(sglang_version="0.5.23", page_size=4, model_name="m",
                          prefetch_threshold=0)
    rng = random.Random(9)
    doc = [rng.randrange(1, 50_000) for _ in range(400)]
    doc[150] = 2**40
    plan = layout.plan(len(doc), layout.page_hashes(doc))
    cuts = (100, 200, 300, 400)
    async with LookupCoordinator(layout, FakeStore(plan.keys[: 60 * layout.keys_per_page])) as c:
        got = await asyncio.gather(*(
            c.lookup_tokens(np.array(doc[:n], dtype=np.int64)) for n in cuts
        ))
        want = [await c.lookup(n, layout.page_hashes(doc[:n])) for n in cuts]
    assert got == want == [96, 196, 240, 240]  # (60 pages stored: the wide one is page 37)


async def test_an_array_written_after_its_lookup_was_cancelled_changes_nothing_else() -> None:
    # (its job may still read the array on the worker: whatever it reads is dropped)
    layout = SGLangLayout(sglang_version="0.5.23", page_size=1, model_name="m",
                          prefetch_threshold=0)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(1, 50_000, 20_000, dtype=np.int64) for _ in range(6)]
    first = prompts[0].copy()
    stored = layout.plan(20_000, layout.page_hashes(prompts[1])).keys[: 5000 * layout.keys_per_page]
    async with LookupCoordinator(layout, FakeStore(stored)) as coordinator:
        tasks = [asyncio.create_task(coordinator.lookup_tokens(p)) for p in prompts]
        await asyncio.sleep(0)
        tasks[0].cancel()
        prompts[0][:] = prompts[1]  # (the caller reuses its buffer at once)
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(done[0], asyncio.CancelledError)
        assert done[1:] == [5000, 0, 0, 0, 0]
        assert await coordinator.lookup_tokens(prompts[0]) == 5000
        assert await coordinator.lookup_tokens(first) == 0
        assert not coordinator._preparing


async def test_token_lookups_cancelled_timed_out_or_closed_while_hashed_settle() -> None:
    layout = SGLangLayout(sglang_version="0.5.23", page_size=1, model_name="m",
                          prefetch_threshold=0)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 50_000) for _ in range(20_000)] for _ in range(8)]
    plan = layout.plan(20_000, layout.page_hashes(prompts[0]))
    store = FakeStore(plan.keys[: 5000 * layout.keys_per_page])
    coordinator = LookupCoordinator(layout, store)
    async with coordinator:
        want = await coordinator.lookup_tokens(prompts[0])
        assert want == 5000
        tasks = [asyncio.create_task(coordinator.lookup_tokens(
            p, timeout=1e-9 if i == 1 else None)) for i, p in enumerate(prompts)]
        await asyncio.sleep(0)
        tasks[2].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert done[0] == want
        assert isinstance(done[1], mcl.LookupTimeout)
        assert isinstance(done[2], asyncio.CancelledError)
        assert done[3:] == [0] * 5
        assert not coordinator._preparing
        tasks = [asyncio.create_task(coordinator.lookup_tokens(p)) for p in prompts]
        await asyncio.sleep(0)
        await coordinator.aclose()
        closed = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(c, mcl.ClosedError) or c in (want, 0) for c in closed), closed
    assert any(isinstance(c, mcl.ClosedError) for c in closed)
    assert coordinator._admission.reserved_lookups == coordinator._admission.reserved_keys == 0


@pytest.mark.parametrize("fault", ["prepare", "begin", "stop-iteration"])
async def test_a_lookup_failing_on_the_worker_s_call_back_fails_alone(
    fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (the worker's call-back prepares and begins several lookups at once: one raising must
    # not leave the rest of its batch unbegun, their admission held, or their keys unsent)
    from aio_mclookup._coordinator import core
    from aio_mclookup._plan import sglang as plan_sglang

    layout = SGLangLayout(sglang_version="0.5.23", page_size=1, model_name="m",
                          prefetch_threshold=0)
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 50_000) for _ in range(2_000 + i)] for i in range(6)]
    store = FakeStore(layout.plan(2_000, layout.page_hashes(prompts[0])).keys[:3000])
    if fault == "begin":
        probe_state = core.probe_state

        def failing(plan: Any, rounds: bool) -> Any:
            if plan.num_tokens == 2_003:
                raise RuntimeError("a bug in beginning")
            return probe_state(plan, rounds)

        monkeypatch.setattr(core, "probe_state", failing)
    else:
        prepare = plan_sglang._PendingSGLangPlan.prepare

        def raising(self: Any, job: object | None = None) -> None:
            if self.num_tokens == 2_003:
                raise RuntimeError("a bug in preparing") if fault == "prepare" else StopIteration
            prepare(self, job)

        monkeypatch.setattr(plan_sglang._PendingSGLangPlan, "prepare", raising)
    async with LookupCoordinator(layout, store) as coordinator:
        results = await asyncio.wait_for(asyncio.gather(
            *(coordinator.lookup_tokens(p) for p in prompts), return_exceptions=True
        ), 30)
        assert not coordinator._preparing and not coordinator._core.lookups
        assert coordinator._admission.reserved_lookups == coordinator._admission.reserved_keys == 0
    assert isinstance(results[3], RuntimeError)
    assert results[:3] + results[4:] == [1500, 0, 0, 0, 0]


@pytest.mark.parametrize("pages", [100, 2000], ids=["quick-inline", "large-on-the-worker"])
async def test_a_lone_lookup_past_its_deadline_sends_nothing(pages: int) -> None:
    # (alone, a small plan prepares inline, then does not begin past its deadline; a large
    # one goes to the worker even alone, so that the deadline holds while it is hashed)
    layout = SGLangLayout(sglang_version="0.5.23", page_size=16, model_name="m",
                          prefetch_threshold=0)
    prompt = list(range(1000, 1000 + pages * 16 + 1))
    store = FakeStore(layout.plan(len(prompt), layout.page_hashes(prompt)).keys)
    async with LookupCoordinator(layout, store) as coordinator:
        assert layout.plan_tokens(prompt).quick_to_prepare is (pages <= 512)
        with pytest.raises(mcl.LookupTimeout):
            await coordinator.lookup_tokens(prompt, timeout=1e-9)
        assert store.calls == [] and not coordinator._preparing
        assert await coordinator.lookup_tokens(prompt) == pages * 16
