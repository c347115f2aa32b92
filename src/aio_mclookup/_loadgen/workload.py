"""Synthetic KV-cache workloads: what vLLM workers would have stored, and the lookups that follow.

The model is a chat service seen at one instant. ``system_prompts`` shared system prompts start
every session; each prompt then grows by ``turn_tokens`` per turn (the last answer plus the new
user message). Each session is caught at its current turn ``c`` (uniform in ``0..turns-1``):
its request is turn ``c``'s prompt. Block hashes are chained like vLLM's: hash ``i`` is
``sha256(hash[i-1] + block seed)``, so sessions that share a system prompt share its full hash
blocks exactly, and every turn's hashes start with the previous turn's.

A fraction ``hit_ratio`` of the sessions is *warm*: every turn it served before ``c`` was stored
(the keys a dense vLLM producer writes, ``layout.plan(layout.align(len), hashes).keys``), so its
request finds the previous turn's prompt. Cold sessions stored nothing, and find at most their
system prompt, when a warm session stored it. Every request is distinct, and nothing of a
request's own new tokens is in the store. Everything is deterministic for a given ``seed``.

With ``every_turn`` (the ``sessions`` preset) a session is caught at a turn ``c >= 1`` and asks
for every turn ``1..c`` (agents and chat clients resending a conversation), so the requests for
its earlier turns find their whole prompt.

With ``token_ids`` the prompts are synthetic token ids instead (uniform over a 151,936-token
vocabulary, from a stream of their own, so the sessions, turns and lengths are the same as
without): each system prompt is one token sequence, each turn appends its own tokens, and the
block hashes are vLLM's, from :func:`workload_hasher` (a :class:`BlockHasher` for the layout's
``hash_block_size`` and release). Sessions that share a system prompt then share its full hash
blocks exactly as the chained synthetic hashes do, so both modes find the same hits.

:func:`build_workload` is reusable by benchmarks: it returns the keys to store and the requests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .._checks import positive_int
from .._errors import InvalidRequest
from .._hashing import BlockHasher
from .._layout.groups import FullAttention, SlidingWindow
from .._layout.layout import KVLayout
from .._layout.sglang import SGLangLayout

__all__ = [
    "PRESETS",
    "PRESET_WORKLOADS",
    "SGLANG_PRESETS",
    "PageHasher",
    "VOCAB",
    "Request",
    "Workload",
    "WorkloadSpec",
    "build_workload",
    "describe_hasher",
    "describe_layout",
    "preset_layout",
    "sglang_token_note",
    "workload_hasher",
]

HASH_WIDTH = 32
VOCAB = 151_936  # token ids of token-id workloads are uniform in [0, VOCAB) (Qwen-sized)

PRESETS: dict[str, dict[str, Any]] = {
    "chat": {
        "vllm_version": "0.33.0",
        "model": "Qwen/Qwen3-8B",
        "hash_block_size": 16,
        "scheduler_block_size": 16,
        "groups": [{"kind": "full_attention", "block_size": 16}],
    },
    "dsv4": {
        "vllm_version": "0.33.0",
        "model": "deepseek-ai/DeepSeek-V4-Pro",
        "hash_block_size": 4,
        "scheduler_block_size": 256,
        "groups": [
            {"kind": "full_attention", "block_size": 256},
            {"kind": "sliding_window", "block_size": 64, "sliding_window": 128},
            {"kind": "sliding_window", "block_size": 4, "sliding_window": 8},
            {"kind": "sliding_window", "block_size": 8, "sliding_window": 128},
        ],
    },
    "sessions": {
        "vllm_version": "0.26.0",
        "model": "meta-llama/Llama-3.1-70B-Instruct",
        "cache_prefix": "tenant-a",
        "hash_block_size": 16,
        "scheduler_block_size": 16,
        "tp_size": 4,
        "num_kv_heads": 8,
        "groups": [{"kind": "full_attention", "block_size": 16}],
    },
}
"""Named layouts (:meth:`KVLayout.from_dict` form), each naming its vLLM release: a single
full-attention chat model, the DeepSeek-V4-like hybrid (full attention plus three sliding
windows), and a GQA model at TP 4 with 8 KV heads (four rank namespaces, so four keys per chunk)
behind a cache prefix (bench_coalesce's ``sessions`` scenario)."""

PRESET_WORKLOADS: dict[str, dict[str, Any]] = {
    "sessions": {
        "sessions": 128,
        "turns": 6,
        "system_prompts": 4,
        "system_tokens": (1024, 1024),
        "turn_tokens": (512, 512),
        "hit_ratio": 1.0,
        "every_turn": True,
    },
}
"""Workload defaults of the presets that have their own (the others scale with the layout,
:meth:`WorkloadSpec.for_layout`): ``sessions`` mirrors bench_coalesce's scenario, 128 sessions
sharing 4 system prompts of 1,024 tokens, each at some turn of six, every turn adding 512 tokens,
the earlier turns stored, every turn up to the current one asked for."""


SGLANG_PRESETS: dict[str, dict[str, Any]] = {
    "sglang": {
        "engine": "sglang",
        "sglang_version": "0.5.23",
        "page_size": 64,
        "model_name": "Qwen/Qwen3-8B",
        "tp_size": 2,
    },
}
"""Named SGLang HiCache deployments (:meth:`SGLangLayout.from_dict` form): ``sglang`` is
bench_sglang's, Qwen3-8B at TP 2 (MHA: four objects per page), 64-token pages, the default
prefetch threshold (256 tokens). Its workload is the chat one, from token ids."""

PRESET_WORKLOADS["sglang"] = {"token_ids": True}


def preset_layout(name: str) -> KVLayout | SGLangLayout:
    """The layout of a preset (an :class:`SGLangLayout` for :data:`SGLANG_PRESETS`, else a
    :class:`KVLayout`); :class:`InvalidRequest` for an unknown name."""
    if name in SGLANG_PRESETS:
        return SGLangLayout.from_dict(SGLANG_PRESETS[name])
    try:
        cfg = PRESETS[name]
    except KeyError:
        names = ", ".join(sorted([*PRESETS, *SGLANG_PRESETS]))
        raise InvalidRequest(f"unknown preset {name!r} (choose from {names})") from None
    return KVLayout.from_dict(cfg)


@dataclass(frozen=True)
class WorkloadSpec:
    """The knobs of a synthetic workload (token ranges are inclusive ``(low, high)``).

    ``sessions`` is also the number of distinct requests (one per session, at its current turn).
    """

    sessions: int = 6000
    turns: int = 6
    system_prompts: int = 8
    system_tokens: tuple[int, int] = (1000, 3000)
    turn_tokens: tuple[int, int] = (100, 600)
    hit_ratio: float = 0.8
    seed: int = 0
    every_turn: bool = False
    """Each session asks for every turn from 1 to its current one (caught at a turn >= 1)."""
    token_ids: bool = False
    """Prompts as token ids, hashed with :func:`workload_hasher` (else chained hashes)."""

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "system_prompts"):
            positive_int(name, getattr(self, name))
        if self.every_turn and self.turns < 2:
            raise InvalidRequest(f"every_turn needs turns >= 2, got {self.turns}")
        for name in ("system_tokens", "turn_tokens"):
            low, high = getattr(self, name)
            if not (isinstance(low, int) and isinstance(high, int)) or low < 0 or high < low:
                raise InvalidRequest(f"{name} must be a range 0 <= low <= high, got {low}-{high}")
        if not 0.0 <= self.hit_ratio <= 1.0:
            raise InvalidRequest(f"hit_ratio must be within [0, 1], got {self.hit_ratio!r}")

    @classmethod
    def for_layout(
        cls, layout: KVLayout | SGLangLayout, preset: str | None = None, **overrides: Any
    ) -> WorkloadSpec:
        """Defaults scaled to the layout: long-context hybrids (scheduler block >= 256) get
        longer prompts and fewer sessions, so the stored keys stay under ~300k either way; a
        preset with its own workload (:data:`PRESET_WORKLOADS`) uses that instead."""
        if preset in PRESET_WORKLOADS:
            base: dict[str, Any] = dict(PRESET_WORKLOADS[preset])
        elif isinstance(layout, KVLayout) and layout.scheduler_block_size >= 256:
            base = {
                "sessions": 1200,
                "system_tokens": (2000, 6000),
                "turn_tokens": (256, 2048),
            }
        else:
            base = {}
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Request:
    """One lookup: a prompt of ``num_tokens`` tokens, looked up at ``token_len``
    (``layout.align(num_tokens)``, as vLLM's scheduler does; SGLang: the tokens of the pages
    offered to storage) with the prompt's block hashes (SGLang: page hashes)."""

    index: int
    session: int
    turn: int
    num_tokens: int
    token_len: int
    hashes: npt.NDArray[np.uint8]
    """The prompt's block hashes, one 32-byte row per full hash block (a view: do not mutate)."""
    hash_list: list[bytes] = field(repr=False, compare=False)
    """The same hashes as ``bytes`` (vLLM's own form; the seed-naive path uses it). Empty for
    a token-id workload, whose lookups hash :attr:`token_ids` themselves."""
    token_ids: npt.NDArray[np.uint32] | None = field(default=None, repr=False, compare=False)
    """The prompt's token ids (a token-id workload; a view: do not mutate), else None."""


