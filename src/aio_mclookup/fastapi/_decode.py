"""Decoding request bodies at bounded cost: sizes and counts checked before any per-item work;
hex, base64, token ids, multimodal items, and the compact binary frame."""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any, NoReturn

import numpy as np
from fastapi import Request
from starlette.types import Scope

from .. import (
    BlockHasher,
    HashInput,
    InvalidRequest,
    KVLayout,
    LookupCoordinator,
)
from .._plan.hashes import VLLM_HASH_WIDTHS, check_width
from ._errors import ApiError, _dotted, _field_loc, _invalid, _too_large, _too_many
from ._models import (
    _FRAME_HEAD,
    _MAX_HASH_HEX,
    _MAX_TEXT,
    _MAX_TOKEN_ID,
    _MAX_TOKENS,
    HASHER_KEY,
    STATE_KEY,
    Loc,
    LookupRequest,
)
from ._scan import scan_hex_lookup


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


_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def _unhex(text: str) -> bytes:
    return binascii.unhexlify(text.encode("ascii"))


def _decode_hashes(raw: Mapping[str, Any], form: str, loc: Loc, max_hashes: int) -> HashInput:
    """The hashes of a body in ``form`` ``block_hashes`` (hex strings) or
    ``block_hashes_b64`` (with ``hash_len``), decoded; a 422 naming the field otherwise."""
    if form == "block_hashes":
        if raw.get("hash_len") is not None:
            raise _invalid([*loc, "hash_len"], "hash_len goes with block_hashes_b64 only")
        hashes = raw["block_hashes"]
        if type(hashes) is not list:
            raise _invalid(
                [*loc, "block_hashes"], f"block_hashes must be an array, not {_kind(hashes)}"
            )
        return _decode_hex(hashes, loc, max_hashes)
    return _decode_b64(raw, loc, max_hashes)


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
            # every hash of the first one's width (a mix of widths can join to a fitting sum)
            if list(map(len, hashes)).count(len(first)) == len(hashes):
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
            odd = len(text) % 2 and all(c in _HEX_DIGITS for c in text)
            what = "an even number of hex digits" if odd else "hex digits only (0-9, a-f)"
            raise _invalid([*loc, "block_hashes", i], f"a block hash must have {what}") from None
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


_SGLANG_ONLY = frozenset({"extra_key"})


_KNOWN = frozenset(LookupRequest.model_fields) - _SGLANG_ONLY


