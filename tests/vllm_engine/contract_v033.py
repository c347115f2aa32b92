"""The plug-in's scheduler-side contract against vLLM 0.33.0's own connector code (run with the
vLLM environment's Python and 0.33's sources first on the path: harness.with_vllm033).

Reads 0.33's classes (the connector, its scheduler, the lookup client it replaces, the result
types) and builds the plug-in's connector in the scheduler role on a real 0.33 ``VllmConfig``
and ``KVCacheConfig``, against the real master of ``MOONCAKE_CONFIG_PATH``; then one blocking
and one non-blocking lookup through 0.33's own ``get_num_new_matched_tokens`` path, and its
shutdown. Prints one JSON line of what it found.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import threading
import time
from typing import Any


def _params(func: Any) -> list[list[Any]]:
    """A callable's parameters as ``[name, kind, has default]`` (annotations left out: the
    plug-in types loosely)."""
    return [
        [p.name, p.kind.name, p.default is not inspect.Parameter.empty]
        for p in inspect.signature(func).parameters.values()
    ]


def main() -> None:
    import torch
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import connector as stock
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        MooncakeLookupResult,
        TailKeyBoundary,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler import (
        MooncakeStoreScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
        LookupKeyClient,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from aio_mclookup.vllm import CoalescingLookupClient, MooncakeStoreConnector

    theirs, ours = stock.MooncakeStoreConnector, MooncakeStoreConnector
    methods = ["__init__", "get_num_new_matched_tokens", "build_connector_meta", "shutdown"]
    report: dict[str, Any] = {
        "vllm_version": vllm.__version__,
        "vllm_file": vllm.__file__,
        "subclass": issubclass(ours, theirs),
        "name": ours.__name__,
        "methods": {m: [_params(getattr(theirs, m)), _params(getattr(ours, m))] for m in methods},
        "client_methods": {
            m: [_params(getattr(LookupKeyClient, m)), _params(getattr(CoalescingLookupClient, m))]
            for m in ("lookup", "discard", "reset", "close")
        },
        "result_fields": [f.name for f in dataclasses.fields(MooncakeLookupResult)],
        "boundary_fields": [f.name for f in dataclasses.fields(TailKeyBoundary)],
        "scheduler_lookup_params": _params(MooncakeStoreScheduler.get_num_new_matched_tokens),
    }

    def build(lookup_async: bool, service: str) -> tuple[Any, Any]:
        cfg = EngineArgs(
            model=sys.argv[1],
            load_format="dummy",
            skip_tokenizer_init=True,
            block_size=32,
            enable_prefix_caching=True,
            kv_transfer_config={
                "kv_connector": "MooncakeStoreConnector",
                "kv_connector_module_path": "aio_mclookup.vllm",
                "kv_role": "kv_consumer",
                "kv_connector_extra_config": {
                    "lookup_async": lookup_async,
                    "aio_mclookup_service": service,
                },
            },
        ).create_engine_config()
        cfg.cache_config.kv_cache_layout = "LBHNC"  # (what the engine core resolves first)
        spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
        kv = KVCacheConfig(
            num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
        )
        return ours(cfg, KVConnectorRole.SCHEDULER, kv), cfg

    class Request:  # what MooncakeStoreScheduler reads of a vLLM request
        def __init__(self, request_id: str, tokens: int) -> None:
            self.request_id = request_id
            self.num_tokens = tokens
            self.block_hashes = [bytes([i % 256]) * 32 for i in range(tokens // 32)]

    import asyncio

    from aio_mclookup import StoreWriter
    from aio_mclookup._scheduler.config import store_settings

    settings = store_settings()  # (the writer stays open: its segment holds the keys)
    writer = StoreWriter(settings.master_address, settings.metadata_server, segment_size=16 << 20)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(writer.open())
    runs: dict[str, Any] = {}
    for mode, service in (("sync", "auto"), ("async", "thread"), ("async, sidecar", "sidecar")):
        connector, _ = build(mode.startswith("async"), service)
        client = connector.lookup_client
        if client is not None and mode == "sync":  # the first 4 blocks stored: a hit of 128
            stored = Request("stored", 128)
            keys = list(client.layout.plan(129, stored.block_hashes).keys)
            loop.run_until_complete(writer.put_keys(keys))
        scheduler = connector.connector_scheduler
        run: dict[str, Any] = {
            "took_over": client is not None and scheduler.client is client,
            "scheduler_type": type(scheduler).__name__,
            "layout": None if client is None else client.layout.to_dict(),
        }
        request = Request(f"{mode}-1", 200)
        answers = [connector.get_num_new_matched_tokens(request, 0)]
        if mode.startswith("async"):
            deadline = time.monotonic() + 10.0
            while answers[-1][0] is None and time.monotonic() < deadline:
                client.wait_for_answers(0.05)  # (what the connector's step end does)
                answers.append(connector.get_num_new_matched_tokens(request, 0))
        run["answers"] = [list(a) for a in answers]
        spec = scheduler.load_specs.get(request.request_id) if scheduler is not None else None
        run["load_spec"] = None if spec is None else type(spec).__name__
        run["channel"] = type(getattr(client, "_channel", None)).__name__
        connector.shutdown()
        run["threads_left"] = sorted(
            t.name for t in threading.enumerate() if t.name.startswith("aio-mclookup")
        )
        runs[mode] = run
    report["runs"] = runs
    loop.run_until_complete(writer.aclose())
    loop.close()
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
