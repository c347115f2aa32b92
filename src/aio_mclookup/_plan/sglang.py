"""Planning an SGLang HiCache lookup (:class:`SGLangPlan`): the probed pages, their keys in
every querying rank, and the L3 hit from the answers.

The plan is a :class:`~.plan.LookupPlan` of one full-attention group (see
:mod:`.._layout.sglang_geometry`): the coordinator probes it in rounds as a prefix, pages in
order, a page's keys in every rank as one item, and settles at the first page any rank misses.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .._arrays import BoolArray, IntArray, KeyIndices
from .._checks import integer
from .._errors import InvalidRequest
from .._layout.sglang_geometry import SGLangGeometry
from .._resolve.result import LookupResult
from .._resolve.sglang import l3_hit, present_pages, present_pages_of
from .hashes import RequestHashes
from .keys import COMPILED, ITEM_END, hex_join, hex_keys, ints
from .plan import LookupPlan
from .probe import GroupProbe

__all__ = [
    "PageChain", "SGLangPlan", "build_sglang_plan", "declined", "pending_sglang_plan",
    "query_pages",
]

_FEW_KEYS = 48
"""Fewer keys than this are built by concatenation: faster than the array path."""


_QUICK_PAGES = 512
"""Up to this many pages (a chain of about 190 us) a plan hashes inline when the coordinator
has nothing else under way (docs/design.md, "Preparing plans off the loop")."""


def query_pages(num_tokens: int, page_size: int, eagle: bool) -> int:
    """Pages SGLang's scheduler offers storage for an ``num_tokens``-token request with no
    local match: the span is capped at ``num_tokens - 1`` tokens (one bigram fewer under
    EAGLE), cut down to whole pages."""
    cap = max(num_tokens - 1, 0)
    units = max(cap - 1, 0) if eagle else cap
    return units // page_size


class PageChain(Protocol):
    """The page hashes of a plan's probed pages, not computed yet (``_hashing.sglang``'s
    :class:`PendingPages`)."""

    pages: int

    def job(self) -> object | None:
        """The chain as a native job for the coordinator's worker thread, or None."""

    def digests(self, job: object | None = None) -> npt.NDArray[np.uint8]:
        """The (pages, 32) digests: from the native job that ran, or computed now."""


