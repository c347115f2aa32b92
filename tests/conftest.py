"""Shared fixtures: a real loopback Mooncake master (and a writer) for the integration tests.

The fixtures are session-scoped and synchronous. The Mooncake clients of aio_mclookup are not bound
to an event loop (their work runs on their own threads), so a writer opened here with
``asyncio.run`` can be awaited from each test's own loop. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from aio_mclookup import LocalMaster, MooncakeStore, StoreWriter

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is Linux-only
    uvloop = None

_BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    *(
        [pytest.param(("asyncio", {"loop_factory": uvloop.new_event_loop}), id="uvloop")]
        if uvloop is not None
        else []
    ),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """The backends of the tests marked ``anyio`` (anyio's pytest plugin): asyncio, uvloop
    (asyncio with uvloop's loop) and trio."""
    backend: tuple[str, dict[str, Any]] = request.param
    return backend


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_pycollect_makeitem(
    collector: pytest.Module | pytest.Class, name: str, obj: object
) -> Generator[None, Any, None]:
    """Hand the tests marked ``anyio`` back to anyio's plugin: with ``asyncio_mode = "auto"``,
    pytest-asyncio converts every async test into its own item and runs it on asyncio
    (whatever ``anyio_backend`` says). This wrapper, outside its, turns those items back into
    plain ones, which anyio's ``pytest_pyfunc_call`` runs on the test's backend."""
    outcome = yield
    result = outcome.get_result()
    if not result:
        return
    items = result if isinstance(result, list) else [result]
    if any(_is_anyio(item) for item in items):
        outcome.force_result([_plain(item) if _is_anyio(item) else item for item in items])


def _is_anyio(item: object) -> bool:
    return isinstance(item, pytest.Function) and item.get_closest_marker("anyio") is not None


def _plain(item: pytest.Function) -> pytest.Function:
    """A plain :class:`pytest.Function` for ``item`` (pytest-asyncio's subclass or not)."""
    if type(item) is pytest.Function:
        return item
    assert item.parent is not None
    plain = pytest.Function.from_parent(
        item.parent,
        name=item.name,
        callspec=getattr(item, "callspec", None),
        callobj=item.obj,
        fixtureinfo=item._fixtureinfo,
        keywords=item.keywords,
        originalname=item.originalname,
    )
    plain.own_markers = [m for m in item.own_markers if m.name != "asyncio"]
    return plain


def _require_mooncake() -> None:
    pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine-non-cuda")


@pytest.fixture(scope="session")
def local_master() -> Iterator[LocalMaster]:
    """A real ``mooncake_master`` + HTTP metadata server on loopback, for the whole session."""
    _require_mooncake()
    master = LocalMaster(startup_timeout=30.0)
    master.start_blocking()
    try:
        yield master
    finally:
        master.stop_blocking()


@pytest.fixture(scope="session")
def store_writer(local_master: LocalMaster) -> Iterator[StoreWriter]:
    """A :class:`StoreWriter` on :func:`local_master`; its keys live until the session ends."""
    writer = StoreWriter(local_master.master_address, local_master.metadata_server)
    asyncio.run(asyncio.wait_for(writer.open(), 30.0))
    try:
        yield writer
    finally:
        asyncio.run(asyncio.wait_for(writer.aclose(), 60.0))


@pytest.fixture(scope="session")
def mooncake_store(local_master: LocalMaster) -> Iterator[MooncakeStore]:
    """A lookup-only :class:`MooncakeStore` on :func:`local_master`, shared by the session."""
    store = MooncakeStore(local_master.master_address, local_master.metadata_server)
    asyncio.run(asyncio.wait_for(store.open(), 30.0))
    try:
        yield store
    finally:
        asyncio.run(asyncio.wait_for(store.aclose(), 60.0))
