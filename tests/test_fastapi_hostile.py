"""The FastAPI routes under hostile input (issue 18, items 2, 3, 4 and 9): counts and sizes
checked before per-item work, small bounded error replies that never echo the input, a 4xx for
every malformed body, a body limit derived from the hash limit and enforced while the body
streams in, and an authentication hook."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("fastapi")

import httpx
from fastapi import Depends, FastAPI, Header, HTTPException

from aio_mclookup import FakeStore
from aio_mclookup.fastapi import OCTET_STREAM, create_app
from aio_mclookup.fastapi._decode import _DRAIN_BYTES
from test_fastapi import (
    LAYOUT,
    body,
    fake_app,
    http_client,
    metric,
    prompt,
    uvicorn_server,
    vllm_key,
)

JSON = {"content-type": "application/json"}
SMALL = 2048  # bytes: every error reply here is far smaller


@contextlib.asynccontextmanager
async def serve_raw(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """Like test_fastapi.serve, but an exception in the app is a 500 reply (as a real server
    would answer), not an exception in the test."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://app", timeout=60.0
        ) as client:
            yield client


def bad_hashes(count: int, marker: str = "x") -> bytes:
    return (
        b'{"token_len": 32, "block_hashes": ['
        + b",".join([b'"%s"' % marker.encode()] * count)
        + b"]}"
    )


# ------------------------------------------------------------------ 2: error amplification
@pytest.mark.parametrize("count", [200_000, 1_000_000])
async def test_huge_lists_of_bad_hashes_get_a_small_413_fast(count: int) -> None:
    payload = bad_hashes(count)
    assert len(payload) < 5 << 20  # under the default body limit: the count check must catch it
    store = FakeStore()
    async with serve_raw(fake_app(store)) as client:
        started = time.monotonic()
        r = await client.post("/v1/lookup", content=payload, headers=JSON)
        elapsed = time.monotonic() - started
        batch = await client.post(
            "/v1/lookup/batch",
            content=b'{"requests": [' + payload + b"]}",
            headers=JSON,
        )
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"] == "too_many_hashes" and r.json()["field"] == "block_hashes"
    assert len(r.content) < SMALL
    assert elapsed < 3.0, f"{elapsed:.1f} s for {count} bad hashes"
    assert batch.status_code == 413 and len(batch.content) < SMALL
    assert batch.json()["field"] == "requests.0.block_hashes"
    assert store.calls == []


async def test_bad_items_get_one_error_and_the_input_is_never_echoed() -> None:
    secret = "SECRET-" + "q" * 40
    limit = 65536
    async with serve_raw(fake_app(FakeStore())) as client:
        started = time.monotonic()
        r = await client.post("/v1/lookup", content=bad_hashes(limit, secret), headers=JSON)
        elapsed = time.monotonic() - started
        assert r.status_code == 422 and len(r.content) < SMALL
        assert len(r.json()["detail"]) == 1
        assert r.json()["detail"][0]["loc"] == ["body", "block_hashes", 0]
        assert secret not in r.text and elapsed < 3.0
        # Bad token ids, non-strings among hashes, an unknown field with a huge name.
        for payload, loc in (
            (
                {"token_len": 32, "block_hashes": [{"x": secret}] * 1000},
                ["body", "block_hashes", 0],
            ),
            (
                {"token_len": 32, "block_hashes": ["ab"] * 999 + [secret]},
                ["body", "block_hashes", 999],
            ),
            ({"token_len": secret, "block_hashes": []}, ["body", "token_len"]),
            ({"token_len": 32, "block_hashes_b64": secret, "hash_len": 32}, None),
        ):
            r = await client.post("/v1/lookup", json=payload)
            assert r.status_code == 422 and len(r.content) < SMALL, r.text[:300]
            assert len(r.json()["detail"]) == 1 and secret not in r.text
            if loc is not None:
                assert r.json()["detail"][0]["loc"] == loc
        r = await client.post(
            "/v1/lookup", json={"token_len": 32, "block_hashes": [], secret * 50: 1}
        )
        assert r.status_code == 422 and len(r.content) < SMALL
        assert secret * 2 not in r.text  # the unknown field's name is cut short


