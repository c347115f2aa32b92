"""Resolve with vLLM 0.32 / 0.33's rules: from per-group hash presence to the
:class:`~aio_mclookup._resolve.result.LookupResult` (hit and tail-key boundaries).

Presence is one boolean per request hash and store group: ``present[g][u]`` says whether
``(g, block_hashes[u])`` is in vLLM's presence set (probed somewhere with every namespace
answering 1; a repeated hash counts wherever it occurs). The managers reuse the vectorised
0.26 rules where 0.33 kept them (sliding window, chunked local, block-aligned full attention
and Mamba); what 0.33 changed is here: one lookup alignment for every manager, the
fine-grained variants, the EAGLE peek margin (none for Mamba, capped at the hash list), the
re-derivation of a hit that reaches ``num_tokens``, and the tail-key boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._arrays import BoolArray
from .._errors import InvalidRequest
from .._layout.geometry import Geometry
from .._layout.groups import ChunkedLocalAttention, FullAttention, Mamba, SlidingWindow
from .._layout.rules import EraCRules, EraCSpecGroup
from .hits import (
    chunked_local_hit,
    full_attention_prefix_hit,
    mamba_hit,
    sliding_window_hit,
)
from .result import LookupResult, TailKeyBoundary

__all__ = ["era_c_result", "lone_full_attention_hit"]


def _leading_true(present: BoolArray) -> int:
    if present.size == 0:
        return 0
    first_miss = int(np.argmin(present))
    return present.size if present[first_miss] else first_miss


class _Search:
    """vLLM's store-coordinator hit search over one request's presence."""

    def __init__(self, geometry: Geometry, rules: EraCRules, present: Sequence[BoolArray]):
        self.rules = rules
        self.h = geometry.hash_block_size
        self.count = present[0].size if present else 0
        merged: list[BoolArray] = []
        for sg in rules.spec_groups:
            arr = present[sg.group_ids[0]]
            for gid in sg.group_ids[1:]:
                arr = arr & present[gid]
            merged.append(arr)
        self.units = merged
        """Per spec-group: presence by hash index (present in every member)."""
        self._chunks: dict[tuple[int, int], BoolArray] = {}

    def chunks(self, i: int, block_size: int) -> BoolArray:
        """Spec-group ``i``'s presence by chunk: the chunk's last hash (vLLM's compact view,
        ``len(hashes) // s`` chunks)."""
        got = self._chunks.get((i, block_size))
        if got is None:
            s = block_size // self.h
            got = self.units[i][s - 1 :: s]
            self._chunks[(i, block_size)] = got
        return got

    def manager(self, i: int, sg: EraCSpecGroup, max_length: int, drop: bool) -> int:
        spec, a, h = sg.spec, self.rules.alignment, self.h
        block = spec.block_size
        if isinstance(spec, FullAttention):
            blocks = _leading_true(self.chunks(i, block)[: max(0, max_length) // block])
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
                        hit = (first + int(found[-1]) + 1) * h
            if drop and hit > 0:
                hit -= h
            return hit // a * a
        if isinstance(spec, SlidingWindow):
            return sliding_window_hit(self.chunks(i, block), None, spec, max_length, a, drop)[0]
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
            return chunked_local_hit(self.chunks(i, block), None, spec, max_length)[0]
        assert isinstance(spec, Mamba)
        if self.rules.fine:  # the rightmost present hash unit (never an EAGLE drop)
            found = np.flatnonzero(self.units[i][: min(max(0, max_length) // h, self.count)])
            return (int(found[-1]) + 1) * h if found.size else 0
        return mamba_hit(self.chunks(i, block), None, block, max_length, a)[0]

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


def era_c_result(geometry: Geometry, num_tokens: int, present: Sequence[BoolArray]) -> LookupResult:
    """vLLM 0.32 / 0.33's lookup result for ``num_tokens`` tokens, from per store group
    presence by hash index (see the module docstring)."""
    rules = geometry.rules
    assert rules is not None
    a = rules.alignment
    search = _Search(geometry, rules, present)
    hit = search.longest(num_tokens // a * a)
    if hit >= num_tokens:  # searched again below the request end, on the same presence
        usable = (num_tokens - 1) // a * a
        if usable <= 0:
            return LookupResult(0)
        hit = search.longest(usable)
    if hit <= 0:
        return LookupResult(0)
    return LookupResult(hit, tail_key_boundaries(geometry, rules, hit, present))


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
