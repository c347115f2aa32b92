"""What planning and resolving need to know of a layout, derived once per layout.

:class:`Geometry` is private to the package: a :class:`~aio_mclookup.KVLayout` builds one
and hands it to the planner; nothing here is public API.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .groups import ChunkedLocalAttention, FullAttention, GroupSpec, SpecGroup
from .namespaces import Namespace, key_prefix
from .rules import EraCRules

__all__ = ["ITEM_END", "Geometry", "item_joiners"]

ITEM_END = b"\n"
"""Ends every key of a chunk item (see ``_plan.keys.assemble_items``): a byte no item's key
contains (layouts whose prefixes hold it make no items, though their plain keys hold it), and
no key ends with (keys end in hex or ``@``)."""


def item_joiners(heads: Sequence[bytes], tails: Sequence[bytes]) -> tuple[bytes, ...]:
    """What a chunk's hash in hex joins to make its item (``_plan.keys.hex_join``):
    ``heads[s] + hex + tails[s]`` for every slot ``s``, each followed by :data:`ITEM_END`."""
    if len(tails) != len(heads):
        raise ValueError("heads and tails must be as many")
    if not heads:
        return ()
    between = (tail + ITEM_END + head for tail, head in zip(tails[:-1], heads[1:]))
    return (heads[0], *between, tails[-1] + ITEM_END)


class Geometry:
    """A layout's groups, key prefixes (as bytes and as uint8 rows), merged spec-groups and
    the facts the planner branches on, computed once."""

    __slots__ = (
        "__weakref__",
        "block_sizes",
        "group_namespaces",
        "groups",
        "has_chunked_local",
        "has_full_attention",
        "hash_block_size",
        "item_joiners",
        "key_prefixes",
        "key_separators",
        "key_tails",
        "lone_full_attention",
        "multi_pass",
        "namespaces",
        "prefix_bytes",
        "prefix_rows",
        "rules",
        "scheduler_block_size",
        "spec_groups",
        "use_eagle",
    )

    def __init__(
        self,
        groups: Sequence[GroupSpec],
        *,
        model: str,
        cache_prefix: str,
        hash_block_size: int,
        scheduler_block_size: int,
        use_eagle: bool,
        namespaces: tuple[Namespace, ...],
        store_namespace: str = "",
        group_namespaces: tuple[tuple[Namespace, ...], ...] | None = None,
        rules: EraCRules | None = None,
    ) -> None:
        self.groups: tuple[GroupSpec, ...] = tuple(groups)
        self.hash_block_size = hash_block_size
        self.scheduler_block_size = scheduler_block_size
        self.use_eagle = use_eagle
        self.rules = rules
        """vLLM 0.32 / 0.33 rules (None: vLLM 0.26). Then ``groups`` are the store's
        (prefix-cacheable) groups, and ``group_namespaces`` says each one's namespaces
        (``namespaces`` is the first group's)."""
        self.namespaces = namespaces
        per_group = group_namespaces or (namespaces,) * len(self.groups)
        self.group_namespaces: tuple[tuple[Namespace, ...], ...] = per_group
        self.key_prefixes: tuple[tuple[str, ...], ...] = tuple(
            tuple(key_prefix(cache_prefix, model, g, ns, store_namespace) for ns in nss)
            for g, nss in enumerate(per_group)
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
        # Per group, what follows the hash in each namespace's key (nothing, for vLLM), and
        # what a chunk's hex joins to make its item (the keys in every namespace as one entry).
        self.key_tails: tuple[tuple[bytes, ...], ...] = tuple(
            (b"",) * len(ps) for ps in self.prefix_bytes
        )
        self.item_joiners: tuple[tuple[bytes, ...], ...] = tuple(
            item_joiners(ps, tails) for ps, tails in zip(self.prefix_bytes, self.key_tails)
        )
        # Per group with one namespace: a byte found in no key prefix, so that a run of keys
        # can be built by C calls (hex with this separator, prefix it, split on it).
        self.key_separators: tuple[bytes | None, ...] = tuple(
            next((sep for sep in (b"\x00", b"\n", b" ") if sep not in ps[0]), None)
            if len(ps) == 1
            else None
            for ps in self.prefix_bytes
        )
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
            SpecGroup(spec, tuple(ids), use_eagle) for spec, ids in ordered
        )
        # vLLM's convergence loop makes a single pass for one spec-group, or for exactly two
        # with full attention first; otherwise it repeats until the hit stops falling.
        self.multi_pass = len(self.spec_groups) > 2 or (
            len(self.spec_groups) == 2 and not isinstance(self.spec_groups[0].spec, FullAttention)
        )
