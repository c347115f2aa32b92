"""The scheduler's sidecar process: ``python -m aio_mclookup._scheduler.sidecar FD``, FD one
end of a socket pair. It reads :class:`~.messages.Open`, opens its own lookup-only Mooncake
client, answers :class:`~.messages.Ready` (or :class:`~.messages.Failed`), then serves
requests with a :class:`~.service.LookupService` until :class:`~.messages.Close` or the end
of the stream (the scheduler's process went away)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys

from .._coordinator.options import CoordinatorOptions
from .._layout.layout import KVLayout
from .._store.mooncake import MooncakeStore
from .loop import new_event_loop
from .messages import Close, Closed, Failed, FrameReader, Open, Ready, Reply, encode
from .service import LookupService


async def _serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    frames = FrameReader()
    arrived: list[object] = []

    async def next_request() -> object | None:
        """The next request; None at the end of the stream (the scheduler's process is
        gone). A bad frame raises (FrameError): the sidecar ends, and the scheduler sees it
        go."""
        while not arrived:
            data = await reader.read(1 << 20)
            if not data:
                return None
            arrived.extend(frames.feed(data))
        return arrived.pop(0)

    def emit(reply: Reply) -> None:
        writer.write(encode(reply))

    opening = await next_request()
    if not isinstance(opening, Open):
        return
    store = MooncakeStore(
        opening.master_address,
        opening.metadata_server,
        local_hostname=opening.local_hostname,
        tenant_id=opening.tenant_id,
    )
    try:
        await store.open()
    except Exception as exc:  # the store's Error, or a bad setting
        emit(Failed(repr(exc)))
        await writer.drain()
        return
    service = LookupService(
        KVLayout.from_dict(opening.layout),
        store,
        CoordinatorOptions(**opening.options),
        emit,
    )
    told_to_close = False
    try:
        await service.start()
        emit(Ready())
        while (request := await next_request()) is not None:
            if isinstance(request, Close):
                told_to_close = True
                break
            service.handle(request)  # type: ignore[arg-type]
            await writer.drain()
    finally:
        try:
            await service.aclose()
            await store.aclose()
        finally:
            if told_to_close:
                emit(Closed())
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.close()


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's shutdown closes us
    loop = new_event_loop()
    try:
        loop.run_until_complete(_serve(int(argv[1])))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
