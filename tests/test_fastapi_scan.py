"""The lookup body read without a JSON parse (``fastapi/_scan.py``): it reads the common shape
and steps aside for every other body; whatever it reads, the JSON parse reads alike."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")

from aio_mclookup.fastapi._decode import _Decoder, _parse_json
from aio_mclookup.fastapi._errors import ApiError
from aio_mclookup.fastapi._scan import scan_hex_lookup
from test_fastapi import LAYOUT

DECODER = _Decoder(64, None)
HASHES = [bytes([i]) * 32 for i in range(1, 9)]
HEX = [h.hex() for h in HASHES]


def fill(text: str) -> str:
    """``text`` with H0, H1 and H2 replaced by those hashes' hex."""
    return text.replace("H0", HEX[0]).replace("H1", HEX[1]).replace("H2", HEX[2])


def parsed(body: bytes) -> Any:
    """What the JSON path makes of ``body``: an item's fields, or the error's body."""
    try:
        item = DECODER.item(_parse_json(body), ["body"], {}, LAYOUT)
    except ApiError as exc:
        return ("error", exc.status_code, exc.body())
    return outcome(item)


def scanned(body: bytes) -> Any:
    """What the scan makes of ``body``: the same form as :func:`parsed`, or None."""
    try:
        item = DECODER.scanned(body, ["body"], LAYOUT)
    except ApiError as exc:
        return ("error", exc.status_code, exc.body())
    return None if item is None else outcome(item)


def outcome(item: Any) -> Any:
    rows = np.asarray(item.hashes) if not isinstance(item.hashes, list) else None
    shape = None if rows is None else rows.shape
    raw = b"".join(item.hashes) if rows is None else rows.tobytes()
    return ("item", item.token_len, item.num_tokens, item.source, shape, raw)


TAKEN = [
    json.dumps({"token_len": 128, "block_hashes": HEX}),
    json.dumps({"block_hashes": HEX, "token_len": 128}),
    json.dumps({"num_tokens": 130, "block_hashes": HEX}, separators=(",", ":")),
    json.dumps({"block_hashes": HEX, "num_tokens": 0}, indent=2),
    json.dumps({"block_hashes": HEX[:1], "num_tokens": 7}),
    fill(' \n{ "num_tokens" :7 , "block_hashes" : [ "H0" ] }\r\n'),
    json.dumps({"token_len": 128, "block_hashes": [h.upper() for h in HEX]}),
    json.dumps({"token_len": 16, "block_hashes": ["ab", "cd"]}),
    # read, then refused exactly as the parse refuses them
    json.dumps({"token_len": -16, "block_hashes": HEX}),
    json.dumps({"token_len": 17, "block_hashes": HEX}),
    json.dumps({"num_tokens": 10**15, "block_hashes": HEX}),
    json.dumps({"num_tokens": -0, "block_hashes": HEX}),
]


@pytest.mark.parametrize("text", TAKEN)
def test_the_common_shape_is_read_as_the_parse_reads_it(text: str) -> None:
    body = text.encode()
    assert scan_hex_lookup(body, 64) is not None
    assert scanned(body) == parsed(body)


LEFT = [
    json.dumps({"token_len": 128, "block_hashes": ["abcd", "ab", "abcdef"]}),  # widths mix
    json.dumps({"token_len": 128, "block_hashes": ["abc", "abc"]}),  # odd width
    json.dumps({"token_len": 128, "block_hashes": ["zz" * 16]}),  # not hex
    json.dumps({"token_len": 128, "block_hashes": []}),
    json.dumps({"token_len": 128, "block_hashes": [1, 2]}),
    json.dumps({"token_len": 128, "block_hashes": HEX, "lora_name": "x"}),
    json.dumps({"token_len": 128, "num_tokens": 128, "block_hashes": HEX}),
    fill('{"token_len": 128.0, "block_hashes": ["H0"]}'),
    fill('{"token_len": 1e2, "block_hashes": ["H0"]}'),
    fill('{"token_len": 0128, "block_hashes": ["H0"]}'),
    fill('{"token_len": 1000000000000000000000000000000, "block_hashes": ["H0"]}'),
    '{"token_len": 128, "block_hashes": ["\\u0061b"]}',
    fill('{"token_len": 128, "block_hashes": ["H0","H1", "H2"]}'),
    fill('{"token_len": 128, "block_hashes": ["H0",]}'),
    fill('{"token_len": 128, "block_hashes": ["H0" "H1"]}'),
    fill('{"token_len": 128, "block_hashes": [["H0"]]}'),
    fill('{"token_len": 128, "block_hashes": ["H0"]}}'),
    fill('{"token_len": 128, "block_hashes": ["H0"]} x'),
    fill('{"token_len": 128,, "block_hashes": ["H0"]}'),
    fill('{"token_len": 128, "block_hashes": ["H0"]\x0c}'),  # \f: not JSON whitespace
    fill('\ufeff{"token_len": 128, "block_hashes": ["H0"]}'),
    fill('{"token_len": 128, "block_hashes": ["H0"], "token_len": 16}'),
    fill('{"block_hashes": ["H0"], "token_len": 128, "block_hashes": ["H1"]}'),
    fill('{"token_len": 128, "block_hashes": ["H0"]'),
    json.dumps({"token_len": 128, "block_hashes": HEX * 9}),  # over the limit of 64
    "[]",
    "",
]


@pytest.mark.parametrize("text", LEFT)
def test_every_other_body_is_left_to_the_parse(text: str) -> None:
    assert scanned(text.encode()) is None


def test_a_hash_of_the_widest_width_is_read_and_one_wider_is_left() -> None:
    widest = {"token_len": 16, "block_hashes": ["ab" * 1024]}
    assert scanned(json.dumps(widest).encode()) == parsed(json.dumps(widest).encode())
    wider = {"token_len": 16, "block_hashes": ["ab" * 1025]}
    assert scanned(json.dumps(wider).encode()) is None


def test_mutated_bodies_are_read_alike_or_left() -> None:
    """Random byte edits of common bodies: the scan reads each as the parse does, or leaves
    it to the parse (and it still reads most of the untouched ones)."""
    rng = random.Random(5)
    alphabet = b' \t\n\r\x0c",:[]{}0123456789abcdefABCDEF-+.eE\\u'
    read = 0
    for trial in range(3000):
        body = bytearray(TAKEN[trial % 8].encode())
        for _ in range(rng.choice((0, 1, 1, 2, 3))):
            at = rng.randrange(len(body))
            op = rng.randrange(3)
            if op == 0:
                body[at] = rng.choice(alphabet)
            elif op == 1:
                body.insert(at, rng.choice(alphabet))
            else:
                del body[at]
        frozen = bytes(body)
        got = scanned(frozen)
        if got is not None:
            read += 1
            assert got == parsed(frozen), frozen
    assert read > 600  # the untouched bodies, at least
