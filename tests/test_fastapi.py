"""The FastAPI integration: in process (httpx ASGITransport, the FakeStore) for routes, limits and
error mapping; a real uvicorn server on loopback against a real master for the rest."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from helpers import stop_process

pytest.importorskip("fastapi")

import httpx
import numpy as np
from fastapi import FastAPI

from aio_mclookup import BlockHasher, FakeStore, FullAttention, KVLayout, LookupCoordinator
from aio_mclookup.fastapi import (
    STATE_KEY,
    coordinator_lifespan,
    create_app,
    create_router,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXAMPLE_LAYOUT = EXAMPLES / "layouts" / "single_full_attention.json"

# Full attention, 16-token blocks, scheduler block 32: hits are multiples of 16, token_len of 32.
# vLLM 0.26's rules: token_len is the aligned length and its hit is the plain prefix hit (the
# 0.33 rules, where the lookup itself leaves one token to compute, are tested with token ids).
LAYOUT = KVLayout(
    [FullAttention(16)],
    model="org/toy-model",
    hash_block_size=16,
    scheduler_block_size=32,
    vllm_version="0.26.0",
)


def vllm_key(model_name: str, block_hash: bytes) -> str:
    """The key vLLM 0.26's Mooncake connector stores for one block (TP 1, group 0), by hand."""
    return f"{model_name}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{block_hash.hex()}"


def prompt(blocks: int) -> list[bytes]:
    """``blocks`` fresh 32-byte block hashes."""
    return [uuid.uuid4().bytes * 2 for _ in range(blocks)]


def body(token_len: int, hashes: list[bytes]) -> dict[str, Any]:
    return {"token_len": token_len, "block_hashes": [h.hex() for h in hashes]}


def body_b64(token_len: int, hashes: list[bytes]) -> dict[str, Any]:
    blob = base64.b64encode(b"".join(hashes)).decode()
    return {"token_len": token_len, "block_hashes_b64": blob, "hash_len": 32}


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample's value from Prometheus text (0 when absent)."""
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


