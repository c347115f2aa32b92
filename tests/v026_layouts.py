"""``KVLayout`` pinned to vLLM 0.26 for the test modules that test that release's rules
(layouts default to the latest supported release, 0.33)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aio_mclookup as mcl


class KVLayout(mcl.KVLayout):
    """A :class:`aio_mclookup.KVLayout` whose ``vllm_version`` defaults to ``"0.26.0"``."""

    def __init__(self, *args: Any, vllm_version: str = "0.26.0", **kw: Any) -> None:
        super().__init__(*args, vllm_version=vllm_version, **kw)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> mcl.KVLayout:
        if isinstance(cfg, Mapping) and "vllm_version" not in cfg:
            cfg = {**cfg, "vllm_version": "0.26.0"}
        return super().from_dict(cfg)


class LookupCoordinator(mcl.LookupCoordinator):
    """A :class:`aio_mclookup.LookupCoordinator` whose ``lookup(n, hashes)`` is vLLM 0.26's
    *worker* answer for the aligned length ``n`` (``lookup_result(n, ...).hit_length``, before
    the scheduler's leave-one-token rule): what the modules testing the coordinator's probing on
    0.26 layouts compare. The public ``lookup`` (the scheduler's count) is tested in
    test_coordinator_api.py."""

    async def lookup(  # type: ignore[override]
        self, num_tokens: int, block_hashes: mcl.HashInput, **kw: Any
    ) -> int:
        layout = kw.get("layout") or self.layout
        if isinstance(layout, mcl.KVLayout) and layout.vllm_version == "0.26.0":
            layout.plan(num_tokens, block_hashes)  # the worker's checks: aligned lengths only
        return (await self.lookup_result(num_tokens, block_hashes, **kw)).hit_length
