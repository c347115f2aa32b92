"""SGLang HiCache's page hashes (docs/sglang.md): a SHA-256 chain over full pages of token ids.

Page ``i``'s digest is ``SHA-256(prior ‖ body)``: the prior is the previous page's digest (32
raw bytes), and for page 0 the namespace seed or nothing. A body is the page's ids as uint32
little-endian; under EAGLE a page is ``page_size`` bigrams ``(t_j, t_{j+1})``, both ids each.
From 0.5.23 a page reading an id above 2**32 - 1 is *wide*: ``0xff`` then the same ids as
uint64. Ids are packed for every page at once (numpy; in C when every id fits 32 bits); the
chain is then one C loop (the compiled twin in ``_chain_c.c``) or, in pure Python, one hashlib
call per page.
"""

from __future__ import annotations

import array
import hashlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import _native
from .._errors import InvalidRequest
from ._inputs import MAX_TOKENS, token_list

__all__ = [
    "PendingArrayPages",
    "PendingPages",
    "namespace_seed",
    "narrow_token_ids",
    "page_hashes",
    "token_ids_q",
]

_C: Any = _native.load("aio_mclookup._hashing._chain_c")
"""The compiled chains (``_chain_c.c``), or ``None``: the Python loop of :func:`_chain`."""
_NAMESPACE_TAG = b"sglang-cache-namespace-v1"
_WIDE_TAG = b"\xff"
_U32_MAX = (1 << 32) - 1
_SMALL_BODY = 32
"""Bodies up to this many bytes (pages of 8 ids or fewer) hash faster with CPython's own
SHA-256 than with OpenSSL's, whose per-call setup dominates such small inputs (see
benchmarks/bench_sglang_hash.py)."""
try:  # (CPython's built-in module: _sha256 up to 3.11, _sha2 from 3.12)
    from _sha256 import sha256 as _SMALL_SHA256  # type: ignore[import-not-found]
except ImportError:
    try:
        from _sha2 import sha256 as _SMALL_SHA256  # type: ignore[import-not-found]
    except ImportError:
        _SMALL_SHA256 = hashlib.sha256


def namespace_seed(extra_key: object, cache_salt: object) -> bytes | None:
    """The 32-byte seed of page 0 (SGLang 0.5.20+), or None when neither value is set. An
    empty string counts as absent, as SGLang's API layer makes it."""
    parts = [_NAMESPACE_TAG]
    present = False
    for name, value in (("extra_key", extra_key), ("cache_salt", cache_salt)):
        if value is None or value == "":
            parts.append(b"\x00")
            continue
        if not isinstance(value, str):
            raise InvalidRequest(
                f"{name} must be a str or None, not {type(value).__name__}", field=name
            )
        try:
            raw = value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"{name} is not valid UTF-8 text: {exc}", field=name) from None
        parts += [b"\x01", len(raw).to_bytes(8, "little"), raw]
        present = True
    return hashlib.sha256(b"".join(parts)).digest() if present else None


def token_ids_q(token_ids: object) -> npt.NDArray[np.int64] | npt.NDArray[np.uint32]:
    """The token ids as SGLang's scheduler holds them (an ``array("q")``: every id in
    ``-2**63 .. 2**63 - 1``), from a list, a tuple, another sequence or a 1-D integer array:
    uint32 when every id fits (the usual case: nothing left to check), else int64."""
    if isinstance(token_ids, np.ndarray):
        return _from_array(token_ids)
    ids = token_list(token_ids)
    try:  # (C loops that refuse non-ints and ids beyond the type; 32 bits is the fast one)
        return np.frombuffer(array.array("I", ids), dtype=np.uintc).astype("<u4", copy=False)
    except (TypeError, OverflowError):
        pass
    try:
        packed = array.array("q", ids)
    except (TypeError, OverflowError):
        raise _bad_id(ids) from None
    return np.frombuffer(packed, dtype=np.int64)


def narrow_token_ids(token_ids: object) -> tuple[bytes, int] | None:
    """The ids packed as little-endian uint32 and their count, when every one fits 32 bits
    (the usual prompt; then no page of them can be refused or wide), else None;
    :class:`InvalidRequest` for what is not token ids at all."""
    packed = _packed(token_ids)
    if packed is not None:
        return packed, len(packed) // 4
    tokens = token_ids_q(token_ids)
    if tokens.dtype != np.uint32 and tokens.size and (
        int(tokens.min()) < 0 or int(tokens.max()) > _U32_MAX
    ):
        return None
    return tokens.astype("<u4").tobytes(), tokens.size


