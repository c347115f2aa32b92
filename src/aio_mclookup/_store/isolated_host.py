"""The child process of :class:`~.isolated.ChildClient`: ``python -m
aio_mclookup._store.isolated_host FD``, FD one end of a socket pair. It builds and sets up one
Mooncake client from the ``("open", env, config)`` it reads first, answers ``("ready",
rc)``, then answers each ``("exist", id, keys)`` from a few threads, until ``("close",)`` or
the end of the stream (its parent went away). It ends with ``os._exit``: an ``etcd://``
client's close would hold the GIL ~30 s for nothing (a lookup-only client holds no segment)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import socket
import sys
import threading
from typing import Any

from .isolated import read_frames, send_frame

_THREADS = 8
"""Calls answered at once (the parent's pool sends at most its own thread count)."""
_KEEP: list[Any] = []
"""The client, referenced until ``os._exit``: dropping the last reference would run its
destructor (~30 s, GIL held, for an ``etcd://`` client)."""


def _serve(sock: socket.socket) -> None:
    lock = threading.Lock()
    frames = read_frames(sock)
    opening = next(frames, None)
    if opening is None or opening[0] != "open":
        return
    _, env, config = opening
    for name, value in env.items():
        os.environ.setdefault(name, value)
    from mooncake.store import MooncakeDistributedStore

    client: Any = MooncakeDistributedStore()
    _KEEP.append(client)
    rc = int(client.setup(config))
    send_frame(sock, ("ready", rc), lock)
    if rc != 0:
        return
    pool = concurrent.futures.ThreadPoolExecutor(_THREADS, thread_name_prefix="mooncake-host")

    def answer(ident: int, keys: list[str | bytes]) -> None:
        try:
            codes = list(client.batch_is_exist(keys))
        except Exception:  # (the wheel's TypeError on bad keys): a failed call
            codes = [-1] * len(keys)
        with contextlib.suppress(OSError):
            send_frame(sock, ("answer", ident, codes), lock)

    for message in frames:
        if message[0] == "close":
            return
        if message[0] == "exist":
            pool.submit(answer, message[1], message[2])


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its parent closes it
    sock = socket.socket(fileno=int(argv[1]))
    try:
        with contextlib.suppress(OSError, EOFError):
            _serve(sock)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # never the client's destructor (see the module doc)


if __name__ == "__main__":
    main(sys.argv)