class _Item:
    """One validated lookup: ``token_len`` (plain hit) or ``num_tokens`` (vLLM's scheduler
    view), the hashes, and the body field they came from; or, for an SGLang layout, the
    token ids whose pages the coordinator hashes itself (``tokens``, with their namespace:
    :meth:`LookupCoordinator.lookup_tokens`)."""

    __slots__ = ("cache_salt", "extra_key", "hashes", "num_tokens", "source", "token_len",
                 "tokens")

    def __init__(
        self, token_len: int | None, num_tokens: int, hashes: HashInput, source: str
    ) -> None:
        self.token_len = token_len
        self.num_tokens = num_tokens
        self.hashes = hashes
        self.source = source
        self.tokens: np.ndarray[Any, Any] | None = None
        self.extra_key: str | None = None
        self.cache_salt: str | None = None


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
            why = "applies to SGLang layouts only" if unknown in _SGLANG_ONLY else "unknown field"
            raise _invalid([*loc, _name(unknown)], why)
        form = _form(raw, loc)
        if form == "token_ids":
            return self._tokens(raw, loc, scope, layout)
        for name in _TOKEN_EXTRAS:
            if raw.get(name) is not None:
                raise _invalid([*loc, name], f"{name} goes with token_ids only")
        token_len = _int_field(raw, "token_len", loc, 0, _MAX_TOKENS)
        num_tokens = _int_field(raw, "num_tokens", loc, 0, _MAX_TOKENS)
        decoded = _decode_hashes(raw, form, loc, self.max_hashes)
        return self._counted(token_len, num_tokens, decoded, form, loc, layout)

    def scanned(self, body: bytes, loc: Loc, layout: KVLayout) -> _Item | None:
        """The :class:`_Item` of a body :func:`scan_hex_lookup` reads (the same one
        :meth:`item` makes of its parse), or None: parse it."""
        found = scan_hex_lookup(body, self.max_hashes)  # (over the limit: item() says so)
        if found is None:
            return None
        name, value, rows = found
        count = _int_field({name: value}, name, loc, 0, _MAX_TOKENS)
        token_len, num_tokens = (count, None) if name == "token_len" else (None, count)
        return self._counted(token_len, num_tokens, rows, "block_hashes", loc, layout)

    def widths(self, layout: KVLayout) -> tuple[int, ...]:
        """The hash widths a request may have: the layout's ``hash_bytes``, else the width of
        the router's hasher, else any of vLLM's (32 or 16 bytes)."""
        if layout.hash_bytes is not None:
            return (layout.hash_bytes,)
        width = getattr(self.hasher, "width", None)
        return (width,) if isinstance(width, int) else VLLM_HASH_WIDTHS

    def checked(self, item: _Item, loc: Loc, layout: KVLayout) -> _Item:
        """``item``, once its hashes are of one width the layout's engines write (else 422
        naming the field they came from)."""
        try:
            check_width(item.hashes, self.widths(layout))
        except InvalidRequest as exc:
            raise _invalid([*loc, item.source], str(exc)) from None
        return item

    def _counted(
        self,
        token_len: int | None,
        num_tokens: int | None,
        decoded: HashInput,
        form: str,
        loc: Loc,
        layout: KVLayout,
    ) -> _Item:
        """The item of ``decoded`` hashes, with the body's ``token_len`` or ``num_tokens``."""
        if token_len is None:
            if num_tokens is None:
                raise _invalid([*loc, "num_tokens"], "give num_tokens (or token_len)")
            return self.checked(_Item(None, num_tokens, decoded, form), loc, layout)
        if num_tokens is not None:
            raise _invalid([*loc, "num_tokens"], "give num_tokens or token_len, not both")
        if layout.align(token_len) != token_len:
            raise _invalid(
                [*loc, "token_len"],
                f"token_len={token_len} must be a multiple of scheduler_block_size="
                f"{layout.scheduler_block_size}",
            )
        return self.checked(_Item(token_len, token_len, decoded, form), loc, layout)

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


_JSON = json.JSONDecoder(parse_constant=_reject_constant)
"""The body decoder: stdlib JSON, refusing NaN and Infinity (built once; it keeps no state)."""


_DRAIN_BYTES = 1 << 20
"""How far past the limit an oversize body is still read (and dropped) before the 413, so
that the reply reaches a client still sending: closing on unread bytes resets the connection
and can destroy the reply in flight. Longer bodies are refused unread."""


async def _read_capped(
    chunks: AsyncIterator[bytes], declared: str | None, expects_continue: bool, limit: int
) -> bytes:
    """The body from ``chunks``, at most ``limit`` bytes, else 413 ``payload_too_large``.

    An oversize body is read to its end and dropped when it ends within :data:`_DRAIN_BYTES`
    past the limit; a longer one (by its Content-Length, or while it streams in) and one whose
    client waits for ``100 Continue`` are refused without reading further."""
    drain_to = limit + _DRAIN_BYTES
    if declared is not None and declared.isdigit() and int(declared) > limit:
        if int(declared) <= drain_to and not expects_continue:
            await _drain(chunks, 0, drain_to)
        raise _too_large(limit)
    parts: list[bytes] = []
    seen = 0
    async for chunk in chunks:
        seen += len(chunk)
        if seen > limit:
            await _drain(chunks, seen, drain_to)
            raise _too_large(limit)
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _drain(chunks: AsyncIterator[bytes], seen: int, drain_to: int) -> None:
    """Read and drop the rest of ``chunks`` while no more than ``drain_to`` bytes are seen."""
    async for chunk in chunks:
        seen += len(chunk)
        if seen > drain_to:
            return


async def _read_body(request: Request, limit: int) -> bytes:
    """The body of a route's request, by :func:`_read_capped`."""
    headers = request.headers
    expects_continue = headers.get("expect", "").lower() == "100-continue"
    return await _read_capped(
        request.stream(), headers.get("content-length"), expects_continue, limit
    )


def _parse_json(body: bytes) -> Any:
    try:  # (what json.loads does with bytes, without building a decoder per body)
        return _JSON.decode(body.decode(json.detect_encoding(body), "surrogatepass"))
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
