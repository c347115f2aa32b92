"""The coordinator's sans-IO core, driven by hand: no event loop, no clock, no store.

A test plays the shell: it begins lookups, takes the batches the core wants sent, answers
them from a set of present keys, and reads what settled. Hits must equal what the plan
resolves from the same store (the oracle of every coordinator test).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

import aio_mclookup._coordinator.core as core_mod
from aio_mclookup import (
    CoordinatorOptions,
    FullAttention,
    InternalError,
    KVLayout,
    SlidingWindow,
    StoreError,
)
from aio_mclookup._coordinator.core import (
    Batch,
    CoordinatorCore,
    LookupState,
    _expand,
)
from aio_mclookup._observe.stats import CoordinatorStats
from aio_mclookup._plan.plan import LookupPlan

FULL16 = KVLayout([FullAttention(16)], model="core-test", hash_block_size=16,
                  scheduler_block_size=16, vllm_version="0.26")
HYBRID = KVLayout(
    [FullAttention(16), SlidingWindow(16, sliding_window=32)],
    model="core-hybrid", hash_block_size=16, scheduler_block_size=64, vllm_version="0.26",
)
FULL16_033 = KVLayout([FullAttention(16)], model="core-test", hash_block_size=16,
                      scheduler_block_size=16, tp_size=2, num_kv_heads=8, vllm_version="0.33")
HYBRID_033 = KVLayout(
    [FullAttention(16), SlidingWindow(16, sliding_window=32, extra_retained_tokens=16)],
    model="core-hybrid", hash_block_size=16, scheduler_block_size=64, use_eagle=True,
    vllm_version="0.33",
)


def chain(n: int, tag: bytes) -> list[bytes]:
    return [tag + i.to_bytes(4, "big") + bytes(12) for i in range(n)]


def core_of(**options: object) -> CoordinatorCore:
    return CoordinatorCore(CoordinatorOptions(**options), CoordinatorStats())  # type: ignore[arg-type]


def answer_all(core: CoordinatorCore, present: set[bytes], now: float = 0.0) -> list[list[bytes]]:
    """Play the store until nothing is queued or in flight: every batch answered at once.
    Returns the batches sent."""
    sent: list[list[bytes]] = []
    while True:
        batches, retry_at = core.take_batches(now)
        assert retry_at is None
        if not batches:
            assert not core.table.queued and core.rpcs_in_flight == 0
            return sent
        for batch in batches:
            sent.append(list(batch))
            core.settle_rpc(batch, now, [1 if k in present else 0 for k in batch], now)


def expected(plan: LookupPlan, present: set[bytes]) -> int:
    return plan.resolve([1 if k in present else 0 for k in plan.keys])


def test_runs_without_an_event_loop() -> None:
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()
    core = core_of()
    plan = FULL16.plan(128, chain(8, b"a"))
    present = set(plan.keys[:5])
    lookup = core.begin(plan, now=0.0)
    answer_all(core, present)
    assert core.settled == [lookup] and lookup.error is None
    assert lookup.hit == expected(plan, present) == 80


@pytest.mark.parametrize("cut", [0, 1, 3, 7, 8])
@pytest.mark.parametrize("layout", [FULL16, HYBRID], ids=["full", "hybrid"])
def test_hits_equal_the_plans_own_resolution(layout: KVLayout, cut: int) -> None:
    hashes = chain(16, b"h")
    plan = layout.plan(256, hashes)
    present = set(plan.keys[: cut * len(plan.keys) // 8])
    core = core_of(cache_ttl=None)
    lookup = core.begin(plan, now=0.0)
    answer_all(core, present)
    assert lookup.done and lookup.hit == expected(plan, present)


def test_concurrent_lookups_share_each_key_once() -> None:
    core = core_of(cache_ttl=None)
    hashes = chain(8, b"s")
    plans = [FULL16.plan(128, hashes) for _ in range(3)]
    present = set(plans[0].keys)
    lookups = [core.begin(p, now=0.0) for p in plans]
    sent = answer_all(core, present)
    flat = [k for batch in sent for k in batch]
    assert len(flat) == len(set(flat)) == 8  # every key once, for all three
    assert all(lk.hit == 128 for lk in lookups)
    assert core.stats.dedup_hits_total == 16


def test_a_follower_takes_its_walkers_answers_instead_of_its_keys() -> None:
    core = core_of(cache_ttl=5.0, probe_window=2)
    doc = chain(8, b"w")
    present = set(FULL16.plan(128, doc).keys)
    walker = core.begin(FULL16.plan(128, doc), now=0.0)
    batches, _ = core.take_batches(0.0)  # the walker's first round is in flight
    follower = core.begin(FULL16.plan(128, doc), now=0.0)
    assert walker.followers == [follower] and not follower.waiting
    for batch in batches:
        core.settle_rpc(batch, 0.0, [1 if k in present else 0 for k in batch], 0.0)
    answer_all(core, present)
    assert walker.hit == follower.hit == 128
    assert core.stats.keys_sent_total == 8  # the follower sent none of its own


def test_a_walker_failing_lets_its_followers_probe_by_themselves() -> None:
    core = core_of(cache_ttl=5.0)
    doc = chain(4, b"f")
    present = set(FULL16.plan(64, doc).keys)
    walker = core.begin(FULL16.plan(64, doc), now=0.0)
    batches, _ = core.take_batches(0.0)
    follower = core.begin(FULL16.plan(64, doc), now=0.0)
    assert walker.followers == [follower]
    core.fail(walker, InternalError("gone"))
    core.finish(walker)
    assert list(core._walkers.values()) == [follower]  # the walker now
    assert follower.waiting  # its own round, joining the keys still in flight
    for batch in batches:
        core.settle_rpc(batch, 0.0, [1 if k in present else 0 for k in batch], 0.0)
    answer_all(core, present)
    assert follower.hit == 64 and follower.error is None


def test_a_huge_round_does_not_hold_back_a_small_one() -> None:
    core = core_of(cache_ttl=None, max_keys_per_rpc=8, max_rpcs_in_flight=1,
                   max_round_keys=1_000_000)
    big = core.begin(FULL16.plan(16 * 512, chain(512, b"big")), now=0.0)
    small_plan = FULL16.plan(32, chain(2, b"small"))
    small = core.begin(small_plan, now=0.0)
    batches, _ = core.take_batches(0.0)
    assert len(batches) == 1 and len(batches[0]) == 8
    assert set(small_plan.keys) <= set(batches[0])  # its keys go in the first RPC
    assert big.waiting and small.waiting


def test_one_round_holds_at_most_max_round_keys() -> None:
    core = core_of(cache_ttl=None, max_round_keys=100)
    plan = FULL16.plan(16 * 1000, chain(1000, b"r"))
    lookup = core.begin(plan, now=0.0)
    assert 0 < len(lookup.round_keys) <= 100
    present = set(plan.keys)
    answer_all(core, present)
    assert lookup.hit == expected(plan, present) == 16 * 1000


def test_taking_is_linear_in_the_keys_taken() -> None:
    """A dispatch moves at most its limit of keys and touches no others (the old dispatcher
    copied the whole queue every time)."""
    core = core_of(cache_ttl=None, max_keys_per_rpc=10, max_rpcs_in_flight=1)
    core.begin(FULL16.plan(16 * 5000, chain(5000, b"lin")), now=0.0)
    queued = core.table.queued
    batches, _ = core.take_batches(0.0)
    assert [len(b) for b in batches] == [10]
    assert core.table.queued == queued - 10 == len(core.table.queued_keys())


@pytest.mark.parametrize("on_error", ["raise", "absent"])
def test_a_failed_rpc_opens_the_breaker_and_queued_keys_fail_fast(on_error: str) -> None:
    core = core_of(cache_ttl=None, on_error=on_error, failure_backoff=1.0, max_keys_per_rpc=4,
                   max_rpcs_in_flight=1)
    first = core.begin(FULL16.plan(64, chain(4, b"x")), now=0.0)
    batches, _ = core.take_batches(0.0)
    second = core.begin(FULL16.plan(64, chain(4, b"y")), now=0.0)  # queued behind it
    core.settle_rpc(batches[0], 0.0, StoreError("down", code=-900), now=0.1)
    assert core.breaker.open(0.5)
    batches, retry_at = core.take_batches(0.5)
    assert batches == [] and retry_at == pytest.approx(1.1)
    for lookup in (first, second):
        assert lookup.done
        if on_error == "raise":
            assert isinstance(lookup.error, StoreError) and lookup.error.code == -900
        else:
            assert lookup.error is None and lookup.hit == 0
    assert not core.breaker.open(1.2)  # half-open: one probe RPC may go
    assert core.breaker.slots(2, 0) == 1


def test_answers_of_the_wrong_length_fail_only_that_rpcs_lookups() -> None:
    core = core_of(cache_ttl=None)
    lookup = core.begin(FULL16.plan(64, chain(4, b"len")), now=0.0)
    batches, _ = core.take_batches(0.0)
    core.settle_rpc(batches[0], 0.0, [1], now=0.0)
    assert isinstance(lookup.error, StoreError)


def test_whole_only_takes_the_whole_rpcs_queued_and_leaves_the_rest() -> None:
    core = core_of(cache_ttl=None, rounds=False, max_keys_per_rpc=8, max_rpcs_in_flight=2)
    core.begin(FULL16.plan(64, chain(4, b"w1")), now=0.0)
    core.begin(FULL16.plan(64, chain(4, b"w2")), now=0.0)
    assert not core.whole_rpcs_queued()  # one whole RPC, but two free slots to fill
    batches, _ = core.take_batches(0.0, whole_only=True)
    assert [len(b) for b in batches] == [8] and not core.table.queued  # (what they fill)
    for tag in (b"w3", b"w4", b"w5"):
        core.begin(FULL16.plan(64, chain(4, tag)), now=0.0)
    assert core.whole_rpcs_queued()  # one free slot, a whole RPC for it
    batches, _ = core.take_batches(0.0, whole_only=True)
    assert [len(b) for b in batches] == [8] and core.table.queued == 4
    assert not core.whole_rpcs_queued()  # no slot free
    core.settle_rpc(batches[0], 0.0, [0] * 8, now=0.0)
    assert core.rpcs_in_flight == 1 and not core.whole_rpcs_queued()  # 4 keys: not whole
    batches, _ = core.take_batches(0.0)  # the dispatcher's turn: whatever is left
    assert [len(b) for b in batches] == [4] and core.rpcs_in_flight == 2


def test_a_whole_rpc_of_chunk_items_is_as_many_whole_items_as_fit() -> None:
    # Three namespaces: an RPC of at most 4 keys holds one item (3 keys), and one queued
    # item is that whole RPC.
    three = KVLayout([FullAttention(16)], model="core-test", hash_block_size=16,
                     scheduler_block_size=16, tp_size=3, num_kv_heads=3, vllm_version="0.33")
    core = core_of(cache_ttl=None, max_keys_per_rpc=4, max_rpcs_in_flight=1)
    lookup = core.begin(three.plan(17, chain(1, b"items")), now=0.0)
    assert lookup.unit == 3 and core.table.queued == 1 and core.whole_rpcs_queued()
    batches, _ = core.take_batches(0.0, whole_only=True)
    assert [len(b) for b in batches] == [3] and not core.table.queued


@pytest.mark.parametrize("linger", [0.0, 0.001])
def test_no_whole_rpc_is_sent_early_while_linger_waits_for_more(linger: float) -> None:
    core = core_of(cache_ttl=None, rounds=False, max_keys_per_rpc=8, linger=linger)
    core.begin(FULL16.plan(256, chain(16, b"linger")), now=0.0)  # whole RPCs for both slots
    assert core.table.queued == 16 and core.whole_rpcs_queued() == (not linger)


def test_a_failed_lookups_queued_keys_are_dropped_at_once() -> None:
    # A timed-out lookup's keys must not ride in an RPC sent before its caller finishes it.
    core = core_of(cache_ttl=None, rounds=False, max_keys_per_rpc=4, max_rpcs_in_flight=1)
    late = core.begin(FULL16.plan(128, chain(8, b"late")), now=0.0)
    (first,), _ = core.take_batches(0.0)  # 4 of its keys in flight, 4 queued
    other = core.begin(FULL16.plan(64, chain(4, b"other")), now=0.0)
    core.fail(late, asyncio.TimeoutError())
    assert core.table.abandoned == set(late.plan.keys) - set(first)  # its 4 queued keys
    assert core.table.live == 4  # (the other lookup's)
    core.settle_rpc(first, 0.0, [0] * 4, now=0.0)
    batches, _ = core.take_batches(0.0)
    assert [set(b) for b in batches] == [set(other.plan.keys)]
    core.finish(late)  # (nothing left of it to drop)
    assert set(core.table.waiting) == set(other.plan.keys) and not core.table.abandoned


def test_a_small_lookup_is_not_held_up_by_the_huge_round_that_queued_its_keys() -> None:
    core = core_of(cache_ttl=None, max_keys_per_rpc=10, max_rpcs_in_flight=1)
    doc = chain(400, b"huge")
    core.begin(FULL16.plan(16 * 400, doc), now=0.0)  # one round of 400 keys
    small = core.begin(FULL16.plan(16 * 11, doc[300:310] + chain(1, b"own")), now=0.0)
    present = set(FULL16.plan(16 * 400, doc).keys)
    rpcs = 0
    while not small.done:
        (batch,), _ = core.take_batches(0.0)
        rpcs += 1
        core.settle_rpc(batch, 0.0, [1 if k in present else 0 for k in batch], now=0.0)
    assert small.hit == 160 and rpcs <= 3  # (its share pulls the joined keys out)


def test_abandoned_keys_do_not_make_an_idle_store_look_busy() -> None:
    core = core_of(cache_ttl=None, max_keys_per_rpc=8, probe_window=1)
    gone = core.begin(FULL16.plan(16 * 8, chain(8, b"gone")), now=0.0)  # (nothing in flight)
    core.finish(gone)
    assert core.table.queued == 8 and core.table.live == 0
    plan = FULL16.plan(16 * 64, chain(64, b"new"))
    new = core.begin(plan, now=0.0)
    assert len(new.round_keys) == 64  # idle: every key in one round
    answer_all(core, set(plan.keys))
    assert new.hit == 16 * 64


def test_an_abandoned_key_that_another_lookup_joined_is_still_sent() -> None:
    core = core_of(cache_ttl=None, rounds=False, max_keys_per_rpc=4, max_rpcs_in_flight=1)
    core.begin(FULL16.plan(64, chain(4, b"busy")), now=0.0)
    (busy,), _ = core.take_batches(0.0)  # the only slot is busy
    doc = chain(4, b"joined")
    gone = core.begin(FULL16.plan(64, doc), now=0.0)
    core.fail(gone, asyncio.CancelledError())
    core.finish(gone)
    assert core.table.abandoned == set(gone.plan.keys)
    again = core.begin(FULL16.plan(64, doc), now=0.0)  # the same keys: it joins them
    core.settle_rpc(busy, 0.0, [0] * 4, now=0.0)
    (batch,), _ = core.take_batches(0.0)
    assert set(batch) == set(again.plan.keys)
    core.settle_rpc(batch, 0.0, [1] * 4, now=0.0)
    assert again.done and again.hit == 64 and not core.table.waiting


def test_a_lookup_failing_on_a_bug_in_its_keys_fails_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its next round's keys cannot be built (a bug): it fails with InternalError, and failing
    # it (which drops its queued keys, rebuilding them) must not stop the fan-out of the RPC
    # for the others.
    core = core_of(cache_ttl=None, probe_window=1, max_keys_per_rpc=64, max_rpcs_in_flight=2)
    core.begin(FULL16.plan(64, chain(4, b"busy")), now=0.0)
    (busy,), _ = core.take_batches(0.0)  # one slot busy: rounds are small
    docs = {tag: chain(16, tag) for tag in (b"bug", b"fine")}
    buggy, fine = (core.begin(FULL16.plan(256, d), now=0.0) for d in docs.values())
    (shared,), _ = core.take_batches(0.0)  # both first rounds in one RPC
    waiting = core.begin(FULL16.plan(64, chain(4, b"queued")), now=0.0)  # (no slot: queued)
    build = core_mod._entries

    def entries(lookup: LookupState, indices: Any) -> list[bytes]:
        if lookup is buggy and lookup.state.rounds >= 1:
            raise RuntimeError("a bug building its keys")
        return build(lookup, indices)

    monkeypatch.setattr(core_mod, "_entries", entries)
    present = {k for d in docs.values() for k in FULL16.plan(256, d).keys}
    core.settle_rpc(shared, 0.0, [1 if k in present else 0 for k in shared], now=0.0)
    assert isinstance(buggy.error, InternalError) and buggy.waiting == 0
    monkeypatch.setattr(core_mod, "_entries", build)
    core.settle_rpc(busy, 0.0, [0] * len(busy), now=0.0)
    answer_all(core, present)
    assert fine.done and fine.error is None and fine.hit == 256
    assert waiting.done and waiting.error is None
    core.finish(buggy)


def test_a_cancelled_lookups_queued_keys_are_forgotten() -> None:
    core = core_of(cache_ttl=None, max_rpcs_in_flight=1, max_keys_per_rpc=4)
    core.begin(FULL16.plan(64, chain(4, b"busy")), now=0.0)
    (busy,), _ = core.take_batches(0.0)  # the only slot is busy
    gone = core.begin(FULL16.plan(64, chain(4, b"gone")), now=0.0)
    assert core.table.queued == 4
    core.fail(gone, asyncio.CancelledError())
    core.finish(gone)
    assert gone.ident not in core.lookups
    core.settle_rpc(busy, 0.0, [0] * 4, now=0.0)
    assert core.take_batches(0.0) == ([], None)  # nothing of it is sent
    assert not core.table.queued and not core.table.waiting and not core.table.abandoned


def test_positive_answers_are_reused_until_they_expire() -> None:
    core = core_of(cache_ttl=5.0)
    doc = chain(4, b"ttl")
    present = set(FULL16.plan(64, doc).keys)
    first = core.begin(FULL16.plan(64, doc), now=0.0)
    answer_all(core, present, now=0.0)
    core.finish(first)
    again = core.begin(FULL16.plan(64, doc), now=1.0)
    assert again.done and again.hit == 64  # from the caches: nothing queued
    later = core.begin(FULL16.plan(64, doc), now=6.0)
    assert not later.done and core.table.queued  # expired: probed again


def _settled_hits(lookups: Sequence[LookupState]) -> list[int]:
    return [lk.hit for lk in lookups]


@pytest.mark.parametrize("release", ["0.26", "0.33"])
def test_many_lookups_random_stores_match_the_oracle(release: str) -> None:
    rng = np.random.default_rng(7)
    core = core_of(cache_ttl=None, max_keys_per_rpc=16, max_rpcs_in_flight=2, probe_window=2)
    plans, present = [], set()
    full, hybrid = (FULL16, HYBRID) if release == "0.26" else (FULL16_033, HYBRID_033)
    for i in range(40):
        layout = full if i % 2 else hybrid
        n = int(rng.integers(1, 12))
        plan = layout.plan(64 * (n // 4 + 1), chain(4 * (n // 4 + 1), b"r%d" % (i % 7)))
        plans.append(plan)
        cut = int(rng.integers(0, len(plan.keys) + 1))
        present.update(plan.keys[:cut])
    lookups = [core.begin(p, now=0.0) for p in plans]
    answer_all(core, present)
    assert _settled_hits(lookups) == [expected(p, present) for p in plans]
    results = [lk.state.result for lk in lookups]
    assert results == [p.resolve_result([k in present for k in p.keys]) for p in plans]


TP4 = KVLayout([FullAttention(16)], model="core-tp4", cache_prefix="tenant", hash_block_size=16,
               scheduler_block_size=16, tp_size=4, num_kv_heads=8, vllm_version="0.26")


@pytest.mark.parametrize("cache_ttl", [None, 5.0])
def test_several_namespaces_are_probed_a_chunk_at_a_time(cache_ttl: float | None) -> None:
    """Four keys per chunk: the key table holds one entry per chunk, an RPC carries whole
    chunks (at most max_keys_per_rpc keys), and a chunk counts present only when every
    namespace is: some chunks have one namespace missing."""
    hashes = chain(40, b"tp4")
    keys = TP4.plan(16 * 40, hashes).keys
    present = set(keys[: 4 * 30]) - {keys[4 * 20 + 2]}  # chunk 20 lacks rank 2
    core = core_of(cache_ttl=cache_ttl, max_keys_per_rpc=10, probe_window=4)
    first = core.begin(TP4.plan(16 * 40, hashes), now=0.0)
    second = core.begin(TP4.plan(16 * 40, hashes[:25] + chain(15, b"oth")), now=0.0)
    assert first.unit == 4 and all(entry.count(b"\n") == 4 for entry in core.table.queued_keys())
    sent = answer_all(core, present)
    assert sent and all(len(batch) <= 10 and len(batch) % 4 == 0 for batch in sent)
    sent_keys = [key for batch in sent for key in batch]
    if cache_ttl is not None:  # (without a cache, a later round asks again)
        assert len(sent_keys) == len(set(sent_keys))  # the shared chunks went once
    for lookup in (first, second):
        assert lookup.error is None and lookup.hit == expected(lookup.plan, present) == 16 * 20
    assert core.stats.keys_sent_total == len(sent_keys)


def test_plain_keys_and_chunk_items_share_an_rpc() -> None:
    """A coordinator serving a one-namespace and a four-namespace layout: their entries go
    out together, each answered as its own layout's rules say."""
    one, four = chain(8, b"one"), chain(8, b"tp4")
    present = set(FULL16.plan(128, one).keys[:5]) | set(TP4.plan(128, four).keys[:4 * 6])
    core = core_of(cache_ttl=5.0, max_rpcs_in_flight=1)
    lookups = [core.begin(FULL16.plan(128, one), now=0.0), core.begin(TP4.plan(128, four), now=0.0)]
    sent = answer_all(core, present)
    assert len(sent[0]) == 8 + 4 * 8  # one RPC: the plain keys and the chunks' keys
    assert [lk.hit for lk in lookups] == [expected(lk.plan, present) for lk in lookups] == [80, 96]


