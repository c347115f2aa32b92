"""``/docs`` with no network: ``create_app`` serves Swagger UI's and ReDoc's files itself (the
``docs-offline`` extra, package ``fastapi-offline``). Checked in process (the page names only
same-origin files, and they are served), then in Debian's headless Chromium against a real
uvicorn on loopback, with every host name but 127.0.0.1 made unresolvable: the page renders
the routes, and a screenshot shows it (FastAPI's own page, from a CDN, stays blank)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")

import httpx
from fastapi import FastAPI

from aio_mclookup import FakeStore, FullAttention, InvalidRequest, KVLayout
from aio_mclookup.fastapi import create_app

LAYOUT = KVLayout([FullAttention(16)], model="org/toy", hash_block_size=16, scheduler_block_size=16)
ASSETS = "/static-offline-docs"
CHROMIUM = Path("/usr/bin/chromium")
# Every host name but the server's fails to resolve: the page gets no network at all.
NO_NETWORK = "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,1600",
    "--virtual-time-budget=10000",
    NO_NETWORK,
]
SWAGGER_POST_GREEN = 0x49CC90  # Swagger UI's POST badge (.opblock-post .opblock-summary-method)


def need(ok: bool, reason: str) -> None:
    """Skip without ``ok``; under CI (the ``CI`` variable set) fail instead: CI must run it."""
    if ok:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must run this test: {reason}")
    pytest.skip(reason)


def need_extra() -> None:
    try:
        import fastapi_offline  # noqa: F401
    except ImportError:
        need(False, "needs the docs-offline extra (pip install -e '.[docs-offline]')")


def app(**options: Any) -> FastAPI:
    return create_app(LAYOUT, FakeStore(), **options)


@contextlib.asynccontextmanager
async def client(api: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app's lifespan and an in-process client for it."""
    async with api.router.lifespan_context(api):
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            yield c


_URL = re.compile(r"""(?:src|href|spec-url)=["']([^"']+)["']|url:\s*['"]([^'"]+)['"]""")


def page_urls(html: str) -> list[str]:
    """The URLs a docs page loads: src, href and spec-url attributes, and ``url: '...'``."""
    return [a or b for a, b in _URL.findall(html)]


# ------------------------------------------------------------------------------ in process
@pytest.mark.parametrize("offline_docs", [True, None])
async def test_docs_pages_load_only_same_origin_files_and_they_are_served(
    offline_docs: bool | None,
) -> None:
    need_extra()
    kinds = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}
    async with client(app(offline_docs=offline_docs)) as c:
        for page, assets in [
            ("/docs", {"swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"}),
            ("/redoc", {"redoc.standalone.js", "favicon.png"}),
        ]:
            r = await c.get(page)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            assert "://" not in r.text, f"{page} names an absolute URL:\n{r.text}"
            urls = page_urls(r.text)
            assert all(u.startswith("/") and not u.startswith("//") for u in urls), urls
            assert {u.rpartition("/")[2] for u in urls if u.startswith(ASSETS)} == assets
            assert "/openapi.json" in urls
            for url in (u for u in urls if u.startswith(ASSETS)):
                asset = await c.get(url)
                assert asset.status_code == 200, url
                kind = kinds[Path(url).suffix]
                assert asset.headers["content-type"].startswith(kind), (url, asset.headers)
                assert len(asset.content) > (1000 if kind == "image/png" else 100_000), url
        bundle = (await c.get(f"{ASSETS}/swagger-ui-bundle.js")).text
    # Swagger UI 4 cannot render FastAPI's OpenAPI 3.1; the bundle states its version.
    m = re.search(r'PACKAGE_VERSION:"(\d+)\.(\d+)\.(\d+)"', bundle)
    assert m and int(m.group(1)) >= 5, m and m.group(0)


async def test_the_routes_and_the_schema_are_the_same_with_offline_docs() -> None:
    need_extra()
    offline, stock = app(offline_docs=True), app(offline_docs=False)
    assert offline.openapi() == stock.openapi()  # the asset mount is not part of the API
    async with client(offline) as c:
        r = await c.post("/v1/lookup", json={"num_tokens": 32, "block_hashes": ["ab" * 32] * 2})
        assert r.status_code == 200 and r.json() == {"hit_tokens": 0}
        assert (await c.get("/healthz")).status_code == 200


