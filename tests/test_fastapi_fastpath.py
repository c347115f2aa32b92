"""The served path (issue 17, section 3): LookupFastPath answers exactly like the routes, steps
aside for dependencies and overrides; the dependency is async; nothing error-only is built per
request."""

from __future__ import annotations

import inspect
import json
import struct
from typing import Any

import pytest

pytest.importorskip("fastapi")

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request

import aio_mclookup.fastapi as mcl_fastapi
from aio_mclookup import FakeStore, LookupCoordinator
from aio_mclookup.fastapi import (
    LookupFastPath,
    coordinator_lifespan,
    create_app,
    create_router,
    get_coordinator,
)
from test_fastapi import LAYOUT, body, body_b64, metric, prompt, serve, vllm_key

JSON = {"content-type": "application/json"}
FRAME = {"content-type": "application/octet-stream"}


def cases(hashes: list[bytes]) -> list[tuple[str, bytes, dict[str, str]]]:
    hexes = [h.hex() for h in hashes]
    return [
        ("/v1/lookup", json.dumps(body(96, hashes)).encode(), JSON),
        ("/v1/lookup", json.dumps(body_b64(64, hashes)).encode(), JSON),
        ("/v1/lookup", json.dumps({"num_tokens": 70, "block_hashes": hexes}).encode(), JSON),
        ("/v1/lookup", struct.pack(">IH", 64, 32) + b"".join(hashes[:4]), FRAME),
        ("/v1/lookup", b'{"token_len": NaN, "block_hashes": []}', JSON),
        ("/v1/lookup", b'{"token_len": 48, "block_hashes": ["ab", "ab", "ab"]}', JSON),
        ("/v1/lookup", json.dumps(body(64, prompt(70_000))).encode(), JSON),
        ("/v1/lookup", b"{}", {"content-type": "text/plain"}),
        ("/v1/lookup", b"x" * (6 << 20), JSON),
        ("/v1/lookup", json.dumps({"token_ids": [1, 2, 3]}).encode(), JSON),
        (
            "/v1/lookup/batch",
            json.dumps({"requests": [body(96, hashes), body(32, hashes[:2])]}).encode(),
            JSON,
        ),
        ("/v1/lookup/batch", json.dumps({"requests": [body(32, [])] * 1025}).encode(), JSON),
        ("/v1/lookup/batch", b'{"requests": [{"bad": 1}]}', JSON),
    ]


async def answers(app: FastAPI, hashes: list[bytes]) -> list[tuple[int, str, bytes]]:
    out = []
    async with serve(app) as client:
        for path, content, headers in cases(hashes):
            r = await client.post(path, content=content, headers=headers)
            out.append((r.status_code, r.headers["content-type"], r.content))
        text = (await client.get("/metrics")).text
    counted = metric(text, "aio_mclookup_http_responses_total", '{route="/v1/lookup",status="422"}')
    assert counted == 3  # NaN, unaligned token_len, token ids without a hasher
    return out


async def test_the_fast_path_answers_like_the_routes() -> None:
    hashes = prompt(6)
    store = FakeStore()
    store.add(vllm_key("toy-model", h) for h in hashes[:5])
    fast = await answers(create_app(LAYOUT, store), hashes)
    routed = await answers(create_app(LAYOUT, store, fast_path=False), hashes)
    assert fast == routed
    statuses = [status for status, _, _ in fast]
    assert statuses == [200, 200, 200, 200, 422, 422, 413, 415, 413, 422, 200, 413, 422]
    assert fast[0][2] == b'{"hit_tokens":80}' and fast[3][2] == struct.pack(">I", 32)
    assert fast[10][2] == b'{"hit_tokens":[80,32]}'


async def test_the_fast_path_steps_aside_for_overrides_and_dependencies() -> None:
    calls: list[str] = []
    store = FakeStore()
    app = create_app(LAYOUT, store)

    async def overridden(request: Request) -> LookupCoordinator:
        calls.append("override")
        return await get_coordinator(request)

    app.dependency_overrides[get_coordinator] = overridden
    async with serve(app) as client:
        r = await client.post("/v1/lookup", json=body(32, prompt(2)))
        assert r.status_code == 200
    assert calls == ["override"]  # the route ran through FastAPI, with the override

    async def count_dependency() -> None:
        calls.append("app dependency")

    guarded = FastAPI(
        lifespan=coordinator_lifespan(LAYOUT, store), dependencies=[Depends(count_dependency)]
    )
    router = create_router()
    guarded.include_router(router)
    guarded.add_middleware(LookupFastPath, router=router)
    async with serve(guarded) as client:
        assert (await client.post("/v1/lookup", json=body(32, prompt(2)))).status_code == 200
    assert calls == ["override", "app dependency"]
    with pytest.raises(ValueError, match="create_router"):
        LookupFastPath(guarded, router=APIRouter())


