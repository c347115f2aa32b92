"""Resolve: from per-chunk presence to the prefix hit length, with vLLM 0.26's rules.

Each ``*_hit`` function is the vectorised equivalent of one vLLM single-type manager's
``find_longest_cache_hit`` applied to a boolean presence array indexed by chunk;
:func:`longest_hit` is the store coordinator's convergence loop over merged spec-groups.

Presence may be partly unknown (the coordinator probes in rounds). Then ``present`` is the
optimistic view (unknown counts as present) and ``known`` marks what was answered; each
function also returns the unknown chunks its answer depends on. Every rule here is monotone in
presence, so when no answer depends on an unknown chunk, the optimistic answer is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._arrays import BoolArray, IntArray
from .._errors import InvalidRequest
from .._layout.geometry import Geometry
from .._layout.groups import (
    ChunkedLocalAttention,
    FullAttention,
    Mamba,
    SlidingWindow,
    SpecGroup,
    window_blocks,
)

__all__ = ["HitSearch", "longest_hit"]

_NONE = np.zeros(0, dtype=np.int64)


def _leading_true(present: BoolArray) -> int:
    """How many chunks from 0 on are present."""
    if present.size == 0:
        return 0
    first_miss = int(np.argmin(present))
    return present.size if present[first_miss] else first_miss


def _align_down(num_blocks: int, block_size: int, alignment: int) -> int:
    """vLLM pops blocks until ``blocks * block_size`` is a multiple of ``alignment``."""
    if block_size == alignment:
        return num_blocks
    while num_blocks > 0 and (num_blocks * block_size) % alignment:
        num_blocks -= 1
    return num_blocks


def _too_few_hashes(kind: str, needed: int, present: BoolArray) -> None:
    """vLLM's managers index the chunk hashes directly: past the end is an IndexError there."""
    if needed > present.size:
        raise InvalidRequest(
            f"too few block hashes: the {kind} hit search reads chunk {needed - 1} but only "
            f"{present.size} are hashed (vLLM 0.26 raises IndexError here)"
        )


def _unknown(known: BoolArray | None, start: int, stop: int) -> IntArray:
    """Chunks in [start, stop) whose presence is not known yet."""
    if known is None or stop <= start:
        return _NONE
    return np.flatnonzero(~known[start:stop]) + start


