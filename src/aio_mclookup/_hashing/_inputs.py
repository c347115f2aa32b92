"""Checking and converting the caller's inputs: token ids, parent, extras; limits."""

from __future__ import annotations

import array
import operator
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

import numpy as np
from numpy.typing import NDArray

from .._errors import InvalidRequest

__all__ = [
    "MAX_BLOCK_SIZE",
    "MAX_TOKENS",
    "Embeds",
    "MmItem",
    "block_size",
    "embeds",
    "fresh",
    "lookahead",
    "mm_items",
    "optional_str",
    "parent_digest",
    "plain_tokens",
    "token_array",
]

MAX_TOKENS: Final = 1 << 24  # token ids per call (16,777,216)
MAX_BLOCK_SIZE: Final = 1 << 20
_TOKEN_LIMIT: Final = 1 << 63


class MmItem(NamedTuple):
    """A multimodal item: its identifier and placeholder range ``[offset, offset + length)``."""

    identifier: str
    offset: int
    length: int


def fresh(text: str) -> str:
    """A string equal to ``text`` as decoding makes it (a new object unless CPython caches it).

    vLLM's strings are decoded from requests, so two equal ones are distinct objects and pickle
    writes both; the caller's may be one object, which pickle would write once.
    """
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")


def block_size(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(
            f"hash_block_size must be an int, not {type(value).__name__}",
            field="hash_block_size",
        )
    if not 1 <= value <= MAX_BLOCK_SIZE:
        raise InvalidRequest(
            f"hash_block_size must be in 1..{MAX_BLOCK_SIZE}, not {value} (it is the "
            "deployment's kv_cache_config.hash_block_size, e.g. 16)",
            field="hash_block_size",
        )
    return value


def _int(value: object, field: str) -> int:
    if isinstance(value, bool):
        raise InvalidRequest(f"{field} must be an int, not bool", field=field)
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidRequest(
            f"{field} must be an int, not {type(value).__name__}", field=field
        ) from None


def token_list(token_ids: object) -> list[Any] | tuple[Any, ...]:
    """Token ids given as a sequence (not an array), as a list or tuple of at most
    :data:`MAX_TOKENS` items (not checked to be ints); :class:`InvalidRequest` otherwise."""
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)) or not isinstance(
        token_ids, Sequence
    ):
        raise InvalidRequest(
            "token_ids must be a list of ints or a 1-D integer numpy array, not "
            f"{type(token_ids).__name__}",
            field="token_ids",
        )
    if len(token_ids) > MAX_TOKENS:
        raise InvalidRequest(
            f"{len(token_ids):,} token ids are over the limit of {MAX_TOKENS:,} per call",
            field="token_ids",
        )
    return token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids)


def token_array(token_ids: object) -> tuple[NDArray[np.unsignedinteger[Any]], int]:
    """``token_ids`` (a sequence of ints or a 1-D integer array) as an unsigned array (32 or
    64 bits), every id in ``0 <= id < 2**63``, and the largest id (0 when there are none)."""
    if isinstance(token_ids, np.ndarray):
        return _from_array(token_ids)
    ids = token_list(token_ids)
    # array refuses non-integers, negative ids and ids beyond its type; 32 bits when they fit
    # (less memory to go through), else 64
    try:
        arr: NDArray[Any] = np.frombuffer(array.array("I", ids), dtype=np.uintc)
    except OverflowError:
        try:
            arr = np.frombuffer(array.array("Q", ids), dtype=np.ulonglong)
        except (TypeError, OverflowError):
            raise _bad_id(ids) from None
    except TypeError:
        raise _bad_id(ids) from None
    top = int(arr.max()) if len(ids) else 0
    if top >= _TOKEN_LIMIT:
        raise _bad_id(ids)
    return arr, top


