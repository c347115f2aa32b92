"""KV-cache layouts: the model-side facts a lookup needs, validated and precomputed once.

A :class:`KVLayout` mirrors what vLLM 0.26's Mooncake store worker knows about a deployment:
its KV-cache groups (full attention, sliding window, chunked local attention, mamba), the hash
and scheduler block sizes, EAGLE, the rank namespaces (TP/PCP/DCP/PP) and the key prefix. Every
per-layout cost (key prefixes, merged spec-groups, mask parameters) is paid here, once.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt

from ._errors import InvalidRequest

if TYPE_CHECKING:
    from ._plan import HashInput, LookupPlan, _ProbeTarget

__all__ = [
    "ChunkedLocalAttention",
    "FullAttention",
    "GroupSpec",
    "KVLayout",
    "Mamba",
    "SlidingWindow",
]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise InvalidRequest(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_sizes(spec: object) -> None:
    """Validate a group spec's sizes and store them as plain ints (numpy ints included)."""
    for f in dataclasses.fields(spec):  # type: ignore[arg-type]
        object.__setattr__(spec, f.name, _positive_int(f.name, getattr(spec, f.name)))


@dataclass(frozen=True)
class FullAttention:
    """A full-attention KV-cache group (also MLA): every chunk is a candidate."""

    block_size: int
    kind: ClassVar[str] = "full_attention"

    def __post_init__(self) -> None:
        _check_sizes(self)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "block_size": self.block_size}


@dataclass(frozen=True)
class SlidingWindow:
    """A sliding-window group: only the window tails ending at scheduler-block boundaries
    can prove a hit, so only those chunks are probed."""

    block_size: int
    sliding_window: int
    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        _check_sizes(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "block_size": self.block_size,
            "sliding_window": self.sliding_window,
        }


@dataclass(frozen=True)
class ChunkedLocalAttention:
    """A chunked local attention group: blocks before the current attention chunk need no
    cache; blocks inside it must be present from its start."""

    block_size: int
    attention_chunk_size: int
    kind: ClassVar[str] = "chunked_local"

    def __post_init__(self) -> None:
        _check_sizes(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "block_size": self.block_size,
            "attention_chunk_size": self.attention_chunk_size,
        }


@dataclass(frozen=True)
class Mamba:
    """A mamba state group (vLLM's ``mamba_cache_mode="align"``): a hit needs the state at an
    aligned boundary."""

    block_size: int
    kind: ClassVar[str] = "mamba"

    def __post_init__(self) -> None:
        _check_sizes(self)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "block_size": self.block_size}


GroupSpec = FullAttention | SlidingWindow | ChunkedLocalAttention | Mamba

_KINDS: dict[str, type[GroupSpec]] = {
    "full_attention": FullAttention,
    "sliding_window": SlidingWindow,
    "chunked_local": ChunkedLocalAttention,
    "mamba": Mamba,
}

_LAYOUT_FIELDS = {
    "model",
    "cache_prefix",
    "hash_block_size",
    "scheduler_block_size",
    "use_eagle",
    "tp_size",
    "pcp_size",
    "dcp_size",
    "pp_size",
    "num_kv_heads",
    "groups",
}


@dataclass(frozen=True)
class SpecGroup:
    """Groups with identical specs, merged as vLLM merges them: a chunk counts as present only
    if it is present in every member group."""

    spec: GroupSpec
    group_ids: tuple[int, ...]
    drop_eagle: bool


