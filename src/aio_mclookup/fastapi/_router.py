""":func:`create_router`: ``POST /v1/lookup``, ``POST /v1/lookup/batch``, ``GET /v1/layout``,
``GET /healthz`` and ``GET /metrics``."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.params import Depends as DependsParam
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.types import Scope

from .. import (
    BlockHasher,
    LookupCoordinator,
    SGLangLayout,
)
from .._checks import positive_int
from .._errors import Error, InvalidRequest
from .._observe.prometheus import (
    PROMETHEUS_CONTENT_TYPE,
    check_namespace,
    metric_family,
    prometheus_text,
)
from ._decode import (
    _decode_frame,
    _Decoder,
    _Item,
    _kind,
    _media_type,
    _name,
    _parse_json,
    _read_body,
    _state_hasher,
)
from ._errors import ApiError, _invalid, _map_error
from ._fastpath import _FAST_KEY, _FastPaths
from ._lifespan import CoordinatorDep, get_coordinator
from ._models import (
    _BYTES_PER_HASH,
    _HIT,
    OCTET_STREAM,
    BatchLookupRequest,
    BatchLookupResponse,
    ErrorResponse,
    HealthResponse,
    LayoutResponse,
    Loc,
    LookupRequest,
    LookupResponse,
    ValidationErrorResponse,
)
from ._sglang import SGLangDecoder, layout_info

_LIMIT_RESPONSES: dict[int | str, dict[str, Any]] = {
    413: {
        "model": ErrorResponse,
        "description": "The body is larger than max_body_bytes (payload_too_large, refused "
        "while it streams in), a prompt has more than max_hashes_per_request hashes "
        "(too_many_hashes) or as many tokens (too_many_tokens), or a batch more than "
        "max_batch_requests lookups (too_many_requests).",
    },
    415: {
        "model": ErrorResponse,
        "description": "A Content-Type other than application/json (or application/"
        "octet-stream on POST /v1/lookup).",
    },
    422: {
        "model": ValidationErrorResponse,
        "description": "Malformed body: invalid JSON (NaN and Infinity included), a missing, "
        "unknown or mistyped field, bad hex, base64 or token ids, not exactly one of "
        "block_hashes / block_hashes_b64 / token_ids, or a token_len that is not a multiple of "
        "the scheduler block size. One error, whose loc names the field.",
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


def _inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A model's JSON schema with its ``$defs`` inlined (for ``openapi_extra``)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.split("/")[-1]])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)  # type: ignore[no-any-return]


_FRAME_SCHEMA = {
    "type": "string",
    "format": "binary",
    "description": "vLLM 0.33's lookup request frames 1-3 back to back: num_tokens (u32 "
    "big-endian, the prompt's length), hash_len (u16 big-endian, 0 with no hashes), the hashes "
    "concatenated. The answer is application/octet-stream too: hit_length, u32 big-endian.",
}


class _JSONBytes(JSONResponse):
    """The lookup routes' declared response class: JSON, so that OpenAPI shows the
    ``response_model`` (the endpoints render their tiny fixed shape by hand and return a ready
    :class:`Response`)."""


class _PrometheusResponse(PlainTextResponse):
    media_type = PROMETHEUS_CONTENT_TYPE


_Endpoint = Callable[[Request, LookupCoordinator], Coroutine[Any, Any, Response]]


_DIRECT = "_aio_mclookup_direct"  # marks an endpoint the lean path may call directly


def _direct(endpoint: _Endpoint) -> _Endpoint:
    setattr(endpoint, _DIRECT, True)
    return endpoint


def _only_coordinator(route: APIRoute) -> bool:
    """Whether the route's only dependency is :func:`get_coordinator`: no route, router or
    include-level dependencies. (FastAPI 0.16x builds an included route's handler under a
    context variable holding the effective route, whose dependant has the include-level
    dependencies; older versions copy the route with them.)"""
    from fastapi import routing

    var = getattr(routing, "_effective_route_context_var", None)
    context = var.get() if var is not None else None
    effective = context if getattr(context, "original_route", None) is route else route
    dependant = getattr(effective, "dependant", route.dependant)
    return all(d.call is get_coordinator for d in dependant.dependencies)


def _route_class(counts: collections.Counter[tuple[str, int]]) -> type[APIRoute]:
    """Routes that render :class:`ApiError` and count responses by status.

    The lookup endpoints (``endpoint(request, coordinator)``, marked by :func:`_direct`) take a
    lean path when nothing needs FastAPI's dependency machinery: no dependencies on the route
    (an authentication hook adds some) and no ``app.dependency_overrides``. The endpoint is then
    called with the coordinator straight from the app's state, skipping dependency solving and
    response serialisation (the endpoint returns a ready :class:`Response`); otherwise the
    standard FastAPI handler runs, with the same results."""

    class CountedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            path = self.path_format
            endpoint: _Endpoint | None = None
            if getattr(self.endpoint, _DIRECT, False) and _only_coordinator(self):
                endpoint = self.endpoint

            async def counted(request: Request) -> Response:
                try:
                    if endpoint is None or request.app.dependency_overrides:
                        response = await handler(request)
                    else:  # the lean path: the same endpoint, its one dependency inlined
                        response = await endpoint(request, await get_coordinator(request))
                except ApiError as exc:
                    response = exc.response()
                except HTTPException as exc:  # e.g. an authentication dependency's 401
                    counts[(path, exc.status_code)] += 1
                    raise
                counts[(path, response.status_code)] += 1
                return response

            return counted

    return CountedRoute


async def _answer(coordinator: LookupCoordinator, item: _Item, kwargs: Mapping[str, Any]) -> int:
    """``num_tokens``: vLLM's scheduler's count; ``token_len`` (aligned): the worker's reply
    for it, before vLLM 0.26's scheduler rule (the same answer on 0.32+)."""
    if item.token_len is not None:
        result = await coordinator.lookup_result(item.token_len, item.hashes, **kwargs)
        return result.hit_length
    if item.tokens is not None:  # (SGLang: its pages hashed on the coordinator's worker)
        return await coordinator.lookup_tokens(
            item.tokens, extra_key=item.extra_key, cache_salt=item.cache_salt, **kwargs
        )
    return await coordinator.lookup(item.num_tokens, item.hashes, **kwargs)


