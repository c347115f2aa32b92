"""SGLang HiCache deployments on Mooncake (:class:`SGLangLayout`): what an L3 lookup needs to
know of one, validated once (docs/sglang.md).

The three SGLang releases whose keys and hits are reproduced stand for one key-format family
each: 0.5.17 (model-name prefix, no namespace seed), 0.5.20 (the seed from ``extra_key`` and
``cache_salt``) and 0.5.23 (wide pages for ids >= 2**32). What they cannot reproduce exactly
is refused: other releases, hybrid pools, decode context parallelism.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from .._checks import integer, positive_int
from .._errors import InvalidRequest
from .._plan.hashes import HashInput
from .._plan.sglang import (
    SGLangPlan,
    build_sglang_plan,
    declined,
    pending_sglang_plan,
    query_pages,
)
from .._public import present_as_public
from .sglang_geometry import SGLangGeometry, key_parts

__all__ = ["SGLANG_VERSIONS", "SGLangLayout"]

SGLANG_VERSIONS = ("0.5.17", "0.5.20", "0.5.23")
"""The SGLang releases whose HiCache keys and L3 hit are reproduced (one per key format)."""

_FIELDS = (
    "sglang_version", "page_size", "model_name", "tp_size", "pp_size", "mla", "tp_lcm_size",
    "hicache_mem_layout", "extra_backend_tag", "eagle", "prefetch_threshold", "dcp_size",
    "hybrid_pools",
)
_DEFAULT_THRESHOLD = 256
"""SGLang's default ``prefetch_threshold``."""


_OFF_LOOP_PAGES = 16
"""From this many probed pages, :meth:`SGLangLayout.plan_tokens` leaves the page hashing to
the plan's preparation, on the coordinator's worker thread (docs/design.md, "Preparing plans
off the loop": below it the chain is short, and the trip costs the loop about as much)."""


