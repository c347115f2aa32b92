"""Small helpers shared by the test modules."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


def chain(count: int, seed: bytes) -> list[bytes]:
    """Chained 32-byte block hashes, like vLLM's: each one identifies its whole prefix."""
    out, parent = [], hashlib.sha256(seed).digest()
    for i in range(count):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        out.append(parent)
    return out


async def stop_process(proc: asyncio.subprocess.Process, grace: float = 30.0) -> None:
    """Terminate ``proc`` (if it still runs) and wait for it; killed, and the test failed,
    when it takes longer than ``grace`` seconds."""
    if proc.returncode is None:
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), grace)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise


async def gather(
    *calls: Callable[[], Awaitable[_T]], return_exceptions: bool = False
) -> list[Any]:
    """``asyncio.gather`` for any anyio backend: run each call in a task of one task group;
    their results in order (the first error cancels the rest and is raised; with
    ``return_exceptions``, each call's :class:`Exception` is its result instead)."""
    import anyio

    results: list[Any] = [None] * len(calls)

    async def run(i: int, call: Callable[[], Awaitable[_T]]) -> None:
        if not return_exceptions:
            results[i] = await call()
            return
        try:
            results[i] = await call()
        except Exception as exc:
            results[i] = exc

    async with anyio.create_task_group() as group:
        for i, call in enumerate(calls):
            group.start_soon(run, i, call)
    return results
