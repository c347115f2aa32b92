"""Recording subclasses of a store connector (run inside the vLLM environment).

``recording(cls)`` returns a subclass named ``MooncakeStoreConnector`` that, in the scheduler
role, records every lookup result its client returns, the time (and the thread's CPU time) the
scheduler spends in ``get_num_new_matched_tokens``, the time in ``build_connector_meta`` (where
aio-mclookup's connector sends the step's lookups) and, of it, the idle waits for an answer,
and the scheduler steps (``build_connector_meta`` calls).
"""

from __future__ import annotations

import time
from typing import Any


def _caller_id(req_id: str) -> str:
    """The caller's request id (the engine's own is it plus "-<random suffix>")."""
    return req_id.rsplit("-", 1)[0]


SCHEDULERS: list[Any] = []
"""The scheduler-role connectors built in this process (the engine job reads them)."""


def recording(base: type) -> type:
    class MooncakeStoreConnector(base):  # type: ignore[misc,valid-type]
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            self.results: list[tuple[str, int, int, tuple[tuple[int, int], ...]]] = []
            self.lookup_seconds = 0.0
            self.meta_seconds = 0.0
            self.lookup_calls = 0
            self.idle_seconds = 0.0  # of meta_seconds: waiting, idle, for an answer
            self.flush_seconds = 0.0  # ours: sending a step's lookups, collecting answers
            self.lookup_cpu_seconds = 0.0  # the scheduler thread's CPU time in the lookups
            self.steps = 0
            self.last_answer_step = 0
            self.last_answer_at = 0.0
            self.trace_from(0.0)
            scheduler = self.connector_scheduler
            if scheduler is None:
                return
            client = scheduler.client
            inner = client.lookup
            self.submitted = 0

            def lookup(req_id: str, num_tokens: int, hashes: Any, non_block: bool = False) -> Any:
                # (vLLM's client keeps its pending lookups in ``futures``, ours in ``_tickets``)
                first = req_id not in getattr(client, "futures", getattr(client, "_tickets", {}))
                self.submitted += first
                out = inner(req_id, num_tokens, hashes, non_block)
                if out is not None:
                    self.last_answer_step = self.steps
                    self.last_answer_at = time.perf_counter()
                    self.hit_at.setdefault(_caller_id(req_id), self.last_answer_at - self.t0)
                    self.step_answers += 1
                    bounds = tuple((b.group_id, b.num_tokens) for b in out.tail_key_boundaries)
                    self.results.append((req_id, num_tokens, out.hit_length, bounds))
                return out

            client.lookup = lookup
            waiter = getattr(client, "wait_for_answers", None)
            if waiter is not None:  # ours: a step that scheduled nothing waits, idle

                def wait_for_answers(timeout: float) -> Any:
                    start = time.perf_counter()
                    try:
                        return waiter(timeout)
                    finally:
                        self.idle_seconds += time.perf_counter() - start

                client.wait_for_answers = wait_for_answers
                flush = client.flush

                def timed_flush(**how: Any) -> None:
                    start = time.perf_counter()
                    try:
                        flush(**how)
                    finally:
                        self.flush_seconds += time.perf_counter() - start

                client.flush = timed_flush
            SCHEDULERS.append(self)

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return super().get_num_new_matched_tokens(request, num_computed_tokens)
            finally:
                self.lookup_cpu_seconds += time.thread_time() - cpu
                self.lookup_seconds += time.perf_counter() - start
                self.lookup_calls += 1

        def trace_from(self, t0: float) -> None:
            """Start a burst's trace: times are seconds from ``t0`` (perf_counter)."""
            self.t0 = t0
            self.hit_at: dict[str, float] = {}  # caller's request id -> when its hit came
            self.scheduled_at: dict[str, float] = {}  # -> when it was first scheduled
            self.step_trace: list[list[float]] = []
            self.step_answers = 0

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            self.steps += 1
            start = time.perf_counter()
            new = [_caller_id(r.req_id) for r in scheduler_output.scheduled_new_reqs]
            for req_id in new:
                self.scheduled_at.setdefault(req_id, start - self.t0)
            # (time, hits delivered, requests newly scheduled, requests scheduled, tokens)
            self.step_trace.append(
                [
                    round(start - self.t0, 4),
                    self.step_answers,
                    len(new),
                    len(scheduler_output.num_scheduled_tokens),
                    scheduler_output.total_num_scheduled_tokens,
                ]
            )
            self.step_answers = 0
            try:
                return super().build_connector_meta(scheduler_output)
            finally:
                self.meta_seconds += time.perf_counter() - start

    return MooncakeStoreConnector
