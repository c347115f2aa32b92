"""FastAPI integration (from a clone: ``pip install -e '.[fastapi,cpu]' 'uvicorn[standard]'``).

* :func:`coordinator_lifespan` owns a store and a :class:`~aio_mclookup.LookupCoordinator` for
  the app's lifetime;
* :func:`get_coordinator` is the (async) dependency that hands the coordinator to routes;
* :func:`create_router` returns the ready :class:`~fastapi.APIRouter`: ``POST /v1/lookup``,
  ``POST /v1/lookup/batch``, ``GET /v1/layout``, ``GET /healthz`` and ``GET /metrics``;
* :func:`create_app` puts them together;
* :class:`LookupFastPath` (ASGI middleware) serves the two lookup routes before FastAPI's
  middleware, routing and dependency machinery, with the routes' own answers.

Concurrent HTTP requests become concurrent coordinator lookups, so they share RPCs like any
other callers. Nothing here blocks the event loop: ``/healthz`` and ``/metrics`` read the
coordinator's in-memory state only.

The lookup routes read and check their bodies themselves (not through FastAPI's body
parameters): the body is counted while it streams in and refused as soon as it passes
``max_body_bytes``; every count is checked before any per-item work; a malformed body gets one
error (never the input echoed back); and the hot path builds nothing that only an error needs.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import json
import struct
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Annotated, Any, Literal, NoReturn, Union

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, Response
from fastapi.params import Depends as DependsParam
from fastapi.responses import PlainTextResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, JsonValue
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import (
    BlockHasher,
    FakeStore,
    HashInput,
    InvalidRequest,
    KVLayout,
    LookupCoordinator,
    Store,
    StoreError,
)
from ._errors import Error, error_label
from ._observe.prometheus import (
    PROMETHEUS_CONTENT_TYPE,
    check_namespace,
    metric_family,
    prometheus_text,
)

__all__ = [
    "BatchLookupRequest",
    "BatchLookupResponse",
    "CoordinatorDep",
    "ErrorResponse",
    "HASHER_KEY",
    "HealthResponse",
    "LayoutResponse",
    "LookupFastPath",
    "LookupRequest",
    "LookupResponse",
    "MMFeature",
    "OCTET_STREAM",
    "STATE_KEY",
    "ValidationErrorResponse",
    "coordinator_lifespan",
    "create_app",
    "create_router",
    "get_coordinator",
]

STATE_KEY = "aio_mclookup_coordinator"
"""Where the lifespan puts the coordinator: the lifespan state and ``app.state``."""

HASHER_KEY = "aio_mclookup_hasher"
"""Where a lifespan may put a :class:`~aio_mclookup.BlockHasher` (the lifespan state or
``app.state``): a router created without ``hasher=`` hashes token-id bodies with it."""

OCTET_STREAM = "application/octet-stream"
"""The compact body of ``POST /v1/lookup``: vLLM 0.33's lookup request frames 1-3 back to back
(``num_tokens`` u32 big-endian, ``hash_len`` u16 big-endian, the hashes concatenated); the
answer is ``hit_length`` as u32 big-endian."""

StoreSource = Union[Store, Callable[[], Store]]  # noqa: UP007 (a runtime alias on 3.10)
Loc = list[str | int]

_MAX_TOKENS = 1 << 40
_MAX_TOKEN_ID = 1 << 63
_MAX_TEXT = 4096  # characters of lora_name, lora_path, cache_salt, an mm identifier
_MAX_HASH_HEX = 2048  # characters of one hex hash (1,024 bytes)
_BYTES_PER_HASH = 80  # a hex SHA-256 hash in a JSON list takes 67 bytes; the rest is slack
_FRAME_HEAD = struct.Struct(">IH")
_HIT = struct.Struct(">I")

_EXAMPLE_HASHES: list[JsonValue] = [
    "9f2c1e0b7a4d8c3e5f6a7b8c9d0e1f2a3b4c5d6e7f8091a2b3c4d5e6f708192a",
    "1b3d5f7092a4c6e8f0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f607",
]


# ------------------------------------------------------------------------------------ models
class MMFeature(BaseModel):
    """One multimodal item of a prompt, as vLLM's block hash sees it."""

    model_config = ConfigDict(extra="forbid")

    identifier: str = Field(max_length=_MAX_TEXT, description="The item's mm_hash (vLLM's).")
    offset: int = Field(ge=0, description="Index of the item's first placeholder token.")
    length: int = Field(ge=1, description="Placeholder tokens of the item.")


