"""KV-cache layouts: the model-side facts a lookup needs, validated once.

A :class:`KVLayout` mirrors what vLLM's Mooncake store worker knows about a deployment: its
KV-cache groups (full attention, sliding window, chunked local attention, mamba), the hash and
scheduler block sizes, EAGLE, the rank namespaces (TP/PCP/DCP/PP) and the key prefix. Every
per-layout cost (key prefixes, merged spec-groups) is paid here, once, in its
:class:`~aio_mclookup._layout.geometry.Geometry`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .._checks import integer, positive_int
from .._errors import InvalidRequest
from .._plan.hashes import HashInput
from .._plan.plan import LookupPlan, build_plan
from .geometry import Geometry
from .groups import KINDS, GroupSpec
from .namespaces import rank_namespaces

__all__ = ["KVLayout"]

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
            if not isinstance(g, tuple(KINDS.values())):
                raise InvalidRequest(f"groups[{i}] is not a group spec: {g!r}")
        self.groups: tuple[GroupSpec, ...] = tuple(groups)
        self.model = model
        self.cache_prefix = cache_prefix
        self.use_eagle = use_eagle
        self.hash_block_size = h = positive_int("hash_block_size", hash_block_size)
        self.scheduler_block_size = sched = positive_int(
            "scheduler_block_size", scheduler_block_size
        )
        self.tp_size = positive_int("tp_size", tp_size)
        self.pcp_size = positive_int("pcp_size", pcp_size)
        self.dcp_size = positive_int("dcp_size", dcp_size)
        self.pp_size = positive_int("pp_size", pp_size)
        self.num_kv_heads = positive_int("num_kv_heads", num_kv_heads)
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
        self._geometry = Geometry(
            self.groups,
            model=model,
            cache_prefix=cache_prefix,
            hash_block_size=h,
            scheduler_block_size=sched,
            use_eagle=use_eagle,
            namespaces=rank_namespaces(
                self.tp_size, self.pcp_size, self.dcp_size, self.pp_size, self.num_kv_heads
            ),
        )

    @property
    def namespaces(self) -> tuple[tuple[int, int, int, int], ...]:
        """The rank namespaces ``(tp, pcp, dcp, pp)`` every chunk has a key in, in key order."""
        return self._geometry.namespaces

    @property
    def key_prefixes(self) -> tuple[tuple[str, ...], ...]:
        """Per group, per namespace: the key prefix (the key is ``prefix@hex(hash)``)."""
        return self._geometry.key_prefixes

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
        spec_cls = KINDS.get(kind) if isinstance(kind, str) else None
        if spec_cls is None:
            raise InvalidRequest(
                f"groups[{index}].kind={kind!r} is not one of {', '.join(sorted(KINDS))}"
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
            positive_int(f"groups[{index}].{name}", value)
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
        n = integer("num_tokens", num_tokens)
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
        return build_plan(self._geometry, token_len, block_hashes)
