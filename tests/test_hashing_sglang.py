"""SGLang page hashing (``_hashing/sglang.py``) against the chain as docs/sglang.md states it,
written here one token at a time: every page size, EAGLE bigrams, wide pages, the namespace
seed; lists and numpy arrays alike; bad ids refused with a clear error."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_mclookup import InvalidRequest
from aio_mclookup._hashing import sglang
from aio_mclookup._hashing.sglang import (
    namespace_seed,
    narrow_token_ids,
    page_hashes,
    token_ids_q,
)

COMPILED = sglang._C
"""The compiled chain this process loaded (None: not built, or pure Python asked for)."""


def reference(tokens: list[int], page: int, eagle: bool, seed: bytes | None) -> list[bytes]:
    """The rule, slowly: each page's ids (bigram pairs under EAGLE) as uint32, or after 0xff
    as uint64 when one id it reads is above 2**32 - 1; SHA-256 of the prior and the body."""
    pages = (max(len(tokens) - 1, 0) if eagle else len(tokens)) // page
    prior, out = seed or b"", []
    for p in range(pages):
        start = p * page
        if eagle:
            ids = [t for j in range(start, start + page) for t in (tokens[j], tokens[j + 1])]
            read = tokens[start : start + page + 1]
        else:
            ids = read = tokens[start : start + page]
        if max(read) > 0xFFFFFFFF:
            body = b"\xff" + b"".join(struct.pack("<Q", t) for t in ids)
        else:
            body = b"".join(struct.pack("<I", t) for t in ids)
        prior = hashlib.sha256(prior + body).digest()
        out.append(prior)
    return out


def hashes(tokens: object, page: int, eagle: bool = False, wide: bool = True,
           seed: bytes | None = None) -> list[bytes]:
    return page_hashes(tokens, page_size=page, eagle=eagle, wide=wide, seed=seed)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(
        st.one_of(st.integers(0, 200), st.integers(0, (1 << 63) - 1)), max_size=60
    ),
    page=st.integers(1, 9),
    eagle=st.booleans(),
    seeded=st.booleans(),
)
def test_the_chain_matches_the_rule(
    tokens: list[int], page: int, eagle: bool, seeded: bool
) -> None:
    seed = hashlib.sha256(b"s").digest() if seeded else None
    want = reference(tokens, page, eagle, seed)
    try:  # both paths, the compiled chain and the Python loop (when the first was built)
        for twin in {COMPILED, None}:
            sglang._C = twin
            assert hashes(tokens, page, eagle, seed=seed) == want
            assert hashes(np.array(tokens, dtype=np.uint64), page, eagle, seed=seed) == want
            assert hashes(tuple(tokens), page, eagle, seed=seed) == want
    finally:
        sglang._C = COMPILED


@pytest.mark.skipif(COMPILED is None, reason="the C extension is not loaded")
def test_the_compiled_chain_refuses_what_it_cannot_take() -> None:
    assert COMPILED.pages(b"", b"abcdefgh", 4) == reference_bodies([b"abcd", b"efgh"], None)
    assert COMPILED.page_list(b"s" * 32, [b"ab", b"cde"]) == reference_bodies(
        [b"ab", b"cde"], b"s" * 32
    )
    with pytest.raises(ValueError, match="whole number of pages"):
        COMPILED.pages(b"", b"abcde", 4)
    with pytest.raises(ValueError, match="seed must be empty or 32 bytes"):
        COMPILED.pages(b"short", b"abcd", 4)
    with pytest.raises(ValueError, match="width must be >= 1"):
        COMPILED.pages(b"", b"abcd", 0)
    with pytest.raises(TypeError, match="sequence of bytes"):
        COMPILED.page_list(b"", [b"ab", "cd"])


def reference_bodies(bodies: list[bytes], seed: bytes | None) -> list[bytes]:
    prior, out = seed or b"", []
    for body in bodies:
        prior = hashlib.sha256(prior + body).digest()
        out.append(prior)
    return out


def test_known_digest_and_prefix_stability() -> None:
    # docs/sglang.md's first example: tokens 1..13, page 4
    first = hashes(list(range(1, 14)), 4)
    assert [h.hex()[:16] for h in first] == [
        "cf97adeedb59e05b", "4ebfa8a1f3c34151", "eddb4ab93695109c",
    ]
    assert hashes(list(range(1, 9)), 4) == first[:2]  # the first pages do not see the rest
    assert hashes(list(range(1, 4)), 4) == []  # no full page


def test_every_integer_dtype_gives_the_same_hashes() -> None:
    tokens = list(range(60, 124))
    want = hashes(tokens, 16)
    for dtype in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.uint64):
        assert hashes(np.array(tokens, dtype=dtype), 16) == want, dtype


def test_wide_pages_only_where_an_id_needs_them() -> None:
    tokens = [5] * 8 + [1 << 40] + [6] * 7 + [0xFFFFFFFF] * 8
    got = hashes(tokens, 8)
    assert got == reference(tokens, 8, False, None)
    narrow = hashes([5] * 8, 8)
    assert got[0] == narrow[0]  # (the pages before a wide one stay ordinary)


def test_an_eagle_page_is_wide_for_its_lookahead_token() -> None:
    tokens = [1, 2, 3, 4, 1 << 33, 6]
    assert hashes(tokens, 4, eagle=True) == reference(tokens, 4, True, None)
    assert hashes(tokens, 4, eagle=True) != hashes([1, 2, 3, 4, 5, 6], 4, eagle=True)


def test_namespace_seed() -> None:
    def part(s: str | None) -> bytes:
        if not s:
            return b"\x00"
        raw = s.encode()
        return b"\x01" + len(raw).to_bytes(8, "little") + raw

    tag = b"sglang-cache-namespace-v1"
    assert namespace_seed(None, None) is None
    assert namespace_seed("", "") is None  # (empty is absent, as SGLang's API makes it)
    assert namespace_seed("lora-1", None) == hashlib.sha256(tag + part("lora-1") + b"\x00").digest()
    assert namespace_seed(None, "s") == hashlib.sha256(tag + b"\x00" + part("s")).digest()
    assert namespace_seed("é", "s") == hashlib.sha256(tag + part("é") + part("s")).digest()
    assert namespace_seed("a", None) != namespace_seed(None, "a")
    with pytest.raises(InvalidRequest, match="extra_key must be a str"):
        namespace_seed(3, None)
    with pytest.raises(InvalidRequest, match="UTF-8"):
        namespace_seed(None, "\ud800")


@pytest.mark.parametrize(
    ("tokens", "wide", "match"),
    [
        ([1, 2, -3, 4], True, "token id -3 at index 2 is negative"),
        ([1, 2, 3, 1 << 32], False, "does not fit in uint32"),
        ([1, 2, 3, 4, 1 << 63], True, "does not fit in int64"),  # (anywhere: the tail too)
        ([1, 2, 3, 4, -(1 << 63) - 1], True, "does not fit in int64"),
        ([1, 2.0, 3, 4], True, "index 1 is float"),
        ("1234", True, "list of ints"),
        (np.zeros((2, 4), dtype=np.int64), True, "1-D"),
        (np.zeros(4, dtype=np.float64), True, "integer dtype"),
        (np.array([1, 2, 3, 1 << 63], dtype=np.uint64), True, "does not fit in int64"),
    ],
)
def test_bad_ids_are_refused(tokens: object, wide: bool, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        hashes(tokens, 4, wide=wide)


def test_ids_after_the_last_page_are_not_read() -> None:
    assert hashes([1, 2, 3, 4, -5], 4) == hashes([1, 2, 3, 4], 4)
    assert hashes([1, 2, 3, 4, 1 << 40], 4, wide=False) == hashes([1, 2, 3, 4], 4)
    # under EAGLE the last page reads the next token, not the one after
    assert hashes([1, 2, 3, 4, 5, -1], 4, eagle=True) == hashes([1, 2, 3, 4, 5], 4, eagle=True)
    with pytest.raises(InvalidRequest, match="negative"):
        hashes([1, 2, 3, 4, -5], 4, eagle=True)


def test_token_ids_q_keeps_a_view_of_int64_arrays() -> None:
    arr = np.arange(10, dtype=np.int64)
    assert token_ids_q(arr) is arr
    assert token_ids_q([True, 2]).tolist() == [1, 2]  # (array("q") takes bools, as SGLang's)


@pytest.mark.skipif(COMPILED is None, reason="the C extension is not loaded")
@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(
        st.one_of(
            st.integers(0, 200), st.integers(-(1 << 64), 1 << 64), st.just((1 << 32) - 1),
            st.just(1 << 32), st.booleans(),
        ),
        max_size=40,
    ),
    dtype=st.sampled_from(
        [None, "tuple", np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
         np.uint64, ">i8"]
    ),
)
def test_narrow_ids_packs_what_token_ids_q_reads(ids: list[int], dtype: object) -> None:
    """The compiled packing (``_chain_c.narrow_ids``) against :func:`token_ids_q`: the same
    ids where every one fits 32 bits, else None (the Python path then reads, or refuses)."""
    given_ids: object = ids if dtype is None else tuple(ids) if dtype == "tuple" else None
    if given_ids is None:
        try:
            given_ids = np.array(ids, dtype=dtype)  # type: ignore[call-overload]
        except OverflowError:
            return  # (not an array of that dtype)
        if [int(x) for x in given_ids] != [int(x) for x in ids]:
            return  # (wrapped by numpy: another input)
    packed = COMPILED.narrow_ids(given_ids, 1 << 20)
    try:
        read = token_ids_q(given_ids)
    except InvalidRequest:
        assert packed is None
        return
    if all(0 <= int(x) < 1 << 32 for x in ids) and dtype != ">i8":
        assert packed == np.asarray(read, dtype="<u4").tobytes()
    else:  # (an id past 32 bits, or a byte order it does not read: the Python path's)
        assert packed is None


@pytest.mark.skipif(COMPILED is None, reason="the C extension is not loaded")
def test_narrow_ids_hands_back_what_it_does_not_pack() -> None:
    assert COMPILED.narrow_ids([1, 2], 1) is None  # over the limit
    assert COMPILED.narrow_ids(np.arange(4)[::2], 9) is None  # (strided)
    assert COMPILED.narrow_ids(np.zeros((2, 2), dtype=np.int64), 9) is None
    assert COMPILED.narrow_ids(np.zeros(2, dtype=np.float64), 9) is None
    assert COMPILED.narrow_ids([1, np.int64(2)], 9) is None  # (not an int: Python reads it)
    assert COMPILED.narrow_ids(b"ab", 9) is None
    assert COMPILED.narrow_ids([7, True], 9) == struct.pack("<2I", 7, 1)


def test_a_masked_array_is_read_as_token_ids_q_reads_it() -> None:
    """A subclass of ndarray takes the Python path: a masked array's buffer holds what its
    mask hides (found by review: the C packing read it)."""
    outcomes = []
    for masked in (
        np.ma.masked_array(np.array([5], dtype=np.int64), mask=[True]),
        np.ma.masked_array(np.array([5, 6], dtype=np.uint64), mask=[False, True]),
    ):
        for twin in (COMPILED, None):
            sglang._C = twin
            try:
                outcomes.append(hashes(masked, 1, wide=False))
            except Exception as exc:  # (whatever the Python path does, the other does too)
                outcomes.append(type(exc))
            finally:
                sglang._C = COMPILED
    assert outcomes[0] == outcomes[1] and outcomes[2] == outcomes[3]


@pytest.mark.parametrize(
    "ids",
    [
        [], [0, 1, 2**32 - 1], [5, -1], [3, 2**32], list(range(300)),
        np.arange(70, dtype=np.int64), np.arange(70, dtype=np.uint64), np.array([1, -2]),
        np.arange(9, dtype=np.int32), np.arange(9, dtype=np.uint16),
        np.array([7, 2**32], dtype=np.uint64), np.arange(12, dtype=">i8"),
    ],
    ids=repr,
)
def test_narrow_token_ids_packs_exactly_the_prompts_whose_ids_fit_32_bits(ids: Any) -> None:
    # (the same on the compiled and the pure-Python path: the coordinator then hashes the
    # pages itself; None sends the ids through page_hashes, which hashes or refuses them)
    values = [int(x) for x in ids]
    fits = all(0 <= x < 2**32 for x in values)
    want = (np.array(values, dtype="<u4").tobytes(), len(values)) if fits else None
    assert narrow_token_ids(ids) == want


def test_narrow_token_ids_reads_a_misaligned_view() -> None:
    for dtype, size in ((np.uint64, 8), (np.int32, 4), (np.int64, 8)):
        raw = np.zeros(1 + size * 300, dtype=np.uint8)
        raw[1:] = np.frombuffer(np.arange(300, dtype=dtype).tobytes(), dtype=np.uint8)
        view = raw[1:].view(dtype)  # (its buffer one byte off alignment)
        assert view.ctypes.data % size
        ids = [int(x) for x in view]
        fits = all(0 <= x < 2**32 for x in ids)
        want = (np.array(ids, dtype="<u4").tobytes(), 300) if fits else None
        assert narrow_token_ids(view) == want
