"""What planning needs of an SGLang HiCache deployment, derived once (:class:`SGLangGeometry`).

The key of page hash ``H`` in slot ``j`` of a page is ``prefix + hex(H) + suffixes[j]``:
``prefix`` is ``[tag_][model_]`` and each suffix ``_{rank}[_{pp}]_{k|v}`` (``__k`` / ``_{pp}_k``
for MLA). The slots are the distinct keys every querying rank probes for one page, ranks by
(pp, tp), then ``k`` before ``v``, virtual (split-head) ranks in order.

To the coordinator's core the deployment looks like a lone full-attention group of
``page_size``-token chunks with one key per slot: the rounds then probe pages in order and
stop at the first page any rank misses (its *prefix mode*), and its caches tell layouts apart
by ``prefix_bytes[0]``, which here holds each slot's key pattern.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .geometry import ITEM_END, Geometry, item_joiners
from .groups import FullAttention
from .namespaces import Namespace

__all__ = ["SGLangGeometry", "key_parts"]

_HASH_MARK = b"\x00"
"""Marks the hash's place in a slot's key pattern (the suffixes never hold it)."""


def key_parts(
    *,
    model_name: str | None,
    extra_backend_tag: str | None,
    tp_size: int,
    pp_size: int,
    mla: bool,
    heads_split: int,
) -> tuple[bytes, tuple[bytes, ...], tuple[Namespace, ...]]:
    """The key prefix (with its trailing ``_``, or empty), the suffix of every slot, and each
    slot's ``(tp or virtual rank, 0 for k / 1 for v, 0, pp)``."""
    parts = []
    if extra_backend_tag is not None:  # ("" counts: the key then starts with "_")
        parts.append(extra_backend_tag)
    if model_name:
        parts.append(model_name.replace("/", "-"))
    prefix = "".join(part + "_" for part in parts).encode()
    suffixes: list[bytes] = []
    slots: list[Namespace] = []
    for pp in range(pp_size):
        stage = "" if pp_size == 1 else f"_{pp}"
        if mla:  # one object per page and stage, whichever TP rank probes it
            suffixes.append(f"_{stage[1:]}_k".encode())
            slots.append((0, 0, 0, pp))
            continue
        for tp in range(tp_size):
            for rank in range(tp * heads_split, (tp + 1) * heads_split):
                for kv, letter in enumerate("kv"):
                    suffixes.append(f"_{rank}{stage}_{letter}".encode())
                    slots.append((rank, kv, 0, pp))
    return prefix, tuple(suffixes), tuple(slots)


class SGLangGeometry(Geometry):
    """An SGLang deployment's keys and hit rule, as the planner and the coordinator read them
    (see the module docstring)."""

    __slots__ = (
        "eagle",
        "item_keys",
        "key_heads",
        "key_prefix",
        "key_suffixes",
        "page_size",
        "prefetch_threshold",
        "prefix_row",
        "suffix_rows",
    )

    def __init__(
        self,
        *,
        page_size: int,
        eagle: bool,
        prefetch_threshold: int,
        key_prefix: bytes,
        key_suffixes: tuple[bytes, ...],
        slots: tuple[Namespace, ...],
    ) -> None:
        super().__init__(
            [FullAttention(page_size)],
            model="sglang",
            cache_prefix="",
            hash_block_size=page_size,
            scheduler_block_size=page_size,
            use_eagle=False,  # (SGLang's EAGLE is in its page hashes, not in its hit)
            namespaces=slots,
        )
        self.page_size = page_size
        self.eagle = eagle
        self.prefetch_threshold = prefetch_threshold
        self.key_prefix = key_prefix
        self.key_suffixes = key_suffixes
        patterns = tuple(key_prefix + _HASH_MARK + suffix for suffix in key_suffixes)
        # vLLM's key fields, replaced: no vLLM key assembly applies to these keys (the hash
        # goes between key_heads and key_tails, below).
        self.key_prefixes = (tuple(p.decode() for p in patterns),)
        self.prefix_bytes = (patterns,)
        self.prefix_rows = (None,)
        self.key_separators = (None,)
        self.prefix_row: npt.NDArray[np.uint8] = np.frombuffer(key_prefix, dtype=np.uint8)
        self.suffix_rows: npt.NDArray[np.uint8] | None = (
            np.frombuffer(b"".join(key_suffixes), dtype=np.uint8).reshape(len(key_suffixes), -1)
            if len(set(map(len, key_suffixes))) == 1
            else None
        )
        """The suffixes as a (slots, width) matrix when they share one width (the vectorised
        key assembly), else None."""
        k = len(key_suffixes)
        self.item_keys = (
            k if k > 1 and ITEM_END not in key_prefix and not any(
                ITEM_END in suffix for suffix in key_suffixes
            ) else 1
        )
        """A page's keys in every slot make one coordinator item (several slots, and no key
        holds :data:`ITEM_END`): how many; else 1."""
        self.key_heads = (key_prefix,) * k
        """What comes before the hash in each slot's key (the prefix, in every slot)."""
        self.key_tails = (key_suffixes,)
        self.item_joiners = (item_joiners(self.key_heads, key_suffixes),)

    @property
    def keys_per_page(self) -> int:
        return len(self.key_suffixes)
