"""The real Mooncake store: a lookup client, a key writer, and a loopback master for tests.

``mooncake.store`` is imported lazily, inside the functions that need it, so this module (and the
package) imports without the Mooncake wheel installed.

Three facts about the Mooncake client (``mooncake-transfer-engine-non-cuda`` 0.3.13) shape this
module:

* ``setup()`` and ``close()`` hold the GIL for their whole duration (tens of ms for a good setup,
  ~0.3-2 s for close, up to 4.4 s per failed setup attempt). Open and close clients at start-up and
  shut-down, never per request.
* The wheel segfaults on a lookup before ``setup()``, after ``close()``, and on ``close()`` while a
  lookup runs. :class:`_ClientThread` guards every call with a state flag and an in-flight count.
* A failed RPC is not raised; every element of the answer carries the same negative error code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import functools
import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ._errors import ClosedError, Error, InvalidRequest, StoreError

__all__ = ["LocalMaster", "MooncakeStore", "StoreWriter"]

_T = TypeVar("_T")
_Self = TypeVar("_Self", bound="_ClientThread")
_log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"

# Mooncake ErrorCode values (mooncake-store/include/types.h) that this module reads.
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
RPC_FAIL = -900
RPC_TIMEOUT = -901

_CODE_NAMES = {
    INTERNAL_ERROR: "INTERNAL_ERROR",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    INVALID_PARAMS: "INVALID_PARAMS",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}

_CHUNK = 1000
"""Keys per writer RPC: large requests stall ~40 ms on loopback's delayed ACK above ~2000 keys."""

_CLOSE_WAIT = 120.0
"""Longest time a close waits for in-flight calls before it gives up on closing the client."""


def _code_name(code: int) -> str:
    return _CODE_NAMES.get(code, "unknown")


def _split_host_port(address: str) -> tuple[str, int]:
    """Split ``host:port`` (or ``[v6]:port``) into its parts."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected 'host:port', got {address!r}")
    return host.strip("[]") or LOOPBACK, int(port)


async def _tcp_probe(host: str, port: int, timeout: float) -> OSError | None:
    """Try one TCP connect without blocking the loop; return the error or ``None`` on success."""
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


def _port_accepts(port: int, host: str = LOOPBACK) -> bool:
    """One loopback TCP connect; on loopback it completes or is refused at once."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# The client on its own threads, with a lifecycle that cannot reach the wheel's crash paths.
# --------------------------------------------------------------------------------------------

_NEW, _OPENING, _OPEN, _CLOSING, _CLOSED = "new", "opening", "open", "closing", "closed"


