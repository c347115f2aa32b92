"""The scheduler's lookup client, coalescing: vLLM's ``LookupKeyClient`` contract, answered
by a lookup service (a :class:`~aio_mclookup.LookupCoordinator`) behind a channel: a sidecar
process in vLLM, a thread over an in-process store in the unit tests."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from .._coordinator.options import CoordinatorOptions
from .._errors import InvalidRequest
from .._layout.layout import KVLayout
from .._observe.stats import CoordinatorStats
from .._resolve.result import LookupResult
from .channels import Channel, ChannelClosed
from .messages import (
    Answers,
    Reply,
    Reset,
    ResetDone,
    Stats,
    StatsRequest,
    Submit,
    boundary_pairs,
)

__all__ = ["HEAD_START", "CoalescingLookupClient", "PLUGIN_DEFAULTS"]

logger = logging.getLogger("aio_mclookup.vllm")

PLUGIN_DEFAULTS: Mapping[str, Any] = {"timeout": 5.0, "cache_ttl": None}
"""Coordinator options the plug-in changes from the library's defaults: a lookup gives up
(hit 0, logged) after 5 s, as vLLM's scheduler must never wait on a dead master; and no
positive-answer cache, so every answer is the store's at probe time, as vLLM's worker gives
it. ``kv_connector_extra_config["aio_mclookup"]`` overrides either."""

_CLOSE_TIMEOUT = 10.0
"""Seconds :meth:`CoalescingLookupClient.close` waits for the service to close (then it is
killed), and the most ``reset`` and ``stats`` wait for its reply (at most the lookup's own
time limit when that is shorter)."""

_MARGIN = 1.0
"""Seconds a blocking :meth:`~CoalescingLookupClient.lookup` waits beyond the lookup's own
timeout before it gives up on the service itself."""

HEAD_START = 16
"""Lookups a flush sends ahead of the rest when none is out (a burst's first step): a small
batch is answered in a few milliseconds, where a whole burst's batch takes a few hundred, and
the engine has work meanwhile; the rest follow at the next flush, coalesced."""

_R = TypeVar("_R", bound=Reply)


_Unsent = tuple[int, int, bytes | list[bytes], int]
"""A lookup submitted in this scheduler step, not sent yet: ticket, n, hashes, width."""

_Outcome = tuple[int, tuple[tuple[int, int], ...]] | str
"""A finished lookup: its hit and tail-key boundaries, or what went wrong."""


def _joined(hashes: Sequence[bytes]) -> tuple[bytes | list[bytes], int]:
    """The hashes as one blob of rows of one width (cheap to send), or as a list when their
    widths differ (the service then refuses or plans them as the coordinator does)."""
    blob = b"".join(hashes)
    width = len(hashes[0]) if hashes else 32
    if width and width * len(hashes) == len(blob) and all(len(h) == width for h in hashes):
        return blob, width
    return [bytes(h) for h in hashes], 0


class CoalescingLookupClient:
    """``lookup(req_id, num_tokens, block_hashes, non_block)``, ``discard``, ``reset``,
    ``close``: the contract of vLLM's ``LookupKeyClient``, answered by one lookup service
    (a coordinator) behind a :class:`~.channels.Channel`.

    The first :meth:`lookup` of a request id submits its lookup; with ``non_block`` every call
    returns None until the answer is in, then the result (once: the id is then forgotten, as
    vLLM's client does). The lookups of one scheduler step go to the service together, at
    :meth:`flush`, and share ``batch_is_exist`` RPCs; answers are collected at each
    :meth:`flush` and :meth:`wait_for_answers`, by the first :meth:`pending` of a step and by
    a :meth:`lookup` of a pending id. A failed or timed-out lookup is logged and gives a hit
    of 0. ``make_result(hit_length, boundaries)`` builds the caller's result type (vLLM's
    ``MooncakeLookupResult``); ``boundaries`` is a tuple of ``(group_id, num_tokens)``.

    ``open_channel()`` starts the service: at once with ``start_now``, else at the first
    non-blocking lookup. A blocking lookup (vLLM's synchronous mode, where nothing can
    coalesce) skips the service when ``exist_blocking(keys, timeout)`` is given: the calling
    thread plans, asks the store and resolves, as vLLM's worker does. If the service is lost,
    that is logged once and lookups then take that blocking path (or answer 0 without it).

    ``reset`` (the store wiped) is delegated to ``reset_store`` and then restarts the
    service's coordinator, so nothing learned before the wipe is kept. ``close_blocking``, if
    given, is called at :meth:`close` (it closes what ``exist_blocking`` uses).
    """

    def __init__(
        self,
        layout: KVLayout,
        open_channel: Callable[[], Channel],
        *,
        make_result: Callable[[int, tuple[tuple[int, int], ...]], Any],
        reset_store: Callable[[], bool],
        options: CoordinatorOptions,
        exist_blocking: Callable[[list[bytes], float | None], list[int]] | None = None,
        close_blocking: Callable[[], None] | None = None,
        start_now: bool = True,
    ) -> None:
        self.layout = layout
        self._make_result = make_result
        self._reset_store = reset_store
        self._exist_blocking = exist_blocking
        self._close_blocking = close_blocking
        self.direct_rpcs = 0
        """RPCs of blocking lookups made in the caller's thread (not in :meth:`stats`)."""
        self._options = options
        self._open_channel = open_channel
        self._channel: Channel | None = None
        self._lost: str | None = None  # why the service is gone, once it is
        self._tickets: dict[str, int] = {}  # request id -> its lookup's ticket
        self._answers: dict[int, _Outcome] = {}  # ticket -> outcome, not collected yet
        self._unsent: list[_Unsent] = []
        self._discarded: list[int] = []  # sent tickets to cancel, with the next submission
        self._sent: dict[int, float] = {}  # sent tickets not answered -> when they give up
        self._asked: dict[int, _Unsent] = {}  # tickets not collected yet -> what they ask
        self._answered_at: dict[int, float] = {}  # answered, not collected: since when (in
        # that order)
        self._next_ticket = 0
        self._polled = False  # answers taken in by a poll since the last flush
        self._latest_stats: CoordinatorStats | None = None  # the last Stats the service sent
        self._stats_asked = -float("inf")  # when stats_nowait last asked for them
        self._stats_out = False  # a StatsRequest sent, its reply not in yet
        self._closed = False
        if start_now:
            self._channel = open_channel()

    @staticmethod
    def options_from(extra: Mapping[str, Any]) -> CoordinatorOptions:
        """The plug-in's coordinator options: :data:`PLUGIN_DEFAULTS`, then the
        ``"aio_mclookup"`` mapping of the connector's extra config (any
        :class:`CoordinatorOptions` field)."""
        own = extra.get("aio_mclookup", {})
        if not isinstance(own, Mapping):
            raise InvalidRequest(
                f"kv_connector_extra_config['aio_mclookup'] must be a mapping, got {own!r}",
                field="aio_mclookup",
            )
        unknown = set(own) - set(CoordinatorOptions.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(
                f"kv_connector_extra_config['aio_mclookup'] has unknown option(s) "
                f"{', '.join(sorted(unknown))} (the fields of CoordinatorOptions are allowed)",
                field="aio_mclookup",
            )
        return CoordinatorOptions(**{**PLUGIN_DEFAULTS, **own})

    # ------------------------------------------------------------------ vLLM's contract
    def lookup(
        self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes], non_block: bool = False
    ) -> Any:
        """The request's lookup result, or None while it is pending and ``non_block``.

        A non-blocking lookup is sent at the next :meth:`flush` (the end of the scheduler
        step), so all the lookups of one step start together and share RPCs; a blocking one
        (or a second call while still unsent) is sent at once."""
        ticket = self._tickets.get(req_id)
        if ticket is None:
            if self._closed:
                return self._make_result(0, ())
            if (not non_block or self._lost is not None) and self._exist_blocking is not None:
                return self._direct(req_id, num_tokens, block_hashes)
            try:
                hashes, width = _joined(block_hashes)
            except Exception as exc:  # vLLM's contract: log, then a hit of 0
                logger.error("aio-mclookup lookup failed for %s: %r", req_id, exc)
                return self._make_result(0, ())
            ticket = self._next_ticket = self._next_ticket + 1
            self._tickets[req_id] = ticket
            asked = (ticket, num_tokens, hashes, width)
            self._asked[ticket] = asked
            self._unsent.append(asked)
            if non_block:
                return None
        if ticket not in self._answers:
            self.flush(everything=not non_block)
        if ticket not in self._answers:
            if non_block:
                return None
            self._wait_for(ticket)
            self._answers.setdefault(ticket, "no answer from the lookup service")
        del self._tickets[req_id]
        outcome = self._answers.pop(ticket)
        self._forget(ticket)
        if isinstance(outcome, str):  # vLLM's contract: log, then a hit of 0
            logger.error("aio-mclookup lookup failed for %s: %s", req_id, outcome)
            return self._make_result(0, ())
        return self._make_result(*outcome)

    def pending(self, req_id: str) -> bool:
        """Whether ``req_id``'s non-blocking lookup is submitted and its answer not collected
        yet (then :meth:`lookup` would return None): the scheduler's cheap poll. The first
        call after a :meth:`flush` that finds a lookup out takes in the answers there are."""
        ticket = self._tickets.get(req_id)
        if ticket is None or ticket in self._answers:
            return False
        if not self._polled and ticket in self._sent:
            # The first poll of a step takes the answers that came in since the last one (the
            # model ran meanwhile), so they are scheduled in this step, not the next.
            self._polled = True
            self._collect(0.0)
        return ticket not in self._answers

    def answered(self, req_id: str) -> bool:
        """Whether ``req_id``'s lookup has its answer in, not collected by :meth:`lookup`."""
        ticket = self._tickets.get(req_id)
        return ticket is not None and ticket in self._answers

    def wait_for_answers(self, timeout: float) -> bool:
        """Block (the GIL released) until an answer arrives, at most ``timeout`` seconds; at
        once if no lookup is out or an answer is in already. For a scheduler step that
        scheduled nothing: rather than spin through empty steps, it lets the service work.
        Whether any lookup is out or answered (False: nothing to wait for)."""
        self.flush()
        if self._sent and not self._answers:
            self._collect(timeout)
        return bool(self._sent or self._answers or self._unsent)

    def _wait_for(self, ticket: int) -> None:
        """Collect answers until ``ticket``'s is in, at most until it gives up (its own time
        limit from when it was sent)."""
        while (give_up := self._sent.get(ticket)) is not None:
            left = give_up - time.monotonic()
            if left <= 0:
                self._give_up_late()
                return
            self._collect(min(left, 1.0))

    def _direct(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes]) -> Any:
        """One blocking lookup in the calling thread: plan, ask (in chunks of the
        coordinator's ``max_keys_per_rpc``), resolve; a failure is logged and gives 0."""
        assert self._exist_blocking is not None
        options = self._options
        try:
            plan = self.layout.plan(num_tokens, list(block_hashes))
            keys, step = list(plan.keys), options.max_keys_per_rpc
            answers: list[int] = []
            for start in range(0, len(keys), step):
                self.direct_rpcs += 1
                answers += self._exist_blocking(keys[start : start + step], options.timeout)
            result = plan.resolve_result(answers)
        except Exception as exc:  # vLLM's contract: log, then a hit of 0
            logger.error("aio-mclookup lookup failed for %s: %r", req_id, exc)
            return self._make_result(0, ())
        return self._vllm_result(result)

    def flush(self, *, everything: bool = False) -> None:
        """Send the lookups submitted since the last flush, together, and collect the
        answers that are in (vLLM's connector calls this once per scheduler step, from
        ``build_connector_meta``). When none is out, only the first :data:`HEAD_START` go
        now (unless ``everything``): their answers come back quickly, so the engine can start
        on them while the rest, sent at the next flush, are looked up."""
        self._polled = False
        if self._unsent or self._discarded:
            if not everything and not self._sent and len(self._unsent) > HEAD_START:
                batch, self._unsent = self._unsent[:HEAD_START], self._unsent[HEAD_START:]
            else:
                batch, self._unsent = self._unsent, []
            discard, self._discarded = self._discarded, []
            channel = self._service()
            if channel is None:
                self._fail([ticket for ticket, *_ in batch], self._lost or "no lookup service")
                return
            limit = self._wait_limit()
            give_up = float("inf") if limit is None else time.monotonic() + limit
            self._sent.update((ticket, give_up) for ticket, *_ in batch)
            try:
                channel.send(Submit(batch, discard))
            except ChannelClosed as exc:
                self._service_lost(str(exc))
                return
            except Exception as exc:  # (a request that cannot be encoded): these fail alone
                self._fail([ticket for ticket, *_ in batch], f"not sent: {exc!r}")
        if self._sent:
            self._collect(0.0)
            self._give_up_late()

    def _give_up_late(self) -> None:
        """Lookups out for longer than their own time limit (a service that stopped
        answering) get a hit of 0, logged, as a timed-out lookup does."""
        now = time.monotonic()
        late = []
        for ticket, give_up in self._sent.items():  # (in the order sent: earliest first)
            if give_up > now:
                break
            late.append(ticket)
        if late:
            self._fail(late, f"no answer from the lookup service within {self._wait_limit()} s")

    def _service(self) -> Channel | None:
        """The lookup service's channel, started on first use; None once it is lost."""
        if self._channel is None and self._lost is None and not self._closed:
            try:
                self._channel = self._open_channel()
            except Exception as exc:
                self._service_lost(f"the lookup service did not start: {exc!r}")
        return self._channel

    def _collect(self, timeout: float) -> list[Reply]:
        """Take the replies that are in (waiting up to ``timeout`` for the first): answers
        are filed under their tickets; the others are returned."""
        channel = self._channel
        if channel is None:
            return []
        try:
            replies = channel.receive(timeout)
        except ChannelClosed as exc:
            self._service_lost(str(exc))
            return []
        others: list[Reply] = []
        for reply in replies:
            if not isinstance(reply, Answers):
                if isinstance(reply, Stats):
                    self._latest_stats, self._stats_out = reply.stats, False
                others.append(reply)
                continue
            now = time.monotonic()
            for ticket, hit, detail in reply.outcomes:
                if self._sent.pop(ticket, None) is not None:
                    self._answers[ticket] = detail if hit is None else (hit, detail)  # type: ignore[assignment]
                    self._answered_at.pop(ticket, None)  # (a refreshed answer: now the newest)
                    self._answered_at[ticket] = now
        return others

    def _request(self, request: Reset | StatsRequest, reply_type: type[_R]) -> _R:
        """Send ``request`` and wait for its reply (answers meanwhile are filed)."""
        channel = self._service()
        if channel is None:
            raise ChannelClosed(self._lost or "no lookup service")
        channel.send(request)
        limit = self._wait_limit()
        wait = _CLOSE_TIMEOUT if limit is None else min(limit, _CLOSE_TIMEOUT)
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            for reply in self._collect(min(left, 0.1)):
                if isinstance(reply, reply_type):
                    return reply
            if self._lost is not None:
                raise ChannelClosed(self._lost)
        raise ChannelClosed(f"no {reply_type.__name__} from the lookup service within {wait} s")

    def _service_lost(self, why: str) -> None:
        """Log once; every lookup out gets a hit of 0; later ones take the blocking path."""
        if self._lost is None:
            self._lost = why
            logger.error(
                "aio-mclookup: %s; lookups now %s",
                why,
                ("block the scheduler, one at a time" if self._exist_blocking else "answer 0"),
            )
        channel, self._channel = self._channel, None
        if channel is not None:
            with contextlib.suppress(Exception):
                channel.close(0.0)
        self._fail(list(self._sent), why)

    def _fail(self, tickets: list[int], why: str) -> None:
        for ticket in tickets:
            self._forget_sent(ticket)
            self._answers[ticket] = why

    def _forget_sent(self, ticket: int) -> None:
        if self._sent.pop(ticket, None) is not None:
            self._discarded.append(ticket)

    def _vllm_result(self, result: LookupResult) -> Any:
        return self._make_result(result.hit_length, boundary_pairs(result))

    def _wait_limit(self) -> float | None:
        timeout = self._options.timeout
        return None if timeout is None else timeout + _MARGIN

    def discard(self, req_id: str) -> None:
        """Forget a request's lookup (finished or aborted), cancelling it if still out."""
        ticket = self._tickets.pop(req_id, None)
        if ticket is None:
            return
        self._answers.pop(ticket, None)
        self._forget(ticket)

    def _forget(self, ticket: int) -> None:
        """A ticket's answer was collected, or its lookup is no longer wanted: cancel it
        wherever it still is (unsent, out, or out again to refresh its answer)."""
        self._asked.pop(ticket, None)
        self._answered_at.pop(ticket, None)
        if any(unsent[0] == ticket for unsent in self._unsent):
            self._unsent = [unsent for unsent in self._unsent if unsent[0] != ticket]
        self._forget_sent(ticket)

    def refresh(self, max_age: float) -> int:
        """Ask again, at the next :meth:`flush`, the lookups whose answers came in more than
        ``max_age`` seconds ago and are not collected yet (the caller held them back); until
        the new answer is in, the old one stays and is what :meth:`lookup` returns. Returns
        how many were asked again."""
        answered_at = self._answered_at
        if not answered_at:
            return 0
        oldest = time.monotonic() - max_age
        due = []
        for ticket, since in answered_at.items():  # (oldest first)
            if since > oldest:
                break
            due.append(ticket)
        for ticket in due:
            del answered_at[ticket]  # (back in when the new answer comes)
            outcome = self._answers.get(ticket)
            if isinstance(outcome, tuple):  # (a failure is not asked again)
                self._unsent.append(self._asked[ticket])
        return len(due)

    def reset(self) -> bool:
        """Wipe the store (vLLM's own reset, on its worker) and start a fresh coordinator."""
        ok = self._reset_store()
        for req_id in list(self._tickets):
            self.discard(req_id)
        self._unsent.clear()
        if self._channel is not None:
            self.flush()  # (the cancellations)
            try:
                self._request(Reset(), ResetDone)
            except ChannelClosed as exc:
                self._service_lost(str(exc))
        return ok

    def close(self) -> None:
        """Cancel every lookup, end the service and close the blocking path's store."""
        if self._closed:
            return
        self._closed = True
        self._tickets.clear()
        self._answers.clear()
        self._asked.clear()
        self._answered_at.clear()
        self._unsent.clear()
        self._sent.clear()
        self._discarded.clear()
        channel, self._channel = self._channel, None
        try:
            if channel is not None:
                channel.close(_CLOSE_TIMEOUT)
        except Exception as exc:
            logger.warning("aio-mclookup: closing the lookup service: %r", exc)
        if self._close_blocking is not None:
            try:
                self._close_blocking()
            except Exception as exc:
                logger.warning("aio-mclookup: closing the scheduler's Mooncake client: %r", exc)

    # ------------------------------------------------------------------- observability
    def stats_nowait(self, every: float = 1.0) -> CoordinatorStats | None:
        """The last statistics snapshot the service sent (None before the first), without
        waiting: asks for a fresh one when the last ask is ``every`` seconds old (its reply
        is taken in with the answers). For a caller on the scheduler's every step."""
        if self._stats_out:
            self._collect(0.0)  # (the reply, if in; answers meanwhile are filed)
        now = time.monotonic()
        if self._channel is not None and not self._stats_out and now - self._stats_asked >= every:
            self._stats_asked = now
            try:
                self._channel.send(StatsRequest())
            except ChannelClosed as exc:
                self._service_lost(str(exc))
            else:
                self._stats_out = True
        return self._latest_stats

    def stats(self) -> CoordinatorStats:
        """A snapshot of the service's coordinator's statistics (RPCs, keys, lookups); those
        of a fresh coordinator (zeros) while no service runs (not started yet, or lost)."""
        if self._channel is None:
            return CoordinatorStats()
        try:
            return self._request(StatsRequest(), Stats).stats
        except ChannelClosed as exc:
            self._service_lost(str(exc))
            return CoordinatorStats()
