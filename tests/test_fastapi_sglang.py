"""The HTTP router against an SGLang layout (fastapi/_sglang): token ids hashed with the layout's
page hashing, page hashes as hex, base64 or the binary frame, answers equal to
``plan.resolve`` over every key; vLLM-only fields, bad widths and short hash lists are 422s
naming the field before any lookup; GET /v1/layout names the engine; end to end on a real
master."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import struct
from typing import Any

import pytest

pytest.importorskip("fastapi")

import httpx

from aio_mclookup import FakeStore, KVLayout, SGLangLayout
from aio_mclookup.fastapi import create_app
from test_fastapi import http_client, metric, serve, uvicorn_server

LAYOUT = SGLangLayout(
    sglang_version="0.5.23", page_size=4, model_name="Qwen/Qwen3-8B", tp_size=2,
    prefetch_threshold=8,
)
OTHERS = [
    SGLangLayout(sglang_version="0.5.20", page_size=8, model_name="deepseek-ai/DeepSeek-V3",
                 tp_size=4, mla=True, prefetch_threshold=0),
    SGLangLayout(sglang_version="0.5.17", page_size=4, model_name="m", tp_size=2, pp_size=2,
                 eagle=True, prefetch_threshold=4),
    SGLangLayout(sglang_version="0.5.23", page_size=2, tp_size=2, tp_lcm_size=4,
                 hicache_mem_layout="page_head", extra_backend_tag="t", prefetch_threshold=2),
]


def tokens(count: int, start: int = 1000) -> list[int]:
    return list(range(start, start + count))


def stored_keys(layout: SGLangLayout, ids: list[int], pages: int, **ns: Any) -> list[bytes]:
    """The keys of the prompt's first ``pages`` pages on every querying rank (what HiCache
    wrote), the probed keys of a longer request."""
    hashes = layout.page_hashes(ids, **ns)
    pages = min(pages, len(hashes))
    every = SGLangLayout.from_dict({**layout.to_dict(), "prefetch_threshold": 0})
    return every.plan(pages * layout.page_size + 2, hashes).keys


async def oracle(layout: SGLangLayout, store: Any, num_tokens: int, hashes: Any) -> int:
    """SGLang's hit: every key of the plan asked, ``plan.resolve`` on the answers."""
    plan = layout.plan(num_tokens, hashes)
    return plan.resolve(await store.batch_is_exist(plan.keys)) if plan.keys else 0


def app(layout: SGLangLayout, store: Any, **options: Any) -> Any:
    return create_app(layout, store, **options)


# ------------------------------------------------------------------------- in process
async def test_a_batch_with_a_namespace_that_is_not_text_starts_no_lookup() -> None:
    store = FakeStore()
    async with serve(app(LAYOUT, store)) as client:
        for field in ("extra_key", "cache_salt"):
            batch = {"requests": [{"token_ids": tokens(120)},
                                  {"token_ids": tokens(120), field: "\udfff"}]}
            r = await client.post("/v1/lookup/batch", content=json.dumps(batch).encode(),
                                  headers={"content-type": "application/json"})
            assert r.status_code == 422, r.text
            assert r.json()["detail"][0]["loc"] == ["body", "requests", 1, field]
        stats = (await client.get("/metrics")).text
    assert metric(stats, "aio_mclookup_lookups_total") == 0 and not store.calls


