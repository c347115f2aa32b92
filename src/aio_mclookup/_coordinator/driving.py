"""What both shells (asyncio's :mod:`.shell`, anyio's :mod:`.anyio_shell`) do around a step of
the core, with no event loop of their own: after a step, send the whole RPCs queued and wake
the dispatcher; submit an RPC through a :class:`~aio_mclookup.CallbackStore`; settle an RPC's
outcome (through the master epochs first). Each shell adds how callers are woken, how the
dispatcher is woken and what a dispatch sends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from .._observe.stats import CoordinatorStats
from .._store.protocol import Answer, Key
from .core import CoordinatorCore
from .epochs import EpochGuard

__all__ = ["CoreDriver"]

logger = logging.getLogger("aio_mclookup")


class CoreDriver:
    """The part of a shell shared by both; a shell sets the attributes in its ``__init__``
    and provides :meth:`_deliver`, :meth:`_wake_dispatcher` and :meth:`_dispatch`."""

    _core: CoordinatorCore
    _stats: CoordinatorStats
    _epochs: EpochGuard
    _closed: bool
    _calls_in_flight: int
    """RPCs through a CallbackStore whose answer is still to come."""
    _dispatching: bool
    """Inside :meth:`_dispatch`: a call-back within it sends nothing more."""

    def _deliver(self) -> None:
        """Wake the callers of the lookups the core settled."""
        raise NotImplementedError

    def _wake_dispatcher(self) -> None:
        """Let the dispatcher run its next dispatch."""
        raise NotImplementedError

    def _dispatch(self, whole_only: bool = False) -> None:
        """Send what the core says to send (``whole_only``: only whole RPCs)."""
        raise NotImplementedError

    def _check_epoch(self) -> None:
        """A new master epoch, if the store saw its master go: wake the lookups it failed."""
        if self._epochs.check():
            self._deliver()

    def _after(self) -> None:
        """After the core ran: wake settled callers, send the whole RPCs queued (if slots are
        free), and wake the dispatcher for the rest."""
        self._deliver()
        core = self._core
        if core.fresh_keys:
            core.fresh_keys = False
            self._send_whole_rpcs()  # (the store works on them while more are planned)
            self._wake_dispatcher()

    def _send_whole_rpcs(self) -> None:
        """Send whole RPCs now, without waiting for the dispatcher's turn, when the keys
        queued fill every free RPC slot (see :meth:`CoordinatorCore.whole_rpcs_queued`); not
        from a call-back inside a dispatch, which would recurse once per RPC."""
        if self._dispatching or not self._core.whole_rpcs_queued():
            return
        try:
            self._dispatch(whole_only=True)
        except Exception:  # (as the dispatcher does: a bug here must not reach a caller)
            logger.exception("aio_mclookup: dispatch failed")

    def _send(self, submit: Any, keys: tuple[bytes, ...], sent_at: float, generation: int) -> None:
        """One RPC through a :class:`CallbackStore` (``submit``, its ``batch_is_exist_then``):
        the answers fan out as soon as the loop picks them up, one loop iteration before an
        awaiting task would resume."""
        started = time.perf_counter()
        settled = False  # one outcome per RPC, even from a store that answers and then raises

        def answered(outcome: list[int] | BaseException) -> None:
            nonlocal settled
            if settled:
                return
            settled = True
            self._calls_in_flight -= 1
            if self._closed:
                self._core.rpcs_in_flight -= 1
                return  # close settled every caller
            self._stats.rpc_seconds.observe(time.perf_counter() - started)
            self._settle(keys, sent_at, outcome, generation)

        then: Answer = answered
        batch: Sequence[Key] = keys
        self._calls_in_flight += 1
        try:
            submit(batch, then)
        except Exception as exc:  # (closed meanwhile): a failed RPC, answered at once
            answered(exc)

    def _settle(
        self,
        keys: tuple[bytes, ...],
        sent_at: float,
        outcome: Sequence[int] | BaseException,
        generation: int,
    ) -> None:
        """An RPC sent in ``generation`` is over: its outcome to the core (a new master epoch
        first, see :meth:`EpochGuard.outcome`), then wake its callers and send on."""
        core = self._core
        outcome = self._epochs.outcome(outcome, generation)
        core.settle_rpc(keys, sent_at, outcome, time.monotonic())
        self._deliver()
        core.fresh_keys = False
        self._send_whole_rpcs()  # (the store works on them while another RPC fans out)
        self._wake_dispatcher()  # a slot is free: queued keys may go out