async def test_a_prefixed_router_is_served_by_the_fast_path() -> None:
    store = FakeStore()
    hashes = prompt(2)
    store.add(vllm_key("toy-model", h) for h in hashes)
    app = FastAPI(lifespan=coordinator_lifespan(LAYOUT, store))
    router = create_router()
    app.include_router(router, prefix="/kv")
    app.add_middleware(LookupFastPath, router=router, prefix="/kv")
    async with serve(app) as client:
        r = await client.post("/kv/v1/lookup", json=body(32, hashes))
        assert r.json() == {"hit_tokens": 32}
        assert (await client.post("/v1/lookup", json=body(32, hashes))).status_code == 404


def test_the_coordinator_dependency_is_async() -> None:
    # A plain def would cost a thread-pool hop per request.
    assert inspect.iscoroutinefunction(get_coordinator)


async def test_nothing_error_only_is_built_for_a_good_request(monkeypatch: Any) -> None:
    import importlib
    import pkgutil

    built: list[str] = []
    modules = [
        importlib.import_module(info.name)
        for info in pkgutil.iter_modules(mcl_fastapi.__path__, "aio_mclookup.fastapi.")
    ]
    for name in ("_too_large", "_too_many", "_invalid"):
        original = getattr(importlib.import_module("aio_mclookup.fastapi._errors"), name)

        def spy(*args: Any, _name: str = name, _original: Any = original) -> Any:
            built.append(_name)
            return _original(*args)

        for module in modules:  # wherever the name was imported
            if getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, spy)
    hashes = prompt(4)
    for app in (create_app(LAYOUT, FakeStore()), create_app(LAYOUT, FakeStore(), fast_path=False)):
        async with serve(app) as client:
            for _ in range(3):
                assert (await client.post("/v1/lookup", json=body(64, hashes))).status_code == 200
                r = await client.post(
                    "/v1/lookup",
                    content=struct.pack(">IH", 64, 32) + b"".join(hashes),
                    headers=FRAME,
                )
                assert r.status_code == 200
    assert built == []
    async with serve(create_app(LAYOUT, FakeStore())) as client:
        assert (await client.post("/v1/lookup", content=b"x" * (6 << 20))).status_code == 413
    assert built == ["_too_large"]


class _TokenMiddleware:
    """An authentication middleware: 401 without the right header."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (b"authorization", b"Bearer s3cret") not in scope["headers"]:
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, receive, send)


async def test_the_fast_path_never_skips_an_authentication_middleware() -> None:
    store = FakeStore()
    hashes = prompt(2)
    store.add(vllm_key("toy-model", h) for h in hashes)

    after = create_app(LAYOUT, store)  # its fast path first, then the middleware: outside it
    after.add_middleware(_TokenMiddleware)
    before = FastAPI(lifespan=coordinator_lifespan(LAYOUT, store))
    router = create_router()
    before.include_router(router)
    before.add_middleware(_TokenMiddleware)
    before.add_middleware(LookupFastPath, router=router)  # outermost: it must step aside
    around = FastAPI(lifespan=coordinator_lifespan(LAYOUT, store))
    around_router = create_router()
    around.include_router(around_router)
    around.add_middleware(_TokenMiddleware)
    wrapped = LookupFastPath(around, router=around_router)  # around an app with middleware

    for app, lifespan_app in ((after, after), (before, before), (wrapped, around)):
        async with lifespan_app.router.lifespan_context(lifespan_app) as state:

            async def with_state(
                scope: Any, receive: Any, send: Any, _state: Any = state, _app: Any = app
            ) -> None:
                scope["state"] = dict(_state)  # as a server hands the lifespan state on
                await _app(scope, receive, send)

            transport = httpx.ASGITransport(app=with_state)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                for path, payload in (
                    ("/v1/lookup", body(32, hashes)),
                    ("/v1/lookup/batch", {"requests": [body(32, hashes)]}),
                ):
                    assert (await client.post(path, json=payload)).status_code == 401
                    r = await client.post(
                        path, json=payload, headers={"authorization": "Bearer s3cret"}
                    )
                    assert r.status_code == 200, r.text