@dataclass
class Workload:
    """A layout's synthetic cache and the requests to look up against it."""

    layout: KVLayout | SGLangLayout
    spec: WorkloadSpec
    requests: list[Request]
    stored_prefixes: list[tuple[int, npt.NDArray[np.uint8]]]
    """``(token_len, hashes)`` of every prefix the warm sessions stored (aligned lengths; SGLang:
    a request length whose plan under :attr:`writer` has every stored page)."""
    warm_sessions: int
    writer: KVLayout | SGLangLayout | None = None
    """The layout whose plans of :attr:`stored_prefixes` are the stored keys (None: ``layout``;
    SGLang: ``layout`` without its prefetch threshold, which declines lookups, not writes)."""

    def store_keys(self) -> list[bytes]:
        """Every distinct key the cache holds, in write order (what the writer puts)."""
        seen: dict[bytes, None] = {}
        writer = self.writer or self.layout
        for token_len, hashes in self.stored_prefixes:
            seen.update(dict.fromkeys(writer.plan(token_len, hashes).keys))
        return list(seen)

    def iter_store_keys(self, chunk: int = 20_000) -> Iterator[list[bytes]]:
        """:meth:`store_keys` in chunks of about ``chunk`` new keys (for progress display)."""
        seen: set[bytes] = set()
        batch: list[bytes] = []
        writer = self.writer or self.layout
        for token_len, hashes in self.stored_prefixes:
            for key in writer.plan(token_len, hashes).keys:
                if key not in seen:
                    seen.add(key)
                    batch.append(key)
            if len(batch) >= chunk:
                yield batch
                batch = []
        if batch:
            yield batch

    @property
    def prompt_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def aligned_tokens(self) -> int:
        return sum(r.token_len for r in self.requests)

    def summary(self) -> dict[str, Any]:
        """Sizes for reports (no keys are built)."""
        lengths = np.array([r.num_tokens for r in self.requests], dtype=np.int64)
        return {
            "requests": len(self.requests),
            "token_ids": self.spec.token_ids,
            "sessions": self.spec.sessions,
            "warm_sessions": self.warm_sessions,
            "stored_prefixes": len(self.stored_prefixes),
            "prompt_tokens_mean": float(lengths.mean()) if lengths.size else 0.0,
            "prompt_tokens_min": int(lengths.min()) if lengths.size else 0,
            "prompt_tokens_max": int(lengths.max()) if lengths.size else 0,
        }


