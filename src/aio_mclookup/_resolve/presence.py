"""From per-key presence to per-chunk presence (vLLM keys presence by hash) and merged
spec-groups, then to the hit."""

from __future__ import annotations

import numpy as np

from .._arrays import BoolArray
from .._layout.geometry import Geometry
from .._plan.probe import GroupProbe
from .hits import longest_hit

__all__ = ["chunk_presence", "merge", "resolve_present"]


def resolve_present(
    geometry: Geometry, token_len: int, groups: tuple[GroupProbe, ...], present_keys: BoolArray
) -> int:
    """The hit from one boolean per key of a plan (its groups' probes, in key order)."""
    k = len(geometry.namespaces)
    per_group: list[BoolArray] = []
    for probe in groups:
        n = probe.chunks.size
        answers = present_keys[probe.key_offset : probe.key_offset + n * k]
        probed: BoolArray = answers.reshape(n, k).all(axis=1) if k > 1 else answers  # type: ignore[assignment]
        per_group.append(chunk_presence(probe, probed))
    return longest_hit(geometry, token_len, merge(geometry, per_group)).hit


def merge(geometry: Geometry, per_group: list[BoolArray]) -> list[BoolArray]:
    """Per spec-group presence: a chunk must be present in every member group."""
    presence: list[BoolArray] = []
    for sg in geometry.spec_groups:
        arr = per_group[sg.group_ids[0]]
        for gid in sg.group_ids[1:]:
            arr = arr & per_group[gid]
        presence.append(arr)
    return presence


def chunk_presence(probe: GroupProbe, probed: BoolArray) -> BoolArray:
    """Presence of every chunk < limit: vLLM records presence per (group, hash bytes)."""
    if probe.hash_ids is not None:
        by_id = np.zeros(int(probe.hash_ids.max()) + 1, dtype=bool)
        np.logical_or.at(by_id, probe.hash_ids, probed)
        probed = by_id[probe.hash_ids]
    if probe.unprobed_ids is not None:
        present_ids = np.zeros(probe.chunks.size + 1, dtype=bool)
        present_ids[: probe.chunks.size] = probed
        out = present_ids[probe.unprobed_ids]  # -1 picks the trailing False
        out[probe.chunks] = probed
        return out
    if probe.dense:
        return probed
    out = np.zeros(probe.limit, dtype=bool)
    out[probe.chunks] = probed
    return out
