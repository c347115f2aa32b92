"""HTTP errors: :class:`ApiError` (a bounded JSON body, never the input echoed back) and how a
lookup's failure is answered."""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException, Response

from .. import (
    InvalidRequest,
    StoreError,
)
from .._errors import Error, error_label
from ._models import Loc, LookupRequest


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
        headers={"Connection": "close"},  # a refused body is not read to its end
    )


def _too_many(count: int | None, limit: int, loc: Loc, name: str) -> ApiError:
    what = f"{count} block hashes" if count is not None else "the block hashes"
    return ApiError(
        413,
        "too_many_hashes",
        f"{what}: more than the limit of {limit} per request",
        field=_dotted(loc, name),
    )


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
