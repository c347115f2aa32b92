"""vLLM 0.32+ plans (``aio_mclookup._plan.era_c``): the request's hash ids are found only when
an answer needs them, from the hashes as they were at planning time."""

from __future__ import annotations

import numpy as np

from aio_mclookup import FullAttention, KVLayout, SlidingWindow


def _layout() -> KVLayout:
    return KVLayout([FullAttention(16)], model="test-model", hash_block_size=16,
                    scheduler_block_size=16, vllm_version="0.33")


# The public conformance case "edge-repeated_hashes-conflicting_answers": the first hash
# repeats; its first key answers absent, its copy present, and vLLM 0.33 keys presence by hash,
# so the hit is all three blocks (48 of the 49 tokens).
HASHES = [b"a0", b"a0", b"a1"]
EXISTS = [0, 1, 1]


def test_a_repeated_hash_counts_as_vllm_033_counts_it() -> None:
    assert _layout().plan(49, list(HASHES)).resolve(EXISTS) == 48


def test_the_callers_list_may_change_after_planning() -> None:
    hashes = list(HASHES)
    plan = _layout().plan(49, hashes)
    hashes[:] = [b"x0", b"x1", b"x2"]  # (a caller reusing its buffer)
    assert plan.resolve(EXISTS) == 48


def test_the_callers_bytearrays_and_array_may_change_after_planning() -> None:
    mutable = [bytearray(h) for h in HASHES]
    plan = _layout().plan(49, mutable)
    mutable[0][:] = b"zz"
    assert plan.resolve(EXISTS) == 48
    rows = np.frombuffer(b"".join(HASHES), dtype=np.uint8).reshape(3, 2).copy()
    plan = _layout().plan(49, rows)
    rows[0] = (0, 1)
    assert plan.resolve(EXISTS) == 48
    rows = np.frombuffer(b"".join(HASHES), dtype=np.uint8).reshape(3, 2).copy()
    plan = _layout().plan(49, list(rows))  # (numpy rows as the list's items)
    rows[0] = (0, 1)
    assert plan.resolve(EXISTS) == 48


def test_hash_ids_are_found_only_when_an_answer_needs_them() -> None:
    plan = _layout().plan(49, list(HASHES))
    assert plan._hash_ids is None and plan._hash_source is not None  # nothing read yet
    assert plan.hash_ids is not None and plan._hash_source is None
    distinct = _layout().plan(49, [b"b0", b"b1", b"b2"])
    assert distinct.hash_ids is None  # (chained hashes: none repeat)


def test_a_plan_probed_in_one_round_finds_its_hash_ids_at_once() -> None:
    """Every answer of a hybrid plan rests on the hash ids: found while planning, from the
    hashes as given (no snapshot kept)."""
    layout = KVLayout([FullAttention(32), SlidingWindow(16, 32)], model="test-model",
                      hash_block_size=16, scheduler_block_size=32, vllm_version="0.33")
    plan = layout.plan(128, [b"h%d" % (i % 3) for i in range(8)])
    assert plan._hash_source is None and plan.hash_ids is not None


def _hybrid() -> KVLayout:
    return KVLayout([FullAttention(32), SlidingWindow(16, 32)], model="test-model",
                    hash_block_size=16, scheduler_block_size=32, vllm_version="0.33")


def test_bytes_likes_that_hash_or_compare_otherwise_count_by_their_bytes() -> None:
    """A writable memoryview cannot be hashed, a ``cast('c')`` view hashes like its bytes but
    compares unequal to them: both must plan and resolve as the same bytes would."""
    hashes = [b"\xaa\xbb", b"x1", b"x2", b"\xaa\xbb", b"x4", b"x5", b"x6", b"x7"]
    layout = _hybrid()
    expected_keys = layout.plan(128, hashes).keys
    answers = [1 if i % 3 != 1 else 0 for i in range(len(expected_keys))]
    expected = layout.plan(128, hashes).resolve(answers)
    buf = bytearray(b"".join(hashes))
    writable = [memoryview(buf)[2 * i : 2 * i + 2] for i in range(8)]
    cast = [memoryview(h).cast("c") if i == 3 else h for i, h in enumerate(hashes)]
    for items in (writable, cast):
        plan = layout.plan(128, items)
        assert plan.keys == expected_keys
        assert plan.resolve(answers) == expected