class LookupRequest(BaseModel):
    """One prompt, in one of three forms: its block hashes (a list of hex strings, or one base64
    blob of fixed-width hashes), or its token ids (hashed by the server's hasher).

    With hashes, give the prompt's length as ``num_tokens`` (vLLM's scheduler view: the hit is
    what vLLM 0.33's lookup returns, whole blocks, at least one token left to compute) or the
    older ``token_len`` (already aligned; the plain prefix hit, no leave-one-token rule). With
    ``token_ids``, ``num_tokens`` is ``len(token_ids)``.

    This model documents the body; the route parses it itself (see the module's docstring)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"num_tokens": 40, "block_hashes": _EXAMPLE_HASHES},
                {"token_len": 32, "block_hashes": _EXAMPLE_HASHES},
                {
                    "num_tokens": 40,
                    "block_hashes_b64": base64.b64encode(
                        b"".join(bytes.fromhex(str(h)) for h in _EXAMPLE_HASHES)
                    ).decode(),
                    "hash_len": 32,
                },
                {"token_ids": list(range(40)), "cache_salt": "tenant-7"},
            ]
        },
    )

    num_tokens: int | None = Field(
        default=None,
        ge=0,
        le=_MAX_TOKENS,
        description="The prompt's length in tokens (unaligned). The answer is vLLM's scheduler "
        "view: the hit floored to whole scheduler blocks, lowered by one block when it "
        "covers the whole prompt. Implied by token_ids.",
    )
    token_len: int | None = Field(
        default=None,
        ge=0,
        le=_MAX_TOKENS,
        description="Compatibility: tokens to look up, a multiple of the layout's scheduler "
        "block size (vLLM's prompt length floored to it); the answer is the plain prefix hit. "
        "Give this or num_tokens, with hashes only.",
    )
    block_hashes: list[str] | None = Field(
        default=None,
        description="The prompt's block hashes, one per hash block, as hex (vLLM's BlockHash "
        "bytes).",
    )
    block_hashes_b64: str | None = Field(
        default=None,
        description="The block hashes concatenated and base64-encoded (standard alphabet, "
        "padded); each hash is hash_len bytes.",
    )
    hash_len: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Bytes per hash in block_hashes_b64 (required with it, 32 for SHA-256).",
    )
    token_ids: list[int] | None = Field(
        default=None,
        description="The prompt's token ids (0 <= id < 2^63); the server hashes them with its "
        "configured hasher (GET /v1/layout shows it).",
    )
    lora_name: str | None = Field(
        default=None, max_length=_MAX_TEXT, description="With token_ids: the LoRA adapter."
    )
    lora_path: str | None = Field(
        default=None,
        max_length=_MAX_TEXT,
        description="With token_ids: the LoRA adapter's path (vLLM 0.31+ hashes it too).",
    )
    cache_salt: str | None = Field(
        default=None, max_length=_MAX_TEXT, description="With token_ids: the request's salt."
    )
    mm_features: list[MMFeature] | None = Field(
        default=None, description="With token_ids: the prompt's multimodal items."
    )


class LookupResponse(BaseModel):
    """The prefix hit of one prompt."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"hit_tokens": 16}]})

    hit_tokens: int = Field(description="Prefix tokens whose KV cache is in the store.")


