"""SGLang's L3 hit rule (``_resolve/sglang.py``): the first page any rank misses, the
threshold revoke, only ``1`` present."""

from __future__ import annotations

import numpy as np
import pytest

from aio_mclookup import InvalidRequest
from aio_mclookup._resolve.sglang import l3_hit, present_pages, present_pages_of


def test_l3_hit_revokes_below_the_threshold() -> None:
    assert l3_hit(3, 16, 48) == 48
    assert l3_hit(2, 16, 48) == 0
    assert l3_hit(0, 16, 0) == 0
    assert l3_hit(5, 1, -3) == 5


def test_present_pages_stops_at_the_first_missing_key_of_any_rank() -> None:
    assert present_pages([True] * 6, 2) == 3
    assert present_pages([True, True, True, False, True, True], 2) == 1  # (a v of page 1)
    assert present_pages(np.array([False, True, True, True]), 2) == 0
    assert present_pages([], 4) == 0


@pytest.mark.parametrize(
    ("exists", "pages"),
    [
        ([1, 1, 1, 1], 2),
        ([1, 1, -1, 1], 1),  # a Mooncake error counts as absent
        ([1, 1, 1, 0, 1, 1], 1),  # holes after the first miss are ignored
        (np.array([1, 1, 1, 1, 2, 1]), 2),
        ([1, 1, "1", 1], 1),  # (compared as Python does: "1" is not 1)
        ([True, True, 1.0, 1], 2),
    ],
)
def test_present_pages_of_answers(exists: list[object], pages: int) -> None:
    assert present_pages_of(exists, len(exists), 2) == pages  # type: ignore[arg-type]


def test_a_wrong_number_of_answers_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="one answer per key"):
        present_pages_of([1, 1, 1], 4, 2)
