"""aio-mclookup: coalescing asyncio prefix lookups against the Mooncake KV-cache store.

Data flow: :class:`BlockHasher` (token ids to vLLM's block hashes) -> :class:`KVLayout` (the
deployment) -> :meth:`KVLayout.plan` (one request's keys) -> :class:`LookupCoordinator` (many
requests, shared RPCs) -> a :class:`Store` -> resolve (vLLM's hit, :class:`LookupResult`).

Everything public is re-exported here; the underscore modules are private.
"""


from ._coordinator.options import CoordinatorOptions
from ._coordinator.shell import LookupCoordinator
from ._errors import (
    ClosedError,
    Error,
    InternalError,
    InvalidRequest,
    LookupTimeout,
    Overloaded,
    StoreError,
    UnsupportedLayout,
)
from ._hashing import BlockHasher
from ._layout.groups import (
    ChunkedLocalAttention,
    CircularBuffer,
    FullAttention,
    GroupSpec,
    Mamba,
    SlidingWindow,
)
from ._layout.layout import KVLayout
from ._local.master import LocalMaster
from ._local.writer import StoreWriter
from ._observe.prometheus import PROMETHEUS_CONTENT_TYPE, CoordinatorCollector, prometheus_text
from ._observe.stats import CoordinatorStats, Histogram
from ._plan.hashes import HashInput
from ._plan.plan import LookupPlan
from ._resolve.result import LookupResult, TailKeyBoundary
from ._store.fake import FakeStore
from ._store.mooncake import MooncakeStore
from ._store.protocol import CallbackStore, Store

__all__ = [
    "PROMETHEUS_CONTENT_TYPE",
    "BlockHasher",
    "CallbackStore",
    "ChunkedLocalAttention",
    "CircularBuffer",
    "ClosedError",
    "CoordinatorCollector",
    "CoordinatorOptions",
    "CoordinatorStats",
    "Error",
    "FakeStore",
    "FullAttention",
    "GroupSpec",
    "HashInput",
    "Histogram",
    "InternalError",
    "InvalidRequest",
    "KVLayout",
    "LookupCoordinator",
    "LookupPlan",
    "LookupResult",
    "LocalMaster",
    "LookupTimeout",
    "Mamba",
    "MooncakeStore",
    "Overloaded",
    "SlidingWindow",
    "Store",
    "StoreError",
    "StoreWriter",
    "TailKeyBoundary",
    "UnsupportedLayout",
    "prometheus_text",
]

__version__ = "0.1.0"



def _present_as_public() -> None:
    """Classes and functions show as ``aio_mclookup.X`` (in reprs, docs and tracebacks), not
    as the private module that defines them."""
    for name in __all__:
        obj = globals()[name]
        if callable(obj) and getattr(obj, "__module__", "").startswith("aio_mclookup._"):
            obj.__module__ = "aio_mclookup"


_present_as_public()
del _present_as_public
