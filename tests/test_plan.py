"""LookupPlan: request validation, key assembly, resolve, and the hashes planning touches."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np
import pytest

from aio_mclookup import (
    FullAttention,
    InvalidRequest,
    Mamba,
    SlidingWindow,
)
from aio_mclookup._plan.probing import ProbeState
from aio_mclookup._reference.v026 import BaselineLookup
from v026_layouts import KVLayout  # these tests pin vLLM 0.26's rules


def _hashes(n: int) -> list[bytes]:
    return [b"h%d" % i for i in range(n)]


def _full16(**kw: Any) -> KVLayout:
    return KVLayout([FullAttention(16)], model="test-model", hash_block_size=16,
                    scheduler_block_size=16, **kw)


def _seed_layout(**kw: Any) -> KVLayout:
    """The issue's config: full attention B=32 + sliding window B=8/W=8, h=8, L=32."""
    return KVLayout([FullAttention(32), SlidingWindow(8, 8)], model="test-model",
                    hash_block_size=8, scheduler_block_size=32, **kw)


def _dsv4(**kw: Any) -> KVLayout:
    return KVLayout(
        [FullAttention(256), SlidingWindow(64, 128), SlidingWindow(4, 8), SlidingWindow(8, 128)],
        model="deepseek-ai/DeepSeek-V4-Pro", hash_block_size=4, scheduler_block_size=256, **kw,
    )


def _ref_keys(layout: KVLayout, token_len: int, hashes: Sequence[bytes]) -> list[str]:
    return BaselineLookup(layout.to_dict()).build_keys(token_len, hashes)[0]


def _decoded(keys: list[bytes]) -> list[str]:
    return [k.decode("ascii") for k in keys]


# ---------------------------------------------------------------------------- token_len
@pytest.mark.parametrize("bad", [True, False, 48.0, "48", None, 4.8e1, [48]])
def test_token_len_must_be_an_int(bad: Any) -> None:
    with pytest.raises(InvalidRequest, match="token_len"):
        _full16().plan(bad, _hashes(3))


def test_token_len_numpy_int_is_accepted() -> None:
    plan = _full16().plan(np.int64(48), _hashes(3))
    assert plan.num_keys == 3 and plan.token_len == 48 and type(plan.token_len) is int


@pytest.mark.parametrize("token_len", [40, 8, 17, 100])
def test_unaligned_token_len_with_hashes_is_refused(token_len: int) -> None:
    with pytest.raises(InvalidRequest, match="multiple of scheduler_block_size"):
        _full16().plan(token_len, _hashes(10))
    with pytest.raises(ValueError):
        _seed_layout().plan(token_len if token_len % 32 else token_len + 8, _hashes(16))


@pytest.mark.parametrize("hashes", [[], (), np.zeros((0, 32), dtype=np.uint8),
                                    np.zeros((4, 0), dtype=np.uint8)])
def test_no_hashes_gives_no_keys(hashes: Any) -> None:
    for token_len in (40, 48, 0, -16, 13):
        plan = _full16().plan(token_len, hashes)
        assert plan.keys == [] and plan.num_keys == 0 and len(plan) == 0
        assert plan.resolve([]) == 0
        assert plan.resolve(np.zeros(0, dtype=np.int64)) == 0


@pytest.mark.parametrize("token_len", [0, -16, -1, -17])
def test_non_positive_token_len_gives_no_keys(token_len: int) -> None:
    for layout in (_full16(), _seed_layout(), _dsv4()):
        plan = layout.plan(token_len, _hashes(64))
        assert plan.keys == []
        assert plan.resolve([]) == 0
        state = ProbeState(plan)
        assert len(state.next_keys()) == 0 and state.hit == 0


def test_no_candidate_keys_resolves_to_zero() -> None:
    """Hashes for less than one chunk of every group: no keys, hit 0 (vLLM: no RPC)."""
    layout = KVLayout([FullAttention(64)], model="m", hash_block_size=16, scheduler_block_size=64)
    plan = layout.plan(128, _hashes(3))
    assert plan.keys == [] and plan.resolve([]) == 0


# ------------------------------------------------------------------------------ hashes
@pytest.mark.parametrize(("bad", "pos"), [(5, 1), ("h1", 1), (None, 2), (1.5, 0), ([1, 2], 2)])
def test_non_bytes_hash_is_refused_naming_its_index(bad: Any, pos: int) -> None:
    hashes: list[Any] = _hashes(3)
    hashes[pos] = bad
    with pytest.raises(InvalidRequest, match=rf"block_hashes\[{pos}\]"):
        _full16().plan(48, hashes)


@pytest.mark.parametrize("bad", [b"h0h1", "h0h1", bytearray(b"ab"), memoryview(b"ab"), 3, None,
                                 {b"a": 1}, {b"a", b"b"}])
def test_block_hashes_must_be_a_sequence(bad: Any) -> None:
    with pytest.raises(InvalidRequest):
        _full16().plan(32, bad)


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((4, 2, 16), dtype=np.uint8),  # 3-D
        np.zeros((4, 16), dtype=np.float32),  # float
        np.zeros((4, 16), dtype=np.float64),
        np.zeros((4, 16), dtype=np.int64),  # not uint8
        np.zeros((4, 16), dtype=np.int8),
        np.zeros(64, dtype=np.uint8),  # 1-D
        np.array([b"a" * 16] * 4, dtype=object),
        np.array([b"a" * 16] * 4),  # |S16
    ],
)
def test_bad_hash_arrays_are_refused(array: np.ndarray) -> None:
    with pytest.raises(InvalidRequest, match="block_hashes"):
        _full16().plan(64, array)


