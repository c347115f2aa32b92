"""The coordinator's options, validated once (:class:`CoordinatorOptions`).

What each knob trades, and the measurements behind the defaults, are in docs/coordinator.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from .._checks import positive_int
from .._errors import InvalidRequest

__all__ = ["CoordinatorOptions", "check_timeout"]


def check_timeout(name: str, value: object) -> float | None:
    """A timeout in seconds: a positive number or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidRequest(f"{name} must be > 0 seconds or None, got {value!r}", field=name)
    return float(value)


@dataclass(frozen=True, slots=True)
class CoordinatorOptions:
    """How a :class:`~aio_mclookup.LookupCoordinator` batches, bounds and caches its work.

    * ``timeout``: seconds each lookup may take (None: no bound); a late lookup raises
      :class:`~aio_mclookup.LookupTimeout`.
    * ``on_error``: ``"raise"`` gives callers whose keys were in a failed RPC a
      :class:`~aio_mclookup.StoreError`; ``"absent"`` (vLLM's behaviour) counts those keys as
      absent.
    * ``max_keys_per_rpc``, ``max_rpcs_in_flight``: the size of one RPC and how many run at
      once on the store's threads; ``linger``: seconds to wait for more work before a
      dispatch (0 sends at once).
    * ``max_round_keys``: at most this many keys of one lookup join one round (a huge prompt
      probes in several rounds instead of flooding the queue); RPC capacity is shared between
      the lookups with keys queued, in turn.
    * ``max_pending_lookups`` / ``max_pending_keys``: bounds on admitted work (keys, not
      hashes); past them callers wait in arrival order (``when_full="wait"``, at most
      ``max_waiting_lookups`` of them) or get :class:`~aio_mclookup.Overloaded` (``"raise"``).
    * ``cache_ttl``: seconds a positive answer is reused, counted from when its RPC was sent
      (keep it below the master's lease TTL); None disables the cache. ``cache_max_keys``
      bounds it.
    * ``rounds``: probe only keys that can change the answer, in rounds; False sends every
      planned key in one round, as vLLM does. ``probe_window``: while the store is busy, a
      round probes at most this many of the unknown chunks an answer rests on per
      spec-group (doubling every round); None: never limit.
    * ``failure_backoff``: after a failed RPC, fail fast for this long, then let one probe
      RPC through (doubling the pause, up to 8x, while the store stays down). With a store
      that knows whether its master's port is up (``store.epochs.reachable``), the first
      pause is ``failure_backoff / 16`` while it is up, and lookups fail fast while it is
      down.
    """

    timeout: float | None = None
    on_error: Literal["raise", "absent"] = "raise"
    max_keys_per_rpc: int = 1000
    max_rpcs_in_flight: int = 2
    linger: float = 0.0
    max_round_keys: int = 16_000
    max_pending_lookups: int = 4096
    max_pending_keys: int = 2_000_000
    max_waiting_lookups: int = 16_384
    when_full: Literal["wait", "raise"] = "wait"
    cache_ttl: float | None = 5.0
    cache_max_keys: int = 1_000_000
    rounds: bool = True
    probe_window: int | None = 16
    failure_backoff: float = 1.0

    def __post_init__(self) -> None:
        if self.on_error not in ("raise", "absent"):
            raise InvalidRequest(
                f"on_error must be 'raise' or 'absent', got {self.on_error!r}", field="on_error"
            )
        if self.when_full not in ("wait", "raise"):
            raise InvalidRequest(
                f"when_full must be 'wait' or 'raise', got {self.when_full!r}",
                field="when_full",
            )
        for name in (
            "max_keys_per_rpc", "max_rpcs_in_flight", "max_round_keys", "max_pending_lookups",
            "max_pending_keys", "max_waiting_lookups", "cache_max_keys",
        ):
            positive_int(name, getattr(self, name))
        if self.probe_window is not None:
            positive_int("probe_window", self.probe_window)
        for name in ("timeout", "cache_ttl"):
            object.__setattr__(self, name, check_timeout(name, getattr(self, name)))
        if not isinstance(self.rounds, bool):
            raise InvalidRequest(f"rounds must be a bool, got {self.rounds!r}", field="rounds")
        for name, low_ok in (("linger", True), ("failure_backoff", False)):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (value >= 0 if low_ok else value > 0)
            ):
                bound = ">= 0" if low_ok else "> 0"
                raise InvalidRequest(f"{name} must be {bound}, got {value!r}", field=name)

    def replace(self, **changes: Any) -> CoordinatorOptions:
        """A copy with some options changed (validated again)."""
        return dataclasses.replace(self, **changes)
