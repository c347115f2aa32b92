"""Admission's bookkeeping, for both shells: how much work is admitted, whether one more
lookup fits, and when a newcomer may not even wait. Sans-IO: the waiting line itself (futures
or events) is the shell's.
"""

from __future__ import annotations

from .._errors import Overloaded
from .core import CoordinatorCore

__all__ = ["Admission"]


class Admission:
    """Work admitted to ``core``: the lookups it registered, and those let in from the
    waiting line that have not begun yet (:attr:`reserved_lookups`, :attr:`reserved_keys`),
    against ``max_pending_lookups`` and ``max_pending_keys``."""

    __slots__ = ("_core", "reserved_keys", "reserved_lookups")

    def __init__(self, core: CoordinatorCore) -> None:
        self._core = core
        self.reserved_lookups = 0
        self.reserved_keys = 0

    def has_room(self, num_keys: int) -> bool:
        """Whether a lookup of ``num_keys`` planned keys fits now (one always fits alone,
        however large)."""
        core = self._core
        pending = len(core.lookups) + self.reserved_lookups
        if not pending:
            return True
        options = core.options
        return (
            pending < options.max_pending_lookups
            and self.pending_keys() + num_keys <= options.max_pending_keys
        )

    def pending_keys(self) -> int:
        return self._core.pending_keys + self.reserved_keys

    def reserve(self, num_keys: int) -> None:
        """A waiter was let in: its work counts until it begins (or gives up)."""
        self.reserved_lookups += 1
        self.reserved_keys += num_keys

    def release(self, num_keys: int) -> None:
        """A reserved waiter began (the core counts it now) or gave up."""
        self.reserved_lookups -= 1
        self.reserved_keys -= num_keys

    def refusal(self, waiting: int) -> Overloaded | None:
        """The error for a lookup that does not fit and may not wait (``when_full="raise"``,
        or ``waiting`` lookups fill the line already), else None: it waits."""
        options = self._core.options
        if options.when_full != "raise" and waiting < options.max_waiting_lookups:
            return None
        return Overloaded(
            f"{len(self._core.lookups)} lookups / {self.pending_keys()} keys pending "
            f"(max {options.max_pending_lookups} / {options.max_pending_keys}), "
            f"{waiting} waiting"
        )
