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