async def test_a_huge_batch_is_refused_before_any_item_is_checked() -> None:
    items = b",".join([b'{"bad": 1}'] * 300_000)
    async with serve_raw(fake_app(FakeStore())) as client:
        started = time.monotonic()
        r = await client.post(
            "/v1/lookup/batch", content=b'{"requests": [' + items + b"]}", headers=JSON
        )
        elapsed = time.monotonic() - started
    assert r.status_code == 413 and r.json()["error"] == "too_many_requests"
    assert len(r.content) < SMALL and elapsed < 3.0


# ------------------------------------------------------------------ 3: malformed bodies
MALFORMED = [
    b'{"token_len": NaN, "block_hashes": []}',
    b'{"token_len": Infinity, "block_hashes": []}',
    b'{"token_len": -Infinity, "block_hashes": []}',
    b'{"token_len": 1e400, "block_hashes": []}',
    b'{"num_tokens": 1e400, "block_hashes": []}',
    b'{"token_len": 32, "block_hashes": ["ab", NaN]}',
    b'{"token_len": 32, "block_hashes_b64": "AAAA", "hash_len": 1e400}',
    b'{"token_len": 32, "block_hashes": [], "x": NaN}',
    b'{"token_len": 1' + b"0" * 5000 + b', "block_hashes": []}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"token_len": 32, "block_hashes": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b"\xff\xfe{not utf-8",
    b"",
    b"null",
    b"[]",
    b'"a string"',
    b"{not json",
    b'{"token_len": 32, "block_hashes": [], }',
]


@pytest.mark.parametrize("payload", MALFORMED, ids=lambda p: repr(p[:30]))
async def test_every_malformed_body_gets_a_4xx(payload: bytes) -> None:
    store = FakeStore()
    async with serve_raw(fake_app(store)) as client:
        cases = [("/v1/lookup", payload), ("/v1/lookup/batch", payload)]
        if payload:  # (an empty item list is a valid batch)
            cases.append(("/v1/lookup/batch", b'{"requests": [' + payload + b"]}"))
        for route, content in cases:
            r = await client.post(route, content=content, headers=JSON)
            assert r.status_code in (413, 422), (route, r.status_code, r.text[:300])
            assert len(r.content) < SMALL
            detail = r.json()["detail"]
            assert isinstance(detail, (list, str))
    assert store.calls == []


# --------------------------------------------------------------------------- 4: body size
@pytest.mark.parametrize(
    ("options", "limit"),
    [({}, 5 << 20), ({"max_hashes_per_request": 1000}, 80_000), ({"max_body_bytes": 1234}, 1234)],
)
async def test_the_default_body_limit_follows_the_hash_limit(
    options: dict[str, Any], limit: int
) -> None:
    """80 bytes per hash: 5 MiB for the default 65,536 hashes (a hex SHA-256 hash in a JSON
    list takes 67)."""
    async with serve_raw(fake_app(FakeStore(), options)) as client:
        for size, too_large in ((limit, False), (limit + 1, True)):
            r = await client.post("/v1/lookup", content=b" " * size, headers=JSON)
            assert (r.status_code == 413) is too_large, (size, r.text)
            if too_large:
                assert r.json()["error"] == "payload_too_large"
            else:
                assert r.status_code == 422  # whitespace only: not JSON, but read and parsed


class CountedBody:
    """A request body of ``size`` bytes in ``chunk``-byte pieces that counts what the server
    pulled; with ``declared``, sent with a Content-Length, else chunked."""

    def __init__(self, size: int, chunk: int = 65_000) -> None:
        self.size, self.chunk, self.pulled = size, chunk, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        left = self.size
        while left:
            piece = min(left, self.chunk)
            left -= piece
            self.pulled += piece
            yield b" " * piece

    async def post(
        self, client: httpx.AsyncClient, declared: bool, **headers: str
    ) -> httpx.Response:
        if declared:
            headers["content-length"] = str(self.size)
        return await client.post("/v1/lookup", content=self, headers={**JSON, **headers})


