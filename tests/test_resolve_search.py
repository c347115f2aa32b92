"""vLLM 0.32 / 0.33's hit search (``aio_mclookup._resolve.era_c``): its compiled twin
(``_search_c``) against the Python ``_Search`` on the same random layouts, presence, knowledge
and lengths: the same hit and the same unknown units noted, or the Python search raising
vLLM's error where the twin hands a case back. (The whole suite runs on both paths in CI; the
rounds and results are checked against the literal 0.33 oracle in ``test_hits_v033.py``.)
"""

from __future__ import annotations

import importlib
import importlib.util
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aio_mclookup as mcl
from aio_mclookup._resolve import era_c
from test_hits_v033 import layout_configs

SEARCH_C = "aio_mclookup._resolve._search_c"
C_SEARCH: Any = importlib.import_module(SEARCH_C) if importlib.util.find_spec(SEARCH_C) else None
needs_build = pytest.mark.skipif(C_SEARCH is None, reason="the C extension is not built")


def _both(
    monkeypatch: pytest.MonkeyPatch, *args: Any, **kwargs: Any
) -> tuple[Any, Any, bool]:
    """The search on each path: (compiled, pure, whether the twin took the case)."""
    calls: list[Any] = []

    def spy(*call: Any) -> Any:
        got = C_SEARCH.hit_for(*call)
        calls.append(got)
        return got

    outcomes = []
    for twin in (spy, None):
        monkeypatch.setattr(era_c, "_C", None if twin is None else SimpleNamespace(hit_for=twin))
        try:
            hit, depends = era_c._search(*args, **kwargs)
            outcomes.append((hit, [d.tolist() for d in depends]))
        except mcl.InvalidRequest as exc:
            outcomes.append(("raises", type(exc)))
    took = bool(calls) and calls[0] is not None
    return outcomes[0], outcomes[1], took


@st.composite
def searches(draw: st.DrawFn) -> tuple[Any, ...]:
    layout = mcl.KVLayout.from_dict(draw(layout_configs()))
    geometry = layout._geometry
    rules = geometry.rules
    assert rules is not None
    h = geometry.hash_block_size
    groups = len(rules.coverage)
    count = draw(st.integers(0, 48))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    density = draw(st.sampled_from([0.3, 0.8, 0.95, 1.0]))
    present = tuple(rng.random(count) < density for _ in range(groups))
    known = None
    if draw(st.booleans()):
        share = draw(st.sampled_from([0.0, 0.5, 0.9]))
        known = tuple(rng.random(count) < share for _ in range(groups))
        present = tuple(p | ~k for p, k in zip(present, known))  # (unknown counts as present)
    num_tokens = draw(st.integers(0, count * h + 2 * h))
    lazy = known is not None and draw(st.booleans())
    return geometry, rules, num_tokens, present, known, lazy


@needs_build
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(searches())
def test_the_twin_finds_what_the_python_search_finds(case: tuple[Any, ...]) -> None:
    geometry, rules, num_tokens, present, known, lazy = case
    with pytest.MonkeyPatch.context() as monkeypatch:
        compiled, pure, took = _both(
            monkeypatch, geometry, rules, num_tokens, present, known, lazy
        )
    assert compiled == pure
    if not took:  # handed back: only where vLLM raises
        assert pure[0] == "raises"


@needs_build
def test_a_dsv4_like_search_by_hand() -> None:
    """Full attention (block 8) with two windows: the hit, the units each rests on."""
    groups = [mcl.FullAttention(8), mcl.SlidingWindow(4, sliding_window=8),
              mcl.SlidingWindow(2, sliding_window=4)]
    layout = mcl.KVLayout(groups, model="m", hash_block_size=2, scheduler_block_size=8)
    geometry = layout._geometry
    rules = geometry.rules
    assert rules is not None
    count = 16  # 32 tokens
    present = tuple(np.ones(count, dtype=bool) for _ in range(3))
    known = tuple(np.zeros(count, dtype=bool) for _ in range(3))
    for gid in range(3):
        present[gid][12:] = False
        known[gid][12:] = True  # absent from token 24 on, the rest unknown
    hit, depends = era_c._search(geometry, rules, 32, present, known, lazy=True)
    # Lazy: full attention first; its prefix of 3 blocks (units 3, 7, 11) rests on unknowns.
    assert hit == 24
    assert [d.tolist() for d in depends] == [[3, 7, 11], [], []]
    for gid in range(3):
        known[gid][:12] = True
    hit, depends = era_c._search(geometry, rules, 32, present, known, lazy=True)
    assert hit == 24 and not any(d.size for d in depends)


@needs_build
def test_the_twin_hands_back_what_it_does_not_search() -> None:
    layout = mcl.KVLayout([mcl.FullAttention(4)], model="m", hash_block_size=4,
                          scheduler_block_size=4)
    geometry = layout._geometry
    rules = geometry.rules
    assert rules is not None
    codes = era_c._search_codes(geometry, rules)
    ones = (np.ones(4, dtype=bool),)
    assert C_SEARCH.hit_for(codes, ones, None, 16, False) == (12, (b"",))
    assert C_SEARCH.hit_for(codes, ones, None, -1, False) is None  # (a negative length)
    assert C_SEARCH.hit_for(codes, (np.ones(8, dtype=bool)[::2],), None, 16, False) is None
    assert C_SEARCH.hit_for(codes, (np.ones(4, dtype=np.uint8),), None, 16, False) is None
    assert C_SEARCH.hit_for(codes, ones, (np.ones(3, dtype=bool),), 16, False) is None
    assert C_SEARCH.hit_for(codes[:-8], ones, None, 16, False) is None  # (codes cut short)


