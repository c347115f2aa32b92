"""The app's lifetime: the lifespan that owns a store and a coordinator, and the dependency that
hands the coordinator to routes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Annotated, Any

from fastapi import Depends, Request

from .. import (
    FakeStore,
    KVLayout,
    LookupCoordinator,
    SGLangLayout,
    Store,
)
from .._errors import InvalidRequest
from ._decode import _coordinator_of
from ._models import STATE_KEY, StoreSource


async def get_coordinator(request: Request) -> LookupCoordinator:
    """The app's coordinator (put there by :func:`coordinator_lifespan`); 503 before start-up.

    In your own routes take ``coordinator: CoordinatorDep`` (or ``Depends(get_coordinator)``);
    override it with ``app.dependency_overrides[get_coordinator]``. It is ``async`` so that
    FastAPI calls it on the event loop (a plain ``def`` would cost a thread-pool hop per
    request).
    """
    return _coordinator_of(request.scope)


def coordinator_lifespan(
    layout: KVLayout | SGLangLayout,
    store: StoreSource | None = None,
    *,
    master_address: str | None = None,
    metadata_server: str | None = None,
    store_options: Mapping[str, Any] | None = None,
    own_store: bool | None = None,
    **coordinator_options: Any,
) -> Callable[[Any], contextlib.AbstractAsyncContextManager[dict[str, Any]]]:
    """A FastAPI/Starlette ``lifespan`` that owns a store and a coordinator.

    ``store`` is a :class:`~aio_mclookup.Store` or a zero-argument factory of one (called at
    start-up, so the lifespan can run more than once). Without it, a ``MooncakeStore`` on
    ``master_address`` / ``metadata_server`` (plus ``store_options``) is built. A store that is
    an async context manager is entered at start-up and exited at shut-down, unless
    ``own_store=False`` (a store the caller opened and will close).

    ``coordinator_options`` go to :class:`~aio_mclookup.LookupCoordinator`; unlike its own
    defaults, ``when_full`` defaults to ``"raise"`` here (a full queue answers 429 instead of
    queueing HTTP requests). The coordinator is published in the lifespan state and in
    ``app.state`` under :data:`STATE_KEY`. Compose it inside your own lifespan with
    ``async with coordinator_lifespan(...)(app):``.
    """
    if store is None and (master_address is None or metadata_server is None):
        raise InvalidRequest("give a store, or master_address and metadata_server", field="store")
    options = {"when_full": "raise", **coordinator_options}
    LookupCoordinator(layout, FakeStore(), **options)  # bad options fail here, not at start-up

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[dict[str, Any]]:
        async with contextlib.AsyncExitStack() as stack:
            the_store = _make_store(store, master_address, metadata_server, store_options)
            coordinator = LookupCoordinator(layout, the_store, **options)
            owned = own_store if own_store is not None else hasattr(the_store, "__aenter__")
            if owned:
                await stack.enter_async_context(the_store)  # type: ignore[arg-type]
            await stack.enter_async_context(coordinator)
            setattr(app.state, STATE_KEY, coordinator)
            stack.callback(_drop_from_state, app, coordinator)
            yield {STATE_KEY: coordinator}

    return lifespan


def _drop_from_state(app: Any, coordinator: LookupCoordinator) -> None:
    if getattr(app.state, STATE_KEY, None) is coordinator:
        delattr(app.state, STATE_KEY)


def _make_store(
    store: StoreSource | None,
    master_address: str | None,
    metadata_server: str | None,
    store_options: Mapping[str, Any] | None,
) -> Store:
    if store is None:
        from .._store.mooncake import MooncakeStore

        assert master_address is not None and metadata_server is not None
        return MooncakeStore(master_address, metadata_server, **dict(store_options or {}))
    # A store instance has batch_is_exist on its type; a class or a factory function has not.
    if callable(store) and not hasattr(type(store), "batch_is_exist"):
        return store()
    return store  # type: ignore[return-value]


CoordinatorDep = Annotated[LookupCoordinator, Depends(get_coordinator)]
"""A route parameter annotated with this receives the app's coordinator."""