class PendingPages:
    """The hashes of a prompt's first ``pages`` pages, of ids that all fit 32 bits
    (:func:`narrow_token_ids`' packed bytes), not computed yet: :meth:`job` is the chain as
    a native job (``_chain_c``) for the coordinator's worker thread, :meth:`digests` the
    hashes (from that job once it ran, or computed now)."""

    __slots__ = ("_bodies", "_seed", "_width", "pages")

    def __init__(
        self,
        packed: bytes,
        *,
        pages: int,
        page_size: int,
        eagle: bool,
        seed: bytes | None,
    ) -> None:
        units = pages * page_size
        if eagle:  # (a bigram page also reads the next page's first token)
            tokens = np.frombuffer(packed, dtype="<u4")
            ids = np.empty((units, 2), dtype="<u4")
            ids[:, 0] = tokens[:units]
            ids[:, 1] = tokens[1 : units + 1]
            packed = ids.tobytes()
        self._bodies = packed  # (immutable: the thread reads it; pages past the last unread)
        self._width = page_size * (8 if eagle else 4)
        self._seed = seed or b""
        self.pages = pages

    def job(self) -> object | None:
        """The chain as a native job, or None (no compiled extension)."""
        if _C is None:
            return None
        job: object = _C.pages_job(self._seed, self._bodies, self._width, self.pages)
        return job

    def digests(self, job: object | None = None) -> npt.NDArray[np.uint8]:
        """The (pages, 32) digests: from ``job`` once the worker ran it, else computed now."""
        width, pages = self._width, self.pages
        if job is not None:
            raw: bytes = _C.page_digests(job)
        elif not pages:
            raw = b""
        elif _C is not None:
            raw = b"".join(_C.pages(self._seed, self._bodies[: pages * width], width))
        else:
            bodies = self._bodies
            raw = b"".join(_chain(
                [bodies[i : i + width] for i in range(0, pages * width, width)],
                self._seed or None,
            ))
        return np.frombuffer(raw, dtype=np.uint8).reshape(-1, 32)


class PendingArrayPages:
    """The hashes of a prompt's first ``pages`` pages (not EAGLE), straight from the caller's
    integer array ``ids``: the native job (``_chain_c``) narrows, packs and chains them on
    the coordinator's worker thread, reading the array itself, so the loop never touches the
    ids. Only for a lookup whose caller waits for it (the array's owner must not write to it
    meanwhile; a job whose caller stopped waiting has its result dropped). ``hash_here``
    gives the same hashes on the caller's thread: when no worker ran the job, or when an id
    of the array does not fit 32 bits (wide or refused: the Python path sorts that out)."""

    __slots__ = ("_hash_here", "_ids", "_page_size", "_seed", "pages")

    def __init__(
        self,
        ids: npt.NDArray[Any],
        *,
        pages: int,
        page_size: int,
        seed: bytes | None,
        hash_here: Callable[[], npt.NDArray[np.uint8]],
    ) -> None:
        self._ids = ids
        self._page_size = page_size
        self._seed = seed or b""
        self._hash_here = hash_here
        self.pages = pages

    def job(self) -> object | None:
        """The chain as a native job, or None (no compiled extension, or an array it cannot
        read in place)."""
        if _C is None:
            return None
        job: object | None = _C.ids_pages_job(self._seed, self._ids, self._page_size, self.pages)
        return job

    def digests(self, job: object | None = None) -> npt.NDArray[np.uint8]:
        """The (pages, 32) digests: from ``job`` once the worker ran it, else hashed now."""
        if job is not None:
            raw: bytes | None = _C.ids_page_digests(job)
            if raw is not None:
                return np.frombuffer(raw, dtype=np.uint8).reshape(-1, 32)
        return self._hash_here()


def _narrow(token_ids: object) -> npt.NDArray[np.int64] | npt.NDArray[np.uint32]:
    """:func:`token_ids_q`, packed in one C pass when the ids are a list, a tuple or a 1-D
    integer array whose every id fits 32 bits (the usual prompt)."""
    packed = _packed(token_ids)
    if packed is not None:
        return np.frombuffer(packed, dtype=np.uint32)
    return token_ids_q(token_ids)


def _packed(token_ids: object) -> bytes | None:
    """The ids as little-endian uint32 from one C pass, when they are a list, a tuple or a
    1-D integer array whose every id fits 32 bits; else None (the Python path reads them)."""
    if _C is None or type(token_ids) not in (list, tuple, np.ndarray):  # (not subclasses:
        return None  # a masked array's buffer holds what its mask hides)
    packed: bytes | None = _C.narrow_ids(token_ids, MAX_TOKENS)
    return packed