def _chain(parent: bytes, tag: bytes, count: int) -> list[bytes]:
    """``count`` chained hashes: each is ``sha256(previous + tag + index)``."""
    out: list[bytes] = []
    sha = hashlib.sha256
    pack = struct.Struct("<Q").pack
    for i in range(count):
        parent = sha(parent + tag + pack(i)).digest()
        out.append(parent)
    return out


def _as_rows(hashes: list[bytes]) -> npt.NDArray[np.uint8]:
    return np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(len(hashes), HASH_WIDTH)


def _uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


class PageHasher:
    """The hasher of an SGLang token-id workload: :meth:`SGLangLayout.page_hashes` (no
    ``extra_key`` or ``cache_salt``), with what a report needs of a :class:`BlockHasher`."""

    seeded = False

    def __init__(self, layout: SGLangLayout) -> None:
        self.layout = layout

    def hash(self, token_ids: object) -> list[bytes]:
        """The prompt's page hashes, one 32-byte digest per full page."""
        return self.layout.page_hashes(token_ids)

    def to_dict(self) -> dict[str, Any]:
        layout = self.layout
        return {
            "hasher": "SGLangLayout.page_hashes",
            "algo": "sha256",
            "page_size": layout.page_size,
            "eagle": layout.eagle,
            "sglang_version": layout.sglang_version,
        }


