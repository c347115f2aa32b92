"""Exactness oracle and speed baseline: an un-optimised pure-Python re-implementation of vLLM
0.33.0's (and 0.32.0's) Mooncake-store worker-side prefix lookup.

Written from the behavioural specification of vLLM 0.33 ("Era C", ``lookup-semantics-0.33.md``),
in the style of :mod:`aio_mclookup._reference.v026`: slow on purpose, literal, and with the same
*shape* of work the real worker does, so that timing it is a fair "what vLLM costs" figure and so
that it is an independent oracle for the property tests. The library proper never imports it.

What it models, in the order of the real ``lookup(num_tokens, block_hashes)``:

* the request's ``num_tokens`` is aligned inside: to the hash block ``h`` in fine-grained
  (partial hash hit) mode, which is on when ``cache_hit_alignment_tokens < scheduler_block_size``,
  else to the scheduler block ``L``;
* only ``prefix_cacheable`` groups exist for the lookup, renumbered in order (circular-buffer
  rings and other excluded groups vanish, and the ``@group:<G>`` of later groups drops);
* every group has its own list of key prefixes: its TP replication factor (Mamba: every rank;
  MLA: one shard; else ``tp // max(1, tp // num_kv_heads)`` shards), PCP/DCP/PP namespaces, the
  optional ``store_namespace`` after the model name, and the TP-sharded store form when
  ``store_tp_size`` is set;
* block-aligned mode: the compact "last sub-hash" chunk view and the sliding-window lookup mask
  (from each group's *coverage* spec, i.e. the window widened by ``extra_retained_tokens`` in
  0.33 but not in 0.32), the mask tested before the hash is read; fine-grained mode: every group
  probes every hash unit with the raw hash;
* one ``batch_is_exist`` call (``None`` answers = it raised = hit 0); presence per
  ``(group, hash bytes)``, only ``1`` meaning present;
* the store coordinator's hit search: spec-groups merged by coverage spec, EAGLE per flagged
  group (or every group with ``use_eagle`` and no flag), full attention first, the convergence
  loop with the lookup alignment for every manager and the EAGLE peek margin (none for Mamba,
  capped at ``len(block_hashes) * h``), the fine-grained manager variants;
* a hit that reaches ``num_tokens`` is searched again, on the same presence set, below it;
* the tail-key boundaries of every group, and the wire reply (u32 hit, then u32 pairs).

Where vLLM raises (an assertion in a manager or in the tail-boundary step, an IndexError on a
short hash list), this raises :class:`aio_mclookup._errors.InvalidRequest`.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .._errors import InvalidRequest

__all__ = ["BaselineLookupV033", "TailKeyBoundary", "V033Result", "SUPPORTED_VERSIONS"]

SUPPORTED_VERSIONS = ("0.33.0", "0.33", "0.32.0", "0.32")


# --------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------


class TailKeyBoundary(NamedTuple):
    """Group ``group_id``'s last chunk is keyed at the hash boundary ``num_tokens``."""

    group_id: int
    num_tokens: int


class V033Result(NamedTuple):
    """``MooncakeLookupResult``: the hit and the tail-key boundaries (empty for a hit of 0)."""

    hit_length: int
    tail_key_boundaries: tuple[TailKeyBoundary, ...] = ()

    def to_bytes(self) -> bytes:
        """The lookup reply on the wire: u32 BE hit, then u32 BE (group, tokens) per boundary."""
        out = [struct.pack(">I", self.hit_length)]
        for b in self.tail_key_boundaries:
            out.append(struct.pack(">II", b.group_id, b.num_tokens))
        return b"".join(out)


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


class _VLLMRaised(Exception):
    """What vLLM would raise at this point (AssertionError / IndexError in the real code)."""


def _vllm_assert(condition: bool, message: str) -> None:
    if not condition:
        raise _VLLMRaised(message)


_FULL = "full_attention"
_SWA = "sliding_window"
_CHUNKED = "chunked_local"
_MAMBA = "mamba"
_RING = "circular_buffer"
_KINDS = (_FULL, _SWA, _CHUNKED, _MAMBA, _RING)