async def _lookup_all(
    coordinator: LookupCoordinator,
    items: Sequence[_Item],
    kwargs: Mapping[str, Any],
    *,
    batch: bool,
) -> list[int]:
    """Run the lookups concurrently; on a failure cancel the rest and raise the failure of the
    lowest index as an :class:`ApiError`."""

    def fail(i: int, exc: BaseException) -> BaseException:
        if not isinstance(exc, Error):
            return exc
        loc: Loc = ["body", "requests", i] if batch else ["body"]
        mapped = _map_error(exc, loc, items[i].source)
        mapped.__cause__ = exc
        return mapped

    if len(items) == 1:
        try:
            return [await _answer(coordinator, items[0], kwargs)]
        except Error as exc:
            raise fail(0, exc)  # noqa: B904 (the cause is set)
    tasks = [asyncio.ensure_future(_answer(coordinator, item, kwargs)) for item in items]
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


def _hasher_config(hasher: BlockHasher | None) -> dict[str, Any] | None:
    if hasher is None:
        return None
    config = getattr(hasher, "to_dict", None)
    if callable(config):
        return dict(config())
    names = ("hash_block_size", "algo", "seed", "vllm_version")
    out = {name: getattr(hasher, name, None) for name in names}
    none_hash = getattr(hasher, "none_hash", None)
    if isinstance(none_hash, bytes):
        out["none_hash"] = none_hash.hex()
    return out


