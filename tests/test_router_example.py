"""examples/router.py end to end: OpenAI-style bodies with prompt token ids, a real master whose
keys were written for the hasher's hashes, and the routing decisions that follow."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import stop_process

pytest.importorskip("fastapi")

import httpx

from aio_mclookup import BlockHasher, FullAttention, KVLayout
from aio_mclookup.fastapi import coordinator_lifespan
from test_fastapi import ROOT, http_client, uvicorn_server

sys.path.insert(0, str(ROOT / "examples"))
router_example = importlib.import_module("router")

LAYOUT = KVLayout(
    [FullAttention(16)],
    model="org/router-e2e",
    hash_block_size=16,
    scheduler_block_size=16,
    vllm_version="0.33.0",
)
HASHER = BlockHasher(16, algo="sha256", vllm_version=LAYOUT.vllm_version)
BACKENDS = ["http://engine-a:8000", "http://engine-b:8000", "http://engine-c:8000"]


def keys_of(hashes: Any) -> list[str]:
    return [f"router-e2e@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{bytes(h).hex()}" for h in hashes]


def openai_body(ids: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": "org/router-e2e", "prompt_token_ids": ids, "max_tokens": 16, **extra}


@pytest.mark.integration
async def test_router_decides_from_what_the_store_holds(
    store_writer: Any, mooncake_store: Any
) -> None:
    system = list(range(3000, 3000 + 512))  # a cached 512-token system prompt
    cached_prompt = system + list(range(100, 140))  # 552 tokens: 34 full blocks, 32 stored
    cold_a = list(range(9000, 9300))
    cold_b = cold_a[:200] + list(range(1, 100))  # the same start: the same first block
    lora_prompt = list(range(7000, 7100))
    await store_writer.put_keys(keys_of(HASHER.hash(system)))
    await store_writer.put_keys(
        keys_of(HASHER.hash(lora_prompt, lora_name="sql", lora_path="/loras/sql"))
    )
    lifespan = coordinator_lifespan(LAYOUT, mooncake_store, own_store=False)
    app = router_example.create_router_app(
        LAYOUT,
        lifespan,
        backends=BACKENDS,
        hasher=HASHER,
        min_cached_tokens=64,
        loras={"sql": "/loras/sql"},
    )
    async with uvicorn_server(app) as base, http_client(base) as client:
        r = await client.post("/v1/route", json=openai_body(cached_prompt, temperature=0.2))
        assert r.status_code == 200, r.text
        first = r.json()
        assert first["policy"] == "cached" and first["cached_tokens"] == 512
        assert first["num_tokens"] == 552 and first["backend"] in BACKENDS
        # Cached prompts go to the least busy backend: three in a row spread over all three.
        seen = {first["backend"]}
        for _ in range(2):
            seen.add(
                (await client.post("/v1/route", json=openai_body(cached_prompt))).json()["backend"]
            )
        assert seen == set(BACKENDS)
        # Cold prompts that start alike go to one backend (prefix affinity).
        a = (await client.post("/v1/route", json=openai_body(cold_a))).json()
        b = (await client.post("/v1/route", json=openai_body(cold_b))).json()
        assert a["policy"] == b["policy"] == "cold" and a["cached_tokens"] == 0
        assert a["backend"] == b["backend"]
        # The salt and the LoRA adapter are part of the hashes, as in vLLM.
        salted = (
            await client.post("/v1/route", json=openai_body(cached_prompt, cache_salt="t1"))
        ).json()
        assert salted["policy"] == "cold" and salted["cached_tokens"] == 0
        lora = (
            await client.post("/v1/route", json={**openai_body(lora_prompt), "model": "sql"})
        ).json()
        assert lora["policy"] == "cached" and lora["cached_tokens"] == 96  # 6 blocks; leave one
        plain = (await client.post("/v1/route", json=openai_body(lora_prompt))).json()
        assert plain["cached_tokens"] == 0
        # Bad bodies are refused; done lowers a backend's load.
        r = await client.post("/v1/route", json=openai_body([1, -5]))
        assert r.status_code == 422
        r = await client.post("/v1/route", json={"model": "x"})
        assert r.status_code == 422
        assert (
            await client.post("/v1/route/done", json={"backend": BACKENDS[0]})
        ).status_code == 204
        assert (
            await client.post("/v1/route/done", json={"backend": "elsewhere"})
        ).status_code == 404
        # The library's routes come along: the same answer through /v1/lookup.
        r = await client.post("/v1/lookup", json={"token_ids": cached_prompt})
        assert r.json() == {"hit_tokens": 512}


@pytest.mark.integration
async def test_the_documented_command_serves_decisions(local_master: Any, tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **os.environ,
        "AIO_MCLOOKUP_LAYOUT": str(ROOT / "examples" / "layouts" / "single_full_attention.json"),
        "AIO_MCLOOKUP_BACKENDS": ",".join(BACKENDS),
        "AIO_MCLOOKUP_HASH_SEED": "0",  # the example layout's vLLM 0.26 needs one
        "MOONCAKE_MASTER": local_master.master_address,
        "MOONCAKE_METADATA": local_master.metadata_server,
    }
    argv = ["-m", "uvicorn", "router:app", "--app-dir", "examples", "--host", "127.0.0.1"]
    argv += ["--no-access-log", "--port", str(port)]
    log_path = tmp_path / "router.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *argv, env=env, cwd=ROOT, stdout=log_file, stderr=log_file
        )
    try:
        async with http_client(f"http://127.0.0.1:{port}") as client:
            deadline = time.monotonic() + 30.0
            while True:
                assert proc.returncode is None, log_path.read_text()[-2000:]
                assert time.monotonic() < deadline, "the router did not start"
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/healthz")).status_code == 200:
                        break
                await asyncio.sleep(0.05)
            r = await client.post("/v1/route", json=openai_body(list(range(64))))
            assert r.status_code == 200 and r.json()["policy"] == "cold"
            assert r.json()["backend"] in BACKENDS
    finally:
        await stop_process(proc)


async def test_router_422s_never_echo_the_input() -> None:
    from aio_mclookup import FakeStore

    app = router_example.create_router_app(
        LAYOUT, coordinator_lifespan(LAYOUT, FakeStore()), backends=BACKENDS, hasher=HASHER
    )
    marker = "SECRET-PROMPT-TEXT"
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            for body in (
                openai_body([1, 2, marker, *range(5000)]),  # type: ignore[list-item]
                {"model": marker * 100, "prompt_token_ids": [1, 2, 3]},
                openai_body(list(range(40)), cache_salt=12345),
                openai_body([-5, *range(40)]),  # refused by the hasher (InvalidRequest)
            ):
                r = await client.post("/v1/route", json=body)
                assert r.status_code == 422, r.text
                assert marker not in r.text and len(r.content) < 600, r.text
                (item,) = r.json()["detail"]
                assert item["loc"][0] == "body" and item["msg"] and "input" not in item
