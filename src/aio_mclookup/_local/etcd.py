"""A real etcd on loopback, as a child process, for HA masters (:class:`LocalEtcd`): Debian's
``etcd-server`` package (etcd 3.4) or any ``etcd`` binary on ``PATH``."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import weakref
from collections.abc import Generator
from pathlib import Path
from types import TracebackType

from .._errors import ClosedError, StoreError
from .._store.pool import LOOPBACK, port_accepts
from .master import _make_preexec, _reap, _run_async, _run_sync, free_ports

__all__ = ["LocalEtcd"]


class LocalEtcd:
    """One etcd member on 127.0.0.1 (client and peer ports chosen free, below the ephemeral
    range), its data in a temporary directory; ``endpoint`` is ``127.0.0.1:PORT``, for
    ``LocalMaster(etcd=...)`` and ``etcd://`` addresses. The child gets SIGKILL when its
    starting thread exits, and at garbage collection / interpreter exit."""

    def __init__(self, *, binary: str | None = None, startup_timeout: float = 15.0) -> None:
        self._binary = binary
        self.startup_timeout = startup_timeout
        self.client_port: int | None = None
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._children: list[subprocess.Popen[bytes]] = []
        self._finalizer = weakref.finalize(self, _reap, self._children)

    @property
    def endpoint(self) -> str:
        if self.client_port is None:
            raise ClosedError("LocalEtcd has not been started")
        return f"{LOOPBACK}:{self.client_port}"

    async def start(self) -> None:
        await _run_async(self._start_steps())

    def start_blocking(self) -> None:
        _run_sync(self._start_steps())

    async def stop(self) -> None:
        self.stop_blocking()  # (a SIGKILL and a reap: milliseconds)

    def stop_blocking(self) -> None:
        _reap(self._children)
        self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    async def __aenter__(self) -> LocalEtcd:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def _start_steps(self) -> Generator[float, None, None]:
        binary = self._binary or shutil.which("etcd")
        if binary is None:
            raise StoreError("etcd not found on PATH (Debian: apt-get install etcd-server)")
        self._dir = Path(tempfile.mkdtemp(prefix="aio-mclookup-etcd-"))
        client, peer = free_ports(2, low=True)
        self.client_port = client
        argv = [
            binary,
            f"--data-dir={self._dir / 'data'}",
            f"--listen-client-urls=http://{LOOPBACK}:{client}",
            f"--advertise-client-urls=http://{LOOPBACK}:{client}",
            f"--listen-peer-urls=http://{LOOPBACK}:{peer}",
            f"--initial-advertise-peer-urls=http://{LOOPBACK}:{peer}",
            f"--initial-cluster=default=http://{LOOPBACK}:{peer}",
            "--listen-metrics-urls=",
        ]
        with (self._dir / "etcd.log").open("ab") as log:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_make_preexec(os.getpid()), close_fds=True,
            )
        self._children.append(self._proc)
        deadline = time.monotonic() + self.startup_timeout
        while not port_accepts(client):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = (self._dir / "etcd.log").read_text(errors="replace")[-2000:]
                self.stop_blocking()
                raise StoreError(f"etcd did not start:\n{tail}")
            yield 0.02
