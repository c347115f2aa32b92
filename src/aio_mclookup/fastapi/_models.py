"""The wire format of the HTTP API: request and response models, and its constants and limits."""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from .. import (
    Store,
)

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


class MMFeature(BaseModel):
    """One multimodal item of a prompt, as vLLM's block hash sees it."""

    model_config = ConfigDict(extra="forbid")

    identifier: str = Field(max_length=_MAX_TEXT, description="The item's mm_hash (vLLM's).")
    offset: int = Field(ge=0, description="Index of the item's first placeholder token.")
    length: int = Field(ge=1, description="Placeholder tokens of the item.")


class LookupRequest(BaseModel):
    """One prompt, in one of three forms: its block hashes (a list of hex strings, or one base64
    blob of fixed-width hashes), or its token ids (hashed by the server's hasher).

    Against an SGLang layout (``GET /v1/layout`` says ``"engine": "sglang"``), the hashes
    are SGLang's page hashes (32 bytes) with ``num_tokens``, and token ids are hashed with the
    layout's page hashing, seeded by ``extra_key`` and ``cache_salt``; the answer is SGLang's
    L3 hit. ``token_len``, ``lora_name``, ``lora_path`` and ``mm_features`` are vLLM's (422).

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
    extra_key: str | None = Field(
        default=None,
        max_length=_MAX_TEXT,
        description="With token_ids, SGLang layouts only: the request's extra_key (with the "
        "LoRA id appended when it uses an adapter), which seeds the page hashes from 0.5.20.",
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
    """What the server looks up with: the layout, its engine and release, and the hasher of
    token-id bodies."""

    layout: dict[str, Any] = Field(
        description="The layout (KVLayout.to_dict(), or SGLangLayout.to_dict() with "
        '"engine": "sglang").'
    )
    hasher: dict[str, Any] | None = Field(
        description="The hasher of token-id bodies (vLLM: hash_block_size, algo, seed, "
        "vllm_version, ...; SGLang: the layout's page hashing); null when token-id bodies "
        "are not accepted."
    )
    engine: Literal["vllm", "sglang"] = Field(
        default="vllm", description="Whose keys and hits the lookups reproduce."
    )
    version: str | None = Field(
        default=None, description="The engine's release (vllm_version or sglang_version)."
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