def full_attention_hit(
    present: BoolArray, known: BoolArray | None, block_size: int, max_length: int,
    alignment: int, drop_eagle: bool,
) -> tuple[int, IntArray]:
    """First-miss prefix; EAGLE drops the last block; then align down."""
    blocks = _leading_true(present[: max_length // block_size])
    depends = _unknown(known, 0, blocks)
    return full_attention_prefix_hit(blocks, block_size, alignment, drop_eagle), depends


def full_attention_prefix_hit(
    blocks: int, block_size: int, alignment: int, drop_eagle: bool
) -> int:
    """Full attention's hit from its leading present blocks: EAGLE drops one, then align."""
    if drop_eagle and blocks:
        blocks -= 1
    return _align_down(blocks, block_size, alignment) * block_size


def sliding_window_hit(
    present: BoolArray, known: BoolArray | None, spec: SlidingWindow, max_length: int,
    alignment: int, drop_eagle: bool,
) -> tuple[int, IntArray]:
    """The rightmost run of ``need`` present blocks opened at an aligned right edge.

    vLLM scans down from the last block; while no run is open, a present block only opens one
    if its right edge (its left edge with EAGLE, i.e. after the EAGLE pop) is aligned. With no
    full run, the run touching block 0 counts, aligned down.
    """
    block_size = spec.block_size
    num_blocks = max_length // block_size
    _too_few_hashes("sliding-window", num_blocks, present)
    window = present[:num_blocks]
    need = max(window_blocks(spec, drop_eagle), 1)  # vLLM tests `run >= need` after +1
    step, top = _top_opener(num_blocks, block_size, alignment, drop_eagle)
    blocks = -1
    depends = _NONE
    if window.size and top >= need - 1:
        opener = None
        at = top
        for _ in range(_SCALAR_TESTS):  # the usual answer: the top window, or one near it
            if at < need - 1:
                break
            if window[at + 1 - need : at + 1].all():
                opener = at
                break
            at -= step
        else:
            if at >= need - 1:
                candidates = np.arange(at, need - 2, -step, dtype=np.int64)
                opener = _first_full_run(window, candidates, need)
        if opener is not None:
            blocks = opener + 1
            depends = _unknown(known, opener + 1 - need, opener + 1)
    if blocks < 0:  # no full run: the run the scan was counting when it reached block 0
        leading = _leading_true(window)
        depends = _unknown(known, 0, leading)
        below = top if top < leading else top - ((top - leading) // step + 1) * step
        blocks = _align_down(below + 1 if below >= 0 else 0, block_size, alignment)
    if drop_eagle and blocks:
        blocks = _align_down(blocks - 1, block_size, alignment)
    return blocks * block_size, depends


def _first_full_run(window: BoolArray, candidates: IntArray, need: int) -> int | None:
    """The first of the ``candidates`` (descending block indices) whose ``need`` blocks up to
    it are all present, or None. Candidates are tested from the top in batches growing
    eightfold: the usual answer (the top one, or one near it) costs a few dozen elements,
    not a pass over the window."""
    start, batch = 0, 4
    steps = np.arange(need)[None, :]
    counts = None
    while start < candidates.size:
        part = candidates[start : start + batch]
        if counts is None and part.size * need > window.size:  # cheaper by prefix sums
            counts = np.concatenate(([0], np.cumsum(window, dtype=np.int64)))
        if counts is None:
            full = window[part[:, None] - steps].all(axis=1)
        else:
            full = (counts[part + 1] - counts[part + 1 - need]) == need
        if full.any():
            return int(part[int(np.argmax(full))])
        start += batch
        batch *= 8
    return None


_SCALAR_TESTS = 4
"""Candidate windows :func:`sliding_window_hit` tests one by one before testing the rest in
batches (one numpy call each beats a batch's several for the first few)."""


def _top_opener(
    num_blocks: int, block_size: int, alignment: int, drop_eagle: bool
) -> tuple[int, int]:
    """The blocks that may open a run are ``top, top - step, ...`` down to 0 (none when
    ``top`` < 0): those whose right edge (left edge with EAGLE) is a multiple of
    ``alignment`` (always a multiple of the block size here). Returns ``(step, top)``."""
    step = alignment // block_size
    if num_blocks <= 0:
        return step, -1
    if step == 1:
        return step, num_blocks - 1
    return step, (num_blocks - 1) // step * step if drop_eagle else num_blocks // step * step - 1


def chunked_local_hit(
    present: BoolArray, known: BoolArray | None, spec: ChunkedLocalAttention, max_length: int,
) -> tuple[int, IntArray]:
    """Blocks before the current attention chunk count unchecked; from the chunk's first
    block on, present blocks count until the first miss (vLLM asserts no EAGLE and
    block_size == alignment, which :func:`build_plan` checks up front)."""
    block_size = spec.block_size
    num_blocks = max_length // block_size
    chunk = spec.attention_chunk_size
    start_block = (max_length // chunk * chunk) // block_size
    run = _leading_true(present[start_block:num_blocks])
    if start_block + run < num_blocks:
        _too_few_hashes("chunked-local", start_block + run + 1, present)
    return (start_block + run) * block_size, _unknown(known, start_block, start_block + run)


def mamba_hit(
    present: BoolArray, known: BoolArray | None, block_size: int, max_length: int, alignment: int
) -> tuple[int, IntArray]:
    """The rightmost present block whose end is aligned (vLLM 0.26 ignores EAGLE here)."""
    _too_few_hashes("mamba", max_length // block_size, present)
    idx = np.flatnonzero(present[: max_length // block_size])
    if idx.size and block_size != alignment:
        idx = idx[((idx + 1) * block_size) % alignment == 0]
    if not idx.size:
        return 0, _NONE
    last = int(idx[-1])
    return (last + 1) * block_size, _unknown(known, last, last + 1)


def spec_group_hit(
    sg: SpecGroup, present: BoolArray, known: BoolArray | None, max_length: int,
    alignment: int, drop_eagle: bool,
) -> tuple[int, IntArray]:
    """One merged spec-group's hit for ``max_length`` tokens, and the unknowns it rests on."""
    spec = sg.spec
    if isinstance(spec, FullAttention):
        return full_attention_hit(
            present, known, spec.block_size, max_length, alignment, drop_eagle
        )
    if isinstance(spec, SlidingWindow):
        return sliding_window_hit(present, known, spec, max_length, alignment, drop_eagle)
    if isinstance(spec, ChunkedLocalAttention):
        return chunked_local_hit(present, known, spec, max_length)
    assert isinstance(spec, Mamba)
    return mamba_hit(present, known, spec.block_size, max_length, alignment)


@dataclass(slots=True)
class HitSearch:
    """The outcome of :func:`longest_hit`: the hit, and per spec-group the unknown chunks it
    depends on (all empty when presence was fully known: the hit is then exact)."""

    hit: int
    depends: list[IntArray]

    @property
    def exact(self) -> bool:
        return not any(d.size for d in self.depends)


def longest_hit(
    layout: Geometry,
    token_len: int,
    presence: Sequence[BoolArray],
    known: Sequence[BoolArray] | None = None,
) -> HitSearch:
    """vLLM's hit for ``token_len`` tokens given one presence array per spec-group.

    One spec-group: its manager, aligned to its own block size. Several: full attention first,
    evaluated once; each EAGLE spec-group drops one block, looking one block past the running
    length, until a non-dropping group lowers the length (then every group owes its drop
    again); passes repeat until the length stops falling, or once for a full+other hybrid.
    """
    spec_groups = layout.spec_groups
    count = len(spec_groups)
    depends: list[IntArray] = [_NONE] * count

    def note(i: int, found: IntArray) -> None:
        if found.size:
            depends[i] = np.union1d(depends[i], found) if depends[i].size else found

    def known_of(i: int) -> BoolArray | None:
        return None if known is None else known[i]

    if count == 1:
        sg = spec_groups[0]
        hit, found = spec_group_hit(
            sg, presence[0], known_of(0), token_len, sg.spec.block_size, sg.drop_eagle
        )
        note(0, found)
        return HitSearch(hit, depends)
    alignment = layout.scheduler_block_size
    hit = token_len
    full_hits: dict[int, int] = {}
    verified: set[int] = set()
    while True:
        cur = hit
        for i, sg in enumerate(spec_groups):
            if i in full_hits:
                cur = min(cur, full_hits[i])
                continue
            drop = sg.drop_eagle and i not in verified
            max_length = min(cur + sg.spec.block_size, token_len) if drop else cur
            new, found = spec_group_hit(sg, presence[i], known_of(i), max_length, alignment, drop)
            note(i, found)
            if drop:
                verified.add(i)
            elif new < cur:
                verified.clear()
            cur = new
            if isinstance(sg.spec, FullAttention):
                full_hits[i] = cur
        if cur >= hit:
            break
        hit = cur
        if not layout.multi_pass:
            break
    return HitSearch(hit, depends)
