"""aio-mclookup's router embedded in an app of your own: your routes beside its lookups.

``aio-mclookup serve`` runs the router as a service of its own (docs/fastapi.md). When the
lookups are part of a larger app (your routes, your lifespan, your middleware), embed it as
here: compose :func:`coordinator_lifespan` in your lifespan, include :func:`create_router`,
take the coordinator in your own routes with ``CoordinatorDep``, and wrap the app in
:class:`LookupFastPath` for the lookup routes' speed. Run it (from a clone:
``pip install -e '.[serve,cpu]'``)::

    AIO_MCLOOKUP_LAYOUT=examples/layouts/single_full_attention.json \\
        uvicorn fastapi_app:app --app-dir examples --host 127.0.0.1 --no-access-log

It reads the settings ``aio-mclookup serve`` reads (``ServeSettings.from_environ``):
``AIO_MCLOOKUP_LAYOUT`` (required), ``MOONCAKE_MASTER`` and ``MOONCAKE_METADATA`` (without
them it starts a ``LocalMaster`` of its own), ``AIO_MCLOOKUP_HASH_ALGO`` and
``AIO_MCLOOKUP_HASH_SEED``, ``AIO_MCLOOKUP_TIMEOUT``, ``AIO_MCLOOKUP_CACHE_TTL`` and the
router's limits; a configuration it cannot serve refuses to start and says why. One worker is
one event loop; with ``--workers N`` give a shared master (each worker would otherwise start a
``LocalMaster``), and each worker coalesces only its own lookups.

Routes: the router's (``POST /v1/lookup``, ``POST /v1/lookup/batch``, ``GET /v1/layout``,
``GET /healthz``, ``GET /metrics``), ``GET /readyz``, and this app's own ``POST
/v1/cached-fraction``; the OpenAPI docs are at ``/docs``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field

from aio_mclookup import LocalMaster
from aio_mclookup.fastapi import (
    HASHER_KEY,
    CoordinatorDep,
    LookupFastPath,
    ServeSettings,
    coordinator_lifespan,
    create_readiness_router,
    create_router,
)

log = logging.getLogger("uvicorn.error")  # shown by uvicorn with its own lines


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
    """Read the settings, find (or start) a master, then run the coordinator while the app
    runs; anything of your own starts and stops here too."""
    settings = ServeSettings.from_environ()  # (InvalidRequest naming the variable)
    layout = settings.load_layout()
    hasher = settings.load_hasher(layout)
    async with contextlib.AsyncExitStack() as stack:
        master, metadata = settings.master, settings.metadata
        if master is None or metadata is None:
            local = await stack.enter_async_context(LocalMaster())
            master, metadata = local.master_address, local.metadata_server
            log.info("MOONCAKE_MASTER is not set: started a LocalMaster at %s", master)
        state = await stack.enter_async_context(
            coordinator_lifespan(
                layout,
                master_address=master,
                metadata_server=metadata,
                **settings.coordinator_options(),
            )(app)
        )
        log.info("my-router: %s (vLLM %s rules) against %s", layout.model, layout.vllm_version,
                 master)
        yield {**state, HASHER_KEY: hasher}  # the router hashes token-id bodies with it


make_app: Callable[..., FastAPI] = FastAPI
with contextlib.suppress(ImportError):  # /docs without a CDN (the docs-offline extra)
    from fastapi_offline import FastAPIOffline as make_app

api = make_app(title="my-router", lifespan=lifespan)


class FractionRequest(BaseModel):
    """A prompt, as the scheduler sees it."""

    num_tokens: int = Field(gt=0, description="The request's tokens.")
    block_hashes: list[str] = Field(description="Its block hashes, hex.")


class FractionResponse(BaseModel):
    cached_fraction: float = Field(description="The share of the tokens the store holds.")


@api.post("/v1/cached-fraction", response_model=FractionResponse)
async def cached_fraction(body: FractionRequest, coordinator: CoordinatorDep) -> FractionResponse:
    """An app's own route on the shared coordinator: its lookups coalesce with the router's."""
    hashes = [bytes.fromhex(h) for h in body.block_hashes]
    hit = await coordinator.lookup(body.num_tokens, hashes)
    return FractionResponse(cached_fraction=hit / body.num_tokens)


router = create_router()  # its hasher: the one the lifespan publishes
api.include_router(router)
api.include_router(create_readiness_router())
# What uvicorn serves: POST /v1/lookup(/batch) answered before FastAPI's middleware and routing
# (the same answers); everything else goes to the FastAPI app. Give authentication
# dependencies to create_router(dependencies=...) (the fast path then steps aside), never to
# include_router.
app = LookupFastPath(api, router=router)
