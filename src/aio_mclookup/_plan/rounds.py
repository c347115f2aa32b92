"""Which probe state drives a plan's rounds: vLLM 0.32 / 0.33 plans other than a lone
block-aligned full-attention prefix probed in rounds get
:class:`~.probing_era_c.EraCProbeState` (in rounds, or in one when rounds are off or cannot
follow vLLM); a lone full-attention group probed in rounds gets :class:`~.probing.ProbeState`'s
prefix mode, compiled where built (``_prefix_probe_c``); the rest :class:`~.probing.ProbeState`."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .. import _native
from .._arrays import EMPTY
from .._resolve.answers import first_false
from .era_c import EraCPlan
from .plan import LookupPlan
from .probing import SCOUT_WINDOW, SCOUTS, ProbeState, per_key
from .probing_era_c import EraCProbeState

__all__ = ["probe_state"]

_C: Any = _native.load("aio_mclookup._plan._prefix_probe_c")
"""ProbeState's prefix mode compiled (``_prefix_probe_c.c``: the same attributes and methods),
or ``None``."""


def _resolve_all(plan: LookupPlan, present: Any) -> int:
    """ProbeState's hit when every key came in one round."""
    return plan._resolve_present(np.asarray(present, dtype=bool))


def _int64_array(raw: bytes) -> npt.NDArray[np.int64]:
    """Key indices from native int64 bytes (read-only: nothing writes a round's indices)."""
    return np.frombuffer(raw, dtype=np.int64)


def configure(module: Any) -> None:
    """Hand the compiled prefix mode what it follows of :mod:`.probing` (once per process
    that loads it)."""
    module.configure(
        EMPTY,
        SCOUT_WINDOW,
        SCOUTS,
        first_false,
        per_key,
        _int64_array,
        _resolve_all,
        ProbeState.leaving_prefix_mode,
    )


if _C is not None:
    configure(_C)


def probe_state(plan: LookupPlan, rounds: bool = True) -> ProbeState:
    """A new probe state for ``plan`` (``rounds`` False: every key in one round)."""
    if rounds and plan.single_full_attention and not plan.probe_in_one_round:  # prefix mode
        if _C is not None:
            state: ProbeState = _C.PrefixProbe(plan)  # (ProbeState's twin, not a subclass)
            return state
        return ProbeState(plan)
    if isinstance(plan, EraCPlan):
        return EraCProbeState(plan, rounds)
    return ProbeState(plan, rounds)
