"""Error discipline at the HTTP edge (issue 14): the failing field comes from
``InvalidRequest.field`` (never from parsing the message), and failures are answered by the
coordinator's own error label."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")

from aio_mclookup import (
    BlockHasher,
    ClosedError,
    Error,
    FakeStore,
    InvalidRequest,
    LookupTimeout,
    Overloaded,
    StoreError,
)
from aio_mclookup._errors import InternalError
from aio_mclookup.fastapi import create_app
from test_fastapi import LAYOUT, body, body_b64, prompt, serve


def app_raising(exc: Error, **router: Any) -> Any:
    """An app whose coordinator raises ``exc`` from every lookup."""
    app = create_app(LAYOUT, FakeStore(), router_options=router or None)
    inner = app.router.lifespan_context

    async def fail(*args: Any, **kwargs: Any) -> int:
        raise exc

    class Lifespan:
        def __init__(self, app: Any) -> None:
            self.cm = inner(app)

        async def __aenter__(self) -> Any:
            state = await self.cm.__aenter__()
            coordinator = state["aio_mclookup_coordinator"]
            coordinator.lookup = coordinator.lookup_result = fail
            return state

        async def __aexit__(self, *exc_info: Any) -> Any:
            return await self.cm.__aexit__(*exc_info)

    app.router.lifespan_context = Lifespan
    return app


HASHER = BlockHasher(16, algo="sha256", seed="1", vllm_version=LAYOUT.vllm_version)
TOKENS = {"token_ids": list(range(64))}


@pytest.mark.parametrize(
    ("field", "payload", "loc"),
    [
        # The message says nothing about the field: only .field can name it.
        ("token_len", body(64, prompt(4)), ["body", "token_len"]),
        ("block_hashes.2", body(64, prompt(4)), ["body", "block_hashes", 2]),
        ("block_hashes.2", body_b64(64, prompt(4)), ["body", "block_hashes_b64"]),
        (None, body(64, prompt(4)), ["body", "block_hashes"]),
        (None, body_b64(64, prompt(4)), ["body", "block_hashes_b64"]),
        ("timeout", body(64, prompt(4)), ["body", "block_hashes"]),  # not a body field
        ("groups.1.sliding_window", body(64, prompt(4)), ["body", "block_hashes"]),
        ("num_tokens", TOKENS, ["body", "token_ids"]),
        ("block_hashes", TOKENS, ["body", "token_ids"]),
        (None, TOKENS, ["body", "token_ids"]),
    ],
)
async def test_invalid_request_is_422_at_its_field(
    field: str | None, payload: dict[str, Any], loc: list[Any]
) -> None:
    exc = InvalidRequest("something is wrong with this request", field=field)
    async with serve(app_raising(exc, hasher=HASHER)) as client:
        r = await client.post("/v1/lookup", json=payload)
        assert r.status_code == 422, r.text
        assert r.json()["detail"] == [
            {"loc": loc, "msg": "something is wrong with this request", "type": "invalid_request"}
        ]
        r = await client.post("/v1/lookup/batch", json={"requests": [payload]})
        assert r.json()["detail"][0]["loc"] == ["body", "requests", 0, *loc[1:]]


@pytest.mark.parametrize(
    ("exc", "status", "error", "code", "retry"),
    [
        (Overloaded("full"), 429, "overloaded", None, True),
        (LookupTimeout("late"), 503, "timeout", None, True),
        (ClosedError("closed"), 503, "closed", None, False),
        (StoreError("rpc failed", code=-900), 503, "store_error", -900, True),
        (StoreError("client raised"), 503, "store_error", None, True),
        (InternalError("a bug"), 500, "internal_error", None, False),
    ],
)
async def test_failures_are_answered_by_their_label(
    exc: Error, status: int, error: str, code: int | None, retry: bool
) -> None:
    async with serve(app_raising(exc)) as client:
        for route, payload in (
            ("/v1/lookup", body(64, prompt(4))),
            ("/v1/lookup/batch", {"requests": [body(64, prompt(4))] * 2}),
        ):
            r = await client.post(route, json=payload)
            assert r.status_code == status, r.text
            assert r.json() == {"error": error, "detail": str(exc), "field": None, "code": code}
            assert ("retry-after" in r.headers) is retry


def test_the_router_keeps_no_exception_table_of_its_own() -> None:
    import importlib
    import inspect
    import pkgutil

    import aio_mclookup.fastapi as package

    sources = {
        info.name: inspect.getsource(importlib.import_module(info.name))
        for info in pkgutil.iter_modules(package.__path__, "aio_mclookup.fastapi.")
    }
    body_scanner = sources.pop("aio_mclookup.fastapi._scan")  # reads bodies, not errors
    assert "str(" not in body_scanner and ".args" not in body_scanner
    source = "".join(sources.values())
    assert "import re\n" not in source  # no message parsing
    assert "error_label(exc)" in source  # the one table: aio_mclookup._errors.error_label
    for name in ("LookupTimeout", "Overloaded", "ClosedError"):
        assert f"isinstance(exc, {name})" not in source
