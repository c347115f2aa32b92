""":class:`LookupFastPath`: ASGI middleware answering the lookup routes before FastAPI's own
stack when nothing else (dependencies, overrides, other middleware) would run for them."""

from __future__ import annotations

import collections
import contextlib
import json
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

from fastapi import APIRouter
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import (
    LookupCoordinator,
)
from .._errors import InvalidRequest
from ._decode import _coordinator_of, _media_type, _read_capped
from ._errors import ApiError

_Core = Callable[[bytes, str, LookupCoordinator, Scope], Coroutine[Any, Any, tuple[bytes, str]]]
"""How the fast path answers one lookup route: body, content type, coordinator, scope ->
reply bytes and content type."""


_FAST_KEY = "_aio_mclookup_fast_paths"


class _FastPaths:
    """What :class:`LookupFastPath` needs of a router: its lookup cores by route path, its
    body limit, its response counter, and whether it has dependencies of its own."""

    def __init__(
        self,
        cores: dict[str, _Core],
        body_limit: int,
        counts: collections.Counter[tuple[str, int]],
        has_dependencies: bool,
    ) -> None:
        self.cores = cores
        self.body_limit = body_limit
        self.counts = counts
        self.has_dependencies = has_dependencies


class _Disconnected(Exception):
    """The client went away before its body was read."""


async def _receive_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """:func:`_read_body` on the raw ASGI interface. The usual body, whole in one message and
    within the limit, is returned as it comes; any other goes through :func:`_read_capped`."""
    declared = _header(scope, b"content-length")
    first: Message | None = None
    if declared is None or not declared.isdigit() or int(declared) <= limit:
        first = await receive()  # (_read_capped would read it too: nothing is refused unread)
        if first["type"] != "http.request":
            raise _Disconnected
        body: bytes = first.get("body", b"")
        if not first.get("more_body", False) and len(body) <= limit:
            return body

    async def chunks() -> AsyncGenerator[bytes, None]:
        message = first
        while True:
            if message is None:
                message = await receive()
                if message["type"] != "http.request":
                    raise _Disconnected
            yield message.get("body", b"")
            if not message.get("more_body", False):
                return
            message = None

    expect = _header(scope, b"expect")
    expects_continue = expect is not None and expect.lower() == "100-continue"
    async with contextlib.aclosing(chunks()) as stream:
        return await _read_capped(stream, declared, expects_continue, limit)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class LookupFastPath:
    """ASGI middleware that answers ``POST /v1/lookup`` and ``POST /v1/lookup/batch`` of one
    :func:`create_router` router directly, before FastAPI's middleware, routing and dependency
    machinery; every other request goes on to the app. The answers (bodies, status codes,
    headers, metrics) are the routes' own, from the same code.

    ``app.add_middleware(LookupFastPath, router=router)`` (``prefix``: the router's include
    prefix), or, to skip FastAPI's outer middleware too, around the app:
    ``served = LookupFastPath(app, router=router)`` (serve ``served``; an exception in a lookup
    is then uvicorn's 500). It steps aside (the request goes through FastAPI as usual) when
    the router was created with ``dependencies``, when the app has dependencies of its own or
    any ``dependency_overrides``, and when middleware would be skipped: other middleware added
    after this one (it would run outside, after), or, around the app, any middleware the app
    has (an authentication middleware keeps guarding the lookups). Dependencies added by
    ``app.include_router(router, dependencies=...)`` are *not* seen: with the fast path, give
    them to ``create_router(dependencies=...)`` (:func:`create_app` does).
    """

    def __init__(self, app: ASGIApp, *, router: APIRouter, prefix: str = "") -> None:
        paths = getattr(router, _FAST_KEY, None)
        if not isinstance(paths, _FastPaths):
            raise InvalidRequest(
                "router must come from aio_mclookup.fastapi.create_router", field="router"
            )
        self.app = app
        self.owner = app if isinstance(app, Starlette) else None
        self.paths = paths
        self.routes = {prefix + path: (path, core) for path, core in paths.cores.items()}
        self.middleware_ok: bool | None = None  # decided at the first lookup

    def _skips_no_middleware(self, owner: object) -> bool:
        """Whether answering here skips none of the app's own middleware: around the app, it
        must have none; inside it, this must be the innermost (the first added)."""
        if self.middleware_ok is None:
            middleware = list(getattr(owner, "user_middleware", ()))
            if self.owner is not None:
                self.middleware_ok = not middleware
            else:
                self.middleware_ok = bool(middleware) and middleware[-1].cls is LookupFastPath
        return self.middleware_ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        owner = scope.get("app")
        if owner is None and route is not None:  # wrapped around the app, not inside it
            owner = scope["app"] = self.owner
        if (
            route is None
            or scope["method"] != "POST"
            or self.paths.has_dependencies
            or getattr(owner, "dependency_overrides", None)
            or getattr(getattr(owner, "router", None), "dependencies", None)
            or not self._skips_no_middleware(owner)
        ):
            await self.app(scope, receive, send)
            return
        path, core = route
        headers: list[tuple[bytes, bytes]]
        try:
            coordinator = _coordinator_of(scope)
            body = await _receive_body(scope, receive, self.paths.body_limit)
            media = _media_type(_header(scope, b"content-type"))
            content, media = await core(body, media, coordinator, scope)
            status, headers = 200, [(b"content-type", media.encode())]
        except _Disconnected:
            return
        except ApiError as exc:
            status = exc.status_code
            content = json.dumps(exc.body(), separators=(",", ":")).encode()
            headers = [(b"content-type", b"application/json")]
            headers += [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
        headers.append((b"content-length", b"%d" % len(content)))
        self.paths.counts[(path, status)] += 1
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})
