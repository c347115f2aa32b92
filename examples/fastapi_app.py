"""aio-mclookup behind FastAPI: prefix-hit lookups over HTTP, coalesced into shared RPCs.

Run it (``pip install 'aio-mclookup[fastapi,cpu]' uvicorn``)::

    AIO_MCLOOKUP_LAYOUT=examples/layouts/single_full_attention.json \\
        uvicorn fastapi_app:app --app-dir examples

Environment:

* ``AIO_MCLOOKUP_LAYOUT`` (required): path to a JSON layout in the ``KVLayout.from_dict``
  schema; unset, the app refuses to start.
* ``MOONCAKE_MASTER`` (``host:port``) and ``MOONCAKE_METADATA`` (the metadata server URL, e.g.
  ``http://host:8080/metadata``): the Mooncake deployment. With no master given, the app starts
  a ``LocalMaster`` (a loopback ``mooncake_master`` and metadata server) for itself.
* ``AIO_MCLOOKUP_TIMEOUT``: seconds one lookup may take (default 5).

Routes: ``POST /v1/lookup``, ``POST /v1/lookup/batch``, ``GET /healthz``, ``GET /metrics``;
the OpenAPI docs are at ``/docs``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from aio_mclookup import KVLayout
from aio_mclookup import LocalMaster
from aio_mclookup.fastapi import coordinator_lifespan, create_router

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


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
    """Load the layout, find (or start) a master, then run the coordinator."""
    layout = load_layout()
    timeout = float(os.environ.get("AIO_MCLOOKUP_TIMEOUT", "5"))
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
                layout, master_address=master, metadata_server=metadata, timeout=timeout
            )(app)
        )
        log.info("aio-mclookup serving %s against %s", layout.model, master)
        yield state


app = FastAPI(
    title="aio-mclookup",
    description="Prefix-hit lookups against the Mooncake KV-cache store.",
    lifespan=lifespan,
)
app.include_router(create_router())
