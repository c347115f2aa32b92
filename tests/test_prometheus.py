"""Prometheus exposition of the coordinator's statistics: the ``prometheus_client`` collector
and the text it renders (no FastAPI needed)."""

# ruff: noqa: E501  (OLD_TEXT, at the end, is the old exposition verbatim; its HELP lines are long)

from __future__ import annotations

import asyncio
import math
import re
import sys

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

import aio_mclookup
from aio_mclookup import FakeStore, FullAttention, KVLayout, LookupCoordinator
from aio_mclookup._observe.prometheus import (
    PROMETHEUS_CONTENT_TYPE,
    CoordinatorCollector,
    check_namespace,
    metric_family,
    prometheus_text,
)
from aio_mclookup._observe.stats import CoordinatorStats, Histogram

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

# What the hand-written renderer (before prometheus_client) printed for ``_stats()``: names,
# types, labels and help texts must not change (dashboards and checks use them). Only the
# number format (``10`` -> ``10.0``) and the order of ``_sum``/``_count`` within a histogram
# may differ.
OLD_TEXT = """\
# HELP aio_mclookup_lookups_total Lookups that finished, with a result or an error.
# TYPE aio_mclookup_lookups_total counter
aio_mclookup_lookups_total 10
# HELP aio_mclookup_lookups_failed_total Lookups that ended in an error.
# TYPE aio_mclookup_lookups_failed_total counter
aio_mclookup_lookups_failed_total 0
# HELP aio_mclookup_lookups_cancelled_total Lookups cancelled by their caller.
# TYPE aio_mclookup_lookups_cancelled_total counter
aio_mclookup_lookups_cancelled_total 0
# HELP aio_mclookup_rpcs_total batch_is_exist RPCs sent to the store.
# TYPE aio_mclookup_rpcs_total counter
aio_mclookup_rpcs_total 3
# HELP aio_mclookup_rpc_errors_total batch_is_exist RPCs that failed.
# TYPE aio_mclookup_rpc_errors_total counter
aio_mclookup_rpc_errors_total 0
# HELP aio_mclookup_keys_planned_total Keys a per-request loop (vLLM's) would have sent for the same lookups.
# TYPE aio_mclookup_keys_planned_total counter
aio_mclookup_keys_planned_total 0
# HELP aio_mclookup_keys_sent_total Keys sent to the store, after dedup, cache and probing in rounds.
# TYPE aio_mclookup_keys_sent_total counter
aio_mclookup_keys_sent_total 120
# HELP aio_mclookup_cache_hits_total Keys answered from the short-lived positive-answer cache.
# TYPE aio_mclookup_cache_hits_total counter
aio_mclookup_cache_hits_total 7
# HELP aio_mclookup_dedup_hits_total Keys shared with another lookup's pending or in-flight probe.
# TYPE aio_mclookup_dedup_hits_total counter
aio_mclookup_dedup_hits_total 0
# HELP aio_mclookup_rounds_total Probe rounds over all lookups.
# TYPE aio_mclookup_rounds_total counter
aio_mclookup_rounds_total 0
# HELP aio_mclookup_dispatches_total Dispatches (batches of lookups sent together).
# TYPE aio_mclookup_dispatches_total counter
aio_mclookup_dispatches_total 0
# HELP aio_mclookup_hit_tokens_total Prefix-hit tokens returned by lookups.
# TYPE aio_mclookup_hit_tokens_total counter
aio_mclookup_hit_tokens_total 0
# HELP aio_mclookup_requested_tokens_total Tokens asked about by lookups.
# TYPE aio_mclookup_requested_tokens_total counter
aio_mclookup_requested_tokens_total 0
# HELP aio_mclookup_errors_total Failures by code: a Mooncake error code, exception, timeout, overloaded or closed.
# TYPE aio_mclookup_errors_total counter
aio_mclookup_errors_total{code="-900"} 2
aio_mclookup_errors_total{code="timeout"} 1
# HELP aio_mclookup_model_lookups_total Lookups answered, by the layout's model name.
# TYPE aio_mclookup_model_lookups_total counter
# HELP aio_mclookup_model_hit_tokens_total Prefix-hit tokens returned by lookups, by the layout's model name.
# TYPE aio_mclookup_model_hit_tokens_total counter
# HELP aio_mclookup_model_requested_tokens_total Tokens asked about by lookups, by the layout's model name.
# TYPE aio_mclookup_model_requested_tokens_total counter
# HELP aio_mclookup_pending_lookups Lookups waiting for or inside an RPC.
# TYPE aio_mclookup_pending_lookups gauge
aio_mclookup_pending_lookups 2
# HELP aio_mclookup_pending_keys Keys waiting to be sent.
# TYPE aio_mclookup_pending_keys gauge
aio_mclookup_pending_keys 0
# HELP aio_mclookup_rpcs_in_flight batch_is_exist RPCs in flight.
# TYPE aio_mclookup_rpcs_in_flight gauge
aio_mclookup_rpcs_in_flight 0
# HELP aio_mclookup_store_healthy 1 while the store answers, 0 while failing fast after store errors.
# TYPE aio_mclookup_store_healthy gauge
aio_mclookup_store_healthy 0
# HELP aio_mclookup_last_rpc_ok_age_seconds Seconds since the last successful RPC (absent before the first).
# TYPE aio_mclookup_last_rpc_ok_age_seconds gauge
aio_mclookup_last_rpc_ok_age_seconds 1.5
# HELP aio_mclookup_lookup_seconds Latency of one lookup, from call to answer.
# TYPE aio_mclookup_lookup_seconds histogram
aio_mclookup_lookup_seconds_bucket{le="0.0001"} 0
aio_mclookup_lookup_seconds_bucket{le="0.00025"} 1
aio_mclookup_lookup_seconds_bucket{le="0.0005"} 1
aio_mclookup_lookup_seconds_bucket{le="0.001"} 1
aio_mclookup_lookup_seconds_bucket{le="0.0025"} 1
aio_mclookup_lookup_seconds_bucket{le="0.005"} 3
aio_mclookup_lookup_seconds_bucket{le="0.01"} 3
aio_mclookup_lookup_seconds_bucket{le="0.025"} 3
aio_mclookup_lookup_seconds_bucket{le="0.05"} 3
aio_mclookup_lookup_seconds_bucket{le="0.1"} 3
aio_mclookup_lookup_seconds_bucket{le="0.25"} 3
aio_mclookup_lookup_seconds_bucket{le="0.5"} 3
aio_mclookup_lookup_seconds_bucket{le="1.0"} 3
aio_mclookup_lookup_seconds_bucket{le="2.5"} 3
aio_mclookup_lookup_seconds_bucket{le="5.0"} 3
aio_mclookup_lookup_seconds_bucket{le="10.0"} 3
aio_mclookup_lookup_seconds_bucket{le="+Inf"} 4
aio_mclookup_lookup_seconds_sum 20.0062
aio_mclookup_lookup_seconds_count 4
# HELP aio_mclookup_rpc_seconds Latency of one batch_is_exist RPC.
# TYPE aio_mclookup_rpc_seconds histogram
aio_mclookup_rpc_seconds_bucket{le="0.0001"} 0
aio_mclookup_rpc_seconds_bucket{le="0.00025"} 0
aio_mclookup_rpc_seconds_bucket{le="0.0005"} 0
aio_mclookup_rpc_seconds_bucket{le="0.001"} 0
aio_mclookup_rpc_seconds_bucket{le="0.0025"} 0
aio_mclookup_rpc_seconds_bucket{le="0.005"} 0
aio_mclookup_rpc_seconds_bucket{le="0.01"} 0
aio_mclookup_rpc_seconds_bucket{le="0.025"} 0
aio_mclookup_rpc_seconds_bucket{le="0.05"} 0
aio_mclookup_rpc_seconds_bucket{le="0.1"} 0
aio_mclookup_rpc_seconds_bucket{le="0.25"} 0
aio_mclookup_rpc_seconds_bucket{le="0.5"} 0
aio_mclookup_rpc_seconds_bucket{le="1.0"} 0
aio_mclookup_rpc_seconds_bucket{le="2.5"} 0
aio_mclookup_rpc_seconds_bucket{le="5.0"} 0
aio_mclookup_rpc_seconds_bucket{le="10.0"} 0
aio_mclookup_rpc_seconds_bucket{le="+Inf"} 0
aio_mclookup_rpc_seconds_sum 0.0
aio_mclookup_rpc_seconds_count 0
# HELP aio_mclookup_keys_per_rpc Keys per batch_is_exist RPC.
# TYPE aio_mclookup_keys_per_rpc histogram
aio_mclookup_keys_per_rpc_bucket{le="1.0"} 1
aio_mclookup_keys_per_rpc_bucket{le="4.0"} 1
aio_mclookup_keys_per_rpc_bucket{le="16.0"} 1
aio_mclookup_keys_per_rpc_bucket{le="64.0"} 3
aio_mclookup_keys_per_rpc_bucket{le="128.0"} 3
aio_mclookup_keys_per_rpc_bucket{le="256.0"} 3
aio_mclookup_keys_per_rpc_bucket{le="512.0"} 3
aio_mclookup_keys_per_rpc_bucket{le="1000.0"} 4
aio_mclookup_keys_per_rpc_bucket{le="2000.0"} 4
aio_mclookup_keys_per_rpc_bucket{le="5000.0"} 4
aio_mclookup_keys_per_rpc_bucket{le="10000.0"} 4
aio_mclookup_keys_per_rpc_bucket{le="50000.0"} 4
aio_mclookup_keys_per_rpc_bucket{le="+Inf"} 5
aio_mclookup_keys_per_rpc_sum 61081.0
aio_mclookup_keys_per_rpc_count 5
# HELP aio_mclookup_lookups_per_dispatch Lookups served by one dispatch.
# TYPE aio_mclookup_lookups_per_dispatch histogram
aio_mclookup_lookups_per_dispatch_bucket{le="1.0"} 0
aio_mclookup_lookups_per_dispatch_bucket{le="2.0"} 0
aio_mclookup_lookups_per_dispatch_bucket{le="4.0"} 0
aio_mclookup_lookups_per_dispatch_bucket{le="8.0"} 0
aio_mclookup_lookups_per_dispatch_bucket{le="16.0"} 0
aio_mclookup_lookups_per_dispatch_bucket{le="32.0"} 0
aio_mclookup_lookups_per_dispatch_bucket{le="64.0"} 0
aio_mclookup_lookups_per_dispatch_bucket{le="128.0"} 0
aio_mclookup_lookups_per_dispatch_bucket{le="256.0"} 0
aio_mclookup_lookups_per_dispatch_bucket{le="512.0"} 0
aio_mclookup_lookups_per_dispatch_bucket{le="1024.0"} 0
aio_mclookup_lookups_per_dispatch_bucket{le="+Inf"} 0
aio_mclookup_lookups_per_dispatch_sum 0.0
aio_mclookup_lookups_per_dispatch_count 0
"""



Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _families(text: str) -> list[tuple[list[str], Samples]]:
    """Per family, in order: its ``# HELP`` and ``# TYPE`` lines, and its samples."""
    out: list[tuple[list[str], Samples]] = []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            out.append(([line], {}))
        elif line.startswith("# TYPE "):
            out[-1][0].append(line)
        else:
            m = _SAMPLE.match(line)
            assert m, f"bad sample line {line!r}"
            name, raw_labels, raw_value = m.groups()
            labels = frozenset((k, _unescape(v)) for k, v in _LABEL.findall(raw_labels or ""))
            out[-1][1][(name, labels)] = float(raw_value)
    return out