class SGLangPlan(LookupPlan):
    """The keys one SGLang L3 lookup probes (page-major, then rank slot: ``plan.keys`` as
    UTF-8 ``bytes``) and :meth:`resolve`, SGLang's hit in tokens from the answers.

    ``token_len`` and ``num_tokens`` are the request's length; ``pages`` the pages probed
    (0 when the prefetch threshold declines the query: then there are no keys, and the hit
    is 0). A plan made from token ids may have its page hashes still to compute (see
    :func:`pending_sglang_plan`).
    """

    __slots__ = ("_chain", "_sglang", "num_tokens", "pages")  # (_chain: a pending plan's)

    def __init__(
        self,
        geometry: SGLangGeometry,
        num_tokens: int,
        groups: tuple[GroupProbe, ...],
        pages: int,
    ) -> None:
        super().__init__(geometry, num_tokens, groups, pages * geometry.keys_per_page, False)
        self._sglang = geometry
        self.num_tokens = num_tokens
        self.pages = pages

    # ------------------------------------------------------------------------- structure
    @property
    def single_full_attention(self) -> bool:
        """Probed as a prefix of pages (whenever there is a page to probe)."""
        return len(self._groups) == 1

    @property
    def probe_in_one_round(self) -> bool:
        """Never needed: pages are probed in order, and a repeated page hash (the same keys)
        just gets the same answer again."""
        return False

    @property
    def short(self) -> bool:
        """Never: a plan has every hash its pages need, or planning refused it."""
        return False

    def __repr__(self) -> str:
        return (
            f"<LookupPlan sglang num_tokens={self.num_tokens} pages={self.pages} "
            f"keys={self.num_keys}>"
        )

    # ------------------------------------------------------------------------------- keys
    @property
    def keys(self) -> list[bytes]:
        """Every key, page by page, each page's slots in order (a shared list: do not
        mutate)."""
        if self._keys is None:
            array = self.key_array()
            if array is not None:
                keys: list[bytes] = array.tolist()
            else:
                keys = self._concatenate(range(self.pages)) if self.pages else []
            self._keys = keys
        return self._keys

    def key_array(self) -> npt.NDArray[np.bytes_] | None:
        """Every key in one fixed-width ``bytes`` array (None: slots of different widths)."""
        if not self._key_array_tried:
            self._key_array_tried = True
            if self.num_keys:
                self._key_array = self._key_rows(range(self.pages))
        return self._key_array

    def _key_rows(self, pages: range | IntArray) -> npt.NDArray[np.bytes_] | None:
        """The keys of some pages as one fixed-width array, or None (slots differ in width)."""
        geo = self._sglang
        suffixes = geo.suffix_rows
        if suffixes is None:
            return None
        probe = self._groups[0]
        if isinstance(pages, range):
            encoded = probe.hex_if_encoded
            hexed = (
                encoded[pages.start : pages.stop] if encoded is not None
                else probe.hex_at(np.arange(pages.start, pages.stop))
            )
        else:
            hexed = probe.hex_at(pages)
        plen, hlen = geo.prefix_row.size, hexed.shape[1]
        k, slen = suffixes.shape
        width = plen + hlen + slen
        buf = np.empty((hexed.shape[0], k, width), dtype=np.uint8)
        buf[..., :plen] = geo.prefix_row
        buf[..., plen : plen + hlen] = hexed[:, None, :]
        buf[..., plen + hlen :] = suffixes
        array: npt.NDArray[np.bytes_] = buf.reshape(-1, width).view(f"S{width}").ravel()
        return array  # (keys end in "k" or "v": no trailing NUL is lost)

    def _concatenate(self, pages: range | list[int]) -> list[bytes]:
        """The keys of some pages by bytes concatenation."""
        geo = self._sglang
        rows = self._groups[0].hash_rows
        assert rows is not None
        prefix, suffixes = geo.key_prefix, geo.key_suffixes
        out: list[bytes] = []
        for page in pages:
            head = prefix + rows[page].tobytes().hex().encode()
            out += [head + suffix for suffix in suffixes]
        return out

    def _keys_at(self, indices: KeyIndices) -> list[bytes]:
        """The keys at ascending key indices (building only the pages they are on)."""
        if self._keys is not None or self._key_array is not None or not self.num_keys:
            return super()._keys_at(indices)  # (slices of what is built)
        k = self._sglang.keys_per_page
        if isinstance(indices, range):
            if not len(indices):
                return []
            first, last = indices.start // k, (indices.stop - 1) // k + 1
            keys = self._page_keys(range(first, last))
            return keys[indices.start - first * k : indices.stop - first * k]
        pages = np.unique(indices // k)
        keys = self._page_keys(pages)
        where = np.searchsorted(pages, indices // k) * k + indices % k
        return [keys[i] for i in where.tolist()]

    def _page_keys(self, pages: range | IntArray) -> list[bytes]:
        """Every key of some pages, page by page."""
        if not len(pages):
            return []
        if COMPILED:
            geo = self._sglang
            rows = self._groups[0].hash_rows
            assert rows is not None
            k = geo.keys_per_page
            if isinstance(pages, range):
                index: range | list[int] = range(pages.start * k, pages.stop * k)
            else:
                index = (pages[:, None] * k + np.arange(k)).ravel().tolist()
            return hex_keys(rows, index, geo.key_heads, geo.key_tails[0])
        if len(pages) * self._sglang.keys_per_page >= _FEW_KEYS:
            array = self._key_rows(pages)
            if array is not None:
                keys: list[bytes] = array.tolist()
                return keys
        return self._concatenate(ints(pages))

    @property
    def _chunk_keys(self) -> int:
        """A page's keys in every slot are one coordinator item (several slots, and no key
        holds :data:`ITEM_END`), else 1."""
        return self._sglang.item_keys

    def _items_at(self, indices: KeyIndices) -> list[bytes]:
        """One item per page that ascending key indices cover whole: the page's keys, each
        followed by :data:`ITEM_END`."""
        geo = self._sglang
        k = geo.keys_per_page
        if isinstance(indices, range):
            pages: range | IntArray = range(indices.start // k, indices.stop // k)
        else:
            pages = indices[::k] // k
        if not len(pages):
            return []
        if COMPILED or len(pages) * k < _FEW_KEYS:  # (the usual round: a page or a few)
            rows = self._groups[0].hash_rows
            assert rows is not None
            return hex_join(rows, ints(pages), geo.item_joiners[0])
        keys = self._page_keys(pages)
        if not keys:
            return []
        width = len(keys[0])
        if len(keys) >= _FEW_KEYS and all(len(key) == width for key in keys[:k]):
            rows = np.frombuffer(b"".join(keys), dtype=np.uint8)
            if rows.size == len(keys) * width:  # (one width throughout)
                buf = np.empty((len(keys), width + 1), dtype=np.uint8)
                buf[:, :width] = rows.reshape(len(keys), width)
                buf[:, width] = ITEM_END[0]
                items: list[bytes] = (
                    buf.reshape(-1, k * (width + 1)).view(f"S{k * (width + 1)}").ravel().tolist()
                )
                return items
        tail = ITEM_END
        return [
            b"".join([key + tail for key in keys[start : start + k]])
            for start in range(0, len(keys), k)
        ]

    # ---------------------------------------------------------------------------- resolve
    def prefix_hit(self, chunks: int) -> int:
        """The hit when the first ``chunks`` pages are present on every rank (and the next,
        if any, is missing on some)."""
        geo = self._sglang
        return l3_hit(chunks, geo.page_size, geo.prefetch_threshold)

    def resolve(self, exists: Sequence[int] | npt.NDArray[Any]) -> int:
        """SGLang's L3 hit in tokens from the store's answers (``plan.keys`` order): only
        ``1`` means present (``0`` absent, ``-1`` a Mooncake error)."""
        if not self.num_keys:
            return 0
        k = self._sglang.keys_per_page
        return self.prefix_hit(present_pages_of(exists, self.num_keys, k))

    def resolve_result(self, exists: Sequence[int] | npt.NDArray[Any] | None) -> LookupResult:
        """:meth:`resolve` as a :class:`LookupResult` (``None``: the existence call failed,
        which loads nothing: 0)."""
        return LookupResult(0 if exists is None else self.resolve(exists))

    def _resolve_present(self, present: BoolArray) -> int:
        if not self.num_keys:
            return 0
        return self.prefix_hit(present_pages(present, self._sglang.keys_per_page))


class _PendingSGLangPlan(SGLangPlan):
    """An :class:`SGLangPlan` whose page hashes are still to compute (``chain``):
    :meth:`prepare` (the coordinator's worker thread) computes them before it is probed, and
    whatever reads its groups first (its keys, its answer) prepares it, the same plan either
    way. Prepared, it is a plain :class:`SGLangPlan` (a class with ``__getattr__`` makes
    every attribute read slower)."""

    __slots__ = ()

    def __init__(self, geometry: SGLangGeometry, num_tokens: int, chain: PageChain) -> None:
        super().__init__(geometry, num_tokens, (), chain.pages)
        self._chain = chain
        del self._groups  # (until prepared: see __getattr__)

    def __getattr__(self, name: str) -> Any:
        if name == "_groups":
            self.prepare()
            return self._groups
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def needs_preparing(self) -> bool:
        return True

    @property
    def quick_to_prepare(self) -> bool:
        return self.pages <= _QUICK_PAGES

    def native_job(self) -> object | None:
        """The page chain as a native job (``_chain_c``), or None."""
        return self._chain.job()

    def prepare(self, job: object | None = None) -> None:
        """Compute the page hashes (or take them from the ``job`` the worker ran)."""
        self._groups = (_page_probe(self._chain.digests(job), self.pages),)
        del self._chain  # (its packed ids: no longer needed)
        object.__setattr__(self, "__class__", SGLangPlan)  # (prepared: a plain plan)


def build_sglang_plan(
    geometry: SGLangGeometry, num_tokens: object, page_hashes: object
) -> SGLangPlan:
    """Validate one request and build its :class:`SGLangPlan` (see :meth:`SGLangLayout.plan`)."""
    n = integer("num_tokens", num_tokens)
    if n < 0:
        raise InvalidRequest(f"num_tokens must be >= 0, got {n}", field="num_tokens")
    hashes = RequestHashes(page_hashes)
    page = geometry.page_size
    pages = query_pages(n, page, geometry.eagle)
    if declined(geometry, pages):  # no query: the hit is 0
        return SGLangPlan(geometry, n, (), 0)
    if hashes.count < pages:
        raise InvalidRequest(
            f"page_hashes has {hashes.count} hashes; a request of {n} tokens probes {pages} "
            f"pages (page_size={page}{', EAGLE bigrams' if geometry.eagle else ''}): pass "
            "layout.page_hashes(token_ids) for the whole prompt",
            field="page_hashes",
        )
    rows, _ = hashes.gather(slice(0, pages, 1))
    if rows is None or rows.shape[1] != 32:
        raise InvalidRequest(
            "page_hashes must be 32-byte SHA-256 digests (layout.page_hashes gives them)",
            field="page_hashes",
        )
    return SGLangPlan(geometry, n, (_page_probe(rows, pages),), pages)


def pending_sglang_plan(geometry: SGLangGeometry, num_tokens: int, chain: PageChain) -> SGLangPlan:
    """The plan of a request of ``num_tokens`` tokens whose ``chain.pages`` probed pages (not
    :func:`declined`) are hashed when it is prepared."""
    return _PendingSGLangPlan(geometry, num_tokens, chain)


def declined(geometry: SGLangGeometry, pages: int) -> bool:
    """Whether SGLang queries no page of a request that would probe ``pages``: none, or
    fewer tokens than the prefetch threshold."""
    return not pages or pages * geometry.page_size < geometry.prefetch_threshold


def _page_probe(rows: npt.NDArray[np.uint8], pages: int) -> GroupProbe:
    """The one group of an SGLang plan: its pages' hashes, ``rows`` (pages, 32)."""
    return GroupProbe(
        group_id=0,
        chunks=_pages_of(pages),
        limit=pages,
        key_offset=0,
        hex_items=[],
        hash_rows=rows,
        unprobed_ids=None,
    )


@functools.lru_cache(maxsize=1024)
def _pages_of(pages: int) -> IntArray:
    """``0 .. pages - 1``, read-only, made once per count: a fresh ``np.arange`` per lookup
    cost the event loop more than it looks (docs/design.md, "Preparing plans off the loop")."""
    chunks = np.arange(pages, dtype=np.int64)
    chunks.flags.writeable = False
    return chunks
