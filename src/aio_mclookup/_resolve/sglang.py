"""SGLang HiCache's L3 hit from the store's answers (docs/sglang.md).

Each querying rank stops at the first page with a key not answered ``1``; the ranks agree on
the minimum, which is the first page at which *any* rank's key is missing. The hit is that
many pages in tokens, revoked (0) below ``prefetch_threshold``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy.typing as npt

from .._arrays import BoolArray
from .answers import first_false, leading_present, present_keys

__all__ = ["l3_hit", "present_pages", "present_pages_of"]


def l3_hit(pages: int, page_size: int, threshold: int) -> int:
    """The hit in tokens when the first ``pages`` pages are present on every rank."""
    tokens = pages * page_size
    return tokens if tokens >= threshold else 0


def present_pages(present: BoolArray | Sequence[object], keys_per_page: int) -> int:
    """Leading pages whose every key is present, from one truthy value per key (page-major)."""
    miss = first_false(present)
    return len(present) // keys_per_page if miss is None else miss // keys_per_page


def present_pages_of(
    exists: Sequence[int] | npt.NDArray[Any], num_keys: int, keys_per_page: int
) -> int:
    """:func:`present_pages` from the store's raw answers (only ``1`` means present)."""
    run = leading_present(exists, num_keys)
    if run is None:  # (not plain numbers: compared one by one, or refused)
        return present_pages(present_keys(exists, num_keys), keys_per_page)
    return run // keys_per_page
