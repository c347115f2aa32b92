"""``MooncakeStoreConnector``: vLLM's store connector whose scheduler lookups coalesce."""

from __future__ import annotations

import atexit
import logging
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
    MooncakeStoreConnector as _StockConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    MooncakeLookupResult,
    TailKeyBoundary,
)

from .._errors import InvalidRequest, StoreError, UnsupportedLayout
from .._layout.layout import KVLayout
from .._observe.stats import CoordinatorStats
from .._scheduler.channels import SidecarChannel, ThreadChannel, opening
from .._scheduler.client import CoalescingLookupClient
from .._scheduler.config import choose_service, load_window, store_settings
from .._scheduler.loop import run_once
from .._scheduler.pacing import MAX_HOLD, LoadPacer
from .._store.mooncake import MooncakeStore
from ._metrics import KEY, PluginPromMetrics, PluginStats, stats_record

__all__ = ["MooncakeStoreConnector", "build_client"]

logger = logging.getLogger("aio_mclookup.vllm")


_OPEN_TIMEOUT = 30.0
"""Seconds the scheduler waits at start-up for its Mooncake client, and for the sidecar's,
to set up (and at shut-down for its own to close)."""

_IDLE_WAIT = 0.005
"""Seconds a scheduler step that scheduled nothing waits for a pending lookup's answer."""

_LOAD_WAIT = 0.002
"""Seconds a scheduler step that scheduled nothing, with no lookup out, sleeps (the GIL
released): the engine waits on KV loads, whose thread needs the GIL the empty steps spin on."""

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _result(hit_length: int, boundaries: tuple[tuple[int, int], ...]) -> MooncakeLookupResult:
    return MooncakeLookupResult(
        hit_length, tuple(TailKeyBoundary(group_id=g, num_tokens=n) for g, n in boundaries)
    )


def _host_ip() -> str:
    from vllm.utils.network_utils import get_ip

    return str(get_ip())


def build_client(
    vllm_config: Any,
    kv_cache_config: Any,
    stock_client: Any,
    *,
    start_sidecar: bool = True,
    service: str = "sidecar",
) -> CoalescingLookupClient:
    """The coalescing client for this engine's scheduler: the layout read from vLLM; a
    lookup-only Mooncake client of this process (where the workers' ``MOONCAKE_CONFIG_PATH``
    points) for the synchronous lookups; and a coordinator for the asynchronous ones (started
    now with ``start_sidecar``, else at the first one), in a ``"sidecar"`` process with a
    Mooncake client of its own, or on a ``"thread"`` of this process over the same client.
    The options of the extra config. ``stock_client`` keeps serving ``reset``.
    :class:`UnsupportedLayout` where the layout cannot be reproduced, :class:`StoreError` if
    the master cannot be reached, :class:`InvalidRequest` for a bad configuration."""
    layout = KVLayout.from_vllm(vllm_config, kv_cache_config)
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    options = CoalescingLookupClient.options_from(extra)
    settings = store_settings()
    host = _host_ip()
    store = MooncakeStore(
        settings.master_address,
        settings.metadata_server,
        local_hostname=host,
        tenant_id=settings.tenant_id,
    )
    sidecar = opening(
        layout,
        options,
        master_address=settings.master_address,
        metadata_server=settings.metadata_server,
        local_hostname=host,
        tenant_id=settings.tenant_id,
    )
    run_once(store.open, _OPEN_TIMEOUT)

    async def shared_store() -> MooncakeStore:
        return store

    async def kept_open(_store: Any) -> None:
        """(the scheduler's own client: closed with the client, after the service)"""

    def open_channel() -> SidecarChannel | ThreadChannel:
        if service == "thread":
            return ThreadChannel(layout, shared_store, kept_open, options, _OPEN_TIMEOUT)
        return SidecarChannel(sidecar, _OPEN_TIMEOUT)

    try:
        return CoalescingLookupClient(
            layout,
            open_channel,
            make_result=_result,
            reset_store=stock_client.reset,
            options=options,
            exist_blocking=store.batch_is_exist_blocking,
            close_blocking=store.close_blocking,  # (in this thread: it works at exit too)
            start_now=start_sidecar,
        )
    except BaseException:
        store.close_blocking()
        raise


def _summary(layout: KVLayout) -> str:
    """One line of the layout for the start-up log."""
    groups = "+".join(f"{g['kind']}/{g['block_size']}" for g in layout.to_dict()["groups"])
    return (
        f"groups {groups}, hash block {layout.hash_block_size}, scheduler block "
        f"{layout.scheduler_block_size}, tp {layout.tp_size}, vLLM {layout.vllm_version} rules, "
        f"{len(layout.key_prefixes)} key prefix group(s)"
    )


