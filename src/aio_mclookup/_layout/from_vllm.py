"""A layout's inputs read from a running vLLM (0.32 / 0.33): ``KVLayout.from_vllm``.

vLLM's scheduler process holds everything its store worker uses to build lookup keys (the
KV-cache config, the parallel and model configs, the connector's extra config). This module
reads them the way the worker reads them and returns the constructor arguments of a
:class:`~aio_mclookup.KVLayout`; anything it cannot express exactly is refused with
:class:`UnsupportedLayout`, never approximated. vLLM is imported only inside the functions,
so the rest of the package never needs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import UnsupportedLayout
from .groups import (
    ChunkedLocalAttention,
    CircularBuffer,
    FullAttention,
    GroupSpec,
    Mamba,
    SlidingWindow,
)

__all__ = ["check_against_vllm", "layout_arguments", "running_release"]

_RULE_RELEASES = {"0.32": "0.32.0", "0.33": "0.33.0"}
"""vLLM minor releases whose connector the plug-in drives, and the rules each one uses."""


def running_release(version: str) -> str:
    """``vllm.__version__`` (``"0.32.0"``, ``"0.33.1+cpu"``) -> the rules' release
    (``"0.32.0"``); :class:`UnsupportedLayout` for a release without exact rules here."""
    parts = version.split("+", 1)[0].split(".")
    release = _RULE_RELEASES.get(".".join(parts[:2]))
    if release is None:
        raise UnsupportedLayout(
            f"vLLM {version}: the plug-in reproduces the store lookup of vLLM "
            f"{', '.join(_RULE_RELEASES)} only",
            field="vllm_version",
        )
    return release


def _group_spec(spec: Any, *, store: bool, eagle: bool) -> GroupSpec:
    """One KV-cache group's spec (DCP-resolved, uniform specs unwrapped) as a group spec."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    kind = type(spec)
    block = int(spec.block_size)
    if not store:
        # vLLM's lookup skips the group (only later groups' ids move), so its kind is moot.
        return (
            CircularBuffer(block)
            if kind is CircularBufferSpec
            else FullAttention(block, eagle=eagle, prefix_cacheable=False)
        )
    if kind in (FullAttentionSpec, MLAAttentionSpec):
        return FullAttention(block, mla=kind is MLAAttentionSpec, eagle=eagle)
    if kind in (SlidingWindowSpec, SlidingWindowMLASpec):
        return SlidingWindow(
            block,
            int(spec.sliding_window),
            mla=kind is SlidingWindowMLASpec,
            extra_retained_tokens=int(getattr(spec, "extra_retained_tokens", 0)),
            eagle=eagle,
        )
    if kind is ChunkedLocalAttentionSpec:
        return ChunkedLocalAttention(block, int(spec.attention_chunk_size), eagle=eagle)
    if kind is MambaSpec:
        if spec.mamba_cache_mode != "align":
            raise UnsupportedLayout(
                f"a mamba group with mamba_cache_mode={spec.mamba_cache_mode!r}: vLLM's store "
                "connector needs 'align'",
                field="groups",
            )
        return Mamba(block, eagle=eagle)
    raise UnsupportedLayout(
        f"a prefix-cacheable group of spec {kind.__name__}: its lookup rules are not "
        "reproduced here",
        field="groups",
    )


def _unwrapped(spec: Any) -> Any:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return next(iter(spec.kv_cache_specs.values()))
    return spec


def _resolved_cache_layout(vllm_config: Any) -> str:
    """The KV-cache layout's name (``LBHNC``, ...), which the engine core resolves at start."""
    try:
        return str(vllm_config.cache_config.get_resolved_kv_cache_layout().name)
    except ValueError as exc:
        raise UnsupportedLayout(
            f"the store-TP options need the resolved KV-cache layout: {exc}", field="store_tp_size"
        ) from exc