def test_plain_keys_holding_the_item_end_share_an_rpc_with_items() -> None:
    """A layout whose cache prefix holds a newline (the byte that ends an item's keys) makes
    no items; its plain keys go out whole beside another layout's items."""
    newline = KVLayout([FullAttention(16)], model="core-nl", cache_prefix="a\nb",
                       hash_block_size=16, scheduler_block_size=16, vllm_version="0.26")
    one, four = chain(8, b"one"), chain(8, b"tp4")
    assert all(b"\n" in key for key in newline.plan(128, one).keys)
    present = set(newline.plan(128, one).keys[:5]) | set(TP4.plan(128, four).keys[: 4 * 6])
    core = core_of(cache_ttl=5.0, max_rpcs_in_flight=1)
    lookups = [
        core.begin(newline.plan(128, one), now=0.0), core.begin(TP4.plan(128, four), now=0.0)
    ]
    sent = answer_all(core, present)
    assert set(sent[0]) == set(newline.plan(128, one).keys) | set(TP4.plan(128, four).keys)
    assert [lk.hit for lk in lookups] == [expected(lk.plan, present) for lk in lookups] == [80, 96]


def _item(keys: Sequence[bytes]) -> bytes:
    return b"".join(key + b"\n" for key in keys)


def test_an_rpcs_keys_come_out_of_its_items_whatever_their_shapes() -> None:
    """Entries of one shape (k keys of one width) are split by a reshape; any other mix (items
    of other shapes and the same length, plain keys, which may hold the item end) is split by
    the search for item ends, with the same keys and item starts."""
    rng = np.random.default_rng(8)

    def key(width: int) -> bytes:
        return bytes(rng.choice(list(b"0123456789abcdef@"), size=width).tolist())

    # (keys per item, key width): 4 x 23, 2 x 47 and 8 x 11 items all have 96 bytes; items
    # of 2 and 8 keys of 23 (one model at other tp sizes) can add up to whole 96-byte rows.
    shapes = [(4, 23), (2, 47), (8, 11), (3, 31), (2, 23), (8, 23)]
    items = 0
    for _ in range(400):
        kinds = rng.choice(4, size=int(rng.integers(1, 12)))
        mix = rng.random() < 0.5
        entries = []
        for kind in kinds:
            k, width = shapes[int(kind) if mix else int(kinds[0])]
            if mix and rng.random() < 0.2:  # a plain key, of an item's length, maybe with
                plain = bytearray(key(k * (width + 1)))  # item ends inside
                for at in rng.choice(len(plain) - 1, size=int(rng.integers(0, 3))):
                    plain[at] = ord("\n")
                entries.append(bytes(plain))
            else:
                entries.append(_item([key(width) for _ in range(k)]))
        batch = tuple(entries)
        want, starts = [], []
        for entry in batch:
            starts.append(len(want))
            want.extend(entry.split(b"\n")[:-1] if entry.endswith(b"\n") else [entry])
        got = _expand(batch)
        if got == batch:  # (no items: the keys stay)
            assert want == list(batch)
            continue
        assert isinstance(got, Batch) and list(got) == want
        assert got.items == batch and got.starts.tolist() == starts
        items += 1
    assert items > 50
    same_length = (_item([b"a" * 23] * 4), _item([b"b" * 47] * 2))
    assert _expand(same_length).starts.tolist() == [0, 4]  # type: ignore[attr-defined]
    same_total = tuple(_item([b"c" * 23] * k) for k in (4, 2, 8, 2))  # 4 x 96 bytes
    assert _expand(same_total).starts.tolist() == [0, 4, 6, 14]  # type: ignore[attr-defined]