def _log_like_vllm() -> None:
    """Give this package's log lines vLLM's handler (vLLM configures only its own logger,
    so an INFO line of another package would be dropped); unless the application set up
    handlers for it itself."""
    ours, theirs = logging.getLogger("aio_mclookup"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


class MooncakeStoreConnector(_StockConnector):  # type: ignore[misc]
    """vLLM's ``MooncakeStoreConnector``; in the scheduler role its lookup client is
    :class:`CoalescingLookupClient` (worker roles are untouched).

    Enable with ``{"kv_connector": "MooncakeStoreConnector", "kv_connector_module_path":
    "aio_mclookup.vllm", "kv_connector_extra_config": {"lookup_async": true}}``. Where the
    running release or the layout is not reproduced exactly, or the scheduler cannot reach the
    master, it logs once and keeps vLLM's own client.
    """

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._coalescing: CoalescingLookupClient | None = None
        self._pacer = LoadPacer(0)
        scheduler = self.connector_scheduler
        if role != KVConnectorRole.SCHEDULER or scheduler is None or not scheduler.enable_lookup:
            return
        _log_like_vllm()
        stock = scheduler.client
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        try:
            service, why = choose_service(extra)
            pacer = LoadPacer(
                load_window(extra, vllm_config.scheduler_config.max_num_batched_tokens)
            )
            client = build_client(
                vllm_config,
                kv_cache_config,
                stock,
                start_sidecar=scheduler.lookup_async,
                service=service,
            )
        except (UnsupportedLayout, StoreError) as exc:
            _warn_once(f"aio-mclookup: falling back to vLLM's own lookup client: {exc}")
            return
        except InvalidRequest as exc:
            raise ValueError(f"aio-mclookup: {exc}") from exc
        if not scheduler.lookup_async:
            _warn_once(
                "aio-mclookup: lookup_async is off, so each lookup blocks the scheduler and "
                "nothing coalesces; set kv_connector_extra_config lookup_async: true"
            )
        self._stock_client = stock
        self._coalescing = client
        self._pacer = pacer
        scheduler.client = client
        logger.info(
            "aio-mclookup: serving the scheduler's store lookups (%s mode; asynchronous "
            "lookups on %s [%s]; synchronous ones in the scheduler's thread; hits handed out "
            "%s); layout: %s",
            "async" if scheduler.lookup_async else "sync",
            "a sidecar process" if service == "sidecar" else "a thread of this process",
            why,
            f"within {pacer.window} tokens of work ahead" if pacer.window else "at once",
            _summary(client.layout),
        )
        # At interpreter exit without an engine shutdown, close before module teardown.
        atexit.register(self.shutdown)

    @property
    def lookup_client(self) -> CoalescingLookupClient | None:
        """The coalescing client, or None where vLLM's own client serves the lookups."""
        return self._coalescing

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """vLLM's, except that a request whose lookup is still pending is answered "not known
        yet" at once (what vLLM's path would return for it, without its per-call work), and
        so is one whose result the load pacer holds back (see :class:`LoadPacer`): its answer
        is in (or, synchronous, its lookup not made yet) but the work handed out already
        fills the window."""
        client = self._coalescing
        if client is None:
            result: tuple[int | None, bool] = super().get_num_new_matched_tokens(
                request, num_computed_tokens
            )
            return result
        req_id = request.request_id
        if client.pending(req_id):
            return None, False
        pacer = self._pacer
        if not pacer.admits(req_id) and (
            client.answered(req_id) or not self.connector_scheduler.lookup_async
        ):
            return None, False
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)
        tokens = result[0]
        if tokens is not None:
            pacer.handed(req_id, request.num_tokens - num_computed_tokens - tokens)
        return result

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        """vLLM's; the request is no longer ahead of the engine (see :class:`LoadPacer`)."""
        self._pacer.started((request.request_id,))
        done: tuple[bool, Any] = super().request_finished(request, block_ids)
        return done

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        """As :meth:`request_finished` (vLLM calls this one for several KV-cache groups)."""
        self._pacer.started((request.request_id,))
        done: tuple[bool, Any] = super().request_finished_all_groups(request, block_ids)
        return done

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """vLLM's, after starting the lookups this step submitted (together: they share
        RPCs), and again those whose answers the load pacer has held back for
        :data:`MAX_HOLD`. A step that scheduled nothing then waits instead of returning to
        spin (the engine has nothing to run): up to 5 ms for an answer while lookups are out
        and the load window has room, else 2 ms (KV loads are under way, and their thread
        needs the GIL)."""
        client = self._coalescing
        if client is not None:
            self._pacer.started(scheduler_output.num_scheduled_tokens)  # (request ids)
            if self._pacer.window:
                client.refresh(MAX_HOLD)  # (answers held back this long: asked again)
            client.flush()
            if not scheduler_output.total_num_scheduled_tokens and (
                self._pacer.full or not client.wait_for_answers(_IDLE_WAIT)
            ):  # (a full window: answers that come in wait anyway, loads are under way)
                time.sleep(_LOAD_WAIT)
        return super().build_connector_meta(scheduler_output)

    # -------------------------------------------------------------- metrics (docs/vllm.md)
    def get_kv_connector_stats(self) -> Any:
        """vLLM's (the worker role's store statistics), and in the scheduler role the
        coordinator's latest counters, which vLLM's front end records as ``aio_mclookup_*``
        Prometheus metrics (a fresh snapshot is asked for at most every second)."""
        theirs = super().get_kv_connector_stats()
        client = self._coalescing
        if client is None:
            return theirs
        snapshot = client.stats_nowait()
        if snapshot is None and not client.direct_rpcs:
            return theirs
        ours = PluginStats(
            data={KEY: [stats_record(snapshot or CoordinatorStats(), client.direct_rpcs)]}
        )
        return ours if theirs is None else theirs.aggregate(ours)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        """vLLM's Mooncake store statistics, which also carry the plug-in's records."""
        return PluginStats(data=data) if data is not None else PluginStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """vLLM's Mooncake store metrics and the coordinator's ``aio_mclookup_*`` ones."""
        return PluginPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Close the coalescing client (no thread is left), vLLM's own client, then what
        vLLM's connector closes."""
        client, self._coalescing = getattr(self, "_coalescing", None), None
        if client is not None:
            atexit.unregister(self.shutdown)
            client.close()
            self._stock_client.close()
        super().shutdown()
