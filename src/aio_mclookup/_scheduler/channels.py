"""How the scheduler's client reaches its lookup service: :class:`SidecarChannel`, a child
process of its own (what vLLM's scheduler uses: the coordinator's Python work then never
takes the scheduler's GIL), or :class:`ThreadChannel`, a thread of this process over a store
object of this process (the in-process fake store of the unit tests, say)."""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from .._coordinator.options import CoordinatorOptions
from .._errors import StoreError
from .._layout.layout import KVLayout
from .._store.protocol import Store
from .loop import LoopThread
from .messages import (
    Close,
    Closed,
    Failed,
    FrameError,
    FrameReader,
    Open,
    Ready,
    Reply,
    Request,
    encode,
)
from .service import LookupService

__all__ = ["Channel", "ChannelClosed", "SidecarChannel", "ThreadChannel"]


class ChannelClosed(Exception):
    """The service is gone (its process ended, or the channel was closed)."""


class Channel(Protocol):
    """A lookup service's two directions: requests in order, replies in order."""

    def send(self, request: Request) -> None:
        """Hand over one request; :class:`ChannelClosed` if the service is gone."""

    def receive(self, timeout: float) -> list[Reply]:
        """The replies there are now; if none, wait for the first up to ``timeout`` seconds
        (the GIL released). :class:`ChannelClosed` if the service is gone."""

    def close(self, timeout: float) -> None:
        """End the service (at most ``timeout`` seconds) and free what it held."""


# ---------------------------------------------------------------------- in-process
class ThreadChannel:
    """The service on an event-loop thread of this process, over ``store``: awaited
    ``open_store()`` gives it, ``close_store(store)`` is awaited at :meth:`close`."""

    def __init__(
        self,
        layout: KVLayout,
        open_store: Callable[[], Coroutine[Any, Any, Store]],
        close_store: Callable[[Store], Coroutine[Any, Any, None]],
        options: CoordinatorOptions,
        start_timeout: float,
    ) -> None:
        self._replies: collections.deque[Reply] = collections.deque()
        self._arrived = threading.Event()
        self._loop = LoopThread("aio-mclookup-vllm")
        self._close_store = close_store
        self._closed = False
        try:
            self._store = self._loop.submit(open_store()).result(start_timeout)
            service = LookupService(layout, self._store, options, self._deliver)
            self._loop.submit(service.start()).result(start_timeout)
        except BaseException:
            self._loop.stop(start_timeout)
            raise
        self._service = service

    def _deliver(self, reply: Reply) -> None:  # (on the loop)
        self._replies.append(reply)
        self._arrived.set()

    def send(self, request: Request) -> None:
        if self._closed:
            raise ChannelClosed("the lookup service is closed")
        self._loop.call_soon(self._service.handle, request)

    def receive(self, timeout: float) -> list[Reply]:
        if self._closed:
            raise ChannelClosed("the lookup service is closed")
        if not self._replies and timeout > 0:
            self._arrived.wait(timeout)
        self._arrived.clear()
        out = []
        while self._replies:
            out.append(self._replies.popleft())
        return out

    def close(self, timeout: float) -> None:
        if self._closed:
            return
        self._closed = True

        async def shutdown() -> None:
            try:
                await self._service.aclose()
            finally:
                await self._close_store(self._store)

        try:
            self._loop.submit(shutdown()).result(timeout)
        finally:
            self._loop.stop(timeout)


# ---------------------------------------------------------------------- a child process
_SEND_TIMEOUT = 10.0
"""Seconds a request may take to be handed to the sidecar before it counts as gone."""


