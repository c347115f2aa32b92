"""KV-cache group specs (what one vLLM KV-cache group is) and merged spec-groups."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .._checks import integer, positive_int
from .._errors import InvalidRequest

__all__ = [
    "KINDS",
    "ChunkedLocalAttention",
    "CircularBuffer",
    "FullAttention",
    "GroupSpec",
    "Mamba",
    "SlidingWindow",
    "SpecGroup",
    "non_default_fields",
    "window_blocks",
]


_FLAGS = ("mla", "eagle", "prefix_cacheable")
"""Boolean group fields (vLLM 0.32+); every other field is a size (``extra_retained_tokens``
may be 0)."""
_DEFAULTS: dict[str, object] = {
    "mla": False,
    "extra_retained_tokens": 0,
    "eagle": False,
    "prefix_cacheable": True,
}
"""The value of each vLLM 0.32+ group field that reproduces vLLM 0.26 (omitted by to_dict)."""


def _check_sizes(spec: object) -> None:
    """Validate a group spec's fields and store sizes as plain ints (numpy ints included)."""
    for f in dataclasses.fields(spec):  # type: ignore[arg-type]
        value = getattr(spec, f.name)
        if f.name in _FLAGS:
            if not isinstance(value, (bool, np.bool_)):
                raise InvalidRequest(f"{f.name} must be a bool, got {value!r}", field=f.name)
            object.__setattr__(spec, f.name, bool(value))
        elif f.name == "extra_retained_tokens":
            n = integer(f.name, value)
            if n < 0:
                raise InvalidRequest(f"{f.name} must be >= 0, got {value!r}", field=f.name)
            object.__setattr__(spec, f.name, n)
        else:
            object.__setattr__(spec, f.name, positive_int(f.name, value))


def _spec_dict(spec: Any) -> dict[str, Any]:
    """``{"kind": ..., <fields>}``, leaving out the vLLM 0.32+ fields at their defaults."""
    out: dict[str, Any] = {"kind": spec.kind}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if f.name in _DEFAULTS and value == _DEFAULTS[f.name]:
            continue
        out[f.name] = value
    return out


def non_default_fields(spec: GroupSpec) -> list[str]:
    """The vLLM 0.32+ fields of a spec that are not at their 0.26-equivalent default."""
    return [
        f.name
        for f in dataclasses.fields(spec)
        if f.name in _DEFAULTS and getattr(spec, f.name) != _DEFAULTS[f.name]
    ]


@dataclass(frozen=True)
class FullAttention:
    """A full-attention KV-cache group (also MLA): every chunk is a candidate.

    vLLM 0.32+ fields: ``mla`` (the group's layers are MLA: its KV is replicated on every TP
    rank), ``eagle`` (the group holds draft layers, vLLM's ``is_eagle_group``) and
    ``prefix_cacheable`` (False: outside vLLM's ``prefix_cacheable_groups``, ignored)."""

    block_size: int
    mla: bool = False
    eagle: bool = False
    prefix_cacheable: bool = True
    kind: ClassVar[str] = "full_attention"

    def __post_init__(self) -> None:
        _check_sizes(self)

    def to_dict(self) -> dict[str, Any]:
        return _spec_dict(self)


@dataclass(frozen=True)
class SlidingWindow:
    """A sliding-window group: only the window tails ending at scheduler-block boundaries
    can prove a hit, so only those chunks are probed."""

    block_size: int
    sliding_window: int
    mla: bool = False
    extra_retained_tokens: int = 0
    """vLLM 0.33 widens the window by this much for the lookup (multi-module MTP)."""
    eagle: bool = False
    prefix_cacheable: bool = True
    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        _check_sizes(self)

    def to_dict(self) -> dict[str, Any]:
        return _spec_dict(self)


@dataclass(frozen=True)
class ChunkedLocalAttention:
    """A chunked local attention group: blocks before the current attention chunk need no
    cache; blocks inside it must be present from its start."""

    block_size: int
    attention_chunk_size: int
    eagle: bool = False
    prefix_cacheable: bool = True
    kind: ClassVar[str] = "chunked_local"

    def __post_init__(self) -> None:
        _check_sizes(self)

    def to_dict(self) -> dict[str, Any]:
        return _spec_dict(self)


@dataclass(frozen=True)
class Mamba:
    """A mamba state group (vLLM's ``mamba_cache_mode="align"``): a hit needs the state at an
    aligned boundary."""

    block_size: int
    eagle: bool = False
    prefix_cacheable: bool = True
    kind: ClassVar[str] = "mamba"

    def __post_init__(self) -> None:
        _check_sizes(self)

    def to_dict(self) -> dict[str, Any]:
        return _spec_dict(self)


@dataclass(frozen=True)
class CircularBuffer:
    """A circular-buffer ring group (vLLM 0.32+ ``CircularBufferSpec``): never prefix-cacheable,
    so the lookup ignores it, except that later groups' ids drop by one."""

    block_size: int
    eagle: bool = False
    prefix_cacheable: bool = False
    kind: ClassVar[str] = "circular_buffer"

    def __post_init__(self) -> None:
        _check_sizes(self)
        if self.prefix_cacheable:
            raise InvalidRequest(
                "a circular_buffer group is never prefix-cacheable (prefix_cacheable: false)",
                field="prefix_cacheable",
            )

    def to_dict(self) -> dict[str, Any]:
        return _spec_dict(self)


GroupSpec = FullAttention | SlidingWindow | ChunkedLocalAttention | Mamba | CircularBuffer

KINDS: dict[str, type[GroupSpec]] = {
    "full_attention": FullAttention,
    "sliding_window": SlidingWindow,
    "chunked_local": ChunkedLocalAttention,
    "mamba": Mamba,
    "circular_buffer": CircularBuffer,
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
