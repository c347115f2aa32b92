"""A key owner in a process of its own, for the HA tests: ``python ha_writer.py MASTER
METADATA``. It opens a :class:`StoreWriter` (an ``etcd://`` master address follows the
leader), answers ``ready``, then reads lines of JSON key lists from stdin and answers ``ok N``
for each (``error ...`` on failure). At the end of stdin it ends with ``os._exit``: closing an
``etcd://`` client holds the GIL ~30 s for nothing."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from aio_mclookup import StoreWriter

_KEEP: list[StoreWriter] = []  # referenced until os._exit: no destructor runs



async def main(master: str, metadata: str) -> None:
    writer = StoreWriter(master, metadata)
    _KEEP.append(writer)
    await writer.open()
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        try:
            count = await writer.put_keys(json.loads(line))
            print(f"ok {count}", flush=True)
        except Exception as exc:
            print(f"error {exc!r}", flush=True)


if __name__ == "__main__":
    try:
        asyncio.run(main(sys.argv[1], sys.argv[2]))
    finally:
        sys.stdout.flush()
        os._exit(0)
