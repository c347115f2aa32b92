"""The served OpenAPI schema describes the real responses: each response of the lookup routes
(success and error, JSON) validates against the schema ``/openapi.json`` declares for its
status and media type, and the success schemas are the models (not ``{"type": "string"}``)."""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema
import pytest

from aio_mclookup import BlockHasher, FakeStore, FullAttention, KVLayout
from aio_mclookup.fastapi import create_app
from helpers import chain

LAYOUT = KVLayout([FullAttention(16)], model="org/m", hash_block_size=16, scheduler_block_size=16)


def check(openapi: dict[str, Any], path: str, response: httpx.Response) -> None:
    """Validate one real response against what the schema declares for it."""
    declared = openapi["paths"][path]["post"]["responses"]
    assert str(response.status_code) in declared, (path, response.status_code, declared.keys())
    media = response.headers["content-type"].split(";")[0]
    schema = declared[str(response.status_code)]["content"][media]["schema"]
    validator = jsonschema.Draft202012Validator({**schema, "components": openapi["components"]})
    errors = list(validator.iter_errors(response.json()))
    assert not errors, (path, response.status_code, response.json(), errors[0].message)


async def test_real_lookup_responses_validate_against_the_served_schema() -> None:
    hashes = chain(6, b"doc")
    store = FakeStore(LAYOUT.plan(64, hashes).keys)
    hasher = BlockHasher(16, algo="sha256")
    app = create_app(LAYOUT, store, router_options={"hasher": hasher, "max_batch_requests": 3})
    hexes = [h.hex() for h in hashes]
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            openapi = (await client.get("/openapi.json")).json()
            for path in ("/v1/lookup", "/v1/lookup/batch"):
                ok = openapi["paths"][path]["post"]["responses"]["200"]["content"]
                assert ok["application/json"]["schema"] != {"type": "string"}
            single = [
                {"num_tokens": 100, "block_hashes": hexes},
                {"token_len": 32, "block_hashes": hexes},
                {"token_ids": list(range(40))},
                {"num_tokens": 40, "block_hashes": ["zz"]},  # 422
                {"num_tokens": 40},  # 422
            ]
            seen = set()
            for payload in single:
                r = await client.post("/v1/lookup", json=payload)
                seen.add(r.status_code)
                check(openapi, "/v1/lookup", r)
            r = await client.post("/v1/lookup", content=b"x", headers={"content-type": "text/x"})
            check(openapi, "/v1/lookup", r)  # 415
            seen.add(r.status_code)
            assert (await client.post("/v1/lookup", json=single[0])).json() == {"hit_tokens": 64}
            batches: list[dict[str, Any]] = [
                {"requests": single[:3]},
                {"requests": []},
                {"requests": single[:4]},  # 413: over max_batch_requests
                {"requests": [single[0], single[3]]},  # 422
            ]
            for payload in batches:
                r = await client.post("/v1/lookup/batch", json=payload)
                seen.add(r.status_code)
                check(openapi, "/v1/lookup/batch", r)
            assert {200, 413, 415, 422} <= seen


def test_the_checker_rejects_a_response_the_schema_does_not_describe() -> None:
    openapi = create_app(LAYOUT, FakeStore()).openapi()
    wrong = httpx.Response(200, json={"hit_tokens": "16"})
    with pytest.raises(AssertionError, match="is not of type 'integer'"):
        check(openapi, "/v1/lookup", wrong)
