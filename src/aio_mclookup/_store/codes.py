"""Mooncake's error codes as this library reads them, and how a failed RPC shows in an answer:
it is not raised; every element of the answer carries the same negative code."""

from __future__ import annotations

from collections.abc import Sequence

from .._errors import StoreError

__all__ = [
    "INTERNAL_ERROR", "INVALID_PARAMS", "NO_AVAILABLE_HANDLE", "OBJECT_ALREADY_EXISTS",
    "OBJECT_HAS_LEASE", "OBJECT_NOT_FOUND", "RPC_FAIL", "RPC_TIMEOUT", "code_name",
    "failed_rpc_code", "raise_bad_codes", "raise_if_failed_rpc",
]

# Mooncake ErrorCode values (mooncake-store/include/types.h) that this library reads.
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
RPC_FAIL = -900
RPC_TIMEOUT = -901

_CODE_NAMES = {
    INTERNAL_ERROR: "INTERNAL_ERROR",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    INVALID_PARAMS: "INVALID_PARAMS",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}


def code_name(code: int) -> str:
    return _CODE_NAMES.get(code, "unknown")


def failed_rpc_code(codes: Sequence[int]) -> int | None:
    """The code of a failed RPC (every answer the same negative code), else None."""
    if codes:
        first = codes[0]
        if first < 0 and all(c == first for c in codes):
            return first
    return None


def raise_if_failed_rpc(op: str, codes: Sequence[int]) -> None:
    """Raise :class:`StoreError` when every answer is the same negative code (a failed RPC)."""
    code = failed_rpc_code(codes)
    if code is not None:
        raise StoreError(
            f"Mooncake {op} failed for all {len(codes)} keys with code {code} "
            f"({code_name(code)})",
            code=code,
        )


def raise_bad_codes(
    op: str, keys: Sequence[str], codes: Sequence[int], ok: tuple[int, ...]
) -> None:
    """Raise :class:`StoreError` for the first per-key code not in ``ok``."""
    if len(codes) != len(keys):
        raise StoreError(f"Mooncake {op} answered {len(codes)} codes for {len(keys)} keys")
    bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c not in ok]
    if bad:
        key, code = bad[0]
        raise StoreError(
            f"Mooncake {op} failed for {len(bad)} of {len(keys)} keys; first {key!r} with code "
            f"{code} ({code_name(code)})",
            code=code,
        )
