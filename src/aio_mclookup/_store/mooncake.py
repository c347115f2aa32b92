"""The real store: :class:`MooncakeStore`, a lookup-only Mooncake client on a :class:`ClientPool`,
awaited (:class:`~aio_mclookup.Store`) or calling back (:class:`~aio_mclookup.CallbackStore`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

from .._backend import call_soon_threadsafe
from .._errors import InvalidRequest, LookupTimeout, StoreError
from .codes import raise_if_failed_rpc
from .etcd import leader
from .pool import DEFAULT_TENANT, LOOPBACK, ClientPool, as_error, raise_as_error
from .watch import MasterWatch

_LEADER_RECHECK = 0.5
"""Seconds between two reads of the leader from etcd while the watch holds one (a leader
replaced without dying: one small HTTP request per read)."""
_LEADER_RETRY = 0.05
"""Seconds between two attempts (a read from etcd and a connect) while no leader serves."""

__all__ = ["MooncakeStore"]


def _exist(client: Any, batch: list[str | bytes]) -> list[int]:
    """The client's ``batch_is_exist`` (on a pool thread), a failed RPC raised."""
    answers: list[int] = client.batch_is_exist(batch)
    raise_if_failed_rpc("batch_is_exist", answers)
    return answers


class MooncakeStore(ClientPool):
    """The real :class:`~aio_mclookup.Store`: a lookup-only Mooncake client (no segment, no buffer).

    ``async with MooncakeStore(master, metadata) as store: await store.batch_is_exist(keys)``.

    Blocking client calls run on a private ``ThreadPoolExecutor`` of ``threads`` workers (also
    exposed as ``max_concurrency``), never on the loop's default executor. Concurrent calls on one
    client are safe and give correct results. ``tenant_id`` is the Mooncake tenant whose keys
    are looked up (the writers' ``tenant_id``; Mooncake's default is ``"default"``).

    Process-wide environment: before the client is built, :meth:`open` sets these only where the
    process has not (``os.environ.setdefault``; the client reads them at construction, so the
    first client of the process decides):

    * ``MC_TCP_BIND_ADDRESS=<local_hostname>`` when ``local_hostname`` is an IP address (the
      default ``127.0.0.1`` makes the client advertise and use loopback);
    * ``MC_STORE_CLIENT_SETUP_RETRIES=2`` (the default, 20, means ~90 s against a dead master);
    * ``MC_RPC_TIMEOUT_MS=<rpc_timeout * 1000>`` (default 30 s; size it above the slowest batch);
    * ``MC_RPC_CONNECT_TIMEOUT_MS=<connect_timeout * 1000>`` (bounds one connect to the master:
      a master host gone without a reset otherwise costs the kernel's SYN retries, minutes).

    ``master_address`` is ``host:port``, or ``etcd://HOST:PORT[;HOST:PORT...]`` for HA masters
    (the client finds the leader in etcd and follows it). ``isolate`` runs the Mooncake client
    in a child process of its own (None: for ``etcd://`` only, whose ``setup()`` and
    ``close()`` hold the GIL up to ~10 s and ~30 s; closing is then the child's exit), at one
    more local hop per RPC.

    The client's own listeners (transfer-engine handshake and TCP data ports, 15000-17000) still
    bind all interfaces; no option changes that. For hard isolation run in a network namespace.

    ``setup()`` and ``close()`` of the Mooncake client hold the GIL for their whole duration (the
    process freezes meanwhile; docs/mooncake.md has the figures), so open the store at start-up
    and close it at shut-down, not per request. A dead master fails :meth:`open` fast with
    ``StoreError(code=-900)`` thanks to a TCP probe, a hung one with ``code=-901`` thanks to a
    liveness probe. ``epochs`` watches the master (a held idle connection to its port): a
    restart or a failover starts a new epoch, which a coordinator reads to drop whatever it
    cached from the master before. While the master is down, each lookup returns
    after the client's reconnect back-off with ``StoreError(code=-900)``; the client reconnects
    by itself when the master is back (keys are lost: the master keeps them in memory only).
    """

    _role = "lookup"

    def __init__(
        self,
        master_address: str,
        metadata_server: str,
        *,
        threads: int = 4,
        rpc_timeout: float = 2.0,
        setup_timeout: float = 10.0,
        local_hostname: str = LOOPBACK,
        tenant_id: str = DEFAULT_TENANT,
        connect_timeout: float = 1.0,
        isolate: bool | None = None,
    ) -> None:
        if not isinstance(tenant_id, str) or not tenant_id.strip():
            raise InvalidRequest(
                f"tenant_id must be a non-empty str, got {tenant_id!r}", field="tenant_id"
            )
        super().__init__(
            master_address,
            metadata_server,
            threads=threads,
            rpc_timeout=rpc_timeout,
            setup_timeout=setup_timeout,
            local_hostname=local_hostname,
            global_segment_size=0,
            local_buffer_size=0,
            tenant_id=tenant_id.strip(),
            connect_timeout=connect_timeout,
            isolate=_is_etcd(master_address) if isolate is None else bool(isolate),
        )
        self.max_concurrency = threads
        endpoints = self.etcd_endpoints
        if endpoints is None:
            self.epochs = MasterWatch.of_address(self._master_host, self._master_port)
        else:
            self.epochs = MasterWatch(
                lambda: leader(endpoints), retry=_LEADER_RETRY, recheck=_LEADER_RECHECK
            )
        """The master's epochs, as :class:`~aio_mclookup.LookupCoordinator` reads them
        (``epochs.epoch``, ``epochs.reachable``): a held connection to the master's port that
        tells a restart, however short, the moment it happens (docs/mooncake.md)."""

    def _after_setup(self, client: Any) -> None:
        self.epochs.start()

    def _before_close(self) -> None:
        self.epochs.stop()

    def __repr__(self) -> str:
        return (
            f"MooncakeStore({self.master_address!r}, {self.metadata_server!r}, "
            f"threads={self.max_concurrency}, state={self._state})"
        )

    async def batch_is_exist(self, keys: Sequence[str | bytes]) -> list[int]:
        """Answer each key: 1 present, 0 absent (or a per-key negative code), in order.

        ``str`` and ``bytes`` keys are both accepted (bytes compare byte-exact with the UTF-8 of
        a str key); a bare ``str`` raises :class:`InvalidRequest`. The batch is sent as one RPC:
        keep it at <= ~1000 keys (larger requests stall now and then on loopback: docs/mooncake.md).

        Raises :class:`ClosedError` before :meth:`open` or after :meth:`aclose`, and
        :class:`StoreError` when the RPC failed (every answer the same negative code, ``code`` set)
        or the client raised (``code=None``). ``[]`` answers ``[]`` without a call.
        """
        client = self._client_or_closed()
        if isinstance(keys, (str, bytes)):
            raise InvalidRequest("batch_is_exist() takes a sequence of keys, not one key")
        batch = list(keys)
        if not batch:
            return []
        return await self._call(functools.partial(_exist, client, batch))

    def batch_is_exist_blocking(
        self, keys: Sequence[str | bytes], timeout: float | None = None
    ) -> list[int]:
        """:meth:`batch_is_exist` for a caller that is not async (a synchronous scheduler):
        the calling thread waits, up to ``timeout`` seconds (:class:`LookupTimeout` after),
        while a pool thread makes the call. Same answers and errors."""
        client = self._client_or_closed()
        batch = list(keys)
        if not batch:
            return []
        done = self._submit(functools.partial(_exist, client, batch))
        try:
            return done.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            raise LookupTimeout(f"batch_is_exist took more than {timeout} s") from exc
        except Exception as exc:
            raise_as_error(exc)

    def batch_is_exist_then(
        self, keys: Sequence[str | bytes], then: Callable[[list[int] | BaseException], None]
    ) -> None:
        """:meth:`batch_is_exist` for the coordinator, without an awaiting task: ``then``
        gets the answers (or the :class:`Error` it would raise) on this loop's thread (asyncio's,
        or trio's), as soon as the loop picks them up. Raises :class:`ClosedError` as it
        would."""
        call_soon = call_soon_threadsafe()
        client = self._client_or_closed()
        batch = list(keys)

        def deliver(done: concurrent.futures.Future[list[int]]) -> None:  # (a pool thread)
            outcome: list[int] | BaseException
            if done.cancelled():
                outcome = StoreError("Mooncake client call was cancelled")
            elif (exc := done.exception()) is not None:
                outcome = as_error(exc)
            else:
                outcome = done.result()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                call_soon(then, outcome)

        self._submit(functools.partial(_exist, client, batch)).add_done_callback(deliver)


def _is_etcd(address: object) -> bool:
    return isinstance(address, str) and address.startswith("etcd://")
