"""A Mooncake client in a child process of its own (``python -m
aio_mclookup._store.isolated_host FD``), driven over a socket pair: :class:`ChildClient` has
the few methods of ``MooncakeDistributedStore`` that :class:`~.pool.ClientPool` calls.

Why: an ``etcd://`` client's ``setup()`` holds the GIL up to ~10 s (etcd down, a leader still
warming up) and its ``close()`` ~30 s (its destructor joins the leader watch), and so does
interpreter exit. In a child, that GIL is the child's: this process only waits on a socket
(the GIL released), and closing is the child's ``os._exit`` (nothing to flush: the client is
lookup-only, it holds no segment). A lookup costs one more local hop (a frame each way).

A frame is a 4-byte big-endian length, then a pickled tuple (both ends are this package).
Requests: ``("open", env, config)``, ``("exist", id, keys)``, ``("close",)``; replies:
``("ready", rc)``, ``("answer", id, codes)``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import pickle
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from .._errors import StoreError
from .codes import RPC_FAIL, RPC_TIMEOUT

__all__ = ["ChildClient", "read_frames", "send_frame"]

_HEAD = struct.Struct(">I")
_MAX_FRAME = 1 << 30
_EXIT_WAIT = 2.0
"""Seconds a closed child gets to exit before it is killed."""


def send_frame(sock: socket.socket, message: tuple[Any, ...], lock: threading.Lock) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        sock.sendall(_HEAD.pack(len(data)) + data)


def read_frames(sock: socket.socket) -> Iterator[tuple[Any, ...]]:
    """The messages arriving on ``sock`` (blocking), until end of file."""
    buffer = bytearray()
    while True:
        while len(buffer) >= _HEAD.size:
            (size,) = _HEAD.unpack_from(buffer)
            if size > _MAX_FRAME:
                raise OSError(f"a frame of {size} bytes")
            if len(buffer) < _HEAD.size + size:
                break
            message = pickle.loads(buffer[_HEAD.size : _HEAD.size + size])
            del buffer[: _HEAD.size + size]
            yield message
        data = sock.recv(1 << 20)
        if not data:
            return
        buffer += data


class ChildClient:
    """``setup(config)``, ``batch_is_exist(keys)``, ``health_check()``, ``close()`` of a
    Mooncake client that runs in a child process, built there with ``env`` (the ``MC_*``
    settings) added to this process's environment.

    Each call blocks its calling thread (the pool's) on the socket, the GIL released; calls
    from several threads run concurrently in the child. A call waits at most ``call_timeout``
    seconds, then answers RPC_TIMEOUT for every key; a child that is gone answers RPC_FAIL.
    """

    def __init__(self, env: Mapping[str, str], *, setup_timeout: float, call_timeout: float
                 ) -> None:
        self._env = dict(env)
        self._setup_timeout = setup_timeout
        self._call_timeout = call_timeout
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._waiting: dict[int | str, concurrent.futures.Future[Any]] = {}
        self._ids = itertools.count()
        self._process: subprocess.Popen[bytes] | None = None
        self._socket: socket.socket | None = None
        self._gone = False

    @property
    def pid(self) -> int | None:
        """The child's PID while it runs."""
        proc = self._process
        return proc.pid if proc is not None and proc.poll() is None else None

    def setup(self, config: Mapping[str, Any]) -> int:
        """Start the child and set its client up; ``setup()``'s return code.
        :class:`StoreError` when the child cannot start or does not answer within
        ``setup_timeout`` (it is killed then)."""
        ours, theirs = socket.socketpair()
        isolate = ["-P"] if sys.version_info >= (3, 11) else []  # (not the caller's cwd first)
        try:
            self._process = subprocess.Popen(
                [sys.executable, *isolate, "-m", "aio_mclookup._store.isolated_host",
                 str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # (no terminal signals: its parent closes it)
            )
        except OSError as exc:
            ours.close()
            raise StoreError(f"the Mooncake client process could not start: {exc!r}") from None
        finally:
            theirs.close()
        self._socket = ours
        ready = self._expect("ready")
        threading.Thread(target=self._read, name="mooncake-child-reader", daemon=True).start()
        try:
            send_frame(ours, ("open", self._env, dict(config)), self._send_lock)
            rc = ready.result(self._setup_timeout)
        except concurrent.futures.TimeoutError:
            self.close()
            raise StoreError(
                f"the Mooncake client process did not set up within {self._setup_timeout:g} s",
                code=RPC_TIMEOUT,
            ) from None
        except (OSError, StoreError) as exc:
            self.close()
            raise StoreError(f"the Mooncake client process failed: {exc}", code=RPC_FAIL) from None
        return int(rc)

    def batch_is_exist(self, keys: list[str | bytes]) -> list[int]:
        if self._gone or self._socket is None:
            return [RPC_FAIL] * len(keys)
        ident = next(self._ids)
        answer = self._expect(ident)
        try:
            send_frame(self._socket, ("exist", ident, keys), self._send_lock)
            codes: list[int] = answer.result(self._call_timeout)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._waiting.pop(ident, None)
            return [RPC_TIMEOUT] * len(keys)
        except (OSError, StoreError):
            return [RPC_FAIL] * len(keys)
        return codes

    def health_check(self) -> int:
        """0 while the child runs, 1 once it is gone (the child's own client flag is not
        asked: a call would block)."""
        return 1 if self._gone or self.pid is None else 0

    def close(self) -> int:
        """End the child at once (``os._exit`` there: no 30 s destructor); 0."""
        sock, proc = self._socket, self._process
        if sock is not None:
            with contextlib.suppress(OSError):
                send_frame(sock, ("close",), self._send_lock)
        if proc is not None:
            try:
                proc.wait(_EXIT_WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(_EXIT_WAIT)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        self._end()
        return 0

    # ---- internals -------------------------------------------------------------------------

    def _expect(self, ident: int | str) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._gone:
                future.set_exception(StoreError("the Mooncake client process is gone"))
            else:
                self._waiting[ident] = future
        return future

    def _read(self) -> None:
        """The reader thread: replies to their callers, until the child is gone."""
        assert self._socket is not None
        with contextlib.suppress(OSError, EOFError, pickle.UnpicklingError):
            for message in read_frames(self._socket):
                key = "ready" if message[0] == "ready" else message[1]
                with self._lock:
                    future = self._waiting.pop(key, None)
                if future is not None:
                    future.set_result(message[-1])
        self._end()

    def _end(self) -> None:
        with self._lock:
            self._gone = True
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(StoreError("the Mooncake client process is gone"))

