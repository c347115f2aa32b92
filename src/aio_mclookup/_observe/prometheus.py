"""Prometheus exposition of a coordinator's statistics, through ``prometheus_client``.

Needs the ``prometheus`` extra (``prometheus_client``; the ``fastapi`` and ``dev`` extras include
it). Two ways in:

* :class:`CoordinatorCollector` is a collector for any ``prometheus_client`` registry, so an
  application that already serves ``/metrics`` (e.g. with prometheus-fastapi-instrumentator)
  includes the coordinator's metrics in its own output::

      from prometheus_client import REGISTRY
      REGISTRY.register(CoordinatorCollector(coordinator))

* :func:`prometheus_text` renders the same families on a private registry
  (``prometheus_client.generate_latest``), for any HTTP framework (or none)::

      body = prometheus_text(coordinator.stats())  # Content-Type: PROMETHEUS_CONTENT_TYPE

Metric names, types, labels and help texts are part of the interface (dashboards use them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, Union

from .._public import present_as_public
from .stats import CoordinatorStats, Histogram

if TYPE_CHECKING:
    from prometheus_client.metrics_core import HistogramMetricFamily, Metric
    from prometheus_client.registry import Collector

__all__ = [
    "PROMETHEUS_CONTENT_TYPE",
    "CoordinatorCollector",
    "check_namespace",
    "metric_family",
    "prometheus_text",
]

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The ``Content-Type`` of :func:`prometheus_text`'s output."""

EXTRA_HINT = (
    "needs prometheus_client, from aio-mclookup's 'prometheus' extra (also in 'fastapi' and "
    "'dev'): from a clone, pip install -e '.[prometheus]'; or pip install 'prometheus_client>=0.17'"
)

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")

# (stats attribute, metric name without namespace, help)
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("lookups_total", "lookups_total", "Lookups that finished, with a result or an error."),
    ("lookups_failed_total", "lookups_failed_total", "Lookups that ended in an error."),
    ("lookups_cancelled_total", "lookups_cancelled_total", "Lookups cancelled by their caller."),
    ("rpcs_total", "rpcs_total", "batch_is_exist RPCs sent to the store."),
    ("rpc_errors_total", "rpc_errors_total", "batch_is_exist RPCs that failed."),
    (
        "keys_planned_total",
        "keys_planned_total",
        "Keys a per-request loop (vLLM's) would have sent for the same lookups.",
    ),
    (
        "keys_sent_total",
        "keys_sent_total",
        "Keys sent to the store, after dedup, cache and probing in rounds.",
    ),
    (
        "cache_hits_total",
        "cache_hits_total",
        "Keys answered from the short-lived positive-answer cache.",
    ),
    (
        "dedup_hits_total",
        "dedup_hits_total",
        "Keys shared with another lookup's pending or in-flight probe.",
    ),
    ("rounds_total", "rounds_total", "Probe rounds over all lookups."),
    ("dispatches_total", "dispatches_total", "Dispatches (batches of lookups sent together)."),
    (
        "epoch_changes_total",
        "epoch_changes_total",
        "New master epochs (restart, failover, lost master): cached presences dropped.",
    ),
    ("hit_tokens_total", "hit_tokens_total", "Prefix-hit tokens returned by lookups."),
    ("requested_tokens_total", "requested_tokens_total", "Tokens asked about by lookups."),
)
_ERRORS_HELP = "Failures by code: a Mooncake error code, exception, timeout, overloaded or closed."
_BY_MODEL: tuple[tuple[str, str, str], ...] = (
    ("lookups_by_model", "model_lookups_total", "Lookups answered, by the layout's model name."),
    (
        "hit_tokens_by_model",
        "model_hit_tokens_total",
        "Prefix-hit tokens returned by lookups, by the layout's model name.",
    ),
    (
        "requested_tokens_by_model",
        "model_requested_tokens_total",
        "Tokens asked about by lookups, by the layout's model name.",
    ),
)

_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("pending_lookups", "pending_lookups", "Lookups waiting for or inside an RPC."),
    ("pending_keys", "pending_keys", "Keys waiting to be sent."),
    ("rpcs_in_flight", "rpcs_in_flight", "batch_is_exist RPCs in flight."),
)
_HEALTHY_HELP = "1 while the store answers, 0 while failing fast after store errors."
_AGE_HELP = "Seconds since the last successful RPC (absent before the first)."

_HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    ("lookup_seconds", "lookup_seconds", "Latency of one lookup, from call to answer."),
    ("rpc_seconds", "rpc_seconds", "Latency of one batch_is_exist RPC."),
    ("keys_per_rpc", "keys_per_rpc", "Keys per batch_is_exist RPC."),
    ("lookups_per_dispatch", "lookups_per_dispatch", "Lookups served by one dispatch."),
)


class HasStats(Protocol):
    """Anything with a ``stats()`` snapshot, e.g. a :class:`~aio_mclookup.LookupCoordinator`."""

    def stats(self) -> CoordinatorStats: ...


StatsSource = Union[HasStats, Callable[[], CoordinatorStats], CoordinatorStats]  # noqa: UP007
"""A coordinator, a callable returning a snapshot, or one fixed snapshot."""


def _client() -> ModuleType:
    """``prometheus_client``, or an :class:`ImportError` that names the extra."""
    try:
        import prometheus_client
        import prometheus_client.exposition
        import prometheus_client.metrics_core
        import prometheus_client.utils
    except ImportError as exc:
        raise ImportError(
            f"aio-mclookup's Prometheus metrics {EXTRA_HINT}", name="prometheus_client"
        ) from exc
    return prometheus_client


def check_namespace(namespace: str) -> str:
    """The metric-name prefix for ``namespace`` (``""`` for none); raises ``ValueError``."""
    if not namespace:
        return ""
    if not _NAME.match(namespace):
        raise ValueError(f"namespace {namespace!r} is not a valid Prometheus metric name prefix")
    return namespace + "_"


def _histogram(pc: ModuleType, name: str, help_text: str, hist: Histogram) -> Metric:
    cumulative = hist.cumulative()
    go = pc.utils.floatToGoString
    bounds = [go(float(b)) for b in hist.buckets] + ["+Inf"]
    family: HistogramMetricFamily = pc.metrics_core.HistogramMetricFamily(name, help_text)
    family.add_metric([], list(zip(bounds, map(float, cumulative))), float(hist.sum))
    return family


def coordinator_families(
    stats: CoordinatorStats, *, namespace: str = "aio_mclookup"
) -> list[Metric]:
    """The ``prometheus_client`` metric families of one snapshot (what the collector yields)."""
    pc = _client()
    core = pc.metrics_core
    prefix = check_namespace(namespace)
    out: list[Metric] = []
    for attr, name, help_text in _COUNTERS:
        out.append(core.CounterMetricFamily(prefix + name, help_text, value=getattr(stats, attr)))
    errors = core.CounterMetricFamily(prefix + "errors_total", _ERRORS_HELP, labels=["code"])
    for code, n in sorted(stats.errors_by_code.items()):
        errors.add_metric([str(code)], n)
    out.append(errors)
    for attr, name, help_text in _BY_MODEL:
        family = core.CounterMetricFamily(prefix + name, help_text, labels=["model"])
        for model, n in sorted(getattr(stats, attr).items()):
            family.add_metric([model], n)
        out.append(family)
    for attr, name, help_text in _GAUGES:
        out.append(core.GaugeMetricFamily(prefix + name, help_text, value=getattr(stats, attr)))
    out.append(
        core.GaugeMetricFamily(
            prefix + "store_healthy", _HEALTHY_HELP, value=1 if stats.store_healthy else 0
        )
    )
    age = core.GaugeMetricFamily(prefix + "last_rpc_ok_age_seconds", _AGE_HELP, labels=[])
    if stats.last_rpc_ok_age is not None:
        age.add_metric([], float(stats.last_rpc_ok_age))
    out.append(age)
    for attr, name, help_text in _HISTOGRAMS:
        out.append(_histogram(pc, prefix + name, help_text, getattr(stats, attr)))
    return out