class BatchLookupRequest(BaseModel):
    """Several prompts looked up together, each like the body of POST /v1/lookup."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "requests": [
                        {"num_tokens": 40, "block_hashes": _EXAMPLE_HASHES},
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


class LayoutResponse(BaseModel):
    """What the server looks up with: the layout, and the hasher of token-id bodies."""

    layout: dict[str, Any] = Field(description="The layout (KVLayout.to_dict()).")
    hasher: dict[str, Any] | None = Field(
        description="The hasher of token-id bodies (hash_block_size, algo, seed, "
        "vllm_version, ...); null when token-id bodies are not accepted."
    )


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
        "too_many_tokens",
        "too_many_requests",
        "unsupported_media_type",
        "overloaded",
        "store_error",
        "timeout",
        "closed",
        "not_ready",
        "internal_error",
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
    """A malformed body (FastAPI's validation-error shape). The lookup routes report the first
    problem found, one item, and never echo the input."""

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

    def response(self) -> Response:
        """The response to send."""
        return Response(
            json.dumps(self.body(), separators=(",", ":")).encode(),
            status_code=self.status_code,
            headers=self.headers,
            media_type="application/json",
        )


def _invalid(loc: Loc, msg: str) -> ApiError:
    return ApiError(422, "invalid_request", msg, loc=loc)


def _dotted(loc: Loc, name: str | int) -> str:
    return ".".join(map(str, [*loc[1:], name]))


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        "payload_too_large",
        f"the body is larger than {limit} bytes",
        field="body",
        headers={"Connection": "close"},  # do not read the rest of it
    )


def _too_many(count: int | None, limit: int, loc: Loc, name: str) -> ApiError:
    what = f"{count} block hashes" if count is not None else "the block hashes"
    return ApiError(
        413,
        "too_many_hashes",
        f"{what}: more than the limit of {limit} per request",
        field=_dotted(loc, name),
    )


# How a lookup failure is answered, by the coordinator's own label of it (error_label): the
# package's one exception-to-label table. Every other Error (a StoreError's code, "exception",
# an unknown kind) is a store_error.
_HTTP_BY_LABEL: dict[str, tuple[int, str, str]] = {
    "overloaded": (429, "overloaded", "too many pending lookups"),
    "timeout": (503, "timeout", "lookup timed out"),
    "closed": (503, "closed", "the coordinator is closed"),
    "internal": (500, "internal_error", "a bug in aio_mclookup"),
}
_RETRY = {"Retry-After": "1"}


def _map_error(exc: Error, loc: Loc, source: str) -> ApiError:
    """The HTTP error for an exception from the coordinator. ``source`` is the body field the
    request's hashes came from (named when the exception names no body field)."""
    if isinstance(exc, InvalidRequest):
        return _invalid([*loc, *_field_loc(exc.field, source)], str(exc))
    status, error, default = _HTTP_BY_LABEL.get(error_label(exc), (503, "store_error", ""))
    code = exc.code if isinstance(exc, StoreError) else None
    headers = None if error in ("closed", "internal_error") else dict(_RETRY)
    return ApiError(status, error, str(exc) or default, code=code, headers=headers)


_REQUEST_FIELDS = frozenset({"token_len", "num_tokens", *LookupRequest.model_fields})


def _field_loc(field: str | None, source: str) -> Loc:
    """The body location of a library ``InvalidRequest.field``: ``block_hashes`` (the library's
    name for the hashes) becomes the body field they came from; a field that is not a body field
    (or none) is reported at ``source``."""
    parts: Loc = [int(p) if p.isdigit() else p for p in field.split(".")] if field else []
    if not parts or parts[0] not in _REQUEST_FIELDS:
        return [source]
    if parts[0] == "block_hashes":
        parts[0] = source
        if source != "block_hashes":
            del parts[1:]  # an index into the hashes names no item of a blob or token list
    elif parts[0] in ("token_len", "num_tokens") and source == "token_ids":
        parts = ["token_ids"]  # num_tokens is len(token_ids)
    return parts


# ------------------------------------------------------------------------------ decoding
def _kind(value: object) -> str:
    """A JSON type's name, for messages (never the value itself)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _name(key: object) -> str:
    text = str(key)
    return text if len(text) <= 64 else text[:61] + "..."


def _int_field(raw: Mapping[str, Any], name: str, loc: Loc, low: int, high: int) -> int | None:
    value = raw.get(name)
    if value is None:
        return None
    if type(value) is not int:
        raise _invalid([*loc, name], f"{name} must be an integer, not {_kind(value)}")
    if not low <= value <= high:
        raise _invalid([*loc, name], f"{name} must be between {low} and {high}")
    return value


def _text_field(raw: Mapping[str, Any], name: str, loc: Loc) -> str | None:
    value = raw.get(name)
    if value is None:
        return None
    if type(value) is not str:
        raise _invalid([*loc, name], f"{name} must be a string, not {_kind(value)}")
    if len(value) > _MAX_TEXT:
        raise _invalid([*loc, name], f"{name} is longer than {_MAX_TEXT} characters")
    return value


def _unhex(text: str) -> bytes:
    return binascii.unhexlify(text.encode("ascii"))


def _decode_hex(hashes: list[Any], loc: Loc, limit: int) -> HashInput:
    """Hex strings -> a 2-D uint8 array (one width) or a list of bytes (mixed widths)."""
    if len(hashes) > limit:  # before any per-item work
        raise _too_many(len(hashes), limit, loc, "block_hashes")
    if not hashes:
        return []
    first = hashes[0]
    if type(first) is str and 0 < len(first) <= _MAX_HASH_HEX and not len(first) % 2:
        try:  # the common case: one width, all hex
            raw = _unhex("".join(hashes))
        except (binascii.Error, ValueError, TypeError, UnicodeEncodeError):
            pass
        else:
            width = len(first) // 2
            if len(raw) == width * len(hashes):
                return np.frombuffer(raw, dtype=np.uint8).reshape(len(hashes), width)
    out: list[bytes] = []
    for i, text in enumerate(hashes):
        if type(text) is not str:
            raise _invalid(
                [*loc, "block_hashes", i], f"a block hash must be a string, not {_kind(text)}"
            )
        if not 0 < len(text) <= _MAX_HASH_HEX:
            raise _invalid(
                [*loc, "block_hashes", i],
                f"a block hash must have 1 to {_MAX_HASH_HEX // 2} bytes",
            )
        try:
            out.append(_unhex(text))
        except (binascii.Error, ValueError, UnicodeEncodeError):
            raise _invalid(
                [*loc, "block_hashes", i], "a block hash must be hex with an even length"
            ) from None
    return out


def _decode_b64(raw_body: Mapping[str, Any], loc: Loc, limit: int) -> HashInput:
    blob = raw_body["block_hashes_b64"]
    if type(blob) is not str:
        raise _invalid(
            [*loc, "block_hashes_b64"], f"block_hashes_b64 must be a string, not {_kind(blob)}"
        )
    hash_len = _int_field(raw_body, "hash_len", loc, 1, 1024)
    if hash_len is None:
        raise _invalid([*loc, "hash_len"], "hash_len is required with block_hashes_b64")
    # A cheap bound before decoding: 4 characters carry 3 bytes.
    if len(blob) // 4 * 3 > (limit + 1) * hash_len:
        raise _too_many(None, limit, loc, "block_hashes_b64")
    try:
        raw = base64.b64decode(blob, validate=True)
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


def _decode_token_ids(ids: object, loc: Loc, limit: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Token ids -> a 1-D int64 array; ``limit`` is the most tokens one request may carry."""
    if type(ids) is not list:
        raise _invalid([*loc, "token_ids"], f"token_ids must be an array, not {_kind(ids)}")
    if len(ids) > limit:  # before any per-item work
        raise ApiError(
            413,
            "too_many_tokens",
            f"{len(ids)} token ids: more than the limit of {limit} per request",
            field=_dotted(loc, "token_ids"),
        )
    if not ids:
        return np.zeros(0, dtype=np.int64)
    array: np.ndarray[Any, np.dtype[np.int64]] | None = None
    if set(map(type, ids)) == {int}:
        with contextlib.suppress(OverflowError):
            array = np.array(ids, dtype=np.int64)
        if array is not None and int(array.min()) >= 0:
            return array
    for i, value in enumerate(ids):  # the error path: find the first bad id
        if type(value) is not int:
            raise _invalid(
                [*loc, "token_ids", i], f"a token id must be an integer, not {_kind(value)}"
            )
        if not 0 <= value < _MAX_TOKEN_ID:
            raise _invalid([*loc, "token_ids", i], "a token id must be in [0, 2^63)")
    raise AssertionError("unreachable")  # pragma: no cover


def _decode_mm(raw: object, loc: Loc, num_tokens: int) -> list[tuple[str, int, int]] | None:
    if raw is None:
        return None
    if type(raw) is not list:
        raise _invalid([*loc, "mm_features"], f"mm_features must be an array, not {_kind(raw)}")
    if len(raw) > max(num_tokens, 1):
        raise _invalid([*loc, "mm_features"], "more multimodal items than prompt tokens")
    out = []
    for i, item in enumerate(raw):
        where: Loc = [*loc, "mm_features", i]
        if type(item) is not dict:
            raise _invalid(where, f"a multimodal item must be an object, not {_kind(item)}")
        unknown = [k for k in item if k not in ("identifier", "offset", "length")]
        if unknown:
            raise _invalid([*where, _name(unknown[0])], "unknown field")
        identifier = item.get("identifier")
        if type(identifier) is not str or not 0 < len(identifier) <= _MAX_TEXT:
            raise _invalid(
                [*where, "identifier"],
                f"identifier must be a string of 1 to {_MAX_TEXT} characters",
            )
        offset = _int_field(item, "offset", where, 0, _MAX_TOKENS)
        length = _int_field(item, "length", where, 1, _MAX_TOKENS)
        if offset is None or length is None:
            raise _invalid([*where, "offset" if offset is None else "length"], "field required")
        if offset + length > num_tokens:
            raise _invalid([*where, "length"], "the item runs past the end of the prompt")
        out.append((identifier, offset, length))
    return out


_HASH_FORMS = ("block_hashes", "block_hashes_b64", "token_ids")
_TOKEN_EXTRAS = ("lora_name", "lora_path", "cache_salt", "mm_features")
_KNOWN = frozenset(LookupRequest.model_fields)


class _Item:
    """One validated lookup: ``token_len`` (plain hit) or ``num_tokens`` (vLLM's scheduler
    view), the hashes, and the body field they came from."""

    __slots__ = ("hashes", "num_tokens", "source", "token_len")

    def __init__(
        self, token_len: int | None, num_tokens: int, hashes: HashInput, source: str
    ) -> None:
        self.token_len = token_len
        self.num_tokens = num_tokens
        self.hashes = hashes
        self.source = source


def _form(raw: Mapping[str, Any], loc: Loc) -> str:
    given = [name for name in _HASH_FORMS if raw.get(name) is not None]
    if len(given) != 1:
        if not given:
            raise _invalid(
                [*loc, "block_hashes"], "give block_hashes, block_hashes_b64 or token_ids"
            )
        raise _invalid([*loc, given[1]], f"give only one of {', '.join(given)}")
    return given[0]


class _Decoder:
    """Turns one parsed lookup body into an :class:`_Item`; raises :class:`ApiError`."""

    def __init__(self, max_hashes: int, hasher: BlockHasher | None) -> None:
        self.max_hashes = max_hashes
        self.hasher = hasher

    def item(self, raw: object, loc: Loc, scope: Scope, layout: KVLayout) -> _Item:
        if type(raw) is not dict:
            raise _invalid(loc, f"a lookup must be an object, not {_kind(raw)}")
        if not raw.keys() <= _KNOWN:
            unknown = next(k for k in raw if k not in _KNOWN)
            raise _invalid([*loc, _name(unknown)], "unknown field")
        form = _form(raw, loc)
        if form == "token_ids":
            return self._tokens(raw, loc, scope, layout)
        for name in _TOKEN_EXTRAS:
            if raw.get(name) is not None:
                raise _invalid([*loc, name], f"{name} goes with token_ids only")
        token_len = _int_field(raw, "token_len", loc, 0, _MAX_TOKENS)
        num_tokens = _int_field(raw, "num_tokens", loc, 0, _MAX_TOKENS)
        if form == "block_hashes":
            if raw.get("hash_len") is not None:
                raise _invalid([*loc, "hash_len"], "hash_len goes with block_hashes_b64 only")
            hashes = raw["block_hashes"]
            if type(hashes) is not list:
                raise _invalid(
                    [*loc, "block_hashes"], f"block_hashes must be an array, not {_kind(hashes)}"
                )
            decoded = _decode_hex(hashes, loc, self.max_hashes)
        else:
            decoded = _decode_b64(raw, loc, self.max_hashes)
        if token_len is None:
            if num_tokens is None:
                raise _invalid([*loc, "num_tokens"], "give num_tokens (or token_len)")
            return _Item(None, num_tokens, decoded, form)
        if num_tokens is not None:
            raise _invalid([*loc, "num_tokens"], "give num_tokens or token_len, not both")
        if layout.align(token_len) != token_len:
            raise _invalid(
                [*loc, "token_len"],
                f"token_len={token_len} must be a multiple of scheduler_block_size="
                f"{layout.scheduler_block_size}",
            )
        return _Item(token_len, token_len, decoded, form)

    def _tokens(self, raw: Mapping[str, Any], loc: Loc, scope: Scope, layout: KVLayout) -> _Item:
        if raw.get("token_len") is not None:
            raise _invalid([*loc, "token_len"], "token_len goes with block hashes only")
        if raw.get("hash_len") is not None:
            raise _invalid([*loc, "hash_len"], "hash_len goes with block_hashes_b64 only")
        hasher = self.hasher if self.hasher is not None else _state_hasher(scope)
        if hasher is None:
            raise _invalid(
                [*loc, "token_ids"], "this server takes no token ids (no hasher is configured)"
            )
        block = int(getattr(hasher, "block_size", layout.hash_block_size))
        if block != layout.hash_block_size:  # a misconfigured server, not a bad request
            raise RuntimeError(
                f"the hasher's block size {block} is not the layout's hash_block_size "
                f"{layout.hash_block_size}"
            )
        ids = _decode_token_ids(raw["token_ids"], loc, self.max_hashes * block + block - 1)
        num_tokens = _int_field(raw, "num_tokens", loc, 0, _MAX_TOKENS)
        if num_tokens is not None and num_tokens != len(ids):
            raise _invalid([*loc, "num_tokens"], "num_tokens must equal len(token_ids)")
        options: dict[str, Any] = {}
        for name in ("lora_name", "lora_path", "cache_salt"):
            value = _text_field(raw, name, loc)
            if value is not None:
                options[name] = value
        mm = _decode_mm(raw.get("mm_features"), loc, len(ids))
        if mm:
            options["mm_features"] = mm
        try:
            hashes = hasher.hash(ids, **options)
        except InvalidRequest as exc:
            parts = _field_loc(exc.field, "token_ids") if exc.field else ["token_ids"]
            raise _invalid([*loc, *parts], str(exc)) from exc
        return _Item(None, len(ids), hashes, "token_ids")


def _state_hasher(scope: Scope) -> BlockHasher | None:
    """The hasher a lifespan published under :data:`HASHER_KEY` (its state, or ``app.state``)."""
    state = scope.get("state")
    hasher = state.get(HASHER_KEY) if isinstance(state, Mapping) else None
    if hasher is None:
        hasher = getattr(getattr(scope.get("app"), "state", None), HASHER_KEY, None)
    return hasher


def _coordinator_of(scope: Scope) -> LookupCoordinator:
    state = scope.get("state")
    coordinator = state.get(STATE_KEY) if isinstance(state, Mapping) else None
    if coordinator is None:
        coordinator = getattr(getattr(scope.get("app"), "state", None), STATE_KEY, None)
    if not isinstance(coordinator, LookupCoordinator):
        raise ApiError(503, "not_ready", "the lookup coordinator is not running")
    return coordinator


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it passes ``limit`` bytes: by its Content-Length, or
    while it streams in."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise _invalid(["body"], "the JSON is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, NaN/Infinity, huge integers
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "not valid JSON"
        raise _invalid(["body"], f"invalid JSON: {msg}"[:200]) from None


def _media_type(content_type: str | None) -> str:
    if not content_type:
        return "application/json"
    media = content_type.partition(";")[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        return "application/json"
    return media


def _decode_frame(body: bytes, limit: int) -> _Item:
    """vLLM 0.33's lookup request frames 1-3, back to back."""
    if len(body) < _FRAME_HEAD.size:
        raise _invalid(["body"], f"a lookup frame starts with {_FRAME_HEAD.size} bytes")
    num_tokens, hash_len = _FRAME_HEAD.unpack_from(body)
    payload = len(body) - _FRAME_HEAD.size
    if hash_len == 0:
        if payload:
            raise _invalid(["body", "hash_len"], "hash_len is 0 but hashes follow")
        return _Item(None, num_tokens, [], "block_hashes")
    if payload % hash_len:
        raise _invalid(
            ["body", "block_hashes"],
            f"{payload} bytes of hashes, not a multiple of hash_len={hash_len}",
        )
    count = payload // hash_len
    if count > limit:
        raise _too_many(count, limit, ["body"], "block_hashes")
    rows = np.frombuffer(body, dtype=np.uint8, offset=_FRAME_HEAD.size).reshape(count, hash_len)
    return _Item(None, num_tokens, rows, "block_hashes")


# --------------------------------------------------------------------------- dependencies
async def get_coordinator(request: Request) -> LookupCoordinator:
    """The app's coordinator (put there by :func:`coordinator_lifespan`); 503 before start-up.

    In your own routes take ``coordinator: CoordinatorDep`` (or ``Depends(get_coordinator)``);
    override it with ``app.dependency_overrides[get_coordinator]``. It is ``async`` so that
    FastAPI calls it on the event loop (a plain ``def`` would cost a thread-pool hop per
    request).
    """
    return _coordinator_of(request.scope)


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
        from ._store.mooncake import MooncakeStore

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


class _JSONBytes(Response):
    """The routes' success responses: JSON rendered by hand (a fixed, tiny shape)."""

    media_type = "application/json"


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


_Core = Callable[[bytes, str, LookupCoordinator, Scope], Coroutine[Any, Any, tuple[bytes, str]]]
_FAST_KEY = "_aio_mclookup_fast_paths"


class _FastPaths:
    """What :class:`LookupFastPath` needs of a router: its lookup cores by route path, its
    body limit, its response counter, and whether it has dependencies of its own."""

    def __init__(
        self,
        cores: dict[str, _Core],
        body_limit: int,
        counts: collections.Counter[tuple[str, int]],
        has_dependencies: bool,
    ) -> None:
        self.cores = cores
        self.body_limit = body_limit
        self.counts = counts
        self.has_dependencies = has_dependencies


class _Disconnected(Exception):
    """The client went away before its body was read."""


async def _receive_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """:func:`_read_body` on the raw ASGI interface."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    seen = 0
    while True:
        message: Message = await receive()
        if message["type"] != "http.request":
            raise _Disconnected
        chunk = message.get("body", b"")
        if chunk:
            seen += len(chunk)
            if seen > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class LookupFastPath:
    """ASGI middleware that answers ``POST /v1/lookup`` and ``POST /v1/lookup/batch`` of one
    :func:`create_router` router directly, before FastAPI's middleware, routing and dependency
    machinery; every other request goes on to the app. The answers (bodies, status codes,
    headers, metrics) are the routes' own, from the same code.

    ``app.add_middleware(LookupFastPath, router=router)`` (``prefix``: the router's include
    prefix), or, to skip FastAPI's outer middleware too, around the app:
    ``served = LookupFastPath(app, router=router)`` (serve ``served``; an exception in a lookup
    is then uvicorn's 500). It steps aside (the request goes through FastAPI as usual) when
    the router was created with ``dependencies``, when the app has dependencies of its own or
    any ``dependency_overrides``, and when middleware would be skipped: other middleware added
    after this one (it would run outside, after), or, around the app, any middleware the app
    has (an authentication middleware keeps guarding the lookups). Dependencies added by
    ``app.include_router(router, dependencies=...)`` are *not* seen: with the fast path, give
    them to ``create_router(dependencies=...)`` (:func:`create_app` does).
    """

    def __init__(self, app: ASGIApp, *, router: APIRouter, prefix: str = "") -> None:
        paths = getattr(router, _FAST_KEY, None)
        if not isinstance(paths, _FastPaths):
            raise ValueError("router must come from aio_mclookup.fastapi.create_router")
        self.app = app
        self.owner = app if isinstance(app, Starlette) else None
        self.paths = paths
        self.routes = {prefix + path: (path, core) for path, core in paths.cores.items()}
        self.middleware_ok: bool | None = None  # decided at the first lookup

    def _skips_no_middleware(self, owner: object) -> bool:
        """Whether answering here skips none of the app's own middleware: around the app, it
        must have none; inside it, this must be the innermost (the first added)."""
        if self.middleware_ok is None:
            middleware = list(getattr(owner, "user_middleware", ()))
            if self.owner is not None:
                self.middleware_ok = not middleware
            else:
                self.middleware_ok = bool(middleware) and middleware[-1].cls is LookupFastPath
        return self.middleware_ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        owner = scope.get("app")
        if owner is None and route is not None:  # wrapped around the app, not inside it
            owner = scope["app"] = self.owner
        if (
            route is None
            or scope["method"] != "POST"
            or self.paths.has_dependencies
            or getattr(owner, "dependency_overrides", None)
            or getattr(getattr(owner, "router", None), "dependencies", None)
            or not self._skips_no_middleware(owner)
        ):
            await self.app(scope, receive, send)
            return
        path, core = route
        headers: list[tuple[bytes, bytes]]
        try:
            coordinator = _coordinator_of(scope)
            body = await _receive_body(scope, receive, self.paths.body_limit)
            media = _media_type(_header(scope, b"content-type"))
            content, media = await core(body, media, coordinator, scope)
            status, headers = 200, [(b"content-type", media.encode())]
        except _Disconnected:
            return
        except ApiError as exc:
            status = exc.status_code
            content = json.dumps(exc.body(), separators=(",", ":")).encode()
            headers = [(b"content-type", b"application/json")]
            headers += [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
        headers.append((b"content-length", b"%d" % len(content)))
        self.paths.counts[(path, status)] += 1
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})


async def _answer(coordinator: LookupCoordinator, item: _Item, kwargs: Mapping[str, Any]) -> int:
    """``token_len``: the plain lookup; ``num_tokens``: vLLM's scheduler view of it."""
    if item.token_len is not None:
        return await coordinator.lookup(item.token_len, item.hashes, **kwargs)
    return await coordinator.lookup_request(item.num_tokens, item.hashes, **kwargs)


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
    bodies get a 422. ``dependencies`` run before every route (an authentication hook, e.g.
    ``[Depends(check_token)]``). ``namespace`` prefixes the metric names.
    """
    if max_body_bytes is None and isinstance(max_hashes_per_request, int):
        max_body_bytes = _BYTES_PER_HASH * max_hashes_per_request
    for name, value in (
        ("max_hashes_per_request", max_hashes_per_request),
        ("max_body_bytes", max_body_bytes),
        ("max_batch_requests", max_batch_requests),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    assert max_body_bytes is not None
    body_limit: int = max_body_bytes
    if lookup_timeout is not None and not lookup_timeout > 0:
        raise ValueError(f"lookup_timeout must be > 0 or None, got {lookup_timeout!r}")
    if hasher is not None and not callable(getattr(hasher, "hash", None)):
        raise ValueError(f"hasher must be a BlockHasher, got {type(hasher).__name__}")
    prefix = check_namespace(namespace)
    counts: collections.Counter[tuple[str, int]] = collections.Counter()
    router = APIRouter(
        tags=list(tags), route_class=_route_class(counts), dependencies=list(dependencies or ())
    )
    kwargs: dict[str, Any] = {} if lookup_timeout is None else {"timeout": lookup_timeout}
    decoder = _Decoder(max_hashes_per_request, hasher)
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
            (hit,) = await _lookup_all(coordinator, [item], kwargs, batch=False)
            return _HIT.pack(hit), OCTET_STREAM
        if media != "application/json":
            raise unsupported(media)
        item = decoder.item(_parse_json(body), ["body"], scope, coordinator.layout)
        (hit,) = await _lookup_all(coordinator, [item], kwargs, batch=False)
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
        """The layout lookups use (`KVLayout.to_dict()`), and the hasher of token-id bodies
        (null when they are not accepted): what a router must match."""
        the_hasher = hasher if hasher is not None else _state_hasher(request.scope)
        return LayoutResponse(
            layout=coordinator.layout.to_dict(), hasher=_hasher_config(the_hasher)
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


def create_app(
    layout: KVLayout,
    store: StoreSource | None = None,
    *,
    master_address: str | None = None,
    metadata_server: str | None = None,
    store_options: Mapping[str, Any] | None = None,
    own_store: bool | None = None,
    router_options: Mapping[str, Any] | None = None,
    dependencies: Sequence[DependsParam] | None = None,
    fast_path: bool = True,
    title: str = "aio-mclookup",
    **coordinator_options: Any,
) -> FastAPI:
    """A FastAPI app with :func:`coordinator_lifespan` (the store arguments and
    ``coordinator_options``) and :func:`create_router` (``router_options``; ``dependencies``,
    e.g. an authentication hook, guard every route of the router). ``fast_path`` adds
    :class:`LookupFastPath` (it steps aside while there are dependencies)."""
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
    options = dict(router_options or {})
    if dependencies is not None:
        options["dependencies"] = [*options.get("dependencies", ()), *dependencies]
    router = create_router(**options)
    app.include_router(router)
    if fast_path:
        app.add_middleware(LookupFastPath, router=router)
    return app