def _from_array(arr: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidRequest(
            f"token_ids as an array must be 1-D of an integer dtype, not {arr.ndim}-D "
            f"{arr.dtype}",
            field="token_ids",
        )
    if arr.size > MAX_TOKENS:
        raise InvalidRequest(
            f"{arr.size:,} token ids are over the limit of {MAX_TOKENS:,} per call",
            field="token_ids",
        )
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and int(arr.max()) >> 63:
        i = int(np.argmax(arr >> np.uint64(63)))
        raise InvalidRequest(
            f"token id {int(arr[i])} at index {i} does not fit in int64 (SGLang's scheduler "
            "holds token ids in an array('q'))",
            field="token_ids",
        )
    if arr.dtype == np.uint32 or (arr.dtype.kind == "u" and arr.dtype.itemsize < 4):
        return arr.astype("<u4", copy=False)
    return arr.astype(np.int64, copy=False)


def _bad_id(ids: Sequence[Any]) -> InvalidRequest:
    for i, x in enumerate(ids):
        if not hasattr(x, "__index__"):
            return InvalidRequest(
                f"token id at index {i} is {type(x).__name__} {x!r:.40}, not an int",
                field="token_ids",
            )
        value = operator.index(x)
        if not -(1 << 63) <= value < 1 << 63:
            return InvalidRequest(
                f"token id {value} at index {i} does not fit in int64 (SGLang's scheduler "
                "holds token ids in an array('q'))",
                field="token_ids",
            )
    return InvalidRequest("token_ids are not all ints in int64", field="token_ids")


def page_hashes(
    token_ids: object,
    *,
    page_size: int,
    eagle: bool,
    wide: bool,
    seed: bytes | None,
) -> list[bytes]:
    """One 32-byte digest per full page of ``token_ids`` (bigram pages under ``eagle``);
    ``wide``: ids above 2**32 - 1 make wide pages (0.5.23), else they are refused, as negative
    ids in a hashed page always are. Ids after the last full page are not read."""
    tokens = _narrow(token_ids)
    n = tokens.size
    pages = (max(n - 1, 0) if eagle else n) // page_size
    if not pages:
        return []
    units = pages * page_size
    read = tokens[: units + 1] if eagle else tokens[:units]
    wide_pages: npt.NDArray[np.bool_] | None = None
    if read.dtype != np.uint32:  # (ids that may be negative or wide)
        if int(read.min()) < 0:
            at = int(np.argmax(read < 0))
            raise InvalidRequest(
                f"token id {int(read[at])} at index {at} is negative (SGLang refuses it in a "
                "hashed page)",
                field="token_ids",
            )
        big = read > _U32_MAX
        if big.any():
            if not wide:
                at = int(np.argmax(big))
                raise InvalidRequest(
                    f"token id {int(read[at])} at index {at} does not fit in uint32: this "
                    "SGLang release refuses it (0.5.23 hashes such pages as wide pages)",
                    field="token_ids",
                )
            wide_pages = np.logical_or.reduce(big[:units].reshape(pages, page_size), axis=1)
            if eagle:  # (a bigram page also reads the next page's first token)
                wide_pages = wide_pages | big[page_size : units + 1 : page_size]
    ids: npt.NDArray[Any]
    if eagle:
        ids = np.empty((units, 2), dtype=read.dtype)
        ids[:, 0] = read[:units]
        ids[:, 1] = read[1 : units + 1]
    else:
        ids = read
    if wide_pages is None and _C is not None:  # (every page narrow: one buffer, one C loop)
        rows = np.ascontiguousarray(ids.astype("<u4", copy=False))
        digests: list[bytes] = _C.pages(seed or b"", rows, rows.size // pages * 4)
        return digests
    narrow = _page_bodies(ids.astype("<u4", copy=False), pages, 4)
    if wide_pages is None:
        return _chain(narrow, seed)
    wide_bodies = _page_bodies(ids.astype("<u8"), pages, 8)
    bodies = [
        _WIDE_TAG + w if is_wide else b
        for b, w, is_wide in zip(narrow, wide_bodies, wide_pages.tolist())
    ]
    return _chain(bodies, seed)


def _page_bodies(ids: npt.NDArray[Any], pages: int, itemsize: int) -> list[bytes]:
    """Each page's ids as one ``bytes`` (one C call: a void-typed view's ``tolist``)."""
    rows = np.ascontiguousarray(ids).reshape(pages, -1)
    bodies: list[bytes] = rows.view(f"V{rows.shape[1] * itemsize}").ravel().tolist()
    return bodies


def _chain(bodies: list[bytes], seed: bytes | None) -> list[bytes]:
    """The digests of the chain over the page bodies: one C loop, or one hashlib call per
    page."""
    if _C is not None:
        digests: list[bytes] = _C.page_list(seed or b"", bodies)
        return digests
    sha256 = _SMALL_SHA256 if len(bodies[0]) <= _SMALL_BODY else hashlib.sha256
    digest = seed or b""
    out: list[bytes] = []
    append = out.append
    for body in bodies:
        digest = sha256(digest + body).digest()
        append(digest)
    return out