class CoordinatorCollector:
    """A ``prometheus_client`` collector over a coordinator's statistics.

    ``source`` is a :class:`~aio_mclookup.LookupCoordinator` (anything with ``stats()``), a
    callable returning a :class:`~aio_mclookup.CoordinatorStats`, or one fixed snapshot. Each
    scrape (``collect()``) takes a fresh snapshot; ``describe()`` names the families without
    taking one, so registering never touches the coordinator::

        registry.register(CoordinatorCollector(coordinator, namespace="aio_mclookup"))

    Raises :class:`ImportError` (naming the ``prometheus`` extra) without ``prometheus_client``
    and :class:`ValueError` for a namespace that is not a metric-name prefix.
    """

    def __init__(self, source: StatsSource, *, namespace: str = "aio_mclookup") -> None:
        _client()
        check_namespace(namespace)
        self.namespace = namespace
        self._stats: Callable[[], CoordinatorStats]
        if isinstance(source, CoordinatorStats):
            snapshot = source
            self._stats = lambda: snapshot
        elif callable(getattr(source, "stats", None)):
            self._stats = source.stats  # type: ignore[union-attr]
        elif callable(source):
            self._stats = source
        else:
            raise TypeError(
                "source must be a coordinator, a callable returning CoordinatorStats or a "
                f"CoordinatorStats, not {type(source).__name__}"
            )

    def collect(self) -> Iterator[Metric]:
        """The coordinator's families, from a fresh snapshot."""
        yield from coordinator_families(self._stats(), namespace=self.namespace)

    def describe(self) -> Iterator[Metric]:
        """The same families from an empty snapshot (the registry reads their names)."""
        yield from coordinator_families(CoordinatorStats(), namespace=self.namespace)


class _Families:
    """A collector of fixed families (for rendering on a private registry)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def _render(pc: ModuleType, collector: Collector) -> str:
    registry = pc.CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text: bytes = pc.exposition.generate_latest(registry)
    return text.decode("utf-8")


def prometheus_text(stats: CoordinatorStats, *, namespace: str = "aio_mclookup") -> str:
    """Render a coordinator's statistics in the Prometheus text format (version 0.0.4).

    Counters (``<namespace>_lookups_total``, ``_rpcs_total``, ``_keys_sent_total``,
    ``_errors_total{code}``, ``_cache_hits_total``...), gauges (``_pending_lookups``,
    ``_rpcs_in_flight``, ``_store_healthy``...) and histograms (``_lookup_seconds``,
    ``_rpc_seconds``, ``_keys_per_rpc``, ``_lookups_per_dispatch``), rendered by
    ``prometheus_client.generate_latest`` from a :class:`CoordinatorCollector` on a private
    registry. Serve it with :data:`PROMETHEUS_CONTENT_TYPE`. Raises :class:`ImportError` (naming
    the ``prometheus`` extra) without ``prometheus_client``.
    """
    try:
        pc = _client()
    except ImportError as exc:
        raise ImportError(f"prometheus_text {EXTRA_HINT}", name="prometheus_client") from exc
    return _render(pc, CoordinatorCollector(stats, namespace=namespace))


def metric_family(
    name: str,
    kind: str,
    help_text: str,
    samples: Iterable[tuple[Mapping[str, str], float]],
) -> list[str]:
    """The text lines (``# HELP``, ``# TYPE``, one per ``(labels, value)`` sample) of one extra
    ``counter`` or ``gauge`` family, rendered by ``prometheus_client`` like the coordinator's.

    For a family of your own next to :func:`prometheus_text` (the FastAPI router's
    ``http_responses_total``). A counter's ``name`` must end in ``_total``.
    """
    pc = _client()
    if kind not in ("counter", "gauge"):
        raise ValueError(f"kind must be 'counter' or 'gauge', not {kind!r}")
    if not _NAME.match(name):
        raise ValueError(f"{name!r} is not a valid Prometheus metric name")
    family_name = name
    if kind == "counter":
        if not name.endswith("_total"):
            raise ValueError(f"a counter's name must end in _total: {name!r}")
        family_name = name[: -len("_total")]
    family: Metric = pc.metrics_core.Metric(family_name, help_text, kind)
    for labels, value in samples:
        family.add_sample(name, dict(labels), float(value))
    return _render(pc, _Families([family])).splitlines()


present_as_public(CoordinatorCollector, prometheus_text)
