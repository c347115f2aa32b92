"""``KVLayout.from_vllm`` on real vLLM objects (run with the vLLM environment's Python).

One real ``VllmConfig`` (the tiny model of the engine tier, built by vLLM's own ``EngineArgs``)
and real ``KVCacheConfig`` objects of several layouts, with parallel sizes and connector options
set as vLLM's engine core would have them. Prints one JSON line: per case, the layout dict or
the error's type and message.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any


def _worker_prefixes(cfg: Any, kv: Any) -> list[list[str]]:
    """The lookup key prefixes vLLM's own store worker computes for this engine: its
    ``__init__`` steps that derive them, run on a worker object with no store."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
        MooncakeStoreCoordinator,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
        MooncakeStoreWorker,
    )
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    parallel = cfg.parallel_config
    extra = cfg.kv_transfer_config.kv_connector_extra_config
    w = object.__new__(MooncakeStoreWorker)
    w.tp_rank, w.tp_size = 0, parallel.tensor_parallel_size
    w.pp_rank, w.pp_size = 0, parallel.pipeline_parallel_size
    w.pcp_rank, w.pcp_size = 0, parallel.prefill_context_parallel_size
    w.dcp_rank, w.dcp_size = 0, parallel.decode_context_parallel_size
    w.num_kv_head = cfg.model_config.get_total_num_kv_heads()
    w.cache_config = cfg.cache_config
    w.block_size, w.hash_block_size = resolve_kv_cache_block_sizes(kv, cfg)
    w.coord = MooncakeStoreCoordinator.from_kv_cache_config(
        kv, cfg, w.block_size, w.hash_block_size
    )
    w._kv_cache_groups = w.coord.kv_cache_groups
    w.store_tp_size, namespace, layout_cls = w._select_store_layout(extra)
    metadata = KeyMetadata(
        model_name=cfg.model_config.model.rstrip("/").split("/")[-1],
        tp_rank=0,
        pcp_rank=0,
        dcp_rank=0,
        pp_rank=0,
        cache_prefix=str(extra.get("cache_prefix", "")),
        store_namespace=namespace,
    )
    w._group_tp_replication_factors = w._compute_group_tp_replication_factors()
    w.token_dbs = w._build_token_databases(metadata, layout_cls)
    w._init_lookup_key_prefixes()
    return [list(p) for p in w._lookup_key_prefixes]


def main() -> None:
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import (
        CrossAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    from aio_mclookup import KVLayout

    base = EngineArgs(
        model=sys.argv[1],
        load_format="dummy",
        skip_tokenizer_init=True,
        block_size=32,
        enable_prefix_caching=True,
        kv_transfer_config={"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"},
    ).create_engine_config()
    base.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves first
    bf16 = torch.bfloat16

    def full(b: int = 32) -> Any:
        return FullAttentionSpec(block_size=b, num_kv_heads=2, head_size=64, dtype=bf16)

    def mla(b: int = 32) -> Any:
        return MLAAttentionSpec(block_size=b, num_kv_heads=1, head_size=64, dtype=bf16)

    def swa(w: int, b: int = 32, extra: int = 0) -> Any:
        return SlidingWindowSpec(
            block_size=b,
            num_kv_heads=2,
            head_size=64,
            dtype=bf16,
            sliding_window=w,
            extra_retained_tokens=extra,
        )

    def mamba(b: int, mode: str = "align") -> Any:
        return MambaSpec(
            block_size=b, shapes=((4, 4),), dtypes=(torch.float32,), mamba_cache_mode=mode
        )

    def case(
        groups: list[Any],
        *,
        tp: int = 1,
        dcp: int = 1,
        extra: dict[str, Any] | None = None,
        eagle: tuple[int, ...] = (),
        no_transfer: tuple[int, ...] = (),
        hash_block: int | None = None,
        alignment: int | None = None,
        version: str | None = None,
    ) -> dict[str, Any]:
        cfg = copy.deepcopy(base)
        cfg.parallel_config.tensor_parallel_size = tp
        cfg.parallel_config.decode_context_parallel_size = dcp
        cfg.kv_transfer_config.kv_connector_extra_config = dict(extra or {})
        if hash_block is not None:
            cfg.cache_config.prefix_match_unit = hash_block
        kv = KVCacheConfig(
            num_blocks=16,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    [f"layer{i}"],
                    spec,
                    is_eagle_group=i in eagle,
                    enable_kv_transfer=i not in no_transfer,
                )
                for i, spec in enumerate(groups)
            ],
            cache_hit_alignment_tokens=alignment,
        )
        import vllm

        saved = vllm.__version__
        if version is not None:
            vllm.__version__ = version
        try:
            layout = KVLayout.from_vllm(cfg, kv)
            return {
                "layout": layout.to_dict(),
                "prefixes": [list(p) for p in layout.key_prefixes],
                "vllm_prefixes": _worker_prefixes(cfg, kv),
            }
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        finally:
            vllm.__version__ = saved

    uniform = UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={"a": full(), "b": full()})
    cases = {
        "full": case([full()]),
        "full, cache prefix, tp 2": case([full()], tp=2, extra={"cache_prefix": "p"}),
        "hybrid full + swa + mamba": case([full(32), swa(128), mamba(64)], hash_block=32),
        "mla, tp 4": case([mla()], tp=4),
        "mla + gqa, tp 4": case([mla(), full()], tp=4),
        "eagle group": case([full(), full()], eagle=(1,)),
        "not transferred": case([full(), swa(64)], no_transfer=(1,)),
        "uniform specs": case([uniform]),
        "swa extra retained": case([full(), swa(64, extra=32)]),
        "dcp 2": case([full()], tp=2, dcp=2),
        "store tp 2 of tp 1": case([full()], extra={"store_tp_size": 2}),
        "store tp 4 of tp 2": case([full()], tp=2, extra={"store_tp_size": 4}),
        "store tp, rank-local": case([full()], tp=2, extra={"store_tp_size": 3}),
        "store tp lcm": case(
            [full()], tp=2, extra={"enable_store_tp_lcm": True, "prefill_tp_sizes": [2, 4]}
        ),
        "fine-grained": case([full(32), mamba(64)], hash_block=32, alignment=32),
        "cross attention": case(
            [CrossAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=bf16)]
        ),
        "mamba not align": case([full(), mamba(32, mode="all")]),
        "vllm 0.31": case([full()], version="0.31.0"),
        "vllm 0.33": case([full()], version="0.33.0"),
    }
    print("RESULT " + json.dumps(cases), flush=True)


if __name__ == "__main__":
    main()
