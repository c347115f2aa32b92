"""Plan: one request's candidate keys (vLLM's order) and how to resolve the store's answers.

Planning never touches a hash it does not need: probe targets pick chunk indices first, then
only those hashes are gathered (``hashes``), hex-encoded in one C call and glued to
precomputed key prefixes (``keys``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._arrays import BoolArray, IntArray, KeyIndices
from .._checks import integer
from .._errors import InvalidRequest
from .._layout.geometry import Geometry
from .._layout.groups import ChunkedLocalAttention
from .._resolve.answers import leading_present, present_keys
from .._resolve.hits import full_attention_prefix_hit
from .._resolve.presence import resolve_present
from .._resolve.result import LookupResult
from .hashes import RequestHashes
from .keys import ITEM_END, assemble, assemble_items, assemble_range, build_key_array, one_key
from .probe import GroupProbe
from .targets import probe_targets

__all__ = ["LookupPlan", "build_plan"]


class LookupPlan:
    """The keys one lookup probes, and :meth:`resolve` to turn the answers into a hit length.

    ``keys`` are ASCII ``bytes`` (Mooncake's ``batch_is_exist`` takes them as they are),
    byte-identical to vLLM 0.26's candidate keys and in its order: group-major, then chunk,
    then rank namespace. They are assembled on first access.
    """

    __slots__ = (
        "_groups", "_key_array", "_key_array_tried", "_keys", "_short", "geometry", "num_keys",
        "token_len",
    )

    def __init__(
        self,
        geometry: Geometry,
        token_len: int,
        groups: tuple[GroupProbe, ...],
        num_keys: int,
        short: bool | None = None,
    ) -> None:
        self.geometry = geometry
        self.token_len = token_len
        self._groups = groups
        self.num_keys = num_keys
        self._keys: list[bytes] | None = None
        self._key_array: npt.NDArray[np.bytes_] | None = None
        self._key_array_tried = False
        self._short = short

    @property
    def keys(self) -> list[bytes]:
        """The candidate keys (a shared list: do not mutate)."""
        if self._keys is None:
            array = self.key_array()
            if array is not None:
                keys: list[bytes] = array.tolist()
            else:  # keys of different widths: group by group
                keys = []
                for probe in self._groups:
                    keys.extend(assemble(self.geometry, probe, None))
            self._keys = keys
        return self._keys

    def key_array(self) -> npt.NDArray[np.bytes_] | None:
        """Every key in one fixed-width ``bytes`` array, built once, or None when the keys
        differ in width. :meth:`_keys_at` then slices it: a caller that keeps a plan alive
        while it works (the coordinator) holds no Python object per key, which the garbage
        collector would otherwise walk through at every collection."""
        if not self._key_array_tried:
            self._key_array_tried = True
            self._key_array = build_key_array(self.geometry, self._groups, self.num_keys)
        return self._key_array


    @property
    def needs_preparing(self) -> bool:
        """Work is left before probing (:meth:`prepare`), which the coordinator runs off its
        event loop where it can (:meth:`native_job`)."""
        return False

    def native_job(self) -> object | None:
        """That work as a native job (``_native_job.h``) for the coordinator's worker thread,
        or None: :meth:`prepare` then does all of it."""
        return None

    @property
    def quick_to_prepare(self) -> bool:
        """That work is bounded small enough (a fraction of a millisecond) to do inline when
        the coordinator has nothing else under way."""
        return True

    def prepare(self, job: object | None = None) -> None:
        """Finish that work: from the :meth:`native_job` the worker ran, or all of it now."""

    @property
    def groups(self) -> tuple[GroupProbe, ...]:
        """Per-group probe details."""
        return self._groups

    def __len__(self) -> int:
        return self.num_keys

    @property
    def probe_in_one_round(self) -> bool:
        """Rounds cannot help: some group has fewer hashes than token_len needs (vLLM's own
        answer may then be an error), or hashes repeat where the hit search infers presence
        across chunks. A lone full-attention group probes its prefix in order, where a
        repeated key simply gets the same answer again: repeats do not matter there."""
        if self.short:
            return True
        if self.single_full_attention:
            return False
        return any(p.shares_hashes for p in self._groups)

    def _key_span(self, probe: GroupProbe) -> range:
        """Every key index of one group."""
        k = len(self.geometry.prefix_bytes[probe.group_id])
        return range(probe.key_offset, probe.key_offset + probe.chunks.size * k)

    @property
    def short(self) -> bool:
        """Fewer hashes than ``token_len`` needs in some group (vLLM truncates, or raises)."""
        if self._short is None:
            groups = self.geometry.groups
            self._short = any(
                p.limit < self.token_len // groups[p.group_id].block_size for p in self._groups
            )
        return self._short

    def __repr__(self) -> str:
        return f"<LookupPlan token_len={self.token_len} keys={self.num_keys}>"

    def _keys_at(self, indices: KeyIndices) -> list[bytes]:
        """The keys at ascending key indices (without assembling the others)."""
        if self._keys is not None:
            if isinstance(indices, range):
                return self._keys[indices.start : indices.stop]
            return [self._keys[i] for i in indices.tolist()]
        if self._key_array is not None:
            if isinstance(indices, range):
                picked: list[bytes] = self._key_array[indices.start : indices.stop].tolist()
            else:
                picked = self._key_array[indices].tolist()
            return picked
        groups = self._groups
        if len(groups) == 1:  # key indices are the group's own (its offset is 0)
            if isinstance(indices, range):
                if len(indices) == 1:  # (the usual round of a cached prompt: the likely miss)
                    return [one_key(self.geometry, groups[0], indices.start)]
                return assemble_range(self.geometry, groups[0], indices.start, indices.stop)
            return assemble(self.geometry, groups[0], indices)
        out: list[bytes] = []
        flat = None if isinstance(indices, range) else indices.tolist()  # (a round's few
        # dozen indices: Python ints beat numpy's cost per call)
        for probe in self._groups:  # (each group with its own namespace count)
            span = self._key_span(probe)
            base = probe.key_offset
            if flat is None:
                assert isinstance(indices, range)
                lo, hi = max(indices.start, span.start), min(indices.stop, span.stop)
                if hi > lo:
                    out.extend(assemble_range(self.geometry, probe, lo - base, hi - base))
                continue
            lo, hi = bisect_left(flat, span.start), bisect_left(flat, span.stop)
            if hi > lo:
                out.extend(assemble(self.geometry, probe, [i - base for i in flat[lo:hi]]))
        return out

    @property
    def _chunk_keys(self) -> int:
        """Keys per chunk when the coordinator may track this plan's chunks as *items* (one
        ``bytes`` per chunk: :meth:`_items_at`), else 1: every group with one namespace count
        above 1, keys of one width."""
        geometry = self.geometry
        counts = {len(geometry.prefix_bytes[p.group_id]) for p in self._groups}
        if len(counts) != 1:
            return 1
        k = counts.pop()
        if k < 2:
            return 1
        for probe in self._groups:
            gid = probe.group_id
            if (
                probe.hash_rows is None
                or geometry.prefix_rows[gid] is None
                or any(ITEM_END in prefix for prefix in geometry.prefix_bytes[gid])
            ):
                return 1
        return k

    def _items_at(self, indices: KeyIndices) -> list[bytes]:
        """The items (see :func:`assemble_items`) of the chunks that ascending key indices
        cover whole, group by group, in a plan whose :attr:`_chunk_keys` is above 1."""
        k = len(self.geometry.prefix_bytes[self._groups[0].group_id])
        out: list[bytes] = []
        flat = None if isinstance(indices, range) else indices.tolist()  # (a round's few
        # dozen indices: Python ints beat numpy's cost per call)
        for probe in self._groups:
            offset = probe.key_offset
            end = offset + probe.chunks.size * k
            if flat is None:
                assert isinstance(indices, range)
                lo, hi = max(indices.start, offset), min(indices.stop, end)
                if hi > lo:
                    chunks: range | list[int] = range((lo - offset) // k, (hi - offset) // k)
                    out.extend(assemble_items(self.geometry, probe, chunks))
                continue
            lo, hi = bisect_left(flat, offset), bisect_left(flat, end)
            if hi > lo:
                chunks = [(i - offset) // k for i in flat[lo:hi:k]]
                out.extend(assemble_items(self.geometry, probe, chunks))
        return out

    def resolve_result(self, exists: Sequence[int] | npt.NDArray[Any] | None) -> LookupResult:
        """vLLM's lookup result from the store's per-key answers (``None``: ``batch_is_exist``
        raised, and vLLM answers 0). vLLM 0.26 has no tail-key boundaries: the result carries
        none, and its :meth:`~LookupResult.to_bytes` is 0.26's 4-byte reply."""
        if exists is None:
            return LookupResult(0)
        return LookupResult(self.resolve(exists))

    def _resolve_present_result(self, present: BoolArray) -> LookupResult:
        """:meth:`resolve_result` from one boolean per key."""
        return LookupResult(self._resolve_present(present))

    def result_for_hit(self, hit: int) -> LookupResult:
        """The result of a settled probe whose hit is ``hit`` (0.26: the hit alone)."""
        return LookupResult(hit)

    def resolve(self, exists: Sequence[int] | npt.NDArray[Any]) -> int:
        """The prefix hit in tokens from the store's per-key answers (``plan.keys`` order).

        Only ``1`` means present; ``0``, ``-1``, ``-900`` or anything else means absent.
        """
        if not self.num_keys:
            return 0
        if self.single_full_attention and len(self.geometry.namespaces) == 1 and not self.short:
            hit = self._resolve_prefix(exists)
            if hit is not None:
                return hit
        return self._resolve_present(self.present_keys(exists))

    @property
    def single_full_attention(self) -> bool:
        """One full-attention group: its hit is the run of present chunks from the first."""
        return self.geometry.lone_full_attention and len(self._groups) == 1

    def prefix_hit(self, chunks: int) -> int:
        """The hit of a :attr:`single_full_attention` plan whose first ``chunks`` chunks are
        present and the next one (if any) absent."""
        sg = self.geometry.spec_groups[0]
        block = sg.spec.block_size  # a lone spec-group aligns to its own block size
        return full_attention_prefix_hit(chunks, block, block, sg.drop_eagle)


    def present_keys(self, exists: Sequence[int] | npt.NDArray[Any]) -> BoolArray:
        """vLLM's rule per key: only the value ``1`` means present."""
        return present_keys(exists, self.num_keys)

    def _resolve_present(self, present: BoolArray) -> int:
        """:meth:`resolve` from one boolean per key."""
        if not self.num_keys:
            return 0
        return resolve_present(self.geometry, self.token_len, self._groups, present)

    def _resolve_prefix(self, exists: Sequence[int] | npt.NDArray[Any]) -> int | None:
        """:meth:`resolve` for a single full-attention group in one namespace, without a
        per-key array; None when the general path must decide (odd input, or a missing hash
        that repeats)."""
        n = self.num_keys
        run = leading_present(exists, n)
        if run is None:
            return None
        if run < n:
            keys = self._keys
            repeats = (
                keys.count(keys[run]) > 1 if keys is not None
                else self._groups[0].hash_ids is not None
            )
            if repeats:  # presence is per hash: another copy may be present
                return None
        return self.prefix_hit(run)