@needs_build
def test_what_the_review_found() -> None:
    """Inputs an independent review found the first twin read otherwise than the Python
    search: they are now the same on both paths (or handed back to Python)."""
    def both(geometry: Any, rules: Any, *args: Any) -> None:
        with pytest.MonkeyPatch.context() as monkeypatch:
            compiled, pure, _ = _both(monkeypatch, geometry, rules, *args)
        assert compiled == pure

    # Sizes past int64, and products of sizes past it: handed back.
    huge = mcl.KVLayout([mcl.FullAttention(4), mcl.SlidingWindow(4, sliding_window=2**66)],
                        model="m", hash_block_size=4, scheduler_block_size=4)
    g = huge._geometry
    both(g, g.rules, 16, (np.ones(4, dtype=bool),) * 2)
    h = 2**61
    wide = mcl.KVLayout([mcl.FullAttention(h), mcl.SlidingWindow(h, sliding_window=1)],
                        model="m", hash_block_size=h, scheduler_block_size=h, use_eagle=True)
    g = wide._geometry
    both(g, g.rules, 2**62 - 1, (np.ones(8, dtype=bool),) * 2)
    # Presence arrays that are not 1-D: handed back (the Python search raises or reads them).
    lone = mcl.KVLayout([mcl.FullAttention(4)], model="m", hash_block_size=4,
                        scheduler_block_size=4)
    g = lone._geometry
    codes = era_c._search_codes(g, g.rules)
    assert C_SEARCH.hit_for(codes, (np.ones((2, 4), dtype=bool),), None, 32, False) is None
    assert C_SEARCH.hit_for(codes, (np.array(True),), None, 4, False) is None
    # A bool byte other than 0 or 1 is True, as numpy reads it, where groups merge.
    twice = mcl.KVLayout([mcl.FullAttention(4), mcl.FullAttention(4)], model="m",
                         hash_block_size=4, scheduler_block_size=4)
    g = twice._geometry
    odd = np.frombuffer(b"\x02" * 4, dtype=bool)
    both(g, g.rules, 16, (odd, np.ones(4, dtype=bool)))
    both(g, g.rules, 16, (odd, np.ones(4, dtype=bool)),
         (np.zeros(4, dtype=bool), np.ones(4, dtype=bool)))


def _partial(monkeypatch: pytest.MonkeyPatch, compiled: bool, *args: Any) -> Any:
    """era_c_partial on one path: the result, the units per store group, or the error."""
    monkeypatch.setattr(era_c, "_C", C_SEARCH if compiled else None)
    try:
        found = era_c.era_c_partial(*args)
    except mcl.InvalidRequest as exc:
        return ("raises", str(exc))
    if isinstance(found, mcl.LookupResult):
        return found
    return [units.tolist() for units in found]


@needs_build
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(searches(), st.sampled_from([None, 0, 1, 3, 8, 16]), st.sampled_from([0, 4]))
def test_the_twin_chooses_the_units_the_python_chooses(
    case: tuple[Any, ...], window: int | None, scouts: int
) -> None:
    """``era_c_partial``: the search, the window and scouts, each member group's own unknown
    units (``_search_c.partial``), then the tail keys (Python on both paths)."""
    geometry, _, num_tokens, present, known, _ = case
    if known is None:
        known = tuple(np.ones(p.size, dtype=bool) for p in present)
    args = (geometry, num_tokens, present, known, window, scouts)
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert _partial(monkeypatch, True, *args) == _partial(monkeypatch, False, *args)


@needs_build
def test_partial_hands_back_windows_and_scouts_no_round_has() -> None:
    """Found by the second review: the Python code reads these otherwise (a negative slice
    stop, a lazy search cut at a negative window); no round passes them, the twin hands them
    back."""
    lone = mcl.KVLayout([mcl.FullAttention(4)], model="m", hash_block_size=4,
                        scheduler_block_size=4)
    g = lone._geometry
    codes = era_c._search_codes(g, g.rules)
    present, known = (np.ones(20, dtype=bool),), (np.zeros(20, dtype=bool),)
    assert C_SEARCH.partial(codes, present, known, 80, 1, 4) is not None
    for window, scouts in ((1, -3), (1, 2**62), (-2, 0)):
        assert C_SEARCH.partial(codes, present, known, 80, window, scouts) is None
    # A store group in two spec-groups (only hand-made codes have that): handed back.
    twice = np.frombuffer(codes, dtype=np.int64).tolist()
    twice[4] = 2
    twice += twice[5:]
    doubled = np.array(twice, dtype=np.int64).tobytes()
    assert C_SEARCH.partial(doubled, present, known, 80, 1, 0) is None