async def test_narrow_token_ids_are_hashed_by_the_coordinator_not_the_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (ids that all fit 32 bits reach LookupCoordinator.lookup_tokens, which hashes their
    # pages off the event loop: the layout's page_hashes is never called for them)
    store = FakeStore()
    doc = tokens(120)
    store.add(stored_keys(LAYOUT, doc, 20, extra_key="k"))
    cuts = [30, 81, 120]
    want = [await oracle(LAYOUT, store, n + 1, LAYOUT.page_hashes([*doc[:n], 7], extra_key="k"))
            for n in cuts]

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the route hashed narrow ids itself")

    monkeypatch.setattr(SGLangLayout, "page_hashes", refused)
    async with serve(app(LAYOUT, store)) as client:
        for n, hit in zip(cuts, want):
            r = await client.post("/v1/lookup", json={"token_ids": [*doc[:n], 7],
                                                      "extra_key": "k"})
            assert r.status_code == 200, r.text
            assert r.json() == {"hit_tokens": hit}
        batch = {"requests": [{"token_ids": [*doc[:n], 7], "extra_key": "k"} for n in cuts]}
        r = await client.post("/v1/lookup/batch", json=batch)
        assert r.status_code == 200, r.text
        assert r.json() == {"hit_tokens": want}


@pytest.mark.parametrize("layout", [LAYOUT, *OTHERS], ids=lambda x: repr(x)[13:40])
async def test_token_ids_and_hashes_answer_sglangs_hit(layout: SGLangLayout) -> None:
    store = FakeStore()
    doc = tokens(64)
    salted = tokens(40, start=9)
    store.add(stored_keys(layout, doc, 5))
    store.add(stored_keys(layout, salted, 8, extra_key="lora-1", cache_salt="s"))
    # a hole: page 7 of the doc is stored, page 6 is not (nothing after the miss counts)
    page_7 = stored_keys(layout, doc, 8)[7 * layout.keys_per_page :]
    store.add(page_7)
    cuts = [0, 1, 3, 4, 5, 8, 9, 12, 17, 20, 21, 22, 30, 33, 64]
    async with serve(app(layout, store)) as client:
        for n in cuts:
            ids = doc[:n] + tokens(3, start=50_000)
            hashes = layout.page_hashes(ids)
            want = await oracle(layout, store, len(ids), hashes)
            r = await client.post("/v1/lookup", json={"token_ids": ids})
            assert r.status_code == 200, r.text
            assert r.json() == {"hit_tokens": want}, n
            hexed = {"num_tokens": len(ids), "block_hashes": [h.hex() for h in hashes]}
            assert (await client.post("/v1/lookup", json=hexed)).json() == {"hit_tokens": want}
            b64 = {
                "num_tokens": len(ids),
                "block_hashes_b64": base64.b64encode(b"".join(hashes)).decode(),
                "hash_len": 32,
            }
            assert (await client.post("/v1/lookup", json=b64)).json() == {"hit_tokens": want}
            frame = struct.pack(">IH", len(ids), 32) + b"".join(hashes)
            r = await client.post(
                "/v1/lookup", content=frame, headers={"content-type": "application/octet-stream"}
            )
            assert r.status_code == 200 and struct.unpack(">I", r.content) == (want,)
        ns = {"extra_key": "lora-1", "cache_salt": "s"}
        salted_want = await oracle(layout, store, 41, layout.page_hashes([*salted, 7], **ns))
        batch = {
            "requests": [
                {"token_ids": [*salted, 7], **ns},
                {"token_ids": [*salted, 7]},  # another namespace (0.5.17: the same one)
                {"token_ids": doc, "num_tokens": 64},
            ]
        }
        r = await client.post("/v1/lookup/batch", json=batch)
        plain = await oracle(layout, store, 41, layout.page_hashes([*salted, 7]))
        full = await oracle(layout, store, 64, layout.page_hashes(doc))
        assert r.json() == {"hit_tokens": [salted_want, plain, full]}
        text = (await client.get("/metrics")).text
    assert salted_want > 0 and full > 0
    if layout.sglang_version != "0.5.17":
        assert plain == 0
    assert metric(text, "aio_mclookup_lookups_total") == 4 * len(cuts) + 3


async def test_the_hit_is_exact_for_every_cut_of_a_prompt() -> None:
    """Every prompt length against a store holding pages 0-5 and 7 of one prompt: the router's
    answer from token ids is ``plan.resolve`` over all the plan's keys."""
    store = FakeStore()
    doc = tokens(48, start=3)
    keys = stored_keys(LAYOUT, doc, 8)
    per_page = LAYOUT.keys_per_page
    store.add(keys[: 6 * per_page] + keys[7 * per_page :])
    store.add(keys[6 * per_page : 6 * per_page + 1])  # page 6: one rank's "k" only
    async with serve(app(LAYOUT, store)) as client:
        hits = []
        for n in range(49):
            want = await oracle(LAYOUT, store, n, LAYOUT.page_hashes(doc[:n]))
            r = await client.post("/v1/lookup", json={"token_ids": doc[:n]})
            assert r.json() == {"hit_tokens": want}, n
            hits.append(want)
    assert max(hits) == 24 and hits[:9] == [0] * 9  # pages 0-5; below the threshold: 0


@pytest.mark.parametrize(
    ("body", "loc", "words"),
    [
        ({"token_ids": [1, 2], "token_len": 0}, ["body", "token_len"], "vLLM"),
        ({"token_ids": [1, 2], "lora_name": "a"}, ["body", "lora_name"], "extra_key"),
        ({"token_ids": [1, 2], "lora_path": "a"}, ["body", "lora_path"], "extra_key"),
        (
            {"token_ids": [1], "mm_features": [{"identifier": "x", "offset": 0, "length": 1}]},
            ["body", "mm_features"],
            "multimodal",
        ),
        ({"token_len": 8, "block_hashes": ["00" * 32]}, ["body", "token_len"], "num_tokens"),
        ({"num_tokens": 9, "block_hashes": ["00" * 32], "extra_key": "k"},
         ["body", "extra_key"], "token_ids only"),
        ({"num_tokens": 9, "block_hashes": ["00" * 31] * 2}, ["body", "block_hashes"], "32 bytes"),
        ({"num_tokens": 13, "block_hashes": ["00" * 32] * 2},
         ["body", "block_hashes"], "probes 3"),
        ({"num_tokens": 9, "block_hashes_b64": "AAAA", "hash_len": 3},
         ["body", "block_hashes_b64"], "32 bytes"),
        ({"block_hashes": ["00" * 32]}, ["body", "num_tokens"], "num_tokens"),
        ({"token_ids": [1, 2, 3], "num_tokens": 4}, ["body", "num_tokens"], "len(token_ids)"),
        ({"token_ids": [1, -2]}, ["body", "token_ids", 1], "[0, 2^63)"),
        ({"token_ids": [1, "x"]}, ["body", "token_ids", 1], "integer"),
        ({"token_ids": [1], "extra_key": 5}, ["body", "extra_key"], "string"),
        ({"token_ids": [1], "colour": 5}, ["body", "colour"], "unknown field"),
    ],
)
async def test_bad_sglang_bodies_are_422_naming_the_field(
    body: dict[str, Any], loc: list[Any], words: str
) -> None:
    store = FakeStore()
    async with serve(app(LAYOUT, store)) as client:
        r = await client.post("/v1/lookup", json=body)
        assert r.status_code == 422, r.text
        (detail,) = r.json()["detail"]
        assert detail["loc"] == loc and words in detail["msg"], detail
        batch = {"requests": [{"token_ids": tokens(20)}, body]}
        r = await client.post("/v1/lookup/batch", json=batch)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][:3] == [
            "body", "requests", 1,
        ]
        stats = (await client.get("/metrics")).text
    # refused while decoding: not one lookup started, nothing reached the store
    assert metric(stats, "aio_mclookup_lookups_total") == 0
    assert store.calls == []


