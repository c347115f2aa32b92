"""aio-mclookup: coalescing asyncio prefix lookups against the Mooncake KV-cache store.

Data flow: :class:`KVLayout` (the model) -> :meth:`KVLayout.plan` (one request's keys) ->
:class:`LookupCoordinator` (many requests, shared RPCs) -> a :class:`Store` -> resolve (hit).
"""

from __future__ import annotations

import contextlib

from ._coordinator.options import CoordinatorOptions
from ._coordinator.shell import LookupCoordinator
from ._errors import ClosedError, Error, InvalidRequest, LookupTimeout, Overloaded, StoreError
from ._layout.groups import ChunkedLocalAttention, FullAttention, GroupSpec, Mamba, SlidingWindow
from ._layout.layout import KVLayout
from ._local.master import LocalMaster
from ._local.writer import StoreWriter
from ._observe.prometheus import PROMETHEUS_CONTENT_TYPE, prometheus_text
from ._observe.stats import CoordinatorStats, Histogram
from ._plan.hashes import HashInput
from ._plan.plan import LookupPlan
from ._store.fake import FakeStore
from ._store.mooncake import MooncakeStore
from ._store.protocol import CallbackStore, Store

__all__ = [
    "PROMETHEUS_CONTENT_TYPE",
    "CallbackStore",
    "ChunkedLocalAttention",
    "ClosedError",
    "CoordinatorOptions",
    "CoordinatorStats",
    "Error",
    "FakeStore",
    "FullAttention",
    "GroupSpec",
    "HashInput",
    "Histogram",
    "InvalidRequest",
    "KVLayout",
    "LookupCoordinator",
    "LookupPlan",
    "LocalMaster",
    "LookupTimeout",
    "Mamba",
    "MooncakeStore",
    "Overloaded",
    "SlidingWindow",
    "Store",
    "StoreError",
    "StoreWriter",
    "prometheus_text",
]

__version__ = "0.1.0"

for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("aio_mclookup._"):
        with contextlib.suppress(AttributeError, TypeError):
            _obj.__module__ = "aio_mclookup"
