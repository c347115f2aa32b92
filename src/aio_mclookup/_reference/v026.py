"""Speed baseline: an un-optimised pure-Python re-implementation of vLLM 0.26.0's
Mooncake-store worker-side prefix lookup.

This module is deliberately *not* fast.  It is written from the behavioural
specification in ``lookup-semantics.md`` (Era B, vLLM 0.26.0) and keeps the
same *shape* of work that the real worker does, so that timing it gives a
representative "what vLLM costs" figure for our benchmarks:

* key prefixes are rendered once per group at construction time (what
  ``_init_lookup_key_prefixes`` does since 0.25.0);
* every lookup rebuilds the per-group lookup masks as Python ``list[bool]``
  with a per-block Python loop (``lookup_mask`` / ``reachable_block_mask``);
* chunk hashes are read through a lazy "last sub-hash of the chunk" view
  object with a method call per element (the compact chunk-hash view);
* the candidate loop is a per-chunk Python loop that tests the mask *before*
  touching the hash, then renders ``hash.hex()`` and concatenates strings;
* the answers are folded into a ``set`` of ``(group, hash bytes)`` and the hit
  is derived by per-manager Python loops that build block lists, driven by the
  spec-group convergence loop of the store coordinator.

No numpy, no caching across calls.  It is the reference the benchmarks and
``aio-mclookup loadgen --compare`` measure against ("seed-naive"), and an independent
oracle for the property tests; the library proper does not use it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["BaselineLookup"]


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


class _Block:
    """Stand-in for a KV-cache block object (only identity matters)."""

    __slots__ = ("block_id",)

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id


_FULL = "full_attention"
_SWA = "sliding_window"
_CHUNKED = "chunked_local"
_MAMBA = "mamba"
_KINDS = (_FULL, _SWA, _CHUNKED, _MAMBA)


class _Spec:
    """Hashable/comparable description of one KV-cache group's spec.

    Two groups whose entries carry identical fields are equal specs and are
    merged into one spec-group by the coordinator.
    """

    __slots__ = ("attention_chunk_size", "block_size", "kind", "sliding_window")

    def __init__(
        self,
        kind: str,
        block_size: int,
        sliding_window: int | None = None,
        attention_chunk_size: int | None = None,
    ) -> None:
        self.kind = kind
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.attention_chunk_size = attention_chunk_size

    def _key(self) -> tuple[Any, ...]:
        return (self.kind, self.block_size, self.sliding_window, self.attention_chunk_size)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Spec) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"_Spec{self._key()!r}"


# --------------------------------------------------------------------------
# compact chunk-hash view ("last sub-hash of each chunk")
# --------------------------------------------------------------------------


class _ChunkHashView:
    """Lazy view: element i is ``hashes[i*s + s - 1]`` with ``s = B / h``.

    Length is ``len(hashes) // s`` so a partial trailing chunk has no hash.
    Every element access goes through a method call, like the real view.
    """

    def __init__(self, block_hashes: Sequence[bytes], hash_block_size: int, block_size: int):
        assert block_size % hash_block_size == 0
        self.block_hashes = block_hashes
        self.scale_factor = block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def _get_value_at(self, idx: int) -> bytes:
        return self.block_hashes[idx * self.scale_factor + self.scale_factor - 1]

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, int):
            return self._get_value_at(idx)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            return [self._get_value_at(i) for i in range(start, stop, step)]
        raise TypeError(f"Invalid index type: {type(idx)!r}")

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
    """Answers "is this chunk hash cached for all of these groups"."""

    def __init__(self, hash_block_size: int, exists: set[tuple[int, bytes]] | None) -> None:
        self._exists = exists
        self.hash_block_size = hash_block_size
        self.null_block = _Block(0)
        self._present_block = _Block(1)

    def get_cached_block(self, block_hash: Any, group_ids: list[int]) -> list[_Block] | None:
        if self._exists is None:
            return [self._present_block] * len(group_ids)
        h = bytes(block_hash)
        if all((g, h) in self._exists for g in group_ids):
            return [self._present_block] * len(group_ids)
        return None


# --------------------------------------------------------------------------
# per-spec managers: reachable masks and hit search (block lists shaped like vLLM's)
# --------------------------------------------------------------------------


def _swa_need(spec: _Spec, use_eagle: bool) -> int:
    assert spec.sliding_window is not None
    need = _cdiv(spec.sliding_window - 1, spec.block_size)
    if use_eagle:
        need += 1
    return need


def _dense_reachable_block_mask(
    start_block: int,
    end_block: int,
    alignment_tokens: int | None,
    kv_cache_spec: _Spec,
    use_eagle: bool,
    retention_interval: int | None = None,
    reachable_boundaries: Sequence[int] = (),
) -> list[bool] | None:
    """Full attention, chunked local and (dense) Mamba: every block is a candidate."""
    return None


def _swa_reachable_block_mask(
    start_block: int,
    end_block: int,
    alignment_tokens: int | None,
    kv_cache_spec: _Spec,
    use_eagle: bool,
    retention_interval: int | None = None,
    reachable_boundaries: Sequence[int] = (),
) -> list[bool] | None:
    """Sliding window: the ``need`` blocks ending at each aligned boundary.

    Only the lookup form (``retention_interval=None``, dense segments) is
    implemented; the store-side sparse retention variants are not needed here.
    """
    assert retention_interval is None
    if alignment_tokens is None:
        return None
    spec = kv_cache_spec
    block_size = spec.block_size
    assert alignment_tokens % block_size == 0
    need = _swa_need(spec, use_eagle)
    shift = 1 if use_eagle else 0
    mask = [False] * (end_block - start_block)
    per_segment = alignment_tokens // block_size
    if need >= per_segment:
        return None
    for i in range(start_block, end_block):
        if i >= shift and (i - shift) % per_segment >= per_segment - need:
            mask[i - start_block] = True
    return mask


def _hit_full(
    block_hashes: Sequence[bytes],
    max_length: int,
    kv_cache_group_ids: list[int],
    block_pool: _ExistsPool,
    kv_cache_spec: _Spec,
    drop_eagle_block: bool,
    alignment_tokens: int,
) -> tuple[tuple[list[_Block], ...], int]:
    computed: tuple[list[_Block], ...] = tuple([] for _ in range(len(kv_cache_group_ids)))
    block_size = kv_cache_spec.block_size
    max_num_blocks = max_length // block_size
    for block_hash in itertools.islice(block_hashes, max_num_blocks):
        cached = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
        if not cached:
            break
        for blocks, blk in zip(computed, cached, strict=False):
            blocks.append(blk)
    if drop_eagle_block and computed[0]:
        for blocks in computed:
            blocks.pop()
    while block_size != alignment_tokens and len(computed[0]) * block_size % alignment_tokens != 0:
        for blocks in computed:
            blocks.pop()
    return computed, len(computed[0]) * block_size


def _hit_swa(
    block_hashes: Sequence[bytes],
    max_length: int,
    kv_cache_group_ids: list[int],
    block_pool: _ExistsPool,
    kv_cache_spec: _Spec,
    drop_eagle_block: bool,
    alignment_tokens: int,
) -> tuple[tuple[list[_Block], ...], int]:
    need = _swa_need(kv_cache_spec, drop_eagle_block)
    block_size = kv_cache_spec.block_size
    max_num_blocks = max_length // block_size
    computed: tuple[list[_Block], ...] = tuple(
        [block_pool.null_block] * max_num_blocks for _ in range(len(kv_cache_group_ids))
    )
    run = 0
    found = False
    for i in range(max_num_blocks - 1, -1, -1):
        cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
        if cached:
            if run == 0 and block_size != alignment_tokens:
                blocks_after_pop = i if drop_eagle_block else i + 1
                if (blocks_after_pop * block_size) % alignment_tokens != 0:
                    continue
            for blocks, blk in zip(computed, cached, strict=False):
                blocks[i] = blk
            run += 1
            if run >= need:
                for blocks in computed:
                    del blocks[i + run :]
                found = True
                break
        else:
            run = 0
    if not found:
        # The leading run (starting at block 0) is a hit even if shorter than
        # the window: nothing before it is needed.
        for blocks in computed:
            del blocks[run:]
        while (
            block_size != alignment_tokens and len(computed[0]) * block_size % alignment_tokens != 0
        ):
            for blocks in computed:
                blocks.pop()
    if drop_eagle_block and computed[0]:
        for blocks in computed:
            blocks.pop()
        while (
            block_size != alignment_tokens and len(computed[0]) * block_size % alignment_tokens != 0
        ):
            for blocks in computed:
                blocks.pop()
    return computed, len(computed[0]) * block_size


def _hit_chunked_local(
    block_hashes: Sequence[bytes],
    max_length: int,
    kv_cache_group_ids: list[int],
    block_pool: _ExistsPool,
    kv_cache_spec: _Spec,
    drop_eagle_block: bool,
    alignment_tokens: int,
) -> tuple[tuple[list[_Block], ...], int]:
    assert drop_eagle_block is False, "eagle + chunked local attention is not supported"
    assert kv_cache_spec.block_size == alignment_tokens, (
        "chunked local attention requires block_size == alignment_tokens"
    )
    chunk = kv_cache_spec.attention_chunk_size
    assert chunk is not None
    block_size = kv_cache_spec.block_size
    max_num_blocks = max_length // block_size
    # Every block before the start of the current local-attention chunk is out
    # of the window: it counts as a hit without being looked at.
    local_start = max_length // chunk * chunk if max_length > 0 else 0
    local_start_block = local_start // block_size
    computed: tuple[list[_Block], ...] = tuple(
        [block_pool.null_block] * local_start_block for _ in range(len(kv_cache_group_ids))
    )
    for i in range(local_start_block, max_num_blocks):
        cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
        if cached:
            for blocks, blk in zip(computed, cached, strict=False):
                blocks.append(blk)
        else:
            break
    return computed, len(computed[0]) * block_size


def _hit_mamba(
    block_hashes: Sequence[bytes],
    max_length: int,
    kv_cache_group_ids: list[int],
    block_pool: _ExistsPool,
    kv_cache_spec: _Spec,
    drop_eagle_block: bool,
    alignment_tokens: int,
) -> tuple[tuple[list[_Block], ...], int]:
    # vLLM 0.26 ("align" mode, coarse path): right-to-left, first present block
    # whose end is alignment-aligned.  ``drop_eagle_block`` is accepted and
    # ignored: 0.26 does not pop a Mamba state for EAGLE, and together with the
    # coordinator's ``+block_size`` look-ahead this lets a Mamba group "absorb"
    # the full-attention EAGLE drop (full16 + mamba16, all present, T=64 -> 64).
    computed: tuple[list[_Block], ...] = tuple([] for _ in range(len(kv_cache_group_ids)))
    block_size = kv_cache_spec.block_size
    hit_length = 0
    max_num_blocks = max_length // block_size
    for i in range(max_num_blocks - 1, -1, -1):
        cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
        if cached:
            if block_size != alignment_tokens and (i + 1) * block_size % alignment_tokens != 0:
                continue
            for blocks, blk in zip(computed, cached, strict=False):
                blocks.extend([block_pool.null_block] * i)
                blocks.append(blk)
            hit_length = (i + 1) * block_size
            break
    return computed, hit_length


_MASKS: dict[str, Callable[..., list[bool] | None]] = {
    _FULL: _dense_reachable_block_mask,
    _SWA: _swa_reachable_block_mask,
    _CHUNKED: _dense_reachable_block_mask,
    _MAMBA: _dense_reachable_block_mask,
}

_MANAGERS: dict[str, Callable[..., tuple[tuple[list[_Block], ...], int]]] = {
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
        scheduler_block_size: int,
        hash_block_size: int,
        use_eagle: bool,
    ) -> None:
        assert all(s.block_size % hash_block_size == 0 for s in group_specs), (
            "block_size must be divisible by hash_block_size"
        )
        assert scheduler_block_size % hash_block_size == 0, (
            "scheduler_block_size must be a multiple of hash_block_size"
        )
        assert all(scheduler_block_size % s.block_size == 0 for s in group_specs), (
            "scheduler_block_size must be a multiple of each group's block_size"
        )
        self.group_specs = group_specs
        self.hash_block_size = hash_block_size
        self.lcm_block_size = scheduler_block_size
        self.use_eagle = use_eagle
        # No group carries an explicit EAGLE flag here, so use_eagle applies to all.
        self.eagle_group_ids: set[int] = set(range(len(group_specs))) if use_eagle else set()

        spec_groups: list[tuple[_Spec, list[int]]] = []
        for i, spec in enumerate(group_specs):
            for existing, ids in spec_groups:
                if existing == spec:
                    ids.append(i)
                    break
            else:
                spec_groups.append((spec, [i]))
        # Stable sort: full-attention spec-groups first.
        self.spec_groups = sorted(spec_groups, key=lambda x: x[0].kind != _FULL)
        self.eagle_spec_group_indices: set[int] = (
            set(range(len(self.spec_groups))) if use_eagle else set()
        )

    # -- masks --------------------------------------------------------------
    def lookup_mask(self, aligned_token_len: int) -> tuple[list[bool] | None, ...]:
        assert aligned_token_len % self.lcm_block_size == 0, (
            f"aligned_token_len ({aligned_token_len}) must be a multiple of "
            f"lcm_block_size ({self.lcm_block_size})"
        )
        start_token = 0
        masks: list[list[bool] | None] = []
        for g_idx, spec in enumerate(self.group_specs):
            end_chunk = aligned_token_len // spec.block_size
            start_chunk = min(end_chunk, max(0, _cdiv(start_token, spec.block_size)))
            mask_fn = _MASKS[spec.kind]
            mask = mask_fn(
                start_block=start_chunk,
                end_block=end_chunk,
                alignment_tokens=self.lcm_block_size,
                kv_cache_spec=spec,
                use_eagle=g_idx in self.eagle_group_ids,
                retention_interval=None,
                reachable_boundaries=(),
            )
            if mask is not None:
                assert len(mask) == end_chunk - start_chunk
            masks.append(mask)
        return tuple(masks)

    def block_hashes_for_spec(self, block_hashes: Sequence[bytes], spec: _Spec) -> Sequence[bytes]:
        return _chunk_hashes_for_block_size(block_hashes, self.hash_block_size, spec.block_size)

    # -- hit search ---------------------------------------------------------
    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int, pool: _ExistsPool
    ) -> tuple[tuple[list[bool], ...], int]:
        blocks_per_group, hit_length = self._find_hit_blocks(block_hashes, max_length, pool)
        masks = tuple([blk is not pool.null_block for blk in blocks] for blocks in blocks_per_group)
        return masks, hit_length

    def _find_hit_blocks(
        self, block_hashes: Sequence[bytes], max_length: int, pool: _ExistsPool
    ) -> tuple[tuple[list[_Block], ...], int]:
        eagle_indices = self.eagle_spec_group_indices
        num_groups = len(self.group_specs)
        if len(self.spec_groups) == 1:
            spec, group_ids = self.spec_groups[0]
            hashes = self.block_hashes_for_spec(block_hashes, spec)
            manager = _MANAGERS[spec.kind]
            hit_blocks, hit_length = manager(
                block_hashes=hashes,
                max_length=max_length,
                kv_cache_group_ids=group_ids,
                block_pool=pool,
                kv_cache_spec=spec,
                drop_eagle_block=(0 in eagle_indices),
                alignment_tokens=spec.block_size,  # single spec-group: the spec's own block
            )
            by_group: list[list[_Block]] = [[] for _ in range(num_groups)]
            for gid, blks in zip(group_ids, hit_blocks, strict=True):
                by_group[gid] = blks
            return tuple(by_group), hit_length

        hit_length = max_length
        hit_blocks_by_group: list[list[_Block] | None] = [None] * num_groups
        hit_length_by_group: list[int] = [0] * num_groups
        is_simple_hybrid = len(self.spec_groups) == 2 and self.spec_groups[0][0].kind == _FULL
        eagle_verified: set[int] = set()

        while True:
            curr = hit_length
            for idx, (spec, group_ids) in enumerate(self.spec_groups):
                first = group_ids[0]
                if spec.kind == _FULL and hit_blocks_by_group[first] is not None:
                    curr = min(curr, hit_length_by_group[first])
                    continue
                drop_eagle = idx in eagle_indices and idx not in eagle_verified
                group_max = curr
                if drop_eagle:
                    group_max = min(curr + spec.block_size, max_length)
                hashes = self.block_hashes_for_spec(block_hashes, spec)
                manager = _MANAGERS[spec.kind]
                hit_blocks, new_hit = manager(
                    block_hashes=hashes,
                    max_length=group_max,
                    kv_cache_group_ids=group_ids,
                    block_pool=pool,
                    kv_cache_spec=spec,
                    drop_eagle_block=drop_eagle,
                    alignment_tokens=self.lcm_block_size,
                )
                if drop_eagle:
                    eagle_verified.add(idx)
                elif new_hit < curr:
                    eagle_verified.clear()
                curr = new_hit
                for gid, blocks in zip(group_ids, hit_blocks, strict=True):
                    hit_blocks_by_group[gid] = blocks
                    hit_length_by_group[gid] = new_hit
            if curr >= hit_length:
                break
            hit_length = curr
            if is_simple_hybrid:
                break

        spec0, group_ids0 = self.spec_groups[0]
        if spec0.kind == _FULL:
            num_blocks = hit_length // spec0.block_size
            for gid in group_ids0:
                kept = hit_blocks_by_group[gid]
                assert kept is not None
                del kept[num_blocks:]
                hit_length_by_group[gid] = hit_length
        return tuple(b if b is not None else [] for b in hit_blocks_by_group), hit_length


# --------------------------------------------------------------------------
# worker-side lookup
# --------------------------------------------------------------------------


def _build_prefix(
    cache_prefix: str, model_name: str, tp: int, pcp: int, dcp: int, pp: int, group: int
) -> str:
    head = f"{cache_prefix}@" if cache_prefix else ""
    return f"{head}{model_name}@tp_rank:{tp}@pcp{pcp}@dcp{dcp}@pp_rank:{pp}@group:{group}"


class _PoolKey:
    """Key rendering helpers (``<prefix>@<hash hex>``)."""

    @staticmethod
    def build_prefix(
        cache_prefix: str, model_name: str, tp: int, pcp: int, dcp: int, pp: int, group: int
    ) -> str:
        return _build_prefix(cache_prefix, model_name, tp, pcp, dcp, pp, group)

    @staticmethod
    def build_key_string(key_prefix: str, chunk_hash: str) -> str:
        return f"{key_prefix}@{chunk_hash}"


class BaselineLookup:
    """vLLM 0.26.0 worker ``lookup`` (Era B) re-implemented, un-optimised."""

    def __init__(self, config: dict[str, Any]) -> None:
        groups = config["groups"]
        if not groups:
            raise ValueError("config needs at least one group")
        self.hash_block_size = int(config["hash_block_size"])
        self.block_size = int(config["scheduler_block_size"])  # L
        self.use_eagle = bool(config.get("use_eagle", False))
        self.tp_size = int(config.get("tp_size", 1))
        self.pcp_size = int(config.get("pcp_size", 1))
        self.dcp_size = int(config.get("dcp_size", 1))
        self.pp_size = int(config.get("pp_size", 1))
        self.num_kv_head = int(config.get("num_kv_heads", 1))
        self.cache_prefix = str(config.get("cache_prefix", "") or "")
        self.model_name = str(config["model"]).rstrip("/").split("/")[-1]

        specs: list[_Spec] = []
        for g in groups:
            kind = g["kind"]
            if kind not in _KINDS:
                raise ValueError(f"unknown group kind {kind!r}")
            specs.append(
                _Spec(
                    kind,
                    int(g["block_size"]),
                    g.get("sliding_window") if kind == _SWA else None,
                    g.get("attention_chunk_size") if kind == _CHUNKED else None,
                )
            )
        # Block sizes in the config are the worker's (after vLLM's single-group DCP/PCP
        # rescale), as KVLayout.from_dict takes them.
        self.group_specs = specs
        self.group_block_sizes = [s.block_size for s in specs]
        self._coord = _Coordinator(specs, self.block_size, self.hash_block_size, self.use_eagle)
        self._init_lookup_key_prefixes()

    def _init_lookup_key_prefixes(self) -> None:
        if self.dcp_size > 1:
            namespaces = [
                (tp, pcp, tp % self.dcp_size, pp)
                for pcp in range(self.pcp_size)
                for tp in range(self.tp_size)
                for pp in range(self.pp_size)
            ]
        else:
            tp_count = min(self.tp_size, self.num_kv_head)
            namespaces = [
                (tp, pcp, 0, pp)
                for pcp in range(self.pcp_size)
                for tp in range(tp_count)
                for pp in range(self.pp_size)
            ]
        self._lookup_key_prefixes: tuple[tuple[str, ...], ...] = tuple(
            tuple(
                _PoolKey.build_prefix(self.cache_prefix, self.model_name, tp, pcp, dcp, pp, g_idx)
                for (tp, pcp, dcp, pp) in namespaces
            )
            for g_idx in range(len(self.group_specs))
        )
        self._lookup_expected_per_key = len(namespaces)

    # -- phase 1: candidate keys -------------------------------------------
    def build_keys(
        self, token_len: int, block_hashes: Sequence[bytes]
    ) -> tuple[list[str], list[tuple[int, bytes]]]:
        if not block_hashes or token_len <= 0:
            return [], []
        coord = self._coord
        masks = coord.lookup_mask(token_len)
        candidate_keys: list[str] = []
        candidate_meta: list[tuple[int, bytes]] = []
        for g_idx, spec in enumerate(self.group_specs):
            block_size = spec.block_size
            mask = masks[g_idx]
            chunk_hashes = coord.block_hashes_for_spec(block_hashes, spec)
            max_chunks = min(len(chunk_hashes), _cdiv(token_len, block_size))
            limit = max_chunks if mask is None else min(max_chunks, len(mask))
            for c in range(limit):
                # The mask is consulted before the hash is touched (vLLM #47317).
                if mask is not None and not mask[c]:
                    continue
                h = chunk_hashes[c]
                hx = h.hex()
                for prefix in self._lookup_key_prefixes[g_idx]:
                    candidate_keys.append(_PoolKey.build_key_string(prefix, hx))
                candidate_meta.append((g_idx, bytes(h)))
        return candidate_keys, candidate_meta

    # -- phase 2: answers -> hit length -----------------------------------
    def resolve(
        self,
        token_len: int,
        block_hashes: Sequence[bytes],
        meta: list[tuple[int, bytes]],
        answers: Sequence[int],
    ) -> int:
        if not meta:
            return 0
        k = self._lookup_expected_per_key
        exists: set[tuple[int, bytes]] = set()
        for i, item in enumerate(meta):
            if all(answers[i * k + j] == 1 for j in range(k)):
                exists.add(item)
        _, hit = self._coord.find_longest_cache_hit(
            block_hashes, token_len, _ExistsPool(self.hash_block_size, exists)
        )
        return hit

    def lookup(
        self,
        token_len: int,
        block_hashes: Sequence[bytes],
        batch_is_exist: Callable[[list[str]], list[int]],
    ) -> int:
        keys, meta = self.build_keys(token_len, block_hashes)
        if not keys:
            return 0
        try:
            answers = batch_is_exist(keys)
        except Exception:
            return 0
        return self.resolve(token_len, block_hashes, meta, answers)
