"""FastAPI integration (``pip install 'aio-mclookup[fastapi]'``).

* :func:`coordinator_lifespan` owns a store and a :class:`~aio_mclookup.LookupCoordinator` for
  the app's lifetime;
* :func:`get_coordinator` is the dependency that hands the coordinator to routes;
* :func:`create_router` returns the ready :class:`~fastapi.APIRouter`: ``POST /v1/lookup``,
  ``POST /v1/lookup/batch``, ``GET /healthz`` and ``GET /metrics``;
* :func:`create_app` puts the three together.

Concurrent HTTP requests become concurrent ``coordinator.lookup`` calls, so they share RPCs
like any other callers. Nothing here blocks the event loop: ``/healthz`` and ``/metrics`` read the
coordinator's in-memory state only.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import re
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Annotated, Any, Literal, Union

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, JsonValue, StringConstraints
from starlette.types import Message

from ._coordinator import LookupCoordinator
from ._errors import ClosedError, Error, InvalidRequest, LookupTimeout, Overloaded, StoreError
from ._layout import KVLayout
from ._observe.prometheus import PROMETHEUS_CONTENT_TYPE, check_namespace, metric_family, prometheus_text
from ._plan import HashInput
from ._store import FakeStore, Store

__all__ = [
    "BatchLookupRequest",
    "CoordinatorDep",
    "BatchLookupResponse",
    "ErrorResponse",
    "HealthResponse",
    "LookupRequest",
    "LookupResponse",
    "STATE_KEY",
    "ValidationErrorResponse",
    "coordinator_lifespan",
    "create_app",
    "create_router",
    "get_coordinator",
]

STATE_KEY = "aio_mclookup_coordinator"
"""Where the lifespan puts the coordinator: the lifespan state and ``app.state``."""

StoreSource = Union[Store, Callable[[], Store]]  # noqa: UP007 (a runtime alias on 3.10)
Loc = list[str | int]
HexHash = Annotated[str, StringConstraints(pattern=r"^(?:[0-9a-fA-F]{2})+$", max_length=2048)]

_EXAMPLE_HASHES: list[JsonValue] = [
    "9f2c1e0b7a4d8c3e5f6a7b8c9d0e1f2a3b4c5d6e7f8091a2b3c4d5e6f708192a",
    "1b3d5f7092a4c6e8f0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f607",
]


# ------------------------------------------------------------------------------------ models
class LookupRequest(BaseModel):
    """One prompt: its token count and its block hashes, as a list of hex strings or as one
    base64 blob of fixed-width hashes."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"token_len": 32, "block_hashes": _EXAMPLE_HASHES},
                {
                    "token_len": 32,
                    "block_hashes_b64": base64.b64encode(
                        b"".join(bytes.fromhex(str(h)) for h in _EXAMPLE_HASHES)
                    ).decode(),
                    "hash_len": 32,
                },
            ]
        },
    )

    token_len: int = Field(
        strict=True,
        ge=0,
        le=1 << 40,
        description="Tokens to look up: a multiple of the layout's scheduler block size "
        "(vLLM's prompt length floored to it). 0 answers 0.",
    )
    block_hashes: list[HexHash] | None = Field(
        default=None,
        description="The prompt's block hashes, one per hash block, as hex (vLLM's "
        "BlockHash bytes). Give this or block_hashes_b64.",
    )
    block_hashes_b64: str | None = Field(
        default=None,
        description="The block hashes concatenated and base64-encoded (standard alphabet, "
        "padded); each hash is hash_len bytes. Give this or block_hashes.",
    )
    hash_len: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=1024,
        description="Bytes per hash in block_hashes_b64 (required with it, 32 for SHA-256).",
    )


class LookupResponse(BaseModel):
    """The prefix hit of one prompt."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"hit_tokens": 16}]})

    hit_tokens: int = Field(
        description="Prefix tokens whose KV cache is in the store (0 to token_len)."
    )


class BatchLookupRequest(BaseModel):
    """Several prompts looked up together, each like the body of POST /v1/lookup."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "requests": [
                        {"token_len": 32, "block_hashes": _EXAMPLE_HASHES},
                        {"token_len": 16, "block_hashes": _EXAMPLE_HASHES[:1]},
                    ]
                }
            ]
        },
    )

    requests: list[LookupRequest] = Field(description="The lookups, answered in this order.")