def workload_hasher(layout: KVLayout | SGLangLayout) -> BlockHasher | PageHasher:
    """The hasher of token-id workloads: for vLLM the :class:`BlockHasher` of the layout's
    hash block size and release, sha256, ``PYTHONHASHSEED`` unset, or ``"0"`` for releases
    before 0.29 (whose unset seed cannot be reproduced); for SGLang a :class:`PageHasher`."""
    if isinstance(layout, SGLangLayout):
        return PageHasher(layout)
    minor = int(layout.vllm_version.split(".")[1])
    return BlockHasher(
        layout.hash_block_size,
        seed=None if minor >= 29 else "0",
        vllm_version=layout.vllm_version,
    )


def sglang_token_note(layout: SGLangLayout) -> str:
    """How an SGLang token-id run's two ways hash their prompts (the progress line, the
    report and the JSON say it)."""
    return (
        f"seed-naive first hashes each prompt's token ids with {describe_hasher(layout)}; the "
        "coordinator looks them up with lookup_tokens, which hashes them inside the lookup (on "
        "its worker thread while other lookups are under way; not timed apart); the hashing "
        "is in the latencies and lookups/s"
    )


def describe_hasher(layout: KVLayout | SGLangLayout) -> str:
    """:func:`workload_hasher`'s configuration as a call (its seed is no secret here)."""
    if isinstance(layout, SGLangLayout):
        return (
            f"SGLangLayout.page_hashes (SHA-256 chain over {layout.page_size}-token pages, "
            f"SGLang {layout.sglang_version})"
        )
    h = workload_hasher(layout)
    assert isinstance(h, BlockHasher)
    seed = "'0'" if h.seeded else "None"
    return (
        f"BlockHasher({h.block_size}, algo={h.algo!r}, seed={seed}, "
        f"vllm_version={h.vllm_version!r})"
    )


@dataclass(frozen=True)
class _Units:
    """How an engine cuts a prompt: ``count(n)`` hashes of ``n`` tokens (blocks, pages), the
    request's ``asked(n)`` token_len, the length ``stored(n)`` whose plan holds what a served
    ``n``-token turn stored (0: nothing), and ``rows(ids)``, token ids hashed into rows."""

    count: Callable[[int], int]
    asked: Callable[[int], int]
    stored: Callable[[int], int]
    rows: Callable[[npt.NDArray[np.uint32]], npt.NDArray[np.uint8]]


