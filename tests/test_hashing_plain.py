"""BlockHasher's path for blocks without extra keys (``_payload.plain``), which most prompts take.

Its bodies are checked byte for byte against pickle.dumps / cbor2.dumps at every encoding-width
boundary and every gap length; the hasher's output on it against the per-block recipe for both
input forms and many dtypes, and each way out of it (ids beyond its range, long bodies,
out-of-order stores, bad ids past the last block) against the general path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aio_mclookup import BlockHasher, InvalidRequest
from aio_mclookup._hashing import _hasher, _payload
from test_hashing import SETTINGS, reference_hashes, rows, serialize_fn

PICKLE_TOP = 2**31  # the fast range: BININT1/2/BININT records
CBOR_TOP = 2**32  # 1-, 2-, 3- and 5-byte CBOR ints
# each width's first and last id, in both encodings
BOUNDARIES = sorted({0, 1, 22, 23, 24, 25, 254, 255, 256, 257, 65534, 65535, 65536, 65537,
                     2**24 - 1, 2**24, 2**31 - 2, 2**31 - 1})
CBOR_BOUNDARIES = [*BOUNDARIES, 2**31, 2**32 - 2, 2**32 - 1]


def _bodies_ok(ids: list[int], block: int, width: int, cbor: bool) -> None:
    layout = _payload.plain_layout(block, width, cbor)
    bodies = _payload.plain(np.array(ids, dtype=np.uint64), layout)
    assert bodies is not None
    assert len(bodies) == len(ids) // block
    parent = bytes(range(width))
    ser = serialize_fn("sha256_cbor" if cbor else "sha256")
    for b, body in enumerate(bodies):
        head = _payload.cbor_head(width) if cbor else _payload.pickle_head(width, len(body))
        assert head + parent + body == ser((parent, tuple(ids[b * block:(b + 1) * block]), None))


@pytest.mark.parametrize("cbor", [False, True])
@pytest.mark.parametrize("block", [1, 2, 3, 4, 5, 16, 23, 24, 25, 255, 256, 300])
def test_bodies_at_every_width_boundary(cbor: bool, block: int) -> None:
    edges = CBOR_BOUNDARIES if cbor else BOUNDARIES
    ids = [edges[i % len(edges)] for i in range(block * max(3, -(-len(edges) // block)) + 1)]
    _bodies_ok(ids, block, 32, cbor)
    _bodies_ok(ids[::-1], block, 16, cbor)


@SETTINGS
@given(data=st.data(), block=st.integers(1, 40), width=st.sampled_from([16, 32]),
       cbor=st.booleans())
def test_bodies_match_pickle_and_cbor(data: st.DataObject, block: int, width: int,
                                      cbor: bool) -> None:
    top = (CBOR_TOP if cbor else PICKLE_TOP) - 1
    ids = data.draw(st.lists(st.one_of(st.integers(0, 300), st.integers(0, 70_000),
                                       st.integers(0, top),
                                       st.sampled_from(BOUNDARIES)),
                             min_size=block, max_size=150))
    _bodies_ok(ids, block, width, cbor)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("block", [1, 3, 4, 16, 24])
def test_hashes_at_every_width_boundary_list_and_array(algo: str, block: int) -> None:
    edges = CBOR_BOUNDARIES if algo.endswith("_cbor") else BOUNDARIES
    ids = (edges * 3)[: block * 8 + block // 2]
    hasher = BlockHasher(block, algo=algo, seed="0")
    want = reference_hashes(ids, block, algo, "0")
    assert rows(hasher.hash(ids)) == want
    assert rows(hasher.hash(tuple(ids))) == want
    assert rows(hasher.hash(np.array(ids, dtype=np.uint64))) == want
    assert rows(hasher.hash(np.array(ids, dtype=np.int64))) == want


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_ids_beyond_the_fast_range_take_the_general_path(algo: str) -> None:
    top = CBOR_TOP if algo.endswith("_cbor") else PICKLE_TOP
    layout = _payload.plain_layout(4, 32, algo.endswith("_cbor"))
    for big in (top, top + 1, 2**40, 2**63 - 1):
        ids = [5, 300, 70_000, big, 1, 2, 3, 4]
        assert _payload.plain(np.array(ids, dtype=np.uint64), layout) is None
        want = reference_hashes(ids, 4, algo, "0")
        hasher = BlockHasher(4, algo=algo, seed="0")
        assert rows(hasher.hash(ids)) == want
        assert rows(hasher.hash(np.array(ids, dtype=np.uint64))) == want


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "int32", "uint32",
                                   "int64", "uint64", ">i8", ">u4"])
def test_array_dtypes_and_layouts_agree_with_the_list(dtype: str) -> None:
    rng = np.random.default_rng(4)
    hi = min(np.iinfo(np.dtype(dtype)).max, 151_935) + 1
    ids = rng.integers(0, hi, 2 * 37 + 5).tolist()
    for algo in ("sha256", "sha256_cbor"):
        hasher = BlockHasher(4, algo=algo, seed="0")
        want = rows(hasher.hash(ids))
        assert want == reference_hashes(ids, 4, algo, "0")
        arr = np.array(ids, dtype=dtype)
        assert rows(hasher.hash(arr)) == want
        strided = np.repeat(arr, 2)[::2]  # not contiguous
        assert not strided.flags.c_contiguous
        assert rows(hasher.hash(strided)) == want


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("dtype", ["int64", "int32", "int8"])
def test_bad_ids_are_refused_wherever_they_are(algo: str, dtype: str) -> None:
    hasher = BlockHasher(4, algo=algo, seed="0")
    for ids, index in (([1, 2, 3, 4, 5, -1], 5), ([1, 2, -3, 4], 2), ([-2], 0), ([7, -1], 1)):
        with pytest.raises(InvalidRequest) as err:
            hasher.hash(np.array(ids, dtype=dtype))
        assert err.value.field == "token_ids"
        assert f"index {index}" in str(err.value) and "negative" in str(err.value)
    big = np.array([1, 2, 3, 4, 2**63], dtype=np.uint64)
    with pytest.raises(InvalidRequest, match="index 4"):
        hasher.hash(big)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_short_inputs_give_no_rows_but_are_checked(algo: str) -> None:
    hasher = BlockHasher(16, algo=algo, seed="0")
    for form in ([1, 2, 3], np.array([1, 2, 3], dtype=np.int32), [], np.zeros(0, np.int64)):
        out = hasher.hash(form)
        assert out.shape == (0, hasher.width) and out.dtype == np.uint8
    with pytest.raises(InvalidRequest):
        hasher.hash([1, 2, -3])
    with pytest.raises(InvalidRequest):
        hasher.hash(np.array([1, -2], dtype=np.int64))


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_parent_continues_on_the_plain_path(algo: str) -> None:
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 151_936, 16 * 9).tolist()
    hasher = BlockHasher(16, algo=algo, seed="0")
    whole = hasher.hash(ids)
    rest = hasher.hash(ids[16 * 4:], parent=whole[3])
    assert rows(rest) == rows(whole)[4:]
    assert rows(whole) == reference_hashes(ids, 16, algo, "0")


def test_long_bodies_and_out_of_order_stores_take_the_general_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(6)
    ids = rng.integers(0, 151_936, 3 * 1000).tolist()
    assert not _payload.plain_layout(1000, 32, False).ok  # bodies may pass the struct table
    assert rows(BlockHasher(1000, seed="0").hash(ids)) == reference_hashes(ids, 1000)
    monkeypatch.setattr(_payload, "_IN_ORDER", False)
    assert not _payload.plain_layout(16, 32, True).ok
    for algo in ("sha256", "sha256_cbor"):
        hasher = BlockHasher(16, algo=algo, seed="0")
        assert rows(hasher.hash(ids[:160])) == reference_hashes(ids[:160], 16, algo, "0")


def test_kept_hash_states_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_hasher, "_MAX_STATES", 3)
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 151_936, 16 * 20).tolist()
    hasher = BlockHasher(16, seed="0")
    want = reference_hashes(ids, 16)
    assert rows(hasher.hash(ids)) == want  # more than 3 body lengths
    assert rows(hasher.hash(ids)) == want
    assert len(hasher._states) <= 3
    kw: dict[str, Any] = {"lora_name": "a", "lora_path": "/l/a"}
    assert rows(hasher.hash(ids, **kw)) == reference_hashes(ids, 16, lora=("a", "/l/a"))
