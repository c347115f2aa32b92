"""Shared fixtures: a real loopback Mooncake master (and a writer) for the integration tests.

The fixtures are session-scoped and synchronous. The Mooncake clients of aio_mclookup are not bound
to an event loop (their work runs on their own threads), so a writer opened here with
``asyncio.run`` can be awaited from each test's own loop. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from aio_mclookup import LocalMaster, MooncakeStore, StoreWriter

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is Linux-only
    uvloop = None

# Modules whose async tests run on both asyncio's default loop and uvloop.
_BOTH_LOOPS = {"test_coordinator.py", "test_coordinator_integration.py"}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run the coordinator's async tests on asyncio and on uvloop; the rest on asyncio."""
    if uvloop is None or item.path.name not in _BOTH_LOOPS:
        return {"asyncio": asyncio.new_event_loop}
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


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