def plain_tokens(token_ids: object) -> tuple[NDArray[np.unsignedinteger[Any]], bool] | None:
    """``token_ids`` as an unsigned array in few steps, or ``None`` (then :func:`token_array`
    decides). A list or tuple is converted and checked whole (ids below ``2**32``: the flag is
    True); an array is only reinterpreted (False: a negative or too large id shows as one
    beyond the fast range, which the caller checks)."""
    kind = type(token_ids)
    if kind is list or kind is tuple:
        ids: Any = token_ids
        if len(ids) > MAX_TOKENS:
            return None
        packed = array.array("I")
        try:
            if kind is list:
                packed.fromlist(ids)
            else:
                packed = array.array("I", ids)
        except (TypeError, OverflowError):
            return None
        return np.frombuffer(packed, dtype=np.uintc), True
    if kind is not np.ndarray:
        return None
    arr: NDArray[Any] = token_ids  # type: ignore[assignment]
    dtype = arr.dtype
    if arr.ndim != 1 or dtype.kind not in "iu" or not dtype.isnative or arr.size > MAX_TOKENS:
        return None
    if dtype.itemsize == 8:  # negative int64 ids become >= 2**63
        return arr.view(np.uint64), False
    if dtype.kind == "u":
        return (arr if dtype.itemsize == 4 else arr.astype(np.uint32)), False
    return arr.astype(np.int64).view(np.uint64), False


def _bad_id(ids: Sequence[Any]) -> InvalidRequest:
    for i, x in enumerate(ids):
        if isinstance(x, (bool, np.bool_)) or not hasattr(x, "__index__"):
            return InvalidRequest(
                f"token id at index {i} is {type(x).__name__} {x!r:.40}, not an int",
                field="token_ids",
            )
        value = operator.index(x)
        if value < 0:
            return InvalidRequest(f"token id {value} at index {i} is negative", field="token_ids")
        if value >= _TOKEN_LIMIT:
            return InvalidRequest(
                f"token id {value} at index {i} is outside 0..2**63-1", field="token_ids"
            )
    return InvalidRequest("token_ids are not all ints in 0..2**63-1", field="token_ids")


def _from_array(arr: NDArray[Any]) -> tuple[NDArray[np.unsignedinteger[Any]], int]:
    if arr.ndim != 1:
        raise InvalidRequest(
            f"token_ids must be a 1-D array, not {arr.ndim}-D with shape {arr.shape}",
            field="token_ids",
        )
    if arr.dtype.kind not in "iu":
        raise InvalidRequest(
            f"token_ids must have an integer dtype, not {arr.dtype}", field="token_ids"
        )
    if arr.size > MAX_TOKENS:
        raise InvalidRequest(
            f"{arr.size:,} token ids are over the limit of {MAX_TOKENS:,} per call",
            field="token_ids",
        )
    if not arr.size:
        return np.zeros(0, dtype=np.uint64), 0
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        i = int(np.argmax(arr < 0))
        raise InvalidRequest(f"token id {int(arr[i])} at index {i} is negative", field="token_ids")
    top = int(arr.max())
    if top >= _TOKEN_LIMIT:
        i = int(np.argmax(arr >= _TOKEN_LIMIT))
        raise InvalidRequest(
            f"token id {int(arr[i])} at index {i} is outside 0..2**63-1", field="token_ids"
        )
    if arr.dtype.itemsize == 8 and arr.dtype.isnative:  # checked non-negative: same bits
        return arr.view(np.uint64), top
    return arr.astype(np.uint64), top


def parent_digest(parent: object, width: int) -> bytes:
    """A parent block hash as ``bytes`` of the digest width (bytes-like or a uint8 row)."""
    if isinstance(parent, np.ndarray):
        if parent.dtype != np.uint8 or parent.ndim != 1:
            raise InvalidRequest(
                f"parent as an array must be a 1-D uint8 row, not {parent.ndim}-D {parent.dtype}",
                field="parent",
            )
        data = parent.tobytes()
    elif isinstance(parent, (bytes, bytearray, memoryview)):
        data = bytes(parent)
    else:
        raise InvalidRequest(
            f"parent must be bytes (a block hash), not {type(parent).__name__}", field="parent"
        )
    if len(data) != width:
        raise InvalidRequest(
            f"parent is {len(data)} bytes; this algorithm's hashes are {width}", field="parent"
        )
    return data


def optional_str(value: object, field: str, *, allow_empty: bool = True) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"{field} must be a str, not {type(value).__name__}", field=field)
    if not allow_empty and not value:
        raise InvalidRequest(f"{field} must not be empty", field=field)
    return fresh(value)


