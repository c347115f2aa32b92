"""A lookup's outcome as vLLM returns it: the hit and (vLLM 0.30+) the tail-key boundaries."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["LookupResult", "TailKeyBoundary"]


class TailKeyBoundary(NamedTuple):
    """Store group ``group_id``'s last (possibly partial) chunk of the hit is keyed at the hash
    boundary ``num_tokens`` (its key uses ``block_hashes[num_tokens / hash_block_size - 1]``);
    it exceeds the hit only in fine-grained mode."""

    group_id: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class LookupResult:
    """vLLM's ``MooncakeLookupResult``: ``hit_length`` tokens are cached, and per store group
    (in group order, empty for a hit of 0) where the loader finds its last chunk's key.

    vLLM 0.26 has no boundaries: its results carry none, and :meth:`to_bytes` is then its
    4-byte reply.
    """

    hit_length: int
    tail_key_boundaries: tuple[TailKeyBoundary, ...] = ()

    def to_bytes(self) -> bytes:
        """The lookup reply on the wire: ``hit_length`` as u32 big-endian, then 8 bytes per
        boundary (``group_id`` u32 BE, ``num_tokens`` u32 BE)."""
        count = len(self.tail_key_boundaries)
        flat = [v for b in self.tail_key_boundaries for v in b]
        return struct.pack(f">{1 + 2 * count}I", self.hit_length, *flat)