ADDED_SINCE = {"aio_mclookup_epoch_changes_total": "counter"}
"""Families added after the hand-written renderer: the old ones are kept unchanged around
them."""


def test_the_text_matches_the_hand_written_renderer() -> None:
    text = prometheus_text(_stats())
    added = [f"# TYPE {name} {kind}" for name, kind in ADDED_SINCE.items()]
    new_families = [f for f in _families(text) if f[0][1] not in added]
    assert len(_families(text)) - len(new_families) == len(ADDED_SINCE)
    new = "\n".join(
        line for line in text.splitlines() if not any(name in line for name in ADDED_SINCE)
    )
    old_families = _families(OLD_TEXT)
    # Same families in the same order, with the same HELP and TYPE lines, byte for byte.
    assert [head for head, _ in new_families] == [head for head, _ in old_families]
    # Same samples (names, labels, values) in every family.
    for (head, old_samples), (_, new_samples) in zip(old_families, new_families, strict=True):
        assert new_samples == old_samples, head[0]
    assert len(new.splitlines()) == len(OLD_TEXT.splitlines())
    lines = new.splitlines()
    assert 'aio_mclookup_lookup_seconds_bucket{le="0.00025"} 1.0' in lines
    assert 'aio_mclookup_keys_per_rpc_bucket{le="50000.0"} 4.0' in lines
    assert 'aio_mclookup_errors_total{code="-900"} 2.0' in lines


