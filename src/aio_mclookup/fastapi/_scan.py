"""The common lookup body, ``{"token_len": N, "block_hashes": ["<hex>", ...]}`` (either
order, ``num_tokens`` for ``token_len``), read without a JSON parse.

Parsing builds a string per hash and hex-decoding walks them again; a body of this one shape
(what clients send) is instead checked as a grid of fixed-width rows and decoded in one call,
in about half the time (docs/fastapi.md). Anything else (other fields, escapes,
hashes of several widths, bad hex, a number that is not a plain integer) is left to the
JSON parser, whose result and errors stay the reference: :func:`scan_hex_lookup` accepts
only bodies the parser reads to the same fields and the same hash rows."""

from __future__ import annotations

import binascii
import re
from typing import Any

import numpy as np

from ._models import _MAX_HASH_HEX

__all__ = ["scan_hex_lookup"]

_WS = rb"[ \t\n\r]*"  # JSON's whitespace (not \s: that takes \f and \v too)
_COUNT = rb'"(token_len|num_tokens)"' + _WS + b":" + _WS + rb"(-?(?:0|[1-9][0-9]{0,17}))"
_HASHES = rb'"block_hashes"' + _WS + b":" + _WS + rb"\["
_HASHES_FIRST = re.compile(_WS + rb"\{" + _WS + _HASHES)
_COUNT_AFTER = re.compile(rb"\]" + _WS + b"," + _WS + _COUNT + _WS + rb"\}" + _WS + rb"\Z")
_COUNT_FIRST = re.compile(_WS + rb"\{" + _WS + _COUNT + _WS + b"," + _WS + _HASHES)
_END = re.compile(rb"\]" + _WS + rb"\}" + _WS + rb"\Z")
_JSON_WS = b" \t\n\r"


def scan_hex_lookup(
    body: bytes, limit: int
) -> tuple[str, int, np.ndarray[Any, np.dtype[np.uint8]]] | None:
    """``(field, value, rows)`` of a body holding exactly ``block_hashes`` (1 to ``limit``
    hex strings of one even width, at most ``_MAX_HASH_HEX`` digits) and ``token_len`` or
    ``num_tokens``, a plain integer of at most 18 digits; None for any other body (parse it
    as JSON: it says what is wrong). ``rows`` is one row of raw bytes per hash."""
    end = body.rfind(b"]")
    if end < 0:
        return None
    head = _HASHES_FIRST.match(body)
    if head is not None:
        tail = _COUNT_AFTER.match(body, end)
        if tail is None:
            return None
        name, value = tail.group(1, 2)
    else:
        head = _COUNT_FIRST.match(body)
        if head is None or _END.match(body, end) is None:
            return None
        name, value = head.group(1, 2)
    rows = _hex_rows(body[head.end() : end].strip(_JSON_WS), limit)
    if rows is None:
        return None
    return name.decode(), int(value), rows


def _hex_rows(items: bytes, limit: int) -> np.ndarray[Any, np.dtype[np.uint8]] | None:
    """``"h1", "h2", ...`` (the inside of a JSON array) -> one row per hash, when every item
    is a quoted hex string of the first one's width, all separated alike, and there are at
    most ``limit``; else None."""
    if items[:1] != b'"':
        return None
    close = items.find(b'"', 1)
    width = close - 1  # hex digits of the first hash
    if not 0 < width <= _MAX_HASH_HEX or width % 2:
        return None
    after = items.find(b'"', close + 1)
    sep = b"" if after < 0 else items[close + 1 : after]
    if sep and sep.strip(_JSON_WS) != b",":
        return None
    stride = width + 2 + len(sep)
    count, rest = divmod(len(items) + len(sep), stride)
    if rest or (not sep and count != 1) or count > limit:
        return None
    rows = items + sep  # count rows of stride bytes: '"', width hex digits, '"', sep
    quotes = b'"' * count
    if rows[::stride] != quotes or rows[width + 1 :: stride] != quotes:
        return None
    for at, char in enumerate(sep, width + 2):  # (byte slices: far cheaper than arrays here)
        if rows[at::stride] != bytes((char,)) * count:
            return None
    digits = np.frombuffer(rows, dtype=np.uint8).reshape(count, stride)[:, 1 : width + 1]
    try:  # hex digits only: a quote, backslash or anything else inside fails here
        raw = binascii.unhexlify(digits.tobytes())
    except binascii.Error:
        return None
    return np.frombuffer(raw, dtype=np.uint8).reshape(count, width // 2)
