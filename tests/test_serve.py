"""``aio-mclookup serve`` (``_cli_serve``) and the service it runs (``fastapi/_serve``,
``fastapi/_ready``): settings from flags over the environment, checked before anything starts;
``/readyz``; and the command itself as a real process against a real master (and with its own,
``--demo``), stopped by SIGTERM with exit 0 within 10 s."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import httpx

from aio_mclookup import FakeStore, InvalidRequest, KVLayout, SGLangLayout, StoreError, _cli
from aio_mclookup.fastapi import create_app
from aio_mclookup.fastapi._ready import create_readiness_router
from aio_mclookup.fastapi._serve import ENVIRONMENT, ServeSettings
from helpers import chain

ROOT = Path(__file__).resolve().parents[1]
LAYOUT_FILE = ROOT / "examples" / "layouts" / "single_full_attention.json"
LAYOUT = KVLayout.from_dict(json.loads(LAYOUT_FILE.read_text()))
SGLANG_FILE = ROOT / "examples" / "layouts" / "sglang_qwen3_tp2.json"
STOP_WITHIN = 10.0


def env(**values: str) -> dict[str, str]:
    return {ENVIRONMENT[name]: value for name, value in values.items()}


# -------------------------------------------------------------------------------- settings
def test_settings_come_from_the_environment_and_go_back_to_it() -> None:
    settings = ServeSettings.from_environ(
        env(
            layout=str(LAYOUT_FILE),
            master="127.0.0.1:50051",
            metadata="http://127.0.0.1:8080/metadata",
            hash_algo="sha256_cbor",
            hash_seed="1234",
            timeout="2.5",
            cache_ttl=" None ",
            max_body_bytes="1000",
            max_hashes_per_request="10",
            max_batch_requests="3",
            threads="2",
        )
    )
    assert (settings.master, settings.timeout, settings.cache_ttl) == ("127.0.0.1:50051", 2.5, None)
    assert settings.router_options() == {
        "max_body_bytes": 1000,
        "max_hashes_per_request": 10,
        "max_batch_requests": 3,
    }
    assert settings.coordinator_options() == {"timeout": 2.5, "cache_ttl": None}
    assert ServeSettings.from_environ(settings.to_environ()) == settings
    hasher = settings.load_hasher(settings.load_layout())
    assert hasher is not None and hasher.algo == "sha256_cbor"
    plain = ServeSettings.from_environ(env(layout=str(LAYOUT_FILE)))
    assert plain.cache_ttl == 5.0 and plain.timeout == 5.0 and plain.router_options() == {}
    assert ServeSettings.from_environ(env(layout="x", cache_ttl="600")).cache_ttl == 600.0


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({}, "AIO_MCLOOKUP_LAYOUT is not set"),
        ({"master": "127.0.0.1:1"}, "MOONCAKE_MASTER and MOONCAKE_METADATA go together"),
        ({"cache_ttl": "0"}, r"AIO_MCLOOKUP_CACHE_TTL='0': give seconds \(> 0\) or 'none'"),
        ({"cache_ttl": "nan"}, "AIO_MCLOOKUP_CACHE_TTL='nan'"),
        ({"cache_ttl": ""}, "AIO_MCLOOKUP_CACHE_TTL=''"),
        ({"timeout": "none"}, r"AIO_MCLOOKUP_TIMEOUT='none': give seconds \(> 0\)$"),
        ({"max_batch_requests": "0"}, "AIO_MCLOOKUP_MAX_BATCH='0': give an integer >= 1"),
        ({"threads": "four"}, "AIO_MCLOOKUP_STORE_THREADS='four'"),
    ],
)
def test_bad_settings_name_their_variable(values: dict[str, str], message: str) -> None:
    values = {"layout": str(LAYOUT_FILE), **values} if values else {}
    with pytest.raises(InvalidRequest, match=message):
        ServeSettings.from_environ(env(**values))


def test_a_hash_configuration_that_cannot_be_reproduced_is_refused() -> None:
    settings = ServeSettings.from_environ(env(layout=str(LAYOUT_FILE), hash_algo="xxhash"))
    with pytest.raises(InvalidRequest, match="AIO_MCLOOKUP_HASH_ALGO='xxhash'"):
        settings.load_hasher(settings.load_layout())
    with pytest.raises(InvalidRequest, match=r"nope\.json: cannot read it"):
        ServeSettings.from_environ(env(layout="nope.json")).load_layout()


def test_either_engines_layout_file(tmp_path: Path) -> None:
    sglang = ServeSettings.from_environ(env(layout=str(SGLANG_FILE)))
    layout = sglang.load_layout()
    assert isinstance(layout, SGLangLayout) and layout.tp_size == 2
    assert layout == SGLangLayout.from_dict(json.loads(SGLANG_FILE.read_text()))
    assert sglang.load_hasher(layout) is None  # (the layout hashes its pages itself)
    salted = ServeSettings.from_environ(env(layout=str(SGLANG_FILE), hash_seed="1"))
    with pytest.raises(InvalidRequest, match="AIO_MCLOOKUP_HASH_SEED: SGLang hashes pages"):
        salted.load_hasher(layout)
    said = tmp_path / "vllm.json"
    said.write_text(json.dumps({"engine": "vllm", **json.loads(LAYOUT_FILE.read_text())}))
    assert ServeSettings.from_environ(env(layout=str(said))).load_layout() == LAYOUT
    for bad, message in (
        ({"engine": "trtllm"}, '"engine" must be "vllm" or "sglang"'),
        ({"engine": "sglang", "page_size": 64}, "'sglang_version' is required"),
        ({"engine": "sglang", "sglang_version": "0.4.0", "page_size": 64}, "not supported"),
    ):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(InvalidRequest, match="not a valid layout: .*" + re.escape(message)):
            ServeSettings.from_environ(env(layout=str(path))).load_layout()


def run_cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = _cli.main(["serve", *argv])
    return code, err.getvalue()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layout", str(LAYOUT_FILE)], "no master: give --master and --metadata"),
        (["--demo", "--master", "127.0.0.1:1", "--layout", str(LAYOUT_FILE)], "--demo starts"),
        (["--demo-keys", "--layout", str(LAYOUT_FILE)], "--demo-keys only applies with --demo"),
        (["--demo", "--layout", "nope.json"], "nope.json: cannot read it"),
        (["--demo", "--layout", str(LAYOUT_FILE), "--cache-ttl", "-1"], "CACHE_TTL='-1'"),
        (["--demo", "--layout", str(LAYOUT_FILE), "--workers", "0"], "--workers out of range"),
        (["--demo", "--layout", str(LAYOUT_FILE), "--hash-algo", "xxhash"], "'xxhash'"),
    ],
)
def test_the_command_refuses_bad_flags_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], message: str
) -> None:
    for variable in ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    code, err = run_cli(*argv)
    assert code == 2 and message in err, err


def test_flags_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIO_MCLOOKUP_LAYOUT", "nope.json")
    monkeypatch.setenv("AIO_MCLOOKUP_TIMEOUT", "9")
    args = _cli.build_parser().parse_args(
        ["serve", "--demo", "--layout", str(LAYOUT_FILE), "--timeout", "1.5"]
    )
    from aio_mclookup._cli_serve import serve_settings

    settings = serve_settings(args)
    assert settings.layout == str(LAYOUT_FILE) and settings.timeout == 1.5


# ---------------------------------------------------------------------------------- /readyz
class _Broken(FakeStore):
    async def batch_is_exist(self, keys: Any) -> list[int]:
        raise StoreError("master unreachable", code=-900)


class _Hung(FakeStore):
    async def batch_is_exist(self, keys: Any) -> list[int]:
        await asyncio.sleep(60)
        return [0] * len(keys)


@pytest.mark.parametrize(
    ("store", "status", "reason"),
    [
        (FakeStore(), 200, None),
        (_Broken(), 503, "StoreError: master unreachable"),
        (_Hung(), 503, "no answer within 0.2 s"),
    ],
)
async def test_readyz_is_one_probe_rpc_to_the_store(
    store: FakeStore, status: int, reason: str | None
) -> None:
    app = create_app(LAYOUT, store, offline_docs=False)
    app.include_router(create_readiness_router(probe_timeout=0.2))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        r = await client.get("/readyz")  # (no lifespan yet: the coordinator is not running)
        assert r.status_code == 503 and r.json()["error"] == "not_ready"
        async with app.router.lifespan_context(app) as state:
            app.state._state.update(state)
            r = await client.get("/readyz")
    assert r.status_code == status and r.json()["ready"] is (status == 200)
    assert r.json()["reason"] == reason
    assert "/readyz" in app.openapi()["paths"]


# ------------------------------------------------------------------ the command, for real
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def serving(argv: list[str], log: Path) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """``aio-mclookup serve ARGV`` as a child process, until /healthz answers; then SIGTERM,
    and the exit is checked: 0 within :data:`STOP_WITHIN` seconds."""
    port = _free_port()
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aio_mclookup", "serve", *argv, "--port", str(port),
            stdout=out, stderr=out, cwd=ROOT,
        )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=15) as client:
            deadline = time.monotonic() + 60
            while True:
                assert proc.returncode is None, _text(log)[-3000:]
                assert time.monotonic() < deadline, "serve did not start"
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/healthz")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
            yield proc, client
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = await asyncio.wait_for(proc.wait(), STOP_WITHIN)
        assert code == 0, _text(log)[-3000:]
        assert time.monotonic() - started < STOP_WITHIN
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _text(path: Path | str) -> str:
    return Path(path).read_text(errors="replace")


def _exists(path: str) -> bool:
    return Path(path).exists()


@pytest.mark.integration
async def test_serve_answers_from_a_real_master_and_stops_on_sigterm(
    local_master: Any, store_writer: Any, tmp_path: Path
) -> None:
    hashes = chain(8, b"serve")
    await store_writer.put_keys(LAYOUT.plan(128, hashes[:3]).keys)
    argv = ["--layout", str(LAYOUT_FILE), "--master", local_master.master_address]
    argv += ["--metadata", local_master.metadata_server, "--cache-ttl", "none"]
    argv += ["--hash-algo", "sha256_cbor", "--hash-seed", "1234", "--max-batch", "2"]
    log = tmp_path / "serve.log"
    async with serving(argv, log) as (_proc, client):
        r = await client.get("/readyz")
        assert r.status_code == 200 and r.json()["ready"] is True
        body = {"num_tokens": 128, "block_hashes": [h.hex() for h in hashes]}
        r = await client.post("/v1/lookup", json=body)
        assert r.status_code == 200 and r.json() == {"hit_tokens": 48}
        r = await client.post("/v1/lookup/batch", json={"requests": [body] * 3})
        assert r.status_code == 413  # --max-batch 2
        layout = (await client.get("/v1/layout")).json()
        assert layout["layout"] == LAYOUT.to_dict() and layout["hasher"]["algo"] == "sha256_cbor"
        metrics = (await client.get("/metrics")).text
        assert re.search(r"^aio_mclookup_lookups_total 1\.0$", metrics, re.MULTILINE)
    text = _text(log)
    assert "Application shutdown complete" in text
    assert '"POST /v1/lookup HTTP/1.1" 200' not in text  # (no access log by default)


@pytest.mark.integration
async def test_serve_with_an_sglang_layout_answers_from_token_ids(
    local_master: Any, store_writer: Any, mooncake_store: Any, tmp_path: Path
) -> None:
    layout = SGLangLayout.from_dict(json.loads(SGLANG_FILE.read_text()))
    doc = list(range(20_000, 20_000 + 1024))
    every = SGLangLayout.from_dict({**layout.to_dict(), "prefetch_threshold": 0})
    written = every.plan(6 * 64 + 1, layout.page_hashes(doc)).keys  # pages 0-5
    salted = every.plan(5 * 64 + 1, layout.page_hashes(doc, extra_key="lora")).keys
    assert await store_writer.put_keys([k.decode() for k in written + salted]) == 44
    requests = [
        {"token_ids": doc},
        {"token_ids": doc[:300]},
        {"token_ids": doc[:200]},  # 3 pages offered: below the threshold
        {"token_ids": doc, "extra_key": "lora"},
        {"token_ids": doc, "cache_salt": "other"},
    ]
    expected = []
    for req in requests:
        ids = req["token_ids"]
        hashes = layout.page_hashes(ids, req.get("extra_key"), req.get("cache_salt"))
        plan = layout.plan(len(ids), hashes)
        answers = await mooncake_store.batch_is_exist(plan.keys) if plan.keys else []
        expected.append(plan.resolve(answers))
    assert expected == [384, 256, 0, 320, 0]
    argv = ["--layout", str(SGLANG_FILE), "--master", local_master.master_address]
    argv += ["--metadata", local_master.metadata_server]
    log = tmp_path / "serve-sglang.log"
    async with serving(argv, log) as (_proc, client):
        for req, hit in zip(requests, expected):
            r = await client.post("/v1/lookup", json=req)
            assert r.status_code == 200 and r.json() == {"hit_tokens": hit}, r.text
        r = await client.post("/v1/lookup/batch", json={"requests": requests})
        assert r.json() == {"hit_tokens": expected}
        hashes = layout.page_hashes(doc)
        body = {"num_tokens": len(doc), "block_hashes": [h.hex() for h in hashes]}
        assert (await client.post("/v1/lookup", json=body)).json() == {"hit_tokens": 384}
        r = await client.post("/v1/lookup", json={"token_ids": doc, "lora_name": "x"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "lora_name"]
        shown = (await client.get("/v1/layout")).json()
        assert (shown["engine"], shown["version"]) == ("sglang", "0.5.23")
        assert shown["layout"] == layout.to_dict()
    assert "SGLang 0.5.23 HiCache rules" in _text(log)


@pytest.mark.integration
@pytest.mark.parametrize("layout_file", [LAYOUT_FILE, SGLANG_FILE], ids=["vllm", "sglang"])
async def test_serve_demo_starts_a_master_and_loads_demo_keys(
    tmp_path: Path, layout_file: Path
) -> None:
    pytest.importorskip("mooncake.store")
    log = tmp_path / "demo.log"
    argv = ["--demo", "--demo-keys", "--layout", str(layout_file)]
    async with serving(argv, log) as (_proc, client):
        text = _text(log)
        found = re.search(r"demo master at (127\.0\.0\.1:\d+), metadata server (http://\S+)", text)
        assert found, text[-2000:]
        said = re.search(r"it finds (\d+) tokens:\n.*--data @(\S+) (http://\S+)", text)
        assert said, text[-2000:]
        assert said.group(3).endswith("/v1/lookup")
        request = json.loads(_text(said.group(2)))
        r = await client.post("/v1/lookup", json=request)
        assert r.status_code == 200 and r.json() == {"hit_tokens": int(said.group(1))}
        assert int(said.group(1)) > 0
        assert (await client.get("/readyz")).json()["ready"] is True
    assert not _exists(said.group(2))  # (the demo request is removed at the end)


@pytest.mark.integration
async def test_serve_with_two_workers_stops_them_all_on_sigterm(
    local_master: Any, store_writer: Any, tmp_path: Path
) -> None:
    hashes = chain(4, b"serve-workers")
    await store_writer.put_keys(LAYOUT.plan(64, hashes[:2]).keys)
    argv = ["--layout", str(LAYOUT_FILE), "--master", local_master.master_address]
    argv += ["--metadata", local_master.metadata_server, "--workers", "2"]
    log = tmp_path / "workers.log"
    async with serving(argv, log) as (_proc, client):
        deadline = time.monotonic() + 60
        while _text(log).count("Application startup complete") < 2:
            assert time.monotonic() < deadline, _text(log)[-2000:]
            await asyncio.sleep(0.1)
        for _ in range(4):
            body = {"num_tokens": 64, "block_hashes": [h.hex() for h in hashes]}
            r = await client.post("/v1/lookup", json=body)
            assert r.status_code == 200 and r.json() == {"hit_tokens": 32}
    assert _text(log).count("Application shutdown complete") == 2


def test_serve_exits_1_when_the_master_is_unreachable() -> None:
    argv = ["--layout", str(LAYOUT_FILE), "--master", "127.0.0.1:1"]
    argv += ["--metadata", "http://127.0.0.1:2/metadata", "--port", str(_free_port())]
    proc = subprocess.run(
        [sys.executable, "-m", "aio_mclookup", "serve", *argv],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Mooncake master 127.0.0.1:1 is not reachable" in proc.stderr
    assert "the server did not start" in proc.stderr