async def test_a_prometheus_client_registry_collects_a_live_coordinator() -> None:
    layout = KVLayout(
        [FullAttention(16)], model="org/toy", hash_block_size=16, scheduler_block_size=16
    )
    hashes = [bytes([i]) * 32 for i in range(4)]
    store = FakeStore()
    store.add(k.decode() for k in layout.plan(32, hashes[:2]).keys)
    registry = CollectorRegistry()
    app_requests = prometheus_client.Counter("app_requests", "The app's own.", registry=registry)
    app_requests.inc(5)
    async with LookupCoordinator(layout, store, cache_ttl=None) as coordinator:
        registry.register(aio_mclookup.CoordinatorCollector(coordinator))
        assert registry.get_sample_value("aio_mclookup_lookups_total") == 0
        for _ in range(3):
            assert await coordinator.lookup(64, hashes) == 32
        # Each scrape takes a fresh snapshot.
        assert registry.get_sample_value("aio_mclookup_lookups_total") == 3
        assert registry.get_sample_value("aio_mclookup_rpcs_total") == len(store.calls) > 0
        assert registry.get_sample_value("aio_mclookup_keys_sent_total") == sum(
            map(len, store.calls)
        )
        assert registry.get_sample_value("aio_mclookup_hit_tokens_total") == 96
        assert registry.get_sample_value("aio_mclookup_store_healthy") == 1
        assert registry.get_sample_value("aio_mclookup_lookup_seconds_count") == 3
        inf = registry.get_sample_value("aio_mclookup_lookup_seconds_bucket", {"le": "+Inf"})
        assert inf == 3
        store.fail_with = -900
        with pytest.raises(aio_mclookup.StoreError):
            await coordinator.lookup(64, [bytes([9]) * 32] * 4)
        assert registry.get_sample_value("aio_mclookup_errors_total", {"code": "-900"}) == 1
        assert registry.get_sample_value("aio_mclookup_store_healthy") == 0
        # The app's metrics and the coordinator's come out of one exposition.
        text = prometheus_client.generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["app_requests"].type == "counter"
    assert families["aio_mclookup_lookups"].type == "counter"  # the parser strips _total
    assert families["aio_mclookup_lookup_seconds"].type == "histogram"
    assert families["aio_mclookup_pending_lookups"].type == "gauge"
    assert registry.get_sample_value("app_requests_total") == 5


