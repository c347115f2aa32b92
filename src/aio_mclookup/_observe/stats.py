"""Counters and histograms the coordinator keeps about itself (cheap, lock-free: loop thread).

:meth:`LookupCoordinator.stats` returns a :class:`CoordinatorStats` snapshot; the Prometheus
exposition and the load generator read the same numbers.
"""

from __future__ import annotations

import bisect
import copy
import math
from dataclasses import dataclass, field

from .._errors import InvalidRequest

__all__ = ["CoordinatorStats", "Histogram"]

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)
KEY_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1000, 2000, 5000, 10000, 50000)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class Histogram:
    """A fixed-bucket histogram. ``counts[i]`` counts observations ``<= buckets[i]`` and above
    the previous bound (not cumulative); the last entry counts those above every bound."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def quantile(self, q: float) -> float:
        """An upper-bound estimate of the ``q``-quantile (``0 <= q <= 1``): the smallest bucket
        bound at or below which at least a fraction ``q`` of the observations fall. ``inf`` when
        that is past the last bound, ``nan`` with no observations."""
        if not 0.0 <= q <= 1.0:
            raise InvalidRequest(f"q must be within [0, 1], got {q!r}", field="q")
        total = sum(self.counts)
        if total == 0:
            return math.nan
        rank = max(1, math.ceil(q * total - 1e-9))
        running = 0
        for bound, count in zip((*self.buckets, math.inf), self.counts):
            running += count
            if running >= rank:
                return float(bound)
        return math.inf  # pragma: no cover - running reaches total

    def cumulative(self) -> list[int]:
        """Counts of observations ``<= buckets[i]`` (Prometheus ``le`` order), then the total."""
        out, running = [], 0
        for c in self.counts:
            running += c
            out.append(running)
        return out


@dataclass
class CoordinatorStats:
    """What a coordinator has done since it was created (a snapshot; safe to keep)."""

    lookups_total: int = 0
    """Lookups that finished (with a result or an error)."""
    lookups_failed_total: int = 0
    """Lookups that ended in an error (store error, timeout, overload, close)."""
    lookups_cancelled_total: int = 0
    rpcs_total: int = 0
    """``batch_is_exist`` calls sent to the store."""
    rpc_errors_total: int = 0
    keys_planned_total: int = 0
    """Keys vLLM's loop would have sent for the same lookups."""
    keys_sent_total: int = 0
    """Keys actually sent to the store (after dedup, cache and probing in rounds)."""
    cache_hits_total: int = 0
    """Keys answered from the short-lived positive-answer cache."""
    dedup_hits_total: int = 0
    """Keys shared with another lookup's pending or in-flight probe."""
    rounds_total: int = 0
    """Probe rounds over all lookups (one per lookup when nothing can be skipped)."""
    dispatches_total: int = 0
    epoch_changes_total: int = 0
    """New master epochs begun: the master restarted, failed over or stopped answering after
    it had answered, so every presence cached before was dropped and the lookups in progress
    failed (``StoreError``)."""
    errors_by_code: dict[str, int] = field(default_factory=dict)
    """Failures by Mooncake error code (``"-900"``...), ``"exception"``, ``"timeout"``,
    ``"overloaded"`` or ``"closed"``."""
    hit_tokens_total: int = 0
    requested_tokens_total: int = 0
    lookups_by_model: dict[str, int] = field(default_factory=dict)
    """Lookups answered, by the layout's model name (``KVLayout.model``): a coordinator serving
    several models (``lookup(..., layout=)``) tells them apart here and in the next two."""
    hit_tokens_by_model: dict[str, int] = field(default_factory=dict)
    requested_tokens_by_model: dict[str, int] = field(default_factory=dict)
    pending_lookups: int = 0
    pending_keys: int = 0
    rpcs_in_flight: int = 0
    store_healthy: bool = True
    """False while the coordinator is failing fast after store errors (it probes again later)."""
    last_rpc_ok_age: float | None = None
    """Seconds since the last successful RPC (None before the first)."""
    last_error: str | None = None
    lookup_seconds: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    rpc_seconds: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    keys_per_rpc: Histogram = field(default_factory=lambda: Histogram(KEY_BUCKETS))
    lookups_per_dispatch: Histogram = field(default_factory=lambda: Histogram(COUNT_BUCKETS))

    def count_error(self, code: str) -> None:
        self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1

    def lookup_planned(self, num_keys: int, token_len: int) -> None:
        """A lookup of ``num_keys`` planned keys for ``token_len`` tokens came in."""
        self.keys_planned_total += num_keys
        self.requested_tokens_total += max(token_len, 0)

    def lookup_failed(self, label: str) -> None:
        """A lookup ended in an error (``label``: :func:`~aio_mclookup._errors.error_label`)."""
        self.lookups_total += 1
        self.lookups_failed_total += 1
        self.count_error(label)

    def lookup_done(self, hit_tokens: int, seconds: float) -> None:
        """A lookup settled with a hit of ``hit_tokens`` after ``seconds``."""
        self.lookups_total += 1
        self.hit_tokens_total += hit_tokens
        self.lookup_seconds.observe(seconds)

    def count_model(self, model: str, requested_tokens: int, hit_tokens: int) -> None:
        """One lookup answered under a layout of ``model``."""
        self.lookups_by_model[model] = self.lookups_by_model.get(model, 0) + 1
        by = self.hit_tokens_by_model
        by[model] = by.get(model, 0) + hit_tokens
        by = self.requested_tokens_by_model
        by[model] = by.get(model, 0) + max(requested_tokens, 0)

    def snapshot(self) -> CoordinatorStats:
        return copy.deepcopy(self)