async def test_wide_ids_and_limits() -> None:
    old = SGLangLayout(sglang_version="0.5.20", page_size=4, prefetch_threshold=0)
    async with serve(app(old, FakeStore())) as client:
        r = await client.post("/v1/lookup", json={"token_ids": [1, 2, 1 << 32, 4, 5]})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "token_ids"]
        assert "does not fit in uint32" in r.json()["detail"][0]["msg"]
    # 0.5.23 hashes such pages as wide pages
    async with serve(app(LAYOUT, FakeStore())) as client:
        r = await client.post("/v1/lookup", json={"token_ids": [1, 2, 1 << 32, 4, 5] * 4})
        assert r.status_code == 200 and r.json() == {"hit_tokens": 0}
    # the token limit follows the page size: max_hashes pages (and a partial one)
    options = {"max_hashes_per_request": 3, "max_body_bytes": 10_000}
    limited = app(LAYOUT, FakeStore(), router_options=options)
    async with serve(limited) as client:
        r = await client.post("/v1/lookup", json={"token_ids": tokens(15)})
        assert r.status_code == 200
        r = await client.post("/v1/lookup", json={"token_ids": tokens(16)})
        assert r.status_code == 413 and r.json()["error"] == "too_many_tokens"
        four = {"num_tokens": 99, "block_hashes": ["00" * 32] * 4}
        r = await client.post("/v1/lookup", json=four)
        assert r.status_code == 413 and r.json()["error"] == "too_many_hashes"


async def test_layout_route_names_the_engine_and_vllm_refuses_extra_key() -> None:
    async with serve(app(LAYOUT, FakeStore())) as client:
        body = (await client.get("/v1/layout")).json()
        schema = (await client.get("/openapi.json")).json()
    assert body["engine"] == "sglang" and body["version"] == "0.5.23"
    assert body["layout"] == LAYOUT.to_dict() and body["layout"]["engine"] == "sglang"
    assert body["hasher"]["page_size"] == 4 and body["hasher"]["engine"] == "sglang"
    props = schema["components"]["schemas"]["LayoutResponse"]["properties"]
    assert {"engine", "version"} <= set(props)
    request = schema["paths"]["/v1/lookup"]["post"]["requestBody"]["content"]["application/json"]
    assert "extra_key" in request["schema"]["properties"]
    vllm = KVLayout.from_dict({
        "model": "m", "hash_block_size": 16, "scheduler_block_size": 16,
        "groups": [{"kind": "full_attention", "block_size": 16}],
    })
    async with serve(create_app(vllm, FakeStore())) as client:
        salted = {"num_tokens": 16, "block_hashes": [], "extra_key": "x"}
        r = await client.post("/v1/lookup", json=salted)
        assert r.status_code == 422
        (detail,) = r.json()["detail"]
        assert detail["loc"] == ["body", "extra_key"] and "SGLang" in detail["msg"]
        body = (await client.get("/v1/layout")).json()
    assert body["engine"] == "vllm" and body["version"] == vllm.vllm_version