def test_too_few_hashes_without_full_attention_is_refused() -> None:
    swa = KVLayout([SlidingWindow(16, 32)], model="m", hash_block_size=16, scheduler_block_size=16)
    with pytest.raises(InvalidRequest, match="hashes"):
        swa.plan(64, _hashes(3))
    assert swa.plan(64, _hashes(4)).num_keys == 4
    hybrid = KVLayout([SlidingWindow(8, 8), Mamba(32)], model="m", hash_block_size=8,
                      scheduler_block_size=32)
    with pytest.raises(InvalidRequest):
        hybrid.plan(96, _hashes(11))
    with pytest.raises(InvalidRequest):
        hybrid.plan(96, np.zeros((11, 32), dtype=np.uint8))


def test_full_attention_truncates_to_the_hashes_given() -> None:
    """C2: full16 with 3 hashes for 64 tokens -> 3 keys, hit 48."""
    plan = _full16().plan(64, _hashes(3))
    assert plan.num_keys == 3
    assert plan.resolve([1, 1, 1]) == 48
    seed = _seed_layout()
    for n in range(13):
        plan = seed.plan(96, _hashes(n))
        assert _decoded(plan.keys) == _ref_keys(seed, 96, _hashes(n))
        assert plan.num_keys == (n // 4) + len([i for i in (3, 7, 11) if i < n])
        if n:
            assert plan.groups[0].limit == n // 4


def test_hashes_beyond_token_len_are_ignored() -> None:
    plan = _seed_layout().plan(64, _hashes(40))
    assert _decoded(plan.keys) == _ref_keys(_seed_layout(), 64, _hashes(40))
    assert plan.num_keys == 4


def test_mixed_hash_widths_give_vllm_keys() -> None:
    rng = random.Random(3)
    for layout in (_full16(tp_size=2, num_kv_heads=2), _seed_layout(), _dsv4()):
        token_len = layout.scheduler_block_size * 4
        n = token_len // layout.hash_block_size
        hashes = [rng.randbytes(rng.choice([1, 2, 16, 32])) for _ in range(n)]
        plan = layout.plan(token_len, hashes)
        assert _decoded(plan.keys) == _ref_keys(layout, token_len, hashes)
        idx = np.array(sorted(rng.sample(range(plan.num_keys), plan.num_keys // 2)))
        assert layout.plan(token_len, hashes)._keys_at(idx) == [plan.keys[i] for i in idx]


def test_hash_widths_16_and_32() -> None:
    for width in (16, 32, 1, 64):
        hashes = [bytes([i]) * width for i in range(12)]
        plan = _seed_layout().plan(96, hashes)
        assert _decoded(plan.keys) == _ref_keys(_seed_layout(), 96, hashes)
        assert all(len(k.rsplit(b"@", 1)[1]) == 2 * width for k in plan.keys)


class BlockHash(bytes):
    """vLLM's BlockHash is a bytes subclass."""


def test_bytes_subclasses_and_bytes_likes_are_accepted() -> None:
    raw = [bytes([i, 255 - i]) * 8 for i in range(12)]
    want = _ref_keys(_seed_layout(), 96, raw)
    hashes: Any
    for hashes in (
        [BlockHash(h) for h in raw],
        tuple(raw),
        [bytearray(h) for h in raw],
        [memoryview(h) for h in raw],
    ):
        plan = _seed_layout().plan(96, hashes)
        assert _decoded(plan.keys) == want
        assert plan.resolve([1] * plan.num_keys) == 96


def test_hash_array_forms() -> None:
    rng = np.random.default_rng(5)
    rows = rng.integers(0, 256, size=(24, 32), dtype=np.uint8)
    as_list = [bytes(r) for r in rows]
    layout = _seed_layout(tp_size=2, num_kv_heads=2)
    want = layout.plan(96, as_list[:12]).keys
    assert layout.plan(96, rows[:12]).keys == want
    assert layout.plan(96, np.asfortranarray(rows[:12])).keys == want
    strided = np.empty((12, 64), dtype=np.uint8)
    strided[:, ::2] = rows[:12]
    assert layout.plan(96, strided[:, ::2]).keys == want  # non-contiguous rows
    assert layout.plan(96, rows[::2]).keys == layout.plan(96, as_list[::2]).keys
    assert layout.plan(96, rows[:, :16]).keys == layout.plan(96, [r[:16] for r in as_list]).keys


# -------------------------------------------------------------------------------- keys
def test_keys_are_ascii_bytes_in_vllm_order() -> None:
    plan = _seed_layout().plan(96, _hashes(12))
    assert all(type(k) is bytes and k.isascii() for k in plan.keys)
    assert _decoded(plan.keys) == [
        "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@6833",
        "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@6837",
        "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@683131",
        "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1@6833",
        "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1@6837",
        "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1@683131",
    ]
    assert plan.keys is plan.keys  # assembled once


@pytest.mark.parametrize(
    "layout",
    [
        _full16(),
        _seed_layout(tp_size=4, num_kv_heads=4, pp_size=2),
        _dsv4(cache_prefix="depA"),
        # prefixes of different widths (tp_rank:9 vs tp_rank:10)
        KVLayout([FullAttention(16), SlidingWindow(16, 16)], model="m", hash_block_size=16,
                 scheduler_block_size=16, tp_size=12, num_kv_heads=12),
        # groups of different key widths (group:9 vs group:10): assembled group by group
        KVLayout([FullAttention(16)] + [SlidingWindow(16, 16 * i) for i in range(1, 11)],
                 model="m", hash_block_size=16, scheduler_block_size=16),
    ],
)
def test_keys_at_matches_keys(layout: KVLayout) -> None:
    rng = np.random.default_rng(11)
    token_len = layout.scheduler_block_size * 8
    n = token_len // layout.hash_block_size
    hashes = [bytes(r) for r in rng.integers(0, 256, size=(n, 32), dtype=np.uint8)]
    full = layout.plan(token_len, hashes)
    keys = full.keys
    assert _decoded(keys) == _ref_keys(layout, token_len, hashes)
    for size in (0, 1, 5, 63, 64, 200, full.num_keys):
        size = min(size, full.num_keys)
        idx = np.sort(rng.choice(full.num_keys, size=size, replace=False)).astype(np.int64)
        want = [keys[i] for i in idx.tolist()]
        assert layout.plan(token_len, hashes)._keys_at(idx) == want  # before keys are assembled
        assert full._keys_at(idx) == want  # after
    arr = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(n, 32)
    assert layout.plan(token_len, arr).keys == keys
    idx = np.arange(0, full.num_keys, 3, dtype=np.int64)
    assert layout.plan(token_len, arr)._keys_at(idx) == [keys[i] for i in idx.tolist()]
    span = range(full.num_keys // 3, full.num_keys - 1)  # contiguous runs come as ranges
    assert layout.plan(token_len, hashes)._keys_at(span) == keys[span.start : span.stop]
    assert full._keys_at(span) == keys[span.start : span.stop]


@pytest.mark.parametrize("eagle", [False, True])
@pytest.mark.parametrize("extra", [0, 1, 2, 31, 33, 62, 63])
def test_sliding_window_tails_read_from_lists_in_vllm_order(eagle: bool, extra: int) -> None:
    """List hashes of a sliding window's tails are read with strided slices (one per offset in
    the scheduler block), the last block possibly cut short by the hashes given."""
    layout = _dsv4(use_eagle=eagle)
    token_len = 256 * 8
    n = 64 * 5 + extra  # fewer hashes than token_len needs: the last block is partial
    hashes = [bytes(r) for r in np.random.default_rng(extra).integers(0, 256, (n, 8), np.uint8)]
    want = _ref_keys(layout, token_len, hashes)
    assert _decoded(layout.plan(token_len, hashes).keys) == want
    assert _decoded(layout.plan(token_len, tuple(hashes)).keys) == want
    mixed = [*hashes[:-1], hashes[-1] + b"!"]  # one wider hash: kept as bytes
    assert _decoded(layout.plan(token_len, mixed).keys) == _ref_keys(layout, token_len, mixed)


def _dsv4_answers(plan: Any, rng: np.random.Generator) -> Iterator[list[int]]:
    """Random answers, then prefix-shaped ones (present up to a cut, absent after)."""
    for _ in range(20):
        yield rng.choice([1, 1, 1, 0], size=plan.num_keys).tolist()
    for cut in (0, plan.num_keys // 3, plan.num_keys // 2, plan.num_keys):
        yield [1] * cut + [0] * (plan.num_keys - cut)


@pytest.mark.parametrize("form", ["list", "array"])
def test_groups_whose_hashes_another_group_probes_read_them_from_it(form: str) -> None:
    """DSv4-like: the full-attention chunk ends and SWA-64's tails are among SWA-8's tails, so
    those groups take their rows from SWA-8's (one read of the request for all three)."""
    layout = _dsv4()
    token_len = 256 * 8
    rows = np.random.default_rng(1).integers(0, 256, size=(token_len // 4, 32), dtype=np.uint8)
    hashes: Any = [bytes(r) for r in rows] if form == "list" else rows
    plan = layout.plan(token_len, hashes)
    supersets = [p.subset_of.group_id if p.subset_of else None for p in plan.groups]
    assert supersets == [3, 3, None, None]
    assert _decoded(plan.keys) == _ref_keys(layout, token_len, [bytes(r) for r in rows])
    for probe in plan.groups:  # each group's rows are its own chunks' hashes, in order
        units = probe.chunks * (layout.groups[probe.group_id].block_size // 4) + (
            layout.groups[probe.group_id].block_size // 4 - 1
        )
        assert probe.hash_rows is not None
        assert (probe.hash_rows == rows[units]).all() and probe.hash_rows.flags.c_contiguous


def test_a_superset_of_mixed_widths_leaves_its_subsets_to_read_on_their_own() -> None:
    layout = _dsv4()
    token_len = 256 * 8
    hashes = [bytes([i % 256, i // 256]) * 16 for i in range(token_len // 4)]
    hashes[33] += b"!"  # read by SWA-8 only: its hashes are of mixed widths
    plan = layout.plan(token_len, hashes)
    assert plan.groups[3].hash_rows is None and plan.groups[0].hash_rows is not None
    assert [p.subset_of for p in plan.groups] == [None] * 4
    assert _decoded(plan.keys) == _ref_keys(layout, token_len, hashes)


@pytest.mark.parametrize("form", ["list", "array"])
@pytest.mark.parametrize(
    ("same", "repeats"),
    [
        ((), ()),
        ((63, 191), (0, 1, 2, 3)),  # a full-attention chunk end: every group reads it
        ((33, 99), (3,)),  # only SWA-8 reads these: groups 0 and 1 need their own check
        ((62, 126), (2,)),
        ((47, 111), (1, 3)),
    ],
)
def test_repeated_hashes_are_found_in_groups_read_from_another(
    form: str, same: tuple[int, ...], repeats: tuple[int, ...]
) -> None:
    """vLLM records presence per (group, hash): a group whose rows come from a superset's
    trusts the superset's "no repeats", and otherwise checks its own rows."""
    layout = _dsv4()
    token_len = 256 * 8
    rows = np.random.default_rng(2).integers(0, 256, size=(token_len // 4, 32), dtype=np.uint8)
    if same:
        rows[same[1]] = rows[same[0]]
    as_list = [bytes(r) for r in rows]
    hashes: Any = as_list if form == "list" else rows
    plan = layout.plan(token_len, hashes)
    assert [g for g, p in enumerate(plan.groups) if p.hash_ids is not None] == list(repeats)
    ref = BaselineLookup(layout.to_dict())
    _, meta = ref.build_keys(token_len, as_list)
    for exists in _dsv4_answers(plan, np.random.default_rng(len(same) and same[0])):
        assert layout.plan(token_len, hashes).resolve(exists) == ref.resolve(
            token_len, as_list, meta, exists
        )


def test_sliding_window_tails_of_widths_that_sum_right_are_kept_as_bytes() -> None:
    """Hashes of 31 and 33 bytes in one strided slice join to as many bytes as two of 32: every
    item's width is checked, so they are not cut into wrong rows."""
    layout = _dsv4()
    token_len = 256 * 8
    hashes = [bytes([i % 256, i // 256]) * 16 for i in range(token_len // 4)]
    hashes[47], hashes[111] = hashes[47][:31], hashes[111] + b"!"  # SWA-64's and SWA-8's
    plan = layout.plan(token_len, hashes)
    assert plan.groups[1].hash_rows is None and plan.groups[3].hash_rows is None
    assert _decoded(plan.keys) == _ref_keys(layout, token_len, hashes)
    bad: list[Any] = list(hashes)
    bad[97] = 97  # a masked-in SWA-8 tail
    with pytest.raises(InvalidRequest, match=r"block_hashes\[97\]"):
        layout.plan(token_len, bad)


def test_hex_rows_are_each_hash_in_hex() -> None:
    rows = np.random.default_rng(4).integers(0, 256, size=(40, 32), dtype=np.uint8)
    plan = _dsv4().plan(256 * 4, rows[:256])
    for probe in plan.groups:
        assert probe.hash_rows is not None and probe.hex_rows is not None
        assert [bytes(h) for h in probe.hex_rows] == [r.tobytes().hex().encode()
                                                       for r in probe.hash_rows]
    empty = _full16().plan(48, [b"", b"", b""])
    assert empty.keys == [b"test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"] * 3


def test_plan_does_not_see_later_writes_to_the_hash_array() -> None:
    """The plan keeps its own copy of the hashes it reads: a caller reusing its buffer after
    planning cannot change which hashes count as repeats."""
    layout = _full16()
    rows = np.frombuffer(b"A" * 32 + b"B" * 32 + b"A" * 32, dtype=np.uint8).reshape(3, 32).copy()
    plan = layout.plan(48, rows)
    rows[2] = ord("C")
    assert plan.keys[0] == plan.keys[2]
    assert plan.resolve([0, 1, 1]) == 48  # hash A is present through its second copy


def test_a_read_only_view_of_bytes_is_read_without_a_copy_and_any_other_array_with_one() -> None:
    """Rows over a ``bytes`` object cannot change, so the plan keeps them as they are (how the
    HTTP routes decode hashes); a read-only view of a writeable array is still copied."""
    layout = _full16()
    blob = b"A" * 32 + b"B" * 32 + b"A" * 32
    rows = np.frombuffer(blob, dtype=np.uint8).reshape(3, 32)
    plan = layout.plan(48, rows)
    assert np.shares_memory(plan.groups[0].hash_rows, rows)
    assert plan.keys == layout.plan(48, [blob[:32], blob[32:64], blob[64:]]).keys
    writeable = rows.copy()
    view = writeable.view()
    view.flags.writeable = False
    plan = layout.plan(48, view)
    writeable[2] = ord("C")
    assert not np.shares_memory(plan.groups[0].hash_rows, writeable)
    assert plan.keys[0] == plan.keys[2]


@pytest.mark.parametrize(
    "make",
    [
        lambda n: [np.ones(1)] * n,
        lambda n: [np.ones(2)] * n,
        lambda n: [1, 0] + [[1, 2]] * (n - 2),  # malformed after the first miss
        lambda n: [1, (1,)] + [1] * (n - 2),  # ragged
    ],
)
@pytest.mark.parametrize("namespaces", [1, 2])
def test_malformed_answers_are_refused(make: Any, namespaces: int) -> None:
    plan = _full16(tp_size=namespaces, num_kv_heads=namespaces).plan(48, _hashes(3))
    with pytest.raises(InvalidRequest):
        plan.resolve(make(plan.num_keys))


def test_probing_counts_falsy_answers_absent() -> None:
    plan = _full16().plan(48, _hashes(3))
    state = ProbeState(plan)
    idx = state.next_keys()
    state.record(idx, [1, None, 1])
    assert state.hit == 16


@pytest.mark.parametrize("eagle", [False, True])
def test_prefix_probing_accepts_answers_in_any_order(eagle: bool) -> None:
    """A lone full-attention plan is probed in ranges from its known prefix; answers recorded
    out of that order still give resolve's hit."""
    layout = _full16(use_eagle=eagle, tp_size=2, num_kv_heads=2)
    plan = layout.plan(160, _hashes(10))  # 10 chunks x 2 namespaces
    for miss in (None, 0, 3, 9):
        present = np.ones(20, dtype=bool)
        if miss is not None:
            present[2 * miss + 1] = False
        want = plan.resolve(present.astype(int))
        state = ProbeState(plan)
        state.record(range(12, 20), present[12:20].tolist())  # a later run first
        state.record(np.array([4, 5]), present[4:6])
        while len(idx := state.next_keys(window=2)):
            state.record(idx, present[np.asarray(idx)].tolist())
        assert state.hit == want
        in_order = ProbeState(plan)
        while len(idx := in_order.next_keys(window=3)):
            assert isinstance(idx, range)
            in_order.record(idx, present[np.asarray(idx)].tolist())
        assert in_order.hit == want


@pytest.mark.parametrize("namespaces", [1, 2])
def test_prefix_probing_scouts_bound_the_first_miss(namespaces: int) -> None:
    """A wide prefix-mode window also probes four scouts in the next, twice as wide window;
    the first absent scout bounds the next window, which then stops short of it."""
    k = namespaces
    plan = _full16(tp_size=k, num_kv_heads=k).plan(16 * 100, _hashes(100))
    state = ProbeState(plan)
    idx = state.next_keys(window=8)
    chunks = sorted({i // k for i in np.asarray(idx).tolist()})
    assert chunks == [*range(8), 11, 15, 19, 23]  # the window, then quarter ends of [8, 24)
    assert len(idx) == 12 * k
    present = np.ones(plan.num_keys, dtype=bool)
    present[19 * k] = False  # scout 19 absent (its first namespace)
    state.record(idx, present[np.asarray(idx)])
    assert state.known_prefix == 8 and state.hit is None
    nxt = state.next_keys(window=64)
    assert isinstance(nxt, range) and (nxt.start, nxt.stop) == (8 * k, 19 * k)  # stops at 19
    state.record(nxt, present[nxt.start : nxt.stop])
    assert state.next_keys() is not None and state.hit == 19 * 16 == plan.resolve(present)
    assert state.known_prefix == 19


def test_prefix_probing_with_scouts_matches_resolve_on_random_answers() -> None:
    """Whatever the answers (scouts and windows answered in any pattern), rounds reach
    resolve's hit, and no key is asked twice: a later window that covers a present scout
    hands its recorded answers back (``answered_ahead``) instead."""
    rng = random.Random(5)
    handed_back = 0
    for _ in range(300):
        k = rng.choice([1, 2])
        n = rng.randrange(1, 70)
        plan = _full16(tp_size=k, num_kv_heads=k).plan(16 * n, _hashes(n))
        present = np.array([rng.random() < 0.97 for _ in range(plan.num_keys)])
        if rng.random() < 0.5:  # chat-like: a present prefix, then absent
            cut = rng.randrange(0, plan.num_keys + 1)
            present[:cut], present[cut:] = True, False
        answer = np.where(present, 1.0 + np.arange(plan.num_keys), 0.0)  # each its own mark
        state = ProbeState(plan)
        probed: set[int] = set()
        while len(idx := state.next_keys(window=rng.choice([1, 3, 8, 16, 40, None]))):
            got = np.asarray(idx).tolist()
            known_at, known_answers = state.answered_ahead
            assert known_at == sorted(set(known_at))
            assert known_answers == [answer[got[pos]] for pos in known_at]  # as recorded
            assert all(got[pos] in probed for pos in known_at)
            asked = [i for pos, i in enumerate(got) if pos not in set(known_at)]
            assert probed.isdisjoint(asked)
            probed.update(asked)
            handed_back += len(known_at)
            state.record(idx, answer[got])
        assert state.hit == plan.resolve(present.astype(int))
    assert handed_back > 100  # (the case is exercised)


def test_present_scouts_past_the_prefix_count_when_answers_come_out_of_order() -> None:
    """Leaving prefix mode keeps what the scouts found present."""
    plan = _full16().plan(16 * 100, _hashes(100))
    state = ProbeState(plan)
    idx = state.next_keys(window=8)  # chunks 0-7, scouts 11, 15, 19, 23
    state.record(idx, [1.0] * len(idx))
    state.record(np.array([40]), [1.0])  # out of order: per-chunk arrays from here on
    assert state.known_prefix is None
    rest = np.asarray(state.next_keys()).tolist()
    assert not {11, 15, 19, 23, 40} & set(rest) and rest[0] == 8


def test_keys_at_hex_encodes_only_the_hashes_it_needs() -> None:
    """Probing in rounds builds only the keys a round asks for: a few keys, or a range, of a
    fresh plan leave the other hashes un-encoded."""
    rows = np.random.default_rng(3).integers(0, 256, size=(64, 32), dtype=np.uint8)
    plan = _full16().plan(16 * 64, rows)
    keys = _full16().plan(16 * 64, rows).keys
    assert plan._keys_at(range(10, 13)) == keys[10:13]
    assert plan._keys_at(np.array([0, 40, 63])) == [keys[0], keys[40], keys[63]]
    assert plan.groups[0].hex_if_encoded is None  # nothing else was encoded
    assert plan._keys_at(range(0, 64)) == keys


@pytest.mark.parametrize(
    ("cache_prefix", "separator"),
    [("", b"\x00"), ("a\x00b", b"\n"), ("a\x00\nb", b" "), ("a\x00\n b", None)],
)
def test_runs_of_keys_built_by_splitting_match_vllm(cache_prefix: str, separator: Any) -> None:
    """One namespace: runs of keys are hex-encoded with a separator found in no key prefix,
    prefixed and split; a prefix holding every candidate separator takes the other path."""
    layout = _full16(cache_prefix=cache_prefix)
    assert layout._geometry.key_separators == (separator,)
    hashes = [b"%031d" % i + b"\x00" for i in range(300)]  # (the separator within hashes)
    want = [k.encode() for k in _ref_keys(layout, 16 * 300, hashes)]
    rows = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(300, -1)
    rng = np.random.default_rng(5)
    for lo, hi in [(0, 1), (0, 2), (7, 40), (10, 105), (0, 95), (0, 96), (100, 300), (0, 300)]:
        assert layout.plan(16 * 300, rows)._keys_at(range(lo, hi)) == want[lo:hi]
        assert layout.plan(16 * 300, hashes)._keys_at(range(lo, hi)) == want[lo:hi]
    for size in (2, 30, 95, 96, 150):
        idx = np.sort(rng.choice(300, size=size, replace=False)).astype(np.int64)
        assert layout.plan(16 * 300, rows)._keys_at(idx) == [want[i] for i in idx.tolist()]
    assert layout.plan(16 * 300, rows).keys == want


@pytest.mark.parametrize(
    "hashes",
    [[b"a", b"bb", b"ccc", b"dddd"], [b""] * 4, [b"%02d" % i for i in range(4)]],
    ids=["mixed-widths", "empty", "one-width"],
)
def test_one_key_at_a_time_matches_vllm(hashes: list[bytes]) -> None:
    """A round of one key (a cached prompt's likely miss) takes its own short path."""
    layout = _full16(tp_size=2, num_kv_heads=2)
    for lay in (_full16(), layout):
        want = [k.encode() for k in _ref_keys(lay, 64, hashes)]
        for i in range(len(want)):
            assert lay.plan(64, hashes)._keys_at(range(i, i + 1)) == [want[i]]
            assert lay.plan(64, hashes)._keys_at(np.array([i])) == [want[i]]


@pytest.mark.parametrize(
    ("groups", "hashes"),
    [
        ([SlidingWindow(1, 2), Mamba(4)], [b""] * 8),  # every tail hash empty
        # the full-attention group has mixed widths, so the window reads its own (empty) tails
        ([FullAttention(2), SlidingWindow(1, 2)], [b"\xab"] * 3 + [b""] + [b"\xab"] * 3 + [b""]),
    ],
)
def test_empty_hashes_read_from_a_list_make_keys(groups: list[Any], hashes: list[bytes]) -> None:
    """Found by review: a sliding window's tails read from a list, all of them empty hashes."""
    layout = KVLayout(groups, model="m", hash_block_size=1, scheduler_block_size=4)
    plan = layout.plan(8, hashes)
    assert _decoded(plan.keys) == _ref_keys(layout, 8, hashes)
    ref = BaselineLookup(layout.to_dict())
    keys, meta = ref.build_keys(8, hashes)
    for answers in ([1] * len(keys), [0] * len(keys), [1, 0] * (len(keys) // 2)):
        assert plan.resolve(answers) == ref.resolve(8, hashes, meta, answers)


def test_probe_target_cache_is_bounded_in_entries_and_bytes(monkeypatch: Any) -> None:
    """The per-layout cache of what each group probes drops its oldest entries."""
    from aio_mclookup._plan import targets as _plan

    layout = _dsv4()
    rows = np.zeros((4096, 32), dtype=np.uint8)
    monkeypatch.setattr(_plan, "_PROBE_CACHE_ENTRIES", 3)
    for tokens in range(256, 256 * 6, 256):
        layout.plan(tokens, rows[: tokens // 4])
    cache = _plan._CACHES[id(layout._geometry)]
    assert [key[0] for key in cache.entries] == [256 * 3, 256 * 4, 256 * 5]
    entry = sum(t.nbytes for t in cache.entries[(256 * 5, tuple(
        256 * 5 // g.block_size for g in layout.groups))])
    monkeypatch.setattr(_plan, "_PROBE_CACHE_BYTES", entry)  # room for that entry alone
    layout.plan(256 * 2, rows[: 256 * 2 // 4])  # a smaller one: the older ones make room
    assert [key[0] for key in cache.entries] == [256 * 2]
    assert cache.nbytes == sum(
        sum(t.nbytes for t in targets) for targets in cache.entries.values()
    )
    monkeypatch.setattr(_plan, "_PROBE_CACHE_BYTES", 1)  # nothing fits: planned, not kept
    plan = layout.plan(256, rows[:64])
    assert plan.num_keys and not cache.entries and cache.nbytes == 0


@pytest.mark.parametrize(
    ("tp", "chunks"), [(1, 1023), (1, 1024), (1, 1025), (1, 3000), (2, 511), (2, 512), (2, 1500)]
)
def test_keys_are_the_same_on_both_sides_of_the_copy_threshold(tp: int, chunks: int) -> None:
    """Key rows are glued byte-wide below ``_RECORDS_FROM`` keys and as void items from it."""
    from aio_mclookup._plan.keys import _RECORDS_FROM

    assert _RECORDS_FROM == 1024  # (the parameters straddle it)
    layout = _full16(tp_size=tp, num_kv_heads=tp)
    rng = np.random.default_rng(chunks)
    hashes = [bytes(r) for r in rng.integers(0, 256, (chunks, 32), dtype=np.uint8)]
    plan = layout.plan(chunks * 16, hashes)
    assert _decoded(plan.keys) == _ref_keys(layout, chunks * 16, hashes)


def test_a_layouts_probe_target_cache_goes_with_it() -> None:
    """The cache is keyed by the layout's id: the entry must leave when the layout does, or a
    later layout at the same address would read another layout's targets."""
    import gc

    from aio_mclookup._plan import targets

    layout = _full16()
    layout.plan(48, _hashes(3))
    key = id(layout._geometry)
    assert key in targets._CACHES
    del layout
    gc.collect()
    assert key not in targets._CACHES


# ------------------------------------------------------------------------------ resolve
@pytest.mark.parametrize("exists", [[1, 1], [1, 1, 1, 1], [], None, [[1, 1, 1]], 1])
def test_resolve_with_wrong_shape_is_refused(exists: Any) -> None:
    plan = _full16().plan(48, _hashes(3))
    with pytest.raises(InvalidRequest):
        plan.resolve(exists)


def test_resolve_with_wrong_length_array_is_refused() -> None:
    plan = _seed_layout().plan(96, _hashes(12))
    for n in (0, 5, 7, 12):
        with pytest.raises(InvalidRequest):
            plan.resolve(np.ones(n, dtype=np.int64))
    with pytest.raises(InvalidRequest):
        plan.resolve(np.ones((6, 1), dtype=np.int64))


@pytest.mark.parametrize(
    "value",
    [0, -1, -900, -901, 2, True, False, 1, 255, 256, 257, -(2**40), 1.0, 0.5, np.int64(1),
     np.int8(-1), np.uint8(1)],
)
def test_resolve_never_raises_on_store_values(value: Any) -> None:
    cases = ((_full16(), 48, 3), (_seed_layout(), 96, 12), (_dsv4(), 1024, 256))
    for layout, token_len, n in cases:
        plan = layout.plan(token_len, _hashes(n))
        hit = plan.resolve([value] * plan.num_keys)
        assert hit == (token_len if value == 1 else 0)
        mixed = [value if i % 2 else 1 for i in range(plan.num_keys)]
        ref = BaselineLookup(layout.to_dict())
        _, meta = ref.build_keys(token_len, _hashes(n))
        assert plan.resolve(mixed) == ref.resolve(token_len, _hashes(n), meta, mixed)
        assert plan.resolve(np.array(mixed)) == plan.resolve(mixed)


class _EqualsOne(int):
    """An int whose == says "1" whatever its value (vLLM compares answers with == 1)."""

    def __eq__(self, other: object) -> bool:
        return other == 1

    __hash__ = int.__hash__


class _IndexOnly:
    """Converts to an int, but is never == 1."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


@pytest.mark.parametrize("odd", [_EqualsOne(2), _EqualsOne(-5), _IndexOnly(1), _IndexOnly(-1)])
def test_resolve_compares_answers_with_eq_like_vllm(odd: Any) -> None:
    """Answers whose integer value and ``== 1`` disagree follow ``== 1``, on every path."""
    cases = ((_full16(), 48, 3), (_seed_layout(), 96, 12), (_dsv4(), 1024, 256))
    for layout, token_len, n in cases:
        plan = layout.plan(token_len, _hashes(n))
        ref = BaselineLookup(layout.to_dict())
        _, meta = ref.build_keys(token_len, _hashes(n))
        for pattern in (lambda i: odd, lambda i: odd if i % 3 == 1 else 1,
                        lambda i: odd if i % 3 == 1 else -7):
            answers = [pattern(i) for i in range(plan.num_keys)]
            want = ref.resolve(token_len, _hashes(n), meta, answers)
            assert plan.resolve(answers) == want
            assert plan.resolve(tuple(answers)) == want


def test_resolve_accepts_numpy_dtypes() -> None:
    plan = _seed_layout().plan(96, _hashes(12))
    answers = [1, 0, 0, 1, 0, 0]
    for dtype in (np.int8, np.int32, np.int64, np.uint8, np.float64, np.bool_):
        assert plan.resolve(np.array(answers, dtype=dtype)) == 32
    assert plan.resolve(tuple(answers)) == 32
    assert plan._resolve_present(np.array(answers, dtype=bool)) == 32


# -------------------------------------------------------------- the seed regression (issue)
class RecordingHashes(Sequence[bytes]):
    """A Sequence that records every index read, by item, slice or iteration."""

    def __init__(self, items: Sequence[Any]) -> None:
        self._items = list(items)
        self.accessed: list[int] = []

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        if isinstance(index, slice):
            positions = list(range(*index.indices(len(self._items))))
            self.accessed.extend(positions)
            return [self._items[i] for i in positions]
        pos = index.__index__()
        if pos < 0:
            pos += len(self._items)
        self.accessed.append(pos)
        item: bytes = self._items[pos]
        return item

    def __iter__(self) -> Iterator[bytes]:
        for pos in range(len(self._items)):
            self.accessed.append(pos)
            yield self._items[pos]

    def __reversed__(self) -> Iterator[bytes]:
        for pos in reversed(range(len(self._items))):
            self.accessed.append(pos)
            yield self._items[pos]


class Poison:
    """A hash that must never be touched: any use raises."""

    def _boom(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a masked hash was used")

    __len__ = __bytes__ = __hash__ = __eq__ = __ne__ = __lt__ = __iter__ = _boom
    __buffer__ = __getitem__ = __index__ = __int__ = __bool__ = __repr__ = __str__ = _boom
    hex = _boom


def test_seed_regression_reads_only_masked_in_hashes() -> None:
    """Full B=32 + SWA B=8/W=8, h=8, L=32, token_len=96, 12 hashes: planning reads hash indices
    3, 7 and 11 only (vLLM 0.26 test_lookup_applies_swa_mask_before_accessing_hashes)."""
    hashes = RecordingHashes(_hashes(12))
    plan = _seed_layout().plan(96, hashes)
    keys = plan.keys
    assert set(hashes.accessed) <= {3, 7, 11}
    assert set(hashes.accessed) == {3, 7, 11}
    assert len(keys) == 6
    assert [k.rsplit(b"@", 1)[1] for k in keys] == [b"6833", b"6837", b"683131"] * 2
    # resolving reads nothing more
    assert plan.resolve([1, 0, 0, 1, 0, 0]) == 32
    assert set(hashes.accessed) == {3, 7, 11}
    # nor does probing in rounds
    state = ProbeState(plan)
    while len(idx := state.next_keys()):
        state.record(idx, np.array([1, 0, 0, 1, 0, 0], dtype=bool)[idx])
    assert state.hit == 32
    assert set(hashes.accessed) == {3, 7, 11}


def test_seed_regression_with_longer_hash_list() -> None:
    """16 hashes for 96 tokens: 0.24/0.25 also read index 15 (and 0-12); 0.26 and we do not."""
    hashes = RecordingHashes(_hashes(16))
    plan = _seed_layout().plan(96, hashes)
    assert plan.num_keys == 6
    assert set(hashes.accessed) == {3, 7, 11}


def test_masked_hashes_cost_nothing() -> None:
    """The same plan with every masked hash replaced by an object that raises on any use."""
    real = _hashes(12)
    poisoned: list[Any] = [h if i in (3, 7, 11) else Poison() for i, h in enumerate(real)]
    plan = _seed_layout().plan(96, poisoned)
    assert plan.keys == _seed_layout().plan(96, real).keys
    for exists in ([1, 0, 0, 1, 0, 0], [1] * 6, [0] * 6, [1, 1, 0, 1, 1, 1]):
        assert plan.resolve(exists) == _seed_layout().plan(96, real).resolve(exists)


def test_masked_hashes_cost_nothing_dsv4() -> None:
    """DSv4-like at 4,096 tokens: only the full group's chunk ends and the SWA tails are read."""
    layout = _dsv4()
    n = 4096 // 4
    hashes = RecordingHashes([bytes([i % 256, i // 256]) * 16 for i in range(n)])
    plan = layout.plan(4096, hashes)
    wanted = {
        int(c) * (g.block_size // 4) + g.block_size // 4 - 1
        for probe, g in zip(plan.groups, layout.groups)
        for c in probe.chunks
    }
    assert set(hashes.accessed) == wanted
    assert plan.num_keys == 16 + 32 + 32 + 256
    assert len(wanted) == 272  # distinct hash indices behind those 336 keys, of 1,024
    poisoned: list[Any] = [h if i in wanted else Poison() for i, h in enumerate(hashes._items)]
    assert layout.plan(4096, poisoned).keys == plan.keys


def test_chunk_items_hold_every_namespaces_key_of_a_chunk() -> None:
    """The coordinator's view of a chunk in several rank namespaces: one item, its keys in
    vLLM's order, each ended by the item mark; one namespace or several groups: no items."""
    layout = KVLayout([FullAttention(16)], model="org/m", hash_block_size=16,
                      scheduler_block_size=16, tp_size=4, num_kv_heads=8)
    hashes = [bytes([i]) * 32 for i in range(12)]
    plan = layout.plan(16 * 12, hashes)
    keys = plan.keys
    assert plan._chunk_keys == 4
    for indices in (range(8, 20), np.array([0, 1, 2, 3, 44, 45, 46, 47]), range(0, 48)):
        chunks = sorted({int(i) // 4 for i in (indices if isinstance(indices, range)
                                                else indices.tolist())})
        assert plan._items_at(indices) == [
            b"".join(key + b"\n" for key in keys[4 * c : 4 * c + 4]) for c in chunks
        ]
    one = KVLayout([FullAttention(16)], model="org/m", hash_block_size=16,
                   scheduler_block_size=16)
    assert one.plan(16 * 12, hashes)._chunk_keys == 1


def test_plan_keeps_the_coordinators_helpers_private() -> None:
    plan = KVLayout([FullAttention(16)], model="org/m", hash_block_size=16,
                    scheduler_block_size=16).plan(32, [b"a" * 32, b"b" * 32])
    for name in ("keys_at", "key_span", "resolve_present", "resolve_present_result"):
        assert not hasattr(plan, name)
    assert plan.resolve([1, 1]) == 32 and plan.resolve_result([1, 0]).hit_length == 16
