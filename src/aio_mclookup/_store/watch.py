"""The master watch: one idle TCP connection to the master's RPC port, held by a thread of its
own, that tells when the master went away (a new *epoch*) and whether its port is up.

Why a held connection: the wheel's master offers no start time, uptime or identity on its
metrics port (``/metrics``, ``/health`` and friends were read: only counters, and a view
version that is null outside HA), and a master that restarts between two lookups produces no
error until the next RPC. The kernel closes every connection of a process that ends, kill -9
included, so the held connection reads end-of-file the moment the master is gone: a restart
is seen however short it is, at no cost per lookup (the thread sleeps in ``select``). A master
left idle keeps the connection open (held 75 s here without a byte either way). In HA mode
``locate`` names the current leader (read from etcd) and a change of leader is a new epoch
too.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
from collections.abc import Callable

__all__ = ["MasterWatch"]

_log = logging.getLogger(__name__)

Locate = Callable[[], "tuple[str, int, object] | None"]
"""Where the master is now: host, port and an identity of the serving master (a leader's
view version; None outside HA), or None when no master serves."""


class MasterWatch:
    """Watch one master (or, with ``locate``, whichever master leads).

    ``epoch`` starts at 0 and grows by one each time a master this watch was connected to is
    lost (its connection ended) or replaced (``locate`` names another one): whatever it
    answered before may no longer hold. ``reachable`` is True while connected, False while
    the port does not accept (or no leader is known), None before the first attempt. Both are
    plain attributes, written by the watch's thread only: reading them costs an attribute
    read.
    """

    def __init__(
        self,
        locate: Locate,
        *,
        retry: float = 0.02,
        recheck: float | None = None,
        name: str = "mooncake-watch",
    ) -> None:
        """``retry``: seconds between connect attempts while the master is away;
        ``recheck``: seconds between ``locate`` calls while connected (None: never, for a
        fixed address)."""
        self.epoch = 0
        self.reachable: bool | None = None
        self._locate = locate
        self._retry = retry
        self._recheck = recheck
        self._stop = threading.Event()
        self._first = threading.Event()
        self._wake_r: socket.socket | None = None  # (made at start: a watch never started
        self._wake_w: socket.socket | None = None  # holds no descriptor)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._identity: object = None
        self._where: tuple[str, int, object] | None = None
        self._was_connected = False

    @classmethod
    def of_address(cls, host: str, port: int) -> MasterWatch:
        """A watch of the master at ``host:port``."""
        return cls(lambda: (host, port, None))

    def start(self, wait: float = 1.0) -> None:
        """Start the thread; wait up to ``wait`` seconds for its first connect attempt."""
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread.start()
        self._first.wait(wait)

    def stop(self, timeout: float = 2.0) -> None:
        """End the thread (at most ``timeout`` seconds; it is a daemon thread either way)."""
        self._stop.set()
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(timeout)
        for sock in (self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()

    # ---- the thread ------------------------------------------------------------------------

    def _lost(self) -> None:
        """A master this watch was connected to is gone or replaced: a new epoch."""
        if self._was_connected:
            self.epoch += 1
            self._was_connected = False

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                sock = self._connect()
                self._first.set()
                if sock is None:
                    self.reachable = False
                    self._sleep(self._retry)
                    continue
                try:
                    self.reachable = True
                    self._was_connected = True
                    self._hold(sock)
                finally:
                    sock.close()
                if not self._stop.is_set():
                    self.reachable = False
                    self._lost()
                    # Not at once: a master killed closes its connections a moment before its
                    # listening socket, and a connect in between reaches the dying process,
                    # whose end would count as a second loss of the same master.
                    self._sleep(self._retry)
        except Exception:  # (a bug here must not go unseen, nor take the process down)
            _log.exception("aio_mclookup: the master watch stopped")
            self.reachable = None
        finally:
            self._first.set()

    def _connect(self) -> socket.socket | None:
        """Locate the master and connect to it; None when that fails."""
        try:
            where = self._locate()
        except Exception as exc:  # (etcd unreachable: the master may still serve)
            _log.debug("aio_mclookup: locating the master failed: %r", exc)
            where = self._where
        self._where = where
        if where is None:
            return None
        host, port, identity = where
        if identity != self._identity:
            if self._identity is not None:
                self._lost()  # another leader than the one seen before
            self._identity = identity
        try:
            return socket.create_connection((host, port), timeout=0.5)
        except OSError:
            return None

    def _hold(self, sock: socket.socket) -> None:
        """Wait until the connection ends, the watch stops, or ``locate`` names another
        master."""
        sock.setblocking(False)
        wake = self._wake_r
        assert wake is not None
        while not self._stop.is_set():
            readable, _, _ = select.select([sock, wake], [], [], self._recheck)
            if wake in readable:
                return
            if sock in readable:
                try:
                    if not sock.recv(4096):
                        return  # end of file: the master is gone
                except BlockingIOError:
                    continue
                except OSError:
                    return
                continue  # (bytes from a master: none are expected; keep holding)
            if self._recheck is not None and self._moved():
                return

    def _moved(self) -> bool:
        """``locate`` names another master than the one held (or none)."""
        try:
            where = self._locate()
        except Exception:
            return False  # (etcd unreachable: keep what is held)
        return where is None or where[2] != self._identity

    def _sleep(self, seconds: float) -> None:
        wake = self._wake_r
        assert wake is not None
        with contextlib.suppress(OSError, ValueError):
            select.select([wake], [], [], seconds)  # (the stop's wake-up ends it)