_GROUP_FIELDS: dict[str, set[str]] = {
    _FULL: {"block_size", "mla", "eagle", "prefix_cacheable"},
    _SWA: {
        "block_size",
        "sliding_window",
        "mla",
        "extra_retained_tokens",
        "eagle",
        "prefix_cacheable",
    },
    _CHUNKED: {"block_size", "attention_chunk_size", "eagle", "prefix_cacheable"},
    _MAMBA: {"block_size", "eagle", "prefix_cacheable"},
    _RING: {"block_size", "eagle", "prefix_cacheable"},
}
_REQUIRED_GROUP_FIELDS: dict[str, set[str]] = {
    _FULL: {"block_size"},
    _SWA: {"block_size", "sliding_window"},
    _CHUNKED: {"block_size", "attention_chunk_size"},
    _MAMBA: {"block_size"},
    _RING: {"block_size"},
}
_LAYOUT_FIELDS = {
    "model",
    "cache_prefix",
    "hash_block_size",
    "scheduler_block_size",
    "use_eagle",
    "tp_size",
    "pcp_size",
    "dcp_size",
    "pp_size",
    "num_kv_heads",
    "groups",
    "cache_hit_alignment_tokens",
    "store_namespace",
    "store_tp_size",
    "vllm_version",
}


def _int(cfg: dict[str, Any], name: str, default: int | None = None, minimum: int = 1) -> int:
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidRequest(f"{name} must be an int >= {minimum}, got {value!r}", field=name)
    return value


def _bool(cfg: dict[str, Any], name: str, default: bool, field: str) -> bool:
    value = cfg.get(name, default)
    if not isinstance(value, bool):
        raise InvalidRequest(f"{field} must be a bool, got {value!r}", field=field)
    return value


class _Spec:
    """One KV-cache group's spec as the store coordinator sees it.

    Equal specs are merged into one spec-group. The class of the vLLM spec is modelled by
    ``kind`` plus ``mla`` (``MLAAttentionSpec`` is not equal to ``FullAttentionSpec``).
    """

    __slots__ = (
        "attention_chunk_size",
        "block_size",
        "extra_retained_tokens",
        "kind",
        "mla",
        "sliding_window",
    )

    def __init__(
        self,
        kind: str,
        block_size: int,
        sliding_window: int | None = None,
        attention_chunk_size: int | None = None,
        mla: bool = False,
        extra_retained_tokens: int = 0,
    ) -> None:
        self.kind = kind
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.attention_chunk_size = attention_chunk_size
        self.mla = mla
        self.extra_retained_tokens = extra_retained_tokens

    def _key(self) -> tuple[Any, ...]:
        return (
            self.kind,
            self.mla,
            self.block_size,
            self.sliding_window,
            self.attention_chunk_size,
            self.extra_retained_tokens,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Spec) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"_Spec{self._key()!r}"


def _coverage_spec(spec: _Spec, widen: bool) -> _Spec:
    """0.33: an SWA spec retaining ``e`` extra tokens covers a window of ``W + e`` (and is then
    equal to a plain SWA spec of that window). 0.32 uses the spec as it is."""
    if widen and spec.kind == _SWA and spec.extra_retained_tokens > 0:
        assert spec.sliding_window is not None
        return _Spec(
            _SWA,
            spec.block_size,
            spec.sliding_window + spec.extra_retained_tokens,
            None,
            spec.mla,
            0,
        )
    return spec


# --------------------------------------------------------------------------
# compact chunk-hash view ("last sub-hash of each chunk")
# --------------------------------------------------------------------------


class _ChunkHashView:
    """Lazy view: element i is ``hashes[i*s + s - 1]`` with ``s = B / h``; length
    ``len(hashes) // s``. Every access is a method call, like the real view."""

    def __init__(self, block_hashes: Sequence[bytes], hash_block_size: int, block_size: int):
        self.block_hashes = block_hashes
        self.scale_factor = block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def _get_value_at(self, idx: int) -> bytes:
        return self.block_hashes[idx * self.scale_factor + self.scale_factor - 1]

    def __getitem__(self, idx: int) -> bytes:
        return self._get_value_at(idx)

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in range(len(self)):
            yield self._get_value_at(i)