BOTH_PATHS = pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "routes"])
DECLARED = pytest.mark.parametrize("declared", [True, False], ids=["declared", "chunked"])


def assert_too_large(r: httpx.Response) -> None:
    assert r.status_code == 413 and r.json()["error"] == "payload_too_large"
    assert r.json()["field"] == "body" and len(r.content) < SMALL
    assert r.headers["connection"] == "close"


@BOTH_PATHS
@DECLARED
async def test_a_body_a_little_over_the_limit_is_read_to_its_end_before_the_413(
    fast_path: bool, declared: bool
) -> None:
    """Closing on unread bytes resets the connection, which can destroy the 413 on its way to
    a client still sending; the body is read (and dropped) so the reply arrives."""
    store = FakeStore()
    sent = CountedBody((5 << 20) + 300_000)
    async with serve_raw(fake_app(store, fast_path=fast_path)) as client:
        assert_too_large(await sent.post(client, declared))
    assert sent.pulled == sent.size and store.calls == []


@BOTH_PATHS
@DECLARED
async def test_a_body_far_over_the_limit_is_refused_without_reading_on(
    fast_path: bool, declared: bool
) -> None:
    store = FakeStore()
    sent = CountedBody(20 << 20)  # 20 MB, against the default 5 MiB limit
    async with serve_raw(fake_app(store, fast_path=fast_path)) as client:
        started = time.monotonic()
        assert_too_large(await sent.post(client, declared))
        elapsed = time.monotonic() - started
    cap = (5 << 20) + _DRAIN_BYTES  # the limit, then at most this much more
    assert sent.pulled <= (0 if declared else cap + sent.chunk), sent.pulled
    assert elapsed < 3.0 and store.calls == []


@BOTH_PATHS
async def test_a_client_waiting_for_100_continue_is_refused_at_once(fast_path: bool) -> None:
    sent = CountedBody((5 << 20) + 1)
    async with serve_raw(fake_app(FakeStore(), fast_path=fast_path)) as client:
        assert_too_large(await sent.post(client, True, expect="100-continue"))
    assert sent.pulled == 0


@pytest.mark.integration
async def test_hostile_bodies_do_not_stall_good_requests_on_a_real_server(
    store_writer: Any, mooncake_store: Any
) -> None:
    """Against a real uvicorn and master: 4 bodies of a million bad hashes and 4 oversized ones,
    sent together with 64 good lookups; the good ones are all answered, quickly."""
    from test_fastapi import EXAMPLE_MODEL, real_app

    hashes = prompt(4)
    await store_writer.put_keys([vllm_key(EXAMPLE_MODEL, h) for h in hashes[:2]])
    app = real_app(mooncake_store)
    hostile = bad_hashes(1_000_000)
    oversized = b'{"token_len": 16, "block_hashes": [' + b'"ab",' * (2 << 20) + b'"ab"]}'
    async with uvicorn_server(app) as base, http_client(base) as client:
        started = time.monotonic()

        async def good() -> tuple[int, float]:
            t0 = time.monotonic()
            r = await client.post("/v1/lookup", json=body(64, hashes))
            assert r.json() == {"hit_tokens": 32}
            return r.status_code, time.monotonic() - t0

        async def bad(payload: bytes) -> int | str:
            try:
                r = await client.post("/v1/lookup", content=payload, headers=JSON)
            except httpx.TransportError:  # refused mid-body: the server closed the connection
                return "closed"
            assert len(r.content) < SMALL
            return r.status_code

        results = await asyncio.gather(
            *(bad(hostile) for _ in range(4)),
            *(bad(oversized) for _ in range(4)),
            *(good() for _ in range(64)),
        )
        elapsed = time.monotonic() - started
    assert results[:4] == [413] * 4  # under the body limit: refused by the hash count
    assert all(status in (413, "closed") for status in results[4:8])
    good_replies = results[8:]
    assert [status for status, _ in good_replies] == [200] * 64  # type: ignore[misc]
    assert max(t for _, t in good_replies) < 5.0  # type: ignore[misc]
    assert elapsed < 10.0


