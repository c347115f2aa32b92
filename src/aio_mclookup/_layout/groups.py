"""KV-cache group specs (what one vLLM KV-cache group is) and merged spec-groups."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from .._checks import positive_int

__all__ = [
    "KINDS",
    "ChunkedLocalAttention",
    "FullAttention",
    "GroupSpec",
    "Mamba",
    "SlidingWindow",
    "SpecGroup",
    "window_blocks",
]


def _check_sizes(spec: object) -> None:
    """Validate a group spec's sizes and store them as plain ints (numpy ints included)."""
    for f in dataclasses.fields(spec):  # type: ignore[arg-type]
        object.__setattr__(spec, f.name, positive_int(f.name, getattr(spec, f.name)))


@dataclass(frozen=True)
class FullAttention:
    """A full-attention KV-cache group (also MLA): every chunk is a candidate."""

    block_size: int
    kind: ClassVar[str] = "full_attention"

    def __post_init__(self) -> None:
        _check_sizes(self)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "block_size": self.block_size}


@dataclass(frozen=True)
class SlidingWindow:
    """A sliding-window group: only the window tails ending at scheduler-block boundaries
    can prove a hit, so only those chunks are probed."""

    block_size: int
    sliding_window: int
    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        _check_sizes(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "block_size": self.block_size,
            "sliding_window": self.sliding_window,
        }


@dataclass(frozen=True)
class ChunkedLocalAttention:
    """A chunked local attention group: blocks before the current attention chunk need no
    cache; blocks inside it must be present from its start."""

    block_size: int
    attention_chunk_size: int
    kind: ClassVar[str] = "chunked_local"

    def __post_init__(self) -> None:
        _check_sizes(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "block_size": self.block_size,
            "attention_chunk_size": self.attention_chunk_size,
        }


@dataclass(frozen=True)
class Mamba:
    """A mamba state group (vLLM's ``mamba_cache_mode="align"``): a hit needs the state at an
    aligned boundary."""

    block_size: int
    kind: ClassVar[str] = "mamba"

    def __post_init__(self) -> None:
        _check_sizes(self)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "block_size": self.block_size}


GroupSpec = FullAttention | SlidingWindow | ChunkedLocalAttention | Mamba

KINDS: dict[str, type[GroupSpec]] = {
    "full_attention": FullAttention,
    "sliding_window": SlidingWindow,
    "chunked_local": ChunkedLocalAttention,
    "mamba": Mamba,
}


@dataclass(frozen=True)
class SpecGroup:
    """Groups with identical specs, merged as vLLM merges them: a chunk counts as present only
    if it is present in every member group."""

    spec: GroupSpec
    group_ids: tuple[int, ...]
    drop_eagle: bool


def window_blocks(spec: SlidingWindow, eagle: bool) -> int:
    """Contiguous blocks a sliding-window hit needs: ceil((W - 1) / B), one more with EAGLE."""
    return -(-(spec.sliding_window - 1) // spec.block_size) + (1 if eagle else 0)
