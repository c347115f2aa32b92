"""Array type aliases shared by planning, probing and resolving."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["EMPTY", "BoolArray", "IntArray", "KeyIndices"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
KeyIndices = IntArray | range
"""Key indices of a plan: an ascending array, or a contiguous ``range``."""
EMPTY: IntArray = np.zeros(0, dtype=np.int64)
