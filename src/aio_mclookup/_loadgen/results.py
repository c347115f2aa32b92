"""What a load-generator run is configured with and what it measured: :class:`LoadgenConfig`,
:class:`RunResult` (one run), :class:`LoadgenReport` (all runs)."""

from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._layout.layout import KVLayout
from .._layout.sglang import SGLangLayout
from .workload import Workload, WorkloadSpec, sglang_token_note

__all__ = [
    "COORDINATOR", "NAIVE", "PER_REQUEST", "LoadgenConfig", "LoadgenReport", "RunResult", "version",
]

COORDINATOR = "coordinator"


NAIVE = "seed-naive"
PER_REQUEST = "per-request"
"""One request at a time with this project's planning: what a user who skips the coordinator
gets (see :func:`~.baseline.per_request_lookup`)."""


@dataclass
class LoadgenConfig:
    """Everything one ``aio-mclookup loadgen`` invocation needs (already validated)."""

    layout: KVLayout | SGLangLayout
    layout_source: str
    spec: WorkloadSpec
    requests: int | None = None
    """Lookups per run (cycling over the workload's requests); None: each request once."""
    duration: float | None = None
    """Seconds per run instead of a request count."""
    concurrency: tuple[int, ...] = (1, 16, 64, 256)
    compare: bool = True
    master: str | None = None
    metadata: str | None = None
    write: bool = False
    local_hostname: str = "127.0.0.1"
    progress: bool = False
    timeout: float | None = None
    threads: int = 4
    max_keys_per_rpc: int = 1000
    max_rpcs_in_flight: int = 2
    cache_ttl: float | None = 5.0
    rounds: bool = True
    linger: float = 0.0

    @property
    def embedded(self) -> bool:
        return self.master is None


@dataclass
class RunResult:
    """What one run measured."""

    mode: str
    concurrency: int
    planned: int
    """Lookups the run was to issue (0 for a duration run)."""
    elapsed: float = 0.0
    positions: list[int] = field(default_factory=list)
    """Position in the request sequence of every successful lookup."""
    latencies: list[float] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    rpcs: int = 0
    rounds: int = 0
    """Probing rounds (the coordinator's; seed-naive makes one per lookup)."""
    keys_sent: int = 0
    keys_planned: int = 0
    cache_hits: int = 0
    dedup_hits: int = 0
    prompt_tokens: int = 0
    aligned_tokens: int = 0
    interrupted: bool = False
    hash_times: list[float] = field(default_factory=list)
    """Seconds each lookup spent hashing its token ids (token-id workloads; in its latency)."""
    hashed_in_lookup: bool = False
    """Each lookup hashed its token ids inside the call, not timed apart (the coordinator's
    :meth:`~aio_mclookup.LookupCoordinator.lookup_tokens`: SGLang pages on its worker thread)."""

    @property
    def lookups(self) -> int:
        return len(self.latencies)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def hit_tokens(self) -> int:
        return sum(self.hits)

    def rate(self) -> float:
        return self.lookups / self.elapsed if self.elapsed > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        if not self.latencies:
            return math.nan
        return float(np.percentile(np.asarray(self.latencies), q)) * 1e3

    def hash_ms_median(self) -> float:
        """Median milliseconds a lookup spent hashing its token ids (NaN: none hashed)."""
        if not self.hash_times:
            return math.nan
        return float(np.median(np.asarray(self.hash_times))) * 1e3

    def to_dict(self) -> dict[str, Any]:
        n = self.lookups
        lat = np.asarray(self.latencies) * 1e3
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "lookups": n,
            "errors": self.error_count,
            "errors_by_type": dict(self.errors),
            "elapsed_s": round(self.elapsed, 6),
            "lookups_per_s": round(self.rate(), 3),
            "latency_ms": {
                "p50": _r(self.percentile_ms(50)),
                "p95": _r(self.percentile_ms(95)),
                "p99": _r(self.percentile_ms(99)),
                "mean": _r(float(lat.mean())) if n else None,
                "max": _r(float(lat.max())) if n else None,
            },
            "rpcs": self.rpcs,
            "keys_sent": self.keys_sent,
            "keys_planned": self.keys_planned,
            "cache_hits": self.cache_hits,
            "dedup_hits": self.dedup_hits,
            "rpcs_per_lookup": _r(self.rpcs / n) if n else None,
            "keys_per_lookup": _r(self.keys_sent / n) if n else None,
            "hit_tokens": self.hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "aligned_tokens": self.aligned_tokens,
            "hit_ratio": _r(self.hit_tokens / self.prompt_tokens) if self.prompt_tokens else None,
            "hashing": self._hashing(),
            "interrupted": self.interrupted,
        }


    def _hashing(self) -> dict[str, Any] | None:
        if self.hashed_in_lookup:
            return {"included_in_latency": True, "in_lookup": "lookup_tokens",
                    "lookups": self.lookups}
        if not self.hash_times:
            return None
        return {
            "included_in_latency": True,
            "lookups_hashed": len(self.hash_times),
            "total_s": round(sum(self.hash_times), 6),
            "median_ms": _r(self.hash_ms_median()),
            "mean_ms": _r(sum(self.hash_times) / len(self.hash_times) * 1e3),
        }