_NOT_READ: tuple[npt.NDArray[np.uint8] | None, list[bytes]] = (None, [])
"""Placeholder in build_plan for a group whose rows come from another group's."""
_LATER: tuple[npt.NDArray[np.uint8] | None, list[bytes]] = (None, [])
"""Placeholder in build_plan for a group whose rows are read when needed (its gather)."""


def build_plan(layout: Geometry, token_len: object, block_hashes: object) -> LookupPlan:
    """Validate one request and build its :class:`LookupPlan` (see :meth:`KVLayout.plan`);
    ``block_hashes`` may come read already (a :class:`RequestHashes`)."""
    tokens = integer("token_len", token_len)
    hashes = (
        block_hashes if type(block_hashes) is RequestHashes else RequestHashes(block_hashes)
    )
    if tokens <= 0 or hashes.count == 0:
        return LookupPlan(layout, tokens, (), 0)
    sched = layout.scheduler_block_size
    if tokens % sched:
        raise InvalidRequest(
            f"token_len={tokens} must be a multiple of scheduler_block_size={sched} "
            "(use layout.align(num_tokens))",
            field="token_len",
        )
    h = layout.hash_block_size
    if not layout.has_full_attention and hashes.count < tokens // h:
        raise InvalidRequest(
            f"block_hashes has {hashes.count} hashes but token_len={tokens} needs "
            f"{tokens // h} (hash_block_size={h}) for a layout without full attention",
            field="block_hashes",
        )
    probes: list[GroupProbe] = []
    offset = 0
    # Where the hit search may read a chunk the mask left unprobed (a lone spec-group aligns to
    # its own block; EAGLE groups re-run without their drop on a second pass), an unprobed
    # chunk whose hash equals a probed one counts as that one (vLLM keys presence by hash).
    reads_unprobed = len(layout.spec_groups) == 1 or (layout.use_eagle and layout.multi_pass)
    count = hashes.count
    short = False
    bounds = []  # per group: how many chunks exist for this request
    for block in layout.block_sizes:  # (loops, not comprehensions: this runs per lookup)
        limit = min(count // (block // h), tokens // block)
        short = short or limit < tokens // block
        bounds.append(limit)
    limits = tuple(bounds)
    targets = probe_targets(layout, tokens, limits)
    # Groups read on their own first; then those whose hashes are all among a source's rows.
    # The hashes an immutable array holds at an index array are read later, when needed
    # (GroupProbe's gather): a round builds a few keys of groups of thousands of chunks.
    gathered = []
    subsets = False
    for target in targets:
        if target.source is not None:
            gathered.append(_NOT_READ)
            subsets = True
        elif not isinstance(target.units, slice) and hashes.immutable_array:
            gathered.append(_LATER)
        else:
            gathered.append(hashes.gather(target.units, target.period))
    if subsets:
        for gid, target in enumerate(targets):
            if target.source is not None:
                rows_of_source = gathered[target.source]
                if rows_of_source is _LATER:
                    gathered[gid] = (
                        _LATER if not isinstance(target.units, slice)
                        else hashes.gather(target.units, target.period)
                    )
                elif rows_of_source[0] is not None:  # (mixed widths: read on its own)
                    assert target.positions is not None
                    gathered[gid] = rows_of_source[0].take(target.positions, axis=0), []
                else:
                    gathered[gid] = hashes.gather(target.units, target.period)
    for gid, (spec, limit, target) in enumerate(zip(layout.groups, limits, targets)):
        stride = spec.block_size // h
        chunks = target.chunks
        later = None
        rows, items = gathered[gid]
        if gathered[gid] is _LATER:
            units = target.units
            assert hashes.array is not None and not isinstance(units, slice)
            later = (hashes.array, units)
        unprobed_ids = None
        if reads_unprobed and 0 < chunks.size < limit and hashes.has_duplicates():
            if later is not None:  # (read now after all)
                rows, later = later[0].take(later[1], axis=0), None
            unprobed_ids = _unprobed_ids(hashes, stride, limit, chunks, rows, items)
        probes.append(
            GroupProbe(
                group_id=gid,
                chunks=chunks,
                limit=limit,
                key_offset=offset,
                hex_items=[it.hex().encode() for it in items] if items else [],
                hash_rows=rows,
                unprobed_ids=unprobed_ids,
                gather=later,
            )
        )
        offset += chunks.size * len(layout.namespaces)
    if subsets:  # rows taken from a source's: its verdict on repeated hashes holds for them
        for gid, target in enumerate(targets):
            if target.source is not None and probes[target.source].has_rows:
                probes[gid].subset_of = probes[target.source]
    if offset and layout.has_chunked_local:
        _check_supported(layout)
    return LookupPlan(layout, tokens, tuple(probes), offset, short)


def _check_supported(layout: Geometry) -> None:
    """vLLM 0.26 asserts on these when a lookup reaches the chunked-local manager."""
    for i, spec in enumerate(layout.groups):
        if not isinstance(spec, ChunkedLocalAttention):
            continue
        if layout.use_eagle:
            raise InvalidRequest(
                f"groups[{i}] is chunked_local and use_eagle is set: vLLM 0.26 asserts "
                "chunked local attention has no EAGLE"
            )
        if len(layout.spec_groups) > 1 and spec.block_size != layout.scheduler_block_size:
            raise InvalidRequest(
                f"groups[{i}] is chunked_local with block_size={spec.block_size} in a hybrid "
                f"layout: vLLM 0.26 asserts it equals scheduler_block_size="
                f"{layout.scheduler_block_size}"
            )


def _unprobed_ids(
    hashes: RequestHashes,
    stride: int,
    limit: int,
    probed_chunks: IntArray,
    rows: npt.NDArray[np.uint8] | None,
    items: list[bytes],
) -> IntArray | None:
    """For every chunk < limit: the index of a probed chunk with the same hash, else -1."""
    probed = [bytes(r) for r in rows] if rows is not None else items
    index: dict[bytes, int] = {}
    for j, hsh in enumerate(probed):
        index.setdefault(hsh, j)
    all_units = np.arange(limit, dtype=np.int64) * stride + (stride - 1)
    every_rows, every_items = hashes.gather(all_units)
    every = [bytes(r) for r in every_rows] if every_rows is not None else every_items
    ids = np.array([index.get(hsh, -1) for hsh in every], dtype=np.int64)
    ids[probed_chunks] = -1
    return ids if (ids >= 0).any() else None
