"""The extra-keys slot of each block's chain tuple, per vLLM era.

Order within a block: LoRA, multimodal items (position order), cache salt (block 0 only),
prompt-embeds digest. 0.26-0.30 use bare values (``name``, ``(identifier, rel_offset)``,
``salt``, ``digest``); 0.31+ tag each with its source (``("lora", name, path)``,
``("mm", identifier, rel_offset)``, ``("cache_salt", salt)``, ``("prompt_embeds", digest)``).
No keys -> ``None``. With lookahead L (0.33), the slot is ``(keys over [start, end + L), *the L
tokens after the block)``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ._inputs import Embeds, MmItem
from ._release import Era

__all__ = ["ExtraInputs", "block_extras"]

# One object per tag, as in vLLM (pickle memoizes a repeated "mm" within a block).
_LORA = "lora"
_MM = "mm"
_SALT = "cache_salt"
_EMBEDS = "prompt_embeds"


@dataclass(frozen=True)
class ExtraInputs:
    """A request's hash inputs besides its token ids (strings already made fresh)."""

    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None  # only a non-empty salt counts
    mm: tuple[MmItem, ...] = ()
    embeds: Embeds | None = None
    lookahead: int = 0
    starts_at_zero: bool = True  # False when continuing from a parent: no block 0 here

    @property
    def empty(self) -> bool:
        """True when every block's slot is ``None``."""
        return (
            self.lora_name is None
            and not (self.cache_salt and self.starts_at_zero)
            and not self.mm
            and self.embeds is None
            and not self.lookahead
        )


def block_extras(
    era: Era, inputs: ExtraInputs, n_blocks: int, block_size: int, tokens: list[int] | None
) -> list[object]:
    """The extra slot of each of ``n_blocks`` blocks; ``tokens`` (Python ints) are needed only
    with lookahead."""
    tagged = era is Era.V031
    lora: object = None
    if inputs.lora_name is not None:
        lora = (_LORA, inputs.lora_name, inputs.lora_path) if tagged else inputs.lora_name
    salt: object = None
    if inputs.cache_salt and inputs.starts_at_zero:
        salt = (_SALT, inputs.cache_salt) if tagged else inputs.cache_salt
    mm = inputs.mm
    first = 0  # first item that may still overlap a block
    look = inputs.lookahead
    out: list[object] = []
    for b in range(n_blocks):
        start = b * block_size
        end = start + block_size
        window_end = end + look
        keys: list[object] = []
        if lora is not None:
            keys.append(lora)
        while first < len(mm) and mm[first].offset + mm[first].length <= start:
            first += 1
        i = first
        while i < len(mm) and mm[i].offset < window_end:
            rel = mm[i].offset - start
            keys.append((_MM, mm[i].identifier, rel) if tagged else (mm[i].identifier, rel))
            i += 1
        if salt is not None and b == 0:
            keys.append(salt)
        if inputs.embeds is not None:
            data, row = inputs.embeds
            digest = hashlib.sha256(data[start * row : window_end * row]).digest()
            keys.append((_EMBEDS, digest) if tagged else digest)
        slot: object = tuple(keys) if keys else None
        if look:
            assert tokens is not None
            slot = (slot, *tokens[end:window_end])
        out.append(slot)
    return out
