"""Comparisons of hash rows (``aio_mclookup._rows``): known answers on both paths, and both
against a row-by-row reading of random rows."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_mclookup import _rows

ROWS_C = "aio_mclookup._rows_c"
C_ROWS: Any = importlib.import_module(ROWS_C) if importlib.util.find_spec(ROWS_C) else None
PATHS = ["pure", "compiled"] if C_ROWS is not None else ["pure"]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(_rows, "_C", None if request.param == "pure" else C_ROWS)
    yield request.param


def _rows_of(*hashes: bytes) -> npt.NDArray[np.uint8]:
    return np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(len(hashes), -1)


def test_common_rows_known_answers(path: str) -> None:
    a = _rows_of(b"aaaa", b"bbbb", b"cccc", b"dddd")
    b = _rows_of(b"aaaa", b"bbbb", b"cxcc", b"dddd")
    assert _rows.common_rows(a, b) == 2
    assert _rows.common_rows(a, b, 1) == 1
    assert _rows.common_rows(a, a) == 4
    assert _rows.common_rows(a, a[:3]) == 3
    assert _rows.common_rows(a, a, 0) == 0
    assert _rows.common_rows(a[1:], b[1:]) == 1  # (a slice: rows from an offset)
    assert _rows.common_rows(a[::2], a[::2]) == 2  # (strided rows)
    assert _rows.common_rows(a[::2], b[::2]) == 1
    empty = np.zeros((3, 0), dtype=np.uint8)
    assert _rows.common_rows(empty, empty) == 3  # (rows of empty hashes are all equal)


def test_rows_repeat_known_answers(path: str) -> None:
    assert not _rows.rows_repeat(_rows_of(b"aaaa", b"bbbb", b"cccc"))
    assert _rows.rows_repeat(_rows_of(b"aaaa", b"bbbb", b"aaaa"))
    # The same first 8 bytes, different after: not a repeat (no fingerprint decides alone).
    head = b"12345678"
    assert not _rows.rows_repeat(_rows_of(head + b"x" * 24, head + b"y" * 24))
    assert _rows.rows_repeat(_rows_of(head + b"x" * 24, b"z" * 32, head + b"x" * 24))
    assert not _rows.rows_repeat(_rows_of(b"a" * 32))
    assert not _rows.rows_repeat(np.zeros((0, 32), dtype=np.uint8))
    assert _rows.rows_repeat(np.zeros((2, 0), dtype=np.uint8))
    assert not _rows.rows_repeat(_rows_of(b"ab", b"ba"))  # (narrow: padded fingerprints)
    many = np.arange(20_000, dtype=np.uint64).view(np.uint8).reshape(20_000, 8)
    assert not _rows.rows_repeat(many)
    twice = np.concatenate((many, many[12_345:12_346]))
    assert _rows.rows_repeat(twice)


@st.composite
def row_pairs(draw: st.DrawFn) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], int]:
    width = draw(st.integers(0, 40))
    alphabet = draw(st.integers(1, 3))  # few distinct rows: repeats and long common runs
    pool = [draw(st.binary(min_size=width, max_size=width)) for _ in range(alphabet)]
    a = draw(st.lists(st.sampled_from(pool), min_size=0, max_size=40))
    b = draw(st.lists(st.sampled_from(pool), min_size=0, max_size=40))
    shape = (-1, width) if width else (0, 0)
    ra = np.frombuffer(b"".join(a), dtype=np.uint8).reshape(shape) if a and width else (
        np.zeros((len(a), width), dtype=np.uint8))
    rb = np.frombuffer(b"".join(b), dtype=np.uint8).reshape(shape) if b and width else (
        np.zeros((len(b), width), dtype=np.uint8))
    step = draw(st.integers(1, 3))
    return ra[::step], rb, draw(st.integers(-1, 45))


@settings(max_examples=400, deadline=None)
@given(row_pairs())
def test_both_paths_agree_with_a_row_by_row_reading(case: tuple[Any, Any, int]) -> None:
    a, b, limit = case
    m = min(len(a), len(b)) if limit < 0 else min(len(a), len(b), limit)
    shared = next((i for i in range(m) if bytes(a[i]) != bytes(b[i])), m)
    saved = _rows._C
    try:
        for twin in {None, C_ROWS}:  # (hypothesis and function-scoped fixtures do not mix)
            _rows._C = twin
            assert _rows.common_rows(a, b, None if limit < 0 else limit) == shared
    finally:
        _rows._C = saved
    for rows in (a, b):
        assert _rows.rows_repeat(rows) == (len({bytes(r) for r in rows}) < len(rows))


@pytest.mark.skipif(C_ROWS is None, reason="the C extension is not built")
def test_the_compiled_twin_refuses_other_shapes() -> None:
    with pytest.raises(ValueError, match="2-D array of uint8"):
        C_ROWS.common_rows(np.zeros(4, dtype=np.uint8), np.zeros(4, dtype=np.uint8), -1)
    with pytest.raises(ValueError, match="2-D array of uint8"):
        C_ROWS.common_rows(np.zeros((2, 2), dtype=np.int64), np.zeros((2, 2), dtype=np.int64), -1)
    with pytest.raises(ValueError, match="different widths"):
        C_ROWS.common_rows(np.zeros((2, 2), dtype=np.uint8), np.zeros((2, 3), dtype=np.uint8), -1)
