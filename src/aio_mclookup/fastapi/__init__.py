"""FastAPI integration (from a clone: ``pip install -e '.[fastapi,cpu]' 'uvicorn[standard]'``).

* :func:`coordinator_lifespan` owns a store and a :class:`~aio_mclookup.LookupCoordinator` for
  the app's lifetime;
* :func:`get_coordinator` is the (async) dependency that hands the coordinator to routes;
* :func:`create_router` returns the ready :class:`~fastapi.APIRouter`: ``POST /v1/lookup``,
  ``POST /v1/lookup/batch``, ``GET /v1/layout``, ``GET /healthz`` and ``GET /metrics``;
* :func:`create_app` puts them together;
* :func:`create_readiness_router`: ``GET /readyz``, one probe RPC to the store;
* :class:`ServeSettings` and :func:`create_serve_app`: the service ``aio-mclookup serve`` runs
  (settings from the environment);
* :class:`LookupFastPath` (ASGI middleware) serves the two lookup routes before FastAPI's
  middleware, routing and dependency machinery, with the routes' own answers.

Concurrent HTTP requests become concurrent coordinator lookups, so they share RPCs like any
other callers. Nothing here blocks the event loop: ``/healthz`` and ``/metrics`` read the
coordinator's in-memory state only.

The lookup routes read and check their bodies themselves (not through FastAPI's body
parameters): the body is counted while it streams in and refused as soon as it passes
``max_body_bytes``; every count is checked before any per-item work; a malformed body gets one
error (never the input echoed back); and the hot path builds nothing that only an error needs.
"""

from __future__ import annotations

from ._app import create_app
from ._fastpath import LookupFastPath
from ._lifespan import CoordinatorDep, coordinator_lifespan, get_coordinator
from ._models import (
    HASHER_KEY,
    OCTET_STREAM,
    STATE_KEY,
    BatchLookupRequest,
    BatchLookupResponse,
    ErrorResponse,
    HealthResponse,
    LayoutResponse,
    LookupRequest,
    LookupResponse,
    MMFeature,
    ValidationErrorResponse,
)
from ._ready import ReadyResponse, create_readiness_router
from ._router import create_router
from ._serve import ServeSettings, create_serve_app

__all__ = [
    "HASHER_KEY",
    "OCTET_STREAM",
    "STATE_KEY",
    "BatchLookupRequest",
    "BatchLookupResponse",
    "CoordinatorDep",
    "ErrorResponse",
    "HealthResponse",
    "LayoutResponse",
    "LookupFastPath",
    "LookupRequest",
    "LookupResponse",
    "MMFeature",
    "ReadyResponse",
    "ServeSettings",
    "ValidationErrorResponse",
    "coordinator_lifespan",
    "create_app",
    "create_readiness_router",
    "create_router",
    "create_serve_app",
    "get_coordinator",
]