def test_registering_names_the_families_without_a_snapshot() -> None:
    calls: list[int] = []

    def source() -> CoordinatorStats:
        calls.append(1)
        return _stats()

    registry = CollectorRegistry()
    collector = CoordinatorCollector(source, namespace="router_kv")
    registry.register(collector)
    assert calls == []  # describe() does not touch the coordinator
    # A second collector with the same names is refused, as prometheus_client does.
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(CoordinatorCollector(source, namespace="router_kv"))
    # Another namespace coexists.
    registry.register(CoordinatorCollector(CoordinatorStats(), namespace="other"))
    assert registry.get_sample_value("router_kv_lookups_total") == 10
    assert calls == [1]
    assert registry.get_sample_value("other_lookups_total") == 0
    assert registry.get_sample_value("router_kv_last_rpc_ok_age_seconds") == 1.5
    assert registry.get_sample_value("other_last_rpc_ok_age_seconds") is None
    registry.unregister(collector)
    assert registry.get_sample_value("router_kv_lookups_total") is None


def test_collector_sources_and_bad_arguments() -> None:
    stats = _stats()
    for source in (stats, lambda: stats):
        registry = CollectorRegistry()
        registry.register(CoordinatorCollector(source))
        assert registry.get_sample_value("aio_mclookup_keys_sent_total") == 120
    with pytest.raises(TypeError, match="CoordinatorStats"):
        CoordinatorCollector(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="namespace"):
        CoordinatorCollector(stats, namespace="bad-name")
    assert check_namespace("") == "" and check_namespace("a:b") == "a:b_"


def test_official_parser_accepts_the_text() -> None:
    families = {f.name: f for f in text_string_to_metric_families(prometheus_text(_stats()))}
    # The official parser strips "_total" from counter family names.
    assert families["aio_mclookup_rpcs"].type == "counter"
    assert families["aio_mclookup_keys_per_rpc"].type == "histogram"
    assert families["aio_mclookup_pending_lookups"].type == "gauge"
    errors = {s.labels["code"]: s.value for s in families["aio_mclookup_errors"].samples}
    assert errors == {"-900": 2.0, "timeout": 1.0}


