"""KV-cache layouts: the model-side facts a lookup needs, validated once.

A :class:`KVLayout` mirrors what vLLM's Mooncake store worker knows about a deployment: its
KV-cache groups (full attention, sliding window, chunked local attention, mamba, and from
vLLM 0.32 on circular-buffer rings), the hash and scheduler block sizes, EAGLE, the rank
namespaces (TP/PCP/DCP/PP), the key prefix and the vLLM release whose lookup it reproduces
(``vllm_version``: 0.26, 0.32 or 0.33). Every per-layout cost (key prefixes, merged
spec-groups) is paid here, once, in its :class:`~aio_mclookup._layout.geometry.Geometry`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .._checks import integer, positive_int
from .._errors import InvalidRequest
from .._plan.era_c import build_era_c_plan
from .._plan.hashes import HashInput, check_width
from .._plan.plan import LookupPlan, build_plan
from .from_vllm import check_against_vllm, layout_arguments
from .geometry import Geometry
from .groups import (
    KINDS,
    CircularBuffer,
    FullAttention,
    GroupSpec,
    Mamba,
    non_default_fields,
)
from .namespaces import Namespace, group_namespaces, rank_namespaces, replication_factor
from .rules import EraCRules

__all__ = ["SUPPORTED_VERSIONS", "KVLayout", "normalise_version"]

SUPPORTED_VERSIONS = ("0.26.0", "0.32.0", "0.33.0")
"""The vLLM releases whose lookup a layout reproduces (also accepted as "0.26", "0.32",
"0.33"). Other releases differ in ways of their own and are refused, not guessed."""

DEFAULT_VERSION = "0.33.0"

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
    "vllm_version",
    "cache_hit_alignment_tokens",
    "store_namespace",
    "store_tp_size",
    "hash_bytes",
}
_FLAG_FIELDS = {"mla", "eagle", "prefix_cacheable"}


def normalise_version(value: object) -> str:
    """``"0.33"`` / ``"0.33.0"`` -> ``"0.33.0"`` (likewise 0.26 and 0.32); anything else is
    refused with the supported releases named."""
    if isinstance(value, str):
        full = value if value.count(".") == 2 else f"{value}.0"
        if full in SUPPORTED_VERSIONS:
            return full
    raise InvalidRequest(
        f"vllm_version={value!r} is not supported: the lookup rules are known for vLLM "
        f"{', '.join(v[:-2] for v in SUPPORTED_VERSIONS)} (write e.g. \"0.33.0\"); other "
        "releases differ and are not guessed",
        field="vllm_version",
    )


class KVLayout:
    """A deployment's KV-cache layout, as vLLM's Mooncake store worker sees it.

    Build it in code::

        layout = KVLayout(
            [FullAttention(256, mla=True), SlidingWindow(64, sliding_window=128, mla=True)],
            model="deepseek-ai/DeepSeek-V4-Pro", hash_block_size=4, scheduler_block_size=256,
            num_kv_heads=1, vllm_version="0.33.0",
        )

    or from the JSON-friendly dict of :meth:`from_dict`. ``vllm_version`` (default
    ``"0.33.0"``) picks the release whose lookup is reproduced: ``"0.26.0"``, ``"0.32.0"`` or
    ``"0.33.0"`` (docs/layouts.md describes every field for each). Block sizes are those the
    store worker uses: on 0.26 after its single-group DCP/PCP rescale, on 0.32+ DCP-resolved
    (attention groups: declared block x ``dcp_size``). The layout is immutable; build one per
    model and reuse it for every request.
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
        num_kv_heads: int | None = None,
        vllm_version: str = DEFAULT_VERSION,
        cache_hit_alignment_tokens: int | None = None,
        store_namespace: str = "",
        store_tp_size: int | None = None,
        hash_bytes: int | None = None,
    ) -> None:
        self.vllm_version = version = normalise_version(vllm_version)
        if not isinstance(model, str) or not model.rstrip("/"):
            raise InvalidRequest(f"model must be a non-empty str, got {model!r}", field="model")
        if not isinstance(cache_prefix, str):
            raise InvalidRequest(
                f"cache_prefix must be a str, got {cache_prefix!r}", field="cache_prefix"
            )
        if not isinstance(use_eagle, bool):
            raise InvalidRequest(f"use_eagle must be a bool, got {use_eagle!r}", field="use_eagle")
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
            raise InvalidRequest(
                f"groups must be a non-empty list of group specs, got {groups!r}", field="groups"
            )
        for i, g in enumerate(groups):
            if not isinstance(g, tuple(KINDS.values())):
                raise InvalidRequest(f"groups[{i}] is not a group spec: {g!r}", field=f"groups.{i}")
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
        if num_kv_heads is None:
            if self.tp_size > 1 and self.dcp_size == 1:
                raise InvalidRequest(
                    "num_kv_heads is required when tp_size > 1 and dcp_size == 1 (it decides "
                    "which TP ranks' keys a chunk needs): "
                    + (
                        "give the model's KV head count, and 1 for an MLA model (vLLM 0.26's "
                        "convention)"
                        if version == "0.26.0"
                        else "give the model's total KV heads (MLA models included), and mark "
                        "MLA groups with mla: true"
                    ),
                    field="num_kv_heads",
                )
            num_kv_heads = 1
        self.num_kv_heads = positive_int("num_kv_heads", num_kv_heads)
        if sched % h:
            raise InvalidRequest(
                f"scheduler_block_size={sched} must be a multiple of hash_block_size={h}",
                field="scheduler_block_size",
            )
        if cache_hit_alignment_tokens is not None:
            cache_hit_alignment_tokens = positive_int(
                "cache_hit_alignment_tokens", cache_hit_alignment_tokens
            )
        if store_tp_size is not None:
            store_tp_size = positive_int("store_tp_size", store_tp_size)
        if not isinstance(store_namespace, str):
            raise InvalidRequest(
                f"store_namespace must be a str, got {store_namespace!r}", field="store_namespace"
            )
        self.cache_hit_alignment_tokens = cache_hit_alignment_tokens
        self.store_namespace = store_namespace
        self.store_tp_size = store_tp_size
        if hash_bytes is not None:
            hash_bytes = positive_int("hash_bytes", hash_bytes)
        self.hash_bytes = hash_bytes
        """The width of the engines' block hashes (32: sha256, sha256_cbor; 16: xxhash,
        xxhash_cbor), which :meth:`plan` then insists on; None: not checked."""
        if version == "0.26.0":
            self._check_026()
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
        else:
            self._geometry = self._era_c_geometry()

    # ------------------------------------------------------------------------- validation
    def _check_sizes(self, groups: Sequence[tuple[int, GroupSpec]]) -> None:
        h, sched = self.hash_block_size, self.scheduler_block_size
        for i, g in groups:
            if g.block_size % h:
                raise InvalidRequest(
                    f"groups[{i}].block_size={g.block_size} must be a multiple of "
                    f"hash_block_size={h}",
                    field=f"groups.{i}.block_size",
                )
            if sched % g.block_size:
                raise InvalidRequest(
                    f"scheduler_block_size={sched} must be a multiple of "
                    f"groups[{i}].block_size={g.block_size}",
                    field=f"groups.{i}.block_size",
                )

    def _check_026(self) -> None:
        """vLLM 0.26 has none of the 0.32+ inputs: each must be at its default."""
        for name, default in (
            ("cache_hit_alignment_tokens", None),
            ("store_namespace", ""),
            ("store_tp_size", None),
        ):
            if getattr(self, name) != default:
                raise InvalidRequest(
                    f"{name} is a vLLM 0.32+ input: with vllm_version 0.26.0 it must be "
                    f"{default!r}",
                    field=name,
                )
        for i, g in enumerate(self.groups):
            if isinstance(g, CircularBuffer):
                raise InvalidRequest(
                    f"groups[{i}] is a circular_buffer group, a vLLM 0.32+ kind: vLLM 0.26 "
                    "has none",
                    field=f"groups.{i}.kind",
                )
            bad = non_default_fields(g)
            if bad:
                raise InvalidRequest(
                    f"groups[{i}].{bad[0]} is a vLLM 0.32+ field: with vllm_version 0.26.0 it "
                    "must be left at its default",
                    field=f"groups.{i}.{bad[0]}",
                )
        self._check_sizes(list(enumerate(self.groups)))

    def _era_c_geometry(self) -> Geometry:
        """vLLM 0.32 / 0.33: the store groups, their namespaces and lookup rules."""
        h, sched = self.hash_block_size, self.scheduler_block_size
        store = [(i, g) for i, g in enumerate(self.groups) if g.prefix_cacheable]
        if not store:
            raise InvalidRequest(
                "no prefix-cacheable group: vLLM's store connector refuses such a model",
                field="groups",
            )
        if self.pcp_size > 1 and len(store) > 1:
            raise InvalidRequest(
                "pcp_size > 1 with more than one prefix-cacheable group: vLLM's store "
                "connector refuses it",
                field="pcp_size",
            )
        self._check_sizes(store)
        cha = self.cache_hit_alignment_tokens
        if cha is not None and cha not in (h, sched):
            raise InvalidRequest(
                f"cache_hit_alignment_tokens={cha}: vLLM resolves it to hash_block_size ({h}, "
                f"fine-grained hits) or scheduler_block_size ({sched}); null means {sched}",
                field="cache_hit_alignment_tokens",
            )
        fine = cha is not None and cha < sched
        if fine:
            for i, g in store:
                if not isinstance(g, (FullAttention, Mamba)) and g.block_size != h:
                    raise InvalidRequest(
                        f"groups[{i}] ({g.kind}, block_size={g.block_size}): with fine-grained "
                        f"hits (cache_hit_alignment_tokens={cha}) every group other than full "
                        "attention or mamba has the hash block size (vLLM turns the mode off "
                        "otherwise)",
                        field="cache_hit_alignment_tokens",
                    )
        n = self.store_tp_size
        if n is not None:
            lone = store[0][1] if len(store) == 1 else None
            if not (
                isinstance(lone, FullAttention)
                and not lone.mla
                and self.pcp_size == 1
                and self.dcp_size == 1
                and n >= self.tp_size
                and n % self.tp_size == 0
                and self.num_kv_heads % n == 0
            ):
                raise InvalidRequest(
                    f"store_tp_size={n}: vLLM sets it only for a TP-sharded store layout (one "
                    "prefix-cacheable full-attention group, not MLA; pcp_size = dcp_size = 1; "
                    "a multiple of tp_size that divides num_kv_heads)",
                    field="store_tp_size",
                )
        store_ids: list[int | None] = [None] * len(self.groups)
        for gid, (i, _) in enumerate(store):
            store_ids[i] = gid
        per_group: list[tuple[Namespace, ...]] = []
        for _, g in store:
            factor = replication_factor(
                self.tp_size,
                self.dcp_size,
                self.num_kv_heads,
                mamba=isinstance(g, Mamba),
                mla=bool(getattr(g, "mla", False)),
            )
            per_group.append(
                group_namespaces(
                    self.tp_size, self.pcp_size, self.dcp_size, self.pp_size, factor, n
                )
            )
        groups = [g for _, g in store]
        rules = EraCRules(
            self.vllm_version,
            groups,
            tuple(store_ids),
            hash_block_size=h,
            scheduler_block_size=sched,
            use_eagle=self.use_eagle,
            fine=fine,
        )
        return Geometry(
            groups,
            model=self.model,
            cache_prefix=self.cache_prefix,
            hash_block_size=h,
            scheduler_block_size=sched,
            use_eagle=self.use_eagle,
            namespaces=per_group[0],
            store_namespace=self.store_namespace,
            group_namespaces=tuple(per_group),
            rules=rules,
        )

    @property
    def namespaces(self) -> tuple[tuple[int, int, int, int], ...]:
        """The rank namespaces ``(tp, pcp, dcp, pp)`` every chunk has a key in, in key order
        (vLLM 0.32+: those of the first store group; see :attr:`group_namespaces`)."""
        return self._geometry.namespaces

    @property
    def group_namespaces(self) -> tuple[tuple[tuple[int, int, int, int], ...], ...]:
        """Per store group (vLLM 0.32+: the prefix-cacheable groups, renumbered; 0.26: every
        group): the rank namespaces of its keys, in key order."""
        return self._geometry.group_namespaces

    @property
    def key_prefixes(self) -> tuple[tuple[str, ...], ...]:
        """Per store group, per namespace: the key prefix (the key is ``prefix@hex(hash)``)."""
        return self._geometry.key_prefixes

    @property
    def store_group_ids(self) -> tuple[int | None, ...]:
        """Per group: its id in the keys (``@group:<G>``), None when vLLM ignores it (a group
        that is not prefix-cacheable, vLLM 0.32+)."""
        rules = self._geometry.rules
        return tuple(range(len(self.groups))) if rules is None else rules.store_ids

    @property
    def spec_groups(self) -> tuple[tuple[tuple[int, ...], bool], ...]:
        """vLLM's merged spec-groups, in the order its hit search visits them (full attention
        first): each one's member store groups, and whether EAGLE applies to it."""
        rules = self._geometry.rules
        if rules is None:
            return tuple((sg.group_ids, sg.drop_eagle) for sg in self._geometry.spec_groups)
        return tuple((sg.group_ids, sg.eagle) for sg in rules.spec_groups)

    @property
    def fine_grained(self) -> bool:
        """vLLM 0.32+ partial hash hits: ``cache_hit_alignment_tokens < scheduler_block_size``
        (the lookup then aligns to the hash block)."""
        rules = self._geometry.rules
        return rules is not None and rules.fine

    @property
    def lookup_alignment(self) -> int:
        """What the lookup aligns request lengths to: the scheduler block, or the hash block
        in fine-grained mode."""
        rules = self._geometry.rules
        return self.scheduler_block_size if rules is None else rules.alignment

    # ------------------------------------------------------------------------------ from vLLM
    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any) -> KVLayout:
        """The layout of a running vLLM engine (0.32 or 0.33), read as its Mooncake store worker
        reads it: groups and block sizes from ``kv_cache_config``; EAGLE, ranks, KV heads and
        the model from ``vllm_config``; ``cache_prefix`` and the store namespace from the
        connector's extra config; the rules of ``vllm.__version__``. The result is checked
        against vLLM's own store coordinator. :class:`UnsupportedLayout` (an
        :class:`InvalidRequest`) for a release or layout that cannot be reproduced exactly."""
        groups, arguments = layout_arguments(vllm_config, kv_cache_config)
        layout = cls(groups, **arguments)
        check_against_vllm(layout, vllm_config, kv_cache_config)
        return layout

    # ------------------------------------------------------------------------------ dict form
    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> KVLayout:
        """Build a layout from the JSON-friendly form (the conformance cases' ``config``).

        Required: ``model``, ``hash_block_size``, ``scheduler_block_size``, ``groups`` (each
        ``{"kind": ..., "block_size": ...}``; ``sliding_window`` for ``sliding_window``,
        ``attention_chunk_size`` for ``chunked_local``; vLLM 0.32+ also ``mla``, ``eagle``,
        ``prefix_cacheable``, ``extra_retained_tokens`` and kind ``circular_buffer``).
        Optional: ``vllm_version`` (default ``"0.33.0"``), ``cache_prefix``, ``use_eagle``,
        ``tp_size``, ``pcp_size``, ``dcp_size``, ``pp_size``, ``num_kv_heads`` (required when
        ``tp_size > 1`` and ``dcp_size == 1``) and, vLLM 0.32+, ``cache_hit_alignment_tokens``,
        ``store_namespace``, ``store_tp_size``; on any release ``hash_bytes`` (the hashes' width,
checked). Unknown keys raise :class:`InvalidRequest`.
        """
        if not isinstance(cfg, Mapping):
            raise InvalidRequest(f"layout must be a mapping, got {type(cfg).__name__}")
        unknown = set(cfg) - _LAYOUT_FIELDS
        if unknown:
            raise InvalidRequest(f"unknown layout field(s): {', '.join(sorted(map(str, unknown)))}")
        normalise_version(cfg.get("vllm_version", DEFAULT_VERSION))  # named first if wrong
        for required in ("model", "hash_block_size", "scheduler_block_size", "groups"):
            if required not in cfg:
                raise InvalidRequest(f"layout field {required!r} is required", field=required)
        raw_groups = cfg["groups"]
        if not isinstance(raw_groups, Sequence) or isinstance(raw_groups, (str, bytes)):
            raise InvalidRequest(f"groups must be a list, got {raw_groups!r}", field="groups")
        groups = [cls._group_from_dict(i, g) for i, g in enumerate(raw_groups)]
        options = {k: v for k, v in cfg.items() if k != "groups"}
        return cls(groups, **options)

    @staticmethod
    def _group_from_dict(index: int, raw: object) -> GroupSpec:
        if not isinstance(raw, Mapping):
            raise InvalidRequest(
                f"groups[{index}] must be a mapping, got {raw!r}", field=f"groups.{index}"
            )
        kind = raw.get("kind")
        spec_cls = KINDS.get(kind) if isinstance(kind, str) else None
        if spec_cls is None:
            raise InvalidRequest(
                f"groups[{index}].kind={kind!r} is not one of {', '.join(sorted(KINDS))}",
                field=f"groups.{index}.kind",
            )
        fields = {k: v for k, v in raw.items() if k != "kind"}
        allowed = {f.name for f in dataclasses.fields(spec_cls)}
        required = {
            f.name
            for f in dataclasses.fields(spec_cls)
            if f.default is dataclasses.MISSING
        }
        extra = set(fields) - allowed
        missing = required - set(fields)
        if extra or missing:
            raise InvalidRequest(
                f"groups[{index}] ({kind}) takes {sorted(allowed)} (required "
                f"{sorted(required)}); unknown {sorted(extra)}, missing {sorted(missing)}",
                field=f"groups.{index}",
            )
        for name, value in fields.items():
            where = f"groups[{index}].{name}"
            if name in _FLAG_FIELDS:
                if not isinstance(value, bool):
                    raise InvalidRequest(
                        f"{where} must be a bool, got {value!r}", field=f"groups.{index}.{name}"
                    )
            elif name == "extra_retained_tokens":
                if integer(where, value, f"groups.{index}.{name}") < 0:
                    raise InvalidRequest(
                        f"{where} must be >= 0, got {value!r}", field=f"groups.{index}.{name}"
                    )
            else:
                positive_int(where, value, f"groups.{index}.{name}")
        try:
            return spec_cls(**fields)
        except InvalidRequest as exc:
            raise InvalidRequest(
                f"groups[{index}]: {exc}", field=f"groups.{index}.{exc.field}"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON-friendly form; ``KVLayout.from_dict(layout.to_dict())`` is equal. It always
        names its ``vllm_version`` (as ``"x.y.0"``); group fields of vLLM 0.32+ appear when
        not at their default, and the 0.32+ top-level fields on 0.32+ layouts."""
        out: dict[str, Any] = {
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
        if self.vllm_version != "0.26.0":
            out["cache_hit_alignment_tokens"] = self.cache_hit_alignment_tokens
            out["store_namespace"] = self.store_namespace
            out["store_tp_size"] = self.store_tp_size
        if self.hash_bytes is not None:
            out["hash_bytes"] = self.hash_bytes
        out["vllm_version"] = self.vllm_version
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVLayout) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(repr(self.to_dict()))

    def __repr__(self) -> str:
        groups = ", ".join(repr(g) for g in self.groups)
        return (
            f"KVLayout([{groups}], model={self.model!r}, hash_block_size={self.hash_block_size}, "
            f"scheduler_block_size={self.scheduler_block_size}, "
            f"namespaces={len(self.namespaces)}, use_eagle={self.use_eagle}, "
            f"vllm_version={self.vllm_version!r})"
        )

    # ------------------------------------------------------------------------------- requests
    def align(self, num_tokens: int) -> int:
        """The aligned length vLLM looks up for a prompt of ``num_tokens`` tokens:
        ``num_tokens`` floored to :attr:`lookup_alignment` (the scheduler block; the hash block
        in vLLM 0.32+'s fine-grained mode), 0 when shorter (no lookup).

        vLLM 0.26's scheduler sends this as ``token_len`` and then applies "leave one token
        to compute" to the *result* (see :meth:`leave_one_token`); vLLM 0.32+ sends
        ``num_tokens`` itself and the worker aligns it (and re-derives a full hit).
        """
        n = integer("num_tokens", num_tokens)
        a = self.lookup_alignment
        return max(0, n) // a * a

    def leave_one_token(self, hit: int, num_tokens: int) -> int:
        """vLLM 0.26's scheduler rule: a hit covering the whole prompt is lowered so at least
        one token is computed. (vLLM 0.32+ lowers it inside the lookup: the hit is returned
        unchanged.)"""
        if self.vllm_version == "0.26.0" and hit == num_tokens:
            return max(0, (num_tokens - 1) // self.scheduler_block_size * self.scheduler_block_size)
        return hit

    def plan(self, num_tokens: int, block_hashes: HashInput) -> LookupPlan:
        """Plan one lookup: the candidate keys vLLM would probe, in its order.

        The length is what that release's scheduler hands the worker: on vLLM 0.26 the aligned
        ``token_len`` (a multiple of ``scheduler_block_size``: use :meth:`align`); on vLLM
        0.32+ the request's ``num_tokens`` as it is (aligned inside). ``block_hashes`` is a
        sequence of ``bytes`` (one per ``hash_block_size`` tokens) or a 2-D ``uint8`` numpy
        array of fixed-width hashes. Raises :class:`InvalidRequest` for a malformed request, and,
        with :attr:`hash_bytes` set, for hashes of another width (keys no engine writes).
        """
        if self.hash_bytes is not None:
            check_width(block_hashes, (self.hash_bytes,))
        geometry = self._geometry
        if geometry.rules is None:
            return build_plan(geometry, num_tokens, block_hashes)
        return build_era_c_plan(geometry, num_tokens, block_hashes)

