"""The circuit breaker: after a failed RPC, fail fast for a pause, then let one probe RPC
through; the pause doubles (up to 8x ``backoff``) while the store stays down. A store that
tells whether its master's port is up (``reachable``, see :class:`~.._store.watch.MasterWatch`)
makes the first pause short and keeps failing fast while that port is down. Pure: times are
passed in."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Breaker"]

_MAX_DOUBLINGS = 8
_UNREACHABLE = -900
"""The code queued keys fail with while the master's port is known down and no RPC has
failed yet: Mooncake's RPC_FAIL, what the call would have answered."""
_WATCHED_SHARE = 16
"""With a reachability signal the first pause is ``backoff / 16`` (62.5 ms by default): a
failure while the master's port is up is most often the client's connection to a master that
has just restarted, which the next call finds repaired."""


class Breaker:
    """Failure state of the store as the coordinator saw it (monotonic seconds).

    ``reachable`` (optional) answers True / False when the store knows whether its master's
    port is up, None when it does not know."""

    __slots__ = (
        "backoff", "failures", "last_code", "last_ok", "learned", "reachable", "retry_at",
    )

    def __init__(
        self, backoff: float, reachable: Callable[[], bool | None] | None = None
    ) -> None:
        self.backoff = backoff
        self.reachable = reachable
        self.failures = 0
        self.retry_at = 0.0
        self.last_code: int | None = None
        self.last_ok: float | None = None
        self.learned = False
        """An RPC succeeded since this was last reset (by a new master epoch): something may
        be cached that a restart of the master would make untrue."""

    def _first_pause(self) -> float:
        reachable = self.reachable
        if reachable is not None and reachable() is not None:
            return self.backoff / _WATCHED_SHARE
        return self.backoff

    def failed(self, code: int | None, now: float) -> None:
        """An RPC failed (``code``: Mooncake's error code, if any)."""
        self.last_code = code
        self.failures += 1
        pause = self._first_pause() * 2 ** min(self.failures - 1, 16)
        self.retry_at = now + min(pause, self.backoff * _MAX_DOUBLINGS)

    def succeeded(self, now: float) -> None:
        self.failures = 0
        self.last_ok = now
        self.learned = True

    def open(self, now: float) -> bool:
        """Failing fast: queued keys are answered as failed instead of sent. While the
        master's port is known down it is open, failed RPC or not (``retry_at`` then says
        when to look again)."""
        reachable = self.reachable
        if reachable is not None and reachable() is False:
            if self.retry_at <= now:
                self.retry_at = now + self.backoff / _WATCHED_SHARE
            if self.last_code is None:
                self.last_code = _UNREACHABLE
            return True
        return bool(self.failures) and now < self.retry_at

    def slots(self, free: int, busy: int) -> int:
        """How many RPCs may start, of ``free``: one probe RPC at a time while half-open."""
        if self.failures:
            return min(free, 1) if not busy else 0
        return free