def test_metric_family_renders_an_extra_family() -> None:
    lines = metric_family(
        "aio_mclookup_http_responses_total",
        "counter",
        "HTTP responses, by route and status.",
        [({"status": "200", "route": "/v1/lookup"}, 3), ({"route": 'a"b', "status": "503"}, 1)],
    )
    assert lines == [
        "# HELP aio_mclookup_http_responses_total HTTP responses, by route and status.",
        "# TYPE aio_mclookup_http_responses_total counter",
        'aio_mclookup_http_responses_total{route="/v1/lookup",status="200"} 3.0',
        'aio_mclookup_http_responses_total{route="a\\"b",status="503"} 1.0',
    ]
    # Appended to prometheus_text (what the FastAPI router does), the whole still parses.
    text = prometheus_text(_stats()) + "\n".join(lines) + "\n"
    types, samples = parse(text)
    assert types["aio_mclookup_http_responses_total"] == "counter"
    route = frozenset({("route", "/v1/lookup"), ("status", "200")})
    assert samples[("aio_mclookup_http_responses_total", route)] == 3
    assert metric_family("g", "gauge", "A gauge.", []) == ["# HELP g A gauge.", "# TYPE g gauge"]
    with pytest.raises(ValueError, match="_total"):
        metric_family("requests", "counter", "No suffix.", [])
    with pytest.raises(ValueError, match="kind"):
        metric_family("x", "summary", "Unsupported.", [])


def test_without_prometheus_client_the_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # what a missing package does
    with pytest.raises(ImportError, match=r"prometheus_text needs prometheus_client.*'prometheus'"):
        prometheus_text(_stats())
    with pytest.raises(ImportError, match=r"\[prometheus\]"):
        CoordinatorCollector(_stats())
    with pytest.raises(ImportError, match="'prometheus' extra"):
        metric_family("g", "gauge", "A gauge.", [])
    # The names stay importable without it (aio_mclookup imports them).
    assert PROMETHEUS_CONTENT_TYPE.startswith("text/plain; version=0.0.4")
    assert check_namespace("ns") == "ns_"


def test_histogram_quantile_is_an_upper_bound_from_the_buckets() -> None:
    hist = Histogram((1.0, 2.0, 5.0))
    assert math.isnan(hist.quantile(0.5))  # no observations
    for value in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 4.5, 5.0, 7.0, 100.0):
        hist.observe(value)
    assert hist.quantile(0.0) == 1.0
    assert hist.quantile(0.2) == 1.0  # 2 of 10 are <= 1.0 (bounds are inclusive)
    assert hist.quantile(0.21) == 2.0
    assert hist.quantile(0.5) == 5.0
    assert hist.quantile(0.8) == 5.0
    assert hist.quantile(0.81) == math.inf  # past the last bound
    assert hist.quantile(1.0) == math.inf
    # Against the exact quantile of the observations: never below it.
    values = sorted([0.0003, 0.0004, 0.002, 0.002, 0.03, 0.2, 0.2, 0.2, 0.9, 3.0] * 7)
    stats = CoordinatorStats()
    for value in values:
        stats.lookup_seconds.observe(value)
    for q in (0.1, 0.25, 0.5, 0.9, 0.95, 0.99):
        exact = values[max(0, math.ceil(q * len(values)) - 1)]
        estimate = stats.lookup_seconds.quantile(q)
        assert estimate >= exact
        assert estimate in stats.lookup_seconds.buckets
    with pytest.raises(ValueError, match="q must be"):
        hist.quantile(1.5)


def test_a_coordinator_serving_two_models_labels_their_lookups() -> None:
    """A multi-model router's lookups, by model: ``model_*_total{model=...}``."""
    chat = KVLayout([FullAttention(16)], model="org/chat", hash_block_size=16,
                    scheduler_block_size=16)
    code = KVLayout([FullAttention(16)], model="org/code", hash_block_size=16,
                    scheduler_block_size=16, vllm_version="0.26")
    hashes = [bytes([i]) * 32 for i in range(4)]
    store = FakeStore(chat.plan(64, hashes).keys)

    async def run() -> str:
        async with LookupCoordinator(chat, store) as coordinator:
            assert await coordinator.lookup(80, hashes) == 64
            assert await coordinator.lookup(64, hashes, layout=code) == 0
            assert (await coordinator.lookup_result(64, hashes, layout=code)).hit_length == 0
            return prometheus_text(coordinator.stats())

    lines = asyncio.run(run()).splitlines()
    for sample in (
        'aio_mclookup_model_lookups_total{model="org/chat"} 1.0',
        'aio_mclookup_model_lookups_total{model="org/code"} 2.0',
        'aio_mclookup_model_hit_tokens_total{model="org/chat"} 64.0',
        'aio_mclookup_model_requested_tokens_total{model="org/chat"} 80.0',
        'aio_mclookup_model_requested_tokens_total{model="org/code"} 128.0',
    ):
        assert sample in lines, sample
