"""Token-id bodies (issue 16, "Routers"): the router hashes token ids with its hasher and answers
vLLM's scheduler view, checked against the vLLM 0.33 oracle; bad token input is a 422 naming the
field; GET /v1/layout; end to end against a real master."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("fastapi")

import httpx
from fastapi import FastAPI

from aio_mclookup import BlockHasher, FakeStore, FullAttention, KVLayout, StoreWriter
from aio_mclookup._reference.v033 import BaselineLookupV033
from aio_mclookup.fastapi import HASHER_KEY, coordinator_lifespan, create_app, create_router
from test_fastapi import http_client, metric, serve, uvicorn_server

LAYOUT = KVLayout(
    [FullAttention(16)],
    model="org/toy-model",
    hash_block_size=16,
    scheduler_block_size=16,
    vllm_version="0.33.0",
)  # vLLM 0.33's rules
HASHER = BlockHasher(16, algo="sha256", vllm_version="0.33.0")


def tokens(count: int, start: int = 1000) -> list[int]:
    return list(range(start, start + count))


def keys_of(layout: KVLayout, hashes: Any) -> list[str]:
    """The keys vLLM's worker stores for these block hashes (one group, TP 1)."""
    name = layout.model.split("/")[-1]
    return [f"{name}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{bytes(h).hex()}" for h in hashes]


async def oracle_hit(layout: KVLayout, store: Any, num_tokens: int, hashes: Any) -> int:
    """vLLM 0.33's worker lookup (the reference port) on the store's own answers."""
    ref = BaselineLookupV033(layout.to_dict())
    hash_list = [bytes(h) for h in hashes]
    keys, meta = ref.build_keys(num_tokens, hash_list)
    answers = await store.batch_is_exist(keys) if keys else []
    return ref.resolve(num_tokens, hash_list, meta, answers).hit_length


def app_with(store: FakeStore, hasher: BlockHasher | None = HASHER, **router: Any) -> FastAPI:
    return create_app(LAYOUT, store, router_options={"hasher": hasher, **router})


# ------------------------------------------------------------------------- in process
@pytest.mark.parametrize(
    ("prompt_len", "cached_blocks"),
    [(100, 6), (96, 6), (100, 3), (100, 0), (15, 0), (16, 1), (17, 1), (0, 0)],
)
async def test_token_ids_answer_like_vllm(prompt_len: int, cached_blocks: int) -> None:
    ids = tokens(prompt_len)
    hashes = HASHER.hash(ids)
    store = FakeStore()
    store.add(keys_of(LAYOUT, hashes[:cached_blocks]))
    expected = await oracle_hit(LAYOUT, store, prompt_len, hashes)
    async with serve(app_with(store)) as client:
        r = await client.post("/v1/lookup", json={"token_ids": ids})
        assert r.status_code == 200, r.text
        assert r.json() == {"hit_tokens": expected}
        # The same prompt as hashes with num_tokens: the same answer.
        r = await client.post(
            "/v1/lookup",
            json={"num_tokens": prompt_len, "block_hashes": [bytes(h).hex() for h in hashes]},
        )
        assert r.json() == {"hit_tokens": expected}
        r = await client.post(
            "/v1/lookup", json={"token_ids": ids, "num_tokens": prompt_len}
        )  # num_tokens may be given, if it agrees
        assert r.json() == {"hit_tokens": expected}
    if prompt_len == 96 and cached_blocks == 6:
        assert expected == 80  # a whole-prompt hit leaves one block to compute


async def test_extra_keys_change_the_hashes_and_batches_mix_forms() -> None:
    ids = tokens(64)
    plain = HASHER.hash(ids)
    salted = HASHER.hash(ids, cache_salt="tenant-7")
    lora = HASHER.hash(ids, lora_name="adapter", lora_path="/loras/adapter")
    mm = HASHER.hash(ids, mm_features=[("img-0", 8, 20)])
    store = FakeStore()
    store.add(keys_of(LAYOUT, salted))
    store.add(keys_of(LAYOUT, mm[:2]))
    async with serve(app_with(store)) as client:
        single = [
            ({"token_ids": ids}, 0),
            ({"token_ids": ids, "cache_salt": "tenant-7"}, 48),
            ({"token_ids": ids, "cache_salt": "tenant-8"}, 0),
            ({"token_ids": ids, "lora_name": "adapter", "lora_path": "/loras/adapter"}, 0),
            (
                {
                    "token_ids": ids,
                    "mm_features": [{"identifier": "img-0", "offset": 8, "length": 20}],
                },
                32,
            ),
        ]
        for payload, hit in single:
            r = await client.post("/v1/lookup", json=payload)
            assert r.status_code == 200 and r.json() == {"hit_tokens": hit}, (payload, r.text)
        store.add(keys_of(LAYOUT, lora))
        r = await client.post(
            "/v1/lookup/batch",
            json={
                "requests": [
                    {"token_ids": ids, "lora_name": "adapter", "lora_path": "/loras/adapter"},
                    {"num_tokens": 64, "block_hashes": [bytes(h).hex() for h in salted]},
                    {"token_len": 32, "block_hashes": [bytes(h).hex() for h in plain[:2]]},
                    {"token_ids": ids[:40], "cache_salt": "tenant-7"},
                ]
            },
        )
        assert r.status_code == 200, r.text
        assert r.json() == {"hit_tokens": [48, 48, 0, 32]}
    assert len({bytes(p[0]) for p in (plain, salted, lora, mm)}) == 4


