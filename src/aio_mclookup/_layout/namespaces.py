"""Rank namespaces and key prefixes: which workers' keys a chunk has, and how they are spelled.

vLLM 0.26 writes one key per chunk for every rank namespace ``(tp, pcp, dcp, pp)`` whose
worker holds a distinct shard, as ``[cache_prefix@]model@tp_rank:T@pcpP@dcpD@pp_rank:R@group:G``
followed by ``@`` and the chunk hash in lower-case hex (see docs/layouts.md).
"""

from __future__ import annotations

__all__ = ["Namespace", "key_prefix", "model_name", "rank_namespaces"]

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


def key_prefix(cache_prefix: str, model: str, group: int, namespace: Namespace) -> str:
    """A key's prefix for one group and namespace (without the ``@`` before the hash)."""
    tp, pcp, dcp, pp = namespace
    head = f"{cache_prefix}@" if cache_prefix else ""
    return f"{head}{model_name(model)}@tp_rank:{tp}@pcp{pcp}@dcp{dcp}@pp_rank:{pp}@group:{group}"
