"""The master watch (``aio_mclookup._store.watch``) against plain listening sockets on
loopback, which play a master's RPC port: a lost connection is one new epoch, and a master
that dies closes its connections a moment before its listening socket, a moment in which a
reconnect reaches the dying process; that must not count as a second loss of the same master.
(``test_store_epochs.py`` runs the watch against a real ``mooncake_master``.)"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from aio_mclookup._store.watch import MasterWatch

LOOPBACK = "127.0.0.1"


def _listener(port: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(16)
    return sock


def _until(condition: Callable[[], bool], within: float = 2.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "the watch did not get there in time"
        time.sleep(0.002)


def test_a_lost_connection_is_one_epoch_and_the_master_back_is_reachable() -> None:
    listener = _listener()
    port = listener.getsockname()[1]
    watch = MasterWatch.of_address(LOOPBACK, port)
    watch.start()
    try:
        held, _ = listener.accept()
        _until(lambda: watch.reachable is True)
        assert watch.epoch == 0
        held.close()  # the master's end of the connection: gone
        listener.close()
        _until(lambda: watch.epoch == 1)
        _until(lambda: watch.reachable is False)
        listener = _listener(port)  # back on the same port
        again, _ = listener.accept()
        _until(lambda: watch.reachable is True)
        assert watch.epoch == 1
        again.close()
    finally:
        watch.stop()
        listener.close()
    assert not watch._thread.is_alive()


def test_a_reconnect_that_reaches_the_dying_master_is_not_a_second_epoch() -> None:
    listener = _listener()
    port = listener.getsockname()[1]
    # (a retry far longer than the dying window below: a loaded machine cannot stretch the
    # window past it)
    watch = MasterWatch(lambda: (LOOPBACK, port, None), retry=0.2)
    watch.start()
    dying_accepts: list[float] = []
    try:
        held, _ = listener.accept()
        _until(lambda: watch.reachable is True)

        def die() -> None:
            """Close the held connection first, then for 10 ms accept and drop whatever
            connects (the dying process's listener), then close the listener."""
            listener.settimeout(0.001)
            held.close()
            end = time.monotonic() + 0.010
            while time.monotonic() < end:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                dying_accepts.append(time.monotonic())
                conn.close()
            listener.close()

        dying = threading.Thread(target=die)
        dying.start()
        dying.join()
        _until(lambda: watch.reachable is False)
        new = _listener(port)
        try:
            conn, _ = new.accept()
            _until(lambda: watch.reachable is True)
            assert watch.epoch == 1, (watch.epoch, dying_accepts)
            assert not dying_accepts  # (it waited before reconnecting: nothing reached it)
            conn.close()
        finally:
            new.close()
    finally:
        watch.stop()
