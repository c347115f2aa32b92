"""Small helpers shared by the test modules."""

from __future__ import annotations

import hashlib


def chain(count: int, seed: bytes) -> list[bytes]:
    """Chained 32-byte block hashes, like vLLM's: each one identifies its whole prefix."""
    out, parent = [], hashlib.sha256(seed).digest()
    for i in range(count):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        out.append(parent)
    return out