class KVLayout:
    """A deployment's KV-cache layout, as vLLM's Mooncake store worker sees it.

    Build it in code::

        layout = KVLayout(
            [FullAttention(256), SlidingWindow(64, sliding_window=128)],
            model="deepseek-ai/DeepSeek-V4-Pro", hash_block_size=4, scheduler_block_size=256,
        )

    or from the JSON-friendly dict of :meth:`from_dict`. Block sizes are those of the KV-cache
    specs the worker uses (after vLLM's single-group DCP/PCP rescale). The layout is immutable;
    build one per model and reuse it for every request.
    """

    def __init__(
        self,
        groups: Sequence[GroupSpec],
        *,
        model: str,
        hash_block_size: int,
        scheduler_block_size: int,
        cache_prefix: str = "",
        use_eagle: bool = False,
        tp_size: int = 1,
        pcp_size: int = 1,
        dcp_size: int = 1,
        pp_size: int = 1,
        num_kv_heads: int = 1,
    ) -> None:
        if not isinstance(model, str) or not model.rstrip("/"):
            raise InvalidRequest(f"model must be a non-empty str, got {model!r}")
        if not isinstance(cache_prefix, str):
            raise InvalidRequest(f"cache_prefix must be a str, got {cache_prefix!r}")
        if not isinstance(use_eagle, bool):
            raise InvalidRequest(f"use_eagle must be a bool, got {use_eagle!r}")
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
            raise InvalidRequest(f"groups must be a non-empty list of group specs, got {groups!r}")
        for i, g in enumerate(groups):
            if not isinstance(g, tuple(_KINDS.values())):
                raise InvalidRequest(f"groups[{i}] is not a group spec: {g!r}")
        self.groups: tuple[GroupSpec, ...] = tuple(groups)
        self.model = model
        self.cache_prefix = cache_prefix
        self.use_eagle = use_eagle
        self.hash_block_size = h = _positive_int("hash_block_size", hash_block_size)
        self.scheduler_block_size = sched = _positive_int(
            "scheduler_block_size", scheduler_block_size
        )
        self.tp_size = _positive_int("tp_size", tp_size)
        self.pcp_size = _positive_int("pcp_size", pcp_size)
        self.dcp_size = _positive_int("dcp_size", dcp_size)
        self.pp_size = _positive_int("pp_size", pp_size)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        if sched % h:
            raise InvalidRequest(
                f"scheduler_block_size={sched} must be a multiple of hash_block_size={h}"
            )
        for i, g in enumerate(self.groups):
            if g.block_size % h:
                raise InvalidRequest(
                    f"groups[{i}].block_size={g.block_size} must be a multiple of "
                    f"hash_block_size={h}"
                )
            if sched % g.block_size:
                raise InvalidRequest(
                    f"scheduler_block_size={sched} must be a multiple of "
                    f"groups[{i}].block_size={g.block_size}"
                )
        self._precompute()

    # ----------------------------------------------------------------------------- precompute
    def _precompute(self) -> None:
        self.model_name = self.model.rstrip("/").split("/")[-1]
        self.namespaces = self._rank_namespaces()
        self.key_prefixes: tuple[tuple[str, ...], ...] = tuple(
            tuple(self._prefix(g, *ns) for ns in self.namespaces) for g in range(len(self.groups))
        )
        # Key prefixes as bytes with the "@" before the hash, and as a (namespaces, width)
        # uint8 matrix when every namespace's prefix has the same width (the fast path).
        self.prefix_bytes: tuple[tuple[bytes, ...], ...] = tuple(
            tuple(p.encode() + b"@" for p in prefixes) for prefixes in self.key_prefixes
        )
        self.prefix_rows: tuple[npt.NDArray[np.uint8] | None, ...] = tuple(
            np.frombuffer(b"".join(ps), dtype=np.uint8).reshape(len(ps), -1)
            if len({len(p) for p in ps}) == 1
            else None
            for ps in self.prefix_bytes
        )
        # Per group with one namespace: a byte found in no key prefix, so that a run of keys
        # can be built by C calls (hex with this separator, prefix it, split on it).
        self.key_separators: tuple[bytes | None, ...] = tuple(
            next((sep for sep in (b"\x00", b"\n", b" ") if sep not in ps[0]), None)
            if len(ps) == 1
            else None
            for ps in self.prefix_bytes
        )
        # What each group probes per (token_len, chunk limits): lengths repeat (see _plan).
        self.probe_cache: dict[tuple[int, tuple[int, ...]], tuple[_ProbeTarget, ...]] = {}
        self.probe_cache_bytes = 0
        self.block_sizes = tuple(g.block_size for g in self.groups)
        self.has_chunked_local = any(isinstance(g, ChunkedLocalAttention) for g in self.groups)
        self.has_full_attention = any(isinstance(g, FullAttention) for g in self.groups)
        # One full-attention group and nothing else (the common chat model).
        self.lone_full_attention = len(self.groups) == 1 and self.has_full_attention
        # Merge identical specs (first-appearance order), then put full attention first
        # (a stable sort, as vLLM's coordinator does). With use_eagle and no group flagged,
        # vLLM applies EAGLE to every spec-group.
        merged: dict[GroupSpec, list[int]] = {}
        for gid, spec in enumerate(self.groups):
            merged.setdefault(spec, []).append(gid)
        ordered = sorted(merged.items(), key=lambda item: not isinstance(item[0], FullAttention))
        self.spec_groups: tuple[SpecGroup, ...] = tuple(
            SpecGroup(spec, tuple(ids), self.use_eagle) for spec, ids in ordered
        )
        # vLLM's convergence loop makes a single pass for one spec-group, or for exactly two
        # with full attention first; otherwise it repeats until the hit stops falling.
        self.multi_pass = len(self.spec_groups) > 2 or (
            len(self.spec_groups) == 2 and not isinstance(self.spec_groups[0].spec, FullAttention)
        )

    def _rank_namespaces(self) -> tuple[tuple[int, int, int, int], ...]:
        """(tp, pcp, dcp, pp) per key namespace: PCP outermost, then TP, then PP (vLLM 0.26)."""
        if self.dcp_size > 1:
            return tuple(
                (tp, pcp, tp % self.dcp_size, pp)
                for pcp in range(self.pcp_size)
                for tp in range(self.tp_size)
                for pp in range(self.pp_size)
            )
        tp_count = min(self.tp_size, self.num_kv_heads)
        return tuple(
            (tp, pcp, 0, pp)
            for pcp in range(self.pcp_size)
            for tp in range(tp_count)
            for pp in range(self.pp_size)
        )

    def _prefix(self, group: int, tp: int, pcp: int, dcp: int, pp: int) -> str:
        head = f"{self.cache_prefix}@" if self.cache_prefix else ""
        return f"{head}{self.model_name}@tp_rank:{tp}@pcp{pcp}@dcp{dcp}@pp_rank:{pp}@group:{group}"

    # ------------------------------------------------------------------------------ dict form
    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> KVLayout:
        """Build a layout from the JSON-friendly form (the conformance cases' ``config``).

        Required: ``model``, ``hash_block_size``, ``scheduler_block_size``, ``groups`` (each
        ``{"kind": ..., "block_size": ...}``; ``sliding_window`` for ``sliding_window``,
        ``attention_chunk_size`` for ``chunked_local``). Optional: ``cache_prefix``,
        ``use_eagle``, ``tp_size``, ``pcp_size``, ``dcp_size``, ``pp_size``, ``num_kv_heads``.
        Unknown keys raise :class:`InvalidRequest`.
        """
        if not isinstance(cfg, Mapping):
            raise InvalidRequest(f"layout must be a mapping, got {type(cfg).__name__}")
        unknown = set(cfg) - _LAYOUT_FIELDS
        if unknown:
            raise InvalidRequest(f"unknown layout field(s): {', '.join(sorted(map(str, unknown)))}")
        for required in ("model", "hash_block_size", "scheduler_block_size", "groups"):
            if required not in cfg:
                raise InvalidRequest(f"layout field {required!r} is required")
        raw_groups = cfg["groups"]
        if not isinstance(raw_groups, Sequence) or isinstance(raw_groups, (str, bytes)):
            raise InvalidRequest(f"groups must be a list, got {raw_groups!r}")
        groups = [cls._group_from_dict(i, g) for i, g in enumerate(raw_groups)]
        options = {k: v for k, v in cfg.items() if k != "groups"}
        return cls(groups, **options)

    @staticmethod
    def _group_from_dict(index: int, raw: object) -> GroupSpec:
        if not isinstance(raw, Mapping):
            raise InvalidRequest(f"groups[{index}] must be a mapping, got {raw!r}")
        kind = raw.get("kind")
        spec_cls = _KINDS.get(kind) if isinstance(kind, str) else None
        if spec_cls is None:
            raise InvalidRequest(
                f"groups[{index}].kind={kind!r} is not one of {', '.join(sorted(_KINDS))}"
            )
        fields = {k: v for k, v in raw.items() if k != "kind"}
        allowed = {f.name for f in dataclasses.fields(spec_cls)}
        extra = set(fields) - allowed
        missing = allowed - set(fields)
        if extra or missing:
            raise InvalidRequest(
                f"groups[{index}] ({kind}) needs exactly {sorted(allowed)}; "
                f"unknown {sorted(extra)}, missing {sorted(missing)}"
            )
        for name, value in fields.items():
            _positive_int(f"groups[{index}].{name}", value)
        return spec_cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-friendly form; ``KVLayout.from_dict(layout.to_dict())`` is equal."""
        return {
            "model": self.model,
            "cache_prefix": self.cache_prefix,
            "hash_block_size": self.hash_block_size,
            "scheduler_block_size": self.scheduler_block_size,
            "use_eagle": self.use_eagle,
            "tp_size": self.tp_size,
            "pcp_size": self.pcp_size,
            "dcp_size": self.dcp_size,
            "pp_size": self.pp_size,
            "num_kv_heads": self.num_kv_heads,
            "groups": [g.to_dict() for g in self.groups],
        }

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVLayout) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(repr(self.to_dict()))

    def __repr__(self) -> str:
        groups = ", ".join(repr(g) for g in self.groups)
        return (
            f"KVLayout([{groups}], model={self.model!r}, hash_block_size={self.hash_block_size}, "
            f"scheduler_block_size={self.scheduler_block_size}, "
            f"namespaces={len(self.namespaces)}, use_eagle={self.use_eagle})"
        )

    # ------------------------------------------------------------------------------- requests
    def align(self, num_tokens: int) -> int:
        """The ``token_len`` vLLM's scheduler looks up for a prompt of ``num_tokens`` tokens:
        ``num_tokens`` floored to the scheduler block (0 when shorter than one block, in which
        case vLLM skips the lookup).

        vLLM 0.26 then applies "leave one token to compute" to the *result*: if the hit equals
        ``num_tokens``, it uses ``max(0, (num_tokens - 1) // L * L)`` instead (see
        :meth:`leave_one_token`).
        """
        n = _token_count("num_tokens", num_tokens)
        return max(0, n) // self.scheduler_block_size * self.scheduler_block_size

    def leave_one_token(self, hit: int, num_tokens: int) -> int:
        """vLLM's scheduler rule: a hit covering the whole prompt is lowered so at least one
        token is computed."""
        if hit == num_tokens:
            return max(0, (num_tokens - 1) // self.scheduler_block_size * self.scheduler_block_size)
        return hit

    def plan(self, token_len: int, block_hashes: HashInput) -> LookupPlan:
        """Plan one lookup: the candidate keys vLLM 0.26 would probe for ``token_len`` tokens
        (a multiple of ``scheduler_block_size``) and these block hashes, in vLLM's order.

        ``block_hashes`` is a sequence of ``bytes`` (one per ``hash_block_size`` tokens) or a
        2-D ``uint8`` numpy array of fixed-width hashes. Raises :class:`InvalidRequest` for a
        malformed request.
        """
        build = _BUILD_PLAN
        if not build:  # imported on first use: _plan imports this module
            from ._plan import build_plan

            build.append(build_plan)
        return build[0](self, token_len, block_hashes)


_BUILD_PLAN: list[Callable[[KVLayout, object, object], LookupPlan]] = []
"""``_plan.build_plan``, once imported (a function-level import costs on every call)."""


def window_blocks(spec: SlidingWindow, eagle: bool) -> int:
    """Contiguous blocks a sliding-window hit needs: ceil((W - 1) / B), one more with EAGLE."""
    return -(-(spec.sliding_window - 1) // spec.block_size) + (1 if eagle else 0)


def _token_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequest(f"{name} must be an int, got {value!r}")
    return int(value)
