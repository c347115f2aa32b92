"""Prometheus text exposition (format 0.0.4) of a :class:`CoordinatorStats` snapshot.

No dependency: the text is rendered here, so any HTTP framework (or none) can serve it::

    body = prometheus_text(coordinator.stats())  # Content-Type: PROMETHEUS_CONTENT_TYPE
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

from .stats import CoordinatorStats, Histogram

__all__ = ["PROMETHEUS_CONTENT_TYPE", "prometheus_text"]

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The ``Content-Type`` of :func:`prometheus_text`'s output."""

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
    ("hit_tokens_total", "hit_tokens_total", "Prefix-hit tokens returned by lookups."),
    ("requested_tokens_total", "requested_tokens_total", "Tokens asked about by lookups."),
)

_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("pending_lookups", "pending_lookups", "Lookups waiting for or inside an RPC."),
    ("pending_keys", "pending_keys", "Keys waiting to be sent."),
    ("rpcs_in_flight", "rpcs_in_flight", "batch_is_exist RPCs in flight."),
)

_HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    ("lookup_seconds", "lookup_seconds", "Latency of one lookup, from call to answer."),
    ("rpc_seconds", "rpc_seconds", "Latency of one batch_is_exist RPC."),
    ("keys_per_rpc", "keys_per_rpc", "Keys per batch_is_exist RPC."),
    ("lookups_per_dispatch", "lookups_per_dispatch", "Lookups served by one dispatch."),
)


def format_value(value: float) -> str:
    """A sample value as Prometheus writes it (``+Inf``, ``-Inf``, ``NaN``, ints exact)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def escape_label(value: str) -> str:
    """A label value escaped for the text format (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def metric_family(
    name: str,
    kind: str,
    help_text: str,
    samples: Iterable[tuple[Mapping[str, str], float]],
) -> list[str]:
    """``# HELP``, ``# TYPE`` and one line per ``(labels, value)`` sample of one family."""
    lines = [f"# HELP {name} {_escape_help(help_text)}", f"# TYPE {name} {kind}"]
    lines.extend(f"{name}{_labels(labels)} {format_value(value)}" for labels, value in samples)
    return lines


def histogram_family(name: str, help_text: str, hist: Histogram) -> list[str]:
    """A histogram family: cumulative ``_bucket{le=...}`` lines, ``_sum`` and ``_count``."""
    lines = [f"# HELP {name} {_escape_help(help_text)}", f"# TYPE {name} histogram"]
    cumulative = hist.cumulative()
    bounds = (*hist.buckets, math.inf)
    for bound, count in zip(bounds, cumulative, strict=True):
        le = "+Inf" if math.isinf(bound) else repr(float(bound))
        lines.append(f'{name}_bucket{{le="{le}"}} {count}')
    lines.append(f"{name}_sum {format_value(float(hist.sum))}")
    lines.append(f"{name}_count {cumulative[-1] if cumulative else hist.count}")
    return lines


def check_namespace(namespace: str) -> str:
    """The metric-name prefix for ``namespace`` (``""`` for none); raises ``ValueError``."""
    if not namespace:
        return ""
    if not _NAME.match(namespace):
        raise ValueError(f"namespace {namespace!r} is not a valid Prometheus metric name prefix")
    return namespace + "_"


def prometheus_text(stats: CoordinatorStats, *, namespace: str = "aio_mclookup") -> str:
    """Render a coordinator's statistics in the Prometheus text format (version 0.0.4).

    Counters (``<namespace>_lookups_total``, ``_rpcs_total``, ``_keys_sent_total``,
    ``_errors_total{code}``, ``_cache_hits_total``...), gauges (``_pending_lookups``,
    ``_rpcs_in_flight``, ``_store_healthy``...) and histograms (``_lookup_seconds``,
    ``_rpc_seconds``, ``_keys_per_rpc``, ``_lookups_per_dispatch``). Serve it with
    :data:`PROMETHEUS_CONTENT_TYPE`.
    """
    prefix = check_namespace(namespace)
    lines: list[str] = []
    for attr, name, help_text in _COUNTERS:
        lines += metric_family(prefix + name, "counter", help_text, [({}, getattr(stats, attr))])
    lines += metric_family(
        prefix + "errors_total",
        "counter",
        "Failures by code: a Mooncake error code, exception, timeout, overloaded or closed.",
        [({"code": str(code)}, n) for code, n in sorted(stats.errors_by_code.items())],
    )
    for attr, name, help_text in _GAUGES:
        lines += metric_family(prefix + name, "gauge", help_text, [({}, getattr(stats, attr))])
    lines += metric_family(
        prefix + "store_healthy",
        "gauge",
        "1 while the store answers, 0 while failing fast after store errors.",
        [({}, 1 if stats.store_healthy else 0)],
    )
    age = stats.last_rpc_ok_age
    lines += metric_family(
        prefix + "last_rpc_ok_age_seconds",
        "gauge",
        "Seconds since the last successful RPC (absent before the first).",
        [] if age is None else [({}, float(age))],
    )
    for attr, name, help_text in _HISTOGRAMS:
        lines += histogram_family(prefix + name, help_text, getattr(stats, attr))
    return "\n".join(lines) + "\n"