@contextlib.asynccontextmanager
async def serve(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """Run the app's lifespan and an in-process client for it."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://app", timeout=10.0
        ) as client:
            yield client


def fake_app(store: FakeStore, router: dict[str, Any] | None = None, **options: Any) -> FastAPI:
    return create_app(LAYOUT, store, router_options=router, **options)


# ------------------------------------------------------------------------- in process
async def test_lookup_hex_b64_and_batch() -> None:
    store = FakeStore()
    hashes = prompt(6)
    store.add(vllm_key("toy-model", h) for h in hashes[:5])
    other = prompt(4)
    async with serve(fake_app(store)) as client:
        r = await client.post("/v1/lookup", json=body(96, hashes))
        assert r.status_code == 200 and r.json() == {"hit_tokens": 80}
        r = await client.post("/v1/lookup", json=body_b64(64, hashes))
        assert r.status_code == 200 and r.json() == {"hit_tokens": 64}
        r = await client.post("/v1/lookup", json=body(64, other))
        assert r.json() == {"hit_tokens": 0}
        r = await client.post("/v1/lookup", json=body(0, []))
        assert r.json() == {"hit_tokens": 0}
        r = await client.post(
            "/v1/lookup/batch",
            json={"requests": [body(64, other), body_b64(96, hashes), body(32, hashes[:2])]},
        )
        assert r.status_code == 200 and r.json() == {"hit_tokens": [0, 80, 32]}
        r = await client.post("/v1/lookup/batch", json={"requests": []})
        assert r.json() == {"hit_tokens": []}


async def test_hex_hashes_of_mixed_widths_are_read_one_by_one_and_refused() -> None:
    """Widths that differ but join to a multiple of the first one's must not be re-cut into
    rows of that width: each hash keeps its own bytes; and a request of mixed widths is a 422
    (no engine writes such keys), not a lookup of nothing."""
    from aio_mclookup.fastapi._decode import _decode_hex

    hashes = [b"\xaa\xbb", b"\xcc", b"\xdd\xee\xff"]  # 6 bytes: three rows of 2 would fit
    assert _decode_hex([h.hex() for h in hashes], ["body"], 100) == hashes
    rows = _decode_hex(["aabb", "ccdd"], ["body"], 100)
    assert isinstance(rows, np.ndarray) and rows.tolist() == [[0xAA, 0xBB], [0xCC, 0xDD]]
    async with serve(fake_app(FakeStore())) as client:
        r = await client.post("/v1/lookup", json=body(32, hashes))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "block_hashes"]


async def test_concurrent_requests_share_rpcs() -> None:
    store = FakeStore(delay=0.002)
    prompts = [prompt(4) for _ in range(256)]
    for p in prompts[::2]:
        store.add(vllm_key("toy-model", h) for h in p)
    async with serve(fake_app(store)) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/lookup", json=body(64, p)) for p in prompts)
        )
        text = (await client.get("/metrics")).text
    assert [r.json()["hit_tokens"] for r in responses] == [64, 0] * 128
    rpcs = metric(text, "aio_mclookup_rpcs_total")
    assert metric(text, "aio_mclookup_lookups_total") == 256
    assert rpcs == len(store.calls) and 0 < rpcs < 256 / 4
    assert (
        metric(text, "aio_mclookup_http_responses_total", '{route="/v1/lookup",status="200"}')
        == 256
    )


@pytest.mark.parametrize(
    ("payload", "loc"),
    [
        ({"token_len": 48, "block_hashes": ["ab"] * 3}, ["body", "token_len"]),
        ({"token_len": -32, "block_hashes": []}, ["body", "token_len"]),
        ({"token_len": "many", "block_hashes": []}, ["body", "token_len"]),
        ({"block_hashes": []}, ["body", "num_tokens"]),
        ({"token_len": 32, "num_tokens": 32, "block_hashes": []}, ["body", "num_tokens"]),
        ({"num_tokens": 1.5, "block_hashes": []}, ["body", "num_tokens"]),
        ({"token_len": True, "block_hashes": []}, ["body", "token_len"]),
        ({"token_len": 32, "block_hashes": "ab"}, ["body", "block_hashes"]),
        ({"token_len": 32, "block_hashes": ["ab"], "cache_salt": "x"}, ["body", "cache_salt"]),
        ({"token_len": 32, "block_hashes": ["ab", "xyz1"]}, ["body", "block_hashes", 1]),
        ({"token_len": 32, "block_hashes": ["ab", "abc"]}, ["body", "block_hashes", 1]),
        ({"token_len": 32, "block_hashes": ["", "ab"]}, ["body", "block_hashes", 0]),
        ({"token_len": 32, "block_hashes": [7]}, ["body", "block_hashes", 0]),
        ({"token_len": 32}, ["body", "block_hashes"]),
        (
            {"token_len": 32, "block_hashes": [], "block_hashes_b64": ""},
            ["body", "block_hashes_b64"],
        ),
        ({"token_len": 32, "block_hashes_b64": "AAAA"}, ["body", "hash_len"]),
        ({"token_len": 32, "block_hashes": ["ab"], "hash_len": 1}, ["body", "hash_len"]),
        (
            {"token_len": 32, "block_hashes_b64": "!!!!", "hash_len": 1},
            ["body", "block_hashes_b64"],
        ),
        (
            {"token_len": 32, "block_hashes_b64": "AAAA", "hash_len": 2},
            ["body", "block_hashes_b64"],
        ),
        ({"token_len": 32, "block_hashes_b64": "AAAA", "hash_len": 0}, ["body", "hash_len"]),
        ({"token_len": 32, "block_hashes": [], "extra": 1}, ["body", "extra"]),
    ],
)
async def test_bad_bodies_are_422_naming_the_field(payload: dict[str, Any], loc: list[Any]) -> None:
    store = FakeStore()
    async with serve(fake_app(store)) as client:
        r = await client.post("/v1/lookup", json=payload)
        assert r.status_code == 422, r.text
        assert loc in [item["loc"] for item in r.json()["detail"]], r.text
        r = await client.post("/v1/lookup/batch", json={"requests": [body(32, []), payload]})
        assert r.status_code == 422, r.text
        batch_loc = ["body", "requests", 1, *loc[1:]]
        assert batch_loc in [item["loc"] for item in r.json()["detail"]], r.text
    assert store.calls == []  # nothing reached the store


async def test_invalid_json_and_batch_shape_are_422() -> None:
    async with serve(fake_app(FakeStore())) as client:
        r = await client.post(
            "/v1/lookup", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 422
        r = await client.post("/v1/lookup/batch", json={"requests": "all"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "requests"]


async def test_limits_are_413() -> None:
    limits = {"max_hashes_per_request": 4, "max_body_bytes": 2048, "max_batch_requests": 3}
    store = FakeStore()
    async with serve(fake_app(store, limits)) as client:
        ok = await client.post("/v1/lookup", json=body(64, prompt(4)))
        assert ok.status_code == 200
        for payload, field in (
            (body(64, prompt(5)), "block_hashes"),
            (body_b64(64, prompt(5)), "block_hashes_b64"),
        ):
            r = await client.post("/v1/lookup", json=payload)
            assert r.status_code == 413, r.text
            assert r.json()["error"] == "too_many_hashes" and r.json()["field"] == field
        r = await client.post(
            "/v1/lookup/batch", json={"requests": [body(32, []), body(64, prompt(5))]}
        )
        assert r.status_code == 413 and r.json()["field"] == "requests.1.block_hashes"
        r = await client.post("/v1/lookup/batch", json={"requests": [body(32, [])] * 4})
        assert r.status_code == 413 and r.json()["error"] == "too_many_requests"
        assert (
            await client.post("/v1/lookup/batch", json={"requests": [body(32, [])] * 3})
        ).status_code == 200
        big = {"token_len": 32, "block_hashes": ["ab" * 1100]}
        r = await client.post("/v1/lookup", json=big)
        assert r.status_code == 413 and r.json()["error"] == "payload_too_large"

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"token_len": 32, "block_hashes": ["'
            for _ in range(10):
                yield b"ab" * 200
            yield b'"]}'

        r = await client.post(
            "/v1/lookup", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413 and r.json()["error"] == "payload_too_large"
        text = (await client.get("/metrics")).text
    assert (
        metric(text, "aio_mclookup_http_responses_total", '{route="/v1/lookup",status="413"}') == 4
    )
    assert len(store.calls) == 1


async def test_overloaded_is_429() -> None:
    store = FakeStore(delay=0.3)
    app = fake_app(store, max_pending_lookups=2)
    async with serve(app) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/lookup", json=body(64, prompt(4))) for _ in range(10))
        )
        text = (await client.get("/metrics")).text
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 2 + [429] * 8
    for r in responses:
        if r.status_code == 429:
            assert r.json()["error"] == "overloaded" and r.headers["retry-after"] == "1"
    assert metric(text, "aio_mclookup_errors_total", '{code="overloaded"}') == 8


async def test_a_failing_batch_cancels_its_other_lookups() -> None:
    store = FakeStore(delay=0.3)
    async with serve(fake_app(store, max_pending_lookups=1)) as client:
        started = time.monotonic()
        r = await client.post(
            "/v1/lookup/batch", json={"requests": [body(64, prompt(4)) for _ in range(3)]}
        )
        assert time.monotonic() - started < 0.25  # not held up by the admitted lookup
        text = (await client.get("/metrics")).text
    assert r.status_code == 429 and r.json()["error"] == "overloaded"
    assert metric(text, "aio_mclookup_lookups_cancelled_total") == 1
    assert metric(text, "aio_mclookup_pending_lookups") == 0


async def test_store_errors_are_503_and_healthz_follows() -> None:
    store = FakeStore()
    app = fake_app(store, failure_backoff=0.05)
    async with serve(app) as client:
        assert (await client.get("/healthz")).json()["status"] == "ok"
        store.fail_with = -900
        r = await client.post("/v1/lookup", json=body(64, prompt(4)))
        assert r.status_code == 503, r.text
        assert r.json()["error"] == "store_error" and r.json()["code"] == -900
        health = await client.get("/healthz")
        assert health.status_code == 503
        assert health.json()["status"] == "unhealthy" and not health.json()["store_healthy"]
        assert "-900" in health.json()["last_error"]
        text = (await client.get("/metrics")).text
        assert metric(text, "aio_mclookup_errors_total", '{code="-900"}') == 1
        assert metric(text, "aio_mclookup_store_healthy") == 0

        store.fail_with = RuntimeError("the fake store broke")
        await asyncio.sleep(0.1)  # past the failure back-off: the next lookup probes
        r = await client.post("/v1/lookup", json=body(64, prompt(4)))
        assert r.status_code == 503 and r.json()["error"] == "store_error"
        assert r.json()["code"] is None and "broke" in r.json()["detail"]

        store.fail_with = None
        await asyncio.sleep(0.25)
        r = await client.post("/v1/lookup", json=body(64, prompt(4)))
        assert r.status_code == 200, r.text
        assert (await client.get("/healthz")).status_code == 200


@pytest.mark.parametrize("where", ["router", "coordinator"])
async def test_timeouts_are_503_not_hangs(where: str) -> None:
    store = FakeStore(delay=5.0)  # a store that hangs
    if where == "router":
        app = fake_app(store, {"lookup_timeout": 0.05})
    else:
        app = fake_app(store, timeout=0.05)
    async with serve(app) as client:
        started = time.monotonic()
        single, batch, health = await asyncio.gather(
            client.post("/v1/lookup", json=body(64, prompt(4))),
            client.post("/v1/lookup/batch", json={"requests": [body(64, prompt(4))] * 2}),
            client.get("/healthz"),
        )
        assert time.monotonic() - started < 2.0
    assert single.status_code == 503 and single.json()["error"] == "timeout"
    assert batch.status_code == 503 and batch.json()["error"] == "timeout"
    assert health.status_code == 200  # answered at once while the store hangs


async def test_not_started_and_closed_are_503() -> None:
    app = fake_app(FakeStore())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://app"
    ) as client:
        for r in (
            await client.post("/v1/lookup", json=body(32, [])),
            await client.get("/healthz"),
            await client.get("/metrics"),
        ):
            assert r.status_code == 503 and r.json()["error"] == "not_ready"
    async with serve(app) as client:
        coordinator = getattr(app.state, STATE_KEY)
        assert isinstance(coordinator, LookupCoordinator)
        await coordinator.aclose()
        r = await client.post("/v1/lookup", json=body(64, prompt(4)))
        assert r.status_code == 503 and r.json()["error"] == "closed"
        assert (await client.get("/healthz")).status_code == 503
    assert not hasattr(app.state, STATE_KEY)  # the lifespan cleaned up


async def test_lifespan_owns_an_async_context_manager_store() -> None:
    events: list[str] = []

    class OwnedStore(FakeStore):
        async def __aenter__(self) -> OwnedStore:
            events.append("open")
            return self

        async def __aexit__(self, *exc: object) -> None:
            events.append("close")

    app = FastAPI(lifespan=coordinator_lifespan(LAYOUT, OwnedStore))  # a factory: a class
    app.include_router(create_router())
    for _ in range(2):  # the factory makes a fresh store per start-up
        async with serve(app) as client:
            assert (await client.post("/v1/lookup", json=body(64, prompt(4)))).status_code == 200
    assert events == ["open", "close", "open", "close"]
    with pytest.raises(ValueError, match="master_address"):
        coordinator_lifespan(LAYOUT)
    with pytest.raises(ValueError, match="max_body_bytes"):
        create_router(max_body_bytes=0)


async def test_openapi_documents_routes_bodies_and_errors() -> None:
    async with serve(fake_app(FakeStore())) as client:
        schema = (await client.get("/openapi.json")).json()
    paths = schema["paths"]
    assert set(paths) >= {"/v1/lookup", "/v1/lookup/batch", "/healthz", "/metrics"}
    for path in ("/v1/lookup", "/v1/lookup/batch"):
        op = paths[path]["post"]
        assert op["summary"] and op["description"]
        assert {"200", "413", "422", "429", "503"} <= set(op["responses"])
        for code in ("413", "422", "429", "503"):
            assert op["responses"][code]["description"]
        content = op["requestBody"]["content"]
        assert content["application/json"]["schema"]["title"] in (
            "LookupRequest",
            "BatchLookupRequest",
        )
    assert "503" in paths["/healthz"]["get"]["responses"]
    assert (
        "text/plain; version=0.0.4; charset=utf-8"
        in (paths["/metrics"]["get"]["responses"]["200"]["content"])
    )
    body = paths["/v1/lookup"]["post"]["requestBody"]["content"]
    assert body["application/octet-stream"]["schema"]["format"] == "binary"
    assert "u32 big-endian" in body["application/octet-stream"]["schema"]["description"]
    request = body["application/json"]["schema"]
    assert set(request["properties"]) == {
        "num_tokens",
        "token_len",
        "block_hashes",
        "block_hashes_b64",
        "hash_len",
        "token_ids",
        "lora_name",
        "lora_path",
        "cache_salt",
        "mm_features",
        "extra_key",
    }
    assert all(p.get("description") for p in request["properties"].values())
    assert request["examples"] and request["additionalProperties"] is False
    batch = paths["/v1/lookup/batch"]["post"]["requestBody"]["content"]["application/json"]
    items = batch["schema"]["properties"]["requests"]["items"]
    assert items["title"] == "LookupRequest" and "$ref" not in json.dumps(items)
    assert "/v1/layout" in paths
    components = schema["components"]["schemas"]
    assert {
        "ErrorResponse",
        "ValidationErrorResponse",
        "LookupResponse",
        "HealthResponse",
        "LayoutResponse",
    } <= set(components)


def test_example_refuses_to_start_without_a_layout() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIO_MCLOOKUP", "MOONCAKE"))}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "fastapi_app:app",
            "--app-dir",
            str(EXAMPLES),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode != 0
    assert "AIO_MCLOOKUP_LAYOUT is not set" in proc.stderr


# --------------------------------------------------------------- real uvicorn, real master
@contextlib.asynccontextmanager
async def uvicorn_server(app: FastAPI) -> AsyncIterator[str]:
    """Serve ``app`` with a real uvicorn server on a free loopback port, in a thread."""
    uvicorn = pytest.importorskip("uvicorn")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # (keep-alive past uvicorn's 5 s: on a loaded machine a pooled connection can idle that
    # long between requests, and one the server closes as the client reuses it fails)
    config = uvicorn.Config(
        app,
        log_level="warning",
        loop="asyncio",
        http="h11",
        ws="none",
        lifespan="on",
        backlog=1024,
        timeout_keep_alive=120,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20.0
        while not server.started:
            assert thread.is_alive(), "uvicorn exited during start-up"
            assert time.monotonic() < deadline, "uvicorn did not start"
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.to_thread(thread.join, 20.0)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"


def http_client(base: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base, timeout=15.0, limits=httpx.Limits(max_connections=300))


EXAMPLE_MODEL = "Qwen3-8B"  # examples/layouts/single_full_attention.json: 16-token blocks


def real_app(store: Any, router: dict[str, Any] | None = None, **options: Any) -> FastAPI:
    layout = KVLayout(
        [FullAttention(16)],
        model="Qwen/Qwen3-8B",
        hash_block_size=16,
        scheduler_block_size=16,
        vllm_version="0.26.0",
    )
    return create_app(layout, store, own_store=False, router_options=router, **options)


@pytest.mark.integration
async def test_http_hits_and_limits_against_real_master(
    store_writer: Any, mooncake_store: Any
) -> None:
    hashes = prompt(5)
    miss = prompt(3)
    assert await store_writer.put_keys([vllm_key(EXAMPLE_MODEL, h) for h in hashes[:3]]) == 3
    app = real_app(mooncake_store, {"max_hashes_per_request": 64, "max_body_bytes": 64 << 10})
    async with uvicorn_server(app) as base, http_client(base) as client:
        r = await client.post("/v1/lookup", json=body(80, hashes))
        assert r.status_code == 200 and r.json() == {"hit_tokens": 48}
        r = await client.post("/v1/lookup", json=body_b64(80, hashes))
        assert r.json() == {"hit_tokens": 48}
        r = await client.post(
            "/v1/lookup/batch",
            json={"requests": [body(48, miss), body(32, hashes), body(80, hashes)]},
        )
        assert r.json() == {"hit_tokens": [0, 32, 48]}
        r = await client.post("/v1/lookup", json=body(40, hashes))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "token_len"]
        r = await client.post("/v1/lookup", json=body(16 * 65, prompt(65)))
        assert r.status_code == 413 and r.json()["error"] == "too_many_hashes"
        r = await client.post("/v1/lookup", json={"token_len": 16, "block_hashes": ["ab" * 40000]})
        assert r.status_code == 413 and r.json()["error"] == "payload_too_large"
        health = await client.get("/healthz")
        assert health.status_code == 200 and health.json()["store_healthy"]


@pytest.mark.integration
async def test_256_concurrent_http_lookups_share_rpcs(
    store_writer: Any, mooncake_store: Any
) -> None:
    prompts = [prompt(4) for _ in range(256)]
    written = [vllm_key(EXAMPLE_MODEL, h) for p in prompts[::2] for h in p[:2]]
    assert await store_writer.put_keys(written) == len(written)
    app = real_app(mooncake_store)
    async with uvicorn_server(app) as base, http_client(base) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/lookup", json=body(64, p)) for p in prompts)
        )
        text = (await client.get("/metrics")).text
    assert [r.status_code for r in responses] == [200] * 256
    assert [r.json()["hit_tokens"] for r in responses] == [32, 0] * 128
    lookups = metric(text, "aio_mclookup_lookups_total")
    rpcs = metric(text, "aio_mclookup_rpcs_total")
    assert lookups == 256
    print(f"{rpcs:.0f} RPCs for {lookups:.0f} concurrent HTTP lookups")
    assert 0 < rpcs < lookups / 4, f"{rpcs} RPCs for {lookups} lookups"
    assert metric(text, "aio_mclookup_lookups_per_dispatch_count") >= 1


@pytest.mark.integration
async def test_http_overload_and_timeout_against_real_master(mooncake_store: Any) -> None:
    # Every admitted lookup lingers 0.3 s before its RPC but may take only 0.1 s: 503 timeout;
    # while one is pending, the others are refused at once: 429.
    app = real_app(mooncake_store, {"lookup_timeout": 0.1}, linger=0.3, max_pending_lookups=1)
    async with uvicorn_server(app) as base, http_client(base) as client:
        started = time.monotonic()
        responses = await asyncio.gather(
            *(client.post("/v1/lookup", json=body(64, prompt(4))) for _ in range(32))
        )
        elapsed = time.monotonic() - started
        text = (await client.get("/metrics")).text
    by_status: dict[int, list[Any]] = {}
    for r in responses:
        by_status.setdefault(r.status_code, []).append(r.json())
    assert set(by_status) <= {200, 429, 503} and 429 in by_status and 503 in by_status
    assert all(b["error"] == "overloaded" for b in by_status[429])
    assert all(b["error"] == "timeout" for b in by_status[503])
    assert elapsed < 5.0
    assert metric(text, "aio_mclookup_errors_total", '{code="overloaded"}') == len(by_status[429])
    assert metric(text, "aio_mclookup_errors_total", '{code="timeout"}') == len(by_status[503])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _example_env(local_master: Any) -> dict[str, str]:
    """The environment of the example app against ``local_master``."""
    return {
        **os.environ,
        "AIO_MCLOOKUP_LAYOUT": str(EXAMPLE_LAYOUT),
        "MOONCAKE_MASTER": local_master.master_address,
        "MOONCAKE_METADATA": local_master.metadata_server,
    }


@pytest.mark.integration
async def test_example_app_serves_hits_from_a_real_master(
    local_master: Any, store_writer: Any, tmp_path: Path
) -> None:
    """The documented command, ``uvicorn fastapi_app:app --app-dir examples --host 127.0.0.1
    --no-access-log``, end to end: hashes, and token ids hashed as the environment says."""
    hashes = prompt(4)
    await store_writer.put_keys([vllm_key(EXAMPLE_MODEL, h) for h in hashes[:2]])
    layout = KVLayout.from_dict(json.loads(EXAMPLE_LAYOUT.read_text()))
    hasher = BlockHasher(16, algo="sha256_cbor", seed="1234", vllm_version=layout.vllm_version)
    ids = list(range(500, 580))  # 5 blocks of 16; the first 3 stored
    await store_writer.put_keys([vllm_key(EXAMPLE_MODEL, bytes(h)) for h in hasher.hash(ids)[:3]])
    port = _free_port()
    env = _example_env(local_master)
    env.update(AIO_MCLOOKUP_HASH_ALGO="sha256_cbor", AIO_MCLOOKUP_HASH_SEED="1234")
    argv = ["-m", "uvicorn", "fastapi_app:app", "--app-dir", "examples"]
    argv += ["--host", "127.0.0.1", "--no-access-log", "--port", str(port)]
    log_path = tmp_path / "example.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *argv, env=env, cwd=ROOT, stdout=log_file, stderr=log_file
        )
    try:
        async with http_client(f"http://127.0.0.1:{port}") as client:
            deadline = time.monotonic() + 30.0
            while True:
                assert proc.returncode is None, "the example exited"
                assert time.monotonic() < deadline, "the example did not start"
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/healthz")).status_code == 200:
                        break
                await asyncio.sleep(0.05)
            r = await client.post("/v1/lookup", json=body(64, hashes))
            assert r.status_code == 200 and r.json() == {"hit_tokens": 32}
            r = await client.post("/v1/lookup", json={"token_ids": ids})
            assert r.status_code == 200 and r.json() == {"hit_tokens": 48}
            r = await client.post("/v1/lookup", json={"token_ids": ids[:48]})
            assert r.json() == {"hit_tokens": 32}  # a whole-prompt hit leaves one block
            config = (await client.get("/v1/layout")).json()
            assert config["layout"] == layout.to_dict()
            assert config["hasher"] == hasher.to_dict() and config["hasher"]["seeded"]
            # The app's own route, on the same coordinator; and /readyz.
            fraction = {"num_tokens": 64, "block_hashes": [h.hex() for h in hashes]}
            r = await client.post("/v1/cached-fraction", json=fraction)
            assert r.status_code == 200 and r.json() == {"cached_fraction": 0.5}
            assert (await client.get("/readyz")).json()["ready"] is True
    finally:
        await stop_process(proc)
    log = log_path.read_text(errors="replace")
    # uvicorn re-raises SIGTERM after a graceful shut-down.
    assert proc.returncode in (0, -signal.SIGTERM), log[-2000:]
    assert "Application shutdown complete" in log
    assert '"POST /v1/lookup HTTP/1.1" 200' not in log  # no access log


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


@pytest.mark.integration
async def test_example_app_with_several_workers_answers_alike_on_every_connection(
    local_master: Any, store_writer: Any, tmp_path: Path
) -> None:
    """``--workers 2`` against a shared master (the docstring's advice when one worker's CPU
    is the limit): two worker processes, and every connection, whichever worker took it,
    gets the same hit."""
    hashes = prompt(6)
    await store_writer.put_keys([vllm_key(EXAMPLE_MODEL, h) for h in hashes[:3]])
    port = _free_port()
    env = _example_env(local_master)
    argv = ["-m", "uvicorn", "fastapi_app:app", "--app-dir", "examples", "--host", "127.0.0.1"]
    argv += ["--no-access-log", "--port", str(port), "--workers", "2"]
    log_path = tmp_path / "workers.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *argv, env=env, cwd=ROOT, stdout=log_file, stderr=log_file
        )
    try:
        deadline = time.monotonic() + 60.0
        while log_path.read_text(errors="replace").count("Application startup complete") < 2:
            assert proc.returncode is None, log_path.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "the workers did not start"
            await asyncio.sleep(0.1)
        started = re.findall(r"Started server process \[(\d+)\]", log_path.read_text())
        assert len(set(started)) == 2 and set(map(int, started)) <= set(_children(proc.pid))
        hits = []
        for _ in range(16):  # a fresh connection each: the kernel picks the worker
            async with http_client(f"http://127.0.0.1:{port}") as client:
                r = await client.post("/v1/lookup", json=body(96, hashes))
                assert r.status_code == 200, r.text
                hits.append(r.json()["hit_tokens"])
        assert hits == [48] * 16
    finally:
        await stop_process(proc)
    log = log_path.read_text(errors="replace")
    assert log.count("Application shutdown complete") == 2, log[-2000:]


def test_example_refuses_a_hash_configuration_it_cannot_reproduce() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIO_MCLOOKUP", "MOONCAKE"))}
    env["AIO_MCLOOKUP_LAYOUT"] = str(EXAMPLE_LAYOUT)
    env["AIO_MCLOOKUP_HASH_ALGO"] = "xxhash"  # vLLM 0.33 seeds it at random without a seed
    argv = ["-m", "uvicorn", "fastapi_app:app", "--app-dir", str(EXAMPLES), "--port", "0"]
    proc = subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode != 0
    assert "AIO_MCLOOKUP_HASH_ALGO='xxhash'" in proc.stderr