def _chunk_hashes_for_block_size(
    block_hashes: Sequence[bytes], hash_block_size: int, block_size: int
) -> Sequence[bytes]:
    if block_size == hash_block_size:
        return block_hashes
    return _ChunkHashView(block_hashes, hash_block_size, block_size)  # type: ignore[return-value]


# --------------------------------------------------------------------------
# existence pool
# --------------------------------------------------------------------------


class _ExistsPool:
    """Answers "is this hash cached for every one of these groups"."""

    def __init__(self, exists: set[tuple[int, bytes]]) -> None:
        self._exists = exists

    def cached(self, block_hash: bytes, group_ids: Sequence[int]) -> bool:
        h = bytes(block_hash)
        return all((g, h) in self._exists for g in group_ids)

    def has(self, group_id: int, block_hash: bytes) -> bool:
        return (group_id, bytes(block_hash)) in self._exists


# --------------------------------------------------------------------------
# masks (block-aligned mode only)
# --------------------------------------------------------------------------


def _swa_need(spec: _Spec, use_eagle: bool) -> int:
    assert spec.sliding_window is not None
    return _cdiv(spec.sliding_window - 1, spec.block_size) + (1 if use_eagle else 0)


def _swa_reachable_block_mask(
    end_block: int, alignment_tokens: int, spec: _Spec, use_eagle: bool
) -> list[bool] | None:
    """The ``need`` blocks ending at each aligned boundary (shifted by one with EAGLE)."""
    block_size = spec.block_size
    need = _swa_need(spec, use_eagle)
    shift = 1 if use_eagle else 0
    per_segment = alignment_tokens // block_size
    if need >= per_segment:
        return None
    mask = [False] * end_block
    for i in range(end_block):
        if i >= shift and (i - shift) % per_segment >= per_segment - need:
            mask[i] = True
    return mask


# --------------------------------------------------------------------------
# per-spec managers: hit search
# --------------------------------------------------------------------------


class _SearchContext(NamedTuple):
    block_hashes: Sequence[bytes]  # the raw hash list
    hash_block_size: int
    fine: bool  # partial hash hits enabled
    pool: _ExistsPool


