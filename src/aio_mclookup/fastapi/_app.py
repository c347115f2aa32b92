""":func:`create_app`: the router, lifespan and fast path in one FastAPI app."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.params import Depends as DependsParam

from .. import (
    InvalidRequest,
    KVLayout,
    SGLangLayout,
)
from ._fastpath import LookupFastPath
from ._lifespan import coordinator_lifespan
from ._models import StoreSource
from ._router import create_router

DOCS_ASSETS_URL = "/static-offline-docs"
"""Where ``create_app`` serves the docs pages' JavaScript, CSS and favicon (offline docs)."""


def create_app(
    layout: KVLayout | SGLangLayout,
    store: StoreSource | None = None,
    *,
    master_address: str | None = None,
    metadata_server: str | None = None,
    store_options: Mapping[str, Any] | None = None,
    own_store: bool | None = None,
    router_options: Mapping[str, Any] | None = None,
    dependencies: Sequence[DependsParam] | None = None,
    fast_path: bool = True,
    offline_docs: bool | None = None,
    title: str = "aio-mclookup",
    **coordinator_options: Any,
) -> FastAPI:
    """A FastAPI app with :func:`coordinator_lifespan` (the store arguments and
    ``coordinator_options``) and :func:`create_router` (``router_options``; ``dependencies``,
    e.g. an authentication hook, guard every route of the router). ``fast_path`` adds
    :class:`LookupFastPath` (it steps aside while there are dependencies).

    ``offline_docs``: ``True`` serves ``/docs`` and ``/redoc`` with Swagger UI's and ReDoc's
    files from the app itself, under ``/static-offline-docs/`` (the ``docs-offline`` extra;
    without it, :class:`~aio_mclookup.InvalidRequest`); ``False`` keeps FastAPI's pages, which
    load them from a CDN; ``None`` (the default) is ``True`` when the extra is installed."""
    app = _app_factory(offline_docs)(
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


def _app_factory(offline_docs: bool | None) -> Callable[..., FastAPI]:
    """``FastAPI``, or ``fastapi_offline.FastAPIOffline`` serving its files under
    ``DOCS_ASSETS_URL``, as ``offline_docs`` asks (see :func:`create_app`)."""
    if offline_docs is False:
        return FastAPI
    try:
        from fastapi_offline import FastAPIOffline
    except ImportError:
        if offline_docs:
            raise InvalidRequest(
                "offline_docs=True needs the fastapi-offline package: from a clone, "
                "pip install -e '.[docs-offline]' (or pip install 'fastapi-offline>=1.7.7')",
                field="offline_docs",
            ) from None
        return FastAPI
    return functools.partial(FastAPIOffline, static_url=DOCS_ASSETS_URL)
