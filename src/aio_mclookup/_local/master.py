"""An embedded Mooncake master on loopback (the load generator's default and the tests' real
part): :class:`LocalMaster` starts ``mooncake_master`` and its HTTP metadata server as child
processes that die with their parent."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import weakref
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from .._backend import sleep
from .._errors import ClosedError, InvalidRequest, StoreError
from .._public import present_as_public
from .._store.pool import LOOPBACK, MOONCAKE_INSTALL, port_accepts

__all__ = ["LocalMaster"]

_T = TypeVar("_T")

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


_LOW_PORTS = (20000, 32000)
"""Where :func:`free_ports` looks with ``low=True``: below Linux's ephemeral range (32768+), so
that no client connection takes the port between a master's stop and its restart (an HA
standby promoted on an ephemeral port was seen to fail to start)."""


def free_ports(n: int, *, low: bool = False) -> list[int]:
    """``n`` distinct ports that were free on loopback a moment ago (``low``: from
    :data:`_LOW_PORTS`, else the kernel's choice)."""
    socks: list[socket.socket] = []
    rng = random.Random()
    try:
        while len(socks) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((LOOPBACK, rng.randrange(*_LOW_PORTS) if low else 0))
            except OSError:
                s.close()
                continue
            socks.append(s)
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
        "mooncake_master not found next to the Python interpreter or on PATH: "
        + MOONCAKE_INSTALL
    )


def _isolated_python(program: str) -> list[str]:
    """How to start ``program`` isolated from the caller's Python settings: a Python script
    (the wheel's ``mooncake_master`` is one) runs under ``python -I`` (no ``PYTHONPATH``, no
    user site, nothing imported from the working directory); a native binary as it is."""
    try:
        with open(program, "rb") as f:
            first = f.readline(256)
    except OSError:
        return []
    return [sys.executable, "-I"] if first.startswith(b"#!") and b"python" in first else []


def _stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, or traced): it would ignore SIGTERM until resumed."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] in (["T"], ["t"])


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
    """Drive a step generator, sleeping on the running async library between steps."""
    try:
        done, delay, result = _next_step(gen)
        while not done:
            await sleep(delay)
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
        etcd: str | None = None,
        oplog: bool = False,
    ) -> None:
        """``default_kv_lease_ttl``: ms or a duration like ``"100ms"``; ``client_ttl``: seconds;
        ``extra_args``: more master flags; ``keep_logs``: keep a temporary log dir after stop.

        ``etcd`` (``HOST:PORT[;HOST:PORT...]``, e.g. a :class:`LocalEtcd`'s ``endpoint``)
        makes it an HA master elected through that etcd (``--enable_ha``; ``oplog``:
        ``--enable_oplog``, so that a promoted standby keeps the keys); it is then ready when
        its metrics port answers (a standby opens no RPC port), and clients reach whichever
        master leads at :attr:`ha_address`."""
        self.etcd = etcd
        self.oplog = oplog
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
            raise ClosedError("LocalMaster has not been started")
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def ha_address(self) -> str:
        """``etcd://E`` for an HA master (``etcd``), for ``MooncakeStore``'s
        ``master_address``: whichever master leads."""
        if self.etcd is None:
            raise InvalidRequest("LocalMaster is not an HA master (etcd=None)")
        return f"etcd://{self.etcd}"

    def health(self, timeout: float = 0.5) -> dict[str, object] | None:
        """The master's ``/health`` (``role``, ``ha_state``, ``service_ready``, ...), read from
        its metrics port; None when it does not answer."""
        if self.metrics_port is None:
            return None
        try:
            with urllib.request.urlopen(
                f"http://{LOOPBACK}:{self.metrics_port}/health", timeout=timeout
            ) as reply:
                found = json.load(reply)
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) else None

    @property
    def metadata_server(self) -> str:
        """``http://127.0.0.1:H/metadata``, for ``MooncakeStore``'s ``metadata_server``."""
        if self.metadata_port is None:
            raise ClosedError("LocalMaster has not been started")
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
                    cwd=self._log_dir,  # (not the caller's directory: nothing to import there)
                )
            except OSError as exc:
                raise StoreError(f"cannot start {name} ({argv[0]}): {exc}") from exc
        self._children.append(proc)
        return proc

    def _master_argv(self) -> list[str]:
        binary = self._binary or _find_master_binary()
        argv = [
            *_isolated_python(binary),
            binary,
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={self.metrics_port}",
            "--logtostderr",
        ]
        if self.etcd is not None:
            argv += ["--enable_ha=true", f"--etcd_endpoints={self.etcd}"]
            if self.oplog:
                argv.append("--enable_oplog=true")
        if self.default_kv_lease_ttl is not None:
            argv.append(f"--default_kv_lease_ttl={self.default_kv_lease_ttl}")
        if self.client_ttl is not None:
            argv.append(f"--client_ttl={self.client_ttl}")
        argv.extend(self.extra_args)
        return argv

    def _metadata_argv(self) -> list[str]:
        return [
            sys.executable,
            "-I",  # isolated: no script directory, working directory or PYTHON* variables
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
                raise ClosedError("LocalMaster.restart() before start()")
            yield from self._wait_exit_steps(self._master, self.stop_timeout, int(signal.SIGTERM))
        elif self._master is not None and self._master.poll() is None:
            raise InvalidRequest("LocalMaster is already running")
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
                    self.rpc_port, self.metrics_port, self.metadata_port = free_ports(
                        3, low=self.etcd is not None
                    )
                if self._metadata is None or self._metadata.poll() is not None:
                    self._drop_exited(self._metadata)
                    self._metadata = self._spawn("metadata", self._metadata_argv())
                self._drop_exited(self._master)
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
            ready_port = self.rpc_port if self.etcd is None else self.metrics_port
            assert ready_port is not None
            if port_accepts(self.metadata_port) and port_accepts(ready_port):
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
        # A stopped child (SIGSTOP) cannot act on SIGTERM until resumed: no grace for it.
        while proc.poll() is None and time.monotonic() < deadline and not _stopped(proc.pid):
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

    def _drop_exited(self, proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.poll() is not None and proc in self._children:
            self._children.remove(proc)

    def _kill_all_now(self) -> None:
        """SIGKILL and reap every child at once."""
        _reap(self._children)


present_as_public(LocalMaster)