def create_router(
    *,
    max_hashes_per_request: int = 65536,
    max_body_bytes: int | None = None,
    max_batch_requests: int = 1024,
    lookup_timeout: float | None = None,
    hasher: BlockHasher | None = None,
    dependencies: Sequence[DependsParam] | None = None,
    namespace: str = "aio_mclookup",
    tags: Sequence[str] = ("aio-mclookup",),
) -> APIRouter:
    """The HTTP API: ``POST /v1/lookup``, ``POST /v1/lookup/batch``, ``GET /v1/layout``,
    ``GET /healthz``, ``GET /metrics``. It takes the coordinator from :func:`get_coordinator`.

    Limits answer 413: bodies over ``max_body_bytes`` (checked while the body streams in;
    default ``80 * max_hashes_per_request`` bytes, 5 MiB, room for that many hex SHA-256
    hashes), prompts with more than ``max_hashes_per_request`` hashes (or as many hash blocks
    of token ids) and batches of more than ``max_batch_requests``. ``lookup_timeout``
    (seconds) overrides the coordinator's timeout per lookup.

    ``hasher`` (a :class:`~aio_mclookup.BlockHasher`) hashes token-id bodies; without it the
    one a lifespan published under :data:`HASHER_KEY` is used, and with neither, token-id
    bodies get a 422. When the coordinator's layout is an :class:`~aio_mclookup.SGLangLayout`
    the bodies are SGLang's (:mod:`._sglang`): token ids hashed with its page hashing, or page
    hashes, and the answers SGLang's L3 hits; ``hasher`` is not used. ``dependencies`` run
    before every route (an authentication hook, e.g. ``[Depends(check_token)]``).
    ``namespace`` prefixes the metric names.
    """
    if max_body_bytes is None and isinstance(max_hashes_per_request, int):
        max_body_bytes = _BYTES_PER_HASH * max_hashes_per_request
    for name, value in (
        ("max_hashes_per_request", max_hashes_per_request),
        ("max_body_bytes", max_body_bytes),
        ("max_batch_requests", max_batch_requests),
    ):
        positive_int(name, value)
    assert max_body_bytes is not None
    body_limit: int = max_body_bytes
    if lookup_timeout is not None and not lookup_timeout > 0:
        raise InvalidRequest(
            f"lookup_timeout must be > 0 or None, got {lookup_timeout!r}", field="lookup_timeout"
        )
    if hasher is not None and not callable(getattr(hasher, "hash", None)):
        raise InvalidRequest(
            f"hasher must be a BlockHasher, got {type(hasher).__name__}", field="hasher"
        )
    prefix = check_namespace(namespace)
    counts: collections.Counter[tuple[str, int]] = collections.Counter()
    router = APIRouter(
        tags=list(tags), route_class=_route_class(counts), dependencies=list(dependencies or ())
    )
    kwargs: dict[str, Any] = {} if lookup_timeout is None else {"timeout": lookup_timeout}
    decoder = _Decoder(max_hashes_per_request, hasher)
    sglang = SGLangDecoder(max_hashes_per_request)
    lookup_schema = _inline_schema(LookupRequest)
    batch_schema = _inline_schema(BatchLookupRequest)

    def unsupported(media: str) -> ApiError:
        return ApiError(
            415, "unsupported_media_type", f"Content-Type {_name(media)} is not accepted"
        )

    async def run_lookup(
        body: bytes, media: str, coordinator: LookupCoordinator, scope: Scope
    ) -> tuple[bytes, str]:
        """One lookup body -> the reply's bytes and media type; raises ApiError."""
        if media == OCTET_STREAM:
            item = _decode_frame(body, max_hashes_per_request)
            layout = coordinator.layout
            if isinstance(layout, SGLangLayout):
                item = sglang.checked(item, ["body"], layout)
            else:
                item = decoder.checked(item, ["body"], layout)
            (hit,) = await _lookup_all(coordinator, [item], kwargs, batch=False)
            return _HIT.pack(hit), OCTET_STREAM
        if media != "application/json":
            raise unsupported(media)
        layout = coordinator.layout
        if isinstance(layout, SGLangLayout):
            found: _Item | None = sglang.body(body, ["body"], layout)
        else:
            found = decoder.scanned(body, ["body"], layout)
            if found is None:  # not the common shape: parse it
                found = decoder.item(_parse_json(body), ["body"], scope, layout)
        assert found is not None
        (hit,) = await _lookup_all(coordinator, [found], kwargs, batch=False)
        return b'{"hit_tokens":%d}' % hit, "application/json"

    async def run_batch(
        body: bytes, media: str, coordinator: LookupCoordinator, scope: Scope
    ) -> tuple[bytes, str]:
        """A batch body -> the reply's bytes and media type; raises ApiError."""
        if media != "application/json":
            raise unsupported(media)
        raw = _parse_json(body)
        if type(raw) is not dict:
            raise _invalid(["body"], f"the body must be an object, not {_kind(raw)}")
        if not raw.keys() <= {"requests"}:
            unknown = next(k for k in raw if k != "requests")
            raise _invalid(["body", _name(unknown)], "unknown field")
        requests = raw.get("requests")
        if type(requests) is not list:
            raise _invalid(
                ["body", "requests"], f"requests must be an array, not {_kind(requests)}"
            )
        if len(requests) > max_batch_requests:
            raise ApiError(
                413,
                "too_many_requests",
                f"{len(requests)} lookups, more than the limit {max_batch_requests}",
                field="requests",
            )
        layout = coordinator.layout
        if isinstance(layout, SGLangLayout):
            where = ["body", "requests"]
            items = [sglang.item(req, [*where, i], layout) for i, req in enumerate(requests)]
        else:
            items = [
                decoder.item(req, ["body", "requests", i], scope, layout)
                for i, req in enumerate(requests)
            ]
        if not items:
            return b'{"hit_tokens":[]}', "application/json"
        hits = await _lookup_all(coordinator, items, kwargs, batch=True)
        return b'{"hit_tokens":[%s]}' % b",".join(b"%d" % h for h in hits), "application/json"

    setattr(
        router,
        _FAST_KEY,
        _FastPaths(
            {"/v1/lookup": run_lookup, "/v1/lookup/batch": run_batch},
            body_limit,
            counts,
            bool(router.dependencies),
        ),
    )

    @router.post(
        "/v1/lookup",
        response_model=LookupResponse,
        response_class=_JSONBytes,
        responses={
            **_LIMIT_RESPONSES,
            200: {"content": {OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}}},
        },
        summary="Prefix hit of one prompt",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": lookup_schema},
                    OCTET_STREAM: {"schema": _FRAME_SCHEMA},
                },
            }
        },
    )
    @_direct
    async def lookup(request: Request, coordinator: CoordinatorDep) -> Response:
        """How many leading tokens of the prompt have their KV cache in the store.

        The body is JSON (LookupRequest) or, as application/octet-stream, vLLM 0.33's lookup
        frame (answered in kind). Concurrent requests share `batch_is_exist` RPCs."""
        body = await _read_body(request, body_limit)
        media = _media_type(request.headers.get("content-type"))
        content, media = await run_lookup(body, media, coordinator, request.scope)
        return Response(content, media_type=media)

    @router.post(
        "/v1/lookup/batch",
        response_model=BatchLookupResponse,
        response_class=_JSONBytes,
        responses=_LIMIT_RESPONSES,
        summary="Prefix hits of several prompts",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": batch_schema}},
            }
        },
    )
    @_direct
    async def lookup_batch(request: Request, coordinator: CoordinatorDep) -> Response:
        """The prefix hit of each prompt, in order. Every request is validated before any is
        looked up; if one lookup fails, the batch fails with that error."""
        body = await _read_body(request, body_limit)
        media = _media_type(request.headers.get("content-type"))
        content, media = await run_batch(body, media, coordinator, request.scope)
        return Response(content, media_type=media)

    @router.get("/v1/layout", response_model=LayoutResponse, summary="Layout and hasher")
    async def layout_route(request: Request, coordinator: CoordinatorDep) -> LayoutResponse:
        """The layout lookups use (`KVLayout.to_dict()` or `SGLangLayout.to_dict()`), its
        engine and release, and the hasher of token-id bodies (null when they are not
        accepted): what a router must match."""
        layout = coordinator.layout
        if isinstance(layout, SGLangLayout):
            return LayoutResponse(
                layout=layout.to_dict(),
                hasher=layout_info(layout),
                engine="sglang",
                version=layout.sglang_version,
            )
        the_hasher = hasher if hasher is not None else _state_hasher(request.scope)
        return LayoutResponse(
            layout=layout.to_dict(),
            hasher=_hasher_config(the_hasher),
            engine="vllm",
            version=layout.vllm_version,
        )

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
