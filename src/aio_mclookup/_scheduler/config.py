"""The scheduler's lookup set-up: where its Mooncake client connects (the workers'
``MOONCAKE_CONFIG_PATH``) and where its lookup service runs (a sidecar process or a thread)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidRequest
from .._store.pool import DEFAULT_TENANT

__all__ = [
    "LOAD_WINDOW_STEPS",
    "SIDECAR_MIN_CPUS",
    "StoreSettings",
    "choose_service",
    "load_window",
    "store_settings",
]

SIDECAR_MIN_CPUS = 4
"""CPUs this process may run on from which ``"auto"`` puts the lookup service in a sidecar
process; below, on a thread of the scheduler's process (docs/vllm.md, "Sidecar or thread")."""

_SERVICES = ("auto", "sidecar", "thread")
LOAD_WINDOW_STEPS = 2.0
"""The default of ``aio_mclookup_load_window``: hits are handed to the scheduler while the
work handed out and not started is below this many steps' token budgets (docs/vllm.md, "Load
pacing")."""
_MAX_WINDOW_STEPS = 1_000_000
"""The largest ``aio_mclookup_load_window`` taken (a finite number of steps)."""


@dataclass(frozen=True)
class StoreSettings:
    """The master, metadata server and tenant a lookup-only client needs (no segment)."""

    master_address: str
    metadata_server: str
    tenant_id: str


def store_settings(environ: Mapping[str, str] = os.environ) -> StoreSettings:
    """Read the JSON file named by ``MOONCAKE_CONFIG_PATH`` as vLLM's workers read it
    (``master_server_address``, ``metadata_server``, ``tenant_id``: null or blank means
    Mooncake's ``"default"``); :class:`InvalidRequest` naming what is missing."""
    path = environ.get("MOONCAKE_CONFIG_PATH")
    if not path:
        raise InvalidRequest(
            "MOONCAKE_CONFIG_PATH is not set: the scheduler's lookup client reads the workers' "
            "Mooncake config from it",
            field="MOONCAKE_CONFIG_PATH",
        )
    try:
        with open(path, encoding="utf-8") as file:
            config: Any = json.load(file)
    except (OSError, ValueError) as exc:
        raise InvalidRequest(
            f"MOONCAKE_CONFIG_PATH={path!r} cannot be read as JSON: {exc}",
            field="MOONCAKE_CONFIG_PATH",
        ) from exc
    if not isinstance(config, dict):
        raise InvalidRequest(f"{path}: a JSON object expected", field="MOONCAKE_CONFIG_PATH")
    for name in ("master_server_address", "metadata_server"):
        if not isinstance(config.get(name), str) or not config[name]:
            raise InvalidRequest(f"{path}: {name} is missing", field=name)
    tenant = config.get("tenant_id")
    if tenant is not None and not isinstance(tenant, str):
        raise InvalidRequest(f"{path}: tenant_id must be a string or null", field="tenant_id")
    return StoreSettings(
        master_address=config["master_server_address"],
        metadata_server=config["metadata_server"],
        tenant_id=(tenant or "").strip() or DEFAULT_TENANT,
    )


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def choose_service(extra: Mapping[str, Any], cpus: int | None = None) -> tuple[str, str]:
    """``(service, why)``: where the asynchronous lookups are answered, from the connector's
    extra config ``aio_mclookup_service`` (``"auto"``, the default, ``"sidecar"`` or
    ``"thread"``) and, for ``"auto"``, the CPUs this process may use (``cpus``, else its
    affinity) against :data:`SIDECAR_MIN_CPUS`. :class:`InvalidRequest` for another value."""
    wanted = extra.get("aio_mclookup_service", "auto")
    if wanted not in _SERVICES:
        raise InvalidRequest(
            f"kv_connector_extra_config['aio_mclookup_service'] must be one of "
            f"{', '.join(_SERVICES)}, got {wanted!r}",
            field="aio_mclookup_service",
        )
    if wanted != "auto":
        return str(wanted), "aio_mclookup_service"
    cpus = _usable_cpus() if cpus is None else cpus
    service = "sidecar" if cpus >= SIDECAR_MIN_CPUS else "thread"
    return service, f"auto: {cpus} CPUs, the sidecar from {SIDECAR_MIN_CPUS}"


def load_window(extra: Mapping[str, Any], step_tokens: int) -> int:
    """The load pacer's window in tokens: the connector's extra config
    ``aio_mclookup_load_window`` (scheduler steps, default :data:`LOAD_WINDOW_STEPS`; ``0``
    hands every hit out at once) times ``step_tokens``, the scheduler's token budget per step
    (``max_num_batched_tokens``), at least 1 token. :class:`InvalidRequest` for a value that
    is not a number from 0 to :data:`_MAX_WINDOW_STEPS`."""
    steps = extra.get("aio_mclookup_load_window", LOAD_WINDOW_STEPS)
    if (
        isinstance(steps, bool)
        or not isinstance(steps, int | float)
        or not 0 <= steps <= _MAX_WINDOW_STEPS
    ):
        raise InvalidRequest(
            "kv_connector_extra_config['aio_mclookup_load_window'] must be a number of "
            f"scheduler steps from 0 to {_MAX_WINDOW_STEPS:,}, got {steps!r}",
            field="aio_mclookup_load_window",
        )
    return max(1, int(steps * max(1, step_tokens))) if steps else 0