class BatchLookupResponse(BaseModel):
    """The prefix hits, in request order."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"hit_tokens": [16, 16]}]})

    hit_tokens: list[int] = Field(description="One hit per request, in request order.")


class ErrorResponse(BaseModel):
    """A failure that is not a malformed body."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "error": "store_error",
                    "detail": "Mooncake batch_is_exist failed: RPC_FAIL",
                    "field": None,
                    "code": -900,
                }
            ]
        }
    )

    error: Literal[
        "payload_too_large",
        "too_many_hashes",
        "too_many_requests",
        "overloaded",
        "store_error",
        "timeout",
        "closed",
        "not_ready",
    ] = Field(description="What went wrong, as a stable machine-readable word.")
    detail: str = Field(description="A human-readable message.")
    field: str | None = Field(
        default=None,
        description="The body field over a limit, if any (e.g. requests.2.block_hashes).",
    )
    code: int | None = Field(default=None, description="The Mooncake error code, if any.")


class ValidationErrorItem(BaseModel):
    """One problem with the body; ``loc`` names the field."""

    loc: Loc = Field(description='Where: for example ["body", "requests", 2, "token_len"].')
    msg: str
    type: str


class ValidationErrorResponse(BaseModel):
    """A malformed body (FastAPI's validation-error shape)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "detail": [
                        {
                            "loc": ["body", "token_len"],
                            "msg": "token_len=40 must be a multiple of scheduler_block_size=16",
                            "type": "invalid_request",
                        }
                    ]
                }
            ]
        }
    )

    detail: list[ValidationErrorItem]


class HealthResponse(BaseModel):
    """The coordinator's view of the store, from its recent RPC outcomes (no RPC is made)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "status": "ok",
                    "store_healthy": True,
                    "last_rpc_ok_age": 0.8,
                    "last_error": None,
                    "pending_lookups": 0,
                    "rpcs_in_flight": 0,
                }
            ]
        }
    )

    status: Literal["ok", "unhealthy"] = Field(description="ok (HTTP 200) or unhealthy (503).")
    store_healthy: bool = Field(description="False while lookups fail fast after store errors.")
    last_rpc_ok_age: float | None = Field(
        description="Seconds since the last successful RPC (null before the first)."
    )
    last_error: str | None = Field(description="The last store error, if any.")
    pending_lookups: int
    rpcs_in_flight: int


# ------------------------------------------------------------------------------------ errors
class ApiError(HTTPException):
    """An HTTP error with a JSON body; the router's routes render it as :class:`ErrorResponse`
    (or, for 422, as :class:`ValidationErrorResponse`)."""

    def __init__(
        self,
        status_code: int,
        error: str,
        detail: str,
        *,
        field: str | None = None,
        code: int | None = None,
        loc: Loc | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status_code=status_code, detail=detail, headers=headers)
        self.error = error
        self.field = field
        self.code = code
        self.loc = loc

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        if self.status_code == 422:
            loc: Loc = self.loc if self.loc is not None else ["body"]
            return {"detail": [{"loc": loc, "msg": str(self.detail), "type": self.error}]}
        return {
            "error": self.error,
            "detail": str(self.detail),
            "field": self.field,
            "code": self.code,
        }

    def response(self) -> JSONResponse:
        """The response to send."""
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def _invalid(loc: Loc, msg: str) -> ApiError:
    return ApiError(422, "invalid_request", msg, loc=loc)


_FIELD = re.compile(r"(token_len|block_hashes)\b")


