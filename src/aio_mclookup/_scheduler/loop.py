"""An event loop on a thread of its own, for callers that are not async (vLLM's scheduler)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread", "new_event_loop", "run_once"]

_T = TypeVar("_T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where installed, else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; asyncio still works
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """A daemon thread running one event loop (uvloop when installed) until :meth:`stop`.

    :meth:`submit` runs a coroutine on it from any other thread and returns a
    :class:`concurrent.futures.Future`; cancelling that future cancels the coroutine.
    """

    def __init__(self, name: str) -> None:
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Schedule ``coro`` on the loop (thread-safe)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call_soon(self, callback: Callable[..., object], *args: object) -> None:
        """Run ``callback(*args)`` on the loop (thread-safe)."""
        self._loop.call_soon_threadsafe(callback, *args)

    def stop(self, timeout: float) -> bool:
        """Stop the loop and join its thread; False if it did not end within ``timeout``
        seconds (it is a daemon thread, so it never holds the process up)."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        return not self._thread.is_alive()


def run_once(make: Callable[[], Coroutine[Any, Any, _T]], timeout: float) -> _T:
    """``make()``'s coroutine run to its end on a fresh event loop in a thread of its own
    (so that it works from a thread whose own loop is running, too); at most ``timeout``
    seconds (:class:`TimeoutError` after, the thread left to finish)."""
    done: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def run() -> None:
        loop = new_event_loop()
        try:
            done.set_result(loop.run_until_complete(make()))
        except BaseException as exc:
            done.set_exception(exc)
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="aio-mclookup-once", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"did not finish within {timeout} s")
    return done.result()