def lookahead(value: object, has_lookahead: bool, version: str) -> int:
    n = _int(value, "lookahead_tokens")
    if not 0 <= n <= MAX_TOKENS:
        raise InvalidRequest(
            f"lookahead_tokens must be in 0..{MAX_TOKENS}, not {n}", field="lookahead_tokens"
        )
    if n and not has_lookahead:
        raise InvalidRequest(
            f"vLLM {version} has no lookahead block hashes (they exist from 0.33.0, and never "
            "with a KV connector): pass lookahead_tokens=0",
            field="lookahead_tokens",
        )
    return n


def mm_items(features: object, continuation: bool) -> list[MmItem]:
    """Sorted, non-overlapping ``(identifier, offset, length)`` items, strings made fresh.

    Offsets count from the first of this call's tokens; with a parent (``continuation``) an item
    begun in the earlier part has a negative offset.
    """
    if features is None:
        return []
    if isinstance(features, (str, bytes)) or not isinstance(features, Sequence):
        raise InvalidRequest(
            "mm_features must be a sequence of (identifier, offset, length)",
            field="mm_features",
        )
    if len(features) > MAX_TOKENS:
        raise InvalidRequest(f"more than {MAX_TOKENS:,} mm_features", field="mm_features")
    items: list[MmItem] = []
    for i, feature in enumerate(features):
        field = f"mm_features.{i}"
        try:
            identifier, offset, length = feature
        except (TypeError, ValueError):
            raise InvalidRequest(
                f"{field} must be (identifier, offset, length), not {feature!r:.60}",
                field=field,
            ) from None
        if not isinstance(identifier, str) or not identifier:
            raise InvalidRequest(
                f"{field}: the identifier must be a non-empty str (the item's mm_hash or "
                "multi_modal_uuid)",
                field=field,
            )
        offset, length = _int(offset, field), _int(length, field)
        if length < 1:
            raise InvalidRequest(f"{field}: length must be >= 1, not {length}", field=field)
        if offset < 0 and not continuation:
            raise InvalidRequest(
                f"{field}: offset {offset} is negative (only with parent=, for an item begun "
                "before the continuation)",
                field=field,
            )
        if items and offset < items[-1].offset + items[-1].length:
            raise InvalidRequest(
                f"{field}: items must be sorted by offset and must not overlap (as vLLM "
                "orders its placeholders)",
                field=field,
            )
        items.append(MmItem(fresh(identifier), offset, length))
    return items


class Embeds(NamedTuple):
    """Prompt embeddings as raw bytes in C order; row ``i`` (token ``i``) is
    ``data[i * row_bytes : (i + 1) * row_bytes]``."""

    data: memoryview
    row_bytes: int


def embeds(prompt_embeds: object, n_tokens: int, continuation: bool) -> Embeds | None:
    """Check the prompt embeddings (tokens x hidden, one row per token id)."""
    if prompt_embeds is None:
        return None
    if not isinstance(prompt_embeds, np.ndarray):
        raise InvalidRequest(
            "prompt_embeds must be a numpy array (for a torch tensor: tensor.cpu().numpy(), or "
            "tensor.view(torch.uint8).numpy() for bfloat16: only the bytes count)",
            field="prompt_embeds",
        )
    if prompt_embeds.ndim != 2 or prompt_embeds.dtype.hasobject:
        raise InvalidRequest(
            f"prompt_embeds must be a 2-D numeric array (tokens x hidden), not "
            f"{prompt_embeds.ndim}-D {prompt_embeds.dtype}",
            field="prompt_embeds",
        )
    if prompt_embeds.shape[0] > n_tokens:
        raise InvalidRequest(
            f"prompt_embeds has {prompt_embeds.shape[0]} rows for {n_tokens} token ids (one "
            "row per prompt token"
            + (", counted from the continuation's first token)" if continuation else ")"),
            field="prompt_embeds",
        )
    # the engine hashes its tensor's bytes: C order, native byte order (as torch holds them)
    native = prompt_embeds.astype(prompt_embeds.dtype.newbyteorder("="), copy=False)
    flat = np.ascontiguousarray(native).reshape(-1).view(np.uint8)
    return Embeds(flat.data, prompt_embeds.shape[1] * prompt_embeds.dtype.itemsize)
