"""The circuit breaker: after a failed RPC, fail fast for a pause, then let one probe RPC
through; the pause doubles (up to 8x) while the store stays down. Pure: times are passed in."""

from __future__ import annotations

__all__ = ["Breaker"]

_MAX_DOUBLINGS = 8


class Breaker:
    """Failure state of the store as the coordinator saw it (monotonic seconds)."""

    __slots__ = ("backoff", "failures", "last_code", "last_ok", "retry_at")

    def __init__(self, backoff: float) -> None:
        self.backoff = backoff
        self.failures = 0
        self.retry_at = 0.0
        self.last_code: int | None = None
        self.last_ok: float | None = None

    def failed(self, code: int | None, now: float) -> None:
        """An RPC failed (``code``: Mooncake's error code, if any)."""
        self.last_code = code
        self.failures += 1
        self.retry_at = now + self.backoff * min(2 ** (self.failures - 1), _MAX_DOUBLINGS)

    def succeeded(self, now: float) -> None:
        self.failures = 0
        self.last_ok = now

    def open(self, now: float) -> bool:
        """Failing fast: queued keys are answered as failed instead of sent."""
        return bool(self.failures) and now < self.retry_at

    def slots(self, free: int, busy: int) -> int:
        """How many RPCs may start, of ``free``: one probe RPC at a time while half-open."""
        if self.failures:
            return min(free, 1) if not busy else 0
        return free
