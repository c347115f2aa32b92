"""The client pool: one ``MooncakeDistributedStore`` driven from a private thread pool with a
lifecycle that cannot crash the process.

``mooncake.store`` is imported lazily, inside the functions that need it, so the package imports
without the Mooncake wheel installed. Facts about the wheel that shape this module (measured
figures in docs/design.md):

* ``setup()`` and ``close()`` hold the GIL for their whole duration. Open and close clients at
  start-up and shut-down, never per request.
* The wheel segfaults on a lookup before ``setup()``, after ``close()``, and on ``close()`` while
  a lookup runs. :class:`ClientPool` guards every call with a state flag and an in-flight count.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlsplit

from .._backend import on_asyncio, wait_future
from .._checks import positive_int
from .._errors import ClosedError, Error, InvalidRequest, StoreError
from .codes import RPC_FAIL, RPC_TIMEOUT
from .etcd import claim_endpoints, etcd_endpoints, leader
from .isolated import ChildClient
from .logs import quiet_settings, setup_output

__all__ = [
    "LOOPBACK",
    "MOONCAKE_INSTALL",
    "ClientPool",
    "as_error",
    "client_config",
    "client_env",
    "port_accepts",
]

_T = TypeVar("_T")
_Self = TypeVar("_Self", bound="ClientPool")
_log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"

_CLOSE_WAIT = 120.0
"""Longest time a close waits for in-flight calls before it gives up on closing the client."""


def _split_host_port(address: str) -> tuple[str, int]:
    """Split ``host:port`` (or ``[v6]:port``) into its parts."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidRequest(f"expected 'host:port', got {address!r}", field="master_address")
    return host.strip("[]") or LOOPBACK, int(port)