BAD_TOKEN_BODIES = [
    ({"token_ids": [1, 2.5]}, ["body", "token_ids", 1]),
    ({"token_ids": [1, "2"]}, ["body", "token_ids", 1]),
    ({"token_ids": [True, 2]}, ["body", "token_ids", 0]),
    ({"token_ids": [1, None]}, ["body", "token_ids", 1]),
    ({"token_ids": [1, [2]]}, ["body", "token_ids", 1]),
    ({"token_ids": [1, -2]}, ["body", "token_ids", 1]),
    ({"token_ids": [1, 1 << 63]}, ["body", "token_ids", 1]),
    ({"token_ids": [1, 1 << 64]}, ["body", "token_ids", 1]),
    ({"token_ids": [1, -(1 << 70)]}, ["body", "token_ids", 1]),
    ({"token_ids": "1 2 3"}, ["body", "token_ids"]),
    ({"token_ids": {"0": 1}}, ["body", "token_ids"]),
    ({"token_ids": [1], "block_hashes": ["ab"]}, ["body", "token_ids"]),
    ({"token_ids": [1], "block_hashes_b64": "AAAA"}, ["body", "token_ids"]),
    ({"token_ids": [1], "token_len": 16}, ["body", "token_len"]),
    ({"token_ids": [1], "hash_len": 32}, ["body", "hash_len"]),
    ({"token_ids": [1, 2], "num_tokens": 3}, ["body", "num_tokens"]),
    ({"token_ids": [1], "lora_name": 7}, ["body", "lora_name"]),
    ({"token_ids": [1], "lora_path": "p" * 5000}, ["body", "lora_path"]),
    ({"token_ids": [1], "cache_salt": ["x"]}, ["body", "cache_salt"]),
    ({"token_ids": [1], "mm_features": "img"}, ["body", "mm_features"]),
    ({"token_ids": [1] * 8, "mm_features": [["img", 0, 4]]}, ["body", "mm_features", 0]),
    (
        {"token_ids": [1] * 8, "mm_features": [{"identifier": "img", "offset": 6, "length": 4}]},
        ["body", "mm_features", 0, "length"],
    ),
    (
        {"token_ids": [1] * 8, "mm_features": [{"identifier": "img", "offset": -1, "length": 4}]},
        ["body", "mm_features", 0, "offset"],
    ),
    (
        {"token_ids": [1] * 8, "mm_features": [{"identifier": "", "offset": 0, "length": 4}]},
        ["body", "mm_features", 0, "identifier"],
    ),
    (
        {"token_ids": [1] * 8, "mm_features": [{"identifier": "i", "offset": 0, "size": 4}]},
        ["body", "mm_features", 0, "size"],
    ),
    ({"block_hashes": ["ab"], "num_tokens": 16, "cache_salt": "s"}, ["body", "cache_salt"]),
]


@pytest.mark.parametrize(("payload", "loc"), BAD_TOKEN_BODIES)
async def test_bad_token_bodies_are_422_naming_the_field(
    payload: dict[str, Any], loc: list[Any]
) -> None:
    store = FakeStore()
    async with serve(app_with(store)) as client:
        r = await client.post("/v1/lookup", json=payload)
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == loc and len(r.json()["detail"]) == 1
        r = await client.post("/v1/lookup/batch", json={"requests": [{"token_ids": [1]}, payload]})
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["body", "requests", 1, *loc[1:]]
    assert store.calls == []


async def test_a_huge_token_list_is_bounded_like_hashes() -> None:
    limit = 1000  # hashes per request: 16,015 tokens at most (1,000 blocks + a partial one)
    store = FakeStore()
    async with serve(app_with(store, max_hashes_per_request=limit, max_body_bytes=64 << 20)) as c:
        r = await c.post("/v1/lookup", json={"token_ids": [7] * (16 * limit + 15)})
        assert r.status_code == 200
        bad = "[" + ",".join(["-1"] * 2_000_000) + "]"  # 2 M bad ids: refused by the count
        started = time.monotonic()
        r = await c.post(
            "/v1/lookup",
            content=('{"token_ids": ' + bad + "}").encode(),
            headers={"content-type": "application/json"},
        )
        elapsed = time.monotonic() - started
    assert r.status_code == 413 and r.json()["error"] == "too_many_tokens"
    assert r.json()["field"] == "token_ids" and len(r.content) < 1024 and elapsed < 5.0


