"""Comparisons of hash rows (2-D uint8 arrays, one hash per row): the leading rows two arrays
share (the known prefixes' test), and whether any row repeats (a plan's repeated hashes).

:func:`common_rows` has a compiled twin, ``_rows_c`` (a ``memcmp`` per row, no temporary
arrays), which runs when it was built; the numpy code is the reference and the fallback
(:mod:`._native`). :func:`rows_repeat` is the reference and the fallback of ``_plan/_repeats_c``'s
test, which ``_plan.probe.duplicate_ids`` runs where it was built (docs/design.md,
"Compiled extensions")."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from . import _native

__all__ = ["common_rows", "rows_repeat"]

_C: Any = _native.load("aio_mclookup._rows_c")
"""The compiled comparisons, or ``None``: the numpy code below."""


def common_rows(
    a: npt.NDArray[np.uint8], b: npt.NDArray[np.uint8], limit: int | None = None
) -> int:
    """How many leading rows ``a`` and ``b`` share (same width), at most ``limit`` (and at
    most the shorter one's length)."""
    if _C is not None:
        return int(_C.common_rows(a, b, -1 if limit is None else limit))
    m: int = min(a.shape[0], b.shape[0])
    if limit is not None and limit < m:
        m = limit
    width: int = a.shape[1]
    if not m or not width:  # (rows of empty hashes are all equal)
        return m
    if a.shape[0] != m:
        a = a[:m]
    if b.shape[0] != m:
        b = b[:m]
    differs = (a != b).ravel()
    first = int(differs.argmax())
    return first // width if differs[first] else m


def rows_repeat(rows: npt.NDArray[np.uint8]) -> bool:
    """Whether two of ``rows`` are equal."""
    n: int = rows.shape[0]
    width: int = rows.shape[1]
    if n < 2:
        return False
    if not width:
        return True
    # Fingerprints first: when none repeats, no row does (sorting 32 bits costs about 60 % of
    # sorting 64; a false alarm, 1 in 8 at 32K hashes, costs the 64-bit sort next).
    if width <= 8:
        padded = np.zeros((n, 8), dtype=np.uint8)
        padded[:, :width] = rows
        return _repeats(padded.view(np.uint64).ravel())
    if width % 8 == 0 and rows.flags.c_contiguous:  # the rows' first bytes, no copy
        if not _repeats(rows.view(np.uint32)[:, 0]) or not _repeats(rows.view(np.uint64)[:, 0]):
            return False
    elif not _repeats(np.ascontiguousarray(rows[:, :8]).view(np.uint64).ravel()):
        return False
    distinct: int = len({bytes(row) for row in rows})
    return distinct < n


def _repeats(fingerprints: npt.NDArray[np.uint32] | npt.NDArray[np.uint64]) -> bool:
    """Whether some fingerprint occurs twice (then the rows may repeat)."""
    ordered = np.sort(fingerprints)  # a sorted copy
    return bool((ordered[1:] == ordered[:-1]).any())
