"""Prometheus text exposition of the coordinator's statistics (no FastAPI needed)."""

from __future__ import annotations

import math
import re

import pytest

from aio_mclookup import FakeStore, FullAttention, KVLayout, LookupCoordinator
from aio_mclookup._observe.prometheus import PROMETHEUS_CONTENT_TYPE, prometheus_text
from aio_mclookup._observe.stats import CoordinatorStats

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

REQUIRED = {
    "aio_mclookup_lookups_total": "counter",
    "aio_mclookup_rpcs_total": "counter",
    "aio_mclookup_keys_sent_total": "counter",
    "aio_mclookup_errors_total": "counter",
    "aio_mclookup_cache_hits_total": "counter",
    "aio_mclookup_pending_lookups": "gauge",
    "aio_mclookup_lookup_seconds": "histogram",
    "aio_mclookup_rpc_seconds": "histogram",
    "aio_mclookup_keys_per_rpc": "histogram",
    "aio_mclookup_lookups_per_dispatch": "histogram",
}


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse(text: str) -> tuple[dict[str, str], dict[tuple[str, frozenset[tuple[str, str]]], float]]:
    """A strict little parser: family types, and samples keyed by (name, labels)."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    helps: set[str] = set()
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in helps, f"duplicate HELP for {name}"
            helps.add(name)
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name in helps, f"TYPE before HELP for {name}"
            assert name not in types, f"duplicate TYPE for {name}"
            types[name] = kind
            continue
        m = _SAMPLE.match(line)
        assert m, f"bad sample line {line!r}"
        name, raw_labels, raw_value = m.groups()
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or types.get(family) == "histogram", f"{name} has no TYPE"
        labels = frozenset((k, _unescape(v)) for k, v in _LABEL.findall(raw_labels or ""))
        key = (name, labels)
        assert key not in samples, f"duplicate sample {line!r}"
        samples[key] = float(raw_value)
    return types, samples


def _stats() -> CoordinatorStats:
    stats = CoordinatorStats(
        lookups_total=10,
        rpcs_total=3,
        keys_sent_total=120,
        cache_hits_total=7,
        pending_lookups=2,
        store_healthy=False,
        last_rpc_ok_age=1.5,
    )
    stats.count_error("-900")
    stats.count_error("-900")
    stats.count_error("timeout")
    for seconds in (0.0002, 0.003, 0.003, 20.0):
        stats.lookup_seconds.observe(seconds)
    for keys in (1, 40, 40, 1000, 60000):
        stats.keys_per_rpc.observe(keys)
    return stats


def test_required_families_have_help_type_and_values() -> None:
    types, samples = parse(prometheus_text(_stats()))
    for name, kind in REQUIRED.items():
        assert types.get(name) == kind, name
    assert samples[("aio_mclookup_lookups_total", frozenset())] == 10
    assert samples[("aio_mclookup_rpcs_total", frozenset())] == 3
    assert samples[("aio_mclookup_keys_sent_total", frozenset())] == 120
    assert samples[("aio_mclookup_cache_hits_total", frozenset())] == 7
    assert samples[("aio_mclookup_pending_lookups", frozenset())] == 2
    assert samples[("aio_mclookup_store_healthy", frozenset())] == 0
    assert samples[("aio_mclookup_last_rpc_ok_age_seconds", frozenset())] == 1.5
    assert samples[("aio_mclookup_errors_total", frozenset({("code", "-900")}))] == 2
    assert samples[("aio_mclookup_errors_total", frozenset({("code", "timeout")}))] == 1


def test_histograms_are_cumulative_and_consistent() -> None:
    stats = _stats()
    _, samples = parse(prometheus_text(stats))
    for name, hist in (
        ("aio_mclookup_lookup_seconds", stats.lookup_seconds),
        ("aio_mclookup_keys_per_rpc", stats.keys_per_rpc),
    ):
        buckets = sorted(
            (float(dict(labels)["le"]), value)
            for (n, labels), value in samples.items()
            if n == f"{name}_bucket"
        )
        assert [b for b, _ in buckets] == [*map(float, hist.buckets), math.inf]
        counts = [v for _, v in buckets]
        assert counts == sorted(counts), "buckets must be cumulative"
        assert counts[-1] == samples[(f"{name}_count", frozenset())] == hist.count
        assert samples[(f"{name}_sum", frozenset())] == pytest.approx(hist.sum)
    _, samples = parse(prometheus_text(stats))
    le = {
        dict(labels)["le"]: v
        for (n, labels), v in samples.items()
        if n == "aio_mclookup_lookup_seconds_bucket"
    }
    assert le["0.00025"] == 1 and le["0.005"] == 3 and le["10.0"] == 3 and le["+Inf"] == 4
    keys = {
        dict(labels)["le"]: v
        for (n, labels), v in samples.items()
        if n == "aio_mclookup_keys_per_rpc_bucket"
    }
    assert keys["1.0"] == 1 and keys["64.0"] == 3 and keys["1000.0"] == 4 and keys["+Inf"] == 5


def test_empty_stats_render() -> None:
    types, samples = parse(prometheus_text(CoordinatorStats()))
    assert set(REQUIRED) <= set(types)
    assert not any(n == "aio_mclookup_errors_total" for n, _ in samples)
    assert ("aio_mclookup_last_rpc_ok_age_seconds", frozenset()) not in samples
    assert samples[("aio_mclookup_lookup_seconds_bucket", frozenset({("le", "+Inf")}))] == 0


def test_namespace_and_label_escaping() -> None:
    stats = CoordinatorStats()
    stats.count_error('we"ird\\code\nx')
    types, samples = parse(prometheus_text(stats, namespace="router_kv"))
    assert "router_kv_rpcs_total" in types and "aio_mclookup_rpcs_total" not in types
    assert samples[("router_kv_errors_total", frozenset({("code", 'we"ird\\code\nx')}))] == 1
    types, _ = parse(prometheus_text(stats, namespace=""))
    assert "rpcs_total" in types
    with pytest.raises(ValueError, match="namespace"):
        prometheus_text(stats, namespace="bad-name")
    assert PROMETHEUS_CONTENT_TYPE.startswith("text/plain; version=0.0.4")


def test_official_parser_accepts_the_text() -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name: f for f in parser.text_string_to_metric_families(prometheus_text(_stats()))}
    # The official parser strips "_total" from counter family names.
    assert families["aio_mclookup_rpcs"].type == "counter"
    assert families["aio_mclookup_keys_per_rpc"].type == "histogram"
    assert families["aio_mclookup_pending_lookups"].type == "gauge"


async def test_live_coordinator_counters_match_the_fake_store() -> None:
    layout = KVLayout(
        [FullAttention(16)], model="org/toy", hash_block_size=16, scheduler_block_size=16
    )
    hashes = [bytes([i]) * 32 for i in range(4)]
    store = FakeStore(delay=0.001)
    store.add(k.decode() for k in layout.plan(32, hashes[:2]).keys)
    async with LookupCoordinator(layout, store, cache_ttl=None) as coordinator:
        hits = [await coordinator.lookup(64, hashes) for _ in range(3)]
        text = prometheus_text(coordinator.stats())
    assert hits == [32, 32, 32]
    _, samples = parse(text)
    assert samples[("aio_mclookup_lookups_total", frozenset())] == 3
    assert samples[("aio_mclookup_rpcs_total", frozenset())] == len(store.calls)
    assert samples[("aio_mclookup_keys_sent_total", frozenset())] == sum(map(len, store.calls))
    assert samples[("aio_mclookup_lookup_seconds_count", frozenset())] == 3
    assert samples[("aio_mclookup_keys_per_rpc_count", frozenset())] == len(store.calls)
    assert samples[("aio_mclookup_hit_tokens_total", frozenset())] == 96