# ------------------------------------------------------------------------- real master
@pytest.mark.integration
async def test_router_from_token_ids_on_a_real_master(
    local_master: Any, store_writer: Any, mooncake_store: Any
) -> None:
    """Keys written to a real master as SGLang's ranks write them are found from token ids
    posted to a real server, one by one and concurrently, each answer ``plan.resolve`` over
    the plan's keys asked of the same master."""
    layout = SGLangLayout(
        sglang_version="0.5.23", page_size=16, model_name="org/e2e-sglang", tp_size=2,
        prefetch_threshold=32,
    )
    docs = [tokens(256, start=100_000 * (i + 1)) for i in range(4)]
    written: list[str] = []
    for i, doc in enumerate(docs):
        written += [k.decode() for k in stored_keys(layout, doc, 4 + 3 * i)]
    salted = tokens(128, start=7)
    written += [k.decode() for k in stored_keys(layout, salted, 8, cache_salt="t1")]
    assert await store_writer.put_keys(written) == len(written)
    requests: list[dict[str, Any]] = []
    for doc in docs:
        for cut in (0, 17, 40, 64, 100, 150, 256):
            requests.append({"token_ids": doc[:cut] + tokens(20, start=5_000_000 + cut)})
    requests += [{"token_ids": salted, "cache_salt": "t1"}, {"token_ids": salted}]
    expected = []
    for req in requests:
        hashes = layout.page_hashes(req["token_ids"], cache_salt=req.get("cache_salt"))
        expected.append(await oracle(layout, mooncake_store, len(req["token_ids"]), hashes))
    assert any(expected) and expected[-1] == 0 and expected[-2] > 0
    server = create_app(layout, mooncake_store, own_store=False)
    async with uvicorn_server(server) as base, http_client(base) as client:
        replies = await asyncio.gather(*(client.post("/v1/lookup", json=r) for r in requests))
        assert [r.json()["hit_tokens"] for r in replies] == expected
        r = await client.post("/v1/lookup/batch", json={"requests": requests})
        assert r.json() == {"hit_tokens": expected}
        text = (await client.get("/metrics")).text
        with contextlib.suppress(httpx.TransportError):
            await client.aclose()
    assert metric(text, "aio_mclookup_lookups_total") == 2 * len(requests)


async def test_sglang_responses_validate_against_the_served_schema() -> None:
    from test_fastapi_openapi import check

    jsonschema = pytest.importorskip("jsonschema")
    doc = tokens(40)
    store = FakeStore(stored_keys(LAYOUT, doc, 6))
    async with serve(app(LAYOUT, store, router_options={"max_batch_requests": 2})) as client:
        openapi = (await client.get("/openapi.json")).json()
        hexes = [h.hex() for h in LAYOUT.page_hashes(doc)]
        single: list[dict[str, Any]] = [
            {"token_ids": doc, "extra_key": "k", "cache_salt": "s"},
            {"token_ids": doc},
            {"num_tokens": 40, "block_hashes": hexes},
            {"token_ids": doc, "token_len": 8},  # 422
            {"num_tokens": 40, "block_hashes": hexes[:2]},  # 422: pages 0-8 are probed
        ]
        seen = set()
        for payload in single:
            r = await client.post("/v1/lookup", json=payload)
            seen.add(r.status_code)
            check(openapi, "/v1/lookup", r)
        for batch in (single[:2], single[:3], [single[1], single[4]]):
            r = await client.post("/v1/lookup/batch", json={"requests": batch})
            seen.add(r.status_code)
            check(openapi, "/v1/lookup/batch", r)
        assert seen == {200, 413, 422}
        layout = await client.get("/v1/layout")
        declared = openapi["paths"]["/v1/layout"]["get"]["responses"]["200"]["content"]
        schema = declared["application/json"]["schema"]
        validator = jsonschema.Draft202012Validator({**schema, "components": openapi["components"]})
        assert not list(validator.iter_errors(layout.json()))
    assert (await _hit(store, {"token_ids": doc})) == 24  # pages 0-5
    assert (await _hit(store, {"token_ids": doc, "cache_salt": "s"})) == 0


async def _hit(store: FakeStore, body: dict[str, Any]) -> int:
    async with serve(app(LAYOUT, store)) as client:
        hit: int = (await client.post("/v1/lookup", json=body)).json()["hit_tokens"]
        return hit
