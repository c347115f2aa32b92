"""``GET /readyz``: ready when the store answers a one-key RPC now (a readiness probe)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

from ._decode import _coordinator_of
from ._errors import ApiError
from ._models import ErrorResponse

__all__ = ["ReadyResponse", "create_readiness_router"]

PROBE_KEY = b"aio-mclookup-readyz"
"""The key the probe asks for (its answer, present or not, does not matter)."""


class ReadyResponse(BaseModel):
    """Whether the store answered the probe RPC."""

    ready: bool = Field(description="true (HTTP 200) when the store answered; false (503).")
    store_seconds: float = Field(description="How long the probe RPC took (or was waited for).")
    reason: str | None = Field(default=None, description="Why not ready.")


def create_readiness_router(probe_timeout: float = 2.0) -> APIRouter:
    """A router with ``GET /readyz``: one ``batch_is_exist`` of one key on the coordinator's
    store, straight (not through the coordinator: its breaker does not answer for the store),
    bounded by ``probe_timeout`` seconds. 200 when it answers, 503 (and why) when it fails or
    takes longer, or before start-up (``not_ready``)."""

    router = APIRouter(tags=["aio-mclookup"])

    @router.get(
        "/readyz",
        response_model=ReadyResponse,
        responses={
            503: {
                "model": ReadyResponse | ErrorResponse,
                "description": "The store did not answer, or the coordinator is not running "
                "(not_ready).",
            }
        },
        summary="Readiness: the store answers an RPC now",
    )
    async def readyz(request: Request, response: Response) -> ReadyResponse | Response:
        """One probe RPC to the store (each call makes one: poll it every few seconds)."""
        try:
            coordinator = _coordinator_of(request.scope)
        except ApiError as exc:  # (before start-up: 503 not_ready, as the router's routes)
            return exc.response()
        started = time.perf_counter()
        try:
            await asyncio.wait_for(coordinator.store.batch_is_exist([PROBE_KEY]), probe_timeout)
        except Exception as exc:
            response.status_code = 503
            reason = (
                f"no answer within {probe_timeout:g} s"
                if isinstance(exc, asyncio.TimeoutError)
                else f"{type(exc).__name__}: {exc}"
            )
            return ReadyResponse(
                ready=False, store_seconds=time.perf_counter() - started, reason=reason
            )
        return ReadyResponse(ready=True, store_seconds=time.perf_counter() - started)

    return router
