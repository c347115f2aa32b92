"""aio-mclookup behind FastAPI: prefix-hit lookups over HTTP, coalesced into shared RPCs.

Run it (from a clone: ``pip install -e '.[fastapi,cpu]' 'uvicorn[standard]'``)::

    AIO_MCLOOKUP_LAYOUT=examples/layouts/single_full_attention.json \\
        uvicorn fastapi_app:app --app-dir examples --host 127.0.0.1 --no-access-log

(``uvicorn[standard]`` brings httptools and uvloop, which uvicorn then picks by itself; the
access log costs a few percent per request.) One worker is one event loop: when its CPU is the
limit, run a worker per core (``--workers N``) against a shared master (``MOONCAKE_MASTER``;
without one, each worker would start a ``LocalMaster`` of its own). Each worker coalesces
only its own lookups (docs/fastapi.md, "Performance").

Environment:

* ``AIO_MCLOOKUP_LAYOUT`` (required): path to a JSON layout in the ``KVLayout.from_dict``
  schema; unset, the app refuses to start.
* ``MOONCAKE_MASTER`` (``host:port``) and ``MOONCAKE_METADATA`` (the metadata server URL, e.g.
  ``http://host:8080/metadata``): the Mooncake deployment. With no master given, the app starts
  a ``LocalMaster`` (a loopback ``mooncake_master`` and metadata server) for itself.
* ``AIO_MCLOOKUP_TIMEOUT``: seconds one lookup may take (default 5).
* ``AIO_MCLOOKUP_CACHE_TTL``: seconds a positive answer is reused (``none``: no cache; default:
  the coordinator's, 5).
* ``AIO_MCLOOKUP_HASH_ALGO`` (default ``sha256``) and ``AIO_MCLOOKUP_HASH_SEED`` (the engines'
  ``PYTHONHASHSEED``; default unset): how token-id bodies are hashed, with the layout's
  ``hash_block_size`` and ``vllm_version``. They must match the vLLM engines'
  (``--prefix-caching-hash-algo`` and ``PYTHONHASHSEED``); a configuration whose hashes cannot
  be reproduced (e.g. ``xxhash`` with no seed) refuses to start and says what to set; with
  neither variable set, such a layout (vLLM 0.26-0.28 with no seed) serves block-hash bodies
  only.

Routes: ``POST /v1/lookup``, ``POST /v1/lookup/batch``, ``GET /v1/layout``, ``GET /healthz``,
``GET /metrics``; the OpenAPI docs are at ``/docs``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from aio_mclookup import BlockHasher, CoordinatorOptions, InvalidRequest, KVLayout, LocalMaster
from aio_mclookup.fastapi import (
    HASHER_KEY,
    LookupFastPath,
    coordinator_lifespan,
    create_router,
)

log = logging.getLogger("uvicorn.error")  # shown by uvicorn with its own lines


def load_layout() -> KVLayout:
    """The layout named by ``AIO_MCLOOKUP_LAYOUT``; a clear error when it is missing."""
    path = os.environ.get("AIO_MCLOOKUP_LAYOUT")
    if not path:
        raise RuntimeError(
            "AIO_MCLOOKUP_LAYOUT is not set: point it at a JSON KV-cache layout "
            "(KVLayout.from_dict schema), e.g. examples/layouts/single_full_attention.json"
        )
    try:
        return KVLayout.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"AIO_MCLOOKUP_LAYOUT={path}: {exc}") from exc


def load_hasher(layout: KVLayout) -> BlockHasher | None:
    """The hasher of token-id bodies: ``AIO_MCLOOKUP_HASH_ALGO`` and ``AIO_MCLOOKUP_HASH_SEED``,
    with the layout's ``hash_block_size`` and ``vllm_version`` (a contract).

    A configuration whose hashes cannot be reproduced refuses to start when either variable is
    set; with neither set, the app serves block-hash bodies only and says why."""
    algo = os.environ.get("AIO_MCLOOKUP_HASH_ALGO")
    seed = os.environ.get("AIO_MCLOOKUP_HASH_SEED")  # unset: the engines run without one
    try:
        return BlockHasher(
            layout.hash_block_size,
            algo=algo or "sha256",
            seed=seed,
            vllm_version=layout.vllm_version,
        )
    except InvalidRequest as exc:
        if algo is None and seed is None:
            log.warning("token-id bodies are off: %s", exc)
            return None
        raise RuntimeError(f"AIO_MCLOOKUP_HASH_ALGO={algo or 'sha256'!r}: {exc}") from exc


def load_cache_options() -> dict[str, float | None]:
    """``cache_ttl`` from ``AIO_MCLOOKUP_CACHE_TTL`` (``none``: no cache), checked as the
    coordinator checks it; nothing when it is unset (the coordinator's default)."""
    raw = os.environ.get("AIO_MCLOOKUP_CACHE_TTL")
    if raw is None:
        return {}
    try:
        ttl = None if raw.strip().lower() == "none" else float(raw)
        CoordinatorOptions(cache_ttl=ttl)
    except (ValueError, InvalidRequest) as exc:
        raise RuntimeError(
            f"AIO_MCLOOKUP_CACHE_TTL={raw!r}: give seconds (> 0) or 'none' ({exc})"
        ) from exc
    return {"cache_ttl": ttl}


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
    """Load the layout and the hasher, find (or start) a master, then run the coordinator."""
    layout = load_layout()
    hasher = load_hasher(layout)
    timeout = float(os.environ.get("AIO_MCLOOKUP_TIMEOUT", "5"))
    cache = load_cache_options()
    async with contextlib.AsyncExitStack() as stack:
        master = os.environ.get("MOONCAKE_MASTER")
        metadata = os.environ.get("MOONCAKE_METADATA")
        if not master:
            local = await stack.enter_async_context(LocalMaster())
            master, metadata = local.master_address, local.metadata_server
            log.info("MOONCAKE_MASTER is not set: started a LocalMaster at %s", master)
        elif not metadata:
            raise RuntimeError("MOONCAKE_METADATA must be set along with MOONCAKE_MASTER")
        state = await stack.enter_async_context(
            coordinator_lifespan(
                layout, master_address=master, metadata_server=metadata, timeout=timeout, **cache
            )(app)
        )
        log.info(
            "aio-mclookup serving %s (vLLM %s rules, token ids hashed with %s) against %s",
            layout.model,
            layout.vllm_version,
            hasher.algo if hasher is not None else "nothing",
            master,
        )
        yield {**state, HASHER_KEY: hasher}  # the router hashes token-id bodies with it


make_app: Callable[..., FastAPI] = FastAPI
with contextlib.suppress(ImportError):  # /docs without a CDN (the docs-offline extra)
    from fastapi_offline import FastAPIOffline as make_app

api = make_app(
    title="aio-mclookup",
    description="Prefix-hit lookups against the Mooncake KV-cache store.",
    lifespan=lifespan,
)
router = create_router()  # its hasher: the one the lifespan publishes
api.include_router(router)
# What uvicorn serves: POST /v1/lookup(/batch) answered before FastAPI's middleware and routing
# (the same answers); everything else goes to the FastAPI app. Give authentication
# dependencies to create_router(dependencies=...) (the fast path then steps aside), never to
# include_router.
app = LookupFastPath(api, router=router)
