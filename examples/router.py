"""A KV-cache-aware routing decision for OpenAI-style requests, from the Mooncake store.

A gateway in front of several vLLM engines that share one Mooncake store asks this service where
to send a request. The body is an OpenAI-style completion request carrying its prompt's token ids
(``prompt_token_ids``; ``model``, ``cache_salt`` and the usual sampling fields may come along, and
are ignored except ``model``, which selects a LoRA adapter when one is configured under that name,
and ``cache_salt``). The service hashes the tokens as the engines do (``BlockHasher``), asks the
store how many prompt tokens an engine would find there (vLLM's scheduler view), and answers with
its decision:

* **cached** (at least ``min_cached_tokens`` found): any engine can load that prefix from the
  shared store, so the least busy backend takes it (fewest requests routed to it and not yet
  reported done);
* **cold**: the prefix has to be computed; the backend is chosen by the prompt's first block hash
  (rendezvous hashing), so requests that share a prompt start land on the same engine, whose own
  GPU prefix cache then serves them while the store fills.

Run it (from a clone: ``pip install -e '.[fastapi,cpu]' 'uvicorn[standard]'``)::

    AIO_MCLOOKUP_LAYOUT=examples/layouts/single_full_attention.json \\
    AIO_MCLOOKUP_BACKENDS=http://10.0.0.11:8000,http://10.0.0.12:8000 \\
        uvicorn router:app --app-dir examples --host 127.0.0.1 --no-access-log

Environment: ``AIO_MCLOOKUP_LAYOUT`` (required), ``AIO_MCLOOKUP_BACKENDS`` (required, comma
separated), ``AIO_MCLOOKUP_MIN_CACHED_TOKENS`` (default: one scheduler block),
``AIO_MCLOOKUP_HASH_ALGO`` / ``AIO_MCLOOKUP_HASH_SEED`` (as the engines'), ``AIO_MCLOOKUP_LORAS``
(``name=path,...``: the adapters the engines serve), ``MOONCAKE_MASTER`` / ``MOONCAKE_METADATA``
(without them a loopback ``LocalMaster`` is started, for trying it out).

Routes: ``POST /v1/route`` (the decision), ``POST /v1/route/done`` (a request finished on a
backend: its load goes down), plus the library's ``/v1/lookup``, ``/v1/layout``, ``/healthz``
and ``/metrics``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from aio_mclookup import (
    BlockHasher,
    Error,
    InvalidRequest,
    KVLayout,
    LocalMaster,
)
from aio_mclookup.fastapi import CoordinatorDep, coordinator_lifespan, create_router

MAX_PROMPT_TOKENS = 1 << 20


class RouteRequest(BaseModel):
    """The parts of an OpenAI-style completion request that decide the route."""

    model_config = ConfigDict(extra="allow")  # temperature, max_tokens, ... pass through

    model: str | None = Field(default=None, max_length=1024)
    prompt_token_ids: list[int] = Field(max_length=MAX_PROMPT_TOKENS)
    cache_salt: str | None = Field(default=None, max_length=4096)


class RouteDecision(BaseModel):
    backend: str = Field(description="Where to send the request.")
    policy: Literal["cached", "cold"]
    cached_tokens: int = Field(description="Prompt tokens an engine finds in the store.")
    num_tokens: int = Field(description="The prompt's length.")
    cached_fraction: float


class Done(BaseModel):
    backend: str


def invalid(loc: Sequence[Any], msg: str, kind: str = "invalid_request") -> JSONResponse:
    """A 422 in the library's shape: one problem, its location and a bounded message, never
    the input (FastAPI's default handler echoes the input, the whole prompt included)."""
    where = [part if isinstance(part, int) else str(part)[:64] for part in loc]
    item = {"loc": where, "msg": msg[:300], "type": kind}
    return JSONResponse({"detail": [item]}, status_code=422)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    return invalid(first.get("loc", ["body"]), str(first.get("msg", "invalid body")),
                   str(first.get("type", "invalid_request")))


def rendezvous(backends: Sequence[str], key: bytes) -> str:
    """The backend with the highest hash of (backend, key): stable while backends come and go."""
    return max(backends, key=lambda b: hashlib.blake2b(b.encode() + key, digest_size=8).digest())


def create_router_app(
    layout: KVLayout,
    lifespan: Any,
    *,
    backends: Sequence[str],
    hasher: BlockHasher,
    min_cached_tokens: int | None = None,
    loras: Mapping[str, str] | None = None,
) -> FastAPI:
    """The routing service; ``lifespan`` runs its coordinator (``coordinator_lifespan``)."""
    if not backends:
        raise ValueError("give at least one backend")
    threshold = layout.scheduler_block_size if min_cached_tokens is None else min_cached_tokens
    adapters = dict(loras or {})
    load = dict.fromkeys(backends, 0)
    app = FastAPI(
        title="aio-mclookup router example",
        lifespan=lifespan,
    )
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.include_router(create_router(hasher=hasher))

    @app.post("/v1/route", response_model=RouteDecision)
    async def route(
        body: RouteRequest, coordinator: CoordinatorDep
    ) -> RouteDecision | JSONResponse:
        ids = body.prompt_token_ids
        options: dict[str, Any] = {}
        if body.cache_salt is not None:
            options["cache_salt"] = body.cache_salt
        if body.model in adapters:
            options.update(lora_name=body.model, lora_path=adapters[body.model])
        try:
            hashes = hasher.hash(ids, **options)
            found = await coordinator.lookup(len(ids), hashes) if len(hashes) else 0
        except InvalidRequest as exc:
            return invalid(["body", "prompt_token_ids"], str(exc))
        except Error:  # the store is down or slow: fail open, route as if nothing were cached
            found = 0
        if found >= threshold and found > 0:
            backend, policy = min(backends, key=lambda b: load[b]), "cached"
        else:
            first = bytes(hashes[0]) if len(hashes) else b"short:" + bytes(str(ids), "ascii")
            backend, policy = rendezvous(backends, first), "cold"
        load[backend] += 1
        return RouteDecision(
            backend=backend,
            policy=policy,  # type: ignore[arg-type]
            cached_tokens=found,
            num_tokens=len(ids),
            cached_fraction=found / len(ids) if ids else 0.0,
        )

    @app.post("/v1/route/done", status_code=204)
    async def done(body: Done) -> None:
        if body.backend not in load:
            raise HTTPException(404, "unknown backend")
        load[body.backend] = max(0, load[body.backend] - 1)

    return app


def _from_env() -> FastAPI:
    """The app the documented command serves, configured from the environment at start-up."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        async with contextlib.AsyncExitStack() as stack:
            master = os.environ.get("MOONCAKE_MASTER")
            metadata = os.environ.get("MOONCAKE_METADATA")
            if not master:
                local = await stack.enter_async_context(LocalMaster())
                master, metadata = local.master_address, local.metadata_server
            inner = coordinator_lifespan(
                settings["layout"], master_address=master, metadata_server=metadata, timeout=2.0
            )
            yield await stack.enter_async_context(inner(app))

    settings = _settings()
    return create_router_app(
        settings["layout"],
        lifespan,
        backends=settings["backends"],
        hasher=settings["hasher"],
        min_cached_tokens=settings["min_cached_tokens"],
        loras=settings["loras"],
    )


def _settings() -> dict[str, Any]:
    path = os.environ.get("AIO_MCLOOKUP_LAYOUT")
    backends = [b for b in os.environ.get("AIO_MCLOOKUP_BACKENDS", "").split(",") if b]
    if not path or not backends:
        raise RuntimeError("set AIO_MCLOOKUP_LAYOUT and AIO_MCLOOKUP_BACKENDS")
    layout = KVLayout.from_dict(json.loads(Path(path).read_text()))
    hasher = BlockHasher(
        layout.hash_block_size,
        algo=os.environ.get("AIO_MCLOOKUP_HASH_ALGO", "sha256"),
        seed=os.environ.get("AIO_MCLOOKUP_HASH_SEED"),
        vllm_version=layout.vllm_version,
    )
    minimum = os.environ.get("AIO_MCLOOKUP_MIN_CACHED_TOKENS")
    loras = dict(
        item.split("=", 1) for item in os.environ.get("AIO_MCLOOKUP_LORAS", "").split(",") if item
    )
    return {
        "layout": layout,
        "backends": backends,
        "hasher": hasher,
        "min_cached_tokens": int(minimum) if minimum else None,
        "loras": loras,
    }


class _FromEnvironment:
    """The app the documented command serves (``router:app``), built from the environment when
    the server starts, so that importing this module needs no environment."""

    def __init__(self) -> None:
        self.app: FastAPI | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.app is None:
            try:
                self.app = _from_env()
            except (RuntimeError, OSError, ValueError) as exc:
                if scope["type"] != "lifespan":
                    raise
                await receive()  # lifespan.startup
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                return
        await self.app(scope, receive, send)


app = _FromEnvironment()
