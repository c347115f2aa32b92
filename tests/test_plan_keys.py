"""Key assembly (``aio_mclookup._plan.keys``): the compiled keys and items (``_keys_c``) against
their Python twins, and the keys every path of a plan builds against one spelled-out rule."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_mclookup import FullAttention, KVLayout, SGLangLayout, SlidingWindow
from aio_mclookup._plan import keys
from aio_mclookup._plan.keys import ITEM_END, item_joiners

KEYS_C = "aio_mclookup._plan._keys_c"
C: Any = importlib.import_module(KEYS_C) if importlib.util.find_spec(KEYS_C) else None
needs_c = pytest.mark.skipif(C is None, reason="the key extension is not built")

pieces = st.lists(st.binary(max_size=12), min_size=1, max_size=5)


def _rows(data: st.DataObject, width: int, count: int) -> np.ndarray:
    raw = data.draw(st.binary(min_size=width * count, max_size=width * count))
    return np.frombuffer(raw, dtype=np.uint8).reshape(count, width)


def _pure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keys, "_C", None)


def _index(data: st.DataObject, limit: int) -> range | list[int]:
    if data.draw(st.booleans()):
        lo = data.draw(st.integers(0, limit))
        return range(lo, data.draw(st.integers(lo, limit)))
    if not limit:
        return []
    return sorted(data.draw(st.lists(st.integers(0, limit - 1), max_size=20)))


def test_keys_and_items_by_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = np.arange(6, dtype=np.uint8).reshape(2, 3)
    for compiled in (True, False):
        if not compiled:
            _pure(monkeypatch)
        assert keys.hex_keys(rows, range(4), (b"a@", b"b@"), (b"", b"!")) == [
            b"a@000102", b"b@000102!", b"a@030405", b"b@030405!"]
        assert keys.hex_keys(rows, [3], (b"a@", b"b@"), (b"", b"")) == [b"b@030405"]
        joiners = item_joiners((b"p", b"q"), (b"_k", b"_v"))
        assert joiners == (b"p", b"_k" + ITEM_END + b"q", b"_v" + ITEM_END)
        assert keys.hex_join(rows, [1, 0], joiners) == [
            b"p030405_k\nq030405_v\n", b"p000102_k\nq000102_v\n"]


@needs_c
@settings(max_examples=300, deadline=None)
@given(data=st.data(), width=st.integers(0, 40), count=st.integers(0, 9), heads=pieces)
def test_the_compiled_keys_are_the_python_ones(
    data: st.DataObject, width: int, count: int, heads: list[bytes]
) -> None:
    rows = _rows(data, width, count)
    if data.draw(st.booleans()) and count > 1:  # (strided rows: every other one)
        rows = rows[::2]
    tails = data.draw(st.lists(st.binary(max_size=6), min_size=len(heads), max_size=len(heads)))
    index = _index(data, rows.shape[0] * len(heads))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(keys, "_C", None)
        pure = keys.hex_keys(rows, index, heads, tails)
    assert C.hex_keys(rows, index, tuple(heads), tails) == pure


@needs_c
@settings(max_examples=300, deadline=None)
@given(data=st.data(), width=st.integers(0, 40), count=st.integers(0, 9),
       joiners=st.lists(st.binary(max_size=12), min_size=2, max_size=6))
def test_the_compiled_items_are_the_python_ones(
    data: st.DataObject, width: int, count: int, joiners: list[bytes]
) -> None:
    rows = _rows(data, width, count)
    index = _index(data, count)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(keys, "_C", None)
        pure = keys.hex_join(rows, index, joiners)
    assert C.hex_join(rows, index, tuple(joiners)) == pure
    assert pure == [rows[i].tobytes().hex().encode().join(joiners) for i in index]


@pytest.mark.parametrize("compiled", [True, False])
def test_bad_input_fails_the_same_way_on_both_paths(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if compiled and C is None:
        pytest.skip("the key extension is not built")
    if not compiled:
        _pure(monkeypatch)
    rows = np.zeros((2, 4), dtype=np.uint8)
    with pytest.raises(IndexError):
        keys.hex_keys(rows, range(3, 5), (b"a", b"b"), (b"", b""))  # (2 rows of 2 keys)
    with pytest.raises(IndexError):
        keys.hex_keys(rows, [-1], (b"a",), (b"",))
    with pytest.raises(IndexError):
        keys.hex_join(rows, [2], (b"a", b"b"))
    with pytest.raises(ValueError):
        keys.hex_keys(rows, [0], (b"a", b"b"), (b"",))
    with pytest.raises(ValueError):
        keys.hex_join(rows, [0], (b"a",))
    near_the_top = range(sys.maxsize - 1, sys.maxsize)  # (start + length overflows in C)
    with pytest.raises(IndexError):
        keys.hex_keys(rows, near_the_top, (b"a",), (b"",))
    with pytest.raises(IndexError):
        keys.hex_join(rows, near_the_top, (b"a", b"b"))
    with pytest.raises(ValueError):
        item_joiners((b"a", b"b"), (b"",))
    bools = np.arange(8, dtype=np.uint8).reshape(2, 4)
    assert keys.hex_join(bools, [True, False], (b"<", b">")) == [b"<04050607>", b"<00010203>"]


@needs_c
def test_the_compiled_kernels_refuse_what_they_cannot_read() -> None:
    rows = np.zeros((2, 4), dtype=np.uint8)
    with pytest.raises(ValueError):
        C.hex_join(np.zeros(8, dtype=np.uint8), [0], (b"a", b"b"))  # (not 2-D)
    with pytest.raises(ValueError):
        C.hex_join(np.zeros((2, 2), dtype=np.int32), [0], (b"a", b"b"))
    with pytest.raises(ValueError):
        C.hex_keys(rows, range(0, 4, 2), (b"a",), (b"",))  # (a range's step must be 1)
    with pytest.raises(TypeError):
        C.hex_keys(rows, np.arange(2), (b"a",), (b"",))
    with pytest.raises(TypeError):
        C.hex_keys(rows, [0.0], (b"a",), (b"",))
    with pytest.raises(TypeError):
        C.hex_join(rows, [0], (b"a", "b"))
    assert C.hex_keys(rows, (), (b"a",), (b"",)) == []


LAYOUTS = [
    KVLayout([FullAttention(16)], model="m", hash_block_size=16, scheduler_block_size=16),
    KVLayout([FullAttention(16)], model="m", hash_block_size=16, scheduler_block_size=16,
             tp_size=2, num_kv_heads=2),
    KVLayout([FullAttention(32), SlidingWindow(16, 32)], model="m", hash_block_size=16,
             scheduler_block_size=32, tp_size=2, num_kv_heads=2),
    KVLayout([FullAttention(32), SlidingWindow(16, 32)], model="m", hash_block_size=16,
             scheduler_block_size=32, tp_size=2, num_kv_heads=2, vllm_version="0.33.0"),
    KVLayout([FullAttention(64), SlidingWindow(32, 64)], model="m", hash_block_size=16,
             scheduler_block_size=64, vllm_version="0.33.0"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_key_path_of_a_vllm_plan_builds_the_same_keys(
    layout: KVLayout, data: st.DataObject
) -> None:
    blocks = 2 * data.draw(st.integers(1, 35))
    hashes = np.frombuffer(
        data.draw(st.binary(min_size=32 * blocks, max_size=32 * blocks)), dtype=np.uint8
    ).reshape(blocks, 32)
    # (an immutable array's rows are read when needed, straight from it; a writable copy's
    # are copied out when planned: the same keys either way)
    whole = layout.plan(blocks * 16, hashes.copy()).keys
    if not whole:  # (shorter than a scheduler block)
        return
    indices = sorted(set(data.draw(st.lists(st.integers(0, len(whole) - 1), max_size=30))))
    plan = layout.plan(blocks * 16, hashes)
    masked = any(p.chunks.size < p.limit for p in plan.groups)
    assert any(p._gather is not None for p in plan.groups) is masked
    assert plan._keys_at(np.array(indices, dtype=np.intp)) == [whole[i] for i in indices]
    lo = data.draw(st.integers(0, len(whole)))
    hi = data.draw(st.integers(lo, len(whole)))
    assert layout.plan(blocks * 16, hashes)._keys_at(range(lo, hi)) == whole[lo:hi]
    k = plan._chunk_keys
    if k > 1:
        chunks = range(lo // k, hi // k)
        items = layout.plan(blocks * 16, hashes)._items_at(range(chunks.start * k, chunks.stop * k))
        assert items == [
            b"".join(key + ITEM_END for key in whole[c * k : (c + 1) * k]) for c in chunks
        ]


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**20), min_size=1, max_size=600), data=st.data())
def test_every_key_path_of_an_sglang_plan_builds_the_same_keys(
    tokens: list[int], data: st.DataObject
) -> None:
    layout = SGLangLayout(sglang_version="0.5.23", page_size=8, model_name="M", tp_size=2)
    plan = layout.plan(len(tokens), layout.page_hashes(tokens))
    whole = list(plan.keys)
    k = plan._sglang.keys_per_page
    fresh = layout.plan(len(tokens), layout.page_hashes(tokens))
    pages = len(whole) // k
    lo = data.draw(st.integers(0, pages))
    hi = data.draw(st.integers(lo, pages))
    assert fresh._page_keys(range(lo, hi)) == whole[lo * k : hi * k]
    assert fresh._items_at(range(lo * k, hi * k)) == [
        b"".join(key + ITEM_END for key in whole[p * k : (p + 1) * k]) for p in range(lo, hi)
    ]
    picked = np.array(sorted(set(data.draw(st.lists(st.integers(0, max(pages - 1, 0)),
                                                    max_size=8)))) if pages else [],
                      dtype=np.intp)
    assert fresh._page_keys(picked) == [whole[p * k + j] for p in picked.tolist() for j in range(k)]


@needs_c
@settings(max_examples=300, deadline=None)
@given(entries=st.lists(st.one_of(
    st.lists(st.binary(max_size=8).filter(lambda key: ITEM_END not in key), min_size=2,
             max_size=5).map(lambda ks: b"".join(key + ITEM_END for key in ks)),
    st.binary(max_size=20),
), max_size=12))
def test_the_compiled_split_of_items_is_the_python_one(entries: list[bytes]) -> None:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(keys, "_C", None)
        pure = keys.split_items(entries)
    assert C.split_items(tuple(entries), ITEM_END) == pure
    assert C.split_items(entries, ITEM_END) == pure
    with pytest.raises(TypeError):
        C.split_items([b"a", "b"], ITEM_END)