class _ClientThread:
    """A ``MooncakeDistributedStore`` driven from a private thread pool with a safe lifecycle.

    Every blocking client call runs on the pool and is counted in flight from submission until its
    thread finishes, even when the awaiting caller is cancelled (the result is then dropped).
    Closing first refuses new calls (:class:`ClosedError`), then waits for the in-flight ones,
    then runs ``client.close()`` on the pool, then shuts the pool down. The object is not bound to
    an event loop: each call uses the loop that awaits it.
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
    ) -> None:
        if threads < 1:
            raise ValueError("threads must be >= 1")
        if rpc_timeout <= 0 or setup_timeout <= 0:
            raise ValueError("rpc_timeout and setup_timeout must be > 0")
        self._master_host, self._master_port = _split_host_port(master_address)
        self.master_address = master_address
        self.metadata_server = metadata_server
        self.rpc_timeout = rpc_timeout
        self.setup_timeout = setup_timeout
        self.local_hostname = local_hostname
        self._threads = threads
        self._config: dict[str, Any] = {
            "local_hostname": local_hostname,
            "metadata_server": metadata_server,
            "master_server_addr": master_address,
            "global_segment_size": global_segment_size,
            "local_buffer_size": local_buffer_size,
            "protocol": "tcp",
        }
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
        letting ``setup()`` retry for ~4.4 s per attempt while holding the GIL. A non-zero
        ``setup()`` return raises :class:`StoreError` with that code. On any failure the object is
        closed. ``setup()`` holds the GIL while it runs, so the whole process pauses for it.
        """
        with self._cond:
            if self._state != _NEW:
                raise ClosedError(f"{type(self).__name__} can be opened only once")
            self._state = _OPENING
        try:
            await self._probe()
            self._apply_env_defaults()
            await self._call(self._setup_job, _OPENING)
        except BaseException as exc:
            fut = self._begin_close()
            if isinstance(exc, Exception):
                with contextlib.suppress(Exception):
                    await asyncio.wrap_future(fut)
            raise
        with self._cond:
            if self._state != _OPENING:
                raise ClosedError(f"{type(self).__name__} was closed while opening")
            self._state = _OPEN

    async def aclose(self) -> None:
        """Refuse new calls, wait for in-flight ones, close the client, stop the threads.

        Idempotent. In-flight calls are bounded by the client's RPC timeout (and ~4.4 s per call
        while the master is down). ``close()`` holds the GIL (~0.3-2 s): close at shut-down only.
        """
        fut = self._begin_close()
        # Shielded: a caller that stops waiting must not cancel the close job itself.
        await asyncio.shield(asyncio.wrap_future(fut))

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

    # ---- internals -------------------------------------------------------------------------

    def _apply_env_defaults(self) -> None:
        """Set the process-wide ``MC_*`` defaults that the client reads at construction."""
        try:
            ipaddress.ip_address(self.local_hostname)
        except ValueError:
            pass
        else:
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.local_hostname)
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(1, round(self.rpc_timeout * 1000))))

    async def _probe(self) -> None:
        err = await _tcp_probe(self._master_host, self._master_port, self.setup_timeout)
        if err is not None:
            raise StoreError(
                f"Mooncake master {self.master_address} is not reachable: {err}", code=RPC_FAIL
            )
        url = urlsplit(self.metadata_server)
        if url.scheme in ("http", "https") and url.hostname:
            port = url.port or (443 if url.scheme == "https" else 80)
            err = await _tcp_probe(url.hostname, port, self.setup_timeout)
            if err is not None:
                raise StoreError(
                    f"metadata server {self.metadata_server} is not reachable: {err}",
                    code=RPC_FAIL,
                )

    def _setup_job(self) -> None:
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        with self._cond:
            self._client = client  # so a close after a failed setup still closes it
        rc = client.setup(dict(self._config))
        if rc != 0:
            raise StoreError(
                f"Mooncake setup() against {self.master_address} returned {rc}", code=int(rc)
            )
        self._after_setup(client)

    def _release(self, _fut: concurrent.futures.Future[Any]) -> None:
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
        cf.add_done_callback(self._release)
        return cf

    async def _call(self, fn: Callable[[], _T], state: str = _OPEN) -> _T:
        """Run ``fn`` on the pool if the object is in ``state``; count it in flight."""
        cf = self._submit(fn, state)
        try:
            return await asyncio.wrap_future(cf)
        except Exception as exc:
            error = _as_error(exc)
            if error is exc:
                raise
            raise error from exc

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


def _exist(client: Any, batch: list[str | bytes]) -> list[int]:
    """The client's ``batch_is_exist`` (on a pool thread), a failed RPC raised."""
    answers: list[int] = client.batch_is_exist(batch)
    _raise_if_failed_rpc("batch_is_exist", answers)
    return answers


def _as_error(exc: BaseException) -> BaseException:
    """A client call's exception as this library's: an :class:`Error` as it is, anything
    else (the wheel's own) as a :class:`StoreError` without a code."""
    return exc if isinstance(exc, Error) else StoreError(f"Mooncake client call failed: {exc!r}")


def _raise_if_failed_rpc(op: str, codes: Sequence[int]) -> None:
    """Raise :class:`StoreError` when every answer is the same negative code (a failed RPC)."""
    if codes:
        first = codes[0]
        if first < 0 and all(c == first for c in codes):
            raise StoreError(
                f"Mooncake {op} failed for all {len(codes)} keys with code {first} "
                f"({_code_name(first)})",
                code=first,
            )