# --------------------------------------------------------------- 9: the trust boundary
async def test_an_authentication_dependency_guards_every_route() -> None:
    async def check_token(authorization: str | None = Header(default=None)) -> None:
        if authorization != "Bearer s3cret":
            raise HTTPException(401, "missing or wrong token", {"WWW-Authenticate": "Bearer"})

    store = FakeStore()
    hashes = prompt(2)
    store.add(vllm_key("toy-model", h) for h in hashes)
    for app in (
        create_app(LAYOUT, store, dependencies=[Depends(check_token)]),
        create_app(LAYOUT, store, router_options={"dependencies": [Depends(check_token)]}),
    ):
        async with serve_raw(app) as client:
            for method, path, payload in (
                ("POST", "/v1/lookup", body(32, hashes)),
                ("POST", "/v1/lookup/batch", {"requests": [body(32, hashes)]}),
                ("GET", "/v1/layout", None),
                ("GET", "/healthz", None),
                ("GET", "/metrics", None),
            ):
                r = await client.request(method, path, json=payload)
                assert r.status_code == 401, (path, r.text)
                r = await client.request(
                    method, path, json=payload, headers={"authorization": "Bearer s3cret"}
                )
                assert r.status_code == 200, (path, r.text)
            text = (await client.get("/metrics", headers={"authorization": "Bearer s3cret"})).text
            assert 'route="/v1/lookup",status="401"' in text
            assert metric(text, "aio_mclookup_lookups_total") == 2  # the two with the token
    assert len(store.calls) == 2  # one RPC per app; its batch lookup came from the cache


# ------------------------------------------------------------------ compact body, 415
async def test_octet_stream_frames_and_other_media_types() -> None:
    store = FakeStore()
    hashes = prompt(6)
    store.add(vllm_key("toy-model", h) for h in hashes[:4])
    frame = struct.pack(">IH", 100, 32) + b"".join(hashes)
    async with serve_raw(fake_app(store)) as client:
        r = await client.post("/v1/lookup", content=frame, headers={"content-type": OCTET_STREAM})
        assert r.status_code == 200 and r.headers["content-type"] == OCTET_STREAM
        assert struct.unpack(">I", r.content) == (64,)  # 4 blocks of 16, whole 32-token blocks
        full = struct.pack(">IH", 64, 32) + b"".join(hashes[:4])  # a whole-prompt hit: 64 -> 32
        r = await client.post("/v1/lookup", content=full, headers={"content-type": OCTET_STREAM})
        assert struct.unpack(">I", r.content) == (32,)
        r = await client.post(
            "/v1/lookup", json={"num_tokens": 64, "block_hashes": [h.hex() for h in hashes[:4]]}
        )
        assert r.json() == {"hit_tokens": 32}  # the same answer as JSON
        empty = struct.pack(">IH", 10, 0)
        r = await client.post("/v1/lookup", content=empty, headers={"content-type": OCTET_STREAM})
        assert struct.unpack(">I", r.content) == (0,)
        for bad, loc in (
            (b"\x00\x01", ["body"]),
            (struct.pack(">IH", 64, 32) + b"x" * 33, ["body", "block_hashes"]),
            (struct.pack(">IH", 64, 0) + b"x", ["body", "hash_len"]),
        ):
            r = await client.post("/v1/lookup", content=bad, headers={"content-type": OCTET_STREAM})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == loc
        many = struct.pack(">IH", 64, 1) + b"x" * 65537
        r = await client.post("/v1/lookup", content=many, headers={"content-type": OCTET_STREAM})
        assert r.status_code == 413 and r.json()["error"] == "too_many_hashes"
        for route in ("/v1/lookup", "/v1/lookup/batch"):
            r = await client.post(route, content=b"{}", headers={"content-type": "text/plain"})
            assert r.status_code == 415 and r.json()["error"] == "unsupported_media_type"
        r = await client.post(
            "/v1/lookup/batch", content=frame, headers={"content-type": OCTET_STREAM}
        )
        assert r.status_code == 415
        r = await client.post(
            "/v1/lookup",
            content=json.dumps(body(32, hashes[:2])).encode(),
            headers={"content-type": "application/json; charset=utf-8"},
        )
        assert r.json() == {"hit_tokens": 32}
