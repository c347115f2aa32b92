"""How the scheduler's client reaches its lookup service: :class:`SidecarChannel`, a child
process of its own (what vLLM's scheduler uses: the coordinator's Python work then never
takes the scheduler's GIL), or :class:`ThreadChannel`, a thread of this process over a store
object of this process (the in-process fake store of the unit tests, say)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
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
MAX_OUTBOX = 256 << 20
"""Bytes of requests the sidecar has not read yet, past which it counts as gone."""

_SEND_WAIT = 0.02
"""Seconds :meth:`SidecarChannel.send` waits for the socket to take a request that does not
fit at once (a busy sidecar reads it later; the rest is written at the next exchange)."""

_KILL_WAIT = 2.0
"""Seconds to wait for a killed sidecar to be reaped."""


class SidecarChannel:
    """The service in a child process (``python -m aio_mclookup._scheduler.sidecar``) over a
    socket pair. ``opening`` tells it the layout, store and options; it opens its own
    Mooncake client, and :class:`StoreError` here says why it could not (or why the process
    could not be started).

    Nothing here blocks beyond the time it is given: requests are queued and written as the
    socket takes them (at each :meth:`send`, which waits at most :data:`_SEND_WAIT`, and at
    each :meth:`receive`); a sidecar that leaves :data:`MAX_OUTBOX` bytes unread counts as
    gone.

    The child ends when told (:meth:`close`) or when this process goes away (its end of the
    socket then reads end-of-file); it ignores SIGINT, so a Ctrl-C reaches the engine, whose
    shutdown closes it."""

    def __init__(self, opening: Open, start_timeout: float) -> None:
        self._gone: str | None = None
        self._outbox = bytearray()
        self._reader = FrameReader()
        self._pending: list[Reply] = []
        try:
            ours, theirs = socket.socketpair()
        except OSError as exc:
            raise StoreError(f"the lookup sidecar could not start: {exc!r}") from None
        # (-P: not the engine's working directory first on the child's path; Python 3.11+)
        isolate = ["-P"] if sys.version_info >= (3, 11) else []
        command = [sys.executable, *isolate, "-m", "aio_mclookup._scheduler.sidecar"]
        try:
            self._process = subprocess.Popen(
                [*command, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            ours.close()
            raise StoreError(f"the lookup sidecar could not start: {exc!r}") from None
        finally:
            theirs.close()
        self._socket = ours
        ours.setblocking(False)
        self._poll = select.poll()
        self._poll.register(ours, select.POLLIN)
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
            self._pending += self._exchange(left)
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
        self._outbox += encode(request)
        if len(self._outbox) > MAX_OUTBOX:
            self._lost(f"the lookup sidecar left {len(self._outbox)} bytes of requests unread")
        self._write()
        deadline = time.monotonic() + _SEND_WAIT
        while self._outbox and (left := deadline - time.monotonic()) > 0:
            self._wait(select.POLLOUT, left)
            self._write()

    def _write(self) -> None:
        """Write what the socket takes now of the queued requests."""
        while self._outbox:
            try:
                sent = self._socket.send(self._outbox)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._lost(f"the lookup sidecar is gone ({exc!r})")
            del self._outbox[:sent]

    def receive(self, timeout: float) -> list[Reply]:
        if self._pending:
            out, self._pending = self._pending, []
            return out + self._exchange(0.0)
        return self._exchange(timeout)

    def _exchange(self, timeout: float) -> list[Reply]:
        """Write what can be written, then what arrived (waiting up to ``timeout`` for
        something to read), as replies."""
        if self._gone is not None:
            raise ChannelClosed(self._gone)
        self._write()
        ready = self._wait(select.POLLIN | (select.POLLOUT if self._outbox else 0), timeout)
        if not ready & (select.POLLIN | select.POLLHUP | select.POLLERR):
            self._write()
            return []
        out: list[Reply] = []
        while self._gone is None:
            try:
                data = self._socket.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                break
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
        if self._gone is not None and not out:  # (what came before the end is still given)
            raise ChannelClosed(self._gone)
        if self._gone is None:
            self._write()
        return out

    def _wait(self, events: int, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for ``events`` on the socket; the events seen."""
        self._poll.modify(self._socket, events)
        return sum(mask for _, mask in self._poll.poll(max(timeout, 0.0) * 1000))

    def _lost(self, why: str) -> Any:
        self._gone = why
        raise ChannelClosed(why)

    def close(self, timeout: float) -> None:
        """Ask the sidecar to close, wait for it at most ``timeout`` seconds in all, then
        kill what is left."""
        deadline = time.monotonic() + timeout
        if self._gone is None:
            with contextlib.suppress(ChannelClosed):
                self.send(Close())
                closed = False
                while not closed and time.monotonic() < deadline:
                    left = min(0.05, max(0.0, deadline - time.monotonic()))
                    closed = any(isinstance(r, Closed) for r in self.receive(left))
            self._gone = "the lookup sidecar is closed"
        try:
            self._process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._kill()
        self._socket.close()

    def _kill(self) -> None:
        self._gone = self._gone or "the lookup sidecar was stopped"
        with contextlib.suppress(OSError):
            self._process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(_KILL_WAIT)
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
        options=dataclasses.asdict(options),
    )