async def test_offline_docs_false_keeps_fastapis_cdn_page() -> None:
    async with client(app(offline_docs=False)) as c:
        page = (await c.get("/docs")).text
        assert "https://cdn.jsdelivr.net/" in page and ASSETS not in page
        assert (await c.get(f"{ASSETS}/swagger-ui.css")).status_code == 404


async def test_without_the_extra_true_raises_and_the_default_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "fastapi_offline", None)  # import fails: not installed
    with pytest.raises(InvalidRequest, match=r"pip install -e '\.\[docs-offline\]'") as info:
        app(offline_docs=True)
    assert info.value.field == "offline_docs"
    async with client(app()) as c:
        assert "https://cdn.jsdelivr.net/" in (await c.get("/docs")).text


# ------------------------------------------------------------------------ a real browser
@contextlib.contextmanager
def uvicorn_server(api: FastAPI) -> Iterator[str]:
    """Serve ``api`` with uvicorn on a free loopback port, in a thread; yields the base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        api, log_level="warning", loop="asyncio", http="h11", ws="none", lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20.0
        while not server.started:
            assert thread.is_alive(), "uvicorn exited during start-up"
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20.0)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"


def chromium(profile: Path, *args: str) -> str:
    """Run headless Chromium (no network but loopback) once; its standard output."""
    proc = subprocess.run(
        [str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=90,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"chromium exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


def png_colours(path: Path) -> tuple[tuple[int, ...], dict[int, int]]:
    """A PNG's shape and its pixel count per 0xRRGGBB colour."""
    import matplotlib.image
    import numpy as np

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    img = matplotlib.image.imread(path)
    rgb = np.rint(np.asarray(img)[..., :3] * 255).astype(np.uint32)
    packed = rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2]
    values, counts = np.unique(packed, return_counts=True)
    return img.shape, dict(zip(values.tolist(), counts.tolist()))


@pytest.mark.timeout(300)
def test_docs_render_in_headless_chromium_with_no_network(tmp_path: Path) -> None:
    need(CHROMIUM.exists(), f"needs Debian's chromium ({CHROMIUM}; apt-get install chromium)")
    need_extra()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        need(False, "needs matplotlib (the report extra) to read the screenshot")
    offline = app(offline_docs=True)
    spec = offline.openapi()
    routes = sorted(spec["paths"])
    assert "/v1/lookup" in routes
    shot = tmp_path / "docs.png"
    with uvicorn_server(offline) as base:
        chromium(tmp_path / "p1", f"--screenshot={shot}", f"{base}/docs")
        dom = chromium(tmp_path / "p2", "--dump-dom", f"{base}/docs")
        redoc = chromium(tmp_path / "p3", "--dump-dom", f"{base}/redoc")
    # Swagger UI's operation rows exist only once its JS ran and fetched /openapi.json.
    for route in routes:
        assert re.search(rf'class="opblock-summary-path"[^>]*data-path="{route}"', dom), route
    assert re.search(r">OAS 3\.1<", dom), "no OpenAPI 3.1 version stamp"
    summary = spec["paths"]["/v1/lookup"]["post"]["summary"]
    assert summary in redoc, "ReDoc did not render /v1/lookup"

    shape, colours = png_colours(shot)
    assert shape[:2] == (1600, 1280), shape
    background = max(colours, key=lambda c: colours[c])
    drawn = 1 - colours[background] / (shape[0] * shape[1])
    assert len(colours) > 100 and drawn > 0.05, (len(colours), drawn, shot)
    assert colours.get(SWAGGER_POST_GREEN, 0) > 1000, f"{shot}: no POST badge"

    # The control: FastAPI's own page, whose files come from a CDN, renders nothing here.
    blank = tmp_path / "stock.png"
    with uvicorn_server(app(offline_docs=False)) as base:
        chromium(tmp_path / "p4", f"--screenshot={blank}", f"{base}/docs")
        stock_dom = chromium(tmp_path / "p5", "--dump-dom", f"{base}/docs")
    assert "opblock" not in stock_dom
    assert len(png_colours(blank)[1]) == 1, "FastAPI's CDN page drew something offline"
