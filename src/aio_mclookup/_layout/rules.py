"""vLLM 0.32 / 0.33 lookup rules of a layout, derived once: which groups the store sees, the
coverage spec of each, merged spec-groups, EAGLE and the lookup alignment.

Private to the package: a :class:`~aio_mclookup.KVLayout` of release 0.32 or 0.33 builds one
and hands it, inside its geometry, to the planner and the resolver.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from .groups import ChunkedLocalAttention, FullAttention, GroupSpec, Mamba, SlidingWindow

__all__ = ["EraCRules", "EraCSpecGroup", "coverage_spec"]


@dataclass(frozen=True, slots=True)
class EraCSpecGroup:
    """Store groups with equal coverage specs: a hash counts as present for the spec-group
    only if it is present in every member."""

    spec: GroupSpec
    """The coverage spec (window widened by ``extra_retained_tokens`` on 0.33)."""
    group_ids: tuple[int, ...]
    eagle: bool

    @property
    def full_attention(self) -> bool:
        return isinstance(self.spec, FullAttention)

    @property
    def mamba(self) -> bool:
        return isinstance(self.spec, Mamba)


def coverage_spec(spec: GroupSpec, widen: bool) -> GroupSpec:
    """The spec the store coordinator merges, masks and searches with: flags cleared; on 0.33
    a sliding window retaining ``e`` extra tokens covers ``W + e`` (and then equals a plain
    window of that size); 0.32 keeps the window (and ``e`` tells specs apart)."""
    if isinstance(spec, SlidingWindow) and widen and spec.extra_retained_tokens:
        return SlidingWindow(
            spec.block_size, spec.sliding_window + spec.extra_retained_tokens, mla=spec.mla
        )
    return dataclasses.replace(spec, eagle=False)


class EraCRules:
    """A 0.32 / 0.33 layout's lookup rules, for its prefix-cacheable ("store") groups."""

    __slots__ = (
        "alignment",
        "coverage",
        "fine",
        "keys_as_026",
        "mask_eagle",
        "multi_pass",
        "search_codes",
        "spec_groups",
        "store_ids",
        "version",
    )

    def __init__(
        self,
        version: str,
        store_groups: Sequence[GroupSpec],
        store_ids: tuple[int | None, ...],
        *,
        hash_block_size: int,
        scheduler_block_size: int,
        use_eagle: bool,
        fine: bool,
    ) -> None:
        self.version = version
        self.keys_as_026: bool | None = None
        """Whether the planner may build this layout's probes as 0.26's (set by it)."""
        self.search_codes: bytes | None = None
        """These rules as the compiled hit search reads them (set by the resolver)."""
        self.store_ids = store_ids
        """Per layout group: its store group id, or None when it is not prefix-cacheable."""
        self.fine = fine
        """Fine-grained (partial hash hit) mode: every alignment is the hash block."""
        self.alignment = hash_block_size if fine else scheduler_block_size
        widen = version == "0.33.0"
        self.coverage: tuple[GroupSpec, ...] = tuple(coverage_spec(g, widen) for g in store_groups)
        merged: dict[GroupSpec, list[int]] = {}
        for gid, spec in enumerate(self.coverage):
            merged.setdefault(spec, []).append(gid)
        ordered = sorted(merged.items(), key=lambda item: not isinstance(item[0], FullAttention))
        flagged = {gid for gid, g in enumerate(store_groups) if g.eagle}
        self.spec_groups: tuple[EraCSpecGroup, ...] = tuple(
            EraCSpecGroup(
                spec,
                tuple(ids),
                bool(flagged.intersection(ids)) if flagged else use_eagle,
            )
            for spec, ids in ordered
        )
        eagle_ids = {gid for sg in self.spec_groups if sg.eagle for gid in sg.group_ids}
        self.mask_eagle: tuple[bool, ...] = tuple(
            gid in eagle_ids for gid in range(len(store_groups))
        )
        """Per store group: EAGLE-shifted lookup mask (every member of an EAGLE spec-group)."""
        self.multi_pass = len(self.spec_groups) > 2 or (
            len(self.spec_groups) == 2 and not self.spec_groups[0].full_attention
        )
        """vLLM's convergence loop repeats unless there is one spec-group, or exactly two with
        full attention first (the "simple hybrid")."""

    @property
    def has_chunked_local(self) -> bool:
        return any(isinstance(sg.spec, ChunkedLocalAttention) for sg in self.spec_groups)
