"""vLLM 0.32 / 0.33 rules: a property test against the slow 0.33 oracle, plus worked examples.

The property test draws random 0.32 / 0.33 layouts using every input those releases add
(``mla``, ``eagle`` flags, ``extra_retained_tokens``, groups that are not prefix-cacheable,
circular-buffer rings, fine-grained ``cache_hit_alignment_tokens``, store namespaces, TP-sharded
store layouts, per-group TP replication), random unaligned request lengths, random hash lists
(repeats, mixed widths, short lists) and random store answers, and checks that

* ``plan.keys`` equals the oracle's candidate keys (same keys, same order);
* ``plan.resolve_result(answers)`` equals the oracle's result (hit, tail-key boundaries, wire
  bytes), or both raise where vLLM raises;
* ``plan.resolve`` and probing through :meth:`LookupPlan.probing` agree with it.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aio_mclookup as mcl
from aio_mclookup._plan.rounds import probe_state
from aio_mclookup._reference.v033 import BaselineLookupV033

MAX_UNITS = 80
Request = tuple[dict[str, Any], int, list[bytes], str, int]


@st.composite
def layout_configs(draw: st.DrawFn) -> dict[str, Any]:
    h = draw(st.sampled_from([1, 2, 4, 8]))
    groups: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(1, 4))):
        if groups and draw(st.integers(0, 4)) == 0:
            groups.append(dict(draw(st.sampled_from(groups))))  # equal spec: merged
            continue
        kind = draw(
            st.sampled_from(
                [
                    "full_attention",
                    "full_attention",
                    "sliding_window",
                    "mamba",
                    "chunked_local",
                    "circular_buffer",
                ]
            )
        )
        block = h * draw(st.sampled_from([1, 2, 4]))
        group: dict[str, Any] = {"kind": kind, "block_size": block}
        if kind == "sliding_window":
            group["sliding_window"] = draw(st.integers(1, 5 * block))
            if draw(st.integers(0, 2)) == 0:
                group["extra_retained_tokens"] = draw(st.integers(0, 3 * block))
        elif kind == "chunked_local":
            group["attention_chunk_size"] = draw(st.sampled_from([block, 2 * block, 3 * block]))
        if kind in ("full_attention", "sliding_window") and draw(st.integers(0, 3)) == 0:
            group["mla"] = True
        if draw(st.integers(0, 5)) == 0:
            group["eagle"] = True
        if kind == "circular_buffer" or draw(st.integers(0, 7)) == 0:
            group["prefix_cacheable"] = False
        groups.append(group)
    store = [g for g in groups if g.get("prefix_cacheable", True)]
    if not store:
        groups.append({"kind": "full_attention", "block_size": h})
        store = [groups[-1]]
    sched = math.lcm(*(g["block_size"] for g in groups)) * draw(st.sampled_from([1, 1, 2]))
    cfg: dict[str, Any] = {
        "model": draw(st.sampled_from(["test-model", "org/Model-X", "/models/m/"])),
        "cache_prefix": draw(st.sampled_from(["", "", "depA"])),
        "hash_block_size": h,
        "scheduler_block_size": sched,
        "use_eagle": draw(st.booleans()),
        "groups": groups,
        "vllm_version": draw(st.sampled_from(["0.33.0", "0.33", "0.32.0", "0.32"])),
    }
    fine_ok = h < sched and all(
        g["kind"] in ("full_attention", "mamba") or g["block_size"] == h for g in store
    )
    cfg["cache_hit_alignment_tokens"] = draw(
        st.sampled_from([None, sched, h] if fine_ok else [None, sched])
    )
    if draw(st.integers(0, 2)) == 0:
        tp = draw(st.sampled_from([1, 2, 4]))
        cfg["tp_size"] = tp
        cfg["num_kv_heads"] = draw(st.sampled_from([1, 2, 3, 8]))
        cfg["dcp_size"] = draw(st.sampled_from([1, 1, 2])) if tp > 1 else 1
        cfg["pcp_size"] = draw(st.sampled_from([1, 2])) if len(store) == 1 else 1
        cfg["pp_size"] = draw(st.sampled_from([1, 2]))
        lone = store[0] if len(store) == 1 else None
        if (
            lone is not None
            and lone["kind"] == "full_attention"
            and not lone.get("mla")
            and cfg["pcp_size"] == 1
            and cfg["dcp_size"] == 1
            and draw(st.booleans())
        ):
            n = tp * draw(st.sampled_from([1, 2]))
            if cfg["num_kv_heads"] % n == 0:
                cfg["store_tp_size"] = n
                cfg["store_namespace"] = f"@store_tp:{n}@store_pp:{cfg['pp_size']}@x"
    if "store_namespace" not in cfg and draw(st.integers(0, 3)) == 0:
        cfg["store_namespace"] = "@store_pp:1@store_format:rank_local_tp1_layout_LBHNC"
    return cfg


@st.composite
def requests(draw: st.DrawFn) -> Request:
    cfg = draw(layout_configs())
    h = cfg["hash_block_size"]
    units = draw(st.integers(0, MAX_UNITS))
    num_tokens = units * h + draw(st.integers(0, h)) if units else draw(st.integers(-3, 2 * h))
    count = draw(st.sampled_from([units, units, units, max(0, units - 1), units + 2, units // 2]))
    pool = draw(st.sampled_from([3, 8, 1000]))  # small pools repeat hashes
    widths = draw(st.sampled_from([[2], [2], [1, 3]]))
    rng = random.Random(draw(st.integers(0, 2**32)))
    hashes = [
        (b"%d" % rng.randrange(pool)).rjust(rng.choice(widths), b"h")[: max(widths)]
        if pool < 1000
        else b"h%04d" % i
        for i in range(count)
    ]
    mode = draw(st.sampled_from(["all", "none", "random", "by_hash", "prefix", "raise"]))
    return cfg, num_tokens, hashes, mode, draw(st.integers(0, 2**32))


def store_answers(mode: str, seed: int, keys: list[str]) -> list[int] | None:
    rng = random.Random(seed)
    if mode == "raise":
        return None
    if mode == "all":
        return [1] * len(keys)
    if mode == "none":
        return [rng.choice([0, -1, -900, 2]) for _ in keys]
    if mode == "random":
        return [rng.choice([1, 1, 1, 0]) for _ in keys]
    if mode == "prefix":
        cut = rng.randrange(len(keys) + 1)
        return [1 if i < cut else 0 for i in range(len(keys))]
    present = {k: rng.random() < 0.8 for k in keys}  # a consistent store, by key
    return [1 if present[k] else 0 for k in keys]


def _probed_result(
    plan: mcl.LookupPlan, answers: list[int], window: int | None, ahead: int | None = None
) -> mcl.LookupResult:
    """The result of probing in rounds of ``window``; the first round also asks, with window
    ``ahead``, what the next would if its full-attention units were absent (as the
    coordinator does after a known prefix whose next chunk is likely absent)."""
    present = np.array([a == 1 for a in answers], dtype=bool)
    state = probe_state(plan)
    seen: set[int] = set()
    for i in range(plan.num_keys + 2):
        idx = state.next_keys(window, ahead if i == 0 else None)
        got = list(idx)
        if not got:
            break
        ahead = {got[pos] for pos in state.answered_ahead[0]}  # scouts answered earlier
        assert ahead <= seen
        assert not seen & (set(got) - ahead)
        seen.update(got)
        state.record(idx, present[got].tolist())
    assert state.result is not None
    assert state.hit == state.result.hit_length
    return state.result


def _consistent(keys: list[str], answers: list[int]) -> bool:
    """Each key answered one way (a store's answers; a case may answer a repeated key both)."""
    answer_of: dict[str, int] = {}
    return all(answer_of.setdefault(k, a) == a for k, a in zip(keys, answers))


def check_request(
    cfg: dict[str, Any], num_tokens: int, hashes: list[bytes], mode: str, seed: int
) -> None:
    oracle = BaselineLookupV033(cfg)
    layout = mcl.KVLayout.from_dict(cfg)
    want_keys, meta = oracle.build_keys(num_tokens, hashes)
    plan = layout.plan(num_tokens, hashes)
    assert [k.decode("ascii") for k in plan.keys] == want_keys
    assert plan.num_keys == len(want_keys)
    widths = {len(x) for x in hashes}
    if len(widths) == 1:
        blob = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(len(hashes), -1)
        assert layout.plan(num_tokens, blob).keys == plan.keys
    answers = store_answers(mode, seed, want_keys)
    try:
        want = oracle.resolve(num_tokens, hashes, meta, answers)
    except mcl.InvalidRequest:
        with pytest.raises(mcl.InvalidRequest):
            plan.resolve_result(answers)
        if answers is not None and plan.num_keys and _consistent(want_keys, answers):
            for window, ahead in ((None, None), (1, None), (8, None), (1, 16)):  # rounds
                with pytest.raises(mcl.InvalidRequest):  # raise where one round does
                    _probed_result(plan, answers, window, ahead)
        return
    got = plan.resolve_result(answers)
    assert got.hit_length == want.hit_length
    assert tuple(got.tail_key_boundaries) == tuple(want.tail_key_boundaries)
    assert got.to_bytes() == want.to_bytes()
    if answers is not None:
        assert plan.resolve(answers) == want.hit_length
        assert plan.resolve(np.array(answers, dtype=np.int64)) == want.hit_length
        if plan.num_keys:
            assert _probed_result(plan, answers, None) == got
            if _consistent(want_keys, answers):  # (a store answers a key one way: rounds
                # may rely on that)
                for window in (1, 3, 8, 16):  # (8 and up: windows with scouts)
                    assert _probed_result(plan, answers, window) == got
                for window, ahead in ((1, 1), (1, 16), (3, 8)):
                    assert _probed_result(plan, answers, window, ahead) == got


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(request=requests())
def test_matches_v033_oracle(request: Request) -> None:
    check_request(*request)


# ------------------------------------------------------------------------ worked examples
def _layout(groups: list[Any], h: int, sched: int, **kw: Any) -> mcl.KVLayout:
    return mcl.KVLayout(
        groups, model="test-model", hash_block_size=h, scheduler_block_size=sched, **kw
    )


def _h(n: int) -> list[bytes]:
    return [b"h%d" % i for i in range(n)]


def test_full_hit_is_searched_again_below_the_end() -> None:
    layout = _layout([mcl.FullAttention(16)], 16, 16)
    plan = layout.plan(64, _h(4))
    assert plan.resolve([1] * 4) == 48
    assert plan.resolve_result([1] * 4).tail_key_boundaries == (mcl.TailKeyBoundary(0, 48),)
    assert layout.plan(65, _h(4)).resolve([1] * 4) == 64  # 65 tokens: aligned inside


def test_swa_rederivation_degrades_to_zero() -> None:
    """0.26 would answer 48 here (its scheduler clamp); 0.33 re-derives on what exists: 0."""
    layout = _layout([mcl.SlidingWindow(16, sliding_window=32)], 16, 16)
    assert layout.plan(64, _h(4)).resolve([0, 0, 1, 1]) == 0


def test_mamba_keys_need_every_tp_rank() -> None:
    layout = _layout([mcl.FullAttention(16), mcl.Mamba(16)], 16, 16, tp_size=2, num_kv_heads=1)
    keys = [k.decode() for k in layout.plan(33, _h(2)).keys]
    assert len(keys) == 6
    assert [k.split("@")[1] for k in keys[2:4]] == ["tp_rank:0", "tp_rank:1"]
    assert layout.group_namespaces[1] == ((0, 0, 0, 0), (1, 0, 0, 0))


def test_eagle_gives_mamba_no_margin() -> None:
    """full16 + Mamba16, EAGLE, 65 tokens, everything present: 0.26 -> 64, 0.33 -> 48."""
    layout = _layout([mcl.FullAttention(16), mcl.Mamba(16)], 16, 16, use_eagle=True)
    plan = layout.plan(65, _h(4))
    assert plan.resolve([1] * plan.num_keys) == 48


def test_fine_grained_boundary_exceeds_the_hit() -> None:
    layout = _layout(
        [mcl.FullAttention(16), mcl.Mamba(16)],
        4,
        16,
        cache_hit_alignment_tokens=4,
        use_eagle=True,
    )
    assert layout.fine_grained and layout.lookup_alignment == 4
    hashes = _h(6)
    plan = layout.plan(25, hashes)
    keys = [k.decode() for k in plan.keys]
    present = {"group:0@6833", "group:0@6835", "group:1@6834", "group:1@6835"}
    answers = [1 if "@".join(k.rsplit("@", 2)[-2:]) in present else 0 for k in keys]
    res = plan.resolve_result(answers)
    assert res == mcl.LookupResult(20, (mcl.TailKeyBoundary(0, 24), mcl.TailKeyBoundary(1, 20)))
    assert res.to_bytes().hex() == "0000001400000000000000180000000100000014"


def test_ring_groups_are_dropped_and_later_groups_renumbered() -> None:
    layout = _layout([mcl.FullAttention(16), mcl.CircularBuffer(8), mcl.Mamba(16)], 8, 16)
    assert layout.store_group_ids == (0, None, 1)
    keys = [k.decode() for k in layout.plan(33, _h(4)).keys]
    assert {k.split("@")[5] for k in keys} == {"group:0", "group:1"}


def test_extra_retained_tokens_widen_on_033_only() -> None:
    groups = [mcl.FullAttention(32), mcl.SlidingWindow(8, 8, extra_retained_tokens=8)]
    assert _layout(groups, 8, 32).plan(96, _h(12)).num_keys == 9
    assert _layout(groups, 8, 32, vllm_version="0.32").plan(96, _h(12)).num_keys == 6


def test_store_raised_is_zero() -> None:
    plan = _layout([mcl.FullAttention(16), mcl.Mamba(16)], 16, 16).plan(48, _h(3))
    assert plan.resolve_result(None) == mcl.LookupResult(0)
    assert plan.resolve_result(None).to_bytes() == b"\0\0\0\0"


def test_chunked_local_hybrid_raises_only_when_searched() -> None:
    layout = _layout([mcl.FullAttention(32), mcl.ChunkedLocalAttention(16, 32)], 16, 32)
    plan = layout.plan(64, _h(4))
    assert plan.resolve_result(None).hit_length == 0  # the store raised: no search
    with pytest.raises(mcl.InvalidRequest):
        plan.resolve_result([1] * plan.num_keys)


def test_rounds_of_a_lone_full_attention_plan_are_exact_and_partial() -> None:
    layout = _layout([mcl.FullAttention(16)], 16, 16, use_eagle=True)
    plan = layout.plan(16 * 40, _h(40))
    assert not plan.probe_in_one_round
    present = np.array([i < 23 for i in range(plan.num_keys)])
    state = probe_state(plan)
    sent = 0
    while True:
        idx = state.next_keys(4)
        if not len(idx):
            break
        sent += len(idx)
        state.record(idx, present[np.asarray(list(idx))])
    assert state.result == plan.resolve_result(present.astype(int).tolist())
    assert state.result is not None and state.result.hit_length == 22 * 16
    assert sent < plan.num_keys


def test_hybrid_plans_probe_in_rounds_and_send_fewer_keys() -> None:
    # full 32 + SWA 8/W8, 512 tokens stored up to 256: the first round probes the full
    # prefix's first window only (SWA keys wait while full attention is unsettled); the
    # window at the hit comes once the full prefix is known.
    layout = _layout([mcl.FullAttention(32), mcl.SlidingWindow(8, 8)], 8, 32)
    plan = layout.plan(512, _h(64))
    assert not plan.probe_in_one_round
    unit = [int(bytes.fromhex(k.rsplit(b"@", 1)[1].decode())[1:]) for k in plan.keys]
    present = np.array([(u + 1) * 8 <= 256 for u in unit])  # every group, up to 256 tokens
    answers = [1 if p else 0 for p in present]
    state = probe_state(plan)
    first = state.next_keys(4)
    assert all(b"@group:0@" in plan.keys[i] for i in first)  # full attention only
    assert len(first) == 4
    state.record(first, present[np.asarray(list(first))])
    sent = len(first)
    while True:
        idx = state.next_keys(4)
        if not len(idx):
            break
        sent += len(idx)
        state.record(idx, present[np.asarray(list(idx))])
    assert state.result == plan.resolve_result(answers)
    assert state.result is not None and state.result.hit_length == 256
    assert sent < plan.num_keys // 2


def test_repeated_hashes_in_a_hybrid_plan_probe_in_one_round() -> None:
    layout = _layout([mcl.FullAttention(32), mcl.SlidingWindow(8, 8)], 8, 32)
    plan = layout.plan(128, _h(8) * 2)
    assert plan.probe_in_one_round
    state = probe_state(plan)
    idx = state.next_keys(1)
    assert list(idx) == list(range(plan.num_keys))  # everything, whatever the window
    state.record(idx, [True] * plan.num_keys)
    assert not len(state.next_keys())
    assert state.result == plan.resolve_result([1] * plan.num_keys)


def test_026_results_carry_no_boundaries() -> None:
    layout = _layout([mcl.FullAttention(16)], 16, 16, vllm_version="0.26")
    plan = layout.plan(64, _h(4))
    assert plan.resolve_result([1] * 4) == mcl.LookupResult(64)
    assert plan.resolve_result([1] * 4).to_bytes() == bytes.fromhex("00000040")
    assert plan.resolve_result(None) == mcl.LookupResult(0)
    state = probe_state(plan)
    while len(idx := state.next_keys()):
        state.record(idx, [True] * len(idx))
    assert state.result == mcl.LookupResult(64)
