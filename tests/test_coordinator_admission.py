"""Admission's bookkeeping (``_coordinator/admission.py``), sans-IO: what fits, what is
reserved, and when a newcomer is refused instead of waiting. (The waiting line itself, in
both shells: test_coordinator_anyio.py and test_coordinator_hostile.py.)"""

from __future__ import annotations

import pytest

import aio_mclookup as mcl
from aio_mclookup._coordinator.admission import Admission
from aio_mclookup._coordinator.core import CoordinatorCore
from aio_mclookup._coordinator.options import CoordinatorOptions
from aio_mclookup._observe.stats import CoordinatorStats
from helpers import chain
from v026_layouts import KVLayout

FULL16 = KVLayout([mcl.FullAttention(16)], model="org/admission", hash_block_size=16,
                  scheduler_block_size=16)


def admission_of(**options: object) -> tuple[CoordinatorCore, Admission]:
    core = CoordinatorCore(CoordinatorOptions(**options), CoordinatorStats())  # type: ignore[arg-type]
    return core, Admission(core)


def test_one_lookup_always_fits_and_the_bounds_count_reserved_work() -> None:
    core, admission = admission_of(max_pending_lookups=2, max_pending_keys=10)
    assert admission.has_room(1_000)  # nothing pending: fits however large
    core.begin(FULL16.plan(64, chain(4, b"a")), now=0.0)  # 4 keys pending
    assert admission.has_room(6) and not admission.has_room(7)
    admission.reserve(6)  # let in from the line, not begun yet
    assert admission.pending_keys() == 10
    assert not admission.has_room(0)  # two lookups: the lookup bound
    admission.release(6)
    assert (admission.reserved_lookups, admission.reserved_keys) == (0, 0)
    assert admission.has_room(6)


@pytest.mark.parametrize(("when_full", "waiting", "refused"), [
    ("raise", 0, True), ("wait", 0, False), ("wait", 3, True),
])
def test_a_newcomer_waits_unless_told_to_raise_or_the_line_is_full(
    when_full: str, waiting: int, refused: bool
) -> None:
    _, admission = admission_of(when_full=when_full, max_waiting_lookups=3)
    refusal = admission.refusal(waiting)
    assert (refusal is not None) == refused
    if refusal is not None:
        assert isinstance(refusal, mcl.Overloaded)
        assert f"{waiting} waiting" in str(refusal)