def _units(layout: KVLayout | SGLangLayout, token_ids: bool) -> _Units:
    if isinstance(layout, SGLangLayout):
        page, eagle = layout.page_size, int(layout.eagle)
        pages = PageHasher(layout)

        def count(n: int) -> int:  # (EAGLE: bigram pages, one token fewer)
            return max(n - eagle, 0) // page

        def stored(n: int) -> int:  # every full page, whatever the prefetch threshold
            return count(n) * page + 1 + eagle if count(n) else 0

        return _Units(
            count,
            lambda n: layout.query_pages(n) * page,
            stored,
            lambda ids: _as_rows(pages.hash(ids)),
        )
    h = layout.hash_block_size
    blocks = workload_hasher(layout) if token_ids else None  # (built only when it hashes)

    def rows(ids: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint8]:
        assert isinstance(blocks, BlockHasher)
        return blocks.hash(ids)

    return _Units(lambda n: n // h, layout.align, layout.align, rows)


def build_workload(layout: KVLayout | SGLangLayout, spec: WorkloadSpec) -> Workload:
    """Build the synthetic cache and the requests (in random order).

    Cost: one sha256 per hash block of each session's prompt (~1 us each; with token ids the
    vLLM hash of each block, ~0.5 us; SGLang: per page); no keys are built here (see
    :meth:`Workload.store_keys`). For an :class:`SGLangLayout` the hashes are page hashes
    (with token ids, ``layout.page_hashes``) and a warm session stored every full page of its
    served turns.
    """
    rng = np.random.default_rng(spec.seed)
    units = _units(layout, spec.token_ids)
    root = hashlib.sha256(b"aio-mclookup workload seed %d" % spec.seed).digest()
    system_lengths = [_uniform(rng, spec.system_tokens) for _ in range(spec.system_prompts)]
    hash_ids = units.rows if spec.token_ids else None
    # token ids come from a stream of their own: the sessions are the same either way
    vocab = np.random.default_rng([spec.seed, 1])
    system_chains: list[list[bytes]] = []
    system_ids: list[npt.NDArray[np.uint32]] = []
    if hash_ids is None:
        system_chains = [
            _chain(root, b"system %d" % i, units.count(n)) for i, n in enumerate(system_lengths)
        ]
    else:
        system_ids = [vocab.integers(0, VOCAB, n, dtype=np.uint32) for n in system_lengths]
    warm_flags = rng.random(spec.sessions) < spec.hit_ratio
    first = 1 if spec.every_turn else 0
    requests: list[Request] = []
    stored: list[tuple[int, npt.NDArray[np.uint8]]] = []
    for session in range(spec.sessions):
        system = int(rng.integers(spec.system_prompts))
        current = int(rng.integers(first, spec.turns))
        lengths: list[int] = []
        total = system_lengths[system]
        for _ in range(current + 1):
            total += _uniform(rng, spec.turn_tokens)
            lengths.append(total)
        ids: npt.NDArray[np.uint32] | None = None
        chain: list[bytes] = []
        if hash_ids is None:
            shared = system_chains[system]
            own = units.count(total) - len(shared)
            parent = shared[-1] if shared else root
            chain = shared + _chain(parent, b"session %d" % session, own)
            rows = _as_rows(chain)
        else:
            own_ids = vocab.integers(0, VOCAB, total - system_lengths[system], dtype=np.uint32)
            ids = np.concatenate([system_ids[system], own_ids])
            rows = hash_ids(ids)
        if warm_flags[session]:
            # The turns this session already had were stored after they were served.
            for served in lengths[:-1]:
                aligned = units.stored(served)
                if aligned:
                    stored.append((aligned, rows[: units.count(served)]))
        asked = lengths[1:] if spec.every_turn else lengths[-1:]
        for turn, num_tokens in enumerate(asked, start=current + 1 - len(asked)):
            n_hashes = units.count(num_tokens)
            requests.append(
                Request(
                    index=-1,
                    session=session,
                    turn=turn,
                    num_tokens=num_tokens,
                    token_len=units.asked(num_tokens),
                    hashes=rows[:n_hashes],
                    hash_list=chain[:n_hashes],
                    token_ids=None if ids is None else ids[:num_tokens],
                )
            )
    order = rng.permutation(len(requests)).tolist()
    shuffled = [
        dataclasses.replace(r, index=i) for i, r in enumerate(requests[j] for j in order)
    ]
    writer = None
    if isinstance(layout, SGLangLayout):
        writer = SGLangLayout.from_dict({**layout.to_dict(), "prefetch_threshold": 0})
    return Workload(layout, spec, shuffled, stored, int(warm_flags.sum()), writer)


def describe_layout(layout: KVLayout | SGLangLayout) -> str:
    """A one-line description of a layout's groups (SGLang: its deployment)."""
    if isinstance(layout, SGLangLayout):
        parallel = f" tp={layout.tp_size}" + (f" pp={layout.pp_size}" if layout.pp_size > 1 else "")
        return (
            f"{layout.model_name or '(no model name)'} [SGLang HiCache, "
            f"{'MLA' if layout.mla else 'MHA'}{', EAGLE' if layout.eagle else ''}] "
            f"page={layout.page_size}{parallel} ({layout.keys_per_page} keys per page) "
            f"prefetch_threshold={layout.prefetch_threshold} sglang={layout.sglang_version}"
        )
    parts = []
    for g in layout.groups:
        if isinstance(g, FullAttention):
            parts.append(f"full/{g.block_size}")
        elif isinstance(g, SlidingWindow):
            parts.append(f"swa/{g.block_size}/W{g.sliding_window}")
        else:
            parts.append(f"{g.kind}/{g.block_size}")
    ranks = ""
    if len(layout.namespaces) > 1:
        ranks = (
            f" tp={layout.tp_size} kv_heads={layout.num_kv_heads} "
            f"({len(layout.namespaces)} keys per chunk)"
        )
    prefix = f" cache_prefix={layout.cache_prefix}" if layout.cache_prefix else ""
    return (
        f"{layout.model} [{', '.join(parts)}] hash_block={layout.hash_block_size} "
        f"scheduler_block={layout.scheduler_block_size}{ranks}{prefix} "
        f"vllm={layout.vllm_version}"
    )