def _map_error(exc: BaseException, loc: Loc, b64: bool) -> ApiError | None:
    """The HTTP error for an exception from ``coordinator.lookup`` (None: not ours)."""
    if isinstance(exc, InvalidRequest):
        m = _FIELD.match(str(exc))
        field = m.group(1) if m else None
        if field == "block_hashes" and b64:
            field = "block_hashes_b64"
        return _invalid([*loc, field] if field else loc, str(exc))
    if isinstance(exc, Overloaded):
        return ApiError(
            429, "overloaded", str(exc) or "too many pending lookups", headers={"Retry-After": "1"}
        )
    if isinstance(exc, (LookupTimeout, asyncio.TimeoutError)):
        return ApiError(
            503, "timeout", str(exc) or "lookup timed out", headers={"Retry-After": "1"}
        )
    if isinstance(exc, StoreError):
        return ApiError(503, "store_error", str(exc), code=exc.code, headers={"Retry-After": "1"})
    if isinstance(exc, ClosedError):
        return ApiError(503, "closed", str(exc) or "the coordinator is closed")
    if isinstance(exc, Error):
        return ApiError(503, "store_error", str(exc))
    return None


# ------------------------------------------------------------------------------ decoding
def _unhex(text: str) -> bytes:
    return binascii.unhexlify(text.encode("ascii"))


def _too_many(count: int | None, limit: int, loc: Loc, name: str) -> ApiError:
    what = f"{count} block hashes" if count is not None else "the block hashes"
    return ApiError(
        413,
        "too_many_hashes",
        f"{what}: more than the limit of {limit} per request",
        field=".".join(map(str, [*loc[1:], name])),
    )


def _decode_hex(hashes: list[str], loc: Loc, limit: int) -> HashInput:
    """Hex strings -> a 2-D uint8 array (one width) or a list of bytes (mixed widths)."""
    if len(hashes) > limit:
        raise _too_many(len(hashes), limit, loc, "block_hashes")
    if not hashes:
        return []
    if len(set(map(len, hashes))) == 1:
        try:
            raw = _unhex("".join(hashes))
        except (binascii.Error, ValueError, UnicodeEncodeError):
            pass
        else:
            width = len(hashes[0]) // 2
            return np.frombuffer(raw, dtype=np.uint8).reshape(len(hashes), width)
    out: list[bytes] = []
    for i, text in enumerate(hashes):
        try:
            out.append(_unhex(text))
        except (binascii.Error, ValueError, UnicodeEncodeError):
            raise _invalid(
                [*loc, "block_hashes", i], "a block hash must be hex with an even length"
            ) from None
    return out


def _decode(req: LookupRequest, loc: Loc, limit: int) -> HashInput:
    """The hashes of one request, validated; raises :class:`ApiError` (422 or 413)."""
    if req.block_hashes_b64 is None:
        if req.hash_len is not None:
            raise _invalid([*loc, "hash_len"], "hash_len goes with block_hashes_b64 only")
        if req.block_hashes is None:
            raise _invalid(
                [*loc, "block_hashes"], "give block_hashes (hex list) or block_hashes_b64"
            )
        return _decode_hex(req.block_hashes, loc, limit)
    if req.block_hashes is not None:
        raise _invalid(
            [*loc, "block_hashes_b64"], "give block_hashes or block_hashes_b64, not both"
        )
    if req.hash_len is None:
        raise _invalid([*loc, "hash_len"], "hash_len is required with block_hashes_b64")
    hash_len = req.hash_len
    # A cheap bound before decoding: 4 characters carry 3 bytes.
    if len(req.block_hashes_b64) // 4 * 3 > (limit + 1) * hash_len:
        raise _too_many(None, limit, loc, "block_hashes_b64")
    try:
        raw = base64.b64decode(req.block_hashes_b64, validate=True)
    except (binascii.Error, ValueError):
        raise _invalid([*loc, "block_hashes_b64"], "not valid base64") from None
    if len(raw) % hash_len:
        raise _invalid(
            [*loc, "block_hashes_b64"],
            f"decodes to {len(raw)} bytes, not a multiple of hash_len={hash_len}",
        )
    count = len(raw) // hash_len
    if count > limit:
        raise _too_many(count, limit, loc, "block_hashes_b64")
    return np.frombuffer(raw, dtype=np.uint8).reshape(count, hash_len)


