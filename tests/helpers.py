"""Small helpers shared by the test modules."""

from __future__ import annotations

import asyncio
import hashlib


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
