"""``etcd://HOST:PORT[;HOST:PORT...]`` master addresses (HA masters elected through etcd):
parsing, the process-wide one-endpoint-string rule of the wheel, and where the leader is.

The leader is recorded in etcd under ``mooncake-store/<cluster id>/master_view`` (cluster id
``MC_STORE_CLUSTER_ID``, else ``mooncake_cluster``): its value is the leader's ``host:port``,
and its ``mod_revision`` changes with every new leader (the master's own ``view_version``).
It is read through etcd's JSON gateway (``POST /v3/kv/range``), which etcd 3.4+ serves on
its client port: no etcd client library is needed.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import urllib.request
from collections.abc import Sequence

from .._errors import InvalidRequest

__all__ = ["SCHEME", "claim_endpoints", "etcd_endpoints", "leader", "view_key"]

SCHEME = "etcd://"
_DEFAULT_CLUSTER = "mooncake_cluster"

_claimed: str | None = None
_claim_lock = threading.Lock()


def etcd_endpoints(address: str) -> list[tuple[str, int]] | None:
    """The endpoints of an ``etcd://`` address, None for any other address;
    :class:`InvalidRequest` for a malformed one."""
    if not address.startswith(SCHEME):
        return None
    out = []
    for part in address[len(SCHEME):].split(";"):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidRequest(
                f"expected 'etcd://HOST:PORT[;HOST:PORT...]', got {address!r}",
                field="master_address",
            )
        out.append((host.strip("[]"), int(port)))
    return out


def claim_endpoints(address: str) -> None:
    """Claim ``address`` as this process's etcd endpoint string: the wheel's clients accept
    only one per process (a second, different one fails ``setup()`` with INVALID_PARAMS,
    even after a failed first). The same string again is fine; another raises
    :class:`InvalidRequest` at once, naming the one in use."""
    global _claimed
    with _claim_lock:
        if _claimed is None:
            _claimed = address
        elif _claimed != address:
            raise InvalidRequest(
                f"this process already uses the etcd endpoints {_claimed!r}; the Mooncake "
                f"client takes only one etcd endpoint string per process, not also "
                f"{address!r} (MooncakeStore runs its client in a child process and has no "
                "such limit)",
                field="master_address",
            )


def view_key() -> str:
    """The etcd key that names the leader."""
    cluster = os.environ.get("MC_STORE_CLUSTER_ID") or _DEFAULT_CLUSTER
    return f"mooncake-store/{cluster}/master_view"


def leader(
    endpoints: Sequence[tuple[str, int]], timeout: float = 0.5
) -> tuple[str, int, int] | None:
    """The leader as etcd records it: ``(host, port, view revision)``, or None when no
    master leads. Asks each endpoint in turn; :class:`OSError` when none answers."""
    key = base64.b64encode(view_key().encode()).decode()
    body = json.dumps({"key": key}).encode()
    failure: OSError = OSError("no etcd endpoint given")
    for host, port in endpoints:
        request = urllib.request.Request(
            f"http://{host}:{port}/v3/kv/range", data=body, method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                reply = json.load(response)
        except (OSError, ValueError) as exc:
            failure = exc if isinstance(exc, OSError) else OSError(f"bad reply: {exc}")
            continue
        kvs = reply.get("kvs") or []
        if not kvs:
            return None
        value = base64.b64decode(kvs[0].get("value", "")).decode()
        host_, sep, port_ = value.rpartition(":")
        if not sep or not port_.isdigit():
            return None
        return host_.strip("[]"), int(port_), int(kvs[0].get("mod_revision", 0))
    raise failure