def _raise_bad_codes(
    op: str, keys: Sequence[str], codes: Sequence[int], ok: tuple[int, ...]
) -> None:
    """Raise :class:`StoreError` for the first per-key code not in ``ok``."""
    if len(codes) != len(keys):
        raise StoreError(f"Mooncake {op} answered {len(codes)} codes for {len(keys)} keys")
    bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c not in ok]
    if bad:
        key, code = bad[0]
        raise StoreError(
            f"Mooncake {op} failed for {len(bad)} of {len(keys)} keys; first {key!r} with code "
            f"{code} ({_code_name(code)})",
            code=code,
        )


class MooncakeStore(_ClientThread):
    """The real :class:`~aio_mclookup.Store`: a lookup-only Mooncake client (no segment, no buffer).

    ``async with MooncakeStore(master, metadata) as store: await store.batch_is_exist(keys)``.

    Blocking client calls run on a private ``ThreadPoolExecutor`` of ``threads`` workers (also
    exposed as ``max_concurrency``), never on the loop's default executor. Concurrent calls on one
    client are safe and give correct results.

    Process-wide environment: before the client is built, :meth:`open` sets these only where the
    process has not (``os.environ.setdefault``; the client reads them at construction, so the
    first client of the process decides):

    * ``MC_TCP_BIND_ADDRESS=<local_hostname>`` when ``local_hostname`` is an IP address (the
      default ``127.0.0.1`` makes the client advertise and use loopback);
    * ``MC_STORE_CLIENT_SETUP_RETRIES=2`` (the default, 20, means ~90 s against a dead master);
    * ``MC_RPC_TIMEOUT_MS=<rpc_timeout * 1000>`` (default 30 s; size it above the slowest batch).

    The client's own listeners (transfer-engine handshake and TCP data ports, 15000-17000) still
    bind all interfaces; no option changes that. For hard isolation run in a network namespace.

    ``setup()`` and ``close()`` of the Mooncake client hold the GIL for their whole duration (the
    process freezes; ~20-40 ms setup, ~0.3-1 s close), so open the store at start-up and close it
    at shut-down, not per request. A dead master fails :meth:`open` fast with
    ``StoreError(code=-900)`` thanks to a TCP probe. While the master is down, each lookup returns
    after up to ~4.4 s (reconnect back-off) with ``StoreError(code=-900)``; the client reconnects
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
    ) -> None:
        super().__init__(
            master_address,
            metadata_server,
            threads=threads,
            rpc_timeout=rpc_timeout,
            setup_timeout=setup_timeout,
            local_hostname=local_hostname,
            global_segment_size=0,
            local_buffer_size=0,
        )
        self.max_concurrency = threads

    def __repr__(self) -> str:
        return (
            f"MooncakeStore({self.master_address!r}, {self.metadata_server!r}, "
            f"threads={self.max_concurrency}, state={self._state})"
        )

    async def batch_is_exist(self, keys: Sequence[str | bytes]) -> list[int]:
        """Answer each key: 1 present, 0 absent (or a per-key negative code), in order.

        ``str`` and ``bytes`` keys are both accepted (bytes compare byte-exact with the UTF-8 of
        a str key); a bare ``str`` raises :class:`InvalidRequest`. The batch is sent as one RPC:
        keep it at <= ~1000 keys (larger requests can stall ~40 ms on loopback's delayed ACK).

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

    def _batch_is_exist_then(
        self, keys: Sequence[str | bytes], then: Callable[[list[int] | BaseException], None]
    ) -> None:
        """:meth:`batch_is_exist` for the coordinator, without an awaiting task: ``then``
        gets the answers (or the :class:`Error` it would raise) on this loop's thread, as
        soon as the loop picks them up. Raises :class:`ClosedError` as it would."""
        loop = asyncio.get_running_loop()
        client = self._client_or_closed()
        batch = list(keys)

        def deliver(done: concurrent.futures.Future[list[int]]) -> None:  # (a pool thread)
            outcome: list[int] | BaseException
            if done.cancelled():
                outcome = StoreError("Mooncake client call was cancelled")
            elif (exc := done.exception()) is not None:
                outcome = _as_error(exc)
            else:
                outcome = done.result()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(then, outcome)

        self._submit(functools.partial(_exist, client, batch)).add_done_callback(deliver)


class StoreWriter(_ClientThread):
    """Stores keys the way vLLM's workers do, with a 1-byte value each (tests, load generator).

    It mounts a ``segment_size`` segment of its own memory: the keys it puts live in that segment
    and therefore only while the writer lives. After :meth:`aclose` the master drops them within
    ~1.5 s; if the process dies, after the master's ``--client_ttl`` (default 10 s).

    After a master restart all keys are gone. The writer needs no re-open: its client re-mounts
    its segment by itself about a second later. Until then puts fail with ``StoreError`` code
    -900 (first call on the dropped connection) or -200 (no segment mounted yet): retry, then
    :meth:`put_keys` stores the keys again.

    It shares :class:`MooncakeStore`'s thread and lifecycle safety and ``MC_*`` defaults.
    """

    _role = "writer"

    def __init__(
        self,
        master_address: str,
        metadata_server: str,
        *,
        segment_size: int = 64 << 20,
        local_buffer_size: int = 16 << 20,
        threads: int = 1,
        rpc_timeout: float = 2.0,
        setup_timeout: float = 10.0,
        local_hostname: str = LOOPBACK,
    ) -> None:
        if segment_size <= 0 or local_buffer_size <= 0:
            raise ValueError("segment_size and local_buffer_size must be > 0")
        super().__init__(
            master_address,
            metadata_server,
            threads=threads,
            rpc_timeout=rpc_timeout,
            setup_timeout=setup_timeout,
            local_hostname=local_hostname,
            global_segment_size=segment_size,
            local_buffer_size=local_buffer_size,
        )
        self.segment_size = segment_size
        self.local_buffer_size = local_buffer_size
        # The 1-byte source every key's value is copied from; registered after setup. It stays
        # alive as long as the writer (the client may reference it until close).
        self._value = ctypes.create_string_buffer(b"x", 1)
        self._value_ptr = ctypes.addressof(self._value)

    def __repr__(self) -> str:
        return (
            f"StoreWriter({self.master_address!r}, {self.metadata_server!r}, "
            f"segment_size={self.segment_size}, state={self._state})"
        )

    def _after_setup(self, client: Any) -> None:
        rc = client.register_buffer(self._value_ptr, 1)
        if rc != 0:
            raise StoreError(f"Mooncake register_buffer() returned {rc}", code=int(rc))

    async def put_keys(self, keys: Iterable[str]) -> int:
        """Store each distinct key with the value ``b"x"``; return how many distinct keys were
        given and are now stored.

        Keys are deduplicated (order kept) and written in chunks of 1000 with ``batch_put_from``
        from one registered 1-byte buffer. A key that is already present is fine (Mooncake
        answers 0 or ``OBJECT_ALREADY_EXISTS`` and keeps the first object). Any other per-key code
        raises :class:`StoreError` with that code (e.g. -200: segment full), as does a failed RPC.
        """
        client = self._client_or_closed()
        unique = list(dict.fromkeys(keys))
        ptr = self._value_ptr
        stored = 0
        for start in range(0, len(unique), _CHUNK):
            chunk = unique[start : start + _CHUNK]
            n = len(chunk)
            codes: list[int] = await self._call(
                functools.partial(client.batch_put_from, chunk, [ptr] * n, [1] * n)
            )
            _raise_bad_codes("batch_put_from", chunk, codes, (0, OBJECT_ALREADY_EXISTS))
            stored += n
        return stored

    async def remove_keys(self, keys: Iterable[str], force: bool = True) -> int:
        """Remove keys; return how many were removed (absent keys are skipped).

        ``force=True`` ignores read leases, which every lookup that finds a key grants for
        ``--default_kv_lease_ttl`` (10 s by default); without it such keys fail with -706.
        """
        client = self._client_or_closed()
        unique = list(dict.fromkeys(keys))
        removed = 0
        for start in range(0, len(unique), _CHUNK):
            chunk = unique[start : start + _CHUNK]
            codes: list[int] = await self._call(
                functools.partial(client.batch_remove, chunk, force)
            )
            _raise_bad_codes("batch_remove", chunk, codes, (0, OBJECT_NOT_FOUND))
            removed += sum(1 for c in codes if c == 0)
        return removed


# --------------------------------------------------------------------------------------------
# A real master (plus the loopback HTTP metadata server) as child processes.
# --------------------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()


def _make_preexec(parent_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when its parent dies."""
    prctl = _PRCTL
    if prctl is None:
        return None
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free on loopback a moment ago."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((LOOPBACK, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _find_master_binary() -> str:
    """``mooncake_master`` next to ``sys.executable`` (the venv's bin/), else on ``PATH``."""
    candidate = Path(sys.executable).parent / "mooncake_master"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("mooncake_master")
    if found:
        return found
    raise StoreError(
        "mooncake_master not found next to the Python interpreter or on PATH; "
        "install mooncake-transfer-engine-non-cuda (aio-mclookup[cpu])"
    )


def _reap(children: list[subprocess.Popen[bytes]]) -> None:
    """Kill and reap children (also the last resort at garbage collection / interpreter exit)."""
    for proc in children:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
    children.clear()


def _next_step(gen: Generator[float, None, _T]) -> tuple[bool, float, _T | None]:
    """Advance a step generator: ``(done, delay, result)``."""
    try:
        return False, next(gen), None
    except StopIteration as stop:
        return True, 0.0, stop.value


def _run_sync(gen: Generator[float, None, _T]) -> _T | None:
    """Drive a step generator, sleeping with ``time.sleep`` between steps."""
    try:
        done, delay, result = _next_step(gen)
        while not done:
            time.sleep(delay)
            done, delay, result = _next_step(gen)
        return result
    finally:
        gen.close()


async def _run_async(gen: Generator[float, None, _T]) -> _T | None:
    """Drive a step generator, sleeping with ``asyncio.sleep`` between steps."""
    try:
        done, delay, result = _next_step(gen)
        while not done:
            await asyncio.sleep(delay)
            done, delay, result = _next_step(gen)
        return result
    finally:
        gen.close()


class LocalMaster:
    """A real ``mooncake_master`` and an HTTP metadata server, both on loopback, as children.

    ``async with LocalMaster() as m: MooncakeStore(m.master_address, m.metadata_server)``; or
    ``start_blocking()`` / ``stop_blocking()`` from synchronous code (e.g. a session fixture).

    The master runs with ``--rpc_address=127.0.0.1 --rpc_port=P --metrics_host=127.0.0.1
    --metrics_port=M --logtostderr`` plus the given flags. The master's built-in HTTP metadata
    server is not used (it binds 0.0.0.0 whatever its host flag says); instead
    ``python -m mooncake.http_metadata_server --host 127.0.0.1 --port H`` runs as a second child.
    Both write to log files in ``log_dir``.

    Children get SIGKILL when the *thread* that started them exits (``PR_SET_PDEATHSIG``), so start
    from a long-lived thread (the main or event-loop thread); they also run in their own session
    (no terminal signals) and are killed at garbage collection / interpreter exit if still alive.
    Ports are chosen once and kept: :meth:`restart` comes back on the same ones.
    """

    def __init__(
        self,
        *,
        default_kv_lease_ttl: int | str | None = None,
        client_ttl: int | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 30.0,
        stop_timeout: float = 5.0,
        log_dir: str | os.PathLike[str] | None = None,
        keep_logs: bool = False,
        binary: str | None = None,
    ) -> None:
        """``default_kv_lease_ttl``: ms or a duration like ``"100ms"``; ``client_ttl``: seconds;
        ``extra_args``: more master flags; ``keep_logs``: keep a temporary log dir after stop."""
        self.default_kv_lease_ttl = default_kv_lease_ttl
        self.client_ttl = client_ttl
        self.extra_args = tuple(extra_args)
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self._binary = binary
        self._own_log_dir = log_dir is None
        self._keep_logs = keep_logs or log_dir is not None
        self._log_dir: Path | None = Path(log_dir) if log_dir is not None else None
        self.rpc_port: int | None = None
        self.metrics_port: int | None = None
        self.metadata_port: int | None = None
        self._master: subprocess.Popen[bytes] | None = None
        self._metadata: subprocess.Popen[bytes] | None = None
        self._children: list[subprocess.Popen[bytes]] = []
        self._finalizer = weakref.finalize(self, _reap, self._children)

    # ---- addresses and state ---------------------------------------------------------------

    @property
    def master_address(self) -> str:
        """``127.0.0.1:P``, for ``MooncakeStore``'s ``master_address``."""
        if self.rpc_port is None:
            raise Error("LocalMaster has not been started")
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """``http://127.0.0.1:H/metadata``, for ``MooncakeStore``'s ``metadata_server``."""
        if self.metadata_port is None:
            raise Error("LocalMaster has not been started")
        return f"http://{LOOPBACK}:{self.metadata_port}/metadata"

    @property
    def pid(self) -> int | None:
        """PID of the running master process, else ``None``."""
        proc = self._master
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def metadata_pid(self) -> int | None:
        """PID of the running metadata server, else ``None``."""
        proc = self._metadata
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def log_dir(self) -> Path | None:
        """Directory of ``master.log`` and ``metadata.log`` (``None`` before the first start)."""
        return self._log_dir

    @property
    def master_log(self) -> Path | None:
        """The master's log file (stdout and stderr, appended across restarts)."""
        return None if self._log_dir is None else self._log_dir / "master.log"

    @property
    def metadata_log(self) -> Path | None:
        """The metadata server's log file."""
        return None if self._log_dir is None else self._log_dir / "metadata.log"

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of both logs, for error messages."""
        out = []
        for path in (self.master_log, self.metadata_log):
            if path is None or not path.exists():
                continue
            with path.open("rb") as f:
                f.seek(max(0, path.stat().st_size - 16384))
                tail = f.read().decode(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path} ---\n" + "\n".join(tail))
        return "\n".join(out)

    def __repr__(self) -> str:
        return f"LocalMaster(rpc_port={self.rpc_port}, pid={self.pid}, log_dir={self._log_dir})"

    # ---- public API ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start both children and wait until the RPC and metadata ports accept connections."""
        await _run_async(self._start_steps(restart=False))

    async def stop(self) -> None:
        """SIGTERM the master, SIGKILL it after ``stop_timeout``; then the metadata server."""
        await _run_async(self._stop_steps())

    async def kill(self) -> None:
        """SIGKILL the master only (a crash); the metadata server keeps running."""
        await _run_async(self._kill_master_steps())

    async def restart(self) -> None:
        """Start the master again on the same ports, once the old process has exited."""
        await _run_async(self._start_steps(restart=True))

    def start_blocking(self) -> None:
        """:meth:`start` for synchronous callers."""
        _run_sync(self._start_steps(restart=False))

    def stop_blocking(self) -> None:
        """:meth:`stop` for synchronous callers."""
        _run_sync(self._stop_steps())

    async def __aenter__(self) -> LocalMaster:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # ---- step generators (yield the seconds to sleep; driven sync or async) -----------------

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        assert self._log_dir is not None
        # The child keeps its own copy of the log descriptor; the parent closes its copy at once.
        with (self._log_dir / f"{name}.log").open("ab") as log:
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_make_preexec(os.getpid()),
                    close_fds=True,
                )
            except OSError as exc:
                raise StoreError(f"cannot start {name} ({argv[0]}): {exc}") from exc
        self._children.append(proc)
        return proc

    def _master_argv(self) -> list[str]:
        argv = [
            self._binary or _find_master_binary(),
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={self.metrics_port}",
            "--logtostderr",
        ]
        if self.default_kv_lease_ttl is not None:
            argv.append(f"--default_kv_lease_ttl={self.default_kv_lease_ttl}")
        if self.client_ttl is not None:
            argv.append(f"--client_ttl={self.client_ttl}")
        argv.extend(self.extra_args)
        return argv

    def _metadata_argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "mooncake.http_metadata_server",
            "--host",
            LOOPBACK,
            "--port",
            str(self.metadata_port),
        ]

    def _start_steps(self, *, restart: bool) -> Generator[float, None, None]:
        if restart:
            if self.rpc_port is None:
                raise Error("LocalMaster.restart() before start()")
            yield from self._wait_exit_steps(self._master, self.stop_timeout, int(signal.SIGTERM))
        elif self._master is not None and self._master.poll() is None:
            raise Error("LocalMaster is already running")
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="aio-mclookup-master-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        fresh_ports = self.rpc_port is None
        deadline = time.monotonic() + self.startup_timeout
        attempt = 0
        try:
            while True:
                attempt += 1
                if self.rpc_port is None:
                    self.rpc_port, self.metrics_port, self.metadata_port = _free_ports(3)
                if self._metadata is None or self._metadata.poll() is not None:
                    self._forget(self._metadata)
                    self._metadata = self._spawn("metadata", self._metadata_argv())
                self._forget(self._master)
                self._master = self._spawn("master", self._master_argv())
                failure = yield from self._wait_ready_steps(deadline)
                if failure is None:
                    return
                # A child exited early. A port taken in the meantime, or (on restart) the old
                # socket still closing, is the usual cause: try again while time remains.
                if time.monotonic() >= deadline or attempt >= 5:
                    raise StoreError(f"LocalMaster did not start: {failure}\n{self.log_tail()}")
                if fresh_ports and not restart:
                    yield from self._stop_steps(remove_logs=False)
                    self.rpc_port = self.metrics_port = self.metadata_port = None
                yield 0.2
        except BaseException:
            self._kill_all_now()
            raise

    def _wait_ready_steps(self, deadline: float) -> Generator[float, None, str | None]:
        """Wait until both ports accept; return ``None``, or why a child exited."""
        assert self.rpc_port is not None and self.metadata_port is not None
        while True:
            for name, proc in (("master", self._master), ("metadata server", self._metadata)):
                if proc is not None and proc.poll() is not None:
                    return f"{name} exited with status {proc.returncode}"
            if _port_accepts(self.metadata_port) and _port_accepts(self.rpc_port):
                return None
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"LocalMaster ports {self.rpc_port}/{self.metadata_port} did not accept "
                    f"connections within {self.startup_timeout:g} s\n{self.log_tail()}"
                )
            yield 0.02

    def _wait_exit_steps(
        self, proc: subprocess.Popen[bytes] | None, grace: float, sig: int | None = None
    ) -> Generator[float, None, None]:
        """Signal ``proc`` (if ``sig``), wait ``grace`` s, then SIGKILL and wait for the exit."""
        if proc is None:
            return
        if sig is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        deadline = time.monotonic() + grace
        while proc.poll() is None and time.monotonic() < deadline:
            yield 0.02
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            deadline = time.monotonic() + 5.0
            while proc.poll() is None and time.monotonic() < deadline:
                yield 0.01
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired as exc:
                raise StoreError(f"process {proc.pid} did not exit after SIGKILL") from exc

    def _kill_master_steps(self) -> Generator[float, None, None]:
        yield from self._wait_exit_steps(self._master, 0.0, int(signal.SIGKILL))

    def _stop_steps(self, *, remove_logs: bool = True) -> Generator[float, None, None]:
        try:
            yield from self._wait_exit_steps(self._master, self.stop_timeout, int(signal.SIGTERM))
            yield from self._wait_exit_steps(self._metadata, self.stop_timeout, int(signal.SIGTERM))
        finally:
            self._kill_all_now()
        self._master = self._metadata = None
        if remove_logs and self._own_log_dir and not self._keep_logs and self._log_dir:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None

    def _forget(self, proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.poll() is not None and proc in self._children:
            self._children.remove(proc)

    def _kill_all_now(self) -> None:
        """SIGKILL and reap every child at once."""
        _reap(self._children)
