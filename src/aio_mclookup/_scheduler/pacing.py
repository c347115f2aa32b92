"""How many lookups' hits a scheduler is handed ahead of what it has started: pure, no vLLM.

vLLM's scheduler starts a KV load for every request whose hit it is given (the load does not
take its token budget), so hits handed over all at once start every load at once: on a small
host those loads then run against the forward passes, and the burst finishes later than with
hits that trickle in (docs/vllm.md, "Load pacing"). :class:`LoadPacer` hands hits out as the
engine takes work in: while the tokens still to compute of the requests handed a result and not
yet scheduled reach its window, further results wait (the lookups themselves still go out).
Results that wait longer than :data:`MAX_HOLD` are asked of the store again (the plug-in does
that with ``CoalescingLookupClient.refresh``), so that a hit handed over is not older.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["MAX_HOLD", "LoadPacer"]

MAX_HOLD = 2.0
"""Seconds an answer may wait, held back, before the store is asked again (docs/vllm.md,
"Load pacing")."""


class LoadPacer:
    """The work handed to the scheduler and not started yet, in tokens to compute, against a
    window of ``window`` tokens (``0``: no pacing, every result goes at once)."""

    __slots__ = ("_ahead", "tokens", "window")

    def __init__(self, window: int) -> None:
        if window < 0:
            raise ValueError(f"the load window must be >= 0 tokens, got {window}")
        self.window = window
        self.tokens = 0
        """Tokens still to compute of the requests handed a result and not started."""
        self._ahead: dict[str, int] = {}

    @property
    def full(self) -> bool:
        """The work ahead fills the window: results that are in wait (a step that scheduled
        nothing has nothing to take from them)."""
        return bool(self.window) and self.tokens >= self.window

    def __len__(self) -> int:
        """Requests handed a result and not started."""
        return len(self._ahead)

    def admits(self, req_id: str) -> bool:
        """Whether ``req_id`` may be handed its result now: pacing is off, it was handed one
        already (asked again), or the work ahead is below the window (one request may take
        it past: a request longer than the window still goes, alone)."""
        return not self.window or req_id in self._ahead or self.tokens < self.window

    def handed(self, req_id: str, tokens_to_compute: int) -> None:
        """``req_id`` was handed its result; it leaves ``tokens_to_compute`` to compute."""
        if req_id not in self._ahead:
            tokens = max(0, tokens_to_compute)
            self._ahead[req_id] = tokens
            self.tokens += tokens

    def started(self, req_ids: Iterable[str]) -> None:
        """These requests were scheduled (or finished, or were aborted): no longer ahead."""
        ahead = self._ahead
        if not ahead:
            return
        for req_id in req_ids:
            tokens = ahead.pop(req_id, None)
            if tokens is not None:
                self.tokens -= tokens