class SGLangLayout:
    """An SGLang deployment with HiCache's Mooncake backend, as its L3 lookup sees it.

    Build it from the deployment's flags (docs/sglang.md maps each one)::

        layout = SGLangLayout(sglang_version="0.5.23", page_size=64,
                              model_name="Qwen/Qwen3-8B", tp_size=2)

    or from the dict of :meth:`from_dict`. Then per request
    ``layout.plan(len(token_ids), layout.page_hashes(token_ids))`` gives the keys every
    querying rank probes, and ``plan.resolve(answers)`` SGLang's L3 hit in tokens; a
    :class:`~aio_mclookup.LookupCoordinator` takes the layout with ``layout=``.
    """

    engine = "sglang"

    def __init__(
        self,
        *,
        sglang_version: str,
        page_size: int,
        model_name: str | None = None,
        tp_size: int = 1,
        pp_size: int = 1,
        mla: bool = False,
        tp_lcm_size: int | None = None,
        hicache_mem_layout: str = "layer_first",
        extra_backend_tag: str | None = None,
        eagle: bool = False,
        prefetch_threshold: int = _DEFAULT_THRESHOLD,
        dcp_size: int = 1,
        hybrid_pools: Sequence[str] = (),
    ) -> None:
        if not isinstance(sglang_version, str) or sglang_version not in SGLANG_VERSIONS:
            raise InvalidRequest(
                f"sglang_version={sglang_version!r} is not supported: the HiCache keys and hit "
                f"are known for SGLang {', '.join(SGLANG_VERSIONS)} (one per key format); "
                "other releases are not guessed",
                field="sglang_version",
            )
        self.sglang_version = sglang_version
        self.page_size = positive_int("page_size", page_size)
        self.model_name = _optional_str("model_name", model_name)
        self.tp_size = positive_int("tp_size", tp_size)
        self.pp_size = positive_int("pp_size", pp_size)
        self.mla = _flag("mla", mla)
        self.eagle = _flag("eagle", eagle)
        self.extra_backend_tag = _optional_str("extra_backend_tag", extra_backend_tag)
        if not isinstance(hicache_mem_layout, str) or not hicache_mem_layout:
            raise InvalidRequest(
                f"hicache_mem_layout must be a non-empty str (--hicache-mem-layout), got "
                f"{hicache_mem_layout!r}",
                field="hicache_mem_layout",
            )
        self.hicache_mem_layout = hicache_mem_layout
        if tp_lcm_size is not None:
            tp_lcm_size = integer("tp_lcm_size", tp_lcm_size)
            if tp_lcm_size and tp_lcm_size % self.tp_size:  # (0 counts as unset, as in SGLang)
                raise InvalidRequest(
                    f"tp_lcm_size={tp_lcm_size} is not a multiple of tp_size={self.tp_size}: "
                    "SGLang stops with an assertion (tp_lcm_size must be divisible by tp_size)",
                    field="tp_lcm_size",
                )
        self.tp_lcm_size = tp_lcm_size
        if isinstance(prefetch_threshold, bool) or not isinstance(prefetch_threshold, int):
            raise InvalidRequest(
                f"prefetch_threshold must be an int (SGLang refuses anything else), got "
                f"{prefetch_threshold!r}",
                field="prefetch_threshold",
            )
        self.prefetch_threshold = prefetch_threshold
        self.dcp_size = positive_int("dcp_size", dcp_size)
        if self.dcp_size > 1:
            raise InvalidRequest(
                f"dcp_size={self.dcp_size}: decode context parallelism adds its own key prefix "
                "and suffixes, which are not reproduced",
                field="dcp_size",
            )
        if isinstance(hybrid_pools, (str, bytes)) or not isinstance(hybrid_pools, Sequence):
            raise InvalidRequest(
                f"hybrid_pools must be a list of pool names, got {hybrid_pools!r}",
                field="hybrid_pools",
            )
        if hybrid_pools:
            raise InvalidRequest(
                f"hybrid_pools={list(hybrid_pools)!r}: hybrid models (SWA, Mamba, the DSA "
                "indexer, DeepSeek-V4 side pools) probe several objects per page with per-pool "
                "hit rules (batch_exists_v2), which are not reproduced",
                field="hybrid_pools",
            )
        self.hybrid_pools: tuple[str, ...] = ()
        prefix, suffixes, slots = key_parts(
            model_name=self.model_name,
            extra_backend_tag=self.extra_backend_tag,
            tp_size=self.tp_size,
            pp_size=self.pp_size,
            mla=self.mla,
            heads_split=self.heads_split,
        )
        self._geometry = SGLangGeometry(
            page_size=self.page_size,
            eagle=self.eagle,
            prefetch_threshold=prefetch_threshold,
            key_prefix=prefix,
            key_suffixes=suffixes,
            slots=slots,
        )

    # ------------------------------------------------------------------------ derived
    @property
    def heads_split(self) -> int:
        """Virtual ranks per TP rank: ``tp_lcm_size / tp_size`` when SGLang splits heads (MHA,
        ``page_head`` host layout, ``tp_lcm_size > tp_size``), else 1."""
        lcm = self.tp_lcm_size
        if lcm is None or self.mla or self.hicache_mem_layout != "page_head" or lcm <= self.tp_size:
            return 1
        return lcm // self.tp_size

    @property
    def key_prefix(self) -> str:
        """What every key starts with, up to the page hash: ``[tag_][model_]``."""
        return self._geometry.key_prefix.decode()

    @property
    def key_suffixes(self) -> tuple[str, ...]:
        """What follows the page hash in each of a page's keys, in key order."""
        return tuple(s.decode() for s in self._geometry.key_suffixes)

    @property
    def keys_per_page(self) -> int:
        """Distinct keys the querying ranks probe per page (MHA ``2 * tp * pp * split``, MLA
        ``pp``)."""
        return self._geometry.keys_per_page

    @property
    def rank_slots(self) -> tuple[tuple[tuple[int, int], tuple[int, ...]], ...]:
        """Per querying rank ``(tp_rank, pp_rank)``, in (pp, tp) order, the positions of its
        keys among a page's :attr:`key_suffixes` (MLA: every TP rank of a stage probes the
        stage's one key). What one rank's own ``batch_exists`` sends, page by page."""
        split = 1 if self.mla else self.heads_split
        out = []
        for pp in range(self.pp_size):
            for tp in range(self.tp_size):
                mine = tuple(
                    j
                    for j, (rank, _, _, stage) in enumerate(self._geometry.namespaces)
                    if stage == pp and (self.mla or rank // split == tp)
                )
                out.append(((tp, pp), mine))
        return tuple(out)

    def query_pages(self, num_tokens: int) -> int:
        """Pages probed for a request of ``num_tokens`` tokens with no local match (before the
        threshold): its first ``num_tokens - 1`` tokens (EAGLE: bigrams) in whole pages."""
        return query_pages(integer("num_tokens", num_tokens), self.page_size, self.eagle)

    # ------------------------------------------------------------------------ requests
    def page_hashes(
        self, token_ids: object, extra_key: str | None = None, cache_salt: str | None = None
    ) -> list[bytes]:
        """SGLang's page hashes of a prompt: one 32-byte SHA-256 digest per full page (bigram
        pages under EAGLE), chained from the namespace seed of ``extra_key`` (the request's
        ``extra_key`` with its LoRA id appended) and ``cache_salt`` on 0.5.20+ (0.5.17
        ignores both). ``token_ids``: a list of ints or a 1-D integer numpy array."""
        return _hashing().page_hashes(  # type: ignore[no-any-return]
            token_ids,
            page_size=self.page_size,
            eagle=self.eagle,
            wide=self.sglang_version == "0.5.23",
            seed=self._chain_seed(extra_key, cache_salt),
        )

    def _chain_seed(self, extra_key: object, cache_salt: object) -> bytes | None:
        """The seed page 0 is chained from: the namespace's on 0.5.20+ (checked on every
        release; 0.5.17 ignores it). No namespace (the usual request) has no seed."""
        if extra_key is None and cache_salt is None:
            return None
        seed = _hashing().namespace_seed(extra_key, cache_salt)
        return None if self.sglang_version == "0.5.17" else seed

    def plan(self, num_tokens: int, page_hashes: HashInput) -> SGLangPlan:
        """Plan one lookup of a request of ``num_tokens`` tokens with no local match: the
        keys of its probed pages on every querying rank (none when ``prefetch_threshold``
        declines the query). ``page_hashes``: :meth:`page_hashes` of the prompt (a sequence
        of 32-byte digests, or a (n, 32) uint8 array). For prompt logprobs from position
        ``L`` pass ``L + 1``."""
        return build_sglang_plan(self._geometry, num_tokens, page_hashes)

    def plan_tokens(
        self,
        token_ids: object,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        *,
        in_place: bool = False,
    ) -> SGLangPlan:
        """:meth:`plan` of a prompt from its token ids, the same plan as ``plan(len(token_ids),
        page_hashes(token_ids, extra_key, cache_salt))``; where every id fits 32 bits (the
        usual prompt) and the prompt has :data:`_OFF_LOOP_PAGES` probed pages or more, its
        pages are hashed when it is prepared: :meth:`LookupCoordinator.lookup_tokens` does
        that on its worker thread, off the event loop.

        ``in_place``: a 1-D numpy array of 4- or 8-byte integers is not copied now; its ids are
        read where they are when the plan is prepared (on that thread), so the array must not
        be written to until then. ``lookup_tokens`` plans this way: its caller waits."""
        hashing = _hashing()
        seed = self._chain_seed(extra_key, cache_salt)
        geometry = self._geometry
        if in_place and not self.eagle and _readable_in_place(token_ids, hashing.MAX_TOKENS):
            assert isinstance(token_ids, np.ndarray)
            n = token_ids.shape[0]
            pages = query_pages(n, self.page_size, False)
            if pages >= _OFF_LOOP_PAGES and not declined(geometry, pages):  # (else as below:
                # the ids are read now, and a bad one is refused even when no page is probed)

                def hash_here() -> npt.NDArray[np.uint8]:  # (the copying way's, read now)
                    rows = self.plan_tokens(token_ids, extra_key, cache_salt).groups[0].hash_rows
                    assert rows is not None
                    return rows

                chain = hashing.PendingArrayPages(
                    token_ids, pages=pages, page_size=self.page_size, seed=seed,
                    hash_here=hash_here,
                )
                return pending_sglang_plan(geometry, n, chain)
        narrow = hashing.narrow_token_ids(token_ids)
        if narrow is None:  # (ids of wide pages, or refused: page_hashes hashes or names them)
            hashes = self.page_hashes(token_ids, extra_key, cache_salt)
            return self.plan(len(token_ids), hashes)  # type: ignore[arg-type]
        packed, n = narrow
        pages = query_pages(n, self.page_size, self.eagle)
        if declined(geometry, pages):
            return build_sglang_plan(geometry, n, ())
        chain = hashing.PendingPages(
            packed,
            pages=pages,
            page_size=self.page_size,
            eagle=self.eagle,
            seed=seed,
        )
        plan = pending_sglang_plan(geometry, n, chain)
        if pages < _OFF_LOOP_PAGES:
            plan.prepare()
        return plan

    # ------------------------------------------------------------------------ dict form
    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> SGLangLayout:
        """A layout from its JSON-friendly form (the conformance cases' ``layout``): the
        keyword arguments of the constructor, and optionally ``"engine": "sglang"``. Unknown
        keys raise :class:`InvalidRequest`."""
        if not isinstance(cfg, Mapping):
            raise InvalidRequest(f"layout must be a mapping, got {type(cfg).__name__}")
        engine = cfg.get("engine", "sglang")
        if engine != "sglang":
            raise InvalidRequest(
                f"engine={engine!r}: an SGLangLayout describes an SGLang deployment",
                field="engine",
            )
        unknown = set(cfg) - set(_FIELDS) - {"engine"}
        if unknown:
            raise InvalidRequest(
                f"unknown SGLang layout field(s): {', '.join(sorted(map(str, unknown)))}"
            )
        for required in ("sglang_version", "page_size"):
            if required not in cfg:
                raise InvalidRequest(f"layout field {required!r} is required", field=required)
        return cls(**{k: v for k, v in cfg.items() if k != "engine"})

    def to_dict(self) -> dict[str, Any]:
        """The JSON-friendly form; ``SGLangLayout.from_dict(layout.to_dict())`` is equal."""
        out: dict[str, Any] = {"engine": "sglang"}
        for name in _FIELDS:
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SGLangLayout) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(repr(self.to_dict()))

    def __repr__(self) -> str:
        return (
            f"SGLangLayout(sglang_version={self.sglang_version!r}, page_size={self.page_size}, "
            f"model_name={self.model_name!r}, tp_size={self.tp_size}, pp_size={self.pp_size}, "
            f"mla={self.mla}, keys_per_page={self.keys_per_page})"
        )


@functools.cache
def _hashing() -> ModuleType:
    """SGLang's page hashing (``_hashing.sglang``), imported on first use: the ``_hashing``
    package brings vLLM's hasher and cbor2, which ``import aio_mclookup`` leaves out until
    they are needed. (Once imported, a call here costs far less than an import statement,
    which goes through importlib's Python code on every run.)"""
    from .._hashing import sglang

    return sglang


def _readable_in_place(token_ids: object, limit: int) -> bool:
    """A numpy array (not a subclass) the worker's job can read in place: 1-D, C-contiguous,
    of 4- or 8-byte integers in the machine's byte order, at most ``limit`` of them."""
    if type(token_ids) is not np.ndarray:
        return False
    dtype = token_ids.dtype
    return (
        token_ids.ndim == 1
        and dtype.kind in "iu"
        and dtype.itemsize in (4, 8)
        and dtype.isnative
        and token_ids.flags.c_contiguous
        and token_ids.shape[0] <= limit
    )


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a bool, got {value!r}", field=name)
    return value


def _optional_str(name: str, value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a str or null, got {value!r}", field=name)
    return value


present_as_public(SGLangLayout)
