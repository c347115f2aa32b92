"""The master probes of :mod:`.pool` (a TCP connect; a malformed request a live master closes
the connection on) through anyio, for the async libraries other than asyncio (trio)."""

from __future__ import annotations

import anyio

__all__ = ["answers", "tcp_probe"]


async def tcp_probe(host: str, port: int, seconds: float) -> OSError | None:
    """Try one TCP connect; return the error or ``None`` on success."""
    try:
        with anyio.fail_after(seconds):
            stream = await anyio.connect_tcp(host, port)
    except TimeoutError:
        return TimeoutError(f"no answer from {host}:{port} within {seconds:g} s")
    except OSError as exc:
        return exc
    await stream.aclose()
    return None


async def answers(host: str, port: int, seconds: float, request: bytes) -> bool:
    """Send ``request``; a live master answers by closing the connection (or with an error
    frame, or a reset). False when nothing came back within ``seconds``."""
    try:
        with anyio.fail_after(seconds):
            stream = await anyio.connect_tcp(host, port)
    except (OSError, TimeoutError):
        return False
    try:
        with anyio.fail_after(seconds):
            await stream.send(request)
            await stream.receive(64)
    except TimeoutError:
        return False
    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
        return True  # closed (EOF) or reset: alive
    finally:
        await stream.aclose()
    return True
