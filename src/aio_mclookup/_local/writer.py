"""Writing keys as vLLM's workers do (tests and the load generator): :class:`StoreWriter`."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable
from typing import Any

from .._errors import InvalidRequest, StoreError
from .._public import present_as_public
from .._store.codes import OBJECT_ALREADY_EXISTS, OBJECT_NOT_FOUND, raise_bad_codes
from .._store.pool import LOOPBACK, ClientPool

__all__ = ["StoreWriter"]

_CHUNK = 1000
"""Keys per writer RPC: larger requests stall now and then on loopback (docs/mooncake.md)."""


class StoreWriter(ClientPool):
    """Stores keys the way vLLM's workers do, with a 1-byte value each (tests, load generator).

    It mounts a ``segment_size`` segment of its own memory: the keys it puts live in that segment
    and therefore only while the writer lives. After :meth:`aclose` the master drops them within
    ~1.5 s; if the process dies, after the master's ``--client_ttl`` (default 10 s).

    After a master restart all keys are gone. The writer needs no re-open: its client re-mounts
    its segment by itself about a second later. Until then puts fail with ``StoreError`` code
    -900 (first call on the dropped connection) or -200 (no segment mounted yet): retry, then
    :meth:`put_keys` stores the keys again.

    It shares :class:`MooncakeStore`'s thread and lifecycle safety and ``MC_*`` defaults.
    """

    _role = "writer"

    def __init__(
        self,
        master_address: str,
        metadata_server: str,
        *,
        segment_size: int = 64 << 20,
        local_buffer_size: int = 16 << 20,
        threads: int = 1,
        rpc_timeout: float = 2.0,
        setup_timeout: float = 10.0,
        local_hostname: str = LOOPBACK,
    ) -> None:
        if segment_size <= 0 or local_buffer_size <= 0:
            raise InvalidRequest(
                "segment_size and local_buffer_size must be > 0", field="segment_size"
            )
        super().__init__(
            master_address,
            metadata_server,
            threads=threads,
            rpc_timeout=rpc_timeout,
            setup_timeout=setup_timeout,
            local_hostname=local_hostname,
            global_segment_size=segment_size,
            local_buffer_size=local_buffer_size,
        )
        self.segment_size = segment_size
        self.local_buffer_size = local_buffer_size
        # The 1-byte source every key's value is copied from; registered after setup. It stays
        # alive as long as the writer (the client may reference it until close).
        self._value = ctypes.create_string_buffer(b"x", 1)
        self._value_ptr = ctypes.addressof(self._value)

    def __repr__(self) -> str:
        return (
            f"StoreWriter({self.master_address!r}, {self.metadata_server!r}, "
            f"segment_size={self.segment_size}, state={self._state})"
        )

    def _after_setup(self, client: Any) -> None:
        rc = client.register_buffer(self._value_ptr, 1)
        if rc != 0:
            raise StoreError(f"Mooncake register_buffer() returned {rc}", code=int(rc))

    async def put_keys(self, keys: Iterable[str]) -> int:
        """Store each distinct key with the value ``b"x"``; return how many distinct keys were
        given and are now stored.

        Keys are deduplicated (order kept) and written in chunks of 1000 with ``batch_put_from``
        from one registered 1-byte buffer. A key that is already present is fine (Mooncake
        answers 0 or ``OBJECT_ALREADY_EXISTS`` and keeps the first object). Any other per-key code
        raises :class:`StoreError` with that code (e.g. -200: segment full), as does a failed RPC.
        """
        client = self._client_or_closed()
        unique = list(dict.fromkeys(keys))
        ptr = self._value_ptr
        stored = 0
        for start in range(0, len(unique), _CHUNK):
            chunk = unique[start : start + _CHUNK]
            n = len(chunk)
            codes: list[int] = await self._call(
                functools.partial(client.batch_put_from, chunk, [ptr] * n, [1] * n)
            )
            raise_bad_codes("batch_put_from", chunk, codes, (0, OBJECT_ALREADY_EXISTS))
            stored += n
        return stored

    async def remove_keys(self, keys: Iterable[str], force: bool = True) -> int:
        """Remove keys; return how many were removed (absent keys are skipped).

        ``force=True`` ignores read leases, which every lookup that finds a key grants for
        ``--default_kv_lease_ttl`` (10 s by default); without it such keys fail with -706.
        """
        client = self._client_or_closed()
        unique = list(dict.fromkeys(keys))
        removed = 0
        for start in range(0, len(unique), _CHUNK):
            chunk = unique[start : start + _CHUNK]
            codes: list[int] = await self._call(
                functools.partial(client.batch_remove, chunk, force)
            )
            raise_bad_codes("batch_remove", chunk, codes, (0, OBJECT_NOT_FOUND))
            removed += sum(1 for c in codes if c == 0)
        return removed


present_as_public(StoreWriter)