def _store_namespace(
    extra: Mapping[str, Any],
    *,
    cache_layout: Callable[[], str],
    store_groups: list[Any],
    tp: int,
    pcp: int,
    dcp: int,
    pp: int,
    num_kv_heads: int,
) -> tuple[str, int | None]:
    """``(store_namespace, store_tp_size)`` as the worker selects them from the connector's
    store-TP options (docs/layouts.md, "store_namespace and store_tp_size")."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    lcm_flag = extra.get("enable_store_tp_lcm") is True
    if not lcm_flag and extra.get("store_tp_size") is None:
        return "", None
    requested: int | None
    if lcm_flag:
        sizes = extra.get("prefill_tp_sizes")
        ok = isinstance(sizes, list) and sizes and all(type(s) is int and s > 0 for s in sizes)
        requested = math.lcm(*sizes) if ok else None  # type: ignore[misc]
    else:
        value = extra.get("store_tp_size")
        requested = value if type(value) is int and value > 0 else None
    layout_name = cache_layout()  # resolved by the engine core before the scheduler exists
    shardable = (
        layout_name in ("LBHNC", "LBNHC")
        and pcp == 1
        and dcp == 1
        and len(store_groups) == 1
        and type(store_groups[0].kv_cache_spec) is FullAttentionSpec
        and str(extra.get("enable_cross_layers_blocks", "False")).lower() != "true"
    )
    if requested is not None and requested >= tp and requested % tp == 0 and shardable:
        if num_kv_heads % requested == 0:
            return (
                f"@store_tp:{requested}@store_pp:{pp}@store_format:tp_shared_"
                f"{layout_name.lower()}",
                requested,
            )
        if num_kv_heads == 1:
            return f"@store_pp:{pp}@store_format:tp_shared_mqa", None
    return f"@store_pp:{pp}@store_format:rank_local_tp{tp}_layout_{layout_name}", None


def layout_arguments(
    vllm_config: Any, kv_cache_config: Any
) -> tuple[list[GroupSpec], dict[str, Any]]:
    """``(groups, keyword arguments)`` of the :class:`~aio_mclookup.KVLayout` that vLLM's store
    worker uses for this engine; :class:`UnsupportedLayout` where that is not exact."""
    import vllm
    from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_cache_spec, resolve_kv_cache_block_sizes

    release = running_release(str(vllm.__version__))
    transfer = vllm_config.kv_transfer_config
    extra: Mapping[str, Any] = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
    parallel = vllm_config.parallel_config
    tp = int(parallel.tensor_parallel_size)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1))
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1))
    pp = int(parallel.pipeline_parallel_size)
    model_config = vllm_config.model_config
    num_kv_heads = int(model_config.get_total_num_kv_heads())

    scheduler_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    store_ids = set(kv_cache_config.prefix_cacheable_group_ids)
    groups = [
        _group_spec(
            resolve_dcp_kv_cache_spec(_unwrapped(g.kv_cache_spec), dcp)
            if i in store_ids
            else _unwrapped(g.kv_cache_spec),
            store=i in store_ids,
            eagle=bool(g.is_eagle_group),
        )
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
    ]
    spec_config = vllm_config.speculative_config
    namespace, store_tp = _store_namespace(
        extra,
        cache_layout=lambda: _resolved_cache_layout(vllm_config),
        store_groups=list(kv_cache_config.prefix_cacheable_groups),
        tp=tp,
        pcp=pcp,
        dcp=dcp,
        pp=pp,
        num_kv_heads=num_kv_heads,
    )
    return groups, {
        "model": str(model_config.model),
        "cache_prefix": str(extra.get("cache_prefix", "")),
        "hash_block_size": int(hash_block),
        "scheduler_block_size": int(scheduler_block),
        "use_eagle": bool(spec_config is not None and spec_config.use_eagle_block_drop()),
        "tp_size": tp,
        "pcp_size": pcp,
        "dcp_size": dcp,
        "pp_size": pp,
        "num_kv_heads": num_kv_heads,
        "vllm_version": release,
        "cache_hit_alignment_tokens": kv_cache_config.cache_hit_alignment_tokens,
        "store_namespace": namespace,
        "store_tp_size": store_tp,
    }


def check_against_vllm(layout: Any, vllm_config: Any, kv_cache_config: Any) -> None:
    """Compare what the layout derived with what vLLM's own store coordinator derives for the
    same engine (merged spec-groups in search order, their EAGLE flags, fine-grained hits,
    the lookup alignment); :class:`UnsupportedLayout` on any difference."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
        MooncakeStoreCoordinator,
    )

    coordinator = MooncakeStoreCoordinator.from_kv_cache_config(
        kv_cache_config, vllm_config, layout.scheduler_block_size, layout.hash_block_size
    )
    theirs = (
        tuple((tuple(g.group_ids), bool(g.use_eagle)) for g in coordinator.attention_groups),
        bool(coordinator.enable_partial_hash_hits),
        coordinator.align_lookup_length(10**9 - 1),
    )
    ours = (
        tuple((tuple(ids), bool(eagle)) for ids, eagle in layout.spec_groups),
        bool(layout.fine_grained),
        (10**9 - 1) // layout.lookup_alignment * layout.lookup_alignment,
    )
    if ours != theirs:
        raise UnsupportedLayout(
            f"the layout read from vLLM ({ours}: spec-groups, fine-grained, alignment) differs "
            f"from what vLLM's store coordinator derives ({theirs})",
            field="groups",
        )
