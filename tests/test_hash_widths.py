"""Hashes of the wrong width are refused, not looked up as "nothing cached": in the library with
a layout's ``hash_bytes`` (InvalidRequest naming block_hashes), over HTTP always (a 422 naming
the body field: the layout's width, else the router hasher's, else one of vLLM's 32 / 16)."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any

import httpx
import numpy as np
import pytest

import aio_mclookup as mcl
from aio_mclookup.fastapi import OCTET_STREAM, create_app
from helpers import chain

GROUPS = [mcl.FullAttention(16)]


def layout(**kw: Any) -> mcl.KVLayout:
    return mcl.KVLayout(GROUPS, model="org/m", hash_block_size=16, scheduler_block_size=16, **kw)


def test_a_layout_with_hash_bytes_refuses_other_widths() -> None:
    sha = layout(hash_bytes=32)
    hashes = chain(4, b"p")
    assert sha.plan(64, hashes).keys == layout().plan(64, hashes).keys  # the same keys
    assert sha.plan(64, np.zeros((4, 32), np.uint8)).num_keys == 4
    for bad, what in [
        ([h[:16] for h in hashes], "16 bytes wide, not 32"),
        ([b"\x01"] * 4, "1 bytes wide, not 32"),
        ([hashes[0], b"\x01", *hashes[2:]], "one width, got 2 widths"),
        (np.zeros((4, 16), np.uint8), "16 bytes wide"),
    ]:
        with pytest.raises(mcl.InvalidRequest, match=what) as info:
            sha.plan(64, bad)
        assert info.value.field == "block_hashes"
    assert layout().plan(64, [b"\x01"] * 4).num_keys == 4  # unset: vLLM's worker takes any
    assert mcl.KVLayout.from_dict(sha.to_dict()) == sha and sha.to_dict()["hash_bytes"] == 32
    assert "hash_bytes" not in layout().to_dict()  # (the reference ports' config, unchanged)
    with pytest.raises(mcl.InvalidRequest, match="hash_bytes"):
        layout(hash_bytes=0)


def test_the_coordinator_fails_only_the_caller_with_the_wrong_width() -> None:
    sha = layout(hash_bytes=32)
    good = chain(4, b"good")
    store = mcl.FakeStore(sha.plan(64, good).keys)

    async def run() -> list[Any]:
        async with mcl.LookupCoordinator(sha, store) as coord:
            return await asyncio.gather(
                coord.lookup(64, [b"\x01"] * 4), coord.lookup(80, good), return_exceptions=True
            )

    bad, hit = asyncio.run(run())
    assert isinstance(bad, mcl.InvalidRequest) and bad.field == "block_hashes"
    assert hit == 64


async def post(app: Any, payload: Any, **kw: Any) -> httpx.Response:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            if isinstance(payload, bytes):
                return await client.post(
                    "/v1/lookup", content=payload, headers={"content-type": OCTET_STREAM}
                )
            return await client.post(kw.get("path", "/v1/lookup"), json=payload)


def frame(hashes: list[bytes]) -> bytes:
    return struct.pack(">IH", 64, len(hashes[0])) + b"".join(hashes)


@pytest.mark.parametrize(
    ("payload", "loc", "message"),
    [
        ({"num_tokens": 64, "block_hashes": ["01"] * 4}, ["body", "block_hashes"], "1 bytes"),
        (
            {"num_tokens": 64, "block_hashes": ["ab" * 32, "01", "ab" * 32]},
            ["body", "block_hashes"],
            "2 widths",
        ),
        (
            {"num_tokens": 64, "block_hashes_b64": base64.b64encode(b"\1" * 8).decode(),
             "hash_len": 2},
            ["body", "block_hashes_b64"],
            "2 bytes wide",
        ),
        (frame([b"\1"] * 4), ["body", "block_hashes"], "1 bytes"),
        (
            {"requests": [{"num_tokens": 64, "block_hashes": ["ab" * 32]},
                          {"num_tokens": 64, "block_hashes": ["ab" * 8]}]},
            ["body", "requests", 1, "block_hashes"],
            "8 bytes wide, not 32 or 16",
        ),
    ],
)
async def test_http_answers_a_wrong_width_with_a_422_naming_the_field(
    payload: Any, loc: list[Any], message: str
) -> None:
    app = create_app(layout(), mcl.FakeStore())
    path = "/v1/lookup/batch" if isinstance(payload, dict) and "requests" in payload else None
    r = await post(app, payload, **({"path": path} if path else {}))
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == loc and message in error["msg"], error


async def test_http_takes_the_layouts_width_then_the_hashers() -> None:
    xx = {"num_tokens": 64, "block_hashes": ["ab" * 16] * 4}  # 16 bytes: xxhash's width
    assert (await post(create_app(layout(), mcl.FakeStore()), xx)).status_code == 200
    r = await post(create_app(layout(hash_bytes=32), mcl.FakeStore()), xx)
    assert r.status_code == 422 and "not 32" in r.json()["detail"][0]["msg"]
    hasher = mcl.BlockHasher(16, algo="sha256")
    app = create_app(layout(), mcl.FakeStore(), router_options={"hasher": hasher})
    assert (await post(app, xx)).status_code == 422


async def test_a_non_hex_hash_is_told_so() -> None:
    app = create_app(layout(), mcl.FakeStore())
    for text, message in [("zz" * 32, "hex digits only"), ("abc", "an even number of hex")]:
        r = await post(app, {"num_tokens": 64, "block_hashes": ["ab" * 32, text]})
        assert r.status_code == 422 and message in r.json()["detail"][0]["msg"], r.text
