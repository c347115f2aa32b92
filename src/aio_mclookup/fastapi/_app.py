""":func:`create_app`: the router, lifespan and fast path in one FastAPI app."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.params import Depends as DependsParam

from .. import (
    KVLayout,
)
from ._fastpath import LookupFastPath
from ._lifespan import coordinator_lifespan
from ._models import StoreSource
from ._router import create_router


def create_app(
    layout: KVLayout,
    store: StoreSource | None = None,
    *,
    master_address: str | None = None,
    metadata_server: str | None = None,
    store_options: Mapping[str, Any] | None = None,
    own_store: bool | None = None,
    router_options: Mapping[str, Any] | None = None,
    dependencies: Sequence[DependsParam] | None = None,
    fast_path: bool = True,
    title: str = "aio-mclookup",
    **coordinator_options: Any,
) -> FastAPI:
    """A FastAPI app with :func:`coordinator_lifespan` (the store arguments and
    ``coordinator_options``) and :func:`create_router` (``router_options``; ``dependencies``,
    e.g. an authentication hook, guard every route of the router). ``fast_path`` adds
    :class:`LookupFastPath` (it steps aside while there are dependencies)."""
    app = FastAPI(
        title=title,
        description="Prefix-hit lookups against the Mooncake KV-cache store, coalesced into "
        "shared batch_is_exist RPCs.",
        lifespan=coordinator_lifespan(
            layout,
            store,
            master_address=master_address,
            metadata_server=metadata_server,
            store_options=store_options,
            own_store=own_store,
            **coordinator_options,
        ),
    )
    options = dict(router_options or {})
    if dependencies is not None:
        options["dependencies"] = [*options.get("dependencies", ()), *dependencies]
    router = create_router(**options)
    app.include_router(router)
    if fast_path:
        app.add_middleware(LookupFastPath, router=router)
    return app
