"""Which probe state drives a plan's rounds: vLLM 0.32 / 0.33 plans other than a lone
block-aligned full-attention prefix probed in rounds get
:class:`~.probing_era_c.EraCProbeState` (in rounds, or in one when rounds are off or cannot
follow vLLM); the rest :class:`~.probing.ProbeState`."""

from __future__ import annotations

from .era_c import EraCPlan
from .plan import LookupPlan
from .probing import ProbeState
from .probing_era_c import EraCProbeState

__all__ = ["probe_state"]


def probe_state(plan: LookupPlan, rounds: bool = True) -> ProbeState:
    """A new probe state for ``plan`` (``rounds`` False: every key in one round)."""
    if isinstance(plan, EraCPlan) and (
        not plan.single_full_attention or not rounds or plan.probe_in_one_round
    ):
        return EraCProbeState(plan, rounds)
    return ProbeState(plan, rounds)