async def _tcp_probe(host: str, port: int, timeout: float) -> OSError | None:
    """Try one TCP connect without blocking the loop; return the error or ``None`` on success."""
    if not on_asyncio():
        from .anyio_probes import tcp_probe

        return await tcp_probe(host, port, timeout)
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return exc
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setblocking(False)
        await asyncio.wait_for(loop.sock_connect(sock, addr), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        return TimeoutError(f"no answer from {host}:{port} within {timeout:g} s")
    except OSError as exc:
        return exc
    finally:
        sock.close()
    return None


_NOT_A_REQUEST = bytes(16)
"""What the liveness probe sends: not a valid RPC header, so a live master closes the
connection at once (measured: under 2 ms on loopback); a hung one (SIGSTOP) never answers,
and its kernel still accepts the connect."""


async def _answers(host: str, port: int, timeout: float) -> bool:
    """A live master answers a malformed request by closing the connection; False when
    nothing came back within ``timeout`` (a hung master: ``setup()`` would freeze the process
    for the RPC timeout per attempt)."""
    if not on_asyncio():
        from . import anyio_probes

        return await anyio_probes.answers(host, port, timeout, _NOT_A_REQUEST)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    try:
        writer.write(_NOT_A_REQUEST)
        await asyncio.wait_for(writer.drain(), timeout)
        await asyncio.wait_for(reader.read(64), timeout)  # EOF or an error frame: alive
    except (asyncio.TimeoutError, TimeoutError):
        return False
    except OSError:  # reset: alive too
        return True
    finally:
        writer.close()
    return True


MOONCAKE_INSTALL = (
    "pip install mooncake-transfer-engine-non-cuda (CPU hosts; from a clone of aio-mclookup: "
    "pip install -e '.[cpu]'), or mooncake-transfer-engine on GPU hosts"
)
"""How to install the Mooncake wheel, for error messages (aio-mclookup is not on PyPI)."""

_ENV_LOCK = threading.Lock()
"""Serialises client construction: the ``MC_*`` settings are process-wide while it runs."""


@contextlib.contextmanager
def client_env(settings: dict[str, str]) -> Iterator[None]:
    """Set the ``MC_*`` settings the process has not set, only while a client is built (the
    wheel reads them at construction), then restore the environment: child processes of the
    application do not inherit them."""
    with _ENV_LOCK:
        added = [name for name in settings if name not in os.environ]
        for name in added:
            os.environ[name] = settings[name]
        try:
            yield
        finally:
            for name in added:
                os.environ.pop(name, None)


def port_accepts(port: int, host: str = LOOPBACK) -> bool:
    """One loopback TCP connect; on loopback it completes or is refused at once."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


DEFAULT_TENANT = "default"
"""Mooncake's tenant when none is set: the master keeps one key space per tenant."""

_NEW, _OPENING, _OPEN, _CLOSING, _CLOSED = "new", "opening", "open", "closing", "closed"


def client_config(
    master_address: str,
    metadata_server: str,
    local_hostname: str,
    global_segment_size: int = 0,
    local_buffer_size: int = 0,
    tenant_id: str = DEFAULT_TENANT,
) -> dict[str, Any]:
    """The ``setup()`` config of a Mooncake client over TCP (lookup-only: no segment, no
    buffer); ``tenant_id`` selects the master's key space (Mooncake's own default
    ``"default"``)."""
    config: dict[str, Any] = {
        "local_hostname": local_hostname,
        "metadata_server": metadata_server,
        "master_server_addr": master_address,
        "global_segment_size": global_segment_size,
        "local_buffer_size": local_buffer_size,
        "protocol": "tcp",
    }
    if tenant_id != DEFAULT_TENANT:
        config["tenant_id"] = tenant_id
    return config


class ClientPool:
    """A ``MooncakeDistributedStore`` driven from a private thread pool with a safe lifecycle.

    Every blocking client call runs on the pool and is counted in flight from submission until its
    thread finishes, even when the awaiting caller is cancelled (the result is then dropped).
    Closing first refuses new calls (:class:`ClosedError`), then waits for the in-flight ones,
    then runs ``client.close()`` on the pool, then shuts the pool down. The object is not bound to
    an event loop: each call uses the loop that awaits it (asyncio's, or trio's through anyio).
    """

    _role = "client"

    def __init__(
        self,
        master_address: str,
        metadata_server: str,
        *,
        threads: int,
        rpc_timeout: float,
        setup_timeout: float,
        local_hostname: str,
        global_segment_size: int,
        local_buffer_size: int,
        tenant_id: str = DEFAULT_TENANT,
        connect_timeout: float = 1.0,
        isolate: bool = False,
    ) -> None:
        positive_int("threads", threads)
        for name, seconds in (
            ("rpc_timeout", rpc_timeout),
            ("setup_timeout", setup_timeout),
            ("connect_timeout", connect_timeout),
        ):
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
                raise InvalidRequest(f"{name} must be > 0 seconds, got {seconds!r}", field=name)
        if not isinstance(master_address, str):
            raise InvalidRequest(
                f"master_address must be a str, got {master_address!r}", field="master_address"
            )
        self.etcd_endpoints = etcd_endpoints(master_address)
        """The etcd endpoints of an ``etcd://`` address (HA masters), else None."""
        if self.etcd_endpoints is None:
            self._master_host, self._master_port = _split_host_port(master_address)
        else:
            self._master_host, self._master_port = self.etcd_endpoints[0]
        self.connect_timeout = connect_timeout
        self.isolated = isolate
        """The Mooncake client runs in a child process of its own (see ``isolated``)."""
        self.master_address = master_address
        self.metadata_server = metadata_server
        self.rpc_timeout = rpc_timeout
        self.setup_timeout = setup_timeout
        self.local_hostname = local_hostname
        self._threads = threads
        self._config = client_config(
            master_address,
            metadata_server,
            local_hostname,
            global_segment_size,
            local_buffer_size,
            tenant_id,
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix=f"mooncake-{self._role}"
        )
        self._cond = threading.Condition()
        self._state = _NEW
        self._inflight = 0
        self._client: Any = None
        self._close_future: concurrent.futures.Future[None] | None = None

    # ---- public lifecycle ------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Client calls submitted to the pool and not finished yet."""
        with self._cond:
            return self._inflight

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` has been called (or opening failed)."""
        with self._cond:
            return self._state in (_CLOSING, _CLOSED)

    async def open(self) -> None:
        """Probe the master, then create and set up the client on the pool.

        Raises :class:`StoreError` with ``code=-900`` at once when the master's RPC port (or an
        HTTP metadata server) does not accept a TCP connect within ``setup_timeout``, instead of
        letting ``setup()`` retry while holding the GIL (docs/mooncake.md, Failures). A non-zero
        ``setup()`` return raises :class:`StoreError` with that code. On any failure the object is
        closed. ``setup()`` holds the GIL while it runs, so the whole process pauses for it.
        """
        with self._cond:
            if self._state != _NEW:
                raise ClosedError(f"{type(self).__name__} can be opened only once")
            self._state = _OPENING
        try:
            await self._probe()
            await self._call(self._setup_job, _OPENING)
        except BaseException as exc:
            fut = self._begin_close()
            if isinstance(exc, Exception):
                with contextlib.suppress(Exception):
                    await wait_future(fut)
            raise
        with self._cond:
            if self._state != _OPENING:
                raise ClosedError(f"{type(self).__name__} was closed while opening")
            self._state = _OPEN

    async def aclose(self) -> None:
        """Refuse new calls, wait for in-flight ones, close the client, stop the threads.

        Idempotent. In-flight calls are bounded by the client's RPC timeout (and its reconnect
        back-off while the master is down). ``close()`` holds the GIL for a while: close at
        shut-down only (figures in docs/mooncake.md).
        """
        fut = self._begin_close()
        # Shielded: a caller that stops waiting must not cancel the close job itself.
        await wait_future(fut, shield=True)

    async def __aenter__(self: _Self) -> _Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def health_check(self) -> int:
        """The client's own health flag, without blocking: 0 healthy, 1 not set up or closed,
        2 master unreachable (it lags the truth by ~1-9 s; it reads the ping thread's state)."""
        with self._cond:
            if self._state != _OPEN or self._client is None:
                return 1
            return int(self._client.health_check())

    # ---- hooks for subclasses -------------------------------------------------------------

    def _after_setup(self, client: Any) -> None:
        """Runs on the pool right after a successful ``setup()``."""

    def _before_close(self) -> None:
        """Runs on the pool before the client is closed (also after a failed open)."""

    # ---- internals -------------------------------------------------------------------------

    def _client_settings(self) -> dict[str, str]:
        """The ``MC_*`` settings the client is built with (where the process has none)."""
        wanted = {
            "MC_STORE_CLIENT_SETUP_RETRIES": "2",
            "MC_RPC_TIMEOUT_MS": str(max(1, round(self.rpc_timeout * 1000))),
            "MC_RPC_CONNECT_TIMEOUT_MS": str(max(1, round(self.connect_timeout * 1000))),
        }
        try:
            ipaddress.ip_address(self.local_hostname)
        except ValueError:
            pass
        else:
            wanted["MC_TCP_BIND_ADDRESS"] = self.local_hostname
        preset = os.environ.get("MC_RPC_TIMEOUT_MS")
        if preset is not None and preset != wanted["MC_RPC_TIMEOUT_MS"]:
            _log.warning(
                "%s: MC_RPC_TIMEOUT_MS=%s is set in the environment and overrides "
                "rpc_timeout=%g s (the Mooncake client reads only the variable)",
                type(self).__name__, preset, self.rpc_timeout,
            )
        return wanted

    async def _probe(self) -> None:
        if self.etcd_endpoints is not None:
            await self._probe_etcd(self.etcd_endpoints)
        else:
            await self._probe_master()
        url = urlsplit(self.metadata_server)
        if url.scheme in ("http", "https") and url.hostname:
            port = url.port or (443 if url.scheme == "https" else 80)
            err = await _tcp_probe(url.hostname, port, self.setup_timeout)
            if err is not None:
                raise StoreError(
                    f"metadata server {self.metadata_server} is not reachable: {err}",
                    code=RPC_FAIL,
                )

    async def _probe_master(self) -> None:
        err = await _tcp_probe(self._master_host, self._master_port, self.setup_timeout)
        if err is not None:
            raise StoreError(
                f"Mooncake master {self.master_address} is not reachable: {err}", code=RPC_FAIL
            )
        if not await _answers(self._master_host, self._master_port, self.setup_timeout):
            raise StoreError(
                f"Mooncake master {self.master_address} accepts connections but does not "
                f"answer within {self.setup_timeout:g} s (hung?); not calling setup(), which "
                "would freeze the process meanwhile",
                code=RPC_TIMEOUT,
            )

    async def _probe_etcd(self, endpoints: list[tuple[str, int]]) -> None:
        """Some etcd endpoint accepts, and etcd names a leader (else ``setup()`` would wait,
        GIL held, for ~10 s)."""
        errors = [await _tcp_probe(host, port, self.setup_timeout) for host, port in endpoints]
        if all(err is not None for err in errors):
            raise StoreError(
                f"no etcd endpoint of {self.master_address} is reachable: {errors[0]}",
                code=RPC_FAIL,
            )
        try:
            found = await asyncio.to_thread(leader, endpoints, self.setup_timeout)
        except OSError as exc:
            raise StoreError(
                f"etcd at {self.master_address} does not answer: {exc}", code=RPC_FAIL
            ) from None
        if found is None:
            raise StoreError(
                f"no Mooncake master leads in etcd at {self.master_address} (no master_view)",
                code=RPC_FAIL,
            )

    def _setup_job(self) -> None:
        if self.isolated:  # (the child sets these before it imports the wheel)
            client: Any = ChildClient(
                {**self._client_settings(), **quiet_settings()},
                setup_timeout=self.setup_timeout,
                call_timeout=2 * self.rpc_timeout + 5.0,  # (reconnects take ~4.3 s)
            )
            with self._cond:
                self._client = client
            rc = client.setup(dict(self._config))
        else:
            rc = self._setup_here()
        if rc != 0:
            raise StoreError(
                f"Mooncake setup() against {self.master_address} returned {rc}", code=int(rc)
            )
        self._after_setup(self._client)

    def _setup_here(self) -> int:
        """Build and set up the client in this process (``setup()`` holds the GIL)."""
        if self.etcd_endpoints is not None:
            claim_endpoints(self.master_address)  # (one etcd string per process)
        quiet = quiet_settings()
        with client_env({**self._client_settings(), **quiet}), setup_output(bool(quiet)):
            # (imported here: the wheel reads MC_LOG_LEVEL once, when it loads)
            from mooncake.store import MooncakeDistributedStore

            client = MooncakeDistributedStore()
            with self._cond:
                self._client = client  # so a close after a failed setup still closes it
            return int(client.setup(dict(self._config)))

    def _call_finished(self, _fut: concurrent.futures.Future[Any]) -> None:
        with self._cond:
            self._inflight -= 1
            if self._inflight == 0:
                self._cond.notify_all()

    def _submit(self, fn: Callable[[], _T], state: str = _OPEN) -> concurrent.futures.Future[_T]:
        """Submit ``fn`` to the pool if the object is in ``state``; count it in flight until
        it is done. Raises :class:`ClosedError` otherwise."""
        with self._cond:
            if self._state != state:
                raise ClosedError(f"{type(self).__name__} is {self._state}")
            # Submit under the lock so that no call can queue behind the close job.
            cf = self._pool.submit(fn)
            self._inflight += 1
        cf.add_done_callback(self._call_finished)
        return cf

    async def _call(self, fn: Callable[[], _T], state: str = _OPEN) -> _T:
        """Run ``fn`` on the pool if the object is in ``state``; count it in flight."""
        cf = self._submit(fn, state)
        try:
            return await wait_future(cf)
        except Exception as exc:
            raise_as_error(exc)

    def _client_or_closed(self) -> Any:
        with self._cond:
            if self._state != _OPEN or self._client is None:
                raise ClosedError(f"{type(self).__name__} is {self._state}")
            return self._client

    def _begin_close(self) -> concurrent.futures.Future[None]:
        with self._cond:
            if self._close_future is not None:
                return self._close_future
            self._state = _CLOSING
            fut = self._pool.submit(self._close_job)
            self._close_future = fut
        fut.add_done_callback(lambda _f: self._pool.shutdown(wait=False))
        return fut

    def _close_job(self) -> None:
        with self._cond:
            idle = self._cond.wait_for(lambda: self._inflight == 0, timeout=_CLOSE_WAIT)
            client, self._client = self._client, None
        try:
            self._before_close()
            # Closing with calls still running would crash the process: leak it instead.
            if client is not None and idle:
                client.close()
            elif client is not None:
                _log.warning(
                    "%s: calls still running after %g s; not closing the Mooncake client",
                    type(self).__name__,
                    _CLOSE_WAIT,
                )
        except Exception as exc:
            raise StoreError(f"Mooncake client close() failed: {exc!r}") from exc
        finally:
            with self._cond:
                self._state = _CLOSED


def raise_as_error(exc: Exception) -> NoReturn:
    """Raise a client call's exception as this library's (:func:`as_error`), chained."""
    error = as_error(exc)
    if error is exc:
        raise exc
    raise error from exc


def as_error(exc: BaseException) -> BaseException:
    """A client call's exception as this library's: an :class:`Error` as it is, anything
    else (the wheel's own) as a :class:`StoreError` without a code."""
    return exc if isinstance(exc, Error) else StoreError(f"Mooncake client call failed: {exc!r}")
