"""aio-mclookup: coalescing asyncio prefix lookups against the Mooncake KV-cache store.

Data flow: :class:`BlockHasher` (token ids to vLLM's block hashes) -> :class:`KVLayout` (the
deployment) -> :meth:`KVLayout.plan` (one request's keys) -> :class:`LookupCoordinator` (many
requests, shared RPCs) -> a :class:`Store` -> resolve (vLLM's hit, :class:`LookupResult`).
SGLang HiCache deployments: :class:`SGLangLayout` (its ``page_hashes`` and ``plan``) in the
same coordinator.

Everything public is re-exported here; the underscore modules are private. The names a
lookup does not need (the block hasher, the embedded master and its writer, Prometheus) load on
first use: a process that only plans and looks up keeps a smaller heap, which every garbage
collection walks (docs/design.md).
"""

import importlib as _importlib
import typing as _typing

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
from ._layout.groups import (
    ChunkedLocalAttention,
    CircularBuffer,
    FullAttention,
    GroupSpec,
    Mamba,
    SlidingWindow,
)
from ._layout.layout import KVLayout
from ._layout.sglang import SGLangLayout
from ._observe.stats import CoordinatorStats, Histogram
from ._plan.hashes import HashInput
from ._plan.plan import LookupPlan
from ._public import present_as_public as _present_as_public
from ._resolve.result import LookupResult, TailKeyBoundary
from ._store.fake import FakeStore
from ._store.mooncake import MooncakeStore
from ._store.protocol import CallbackStore, Epochs, Store

if _typing.TYPE_CHECKING:
    from ._hashing import BlockHasher
    from ._local.master import LocalMaster
    from ._local.writer import StoreWriter
    from ._observe.prometheus import (
        PROMETHEUS_CONTENT_TYPE,
        CoordinatorCollector,
        prometheus_text,
    )

_ON_FIRST_USE = {
    "BlockHasher": "._hashing",
    "LocalMaster": "._local.master",
    "StoreWriter": "._local.writer",
    "PROMETHEUS_CONTENT_TYPE": "._observe.prometheus",
    "CoordinatorCollector": "._observe.prometheus",
    "prometheus_text": "._observe.prometheus",
}
"""Public names imported by :func:`__getattr__` when first read."""

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
    "Epochs",
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
    "SGLangLayout",
    "SlidingWindow",
    "Store",
    "StoreError",
    "StoreWriter",
    "TailKeyBoundary",
    "UnsupportedLayout",
    "prometheus_text",
]

__version__ = "0.1.0"



if not _typing.TYPE_CHECKING:  # (mypy sees the imports above: a misspelt name stays an error)

    def __getattr__(name: str) -> object:
        """Import a name of :data:`_ON_FIRST_USE` on first read (PEP 562); its module presents
        it as ``aio_mclookup.X`` itself (``_public``)."""
        module = _ON_FIRST_USE.get(name)
        if module is None:
            raise AttributeError(f"module 'aio_mclookup' has no attribute {name!r}")
        obj = getattr(_importlib.import_module(module, __name__), name)
        globals()[name] = obj
        return obj


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_present_as_public(*(globals()[name] for name in __all__ if name not in _ON_FIRST_USE))
