"""How many lookups' hits a scheduler is handed ahead of what it has started: pure, no vLLM.

vLLM's scheduler starts a KV load for every request whose hit it is given (the load does not
take its token budget), so hits handed over all at once start every load at once: on a small
host those loads then run against the forward passes, and the burst finishes later than with
hits that trickle in (docs/vllm.md, "Load pacing"). :class:`LoadPacer` hands hits out as the
engine takes work in: while the tokens still to compute of the requests handed a result and not
yet scheduled reach its window, further results wait (the lookups themselves still go out). A
result held longer than :data:`MAX_HOLD` is not handed out as it is: the store is asked again,
so that no hit handed over is older than that (plus a step).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["MAX_HOLD", "LoadPacer"]

MAX_HOLD = 2.0
"""Seconds a result may be held back before the store is asked again (docs/vllm.md, "Load
pacing")."""


class LoadPacer:
    """The work handed to the scheduler and not started yet, in tokens to compute, against a
    window of ``window`` tokens (``0``: no pacing, every result goes at once); and since when
    each result held back has been held."""

    __slots__ = ("_ahead", "_held", "max_hold", "tokens", "window")

    def __init__(self, window: int, max_hold: float = MAX_HOLD) -> None:
        if window < 0:
            raise ValueError(f"the load window must be >= 0 tokens, got {window}")
        self.window = window
        self.max_hold = max_hold
        self.tokens = 0
        """Tokens still to compute of the requests handed a result and not started."""
        self._ahead: dict[str, int] = {}
        self._held: dict[str, float] = {}  # request -> when its result was first held back

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

    def held(self, req_id: str, now: float) -> bool:
        """``req_id``'s result is in but not admitted, at ``now`` (monotonic seconds): whether
        it has been held back for longer than :attr:`max_hold` (then ask the store again: its
        hold starts afresh with the new result)."""
        since = self._held.setdefault(req_id, now)
        if now - since > self.max_hold:
            del self._held[req_id]
            return True
        return False

    def handed(self, req_id: str, tokens_to_compute: int) -> None:
        """``req_id`` was handed its result; it leaves ``tokens_to_compute`` to compute."""
        self._held.pop(req_id, None)
        if req_id not in self._ahead:
            tokens = max(0, tokens_to_compute)
            self._ahead[req_id] = tokens
            self.tokens += tokens

    def started(self, req_ids: Iterable[str]) -> None:
        """These requests were scheduled (or finished, or were aborted): no longer ahead."""
        ahead, held = self._ahead, self._held
        if not ahead and not held:
            return
        for req_id in req_ids:
            tokens = ahead.pop(req_id, None)
            if tokens is not None:
                self.tokens -= tokens
            if held:
                held.pop(req_id, None)