def _token_note(cfg: LoadgenConfig) -> str:
    if isinstance(cfg.layout, SGLangLayout):
        return sglang_token_note(cfg.layout)
    return ("each lookup (both ways) hashed its prompt's token ids first; the hashing time is "
            "included in its latency and in lookups/s")


def _r(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


@dataclass
class LoadgenReport:
    """The whole invocation: setup facts, every run, the hit comparison."""

    config: LoadgenConfig
    workload: Workload | None = None
    runs: list[RunResult] = field(default_factory=list)
    store: dict[str, Any] = field(default_factory=dict)
    compared: int = 0
    mismatches: int = 0
    mismatch_examples: list[dict[str, Any]] = field(default_factory=list)
    interrupted: bool = False
    failure: str | None = None
    loop_name: str = "asyncio"
    wall_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        cfg = self.config
        workload: dict[str, Any] = {"spec": cfg.spec.to_dict()}
        if self.workload is not None:
            workload.update(self.workload.summary())
        return {
            "tool": "aio-mclookup loadgen",
            "version": version(),
            "layout_source": cfg.layout_source,
            "layout": cfg.layout.to_dict(),
            "alignment": _alignment(cfg.layout),
            "workload": workload,
            "token_ids": (
                {
                    "hasher": _hasher_config(cfg),
                    "note": _token_note(cfg),
                }
                if cfg.spec.token_ids
                else None
            ),
            "requests_per_run": (
                None
                if cfg.duration is not None
                else cfg.requests
                if cfg.requests is not None
                else len(self.workload.requests)
                if self.workload is not None
                else None
            ),
            "duration_per_run_s": cfg.duration,
            "concurrency": list(cfg.concurrency),
            "compare": cfg.compare,
            "coordinator_options": {
                "max_keys_per_rpc": cfg.max_keys_per_rpc,
                "max_rpcs_in_flight": cfg.max_rpcs_in_flight,
                "cache_ttl": cfg.cache_ttl,
                "rounds": cfg.rounds,
                "linger": cfg.linger,
                "timeout": cfg.timeout,
                "store_threads": cfg.threads,
            },
            "store": self.store,
            "runs": [r.to_dict() for r in self.runs],
            "hits_check": {
                "compared": self.compared,
                "mismatches": self.mismatches,
                "equal": self.mismatches == 0,
                "examples": self.mismatch_examples,
            },
            "interrupted": self.interrupted,
            "failure": self.failure,
            "wall_seconds": round(self.wall_seconds, 3),
            "environment": {
                "python": platform.python_version(),
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "event_loop": self.loop_name,
            },
        }


def _alignment(layout: KVLayout | SGLangLayout) -> str:
    if isinstance(layout, SGLangLayout):
        return (
            "each lookup is SGLang's L3 hit for num_tokens: its first num_tokens - 1 tokens in "
            f"whole {layout.page_size}-token pages (aligned_tokens), nothing below the "
            f"prefetch threshold of {layout.prefetch_threshold} tokens"
        )
    return (
        "each request's num_tokens is aligned with layout.align(num_tokens) (floored to "
        f"the {layout.scheduler_block_size}-token scheduler block, as vLLM's "
        "scheduler does) before the lookup"
    )


def _hasher_config(cfg: LoadgenConfig) -> dict[str, Any]:
    from .workload import workload_hasher

    hasher = workload_hasher(cfg.layout)
    return {**hasher.to_dict(), "seed": "0" if hasher.seeded else None}


def version() -> str:
    from .. import __version__

    return __version__
