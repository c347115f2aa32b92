"""The coordinator's metrics in vLLM's own Prometheus output.

vLLM carries a connector's statistics from the engine core to its front end (where ``/metrics``
is served) in ``KVConnectorStats`` objects and records them there with the connector class's
``build_prom_metrics``. The scheduler adds one record under :data:`KEY` (the coordinator's
counters and gauges, cumulative) to the store worker's own; here the front end turns it into
``aio_mclookup_*`` metrics (labelled by engine like vLLM's) and hands the rest to vLLM's Mooncake
metrics unchanged.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import (
    MooncakeStoreConnectorStats,
    MooncakeStorePromMetrics,
)

from .._observe.prometheus import _COUNTERS, _GAUGES
from .._observe.stats import CoordinatorStats

__all__ = ["KEY", "PluginPromMetrics", "PluginStats", "stats_record"]

KEY = "aio_mclookup"
"""The key of the plug-in's records in the connector statistics' ``data``."""

_DIRECT = (
    "direct_rpcs_total",
    "batch_is_exist RPCs of synchronous lookups, made in the scheduler's thread (not in "
    "rpcs_total).",
)
"""The one metric beyond the coordinator's: ``(name, help)``."""


def stats_record(stats: CoordinatorStats, direct_rpcs: int) -> dict[str, float]:
    """One record: the coordinator's counters and gauges, and the blocking path's RPCs."""
    record = {name: float(getattr(stats, attr)) for attr, name, _ in _COUNTERS + _GAUGES}
    record[_DIRECT[0]] = float(direct_rpcs)
    return record


class PluginStats(MooncakeStoreConnectorStats):  # type: ignore[misc]
    """vLLM's Mooncake store statistics, with the plug-in's records beside them."""

    def reduce(self) -> dict[str, int | float]:
        """vLLM's summary of its own records, and the plug-in's latest lookups and RPCs."""
        ours = self.data.get(KEY) or []
        rest = PluginStats(data={k: v for k, v in self.data.items() if k != KEY})
        reduced: dict[str, int | float] = MooncakeStoreConnectorStats.reduce(rest)
        if ours:
            reduced["aio_mclookup_lookups"] = int(ours[-1]["lookups_total"])
            reduced["aio_mclookup_rpcs"] = int(ours[-1]["rpcs_total"] + ours[-1][_DIRECT[0]])
        return reduced


class PluginPromMetrics(MooncakeStorePromMetrics):  # type: ignore[misc]
    """vLLM's Mooncake store metrics, and the coordinator's as ``aio_mclookup_*`` (counters
    follow the cumulative records; a smaller value, a restarted coordinator, counts anew)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._ours: dict[str, Any] = {}
        for name, help_text in [(name, text) for _, name, text in _COUNTERS] + [_DIRECT]:
            self._ours[name] = self._counter_cls(
                name=f"aio_mclookup_{name}", documentation=help_text, labelnames=labelnames
            )
        self._gauges = {name for _, name, _ in _GAUGES}
        for _, name, help_text in _GAUGES:
            self._ours[name] = self._gauge_cls(
                name=f"aio_mclookup_{name}", documentation=help_text, labelnames=labelnames
            )
        self._last: dict[tuple[int, str], float] = {}

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0) -> None:
        if not transfer_stats_data:
            return
        data = dict(transfer_stats_data)
        records = data.pop(KEY, None) or []
        super().observe(data, engine_idx)
        if not records:
            return
        latest = records[-1]
        labels = self.per_engine_labelvalues[engine_idx]
        for name, metric in self._ours.items():
            value = float(latest.get(name, 0.0))
            if name in self._gauges:
                metric.labels(*labels).set(value)
                continue
            last = self._last.get((engine_idx, name), 0.0)
            step = value - last if value >= last else value
            if step > 0:
                metric.labels(*labels).inc(step)
            self._last[(engine_idx, name)] = value