async def test_without_a_hasher_token_ids_are_refused() -> None:
    async with serve(app_with(FakeStore(), hasher=None)) as client:
        r = await client.post("/v1/lookup", json={"token_ids": [1, 2, 3]})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "token_ids"]
        assert "hasher" in r.json()["detail"][0]["msg"]
        layout = (await client.get("/v1/layout")).json()
    assert layout == {
        "layout": LAYOUT.to_dict(), "hasher": None, "engine": "vllm", "version": "0.33.0"
    }
    with pytest.raises(ValueError, match="hasher"):
        create_router(hasher=object())  # type: ignore[arg-type]


async def test_layout_route_and_a_hasher_published_by_the_lifespan() -> None:
    store = FakeStore()
    hasher = BlockHasher(16, algo="sha256_cbor", seed="42", vllm_version="0.33.0")
    inner = coordinator_lifespan(LAYOUT, store)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        async with inner(app) as state:
            yield {**state, HASHER_KEY: hasher}

    app = FastAPI(lifespan=lifespan)
    app.include_router(create_router())
    ids = tokens(48)
    store.add(keys_of(LAYOUT, hasher.hash(ids)))
    # A real server: it hands the lifespan's state to every request.
    async with uvicorn_server(app) as base, http_client(base) as client:
        body = (await client.get("/v1/layout")).json()
        assert body["layout"] == LAYOUT.to_dict()
        assert body["hasher"] == hasher.to_dict()
        assert body["hasher"]["algo"] == "sha256_cbor" and "42" not in str(body["hasher"])
        r = await client.post("/v1/lookup", json={"token_ids": ids})
        assert r.json() == {"hit_tokens": 32}
        r = await client.post("/v1/lookup", json={"token_ids": ids, "num_tokens": 48})
        assert r.json() == {"hit_tokens": 32}
        text = (await client.get("/metrics")).text
    assert metric(text, "aio_mclookup_lookups_total") == 2


@pytest.mark.integration
async def test_token_ids_find_keys_written_for_the_hashers_hashes(
    local_master: Any, mooncake_store: Any
) -> None:
    """End to end: keys written with StoreWriter for the hashes the hasher computes for prompts
    are found when the prompts' token ids are posted, with vLLM 0.33's hits."""
    layout = KVLayout(
        [FullAttention(16)],
        model="org/e2e-tokens",
        hash_block_size=16,
        scheduler_block_size=16,
        vllm_version="0.33.0",
    )
    hasher = BlockHasher(16, algo="sha256", vllm_version=layout.vllm_version)
    prompts = [tokens(n, start=7 * n) for n in (300, 256, 100, 40)]
    cached = [19, 16, 2, 0]  # blocks written per prompt: 300 -> 19 of 18 full blocks, ...
    salted = tokens(128, start=5)
    async with StoreWriter(local_master.master_address, local_master.metadata_server) as writer:
        written: list[str] = []
        for ids, blocks in zip(prompts, cached):
            written += keys_of(layout, hasher.hash(ids)[:blocks])
        written += keys_of(layout, hasher.hash(salted, cache_salt="s1"))
        assert await writer.put_keys(written) == len(written)
        expected = [
            await oracle_hit(layout, mooncake_store, len(ids), hasher.hash(ids)) for ids in prompts
        ]
        assert expected == [288, 240, 32, 0]
        app = create_app(layout, mooncake_store, own_store=False, router_options={"hasher": hasher})
        async with uvicorn_server(app) as base, http_client(base) as client:
            for ids, hit in zip(prompts, expected):
                r = await client.post("/v1/lookup", json={"token_ids": ids})
                assert r.status_code == 200 and r.json() == {"hit_tokens": hit}, r.text
            r = await client.post(
                "/v1/lookup/batch",
                json={
                    "requests": [
                        *({"token_ids": ids} for ids in prompts),
                        {"token_ids": salted, "cache_salt": "s1"},
                        {"token_ids": salted},
                    ]
                },
            )
            assert r.json() == {"hit_tokens": [*expected, 112, 0]}
            layout_body = (await client.get("/v1/layout")).json()
            assert layout_body["hasher"]["algo"] == "sha256"
            assert layout_body["layout"]["vllm_version"] == layout.vllm_version
            with contextlib.suppress(httpx.TransportError):
                await client.aclose()
