"""Resolve with vLLM 0.32 / 0.33's rules: from per-group hash presence to the
:class:`~aio_mclookup._resolve.result.LookupResult` (hit and tail-key boundaries).

Presence is one boolean per request hash and store group: ``present[g][u]`` says whether
``(g, block_hashes[u])`` is in vLLM's presence set (probed somewhere with every namespace
answering 1; a repeated hash counts wherever it occurs). The managers reuse the vectorised
0.26 rules where 0.33 kept them (sliding window, chunked local, block-aligned full attention
and Mamba); what 0.33 changed is here: one lookup alignment for every manager, the
fine-grained variants, the EAGLE peek margin (none for Mamba, capped at the hash list), the
re-derivation of a hit that reaches ``num_tokens``, and the tail-key boundaries.

The search (:class:`_Search`) has a compiled twin, ``_search_c``, which runs when it was built
(:mod:`.._native`); the Python class is the reference and the fallback, and where vLLM raises
the twin hands the case back to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _native
from .._arrays import BoolArray, IntArray
from .._errors import InvalidRequest
from .._layout.geometry import Geometry
from .._layout.groups import (
    ChunkedLocalAttention,
    FullAttention,
    Mamba,
    SlidingWindow,
    window_blocks,
)
from .._layout.rules import EraCRules, EraCSpecGroup
from .hits import (
    _NONE,
    _unknown,
    chunked_local_hit,
    full_attention_prefix_hit,
    mamba_hit,
    sliding_window_hit,
)
from .result import LookupResult, TailKeyBoundary

__all__ = ["era_c_partial", "era_c_result", "lone_full_attention_hit"]

_C: Any = _native.load("aio_mclookup._resolve._search_c")
"""The compiled search (``_search_c.c``), or ``None``: :class:`_Search`."""
_KINDS = {FullAttention: 0, SlidingWindow: 1, ChunkedLocalAttention: 2, Mamba: 3}
_LARGEST = 1 << 61
"""Lengths the compiled search takes; longer ones are searched in Python (as are layouts with
sizes of ``2**30`` or more: ``_search_c.c``'s bounds, which keep its arithmetic exact)."""
_LARGEST_SIZE = 1 << 30


def _leading_true(present: BoolArray) -> int:
    if present.size == 0:
        return 0
    first_miss = int(np.argmin(present))
    return present.size if present[first_miss] else first_miss


class _Search:
    """vLLM's store-coordinator hit search over one request's presence.

    With ``known`` (per store group, by hash index: answered yet), ``present`` is the
    optimistic view (unknown counts as present) and every manager call also notes the unknown
    hash units its answer rests on (:attr:`depends`). Each manager's answer is exact once
    those are known (present) and every other unit it read is known absent, and each call's
    inputs are the previous calls' outputs: so when no call notes anything, the whole search,
    re-derivation and all, is the one vLLM runs on the full answers.

    ``lazy``: once a full-attention spec-group (evaluated first) rests on unknowns, the
    search stops at the next spec-group: the others' inputs are still guesses, so their keys
    could be wasted.
    """

    def __init__(
        self,
        geometry: Geometry,
        rules: EraCRules,
        present: Sequence[BoolArray],
        known: Sequence[BoolArray] | None = None,
        lazy: bool = False,
    ):
        self.rules = rules
        self.h = geometry.hash_block_size
        self.count = present[0].size if present else 0
        merged: list[BoolArray] = []
        merged_known: list[BoolArray] = []
        for sg in rules.spec_groups:
            arr = present[sg.group_ids[0]]
            for gid in sg.group_ids[1:]:
                arr = arr & present[gid]
            merged.append(arr)
            if known is not None:  # known: every member answered, or some member absent
                kn = known[sg.group_ids[0]]
                if len(sg.group_ids) > 1:
                    for gid in sg.group_ids[1:]:
                        kn = kn & known[gid]
                    kn = kn | ~arr
                merged_known.append(kn)
        self.units = merged
        """Per spec-group: presence by hash index (present in every member)."""
        self.known = merged_known if known is not None else None
        """Per spec-group: whether that presence is known (None: everything is)."""
        self.depends: list[list[IntArray]] = [[] for _ in rules.spec_groups]
        """Per spec-group: the unknown hash units noted so far."""
        self.lazy = lazy
        self._full_pending = False
        self._chunks: dict[tuple[int, int], BoolArray] = {}
        self._known_chunks: dict[tuple[int, int], BoolArray] = {}

    def chunks(self, i: int, block_size: int) -> BoolArray:
        """Spec-group ``i``'s presence by chunk: the chunk's last hash (vLLM's compact view,
        ``len(hashes) // s`` chunks)."""
        return self._view(self.units, self._chunks, i, block_size)

    def known_chunks(self, i: int, block_size: int) -> BoolArray | None:
        """:meth:`chunks`' knownness (None: everything is known)."""
        if self.known is None:
            return None
        return self._view(self.known, self._known_chunks, i, block_size)

    def _view(
        self,
        by_unit: list[BoolArray],
        cache: dict[tuple[int, int], BoolArray],
        i: int,
        block_size: int,
    ) -> BoolArray:
        got = cache.get((i, block_size))
        if got is None:
            s = block_size // self.h
            got = cache[(i, block_size)] = by_unit[i][s - 1 :: s]
        return got

    def _note(self, i: int, sg: EraCSpecGroup, units: IntArray) -> None:
        if not units.size:
            return
        if sg.full_attention:
            self._full_pending = True
        self.depends[i].append(units)

    def _note_chunks(self, i: int, sg: EraCSpecGroup, chunks: IntArray) -> None:
        if chunks.size:
            s = sg.spec.block_size // self.h
            self._note(i, sg, (chunks + 1) * s - 1)

    def _unknown_units(self, i: int, start: int, stop: int) -> IntArray:
        return _unknown(None if self.known is None else self.known[i], start, stop)

    def manager(self, i: int, sg: EraCSpecGroup, max_length: int, drop: bool) -> int:
        spec, a, h = sg.spec, self.rules.alignment, self.h
        block = spec.block_size
        known = self.known_chunks(i, block)
        if isinstance(spec, FullAttention):
            blocks = _leading_true(self.chunks(i, block)[: max(0, max_length) // block])
            if known is not None:
                self._note_chunks(i, sg, np.flatnonzero(~known[:blocks]))
            if not self.rules.fine:
                return full_attention_prefix_hit(blocks, block, a, drop)
            hit = blocks * block
            if block > h:  # the next block's interior hash boundaries, highest first
                s = block // h
                first = blocks * s
                stop = min(first + s - 1, max_length // h, self.count)
                if stop > first:
                    found = np.flatnonzero(self.units[i][first:stop])
                    if found.size:
                        unit = first + int(found[-1])
                        hit = (unit + 1) * h
                        self._note(i, sg, self._unknown_units(i, unit, unit + 1))
            if drop and hit > 0:
                hit -= h
            return hit // a * a
        if isinstance(spec, SlidingWindow):
            hit, found = sliding_window_hit(self.chunks(i, block), known, spec, max_length, a, drop)
            self._note_chunks(i, sg, found)
            return hit
        if isinstance(spec, ChunkedLocalAttention):
            if drop:
                raise InvalidRequest(
                    "a chunked_local group is EAGLE here: vLLM asserts chunked local attention "
                    "has no EAGLE"
                )
            if block != a:
                raise InvalidRequest(
                    f"chunked_local block_size={block} differs from the lookup alignment {a}: "
                    "vLLM asserts they match ('not compatible with chunked local attention')"
                )
            hit, found = chunked_local_hit(self.chunks(i, block), known, spec, max_length)
            self._note_chunks(i, sg, found)
            return hit
        assert isinstance(spec, Mamba)
        if self.rules.fine:  # the rightmost present hash unit (never an EAGLE drop)
            found = np.flatnonzero(self.units[i][: min(max(0, max_length) // h, self.count)])
            if not found.size:
                return 0
            unit = int(found[-1])
            self._note(i, sg, self._unknown_units(i, unit, unit + 1))
            return (unit + 1) * h
        hit, found = mamba_hit(self.chunks(i, block), known, block, max_length, a)
        self._note_chunks(i, sg, found)
        return hit

    def margin(self, sg: EraCSpecGroup) -> int:
        """How far past the running length an EAGLE spec-group looks (never for Mamba)."""
        block = sg.spec.block_size
        if self.rules.fine and sg.full_attention and block > self.h:
            return self.h
        return block

    def longest(self, max_length: int) -> int:
        spec_groups = self.rules.spec_groups
        if len(spec_groups) == 1:
            return self.manager(0, spec_groups[0], max_length, spec_groups[0].eagle)
        cap = self.count * self.h
        hit = max_length
        full_hits: dict[int, int] = {}
        verified: set[int] = set()
        while True:
            cur = hit
            for i, sg in enumerate(spec_groups):
                if i in full_hits:
                    cur = min(cur, full_hits[i])
                    continue
                if self.lazy and self._full_pending:  # nothing more can be noted (or exact)
                    return cur
                drop = sg.eagle and i not in verified
                limit = cur
                if drop and not sg.mamba:
                    limit = min(cur + self.margin(sg), cap)
                new = self.manager(i, sg, limit, drop)
                if drop:
                    verified.add(i)
                elif new < cur:
                    verified.clear()
                cur = new
                if sg.full_attention:
                    full_hits[i] = cur
            if cur >= hit:
                break
            hit = cur
            if not self.rules.multi_pass:
                break
        return hit

    def hit_for(self, num_tokens: int) -> int:
        """vLLM's hit for a request of ``num_tokens`` tokens: the search, and below the
        request end again on the same presence if it reached it."""
        a = self.rules.alignment
        hit = self.longest(num_tokens // a * a)
        if self.lazy and self._full_pending:  # (not exact: the caller reads the units noted)
            return hit
        if hit >= num_tokens:
            usable = (num_tokens - 1) // a * a
            if usable <= 0:
                return 0
            hit = self.longest(usable)
        return max(hit, 0)


def _search(
    geometry: Geometry,
    rules: EraCRules,
    num_tokens: int,
    present: Sequence[BoolArray],
    known: Sequence[BoolArray] | None = None,
    lazy: bool = False,
) -> tuple[int, list[IntArray]]:
    """:meth:`_Search.hit_for`, compiled where it can be: the hit, and per spec-group the
    unknown units it rests on (ascending, once each; every one empty when the hit is exact)."""
    codes = _compiled(geometry, rules, num_tokens)
    if codes is not None:
        found = _C.hit_for(
            codes, tuple(present), None if known is None else tuple(known), num_tokens, lazy
        )
        if found is not None:  # (None: a case where vLLM raises, which the class below says)
            hit, noted = found
            return hit, [np.frombuffer(units, np.int64) if units else _NONE for units in noted]
    return _python_search(geometry, rules, num_tokens, present, known, lazy)


def _python_search(
    geometry: Geometry,
    rules: EraCRules,
    num_tokens: int,
    present: Sequence[BoolArray],
    known: Sequence[BoolArray] | None,
    lazy: bool,
) -> tuple[int, list[IntArray]]:
    """:func:`_search` by :class:`_Search` (the reference)."""
    search = _Search(geometry, rules, present, known, lazy)
    hit = search.hit_for(num_tokens)
    depends = [
        # (every noted unit is unknown; several calls may note one: once)
        (np.unique(np.concatenate(noted)) if len(noted) > 1 else noted[0]) if noted else _NONE
        for noted in search.depends
    ]
    return hit, depends


def _compiled(geometry: Geometry, rules: EraCRules, num_tokens: int) -> bytes | None:
    """The rules' codes for the compiled search (built once per layout), or None when it
    does not run: not built, or a length it does not take."""
    if _C is None or not 0 <= num_tokens < _LARGEST:
        return None
    codes = rules.search_codes
    if codes is None:
        codes = rules.search_codes = _search_codes(geometry, rules)
    return codes


def _search_codes(geometry: Geometry, rules: EraCRules) -> bytes:
    """The rules as ``_search_c.hit_for`` reads them (see ``_search_c.c``); empty for a spec
    it does not know, which the compiled search refuses."""
    codes = [
        geometry.hash_block_size, rules.alignment, rules.fine, rules.multi_pass,
        len(rules.spec_groups),
    ]
    for sg in rules.spec_groups:
        spec = sg.spec
        kind = _KINDS.get(type(spec))
        if kind is None:
            return b""
        need = (
            (window_blocks(spec, False), window_blocks(spec, True))
            if isinstance(spec, SlidingWindow)
            else (0, 0)
        )
        chunk = spec.attention_chunk_size if isinstance(spec, ChunkedLocalAttention) else 0
        codes += [kind, spec.block_size, *need, chunk, sg.eagle, len(sg.group_ids), *sg.group_ids]
    if max(codes) >= _LARGEST_SIZE:
        return b""  # (sizes no model has: the Python search takes them)
    return np.array(codes, dtype=np.int64).tobytes()


def era_c_result(geometry: Geometry, num_tokens: int, present: Sequence[BoolArray]) -> LookupResult:
    """vLLM 0.32 / 0.33's lookup result for ``num_tokens`` tokens, from per store group
    presence by hash index (see the module docstring)."""
    rules = geometry.rules
    assert rules is not None
    hit, _ = _search(geometry, rules, num_tokens, present)
    if hit <= 0:
        return LookupResult(0)
    return LookupResult(hit, tail_key_boundaries(geometry, rules, hit, present))


def era_c_partial(
    geometry: Geometry,
    num_tokens: int,
    present: Sequence[BoolArray],
    known: Sequence[BoolArray],
    window: int | None = None,
    scouts: int = 0,
) -> LookupResult | list[IntArray]:
    """vLLM 0.32 / 0.33's result from partly known presence, or what it still rests on.

    ``present`` and ``known`` are per store group, by hash index; unknown units count as
    present. Returns the exact :class:`LookupResult` when nothing unknown can change it
    (raising vLLM's errors as :func:`era_c_result` does), else per store group the unknown
    hash units to learn next (ascending; at most ``window`` per spec-group for the hit
    search, and then only those of full attention while it is not settled: see
    :class:`_Search`). A full-attention spec-group cut at ``window`` also gets ``scouts``
    units past it: the last unknown chunk of each quarter of the next window, twice as wide,
    so that an absent one bounds the next window (its keys would be wasted past the miss)."""
    rules = geometry.rules
    assert rules is not None
    codes = _compiled(geometry, rules, num_tokens)
    if codes is not None:  # the search and the choice below, in C
        found = _C.partial(
            codes, tuple(present), tuple(known), num_tokens, -1 if window is None else window,
            scouts,
        )
        if found is not None:  # (None: a case where vLLM raises, which the Python says)
            hit, chosen = found
            if chosen is not None:
                return [np.frombuffer(units, np.int64) if units else _NONE for units in chosen]
            return _exact_result(geometry, rules, hit, present, known)
    hit, depends = _python_search(geometry, rules, num_tokens, present, known, window is not None)
    if any(units.size for units in depends):
        wanted: list[list[IntArray]] = [[] for _ in geometry.groups]
        for sg, units in zip(rules.spec_groups, depends):
            if not units.size:
                continue
            if window is not None and units.size > window:
                if scouts and sg.full_attention:
                    quarter = max(1, window // 2)
                    ahead = units[window + quarter - 1 : window + scouts * quarter : quarter]
                    units = np.concatenate((units[:window], ahead))
                else:
                    units = units[:window]
            for gid in sg.group_ids:
                mine = units[~known[gid][units]]
                if mine.size:
                    wanted[gid].append(mine)
        return [np.concatenate(w) if len(w) > 1 else w[0] if w else _NONE for w in wanted]
    return _exact_result(geometry, rules, hit, present, known)


def _exact_result(
    geometry: Geometry,
    rules: EraCRules,
    hit: int,
    present: Sequence[BoolArray],
    known: Sequence[BoolArray],
) -> LookupResult | list[IntArray]:
    """:func:`era_c_partial` once its hit is exact: the result, or the tail-key units it
    still reads."""
    if hit <= 0:
        return LookupResult(0)
    boundaries = _partial_boundaries(geometry, rules, hit, present, known)
    if isinstance(boundaries, list):
        return boundaries
    return LookupResult(hit, boundaries)


def _partial_boundaries(
    geometry: Geometry,
    rules: EraCRules,
    hit: int,
    present: Sequence[BoolArray],
    known: Sequence[BoolArray],
) -> tuple[TailKeyBoundary, ...] | list[IntArray]:
    """:func:`tail_key_boundaries` once every unit it reads is known, else per store group
    the unknown units it reads (up to the first that may be present)."""
    h = geometry.hash_block_size
    j = hit // h - 1
    wanted: list[IntArray] = []
    missing = False
    for gid, spec in enumerate(geometry.groups):
        units, kn = present[gid], known[gid]
        need = _NONE
        if j < units.size and not kn[j]:
            need = np.array([j], dtype=np.int64)
        elif j < units.size and not units[j] and rules.fine:  # the scan above the hit
            block = spec.block_size
            end = min(-(-hit // block) * block // h, units.size)
            if end > j + 1:
                maybe = np.flatnonzero(units[j + 1 : end]) + j + 1  # present or unknown
                if maybe.size and not kn[maybe[0]]:
                    stop = np.flatnonzero(kn[maybe])  # the unknown ones before a known one
                    need = maybe[: int(stop[0])] if stop.size else maybe
        missing = missing or bool(need.size)
        wanted.append(need)
    if missing:
        return wanted
    return tail_key_boundaries(geometry, rules, hit, present)


def tail_key_boundaries(
    geometry: Geometry, rules: EraCRules, hit: int, present: Sequence[BoolArray]
) -> tuple[TailKeyBoundary, ...]:
    """Per store group, the hash boundary whose key holds its last chunk of the hit."""
    h = geometry.hash_block_size
    j = hit // h - 1
    out: list[TailKeyBoundary] = []
    for gid, spec in enumerate(geometry.groups):
        units = present[gid]
        if j >= units.size:
            raise InvalidRequest(
                f"the hit ({hit} tokens) ends past the block hashes ({units.size}): vLLM "
                "raises IndexError finding its tail key"
            )
        if units[j]:
            out.append(TailKeyBoundary(gid, hit))
            continue
        if not rules.fine:
            raise InvalidRequest(
                f"group {gid} has no key at the hit boundary ({hit} tokens): vLLM asserts "
                "that it does"
            )
        block = spec.block_size
        end = min(-(-hit // block) * block // h, units.size)
        found = np.flatnonzero(units[j + 1 : end]) if end > j + 1 else np.zeros(0, np.int64)
        if not found.size:
            raise InvalidRequest(f"no tail key found for cache group {gid} (vLLM asserts)")
        out.append(TailKeyBoundary(gid, (j + 1 + int(found[0]) + 1) * h))
    return tuple(out)


def lone_full_attention_hit(
    geometry: Geometry, token_len: int, num_tokens: int, chunks: int
) -> int:
    """One block-aligned full-attention store group whose first ``chunks`` probed chunks are
    present and the next one (if any) absent: vLLM 0.32 / 0.33's hit."""
    rules = geometry.rules
    assert rules is not None
    sg = rules.spec_groups[0]
    block, a = sg.spec.block_size, rules.alignment

    def search(max_length: int) -> int:
        return full_attention_prefix_hit(min(chunks, max_length // block), block, a, sg.eagle)

    hit = search(token_len)
    if hit >= num_tokens:
        usable = (num_tokens - 1) // a * a
        if usable <= 0:
            return 0
        hit = search(usable)
    return max(hit, 0)
