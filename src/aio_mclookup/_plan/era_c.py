"""Planning with vLLM 0.32 / 0.33's rules: the store's (prefix-cacheable) groups, each with
its own namespaces; block-aligned masks from each group's coverage spec, or in fine-grained
mode every hash unit; keys assembled by the same vectorised code as 0.26's plans."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._arrays import BoolArray, IntArray
from .._checks import integer
from .._layout.geometry import Geometry
from .._layout.groups import SlidingWindow, window_blocks
from .._resolve.answers import present_keys
from .._resolve.era_c import era_c_result, lone_full_attention_hit
from .._resolve.result import LookupResult, TailKeyBoundary
from .hashes import RequestHashes
from .plan import LookupPlan, build_plan
from .probe import _REPEATS, GroupProbe, duplicate_ids  # (_REPEATS: its jobs, see native_job)

__all__ = ["EraCPlan", "build_era_c_plan"]


class EraCPlan(LookupPlan):
    """A vLLM 0.32 / 0.33 lookup plan: ``keys`` in vLLM's order (group-major over the store
    groups, then chunk or hash unit, then that group's namespaces), and
    :meth:`resolve_result` for vLLM's :class:`LookupResult`.

    ``token_len`` is the aligned lookup length, ``num_tokens`` the request's length as
    given to :meth:`KVLayout.plan`.
    """

    __slots__ = ("_hash_count", "_hash_ids", "_hash_source", "_lone", "_units", "num_tokens")

    def __init__(
        self,
        geometry: Geometry,
        token_len: int,
        num_tokens: int,
        groups: tuple[GroupProbe, ...],
        num_keys: int,
        units: tuple[IntArray, ...] = (),
        hash_count: int = 0,
        hash_source: RequestHashes | None = None,
        short: bool | None = None,
    ) -> None:
        super().__init__(geometry, token_len, groups, num_keys, short)
        rules = geometry.rules
        assert rules is not None
        self._lone = geometry.lone_full_attention and len(groups) == 1 and not rules.fine
        """:attr:`single_full_attention` (read several times per lookup: found once)."""
        self.num_tokens = num_tokens
        self._units = units
        """Per store group: the hash index of each probed chunk (or unit)."""
        self._hash_count = hash_count
        self._hash_ids: IntArray | None = None
        self._hash_source: RequestHashes | None = None
        """The hashes (a snapshot) until :attr:`hash_ids` reads them: a lone full-attention
        plan, probed in rounds as a prefix, never needs them; another plan does, at once
        unless its hashes are an immutable array of at least :data:`_PREPARED_HASHES` rows
        (then :meth:`prepare` finds them, on the coordinator's worker thread)."""
        if hash_source is not None:
            if self.single_full_attention:
                self._hash_source = hash_source.snapshot()
            elif hash_source.count >= _PREPARED_HASHES and hash_source.immutable_array:
                self._hash_source = hash_source
            else:
                self._hash_ids = _hash_ids(hash_source)

    @property
    def needs_preparing(self) -> bool:
        return self._hash_source is not None and not self._lone

    @property
    def quick_to_prepare(self) -> bool:
        source = self._hash_source
        return source is None or source.count <= _QUICK_HASHES

    def native_job(self) -> object | None:
        """The repeated-hash test of the hashes as a native job (``_repeats_c``)."""
        source = self._hash_source
        if _REPEATS is None or source is None or self._lone:
            return None
        try:
            job: object = _REPEATS.test_job(source.array)
        except ValueError:  # (rows it does not read: a reversed or column-strided view)
            return None
        return job

    def prepare(self, job: object | None = None) -> None:
        """Find :attr:`hash_ids`, from the verdict of the test ``job`` where it gave one (the
        test is not run again here)."""
        self._find_hash_ids(None if job is None else _REPEATS.verdict(job))

    @property
    def hash_ids(self) -> IntArray | None:
        """Ids of the request's hashes, equal exactly where hashes repeat (None: none do)."""
        self._find_hash_ids(None)
        return self._hash_ids

    def _find_hash_ids(self, repeats: bool | None) -> None:
        """Compute :attr:`hash_ids` once, given whether the hashes repeat where a test said
        so (None: test them here)."""
        source = self._hash_source  # (read once: another thread may clear it meanwhile)
        if source is not None:
            self._hash_ids = None if repeats is False else _hash_ids(source, repeats)
            self._hash_source = None

    # ------------------------------------------------------------------------- structure
    @property
    def single_full_attention(self) -> bool:
        return self._lone

    @property
    def probe_in_one_round(self) -> bool:
        """Rounds cannot follow vLLM 0.32 / 0.33: some group has fewer hashes than the
        length needs (vLLM may then raise), or hashes repeat in a plan that is not a lone
        full-attention prefix (vLLM keys presence by hash: a repeat elsewhere counts)."""
        if self.short:
            return True
        return not self.single_full_attention and self.hash_ids is not None

    @property
    def short(self) -> bool:
        if self._short is None:
            self._short = any(
                p.limit < self.token_len // self.geometry.groups[p.group_id].block_size
                for p in self._groups
            )
        return self._short

    def __repr__(self) -> str:
        return (
            f"<LookupPlan vllm {self.geometry.rules.version if self.geometry.rules else '?'} "
            f"num_tokens={self.num_tokens} token_len={self.token_len} keys={self.num_keys}>"
        )

    # --------------------------------------------------------------------------- resolve
    def resolve(self, exists: Sequence[int] | npt.NDArray[Any]) -> int:
        return self.resolve_result(exists).hit_length

    def resolve_result(self, exists: Sequence[int] | npt.NDArray[Any] | None) -> LookupResult:
        """vLLM's lookup result from the store's per-key answers (``keys`` order; only ``1``
        means present). ``None`` means ``batch_is_exist`` raised: vLLM then returns 0."""
        if exists is None or not self.num_keys:
            return LookupResult(0)
        return self._resolve_present_result(present_keys(exists, self.num_keys))

    def _resolve_present(self, present: BoolArray) -> int:
        return self._resolve_present_result(present).hit_length

    def _resolve_present_result(self, present: BoolArray) -> LookupResult:
        """:meth:`resolve_result` from one boolean per key."""
        if not self.num_keys:
            return LookupResult(0)
        if self.single_full_attention and self.hash_ids is None:  # the probed prefix decides
            probe = self._groups[0]
            k = len(self.geometry.prefix_bytes[probe.group_id])
            m = probe.chunks.size
            answers = present[probe.key_offset : probe.key_offset + m * k]
            chunks: BoolArray = answers.reshape(m, k).all(axis=1) if k > 1 else answers  # type: ignore[assignment]
            run = m if chunks.all() else int(chunks.argmin())
            return self.result_for_hit(self.prefix_hit(run))
        return era_c_result(self.geometry, self.num_tokens, self.hash_presence(present))

    def hash_presence(self, present: BoolArray) -> list[BoolArray]:
        """Per store group, one boolean per request hash: in vLLM's presence set."""
        n = self._hash_count
        ids = self.hash_ids
        out: list[BoolArray] = []
        for probe, units in zip(self._groups, self._units):
            k = len(self.geometry.prefix_bytes[probe.group_id])
            m = probe.chunks.size
            answers = present[probe.key_offset : probe.key_offset + m * k]
            probed: BoolArray = answers.reshape(m, k).all(axis=1) if k > 1 else answers  # type: ignore[assignment]
            if ids is None:
                by_unit = np.zeros(n, dtype=bool)
                by_unit[units] = probed
            else:
                by_id = np.zeros(int(ids.max()) + 1, dtype=bool)
                np.logical_or.at(by_id, ids[units], probed)
                by_unit = by_id[ids]
            out.append(by_unit)
        return out

    def prefix_hit(self, chunks: int) -> int:
        return lone_full_attention_hit(self.geometry, self.token_len, self.num_tokens, chunks)

    def result_for_hit(self, hit: int) -> LookupResult:
        """The result of a settled probe: a hit of 0 has no boundaries; otherwise this is
        only known from the hit for a lone block-aligned full-attention group (its last
        chunk is keyed at the hit). Other plans resolve their result from the answers."""
        if hit <= 0:
            return LookupResult(0)
        if not self.single_full_attention:
            raise AssertionError("a multi-group plan's result comes from its answers")
        return LookupResult(hit, (TailKeyBoundary(0, hit),))


def build_era_c_plan(geometry: Geometry, num_tokens: object, block_hashes: object) -> EraCPlan:
    """Validate one request and build its :class:`EraCPlan` (see :meth:`KVLayout.plan`)."""
    rules = geometry.rules
    assert rules is not None
    n_tokens = integer("num_tokens", num_tokens)
    hashes = RequestHashes(block_hashes)
    a = rules.alignment
    token_len = n_tokens // a * a
    count = hashes.count
    if token_len <= 0 or count == 0:
        return EraCPlan(geometry, max(token_len, 0), n_tokens, (), 0)
    h = geometry.hash_block_size
    probes: list[GroupProbe] = []
    units_of: list[IntArray] = []
    offset = 0
    short = None  # (found when first read, unless the 0.26 planner found it)
    if _keys_as_026(geometry) and (geometry.has_full_attention or count >= token_len // h):
        # The same probes as vLLM 0.26 for this length: its planner (probe-target cache,
        # shared reads) builds them.
        base = build_plan(geometry, token_len, hashes)
        for probe in base.groups:
            stride = geometry.groups[probe.group_id].block_size // h
            probes.append(probe)
            units_of.append(probe.chunks if stride == 1 else probe.chunks * stride + (stride - 1))
        offset = base.num_keys
        short = base.short
    elif rules.fine:  # every hash unit, raw hashes, every group
        n_units = min(count, token_len // h)
        rows, items = hashes.gather(slice(0, n_units, 1))
        hex_items = [it.hex().encode() for it in items] if items else []
        chunks = np.arange(n_units, dtype=np.int64)
        chunks.flags.writeable = False
        first: GroupProbe | None = None
        for gid in range(len(geometry.groups)):
            probe = GroupProbe(gid, chunks, n_units, offset, hex_items, rows, None)
            if first is not None:
                probe.subset_of = first
                probe._hex_rows = first.hex_rows
            else:
                first = probe
            probes.append(probe)
            units_of.append(chunks)
            offset += n_units * len(geometry.prefix_bytes[gid])
    else:
        for gid, spec in enumerate(geometry.groups):
            block = spec.block_size
            stride = block // h
            limit = min(count // stride, token_len // block)
            chunks = _masked_chunks(
                rules.coverage[gid], rules.mask_eagle[gid], geometry.scheduler_block_size, limit
            )
            chunks.flags.writeable = False
            units = chunks * stride + (stride - 1)
            later = None  # (an immutable array's rows are read when needed: see build_plan)
            if chunks.size == limit:
                rows, items = hashes.gather(slice(stride - 1, limit * stride, stride))
            elif hashes.immutable_array:
                assert hashes.array is not None
                rows, items, later = None, [], (hashes.array, units)
            else:
                rows, items = hashes.gather(units)
            probes.append(
                GroupProbe(
                    gid,
                    chunks,
                    limit,
                    offset,
                    [it.hex().encode() for it in items] if items else [],
                    rows,
                    None,
                    later,
                )
            )
            units_of.append(units)
            offset += chunks.size * len(geometry.prefix_bytes[gid])
    return EraCPlan(
        geometry,
        token_len,
        n_tokens,
        tuple(probes),
        offset,
        tuple(units_of),
        count,
        hashes if offset else None,
        short,
    )


_QUICK_HASHES = 32_768
"""Up to this many hashes (a 131,072-token DeepSeek-V4-like prompt: about 215 us, docs/design.md,
"Preparing plans off the loop") the test runs inline when nothing else is under way."""

_PREPARED_HASHES = 4096
"""From this many hashes (an immutable array), a plan that needs the repeated-hash test leaves
it to :meth:`EraCPlan.prepare`: reading a large cold array and sorting its fingerprints then
costs far more than handing it to a worker thread (docs/design.md, "Preparing plans off the
loop")."""


def _hash_ids(hashes: RequestHashes, repeats: bool | None = None) -> IntArray | None:
    """Ids of every request hash, equal exactly where hashes repeat; None when none do (the
    usual case: hashes are chained). vLLM keys presence by hash, so a repeat anywhere can
    count. ``repeats``: the array's test verdict, when a job gave one."""
    if hashes.array is not None:
        return duplicate_ids(hashes.array, [], repeats)
    items = hashes.items
    assert items is not None
    # Known bytes (a snapshot's, checked when taken): the one C pass of has_duplicates().
    if hashes.bytes_only and not hashes.has_duplicates():
        return None
    try:
        joined = b"".join(items)
    except TypeError:  # (bytes-likes of other kinds)
        return duplicate_ids(None, [bytes(h) for h in items])
    n = len(items)
    width = len(joined) // n if n else 0
    if n and len(joined) == n * width and list(map(len, items)).count(width) == n:
        return duplicate_ids(np.frombuffer(joined, dtype=np.uint8).reshape(n, width), [])
    return duplicate_ids(None, [bytes(h) for h in items])


def _keys_as_026(geometry: Geometry) -> bool:
    """Whether this layout probes exactly what vLLM 0.26 would (so its planner can build the
    probes): block-aligned, one namespace list for every group, EAGLE masks as 0.26's (no
    per-group flags), windows not widened, and no chunked-local group (0.26 checks those while
    planning)."""
    rules = geometry.rules
    assert rules is not None
    known = rules.keys_as_026
    if known is None:
        known = (
            not rules.fine
            and not geometry.has_chunked_local
            and all(ns == geometry.namespaces for ns in geometry.group_namespaces)
            and all(flag == geometry.use_eagle for flag in rules.mask_eagle)
            and all(
                cov == dataclasses.replace(spec, eagle=False)
                for cov, spec in zip(rules.coverage, geometry.groups)
            )
        )
        rules.keys_as_026 = known
    return known


def _masked_chunks(spec: Any, eagle: bool, scheduler_block_size: int, limit: int) -> IntArray:
    """The chunks a group probes in block-aligned mode: all, or a sliding window's tails
    ending at each scheduler-block boundary (shifted one block with EAGLE), from the coverage
    spec."""
    if not isinstance(spec, SlidingWindow) or limit <= 0:
        return np.arange(max(limit, 0), dtype=np.int64)
    need = window_blocks(spec, eagle)
    per_segment = scheduler_block_size // spec.block_size
    if need >= per_segment:
        return np.arange(limit, dtype=np.int64)
    shift = 1 if eagle else 0
    offsets = np.arange(per_segment - need, per_segment, dtype=np.int64) + shift
    segments = np.arange(0, limit + per_segment, per_segment, dtype=np.int64)
    chunks = (segments[:, None] + offsets[None, :]).ravel()
    return chunks[chunks < limit]
