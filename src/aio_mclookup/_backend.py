"""Which async library runs the caller, and the little the store needs from it: a thread-safe
call onto its loop, awaiting a thread pool's future, a sleep.

asyncio (uvloop included) is the fast path: its own calls, nothing of anyio imported. Any other
library anyio runs on (trio) goes through anyio, imported on first use, and trio's token for
calls from other threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["call_soon_threadsafe", "on_asyncio", "sleep", "wait_future"]

_T = TypeVar("_T")


def on_asyncio() -> bool:
    """The running async library is asyncio (or no library can be told: asyncio's own calls
    then raise their own error); False under trio. Without trio imported it is asyncio (the
    only other library anyio runs on), told in a dictionary look-up; else sniffio tells."""
    if "trio" not in sys.modules:
        return True
    try:
        import sniffio
    except ImportError:  # (trio brings sniffio)
        return True
    try:
        return bool(sniffio.current_async_library() == "asyncio")
    except sniffio.AsyncLibraryNotFoundError:
        return True


def call_soon_threadsafe() -> Callable[..., Any]:
    """A function that any thread may call, ``call(fn, *args)``, to run ``fn(*args)`` soon on
    the running loop's thread: asyncio's ``call_soon_threadsafe`` or trio's token. It raises
    :class:`RuntimeError` once that loop is gone."""
    if on_asyncio():
        return asyncio.get_running_loop().call_soon_threadsafe
    import trio

    return trio.lowlevel.current_trio_token().run_sync_soon


async def wait_future(future: concurrent.futures.Future[_T], *, shield: bool = False) -> _T:
    """The result of a thread pool's ``future``, awaited on the running library; ``shield``:
    a cancelled caller still waits for it. Cancelled while it waits, the future is cancelled
    too (a call still queued then never runs)."""
    if on_asyncio():
        wrapped = asyncio.wrap_future(future)
        return await (asyncio.shield(wrapped) if shield else wrapped)
    import anyio

    done = anyio.Event()
    call = call_soon_threadsafe()

    def wake(_future: concurrent.futures.Future[_T]) -> None:  # (the pool's thread)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
            call(done.set)

    future.add_done_callback(wake)
    try:
        with anyio.CancelScope(shield=shield):
            await done.wait()
    except BaseException:
        future.cancel()
        raise
    return future.result()


async def sleep(seconds: float) -> None:
    """Sleep on the running library."""
    if on_asyncio():
        await asyncio.sleep(seconds)
        return
    import anyio

    await anyio.sleep(seconds)
