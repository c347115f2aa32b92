"""Master epochs, for both shells (asyncio's and anyio's): once the store's master may have
changed (restart, failover), nothing learned before answers a lookup again. Sans-IO: the
shells pass every lookup start, dispatch and RPC outcome through one :class:`EpochGuard`.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._errors import StoreError
from .._store.codes import INVALID_PARAMS, RPC_FAIL, RPC_TIMEOUT
from .._store.protocol import epochs_of
from .core import CoordinatorCore

__all__ = ["LOST_MASTER", "EpochGuard"]

LOST_MASTER = frozenset((RPC_FAIL, RPC_TIMEOUT, INVALID_PARAMS))
"""Codes of a failed RPC that say the master may be gone, or another one: a new epoch."""


class EpochGuard:
    """Watches the store's master for ``core``: a new epoch when the store's
    :class:`~aio_mclookup.Epochs` says it changed, or an RPC fails with a
    :data:`LOST_MASTER` code (:meth:`CoordinatorCore.new_epoch` then forgets every cached
    presence and fails the unsettled lookups). Each RPC is tagged with :attr:`generation`
    when sent; :meth:`outcome` refuses the answers of one sent before a change."""

    __slots__ = ("_core", "_epochs", "_seen", "generation")

    def __init__(self, core: CoordinatorCore, store: object) -> None:
        self._core = core
        self._epochs = epochs = epochs_of(store)
        self._seen = 0 if epochs is None else epochs.epoch
        self.generation = 0
        """Bumped at each possible change of master."""
        if epochs is not None:
            core.breaker.reachable = lambda: epochs.reachable

    def check(self) -> bool:
        """Whether the store saw its master go since the last look: then a new epoch began
        (the lookups it failed are in ``core.settled``, for the shell to wake)."""
        epochs = self._epochs
        if epochs is None or epochs.epoch == self._seen:
            return False
        self._seen = epochs.epoch
        self.generation += 1
        self._core.new_epoch("the store's master went away or was replaced", RPC_FAIL)
        return True

    def outcome(
        self, outcome: Sequence[int] | BaseException, generation: int
    ) -> Sequence[int] | BaseException:
        """The outcome of an RPC sent in ``generation``, as the core is to take it. A lost
        master's code begins a new epoch first: before the fan-out, which under
        ``on_error="absent"`` would resolve lookups on presences the master may have lost.
        The answers of an RPC sent before a change become a :class:`StoreError`. (After a
        failed RPC every RPC sent before it is refused too, unless the store watches its
        master: then nothing changed unless its epoch did.)"""
        self.check()
        if isinstance(outcome, StoreError) and outcome.code in LOST_MASTER:
            changed = self._core.new_epoch(
                f"an RPC failed with code {outcome.code}", outcome.code
            )
            if changed or self._epochs is None:
                self.generation += 1
        elif generation != self.generation and not isinstance(outcome, BaseException):
            outcome = StoreError(
                "answered in an earlier master epoch (the master went away meanwhile)",
                code=RPC_FAIL,
            )
        return outcome