def _check_aligned(coordinator: LookupCoordinator, token_len: int, loc: Loc) -> None:
    layout = coordinator.layout
    if layout.align(token_len) != token_len:
        raise _invalid(
            [*loc, "token_len"],
            f"token_len={token_len} must be a multiple of scheduler_block_size="
            f"{layout.scheduler_block_size}",
        )


# --------------------------------------------------------------------------- dependencies
def get_coordinator(request: Request) -> LookupCoordinator:
    """The app's coordinator (put there by :func:`coordinator_lifespan`); 503 before start-up.

    In your own routes take ``coordinator: CoordinatorDep`` (or ``Depends(get_coordinator)``);
    override it with ``app.dependency_overrides[get_coordinator]``.
    """
    state = request.scope.get("state")
    coordinator = state.get(STATE_KEY) if isinstance(state, Mapping) else None
    if coordinator is None:
        coordinator = getattr(request.app.state, STATE_KEY, None)
    if not isinstance(coordinator, LookupCoordinator):
        raise ApiError(503, "not_ready", "the lookup coordinator is not running")
    return coordinator


def coordinator_lifespan(
    layout: KVLayout,
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
        raise ValueError("give a store, or master_address and metadata_server")
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
            stack.callback(_forget, app, coordinator)
            yield {STATE_KEY: coordinator}

    return lifespan


def _forget(app: Any, coordinator: LookupCoordinator) -> None:
    if getattr(app.state, STATE_KEY, None) is coordinator:
        delattr(app.state, STATE_KEY)


def _make_store(
    store: StoreSource | None,
    master_address: str | None,
    metadata_server: str | None,
    store_options: Mapping[str, Any] | None,
) -> Store:
    if store is None:
        from ._mooncake import MooncakeStore

        assert master_address is not None and metadata_server is not None
        return MooncakeStore(master_address, metadata_server, **dict(store_options or {}))
    # A store instance has batch_is_exist on its type; a class or a factory function has not.
    if callable(store) and not hasattr(type(store), "batch_is_exist"):
        return store()
    return store  # type: ignore[return-value]


CoordinatorDep = Annotated[LookupCoordinator, Depends(get_coordinator)]
"""A route parameter annotated with this receives the app's coordinator."""


# --------------------------------------------------------------------------------- router
_LIMIT_RESPONSES: dict[int | str, dict[str, Any]] = {
    413: {
        "model": ErrorResponse,
        "description": "The body is larger than max_body_bytes (payload_too_large), a prompt "
        "has more than max_hashes_per_request hashes (too_many_hashes) or a batch more than "
        "max_batch_requests lookups (too_many_requests).",
    },
    422: {
        "model": ValidationErrorResponse,
        "description": "Malformed body: a missing or mistyped field, bad hex or base64, or a "
        "token_len that is not a multiple of the scheduler block size. loc names the field.",
    },
    429: {
        "model": ErrorResponse,
        "description": "Too many lookups pending (overloaded); retry after Retry-After seconds.",
    },
    503: {
        "model": ErrorResponse,
        "description": "The store failed (store_error, with its Mooncake code), the lookup timed "
        "out (timeout), or the coordinator is closed or not started (closed, not_ready).",
    },
}


class _PrometheusResponse(PlainTextResponse):
    media_type = PROMETHEUS_CONTENT_TYPE


def _route_class(
    max_body_bytes: int, counts: collections.Counter[tuple[str, int]]
) -> type[APIRoute]:
    """Routes that refuse bodies over the limit (413, before parsing) and count responses."""

    class LimitedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            path = self.path_format

            async def limited(request: Request) -> Response:
                try:
                    response = await handler(_limit_body(request, max_body_bytes))
                except ApiError as exc:
                    response = exc.response()
                except RequestValidationError:
                    counts[(path, 422)] += 1
                    raise
                counts[(path, response.status_code)] += 1
                return response

            return limited

    return LimitedRoute


def _limit_body(request: Request, limit: int) -> Request:
    if request.method in ("GET", "HEAD"):
        return request
    too_large = ApiError(
        413, "payload_too_large", f"the body is larger than {limit} bytes", field="body"
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    receive = request.receive
    seen = 0

    async def limited_receive() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise too_large
        return message

    return Request(request.scope, limited_receive)


async def _lookup_all(
    coordinator: LookupCoordinator,
    items: Sequence[tuple[int, HashInput, bool]],
    kwargs: Mapping[str, Any],
    *,
    batch: bool,
) -> list[int]:
    """Run the lookups concurrently; on a failure cancel the rest and raise the failure of the
    lowest index as an :class:`ApiError`."""

    def fail(i: int, exc: BaseException) -> BaseException:
        loc: Loc = ["body", "requests", i] if batch else ["body"]
        mapped = _map_error(exc, loc, items[i][2])
        if mapped is None:
            return exc
        mapped.__cause__ = exc
        return mapped

    if len(items) == 1:
        token_len, hashes, _ = items[0]
        try:
            return [await coordinator.lookup(token_len, hashes, **kwargs)]
        except Error as exc:
            raise fail(0, exc)  # noqa: B904 (the cause is set)
    tasks = [
        asyncio.ensure_future(coordinator.lookup(token_len, hashes, **kwargs))
        for token_len, hashes, _ in items
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        for t in tasks:
            t.add_done_callback(_consume)
    if pending:
        await asyncio.wait(pending)
    for i, t in enumerate(tasks):
        if not t.cancelled() and (err := t.exception()) is not None:
            raise fail(i, err)
    return [t.result() for t in tasks]


def _consume(task: asyncio.Future[int]) -> None:
    """Mark a task's exception as retrieved (it was reported through another task)."""
    if not task.cancelled():
        task.exception()


def create_router(
    *,
    max_hashes_per_request: int = 65536,
    max_body_bytes: int = 16 << 20,
    max_batch_requests: int = 1024,
    lookup_timeout: float | None = None,
    namespace: str = "aio_mclookup",
    tags: Sequence[str] = ("aio-mclookup",),
) -> APIRouter:
    """The HTTP API: ``POST /v1/lookup``, ``POST /v1/lookup/batch``, ``GET /healthz``,
    ``GET /metrics``. It takes the coordinator from :func:`get_coordinator`.

    Limits answer 413: bodies over ``max_body_bytes`` (checked before parsing), prompts with
    more than ``max_hashes_per_request`` hashes and batches of more than
    ``max_batch_requests``. ``lookup_timeout`` (seconds) overrides the coordinator's timeout
    per lookup. ``namespace`` prefixes the metric names.
    """
    for name, value in (
        ("max_hashes_per_request", max_hashes_per_request),
        ("max_body_bytes", max_body_bytes),
        ("max_batch_requests", max_batch_requests),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if lookup_timeout is not None and not lookup_timeout > 0:
        raise ValueError(f"lookup_timeout must be > 0 or None, got {lookup_timeout!r}")
    prefix = check_namespace(namespace)
    counts: collections.Counter[tuple[str, int]] = collections.Counter()
    router = APIRouter(tags=list(tags), route_class=_route_class(max_body_bytes, counts))
    kwargs: dict[str, Any] = {} if lookup_timeout is None else {"timeout": lookup_timeout}

    def prepare(
        coordinator: LookupCoordinator, req: LookupRequest, loc: Loc
    ) -> tuple[int, HashInput, bool]:
        hashes = _decode(req, loc, max_hashes_per_request)
        _check_aligned(coordinator, req.token_len, loc)
        return req.token_len, hashes, req.block_hashes_b64 is not None

    @router.post(
        "/v1/lookup",
        response_model=LookupResponse,
        responses=_LIMIT_RESPONSES,
        summary="Prefix hit of one prompt",
    )
    async def lookup(body: LookupRequest, coordinator: CoordinatorDep) -> LookupResponse:
        """How many leading tokens of the prompt have their KV cache in the store.

        Concurrent requests share `batch_is_exist` RPCs with each other.
        """
        item = prepare(coordinator, body, ["body"])
        (hit,) = await _lookup_all(coordinator, [item], kwargs, batch=False)
        return LookupResponse(hit_tokens=hit)

    @router.post(
        "/v1/lookup/batch",
        response_model=BatchLookupResponse,
        responses=_LIMIT_RESPONSES,
        summary="Prefix hits of several prompts",
    )
    async def lookup_batch(
        body: BatchLookupRequest, coordinator: CoordinatorDep
    ) -> BatchLookupResponse:
        """The prefix hit of each prompt, in order. Every request is validated before any is
        looked up; if one lookup fails, the batch fails with that error."""
        if len(body.requests) > max_batch_requests:
            raise ApiError(
                413,
                "too_many_requests",
                f"{len(body.requests)} lookups, more than the limit {max_batch_requests}",
                field="requests",
            )
        items = [
            prepare(coordinator, req, ["body", "requests", i])
            for i, req in enumerate(body.requests)
        ]
        if not items:
            return BatchLookupResponse(hit_tokens=[])
        hits = await _lookup_all(coordinator, items, kwargs, batch=True)
        return BatchLookupResponse(hit_tokens=hits)

    @router.get(
        "/healthz",
        response_model=HealthResponse,
        responses={
            503: {
                "model": HealthResponse | ErrorResponse,
                "description": "The store is failing, or the coordinator is not "
                "running (not_ready).",
            }
        },
        summary="Store health from recent RPC outcomes",
    )
    async def healthz(response: Response, coordinator: CoordinatorDep) -> HealthResponse:
        """Answers at once from the coordinator's recent RPC outcomes; it never makes an RPC."""
        stats = coordinator.stats()
        healthy = bool(coordinator.healthy)
        if not healthy:
            response.status_code = 503
        return HealthResponse(
            status="ok" if healthy else "unhealthy",
            store_healthy=stats.store_healthy,
            last_rpc_ok_age=stats.last_rpc_ok_age,
            last_error=stats.last_error,
            pending_lookups=stats.pending_lookups,
            rpcs_in_flight=stats.rpcs_in_flight,
        )

    @router.get(
        "/metrics",
        response_class=_PrometheusResponse,
        responses={
            200: {
                "description": "Prometheus text exposition (version 0.0.4).",
                "content": {PROMETHEUS_CONTENT_TYPE: {"schema": {"type": "string"}}},
            },
            503: {
                "description": "The coordinator is not running (not_ready).",
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
                },
            },
        },
        summary="Prometheus metrics",
    )
    async def metrics(
        coordinator: CoordinatorDep,
    ) -> _PrometheusResponse:
        """The coordinator's counters, gauges and histograms, and HTTP responses by route and
        status, in the Prometheus text format."""
        text = prometheus_text(coordinator.stats(), namespace=namespace)
        http = metric_family(
            prefix + "http_responses_total",
            "counter",
            "HTTP responses of the aio-mclookup routes, by route and status.",
            [
                ({"route": path, "status": str(status)}, n)
                for (path, status), n in sorted(counts.items())
            ],
        )
        return _PrometheusResponse(text + "\n".join(http) + "\n")

    return router


def create_app(
    layout: KVLayout,
    store: StoreSource | None = None,
    *,
    master_address: str | None = None,
    metadata_server: str | None = None,
    store_options: Mapping[str, Any] | None = None,
    own_store: bool | None = None,
    router_options: Mapping[str, Any] | None = None,
    title: str = "aio-mclookup",
    **coordinator_options: Any,
) -> FastAPI:
    """A FastAPI app with :func:`coordinator_lifespan` (the store arguments and
    ``coordinator_options``) and :func:`create_router` (``router_options``)."""
    app = FastAPI(
        title=title,
        description="Prefix-hit lookups against the Mooncake KV-cache store, coalesced into "
        "shared batch_is_exist RPCs.",
        lifespan=coordinator_lifespan(
            layout,
            store,
            master_address=master_address,
            metadata_server=metadata_server,
            store_options=store_options,
            own_store=own_store,
            **coordinator_options,
        ),
    )
    app.include_router(create_router(**dict(router_options or {})))
    return app