AHEAD_033 = KVLayout(
    [FullAttention(16), SlidingWindow(16, sliding_window=64)],
    model="core-ahead", hash_block_size=16, scheduler_block_size=16, vllm_version="0.33",
)


@pytest.mark.parametrize("ahead", [True, False])
def test_a_likely_miss_round_also_asks_the_windows_at_the_hit_it_would_leave(
    ahead: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a known prefix, a busy coordinator tests the chunk after it alone (likely
    absent); in a plan with other groups that round also asks their windows at the hit that
    would leave, so a confirmed miss settles the lookup in one round instead of two. The hit
    is the plan's own either way."""
    if not ahead:  # (the same lookup without it: the windows wait for a second round)
        import aio_mclookup._plan.probing_era_c as probing_era_c
        monkeypatch.setattr(probing_era_c.EraCProbeState, "_and_next", lambda s, f, w: f)
    core = core_of(cache_ttl=5.0, probe_window=16)
    doc = chain(24, b"d")
    stored = set(AHEAD_033.plan(24 * 16, doc).keys)
    first = core.begin(AHEAD_033.plan(24 * 16, doc), now=0.0)  # (learns the known prefix)
    answer_all(core, stored)
    assert first.hit == expected(first.plan, stored)
    core.begin(AHEAD_033.plan(8 * 16, chain(8, b"o")), now=0.0)  # busy: its round in flight
    in_flight, _ = core.take_batches(0.0)
    assert core.rpcs_in_flight
    plan = AHEAD_033.plan(32 * 16, doc + chain(8, b"t"))
    lookup = core.begin(plan, now=0.0)
    assert lookup.likely_miss
    first_round = {plan.keys[i] for i in lookup.round_keys}
    fa_keys, sw_keys = (set(plan._keys_at(range(p.key_offset, p.key_offset + p.chunks.size)))
                        for p in plan.groups)
    assert len(first_round & fa_keys) == 1  # the likely miss alone ...
    assert bool(first_round & sw_keys) is ahead  # ... with the window below it, or not yet
    for batch in in_flight:
        core.settle_rpc(batch, 0.0, [1 if k in stored else 0 for k in batch], 0.0)
    answer_all(core, stored)
    assert lookup.done and lookup.hit == expected(plan, stored) > 0
    assert lookup.state.rounds == (1 if ahead else 2)