def _hit_full(
    ctx: _SearchContext,
    view: Sequence[bytes],
    max_length: int,
    group_ids: Sequence[int],
    spec: _Spec,
    drop_eagle: bool,
    alignment: int,
) -> int:
    block_size = spec.block_size
    h = ctx.hash_block_size
    num_blocks = 0
    for chunk_hash in itertools.islice(view, max_length // block_size):
        if not ctx.pool.cached(chunk_hash, group_ids):
            break
        num_blocks += 1
    hit = num_blocks * block_size
    if ctx.fine and block_size > h:
        # The interior hash boundaries of the next block, high to low: the first present one
        # extends the hit to it.
        s = block_size // h
        first = num_blocks * s
        stop = min(first + s - 1, max_length // h, len(ctx.block_hashes))
        for k in range(stop - 1, first - 1, -1):
            if ctx.pool.cached(ctx.block_hashes[k], group_ids):
                hit = (k + 1) * h
                break
    if drop_eagle and hit > 0:
        hit -= h if ctx.fine else block_size
    return hit // alignment * alignment


def _hit_swa(
    ctx: _SearchContext,
    view: Sequence[bytes],
    max_length: int,
    group_ids: Sequence[int],
    spec: _Spec,
    drop_eagle: bool,
    alignment: int,
) -> int:
    need = _swa_need(spec, drop_eagle)
    block_size = spec.block_size
    max_num_blocks = max_length // block_size
    run = 0
    hit_blocks: int | None = None
    for i in range(max_num_blocks - 1, -1, -1):
        if ctx.pool.cached(view[i], group_ids):  # indexes past a short hash list: IndexError
            if run == 0 and block_size != alignment:
                blocks_after_pop = i if drop_eagle else i + 1
                if (blocks_after_pop * block_size) % alignment != 0:
                    continue
            run += 1
            if run >= need:
                hit_blocks = i + run
                break
        else:
            run = 0

    def realign(n: int) -> int:
        while block_size != alignment and n * block_size % alignment != 0:
            n -= 1
        return n

    if hit_blocks is None:
        # The leading run (from block 0) needs no earlier blocks.
        hit_blocks = realign(run)
    if drop_eagle and hit_blocks > 0:
        hit_blocks = realign(hit_blocks - 1)
    return hit_blocks * block_size


def _hit_chunked_local(
    ctx: _SearchContext,
    view: Sequence[bytes],
    max_length: int,
    group_ids: Sequence[int],
    spec: _Spec,
    drop_eagle: bool,
    alignment: int,
) -> int:
    _vllm_assert(not drop_eagle, "eagle is not supported with chunked local attention")
    _vllm_assert(
        spec.block_size == alignment,
        f"block_size {spec.block_size} != alignment {alignment}: not compatible with chunked "
        "local attention now",
    )
    chunk = spec.attention_chunk_size
    assert chunk is not None
    block_size = spec.block_size
    max_num_blocks = max_length // block_size
    local_start_block = (max_length // chunk * chunk if max_length > 0 else 0) // block_size
    n = local_start_block  # blocks before the current attention chunk: hits, unchecked
    for i in range(local_start_block, max_num_blocks):
        if ctx.pool.cached(view[i], group_ids):
            n += 1
        else:
            break
    return n * block_size


def _hit_mamba(
    ctx: _SearchContext,
    view: Sequence[bytes],
    max_length: int,
    group_ids: Sequence[int],
    spec: _Spec,
    drop_eagle: bool,
    alignment: int,
) -> int:
    # Never drops a state for EAGLE.
    h = ctx.hash_block_size
    if ctx.fine:
        for u in range(min(max_length // h, len(ctx.block_hashes)) - 1, -1, -1):
            if ctx.pool.cached(ctx.block_hashes[u], group_ids):
                return (u + 1) * h
        return 0
    block_size = spec.block_size
    for i in range(max_length // block_size - 1, -1, -1):
        if ctx.pool.cached(view[i], group_ids):
            if block_size != alignment and (i + 1) * block_size % alignment != 0:
                continue
            return (i + 1) * block_size
    return 0


_MANAGERS: dict[str, Callable[..., int]] = {
    _FULL: _hit_full,
    _SWA: _hit_swa,
    _CHUNKED: _hit_chunked_local,
    _MAMBA: _hit_mamba,
}


# --------------------------------------------------------------------------
# store coordinator
# --------------------------------------------------------------------------


class _Coordinator:
    def __init__(
        self,
        group_specs: list[_Spec],
        eagle_flags: list[bool],
        scheduler_block_size: int,
        hash_block_size: int,
        use_eagle: bool,
        partial_hash_hits: bool,
        widen_windows: bool,
    ) -> None:
        self.group_specs = group_specs
        self.hash_block_size = hash_block_size
        self.lcm_block_size = scheduler_block_size
        self.partial_hash_hits = partial_hash_hits
        self.alignment = hash_block_size if partial_hash_hits else scheduler_block_size
        self.coverage_specs = [_coverage_spec(s, widen_windows) for s in group_specs]

        spec_groups: list[tuple[_Spec, list[int]]] = []
        for gid, spec in enumerate(self.coverage_specs):
            for existing, ids in spec_groups:
                if existing == spec:
                    ids.append(gid)
                    break
            else:
                spec_groups.append((spec, [gid]))
        # Stable sort: full-attention spec-groups (MLA included) first.
        self.spec_groups = sorted(spec_groups, key=lambda x: x[0].kind != _FULL)
        flagged = {gid for gid, flag in enumerate(eagle_flags) if flag}
        if flagged:
            eagle_indices = {
                idx for idx, (_, ids) in enumerate(self.spec_groups) if flagged.intersection(ids)
            }
        elif use_eagle:
            eagle_indices = set(range(len(self.spec_groups)))
        else:
            eagle_indices = set()
        self.eagle_spec_group_indices = eagle_indices
        # The merged flag reaches every member (vLLM #49069).
        self.eagle_group_ids = {gid for idx in eagle_indices for gid in self.spec_groups[idx][1]}

    # -- masks --------------------------------------------------------------
    def lookup_mask(self, aligned_token_len: int) -> list[list[bool] | None]:
        assert aligned_token_len % self.lcm_block_size == 0
        masks: list[list[bool] | None] = []
        for gid, spec in enumerate(self.coverage_specs):
            end_block = aligned_token_len // spec.block_size
            if spec.kind == _SWA:
                masks.append(
                    _swa_reachable_block_mask(
                        end_block, self.lcm_block_size, spec, gid in self.eagle_group_ids
                    )
                )
            else:
                masks.append(None)
        return masks

    def block_hashes_for_spec(self, block_hashes: Sequence[bytes], spec: _Spec) -> Sequence[bytes]:
        return _chunk_hashes_for_block_size(block_hashes, self.hash_block_size, spec.block_size)

    # -- hit search ---------------------------------------------------------
    def _eagle_margin(self, spec: _Spec) -> int:
        if self.partial_hash_hits and spec.kind == _FULL and spec.block_size > self.hash_block_size:
            return self.hash_block_size
        return spec.block_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int, pool: _ExistsPool
    ) -> int:
        ctx = _SearchContext(block_hashes, self.hash_block_size, self.partial_hash_hits, pool)
        a = self.alignment
        eagle_indices = self.eagle_spec_group_indices
        if len(self.spec_groups) == 1:
            spec, group_ids = self.spec_groups[0]
            return _MANAGERS[spec.kind](
                ctx,
                self.block_hashes_for_spec(block_hashes, spec),
                max_length,
                group_ids,
                spec,
                0 in eagle_indices,
                a,
            )

        hit_length = max_length
        evaluated_full: dict[int, int] = {}  # spec-group index -> its hit
        is_simple_hybrid = len(self.spec_groups) == 2 and self.spec_groups[0][0].kind == _FULL
        eagle_verified: set[int] = set()
        peek_cap = len(block_hashes) * self.hash_block_size
        while True:
            curr = hit_length
            for idx, (spec, group_ids) in enumerate(self.spec_groups):
                if spec.kind == _FULL and idx in evaluated_full:
                    curr = min(curr, evaluated_full[idx])
                    continue
                drop_eagle = idx in eagle_indices and idx not in eagle_verified
                group_max = curr
                if drop_eagle and spec.kind != _MAMBA:
                    group_max = min(curr + self._eagle_margin(spec), peek_cap)
                new_hit = _MANAGERS[spec.kind](
                    ctx,
                    self.block_hashes_for_spec(block_hashes, spec),
                    group_max,
                    group_ids,
                    spec,
                    drop_eagle,
                    a,
                )
                if drop_eagle:
                    eagle_verified.add(idx)
                elif new_hit < curr:
                    eagle_verified.clear()
                curr = new_hit
                if spec.kind == _FULL:
                    evaluated_full[idx] = new_hit
            if curr >= hit_length:
                break
            hit_length = curr
            if is_simple_hybrid:
                break
        return hit_length


# --------------------------------------------------------------------------
# worker-side lookup
# --------------------------------------------------------------------------


def _model_name(model: str) -> str:
    return model.rstrip("/").split("/")[-1]


class BaselineLookupV033:
    """vLLM 0.33.0 (or 0.32.0) worker ``lookup`` re-implemented, un-optimised.

    ``config`` is the layout dict (the conformance ``config``), optionally with
    ``"vllm_version"`` (``"0.33.0"`` when absent; ``"0.32.0"``/``"0.32"`` selects 0.32: no SWA
    widening by ``extra_retained_tokens``).
    """

    def __init__(self, config: dict[str, Any]) -> None:
        unknown = set(config) - _LAYOUT_FIELDS
        if unknown:
            raise InvalidRequest(f"unknown layout field(s): {sorted(unknown)}")
        version = config.get("vllm_version", "0.33.0")
        if version not in SUPPORTED_VERSIONS:
            raise InvalidRequest(
                f"vllm_version {version!r}: this oracle models {', '.join(SUPPORTED_VERSIONS)}",
                field="vllm_version",
            )
        self.vllm_version = "0.32.0" if version.startswith("0.32") else "0.33.0"
        self.widen_windows = self.vllm_version == "0.33.0"

        model = config.get("model")
        if not isinstance(model, str) or not _model_name(model):
            raise InvalidRequest(f"model must be a non-empty str, got {model!r}", field="model")
        self.model_name = _model_name(model)
        self.cache_prefix = config.get("cache_prefix", "") or ""
        self.store_namespace = config.get("store_namespace", "") or ""
        if not isinstance(self.cache_prefix, str) or not isinstance(self.store_namespace, str):
            raise InvalidRequest("cache_prefix and store_namespace must be str")
        self.hash_block_size = h = _int(config, "hash_block_size")
        self.block_size = L = _int(config, "scheduler_block_size")
        self.use_eagle = _bool(config, "use_eagle", False, "use_eagle")
        self.tp_size = _int(config, "tp_size", 1)
        self.pcp_size = _int(config, "pcp_size", 1)
        self.dcp_size = _int(config, "dcp_size", 1)
        self.pp_size = _int(config, "pp_size", 1)
        if config.get("num_kv_heads") is None:
            if self.tp_size > 1 and self.dcp_size == 1:
                raise InvalidRequest(
                    "num_kv_heads is required with tp_size > 1 and dcp_size == 1: the model's "
                    "total KV heads (mark MLA groups with mla: true)",
                    field="num_kv_heads",
                )
            self.num_kv_heads = 1
        else:
            self.num_kv_heads = _int(config, "num_kv_heads")
        cha = config.get("cache_hit_alignment_tokens")
        if cha is not None:
            cha = _int(config, "cache_hit_alignment_tokens")
            if cha not in (h, L):
                raise InvalidRequest(
                    f"cache_hit_alignment_tokens={cha}: vLLM resolves it to hash_block_size "
                    f"({h}) or scheduler_block_size ({L})",
                    field="cache_hit_alignment_tokens",
                )
        self.partial_hash_hits = cha is not None and cha < L
        self.alignment = h if self.partial_hash_hits else L
        store_tp = config.get("store_tp_size")
        self.store_tp_size = None if store_tp is None else _int(config, "store_tp_size")

        raw_groups = config.get("groups")
        if not isinstance(raw_groups, list) or not raw_groups:
            raise InvalidRequest("groups must be a non-empty list", field="groups")
        specs: list[_Spec] = []
        eagle_flags: list[bool] = []
        self.store_group_of: list[int | None] = []  # config index -> store group id
        for i, g in enumerate(raw_groups):
            spec, eagle, cacheable = self._group(i, g)
            if not cacheable:
                self.store_group_of.append(None)
                continue
            self.store_group_of.append(len(specs))
            specs.append(spec)
            eagle_flags.append(eagle)
        if not specs:
            raise InvalidRequest("no prefix-cacheable KV-cache group", field="groups")
        if self.pcp_size > 1 and len(specs) > 1:
            raise InvalidRequest(
                "pcp_size > 1 needs exactly one prefix-cacheable group", field="pcp_size"
            )
        if L % h:
            raise InvalidRequest(
                f"scheduler_block_size={L} must be a multiple of hash_block_size={h}",
                field="scheduler_block_size",
            )
        for gid, spec in enumerate(specs):
            if spec.block_size % h or L % spec.block_size:
                raise InvalidRequest(
                    f"group {gid}: block_size={spec.block_size} must divide "
                    f"scheduler_block_size={L} and be a multiple of hash_block_size={h}",
                    field="groups",
                )
        if self.store_tp_size is not None:
            n = self.store_tp_size
            if not (
                len(specs) == 1
                and specs[0].kind == _FULL
                and not specs[0].mla
                and self.pcp_size == 1
                and self.dcp_size == 1
                and n >= self.tp_size
                and n % self.tp_size == 0
                and self.num_kv_heads % n == 0
            ):
                raise InvalidRequest(
                    "store_tp_size is only set for TP-sharded store layouts (one full-attention "
                    "non-MLA group, pcp = dcp = 1, a multiple of tp_size dividing num_kv_heads)",
                    field="store_tp_size",
                )
        self.group_specs = specs
        self.eagle_flags = eagle_flags
        self._coord = _Coordinator(
            specs,
            eagle_flags,
            L,
            h,
            self.use_eagle,
            self.partial_hash_hits,
            self.widen_windows,
        )
        self._init_lookup_key_prefixes()

    def _group(self, index: int, raw: object) -> tuple[_Spec, bool, bool]:
        if not isinstance(raw, dict):
            raise InvalidRequest(f"groups[{index}] must be a mapping", field=f"groups.{index}")
        kind = raw.get("kind")
        if kind not in _KINDS:
            raise InvalidRequest(
                f"groups[{index}].kind={kind!r} is not one of {', '.join(_KINDS)}",
                field=f"groups.{index}.kind",
            )
        assert isinstance(kind, str)
        fields = {k: v for k, v in raw.items() if k != "kind"}
        extra = set(fields) - _GROUP_FIELDS[kind]
        missing = _REQUIRED_GROUP_FIELDS[kind] - set(fields)
        if extra or missing:
            raise InvalidRequest(
                f"groups[{index}] ({kind}): unknown {sorted(extra)}, missing {sorted(missing)}",
                field=f"groups.{index}",
            )
        where = f"groups.{index}"
        block_size = _int(fields, "block_size")
        mla = _bool(fields, "mla", False, f"{where}.mla")
        eagle = _bool(fields, "eagle", False, f"{where}.eagle")
        cacheable = _bool(fields, "prefix_cacheable", kind != _RING, f"{where}.prefix_cacheable")
        if kind == _RING and cacheable:
            raise InvalidRequest(
                f"groups[{index}]: a circular_buffer group is never prefix-cacheable",
                field=f"{where}.prefix_cacheable",
            )
        extra_retained = _int(fields, "extra_retained_tokens", 0, minimum=0)
        window = _int(fields, "sliding_window") if kind == _SWA else None
        chunk = _int(fields, "attention_chunk_size") if kind == _CHUNKED else None
        return _Spec(kind, block_size, window, chunk, mla, extra_retained), eagle, cacheable

    # -- key prefixes -------------------------------------------------------
    def replication_factor(self, gid: int) -> int:
        spec = self.group_specs[gid]
        if self.dcp_size > 1 or spec.kind == _MAMBA:
            return 1
        if spec.mla:
            return self.tp_size
        return max(1, self.tp_size // self.num_kv_heads)

    def namespaces(self, gid: int) -> list[tuple[int, int, int, int]]:
        """(tp, pcp, dcp, pp) of every key the lookup needs for group ``gid``."""
        if self.store_tp_size is not None:
            return [(s, 0, 0, pp) for s in range(self.store_tp_size) for pp in range(self.pp_size)]
        if self.dcp_size > 1:
            return [
                (tp, pcp, tp % self.dcp_size, pp)
                for pcp in range(self.pcp_size)
                for tp in range(self.tp_size)
                for pp in range(self.pp_size)
            ]
        shards = self.tp_size // self.replication_factor(gid)
        return [
            (shard, pcp, 0, pp)
            for pcp in range(self.pcp_size)
            for shard in range(shards)
            for pp in range(self.pp_size)
        ]

    def _build_prefix(self, tp: int, pcp: int, dcp: int, pp: int, group: int) -> str:
        head = f"{self.cache_prefix}@" if self.cache_prefix else ""
        return (
            f"{head}{self.model_name}{self.store_namespace}@tp_rank:{tp}@pcp{pcp}@dcp{dcp}"
            f"@pp_rank:{pp}@group:{group}"
        )

    def _init_lookup_key_prefixes(self) -> None:
        self.lookup_key_prefixes: list[list[str]] = [
            [
                self._build_prefix(tp, pcp, dcp, pp, gid)
                for (tp, pcp, dcp, pp) in self.namespaces(gid)
            ]
            for gid in range(len(self.group_specs))
        ]

    # -- lookup -------------------------------------------------------------
    def align_lookup_length(self, num_tokens: int) -> int:
        return num_tokens // self.alignment * self.alignment

    def build_keys(
        self, num_tokens: int, block_hashes: Sequence[bytes]
    ) -> tuple[list[str], list[tuple[int, bytes]]]:
        """The keys sent to ``batch_is_exist`` (vLLM's order) and, per probed (group, unit),
        the presence entry its namespace keys decide."""
        token_len = self.align_lookup_length(num_tokens)
        if not block_hashes or token_len <= 0:
            return [], []
        coord = self._coord
        keys: list[str] = []
        meta: list[tuple[int, bytes]] = []
        if self.partial_hash_hits:
            units = min(len(block_hashes), token_len // self.hash_block_size)
            for gid in range(len(self.group_specs)):
                for u in range(units):
                    hx = block_hashes[u].hex()
                    for prefix in self.lookup_key_prefixes[gid]:
                        keys.append(f"{prefix}@{hx}")
                    meta.append((gid, bytes(block_hashes[u])))
            return keys, meta
        masks = coord.lookup_mask(token_len)
        for gid, spec in enumerate(self.group_specs):
            mask = masks[gid]
            view = coord.block_hashes_for_spec(block_hashes, spec)
            max_chunks = min(len(view), _cdiv(token_len, spec.block_size))
            limit = max_chunks if mask is None else min(max_chunks, len(mask))
            for c in range(limit):
                if mask is not None and not mask[c]:  # before the hash is read
                    continue
                chunk_hash = view[c]
                hx = chunk_hash.hex()
                for prefix in self.lookup_key_prefixes[gid]:
                    keys.append(f"{prefix}@{hx}")
                meta.append((gid, bytes(chunk_hash)))
        return keys, meta

    def presence(
        self, meta: Sequence[tuple[int, bytes]], answers: Sequence[int]
    ) -> set[tuple[int, bytes]]:
        exists: set[tuple[int, bytes]] = set()
        i = 0
        for item in meta:
            k = len(self.lookup_key_prefixes[item[0]])
            if all(answers[i + j] == 1 for j in range(k)):
                exists.add(item)
            i += k
        return exists

    def _tail_key_boundaries(
        self, block_hashes: Sequence[bytes], hit: int, pool: _ExistsPool
    ) -> tuple[TailKeyBoundary, ...]:
        if hit <= 0:
            return ()
        h = self.hash_block_size
        j = hit // h - 1
        out: list[TailKeyBoundary] = []
        for gid, spec in enumerate(self.group_specs):
            if pool.has(gid, block_hashes[j]):
                out.append(TailKeyBoundary(gid, hit))
                continue
            _vllm_assert(self.partial_hash_hits, f"no tail key at {hit} for group {gid}")
            c = _cdiv(hit, spec.block_size) - 1
            end = min((c + 1) * spec.block_size // h, len(block_hashes))
            for k in range(j + 1, end):
                if pool.has(gid, block_hashes[k]):
                    out.append(TailKeyBoundary(gid, (k + 1) * h))
                    break
            else:
                _vllm_assert(False, f"No tail key found for cache group {gid}")
        return tuple(out)

    def resolve(
        self,
        num_tokens: int,
        block_hashes: Sequence[bytes],
        meta: Sequence[tuple[int, bytes]],
        answers: Sequence[int] | None,
    ) -> V033Result:
        """Answers of ``batch_is_exist`` (``None``: it raised) -> vLLM's lookup result."""
        if not meta or answers is None:
            return V033Result(0)
        pool = _ExistsPool(self.presence(meta, answers))
        token_len = self.align_lookup_length(num_tokens)
        try:
            hit = self._coord.find_longest_cache_hit(block_hashes, token_len, pool)
            if hit >= num_tokens:
                usable = self.align_lookup_length(num_tokens - 1)
                if usable <= 0:
                    return V033Result(0)
                hit = self._coord.find_longest_cache_hit(block_hashes, usable, pool)
            return V033Result(hit, self._tail_key_boundaries(block_hashes, hit, pool))
        except (_VLLMRaised, IndexError) as exc:
            raise InvalidRequest(f"vLLM {self.vllm_version} raises here: {exc!r}") from exc

    def lookup(
        self,
        num_tokens: int,
        block_hashes: Sequence[bytes],
        batch_is_exist: Callable[[list[str]], Sequence[int]],
    ) -> V033Result:
        keys, meta = self.build_keys(num_tokens, block_hashes)
        if not keys:
            return V033Result(0)
        try:
            answers = batch_is_exist(keys)
        except Exception:
            return V033Result(0)
        return self.resolve(num_tokens, block_hashes, meta, answers)
