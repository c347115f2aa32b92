"""BlockHasher: token ids -> the block hashes vLLM stores as ``request.block_hashes``."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from .. import _native
from .._errors import InvalidRequest
from .._public import present_as_public
from . import _inputs, _payload
from ._algos import Algo, get_algo
from ._extras import ExtraInputs, block_extras
from ._release import Era, check_seed, parse_release

__all__ = ["BlockHasher"]

DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"  # vLLM >= 0.29 with PYTHONHASHSEED unset
_CHUNK_TOKENS: Final = 1 << 16  # payloads are built this many tokens at a time
_TOKEN_LIMIT: Final = 1 << 63
_MAX_STATES: Final = 1 << 12  # hash states kept per hasher (one per pickle body length)

MmFeature = tuple[str, int, int]

_C: Any = _native.load("aio_mclookup._hashing._chain_c")
"""The compiled chain (``_chain_c.c``: SHA-256 only), or ``None``: the Python loops below."""


class BlockHasher:
    """vLLM's block hashes for one deployment's configuration.

    ``hash_block_size`` is the engines' ``kv_cache_config.hash_block_size``; ``algo`` their
    ``--prefix-caching-hash-algo``; ``seed`` their ``PYTHONHASHSEED`` text (``None`` = unset);
    ``vllm_version`` their release (0.26.0 to 0.33.x). Configurations whose hashes cannot be
    reproduced (an unset seed before 0.29 or with xxhash) raise :class:`InvalidRequest`.
    """

    __slots__ = ("_algo", "_block_size", "_cbor_state", "_layout", "_none_hash", "_release",
                 "_seed", "_states")

    def __init__(
        self,
        hash_block_size: int,
        *,
        algo: str = "sha256",
        seed: str | None = None,
        vllm_version: str = "0.33.0",
    ) -> None:
        self._block_size = _inputs.block_size(hash_block_size)
        self._release = parse_release(vllm_version)
        self._algo: Algo = get_algo(algo)
        check_seed(seed, self._release, self._algo.name)
        self._seed = seed
        text = DEFAULT_NONE_HASH_SEED if seed is None else seed
        self._none_hash = self._algo.hash_object(text)
        # SHA-256 states that have taken a payload's head: copying one beats starting anew
        self._states: dict[int, Any] = {}  # pickle: by body length
        self._layout = _payload.plain_layout(self._block_size, self._algo.width, self._algo.cbor)
        self._cbor_state: Any = (
            hashlib.sha256(_payload.cbor_head(self._algo.width))
            if self._algo.sha256 and self._algo.cbor
            else None
        )

    # ------------------------------------------------------------------ configuration
    @property
    def algo(self) -> str:
        """The algorithm name (``sha256``, ``sha256_cbor``, ``xxhash``, ``xxhash_cbor``)."""
        return self._algo.name

    @property
    def block_size(self) -> int:
        """The hash block size: tokens per hash."""
        return self._block_size

    @property
    def vllm_version(self) -> str:
        """The vLLM release string as given."""
        return self._release.text

    @property
    def era(self) -> str:
        """The hashing era of the release: ``0.26-0.28``, ``0.29-0.30`` or ``0.31-0.33``."""
        return self._release.era.value

    @property
    def width(self) -> int:
        """Bytes per hash: 32 for sha256*, 16 for xxhash*."""
        return self._algo.width

    @property
    def seeded(self) -> bool:
        """Whether a ``PYTHONHASHSEED`` was given."""
        return self._seed is not None

    @property
    def none_hash(self) -> bytes:
        """vLLM's ``NONE_HASH``: the parent of the first block."""
        return self._none_hash

    def to_dict(self) -> dict[str, Any]:
        """The configuration, without the seed (with xxhash it is the engines' secret)."""
        return {
            "algo": self.algo,
            "hash_block_size": self._block_size,
            "vllm_version": self.vllm_version,
            "era": self.era,
            "width": self.width,
            "seeded": self.seeded,
        }

    def __repr__(self) -> str:
        seed = "<set>" if self.seeded else None
        return (
            f"BlockHasher({self._block_size}, algo={self.algo!r}, seed={seed}, "
            f"vllm_version={self.vllm_version!r})"
        )

    # ------------------------------------------------------------------ hashing
    def hash(
        self,
        token_ids: Sequence[int] | NDArray[np.integer[Any]],
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MmFeature] | None = None,
        prompt_embeds: NDArray[Any] | None = None,
        lookahead_tokens: int = 0,
        parent: bytes | NDArray[np.uint8] | None = None,
    ) -> NDArray[np.uint8]:
        """The hashes of every full block of ``token_ids``: an ``(n_blocks, width)`` uint8 array.

        ``parent`` continues a chain: ``token_ids`` then start at a block boundary right after
        the block whose hash ``parent`` is; ``mm_features`` offsets and ``prompt_embeds`` rows
        count from the first of these tokens, and ``cache_salt`` (block 0 only) has no effect.
        """
        if (
            lora_name is None
            and lora_path is None
            and cache_salt is None
            and mm_features is None
            and prompt_embeds is None
            and type(lookahead_tokens) is int
            and not lookahead_tokens
        ):
            fast = self._hash_plain(token_ids, parent)
            if fast is not None:
                return fast
        tokens, top = _inputs.token_array(token_ids)
        continuation = parent is not None
        start = (
            self._none_hash
            if parent is None
            else _inputs.parent_digest(parent, self._algo.width)
        )
        extra = self._extra_inputs(
            tokens.size,
            continuation,
            lora_name,
            lora_path,
            cache_salt,
            mm_features,
            prompt_embeds,
            lookahead_tokens,
        )
        h = self._block_size
        n_blocks = max(tokens.size - extra.lookahead, 0) // h
        digests: list[bytes] = []
        if extra.empty:
            self._chain_plain(tokens[: n_blocks * h], top, start, digests)
        else:
            slots = block_extras(
                self._release.era,
                extra,
                n_blocks,
                h,
                tokens.tolist() if extra.lookahead else None,
            )
            self._chain_slots(tokens[: n_blocks * h], slots, start, digests)
        return self._rows(digests)

    def _hash_plain(
        self, token_ids: object, parent: bytes | NDArray[np.uint8] | None
    ) -> NDArray[np.uint8] | None:
        """The hashes of a prompt without extra keys of up to one chunk, with as few calls as
        possible (a 4,096-token prompt's fixed costs count); ``None``: take the general path."""
        got = _inputs.plain_tokens(token_ids)
        compiled = _C is not None and self._algo.sha256
        if got is None or (got[0].size > _CHUNK_TOKENS and not compiled):
            return None
        tokens, checked = got
        h = self._block_size
        n_blocks = tokens.size // h
        if (
            not checked
            and tokens.size > n_blocks * h
            and int(tokens[n_blocks * h :].max()) >= _TOKEN_LIMIT
        ):
            return None  # a bad id past the last block: the general path names it
        if compiled:
            start = (
                self._none_hash
                if parent is None
                else _inputs.parent_digest(parent, self._algo.width)
            )
            if not tokens.flags.c_contiguous:
                tokens = np.ascontiguousarray(tokens)
            rows = _C.plain(tokens, h, self._algo.cbor, start)
            return None if rows is None else self._rows([rows])  # None: an id the C refused
        bodies: tuple[bytes, ...] = ()
        if n_blocks:
            built = _payload.plain(tokens, self._layout)
            if built is None:
                return None  # ids beyond the fast range: the general path handles or refuses them
            bodies = built
        start = (
            self._none_hash if parent is None else _inputs.parent_digest(parent, self._algo.width)
        )
        digests: list[bytes] = []
        self._chain(bodies, start, digests)
        return self._rows(digests)

    def _rows(self, digests: list[bytes] | list[bytearray]) -> NDArray[np.uint8]:
        """``digests`` (runs of whole hashes) as one writable ``(n_blocks, width)`` array."""
        run = digests[0] if len(digests) == 1 and type(digests[0]) is bytearray else None
        data = run if run is not None else bytearray(b"".join(digests))
        out: NDArray[np.uint8] = np.frombuffer(data, dtype=np.uint8)
        return out.reshape(-1, self.width)

    def _extra_inputs(
        self,
        n_tokens: int,
        continuation: bool,
        lora_name: object,
        lora_path: object,
        cache_salt: object,
        mm_features: object,
        prompt_embeds: object,
        lookahead_tokens: object,
    ) -> ExtraInputs:
        name = _inputs.optional_str(lora_name, "lora_name", allow_empty=False)
        path = _inputs.optional_str(lora_path, "lora_path", allow_empty=False)
        if path is not None and name is None:
            raise InvalidRequest("lora_path needs lora_name", field="lora_name")
        if name is not None and path is None and self._release.era is Era.V031:
            raise InvalidRequest(
                f"vLLM {self.vllm_version} hashes the LoRA path with its name: pass lora_path "
                "(the path the server loaded the adapter from, exactly)",
                field="lora_path",
            )
        return ExtraInputs(
            lora_name=name,
            lora_path=path,
            cache_salt=_inputs.optional_str(cache_salt, "cache_salt"),
            mm=tuple(_inputs.mm_items(mm_features, continuation)),
            embeds=_inputs.embeds(prompt_embeds, n_tokens, continuation),
            lookahead=_inputs.lookahead(
                lookahead_tokens, self._release.has_lookahead, self.vllm_version
            ),
            starts_at_zero=not continuation,
        )

    def _chain_plain(
        self, tokens: NDArray[np.uint64], top: int, parent: bytes, out: list[bytes]
    ) -> None:
        """Blocks without extra keys."""
        algo = self._algo
        none_slot = _none_slot(algo.width, algo.cbor)
        whole = tokens.size <= _CHUNK_TOKENS
        step = max(_CHUNK_TOKENS // self._block_size, 1) * self._block_size
        for lo in range(0, tokens.size, step):
            chunk = tokens[lo : lo + step]
            if top < (1 << 32 if algo.cbor else 1 << 31):
                bodies = _payload.plain(chunk, self._layout)
                if bodies is not None:
                    parent = self._chain(bodies, parent, out)
                    continue
            payloads = _payload.build(
                chunk, self._block_size, algo.width, algo.cbor, none_slot, top if whole else None
            )
            if payloads is None:
                parent = self._chain_generic(chunk, [None] * self._blocks(chunk), parent, out)
            else:
                parent = self._chain(payloads.bodies, parent, out)

    def _chain_slots(
        self, tokens: NDArray[np.uint64], slots: list[object], parent: bytes, out: list[bytes]
    ) -> None:
        """Blocks with their extra slots (one per block)."""
        algo = self._algo
        h = self._block_size
        encoded: dict[int, bytes] = {}  # id(slot) -> encoding; the slots outlive this call

        def encode(slot: object) -> bytes:
            key = id(slot)
            if key not in encoded:
                encoded[key] = _payload.extra_encoding(slot, algo.width, algo.cbor)
            return encoded[key]

        per_chunk = max(_CHUNK_TOKENS // h, 1)
        for first in range(0, len(slots), per_chunk):
            chunk_slots = slots[first : first + per_chunk]
            chunk = tokens[first * h : (first + len(chunk_slots)) * h]
            payloads = _payload.build(
                chunk, h, algo.width, algo.cbor, [encode(s) for s in chunk_slots]
            )
            if payloads is None:
                parent = self._chain_generic(chunk, chunk_slots, parent, out)
            else:
                parent = self._chain(payloads.bodies, parent, out)

    def _chain(self, bodies: Sequence[bytes], parent: bytes, out: list[bytes]) -> bytes:
        """Hash ``head + parent + body`` block after block (the head follows from the body's
        length); appends the hashes to ``out`` (one run of them if compiled) and returns the
        last."""
        if not bodies:
            return parent
        algo = self._algo
        if algo.sha256 and _C is not None:
            run: bytes = _C.bodies(parent, bodies, algo.cbor)
            out.append(run)
            return bytes(run[-algo.width :])
        append = out.append
        digest = parent
        if algo.sha256:
            if algo.cbor:
                copy = self._cbor_state.copy
                for body in bodies:
                    state = copy()
                    state.update(digest + body)  # one call: cheaper than two
                    digest = state.digest()
                    append(digest)
            else:
                for start, body in zip(self._pickle_states(bodies), bodies):
                    state = start.copy()
                    state.update(digest + body)
                    digest = state.digest()
                    append(digest)
            return digest
        heads: Iterable[bytes]
        if algo.cbor:
            heads = repeat(_payload.cbor_head(algo.width))
        else:
            heads = _payload.pickle_heads(algo.width, list(map(len, bodies)))
        fn = algo.digest
        for pair in zip(heads, bodies):
            digest = fn(digest.join(pair))
            append(digest)
        return digest

    def _pickle_states(self, bodies: Sequence[bytes]) -> list[Any]:
        """For each body, a SHA-256 state that has taken its pickle head (set by its length)."""
        states = self._states
        try:
            return list(map(states.__getitem__, map(len, bodies)))
        except KeyError:
            pass
        lengths = list(map(len, bodies))
        width = self._algo.width
        missing = set(lengths).difference(states)
        if len(states) + len(missing) > _MAX_STATES:  # unusual lengths (extra keys): not kept
            return [
                states[n] if n in states else hashlib.sha256(_payload.pickle_head(width, n))
                for n in lengths
            ]
        for n in missing:
            states[n] = hashlib.sha256(_payload.pickle_head(width, n))
        return list(map(states.__getitem__, lengths))

    def _blocks(self, tokens: NDArray[np.uint64]) -> int:
        return tokens.size // self._block_size

    def _chain_generic(
        self, tokens: NDArray[np.uint64], slots: list[object], parent: bytes, out: list[bytes]
    ) -> bytes:
        """vLLM's per-block loop, for payloads the fast layout does not cover."""
        h = self._block_size
        ids = tokens.tolist()
        for b, slot in enumerate(slots):
            parent = self._algo.hash_object((parent, tuple(ids[b * h : (b + 1) * h]), slot))
            out.append(parent)
        return parent


@functools.cache
def _none_slot(width: int, cbor: bool) -> bytes:
    """The encoding of an empty extra slot."""
    return _payload.extra_encoding(None, width, cbor)


present_as_public(BlockHasher)
