"""``MooncakeStoreConnector``: vLLM's store connector whose scheduler lookups coalesce."""

from __future__ import annotations

import logging
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
from .._scheduler.channels import SidecarChannel, opening
from .._scheduler.client import CoalescingLookupClient
from .._scheduler.config import store_settings
from .._scheduler.loop import run_once
from .._store.mooncake import MooncakeStore

__all__ = ["MooncakeStoreConnector", "build_client"]

logger = logging.getLogger("aio_mclookup.vllm")

_OPEN_TIMEOUT = 30.0
"""Seconds the scheduler waits at start-up for its Mooncake client, and for the sidecar's,
to set up (and at shut-down for its own to close)."""

_IDLE_WAIT = 0.005
"""Seconds a scheduler step that scheduled nothing waits for a pending lookup's answer."""

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
    vllm_config: Any, kv_cache_config: Any, stock_client: Any, *, start_sidecar: bool = True
) -> CoalescingLookupClient:
    """The coalescing client for this engine's scheduler: the layout read from vLLM, a
    sidecar process whose coordinator and lookup-only Mooncake client (where the workers'
    ``MOONCAKE_CONFIG_PATH`` points) answer the asynchronous lookups (started now with
    ``start_sidecar``, else at the first one), and a Mooncake client of this process for the
    synchronous ones (and for all of them if the sidecar is lost); the options of the extra
    config. ``stock_client`` keeps serving ``reset``. :class:`UnsupportedLayout` where the
    layout cannot be reproduced, :class:`StoreError` if the master cannot be reached,
    :class:`InvalidRequest` for a bad configuration."""
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

    def close_store() -> None:
        run_once(store.aclose, _OPEN_TIMEOUT)

    try:
        return CoalescingLookupClient(
            layout,
            lambda: SidecarChannel(sidecar, _OPEN_TIMEOUT),
            make_result=_result,
            reset_store=stock_client.reset,
            options=options,
            exist_blocking=store.batch_is_exist_blocking,
            close_blocking=close_store,
            start_now=start_sidecar,
        )
    except BaseException:
        close_store()
        raise


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
        scheduler = self.connector_scheduler
        if role != KVConnectorRole.SCHEDULER or scheduler is None or not scheduler.enable_lookup:
            return
        stock = scheduler.client
        try:
            client = build_client(
                vllm_config, kv_cache_config, stock, start_sidecar=scheduler.lookup_async
            )
        except (UnsupportedLayout, StoreError) as exc:
            _warn_once(f"aio-mclookup: keeping vLLM's own lookup client: {exc}")
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
        scheduler.client = client

    @property
    def lookup_client(self) -> CoalescingLookupClient | None:
        """The coalescing client, or None where vLLM's own client serves the lookups."""
        return self._coalescing

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """vLLM's, except that a request whose lookup is still pending is answered "not known
        yet" at once (what vLLM's path would return for it, without its per-call work)."""
        client = self._coalescing
        if client is not None and client.pending(request.request_id):
            return None, False
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        return result

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """vLLM's, after starting the lookups this step submitted (together: they share
        RPCs). A step that scheduled nothing (everything waits on lookups) then waits up to
        5 ms for an answer instead of returning to spin: the engine has nothing to run."""
        client = self._coalescing
        if client is not None:
            client.flush()
            if not scheduler_output.total_num_scheduled_tokens:
                client.wait_for_answers(_IDLE_WAIT)
        return super().build_connector_meta(scheduler_output)

    def shutdown(self) -> None:
        """Close the coalescing client (no thread is left), vLLM's own client, then what
        vLLM's connector closes."""
        client, self._coalescing = getattr(self, "_coalescing", None), None
        if client is not None:
            client.close()
            self._stock_client.close()
        super().shutdown()
