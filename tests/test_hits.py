"""Hit rules: a property test against the independent vLLM 0.26 port, plus worked examples.

The property test draws random layouts (1-4 groups of every kind, identical groups that merge,
EAGLE, several rank namespaces, a cache prefix), random aligned token lengths, random hash lists
(repeats, mixed widths, short lists) and random store answers, and checks that

* ``plan.keys`` equals the reference's candidate keys (same keys, same order);
* ``plan.resolve(answers)`` equals ``BaselineLookup.resolve(...)``;
* probing in rounds (:meth:`LookupPlan.probing`) reaches the same hit.

The unit tests below it pin the manager rules to the worked examples of
``lookup-semantics.md`` (§3.1 mask table, §5.1, §5.3) that the conformance data does not hold.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aio_mclookup import (
    ChunkedLocalAttention,
    FullAttention,
    InvalidRequest,
    LookupPlan,
    Mamba,
    SlidingWindow,
)
from aio_mclookup._plan.probing import ProbeState
from aio_mclookup._reference.v026 import BaselineLookup
from v026_layouts import KVLayout  # these tests pin vLLM 0.26's rules

KINDS = ("full_attention", "sliding_window", "chunked_local", "mamba")
ABSENT = (0, -1, -900, 2)  # with 1, what the store answers; only 1 means present
Request = tuple[dict[str, Any], int, list[bytes], str, int]
MAX_UNITS = 96  # hash units per request: keeps the pure-Python reference quick


# ------------------------------------------------------------------------------ strategies
@st.composite
def layout_configs(draw: st.DrawFn) -> dict[str, Any]:
    h = draw(st.sampled_from([1, 2, 4, 8]))
    groups: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(1, 4))):
        if groups and draw(st.integers(0, 3)) == 0:
            groups.append(dict(draw(st.sampled_from(groups))))  # identical spec: merged
            continue
        kind = draw(st.sampled_from(KINDS))
        block = h * draw(st.sampled_from([1, 2, 4]))
        group: dict[str, Any] = {"kind": kind, "block_size": block}
        if kind == "sliding_window":
            group["sliding_window"] = draw(st.integers(1, 5 * block))
        elif kind == "chunked_local":
            group["attention_chunk_size"] = draw(
                st.one_of(st.integers(1, 4 * block), st.sampled_from([block, 2 * block]))
            )
        groups.append(group)
    lcm = math.lcm(*(g["block_size"] for g in groups))
    sched = lcm * draw(st.sampled_from([1, 1, 2, 4]))
    cfg: dict[str, Any] = {
        "model": draw(st.sampled_from(["test-model", "org/Model-X", "/models/m/"])),
        "cache_prefix": draw(st.sampled_from(["", "", "depA"])),
        "hash_block_size": h,
        "scheduler_block_size": sched,
        "use_eagle": draw(st.booleans()),
        "groups": groups,
    }
    # Rank namespaces: 1 in most cases, up to 8 otherwise.
    if draw(st.integers(0, 2)) == 0:
        cfg["tp_size"] = draw(st.sampled_from([1, 2, 4]))
        cfg["num_kv_heads"] = draw(st.sampled_from([1, 2, 8]))
        cfg["pcp_size"] = draw(st.sampled_from([1, 2]))
        cfg["dcp_size"] = draw(st.sampled_from([1, 1, 2]))
        cfg["pp_size"] = draw(st.sampled_from([1, 2]))
    return cfg


@st.composite
def requests(draw: st.DrawFn) -> Request:
    """(layout config, token_len, hashes, answer mode, answer seed)."""
    cfg = draw(layout_configs())
    h, sched = cfg["hash_block_size"], cfg["scheduler_block_size"]
    max_n = max(1, MAX_UNITS * h // sched)
    token_len = sched * draw(st.integers(0, max_n))
    needed = token_len // h
    has_full = any(g["kind"] == "full_attention" for g in cfg["groups"])
    count_mode = draw(st.sampled_from(["exact", "exact", "more", "fewer"]))
    if count_mode == "more":
        count = needed + draw(st.integers(1, 6))
    elif count_mode == "fewer" and has_full and needed:
        count = draw(st.integers(0, needed - 1))
    else:
        count = needed
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    width_mode = draw(st.sampled_from(["fixed", "fixed", "mixed"]))
    width = draw(st.sampled_from([1, 2, 4, 16, 32]))
    repeat_mode = draw(st.sampled_from(["distinct", "distinct", "repeats", "few"]))
    pool: list[bytes] = []
    if repeat_mode == "few":
        pool = [rnd.randbytes(width) for _ in range(rnd.randint(1, 3))]
    hashes: list[bytes] = []
    for _ in range(count):
        if pool:
            hashes.append(rnd.choice(pool))
        elif repeat_mode == "repeats" and hashes and rnd.random() < 0.3:
            hashes.append(rnd.choice(hashes))
        else:
            w = rnd.choice([2, 4, 16, 32]) if width_mode == "mixed" else width
            hashes.append(rnd.randbytes(w))
    mode = draw(st.sampled_from(["random", "producer", "producer", "all"]))
    return cfg, token_len, hashes, mode, draw(st.integers(0, 2**32 - 1))


def store_answers(
    mode: str, seed: int, ref: BaselineLookup, hashes: Sequence[bytes], meta: list[Any]
) -> list[int]:
    """The store's answers per reference key: all present, random, or a producer that stored
    every group's chunks up to some hash, with noise. Repeated keys may get conflicting
    answers."""
    k = ref._lookup_expected_per_key
    rnd = random.Random(seed)
    if mode == "all":
        return [1] * (len(meta) * k)
    if mode == "random":
        p = rnd.choice([0.3, 0.7, 0.9])
        return [1 if rnd.random() < p else rnd.choice(ABSENT) for _ in range(len(meta) * k)]
    cutoff = rnd.randint(0, len(hashes))
    stored = {(g, bytes(x)) for g in range(len(ref.group_specs)) for x in hashes[:cutoff]}
    noise = rnd.choice([0.0, 0.05, 0.2])
    out: list[int] = []
    for item in meta:
        for _ in range(k):
            present = item in stored and rnd.random() >= noise
            out.append(1 if present else rnd.choice(ABSENT))
    return out


def _distinct_spec_groups(cfg: dict[str, Any]) -> int:
    return len({tuple(sorted(g.items())) for g in cfg["groups"]})


def _expect_rejected(cfg: dict[str, Any]) -> bool:
    """vLLM 0.26 asserts in the chunked-local manager: no EAGLE, and B == L in a hybrid."""
    multi = _distinct_spec_groups(cfg) > 1
    for g in cfg["groups"]:
        if g["kind"] != "chunked_local":
            continue
        if cfg["use_eagle"] or (multi and g["block_size"] != cfg["scheduler_block_size"]):
            return True
    return False


def _short_list_with_eagle(cfg: dict[str, Any], token_len: int, hashes: Sequence[bytes]) -> bool:
    """Fewer hashes than token_len / h, EAGLE, and a group that is not full attention.

    Then vLLM's EAGLE look-ahead (one block past the running length) can make a sliding-window,
    mamba or chunked-local manager index past the end of its hash view: vLLM (and the
    reference) raise IndexError, depending on the answers. Without EAGLE the full-attention
    groups always cap the length within the hashes given.
    """
    return (
        cfg["use_eagle"]
        and len(hashes) < token_len // cfg["hash_block_size"]
        and any(g["kind"] != "full_attention" for g in cfg["groups"])
    )


def probe_in_rounds(plan: LookupPlan, answers: Sequence[int]) -> int:
    """Drive :class:`ProbeState` with answers looked up by key index."""
    present = np.array([a == 1 for a in answers], dtype=bool)
    state = ProbeState(plan)
    seen: set[int] = set()
    for _ in range(10_000):
        idx = state.next_keys()
        if not len(idx):
            break
        got = np.asarray(idx).tolist()
        assert got == sorted(set(got)), "next_keys must be ascending and unique"
        assert got[0] >= 0 and got[-1] < plan.num_keys
        assert not seen & set(got), "a key was probed twice"
        seen.update(got)
        state.record(idx, present[got].tolist())  # a list, as the coordinator passes
    else:  # pragma: no cover
        raise AssertionError("probing did not converge")
    assert state.hit is not None
    return state.hit


# ------------------------------------------------------------------------ property test
def check_request(
    cfg: dict[str, Any], token_len: int, hashes: list[bytes], mode: str, seed: int
) -> None:
    layout = KVLayout.from_dict(cfg)
    ref = BaselineLookup(cfg)
    ref_keys, meta = ref.build_keys(token_len, hashes)
    if ref_keys and _expect_rejected(cfg):
        with pytest.raises(InvalidRequest):
            layout.plan(token_len, hashes)
        # vLLM asserts in the chunked-local manager (or, with a short hash list and EAGLE, may
        # index past the end of a view before it gets there).
        with pytest.raises((AssertionError, IndexError)):
            ref.resolve(token_len, hashes, meta, [1] * len(ref_keys))
        return
    short_eagle = _short_list_with_eagle(cfg, token_len, hashes)
    try:
        plan = layout.plan(token_len, hashes)
    except InvalidRequest:
        if short_eagle:  # refusing what vLLM may crash on is fine
            return
        raise
    keys = plan.keys
    assert all(isinstance(key, bytes) for key in keys)
    assert [key.decode("ascii") for key in keys] == ref_keys
    assert len(plan) == plan.num_keys == len(ref_keys)
    widths = {len(x) for x in hashes}
    if len(widths) == 1 and widths != {0}:
        blob = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(len(hashes), -1)
        assert layout.plan(token_len, blob).keys == keys
    answers = store_answers(mode, seed, ref, hashes, meta)
    want: int | None
    if short_eagle:
        try:
            want = ref.resolve(token_len, hashes, meta, answers)
        except IndexError:
            want = None  # vLLM raises too: any answer of ours is acceptable, but no crash
        try:
            got = plan.resolve(answers)
        except InvalidRequest:
            return
    else:
        want = ref.resolve(token_len, hashes, meta, answers)
        got = plan.resolve(answers)
    if want is not None:
        assert got == want
        assert want % (cfg["scheduler_block_size"] if _distinct_spec_groups(cfg) > 1 else 1) == 0
    assert 0 <= got <= max(token_len, 0)
    assert plan.resolve(np.array(answers, dtype=np.int64)) == got
    assert probe_in_rounds(plan, answers) == got


_W1_EAGLE = {  # regression examples found by this test (see the unit tests below)
    "model": "m",
    "hash_block_size": 1,
    "scheduler_block_size": 2,
    "use_eagle": True,
    "groups": [
        {"kind": "full_attention", "block_size": 1},
        {"kind": "full_attention", "block_size": 2},
        {"kind": "sliding_window", "block_size": 1, "sliding_window": 1},
    ],
}
_SHORT_EAGLE = {
    "model": "m",
    "hash_block_size": 16,
    "scheduler_block_size": 32,
    "use_eagle": True,
    "groups": [
        {"kind": "full_attention", "block_size": 16},
        {"kind": "sliding_window", "block_size": 32, "sliding_window": 32},
    ],
}


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(request=requests())
@example(request=(_W1_EAGLE, 4, [b"x"] * 4, "all", 0))
@example(request=(_SHORT_EAGLE, 64, [b"a", b"b", b"c"], "all", 0))
def test_matches_reference(request: Request) -> None:
    check_request(*request)


# --------------------------------------------------------------------- worked examples
def _layout(groups: list[Any], h: int, sched: int, **kw: Any) -> KVLayout:
    return KVLayout(groups, model="test-model", hash_block_size=h, scheduler_block_size=sched, **kw)


def _hashes(n: int) -> list[bytes]:
    return [b"h%d" % i for i in range(n)]


def _mask(plan: LookupPlan, group: int) -> str:
    probe = plan.groups[group]
    bits = np.zeros(probe.limit, dtype=bool)
    bits[probe.chunks] = True
    return "".join("1" if b else "0" for b in bits)


@pytest.mark.parametrize(
    ("groups", "sched", "h", "eagle", "token_len", "expected"),
    [
        # §3.1 worked masks (produced by the real vLLM code)
        ([FullAttention(32), SlidingWindow(8, 8)], 32, 8, False, 96, "000100010001"),
        ([FullAttention(32), SlidingWindow(8, 8)], 32, 8, False, 128, "0001000100010001"),
        ([FullAttention(32), SlidingWindow(8, 16)], 32, 8, False, 96, "001100110011"),
        ([FullAttention(32), SlidingWindow(8, 8)], 32, 8, True, 96, "000110011001"),
        ([FullAttention(16), SlidingWindow(32, 64)], 32, 16, False, 96, "111"),
    ],
)
def test_sliding_window_mask_table(
    groups: list[Any], sched: int, h: int, eagle: bool, token_len: int, expected: str
) -> None:
    plan = _layout(groups, h, sched, use_eagle=eagle).plan(token_len, _hashes(token_len // h))
    assert _mask(plan, 1) == expected
    assert plan.groups[0].dense


def test_swa_only_single_group_mask_is_all() -> None:
    plan = _layout([SlidingWindow(16, 32)], 16, 16).plan(160, _hashes(10))
    assert plan.groups[0].dense and plan.groups[0].limit == 10


def test_dsv4_masks_at_1024_tokens() -> None:
    """§3.1 last row: None; 8 of 16 (2,3,6,7,..); 8 of 256 (62,63,126,127,..); 64 of 128."""
    layout = _layout(
        [FullAttention(256), SlidingWindow(64, 128), SlidingWindow(4, 8), SlidingWindow(8, 128)],
        4,
        256,
    )
    plan = layout.plan(1024, _hashes(256))
    assert [g.chunks.size for g in plan.groups] == [4, 8, 8, 64]
    assert [g.limit for g in plan.groups] == [4, 16, 256, 128]
    assert plan.groups[1].chunks.tolist() == [2, 3, 6, 7, 10, 11, 14, 15]
    assert plan.groups[2].chunks.tolist() == [62, 63, 126, 127, 190, 191, 254, 255]
    swa8 = plan.groups[3].chunks.tolist()
    assert swa8 == [c for seg in range(4) for c in range(32 * seg + 16, 32 * seg + 32)]
    assert plan.num_keys == 84


@pytest.mark.parametrize(
    ("token_len", "counts"),
    [(131_072, [512, 1024, 1024, 8192]), (1_048_576, [4096, 8192, 8192, 65536])],
)
def test_dsv4_probe_counts(token_len: int, counts: list[int]) -> None:
    """§5.3 DSv4-shaped probe counts: 79.2 % of the chunks are masked at every length."""
    layout = _layout(
        [FullAttention(256), SlidingWindow(64, 128), SlidingWindow(4, 8), SlidingWindow(8, 128)],
        4,
        256,
    )
    rows = np.zeros((token_len // 4, 1), dtype=np.uint8)
    plan = layout.plan(token_len, rows)
    assert [g.chunks.size for g in plan.groups] == counts
    assert plan.num_keys == sum(counts)


def _resolve(layout: KVLayout, token_len: int, n: int, exists: list[int]) -> int:
    plan = layout.plan(token_len, _hashes(n))
    ref = BaselineLookup(layout.to_dict())
    keys, meta = ref.build_keys(token_len, _hashes(n))
    assert [k.decode() for k in plan.keys] == keys
    hit = plan.resolve(exists)
    assert hit == ref.resolve(token_len, _hashes(n), meta, exists)
    assert probe_in_rounds(plan, exists) == hit
    return hit


def test_coordinator_tests_full16() -> None:
    """§5.1 coordinator tests: single full 16 with 4 chunks."""
    layout = _layout([FullAttention(16)], 16, 16)
    assert _resolve(layout, 64, 4, [1, 1, 1, 1]) == 64
    assert _resolve(layout, 64, 4, [1, 1, 0, 0]) == 32
    assert _resolve(layout, 64, 4, [0, 0, 0, 0]) == 0
    eagle = _layout([FullAttention(16)], 16, 16, use_eagle=True)
    assert _resolve(eagle, 64, 4, [1, 1, 1, 1]) == 48


def test_coordinator_tests_hybrid_full16_swa16() -> None:
    layout = _layout([FullAttention(16), SlidingWindow(16, 32)], 16, 16)
    assert _resolve(layout, 64, 4, [1] * 8) == 64
    # A hole at full chunk 1 clips both groups to 16.
    assert _resolve(layout, 64, 4, [1, 0, 1, 1, 1, 1, 1, 1]) == 16


def test_full_eagle_drops_before_aligning() -> None:
    """§7.1 of the rule notes: full16 with L=32, EAGLE, 4 present: 4 -> 3 -> 2 blocks = 32."""
    layout = _layout([FullAttention(16), SlidingWindow(32, 32)], 16, 32, use_eagle=True)
    plan = layout.plan(64, _hashes(4))
    assert plan.groups[0].limit == 4
    assert _resolve(layout, 64, 4, [1] * plan.num_keys) == 32


def test_swa_run_touching_block_zero_counts_below_window() -> None:
    """Single SWA group, window longer than the present prefix: the leading run is a hit."""
    layout = _layout([SlidingWindow(16, 64)], 16, 16)  # need = ceil(63 / 16) = 4 blocks
    assert _resolve(layout, 64, 4, [1, 1, 0, 0]) == 32
    assert _resolve(layout, 64, 4, [0, 1, 1, 1]) == 0  # a run of 3 < 4, not touching block 0
    assert _resolve(layout, 64, 4, [1, 1, 1, 1]) == 64
    shorter = _layout([SlidingWindow(16, 48)], 16, 16)  # need 3
    assert _resolve(shorter, 64, 4, [0, 1, 1, 1]) == 64
    assert _resolve(shorter, 64, 4, [0, 1, 0, 1]) == 0


def test_swa_unaligned_opener_is_skipped() -> None:
    """Full 32 + SWA 8/W16 (need 2): a run must open at an aligned right edge."""
    layout = _layout([FullAttention(32), SlidingWindow(8, 16)], 8, 32)
    # keys: g0 h3 h7 h11, g1 chunks 2,3,6,7,10,11
    full = [1, 1, 1]
    assert _resolve(layout, 96, 12, [*full, 1, 1, 1, 1, 1, 1]) == 96
    assert _resolve(layout, 96, 12, [*full, 1, 1, 1, 1, 1, 0]) == 64
    assert _resolve(layout, 96, 12, [*full, 1, 1, 0, 1, 0, 1]) == 32
    assert _resolve(layout, 96, 12, [*full, 0, 1, 0, 1, 0, 1]) == 0


def test_chunked_local_counts_blocks_before_current_chunk() -> None:
    """C12: chunked-local B16 chunk 32, T=80: only block 4 decides between 64 and 80."""
    layout = _layout([ChunkedLocalAttention(16, 32)], 16, 16)
    assert _resolve(layout, 80, 5, [0, 0, 0, 0, 1]) == 80
    assert _resolve(layout, 80, 5, [1, 1, 1, 1, 0]) == 64
    # A chunk as long as the request: nothing before its start, a miss at 0 means 0.
    whole = _layout([ChunkedLocalAttention(16, 128)], 16, 16)
    assert _resolve(whole, 80, 5, [0, 1, 1, 1, 1]) == 0
    # chunk == B: every block is "before the current chunk", a full hit whatever the store says.
    tiny = _layout([ChunkedLocalAttention(16, 16)], 16, 16)
    assert _resolve(tiny, 80, 5, [0, 0, 0, 0, 0]) == 80


def test_mamba_rightmost_aligned_state() -> None:
    """Single mamba: the rightmost present block counts; hybrid: it must end on L."""
    single = _layout([Mamba(16)], 16, 16)
    assert _resolve(single, 64, 4, [0, 1, 0, 0]) == 32
    assert _resolve(single, 64, 4, [1, 0, 0, 1]) == 64
    eagle = _layout([Mamba(16)], 16, 16, use_eagle=True)
    assert _resolve(eagle, 64, 4, [1, 1, 1, 1]) == 64  # 0.26 ignores EAGLE for mamba
    hybrid = _layout([FullAttention(32), Mamba(16)], 16, 32)
    # keys: g0 h1 h3, g1 h0..h3 ; mamba block 2 ends at 48 (not aligned to 32)
    assert _resolve(hybrid, 64, 4, [1, 1, 0, 0, 1, 0]) == 0
    assert _resolve(hybrid, 64, 4, [1, 1, 0, 1, 1, 0]) == 32


def test_mamba_absorbs_full_eagle_drop() -> None:
    """Rule notes §8.1: full16 + mamba16, EAGLE, all present, T=64 -> 64 (not 48)."""
    layout = _layout([FullAttention(16), Mamba(16)], 16, 16, use_eagle=True)
    assert _resolve(layout, 64, 4, [1] * 8) == 64


def test_merged_groups_need_every_member() -> None:
    """E1 shape with full attention: identical groups merge; a hole in one clips both."""
    layout = _layout([FullAttention(16), FullAttention(16)], 16, 16)
    assert len(layout._geometry.spec_groups) == 1
    assert _resolve(layout, 64, 4, [1, 1, 1, 1, 1, 0, 1, 1]) == 16


def test_three_spec_groups_converge() -> None:
    """Full + two different SWA specs: the passes repeat until the length stops falling."""
    layout = _layout(
        [FullAttention(32), SlidingWindow(8, 8), SlidingWindow(16, 32)], 8, 32
    )
    plan = layout.plan(128, _hashes(16))
    n = plan.num_keys
    assert _resolve(layout, 128, 16, [1] * n) == 128
    rng = np.random.default_rng(7)
    for _ in range(50):
        exists = rng.choice([1, 1, 1, 0], size=n).tolist()
        _resolve(layout, 128, 16, exists)


def test_repeated_hash_presence_is_per_hash() -> None:
    """A (group, hash) counts as present if any of its positions answered 1."""
    layout = _layout([FullAttention(16)], 16, 16)
    same = [b"x", b"x", b"y"]
    plan = layout.plan(48, same)
    ref = BaselineLookup(layout.to_dict())
    _, meta = ref.build_keys(48, same)
    built = layout.plan(48, same)
    assert built.keys[0] == built.keys[1]
    for exists in ([1, 0, 1], [0, 1, 1], [0, 0, 1], [1, 1, 0]):
        want = ref.resolve(48, same, meta, exists)
        assert plan.resolve(exists) == want
        assert built.resolve(exists) == want  # keys assembled: repeats are found by key
        assert plan.resolve(np.array(exists)) == want
        assert probe_in_rounds(plan, exists) == want
    assert plan.resolve([0, 1, 1]) == 48


@pytest.mark.parametrize("bad", [0, -1, -900, -901, 2, 3, True, False, None, 1.0, 0.5])
def test_only_exactly_one_is_present(bad: Any) -> None:
    layout = _layout([FullAttention(16)], 16, 16)
    plan = layout.plan(48, _hashes(3))
    hit = plan.resolve([1, bad, 1])
    # vLLM tests `answer == 1`: True == 1 and 1.0 == 1 hold in Python as well.
    assert hit == (48 if bad == 1 else 16)


@pytest.mark.parametrize("odd", ["1", b"1"])
def test_resolve_mixed_type_answers_compare_like_python(odd: Any) -> None:
    """vLLM: `[1, "1", 1]` -> only positions 0 and 2 equal 1 -> hit 16.

    BUG (reported): ``np.asarray([1, "1", 1])`` turns every answer into a string, so no answer
    equals 1 and resolve returns 0.
    """
    layout = _layout([FullAttention(16)], 16, 16)
    plan = layout.plan(48, _hashes(3))
    ref = BaselineLookup(layout.to_dict())
    _, meta = ref.build_keys(48, _hashes(3))
    answers = [1, odd, 1]
    assert ref.resolve(48, _hashes(3), meta, answers) == 16
    assert plan.resolve(answers) == 16


# ------------------------------------------------------------ regressions found by the property
def test_repeated_hash_feeds_unprobed_window_block() -> None:
    """BUG (reported): vLLM records presence per (group, hash). With EAGLE and three spec-groups
    the second pass re-runs the sliding window without the EAGLE drop and reads block 1, which
    the EAGLE mask does not probe (W=1: need 0, so the probed block is the one after each
    boundary). Its hash equals the probed block 2's hash, so vLLM counts it present: hit 2.
    We count unprobed chunks as absent in hybrid layouts: hit 0."""
    hashes = [b"x"] * 4
    layout = KVLayout.from_dict(_W1_EAGLE)
    ref = BaselineLookup(_W1_EAGLE)
    keys, meta = ref.build_keys(4, hashes)
    answers = [1] * len(keys)
    assert ref.resolve(4, hashes, meta, answers) == 2
    plan = layout.plan(4, hashes)
    assert [k.decode() for k in plan.keys] == keys
    assert plan.resolve(answers) == 2


def test_short_hash_list_with_eagle_rounds_match_resolve() -> None:
    """BUG (reported): full16 + SWA32/W32, h=16, L=32, EAGLE, token_len 64 with 3 hashes
    (fewer than 64/16). vLLM and resolve give 0 for answers [1, 1, 0, 1], but probing in
    rounds raises IndexError: its optimistic first pass (unknown = present) runs the window
    one block past the hashes given (the EAGLE look-ahead).

    Either refuse the request up front (InvalidRequest) or answer without crashing."""
    hashes = [b"a", b"b", b"c"]
    layout = KVLayout.from_dict(_SHORT_EAGLE)
    ref = BaselineLookup(_SHORT_EAGLE)
    _, meta = ref.build_keys(64, hashes)
    answers = [1, 1, 0, 1]
    assert ref.resolve(64, hashes, meta, answers) == 0
    try:
        plan = layout.plan(64, hashes)
    except InvalidRequest:
        return
    assert plan.resolve(answers) == 0
    assert probe_in_rounds(plan, answers) == 0


def test_short_hash_list_with_eagle_resolve_does_not_crash() -> None:
    """BUG (reported): the same request with every key present. vLLM 0.26 (and the reference)
    raise IndexError; our resolve raises a bare IndexError too instead of InvalidRequest."""
    hashes = [b"a", b"b", b"c"]
    layout = KVLayout.from_dict(_SHORT_EAGLE)
    try:
        plan = layout.plan(64, hashes)
    except InvalidRequest:
        return
    with contextlib.suppress(InvalidRequest):
        plan.resolve([1] * plan.num_keys)
