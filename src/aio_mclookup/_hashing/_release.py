"""vLLM releases and their hashing eras; the ``PYTHONHASHSEED`` text and what it allows."""

from __future__ import annotations

import re
from enum import Enum

from .._errors import InvalidRequest

__all__ = ["Era", "Release", "check_seed", "parse_release"]

SUPPORTED = "0.26.0 to 0.33.x"
_RELEASE = re.compile(r"0\.(\d+)(?:\.(\d+))?(?:\.post\d+)?(?:\+[0-9A-Za-z.]+)?")
_MAX_HASH_SEED = 4_294_967_295  # CPython refuses to start with a larger PYTHONHASHSEED
_C_SPACE = " \t\n\v\f\r"


class Era(Enum):
    """The three hashing eras: what NONE_HASH is without a seed, and how extra keys look."""

    V026 = "0.26-0.28"  # unset seed: os.urandom NONE_HASH; extra keys untagged
    V029 = "0.29-0.30"  # unset seed: fn("vllm-none-hash") for sha256*; untagged
    V031 = "0.31-0.33"  # as 0.29, and extra keys tagged with their source, LoRA path hashed


class Release:
    """A parsed vLLM release string within the supported range."""

    __slots__ = ("era", "minor", "patch", "text")

    def __init__(self, text: str, minor: int, patch: int) -> None:
        self.text = text
        self.minor = minor
        self.patch = patch
        self.era = Era.V026 if minor <= 28 else Era.V029 if minor <= 30 else Era.V031

    @property
    def has_lookahead(self) -> bool:
        """Lookahead block hashes exist from 0.33.0 on."""
        return self.minor >= 33


def parse_release(version: object) -> Release:
    """``"0.30"``, ``"0.30.1"``, ``"0.33.0+cpu"``... -> :class:`Release`; anything else refused."""
    if not isinstance(version, str):
        raise InvalidRequest(
            f"vllm_version must be a release string such as '0.33.0', not "
            f"{type(version).__name__}",
            field="vllm_version",
        )
    m = _RELEASE.fullmatch(version.strip())
    minor = int(m.group(1)) if m else -1
    if m is None or not 26 <= minor <= 33:
        raise InvalidRequest(
            f"vllm_version {version!r} is not a supported vLLM release: the hashing recipe is "
            f"known for {SUPPORTED} (e.g. '0.33.0', '0.30', '0.26.1'; no pre-releases)",
            field="vllm_version",
        )
    return Release(version, minor, int(m.group(2) or 0))


def check_seed(seed: object, release: Release, algo: str) -> None:
    """Refuse a seed the engines cannot have, or a missing one when NONE_HASH is random."""
    if seed is None:
        if release.era is Era.V026:
            raise InvalidRequest(
                f"vLLM {release.text} draws NONE_HASH from os.urandom when PYTHONHASHSEED is "
                "unset, so its hashes cannot be reproduced: start the engines with "
                "PYTHONHASHSEED set and pass the same text as seed=",
                field="seed",
            )
        if algo.startswith("xxhash"):
            raise InvalidRequest(
                f"with {algo}, vLLM {release.text} hashes a random per-process seed when "
                "PYTHONHASHSEED is unset, so its hashes cannot be reproduced: start the engines "
                "with PYTHONHASHSEED set and pass the same text as seed=",
                field="seed",
            )
        return
    if not isinstance(seed, str):
        raise InvalidRequest(
            f"seed must be the PYTHONHASHSEED text (str) or None, not {type(seed).__name__}: "
            "vLLM hashes the text itself, so '042' and '42' differ (pass seed='42')",
            field="seed",
        )
    if seed == "":
        raise InvalidRequest(
            "seed='' is ambiguous (Python treats an empty PYTHONHASHSEED as unset): pass None "
            "for unset, or the exact text the engines have",
            field="seed",
        )
    if seed != "random" and not _strtoul_ok(seed):
        raise InvalidRequest(
            f"seed {seed!r} is no PYTHONHASHSEED a Python process starts with: it must be "
            f"'random' or an integer in 0..{_MAX_HASH_SEED} (pass the engines' text exactly)",
            field="seed",
        )


def _strtoul_ok(text: str) -> bool:
    """Whether CPython accepts ``text`` as a numeric PYTHONHASHSEED (C ``strtoul`` rules)."""
    body = text.lstrip(_C_SPACE)
    negative = body.startswith("-")
    if body.startswith(("+", "-")):
        body = body[1:]
    if not body.isascii() or not body.isdigit():  # also refuses an empty body
        return False
    value = int(body)
    if negative and value:
        return False  # strtoul wraps a negative number to a huge one
    return value <= _MAX_HASH_SEED
