"""Rank namespaces and key prefixes: which workers' keys a chunk has, and how they are spelled.

vLLM 0.26 writes one key per chunk for every rank namespace ``(tp, pcp, dcp, pp)`` whose
worker holds a distinct shard, as ``[cache_prefix@]model@tp_rank:T@pcpP@dcpD@pp_rank:R@group:G``
followed by ``@`` and the chunk hash in lower-case hex (see docs/layouts.md).
"""

from __future__ import annotations

__all__ = [
    "Namespace",
    "group_namespaces",
    "key_prefix",
    "model_name",
    "rank_namespaces",
    "replication_factor",
]

Namespace = tuple[int, int, int, int]
"""(tp, pcp, dcp, pp) ranks of one key namespace."""


def rank_namespaces(
    tp_size: int, pcp_size: int, dcp_size: int, pp_size: int, num_kv_heads: int
) -> tuple[Namespace, ...]:
    """The namespaces a chunk has keys in, in vLLM 0.26's order: PCP outermost, then TP, then
    PP. With DCP, every TP rank holds a shard (its DCP rank is ``tp % dcp``); without, only
    the first ``min(tp, num_kv_heads)`` TP ranks hold distinct heads."""
    if dcp_size > 1:
        return tuple(
            (tp, pcp, tp % dcp_size, pp)
            for pcp in range(pcp_size)
            for tp in range(tp_size)
            for pp in range(pp_size)
        )
    tp_count = min(tp_size, num_kv_heads)
    return tuple(
        (tp, pcp, 0, pp)
        for pcp in range(pcp_size)
        for tp in range(tp_count)
        for pp in range(pp_size)
    )


def model_name(model: str) -> str:
    """The model's last path component, as vLLM puts it in keys."""
    return model.rstrip("/").split("/")[-1]


def replication_factor(
    tp_size: int, dcp_size: int, num_kv_heads: int, *, mamba: bool, mla: bool
) -> int:
    """vLLM 0.32+: how many TP ranks hold the same copy of one group's KV. Under DCP every
    rank is distinct; a Mamba state is sharded across TP; MLA is replicated on every rank;
    otherwise each KV head is replicated ``tp // num_kv_heads`` times (at least once)."""
    if dcp_size > 1 or mamba:
        return 1
    if mla:
        return tp_size
    return max(1, tp_size // num_kv_heads)


def group_namespaces(
    tp_size: int,
    pcp_size: int,
    dcp_size: int,
    pp_size: int,
    factor: int,
    store_tp_size: int | None = None,
) -> tuple[Namespace, ...]:
    """vLLM 0.32+: one group's namespaces, PCP outermost, then TP shard, then PP. A TP-sharded
    store layout (``store_tp_size``) has one key per store shard and PP rank instead."""
    if store_tp_size is not None:
        return tuple((s, 0, 0, pp) for s in range(store_tp_size) for pp in range(pp_size))
    if dcp_size > 1:
        return rank_namespaces(tp_size, pcp_size, dcp_size, pp_size, tp_size)
    return tuple(
        (shard, pcp, 0, pp)
        for pcp in range(pcp_size)
        for shard in range(tp_size // factor)
        for pp in range(pp_size)
    )


def key_prefix(
    cache_prefix: str, model: str, group: int, namespace: Namespace, store_namespace: str = ""
) -> str:
    """A key's prefix for one group and namespace (without the ``@`` before the hash); vLLM
    0.32+ puts ``store_namespace`` right after the model name."""
    tp, pcp, dcp, pp = namespace
    head = f"{cache_prefix}@" if cache_prefix else ""
    return (
        f"{head}{model_name(model)}{store_namespace}@tp_rank:{tp}@pcp{pcp}@dcp{dcp}"
        f"@pp_rank:{pp}@group:{group}"
    )