class SidecarChannel:
    """The service in a child process (``python -m aio_mclookup._scheduler.sidecar``) over a
    socket pair. ``opening`` tells it the layout, store and options; it opens its own
    Mooncake client, and :class:`StoreError` here says why it could not.

    The child ends when told (:meth:`close`) or when this process goes away (its end of the
    socket then reads end-of-file); it ignores SIGINT, so a Ctrl-C reaches the engine, whose
    shutdown closes it."""

    def __init__(self, opening: Open, start_timeout: float) -> None:
        ours, theirs = socket.socketpair()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "aio_mclookup._scheduler.sidecar", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self._socket = ours
        self._reader = FrameReader()
        self._pending: list[Reply] = []
        self._gone: str | None = None
        try:
            self.send(opening)
            first = self._first_reply(start_timeout)
        except ChannelClosed as exc:
            self._kill()
            raise StoreError(f"the lookup sidecar could not start: {exc}") from None
        except BaseException:
            self._kill()
            raise
        if isinstance(first, Failed):
            self._kill()
            raise StoreError(f"the lookup sidecar could not start: {first.message}")

    def _first_reply(self, timeout: float) -> Reply:
        deadline = time.monotonic() + timeout
        while not self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreError(f"the lookup sidecar did not start within {timeout} s")
            self._pending += self._read(left)
        first = self._pending.pop(0)
        if not isinstance(first, (Ready, Failed)):
            raise StoreError(f"the lookup sidecar answered {type(first).__name__} at start")
        return first

    @property
    def pid(self) -> int:
        return self._process.pid

    def send(self, request: Request) -> None:
        if self._gone is not None:
            raise ChannelClosed(self._gone)
        data = encode(request)
        try:
            self._socket.settimeout(_SEND_TIMEOUT)
            self._socket.sendall(data)
        except OSError as exc:
            self._lost(f"the lookup sidecar is gone ({exc!r})")

    def receive(self, timeout: float) -> list[Reply]:
        if self._pending:
            out, self._pending = self._pending, []
            return out + self._read(0.0)
        return self._read(timeout)

    def _read(self, timeout: float) -> list[Reply]:
        """What arrived (waiting up to ``timeout`` for something), as replies."""
        if self._gone is not None:
            raise ChannelClosed(self._gone)
        sock = self._socket
        readable, _, _ = select.select([sock], [], [], max(timeout, 0.0))
        if not readable:
            return []
        sock.setblocking(False)
        out: list[Reply] = []
        try:
            while self._gone is None:
                try:
                    data = sock.recv(1 << 20)
                except (BlockingIOError, InterruptedError):
                    return out
                except OSError as exc:
                    self._gone = f"the lookup sidecar is gone ({exc!r})"
                    break
                if not data:
                    self._gone = "the lookup sidecar ended"
                    break
                try:
                    out += self._reader.feed(data)
                except FrameError as exc:
                    self._gone = f"the lookup sidecar sent a bad frame: {exc}"
        finally:
            sock.setblocking(True)
        if not out:  # (what came before the end is still given)
            raise ChannelClosed(self._gone)
        return out

    def _lost(self, why: str) -> Any:
        self._gone = why
        raise ChannelClosed(why)

    def close(self, timeout: float) -> None:
        if self._gone is None:
            deadline = time.monotonic() + timeout
            with contextlib.suppress(ChannelClosed):
                self.send(Close())
                closed = False
                while not closed and time.monotonic() < deadline:
                    closed = any(isinstance(r, Closed) for r in self.receive(0.05))
            self._gone = "the lookup sidecar is closed"
        try:
            self._process.wait(max(0.0, timeout))
        except subprocess.TimeoutExpired:
            self._kill()
        self._socket.close()

    def _kill(self) -> None:
        self._gone = self._gone or "the lookup sidecar was stopped"
        with contextlib.suppress(OSError):
            self._process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(5.0)
        self._socket.close()


def opening(
    layout: KVLayout,
    options: CoordinatorOptions,
    *,
    master_address: str,
    metadata_server: str,
    local_hostname: str,
    tenant_id: str,
) -> Open:
    """The :class:`Open` message of a sidecar."""
    return Open(
        layout=layout.to_dict(),
        master_address=master_address,
        metadata_server=metadata_server,
        local_hostname=local_hostname,
        tenant_id=tenant_id,
        options={f: getattr(options, f) for f in CoordinatorOptions.__dataclass_fields__},
    )
