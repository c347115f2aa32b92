"""The coordinator's core: many lookups' probing rounds over one key table, with no event loop,
clock or store (sans-IO).

The asyncio shell (:mod:`.shell`) feeds it plans (:meth:`CoordinatorCore.begin`), RPC outcomes
(:meth:`CoordinatorCore.settle_rpc`) and timeouts (:meth:`CoordinatorCore.fail`), each with
the current monotonic time, and acts on what it leaves behind:

* keys queued in the :class:`KeyTable` are to be sent: :meth:`CoordinatorCore.take_batches` says
  which, in RPC-sized batches (or fails them fast while the store is down);
* lookups in :attr:`CoordinatorCore.settled` are done: each carries its hit (and result) or
  its error.

Data flow of one lookup: known prefixes first (a lone full-attention group), then share the
work of a *walker* probing the same prompt (see :meth:`CoordinatorCore._follow`), then probe
rounds: :class:`ProbeState` names the keys whose answers can still change the hit; each key is
answered from the positive-answer cache, joins a key already queued or in flight, or is
queued. Answers fan back out; a lookup whose round is complete starts its next round or
resolves.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .._arrays import KeyIndices
from .._errors import Error, InternalError, StoreError
from .._layout.groups import FullAttention
from .._observe.stats import CoordinatorStats
from .._plan.keys import split_items
from .._plan.plan import LookupPlan
from .._plan.probing import SCOUTS, ProbeState
from .._plan.rounds import probe_state
from .._resolve.answers import present_keys
from .._rows import common_rows
from .breaker import Breaker
from .caches import KnownPrefixes, NextChunk, PositiveCache
from .options import CoordinatorOptions
from .table import POS_BITS, POS_MASK, KeyTable, Subscribers, answer

__all__ = ["CoordinatorCore", "LookupState"]

logger = logging.getLogger("aio_mclookup")

_EAGER_KEYS = 4096
"""Plans up to this many keys build them all at once; except a lone full-attention group,
which builds only the ranges its rounds probe (the caches answer most of its keys)."""
_NOTHING_CACHED: dict[bytes, float] = {}  # never written: a dict's get beats a proxy's
_WIDE = 48
"""Rounds of at least this many entries keep their answers in an array (numpy's fixed cost
per call beats a loop's cost per key from there)."""
_COLD_SHIFT = 2
"""A busy store probes a cold prompt's chunks (nothing known of it: no cached prefix, no
walker) in windows this many doublings wider than ``probe_window``: its hit may end anywhere,
the scouts past each window keep the keys past a miss few, and each round costs the event
loop more than a few keys more do (docs/benchmarks.md, the cold bursts)."""
_PRESENT = 1.0
"""The mark of a present answer when no cache keeps it (``cache_ttl`` None): no expiry is
tracked, and as a time it is long past, so no known prefix is ever built on it."""
_NEXT_PRESENT = NextChunk.LIKELY_PRESENT
_NEXT_LEAVES_RUN = NextChunk.LEAVES_RUN
"""What :meth:`KnownPrefixes.after` answers, as globals: on Python 3.11 reading a member off
its enum class goes through ``EnumType.__getattr__``'s slow path, several times a global's
cost."""


@dataclass(eq=False, slots=True)
class LookupState:
    """One lookup in progress: its plan, probing state, the round being answered, and what
    it knows of its prompt (for the caches and walkers)."""

    plan: LookupPlan
    state: ProbeState
    ident: int
    """Its number among the core's lookups (>= 1), as used in :data:`Subscribers`."""
    waiter: Any = None
    """The shell's handle on the caller (a future); the core never touches it."""
    error: BaseException | None = None
    """Set when it failed (then it is done)."""
    done: bool = False
    """Settled (hit, error or given up by the caller): answers for it are dropped."""
    round_keys: KeyIndices = range(0)
    round_present: list[float] | npt.NDArray[np.float64] = field(default_factory=list)
    """Per entry of the round: 0.0 absent, else until when it is known present (an array
    for a round of :data:`_WIDE` entries or more, which are handled a run at a time)."""
    waiting: int = 0
    """Answers of the round still to come."""
    unit: int = 1
    """Keys per entry of its rounds: 1, or (one group, several rank namespaces) a chunk's keys
    in every namespace as one *item* (see :func:`~.._plan.keys.assemble_items`), so that the
    caches, the key table and the fan-out do one step per chunk, not one per key."""
    cold: bool = False
    """Nothing was known of its prompt when it began probing (see :data:`_COLD_SHIFT`)."""
    likely_miss: bool = False
    """A cache knew a prefix and the chunk after it is likely absent (see
    :meth:`KnownPrefixes.after`): the first round probes that chunk alone."""
    own_way: bool = False
    """The request leaves the known run right after its known prefix: no walker can share
    its next chunk, so it does not look for one."""
    prefix_rows: npt.NDArray[np.uint8] | None = None
    """The hash rows of a full-attention group probed whole (``plan.groups[prefix_group]``),
    when its known-present prefix is to be remembered in the :class:`KnownPrefixes` once the
    lookup settles."""
    prefix_group: int = 0
    prefix_from_runs: int = 0
    """Chunks the known prefixes answered at the start (nothing new to remember there)."""
    valid_until: float = math.inf
    """Until when every presence this lookup relied on holds (its earliest expiry)."""
    prompt: tuple[Hashable, bytes] | None = None
    """With ``prefix_rows``: the layout's key prefixes and the first hash, which find its
    known prefix and its walker."""
    walk: tuple[Hashable, bytes] | None = None
    """Set while it is the walker of a shared prefix."""
    followers: list[LookupState] | None = None
    """Lookups waiting for this walker's current round."""
    follow_until: int = 0
    """While following: the first chunk whose hash differs from the walker's."""

    @property
    def hit(self) -> int:
        """The hit, once settled without error."""
        hit = self.state.hit
        assert hit is not None
        return hit


class CoordinatorCore:
    """Probing rounds of many lookups over shared, deduplicated keys (see the module doc)."""

    def __init__(self, options: CoordinatorOptions, stats: CoordinatorStats) -> None:
        self.options = options
        self.stats = stats
        self.table = KeyTable()
        self.settled: list[LookupState] = []
        """Lookups settled since the shell last looked (it empties the list)."""
        self.rpcs_in_flight = 0
        self.fresh_keys = False
        """Keys were queued since the shell last looked: time to dispatch (it resets it)."""
        self.breaker = Breaker(options.failure_backoff)
        self.lookups: dict[int, LookupState] = {}  # by ident: the subscribers' registry
        self.pending_keys = 0
        """Planned keys of the registered lookups (what admission bounds)."""
        self._idents = itertools.count(1)
        self._dispatch_lookups: set[LookupState] = set()
        self._cache = PositiveCache()  # filled only while cache_ttl is set
        self._prefixes = KnownPrefixes()  # likewise
        self._walkers: dict[tuple[Hashable, bytes], LookupState] = {}
        self._now = 0.0
        self._unit = 1
        """The largest :attr:`LookupState.unit` begun: RPCs take whole items."""

    # --------------------------------------------------------------------------- lookups
    def begin(self, plan: LookupPlan, now: float, waiter: Any = None) -> LookupState:
        """Register a lookup of ``plan`` and start it: caches, a walker to follow, or its
        first round. It may settle at once (see :attr:`settled`). A plan not prepared yet
        (:attr:`LookupPlan.needs_preparing`) prepares here."""
        self._now = now
        options = self.options
        if plan.needs_preparing:  # (shells that cannot prepare it off the loop)
            plan.prepare()
        lookup = LookupState(plan, probe_state(plan, options.rounds), next(self._idents), waiter)
        self.lookups[lookup.ident] = lookup
        self.pending_keys += plan.num_keys
        try:
            prefix_mode = lookup.state.known_prefix is not None
            unit = plan._chunk_keys  # (rounds always probe whole chunks)
            if 1 < unit <= options.max_keys_per_rpc:
                lookup.unit = unit
                if unit > self._unit:
                    self._unit = unit
            elif not prefix_mode and plan.num_keys <= _EAGER_KEYS:
                _build_keys(plan)  # one vectorised build beats several partial ones
            if (
                options.rounds
                and (options.cache_ttl is not None or self._cache or self._prefixes)
                and not lookup.state.all_at_once  # (rounds on: the plan's own verdict)
            ):
                self._prefill_from_cache(lookup, prefix_mode)
            if lookup.prefix_rows is None or lookup.own_way or not self._follow(lookup):
                self._next_round(lookup)
        except Exception as exc:
            self._fail_on(lookup, exc)
        return lookup

    def finish(self, lookup: LookupState) -> None:
        """The caller is done with ``lookup`` (settled, timed out or cancelled): forget it."""
        if lookup.walk is not None:
            self._end_walk(lookup)
        lookup.done = True
        lookup.waiter = None  # (the caller's future: no reference cycle left behind)
        del self.lookups[lookup.ident]
        self.pending_keys -= lookup.plan.num_keys
        if lookup.waiting:
            self._drop_queued_keys(lookup)

    def fail(self, lookup: LookupState, error: BaseException) -> None:
        """Settle ``lookup`` with ``error`` (unless it is settled already), dropping its
        queued keys that nobody else waits for now, not when its caller gets to
        :meth:`finish` (an RPC may go out before that)."""
        if not lookup.done:
            lookup.error = error
            lookup.done = True
            self.settled.append(lookup)
            self._dispatch_lookups.discard(lookup)
            if lookup.waiting:
                try:
                    self._drop_queued_keys(lookup)
                except Exception:  # (its keys cannot be rebuilt, e.g. the bug it fails for:
                    # they stay queued, answered to nobody; the failure stays this lookup's)
                    logger.exception("aio_mclookup: could not drop a failed lookup's keys")
                finally:
                    lookup.waiting = 0  # (nothing more to drop at finish)

    def new_epoch(self, why: str, code: int | None = None) -> bool:
        """The master may have lost every lease (restart, failover, gone): nothing answered
        before may answer a lookup again. If an RPC succeeded since the last epoch, forget
        every cached presence (positive cache, known prefixes, walkers) and fail every
        unsettled lookup, which may rest on such answers, with :class:`StoreError` (``code``);
        True then. Answers of RPCs sent before are the caller's to refuse."""
        if not self.breaker.learned:
            return False  # (nothing learned since the last epoch: nothing to forget)
        self.breaker.learned = False
        self.stats.epoch_changes_total += 1
        self._cache = PositiveCache()
        self._prefixes = KnownPrefixes()
        self._walkers.clear()
        for lookup in list(self.lookups.values()):
            self.fail(lookup, StoreError(f"new master epoch ({why}); retry", code=code))
        return True

    def fail_all(self, error: BaseException) -> None:
        """Drop every key and settle every lookup with ``error`` (closing)."""
        self.table.clear()
        self._dispatch_lookups.clear()
        for lookup in list(self.lookups.values()):
            self.fail(lookup, error)

    def _fail_on(self, lookup: LookupState, exc: Exception) -> None:
        """A round of ``lookup`` raised: vLLM's own error cases are :class:`Error` already
        (``InvalidRequest``); anything else is a bug of ours, logged, failing only it."""
        if not isinstance(exc, Error):
            logger.error("aio_mclookup: internal error in a lookup", exc_info=exc)
            exc = InternalError(f"internal error in a lookup round: {exc!r}")
        self.fail(lookup, exc)

    def _next_round(self, lookup: LookupState) -> None:
        """Queue the keys of the lookup's next round, or settle it when none are left."""
        state = lookup.state
        options = self.options
        while not lookup.done:
            window = options.probe_window
            ahead = None
            if window is not None and (self.rpcs_in_flight or self.table.live):  # busy
                if lookup.likely_miss and not state.rounds:
                    # Test the likely miss alone first, and with it (a plan with other groups)
                    # what the next round would ask if it is absent: their windows there.
                    ahead = window << 1  # (the next round's window: a prefix is known)
                    window = 1
                else:
                    if not state.rounds and state.known_prefix == 0:
                        lookup.cold = True
                    window <<= min(state.rounds + (_COLD_SHIFT if lookup.cold else 0), 20)
            else:  # an idle store: latency first, probe everything the answer rests on
                window = None
            if lookup.plan.num_keys > options.max_round_keys:
                window = self._bounded(lookup, window)
                if ahead is not None:
                    ahead = self._bounded(lookup, ahead)
            wanted = state.next_keys(window, ahead)
            count = len(wanted)
            if not count:
                assert state.hit is not None
                lookup.done = True
                self.settled.append(lookup)
                if lookup.prefix_rows is not None:
                    self._remember_prefix(lookup)
                return
            self.stats.rounds_total += 1
            lookup.round_keys = wanted
            if lookup.unit > 1:
                count //= lookup.unit
            lookup.round_present = np.zeros(count) if count >= _WIDE else [0.0] * count
            lookup.waiting = count
            known_at, known_answers = state.answered_ahead  # (per key)
            if known_at and lookup.unit > 1:  # one entry per item: a chunk's keys (one
                # group: unit is its namespaces, and positions come a whole chunk at a time)
                unit = lookup.unit
                known_at = [pos // unit for pos in known_at[::unit]]
                known_answers = known_answers[::unit]
            if self._subscribe(lookup, _entries(lookup, wanted), known_at, known_answers):
                return  # answers will arrive from the store
            self._record_round(lookup)

    def _bounded(self, lookup: LookupState, window: int | None) -> int | None:
        """``window`` capped so that a round holds at most ``max_round_keys`` keys (one
        round's window is in chunks per spec-group; each chunk has a key per namespace and
        member group)."""
        plan = lookup.plan
        per_chunk = max(1, sum(map(len, plan.geometry.prefix_bytes)))  # (a key per namespace
        # of every group)
        cap = max(1, self.options.max_round_keys // per_chunk - SCOUTS)  # (scouts: past it)
        return cap if window is None or window > cap else window

    def _record_round(self, lookup: LookupState) -> None:
        """Every answer of the round is in: record them (and how long they hold)."""
        if lookup.prefix_rows is not None:
            present = lookup.round_present
            if isinstance(present, list):
                until = min(filter(None, present), default=math.inf)
            else:
                until = float(present.min(initial=math.inf, where=present > 0))
            if until < lookup.valid_until:
                lookup.valid_until = until
        lookup.state.record(lookup.round_keys, lookup.round_present, lookup.unit)  # (per item)

    def _remember_prefix(self, lookup: LookupState) -> None:
        """A lookup settled: remember its full-attention group's present prefix by hash
        rows."""
        assert lookup.prefix_rows is not None
        known, then_absent = lookup.state.leading_known(lookup.prefix_group)
        if known > lookup.prefix_from_runs and lookup.valid_until > self._now:
            rows = lookup.prefix_rows
            miss = rows[known].tobytes() if then_absent else None
            probe = lookup.plan.groups[lookup.prefix_group]
            self._prefixes.add(
                lookup.plan.geometry.prefix_bytes[probe.group_id],
                rows[:known],
                lookup.valid_until,
                self.options.cache_max_keys,
                lookup.prompt,
                miss,
            )

    def _subscribe(
        self,
        lookup: LookupState,
        keys: Sequence[bytes],
        known_at: Sequence[int] = (),
        known_answers: Sequence[Any] = (),
    ) -> bool:
        """Fill in the entries the probe state knows (positions ``known_at``, ascending, with
        their answers), answer what the cache knows, join shared probes, queue the rest.

        Returns True when some answers are still to come.
        """
        stats = self.stats
        if known_at:
            present = lookup.round_present
            for pos, answer in zip(known_at, known_answers):
                present[pos] = answer
            lookup.waiting -= len(known_at)
        cached: Mapping[bytes, float] = _NOTHING_CACHED
        if self._cache:
            self._cache.expire(self._now)
            cached = self._cache.members
        base = lookup.ident << POS_BITS
        keys, subs = _without(keys, known_at, base)
        fresh, shared, hits, just_answered = self.table.subscribe(
            keys, subs, cached, lookup.round_present, base
        )
        unit = lookup.unit
        stats.dedup_hits_total += (shared + just_answered) * unit
        stats.cache_hits_total += hits * unit
        lookup.waiting -= hits + just_answered
        if fresh:
            self._dispatch_lookups.add(lookup)
            self.fresh_keys = True
        return lookup.waiting > 0

    def _subscribed(self, subscribers: Subscribers) -> Iterator[tuple[LookupState, int]]:
        """The unsettled lookups among ``subscribers``, with their positions."""
        lookups = self.lookups
        for sub in (subscribers,) if isinstance(subscribers, int) else subscribers:
            lookup = lookups.get(sub >> POS_BITS)
            if lookup is not None and not lookup.done:
                yield lookup, sub & POS_MASK

    def _answer(self, subscribers: Subscribers, present: float) -> None:
        """One key's answer for everyone waiting for it (lookups settled meanwhile are
        skipped); the lookups whose round it completes go on."""
        ready: list[LookupState] = []
        answer(self.lookups, subscribers, present, ready)
        for lookup in ready:
            if not lookup.done:  # (a walker's advance may settle its followers)
                self._advance(lookup)

    def _advance(self, lookup: LookupState) -> None:
        """A round is answered: record it and go on (a failure ends only this lookup)."""
        try:
            self._record_round(lookup)
            self._next_round(lookup)
        except Exception as exc:
            self._fail_on(lookup, exc)
        if lookup.followers:  # a walker's round is over: its followers go on from there
            self._release_followers(lookup, settled=lookup.done)

    # ------------------------------------------------------------------ caches and walkers
    def _prefill_from_cache(self, lookup: LookupState, prefix_mode: bool) -> None:
        """Answer the full-attention chunks the caches know, before the first round, so the
        first probe starts where the cached prefix ends.

        The first full-attention group that probes every chunk first asks the known
        prefixes (one compare of hash rows, no keys built); then, for every full-attention
        group, the key cache is read a block at a time from there, so a short cached prefix
        costs little.
        """
        plan = lookup.plan
        geometry = plan.geometry
        cache = self._cache
        now = self._now
        cache.expire(now)
        asked = False
        for index, probe in enumerate(plan.groups):
            spec = geometry.groups[probe.group_id]
            if not probe.chunks.size or not isinstance(spec, FullAttention):
                continue
            k = len(geometry.prefix_bytes[probe.group_id])  # (its namespaces)
            span = plan._key_span(probe)
            run = 0
            likely_miss = True
            if not asked and probe.hash_rows is not None and (prefix_mode or probe.dense):
                asked = True
                signature = geometry.prefix_bytes[probe.group_id]
                prompt = KnownPrefixes.key_of(signature, probe.hash_rows)
                if self.options.cache_ttl is not None:  # remember its prefix once it settles
                    lookup.prefix_rows = probe.hash_rows
                    lookup.prefix_group = index
                    lookup.prompt = prompt
                chunks, until = self._prefixes.leading(signature, probe.hash_rows, now, prompt)
                lookup.valid_until = min(lookup.valid_until, until)
                lookup.prefix_from_runs = chunks
                run = chunks * k
                if chunks:
                    after = self._prefixes.after(prompt, probe.hash_rows, chunks)
                    likely_miss = after is not _NEXT_PRESENT
                    lookup.own_way = after is _NEXT_LEAVES_RUN
            if cache and not run:  # (else the first round reads the key cache as it goes)
                block = k
                unit = lookup.unit
                while run < len(span):
                    stop = min(span.stop, span.start + run + block)
                    got, until = cache.leading(_entries(lookup, range(span.start + run, stop)))
                    run += got * unit
                    lookup.valid_until = min(lookup.valid_until, until)
                    if span.start + run < stop:
                        break
                    block *= 8
            cached = run - run % k
            if cached:
                lookup.likely_miss = likely_miss
                self.stats.cache_hits_total += cached
                lookup.state.record_present(range(span.start, span.start + cached))

    def _follow(self, lookup: LookupState) -> bool:
        """A lone full-attention lookup about to probe past its known prefix: share the work
        of the lookup probing the same prompt (its *walker*, found by the layout's key prefixes
        and the first hash) instead of subscribing to the same keys chunk by chunk.

        It takes the walker's answers for the chunks both share (same hash rows, so the same
        keys and answers). If it is then at the walker's current chunk, with the same hash
        there, and the walker's round fits one RPC, it waits for that round (see
        :meth:`_release_followers`) and returns True: a wait no longer than joining the
        walker's keys would be. Otherwise it probes by itself (False), and becomes the walker
        if there is none."""
        rows, key = lookup.prefix_rows, lookup.prompt
        start = lookup.state.known_prefix
        if rows is None or key is None or start is None or start >= rows.shape[0]:
            return False
        walker = self._walkers.get(key)
        if walker is lookup:
            return False
        walked = None if walker is None else walker.state.known_prefix
        theirs = None if walker is None else walker.prefix_rows
        if walker is not None and walked is not None and walked > start:
            start = self._take_walked(lookup, walker, start, walked)  # (settled or not)
        if walker is None or walker.done:
            self._walkers[key] = lookup
            lookup.walk = key
            return False
        if theirs is None or walked != start or start >= min(theirs.shape[0], rows.shape[0]):
            return False  # not at the walker's chunk: nothing more to share
        if theirs[start].tobytes() != rows[start].tobytes():
            return False  # our next chunk is not theirs
        if len(walker.round_keys) > self.options.max_keys_per_rpc:
            return False  # a round of several RPCs: do not wait for the slowest of them
        lookup.follow_until = start + common_rows(theirs[start:], rows[start:])
        if walker.followers is None:
            walker.followers = []
        walker.followers.append(lookup)
        return True

    def _take_walked(
        self, lookup: LookupState, walker: LookupState, start: int, walked: int
    ) -> int:
        """Record the walker's present chunks ``start`` to ``walked`` that the lookup shares
        (as if it had joined the walker's keys); returns its new known prefix."""
        theirs, rows = walker.prefix_rows, lookup.prefix_rows
        assert theirs is not None and rows is not None
        if start >= min(theirs.shape[0], rows.shape[0]) or (
            theirs[start].tobytes() != rows[start].tobytes()  # (the usual miss, found cheaply)
        ):
            return start
        shared = common_rows(theirs[start:walked], rows[start:walked])
        if shared:
            k = len(lookup.plan.geometry.namespaces)
            offset = lookup.plan.groups[0].key_offset
            lookup.valid_until = min(lookup.valid_until, walker.valid_until)
            self.stats.cache_hits_total += shared * k
            lookup.state.record_present(range(offset + start * k, offset + (start + shared) * k))
            lookup.likely_miss = (
                start + shared < walked  # it went its own way within the walker's chunks
                or self._prefixes.after(lookup.prompt, rows, start + shared)
                is not _NEXT_PRESENT
            )
        return start + shared

    def _end_walk(self, walker: LookupState) -> None:
        """A walker settled (whichever way): no longer the walker; release its followers."""
        assert walker.walk is not None
        if self._walkers.get(walker.walk) is walker:
            del self._walkers[walker.walk]
        walker.walk = None
        if walker.followers:
            self._release_followers(walker, settled=True)

    def _release_followers(self, walker: LookupState, settled: bool) -> None:
        """The walker finished a round (or settled): followers whose chunks it has not yet
        passed keep waiting; the others take what it found and follow again, or probe by
        themselves."""
        followers, walker.followers = walker.followers or (), None
        walked = None if settled else walker.state.known_prefix
        if len(walker.round_keys) > self.options.max_keys_per_rpc:
            walked = None  # its next round needs several RPCs: no waiting for it
        for lookup in followers:
            if lookup.done:
                continue
            if walked is not None and walked < lookup.follow_until:
                if walker.followers is None:  # still sharing its next chunk: wait on
                    walker.followers = []
                walker.followers.append(lookup)
                continue
            try:
                if not self._follow(lookup):
                    self._next_round(lookup)
            except Exception as exc:
                self._fail_on(lookup, exc)

    def _drop_queued_keys(self, lookup: LookupState) -> None:
        """A finished lookup's probes that nobody else waits for are abandoned: the queued
        ones will not be sent (see :class:`KeyTable`)."""
        table = self.table
        if not lookup.waiting or not table.queued:
            return
        waiting, abandoned, sending = table.waiting, table.abandoned, table.sending
        for key in _entries(lookup, lookup.round_keys):
            subscribers = waiting.get(key)
            if subscribers is not None and key not in sending and not self._wanted(subscribers):
                abandoned.add(key)  # (queued: taking it drops it, unless someone joined)

    def _wanted(self, subscribers: Subscribers) -> bool:
        """Some unsettled lookup waits for this key."""
        return any(self._subscribed(subscribers))

    # ------------------------------------------------------------------------------ RPCs
    def take_batches(
        self, now: float, whole_only: bool = False
    ) -> tuple[list[tuple[bytes, ...]], float | None]:
        """What to send now: queued keys in RPC-sized batches, as many as RPC slots are free
        (counted in flight from here on); with ``whole_only``, only the RPCs the queued keys
        fill (``max_keys_per_rpc`` each), the rest left queued. While the breaker is open,
        queued keys fail fast instead, and the second value says when to try again."""
        self._now = now
        table = self.table
        if not table.queued:
            return [], None
        options = self.options
        breaker = self.breaker
        if breaker.open(now):
            self._fail_queued()
            return [], breaker.retry_at
        slots = breaker.slots(options.max_rpcs_in_flight - self.rpcs_in_flight, self.rpcs_in_flight)
        if slots <= 0:
            return [], None
        unit = self._unit
        per_rpc = self._entries_per_rpc()
        if whole_only:
            slots = min(slots, table.live // per_rpc)
            if not slots:
                return [], None
        entries = table.take(slots * per_rpc, self._wanted)
        if not entries:  # (every key it took was abandoned)
            return [], None
        # Split evenly over the free slots, each RPC at most max_keys_per_rpc keys.
        count = min(slots, -(-len(entries) // per_rpc))
        size = -(-len(entries) // count)
        batches = [entries[start : start + size] for start in range(0, len(entries), size)]
        if unit > 1:
            batches = [_expand(batch) for batch in batches]
        stats = self.stats
        for batch in batches:
            stats.rpcs_total += 1
            stats.keys_sent_total += len(batch)
            stats.keys_per_rpc.observe(len(batch))
        self.rpcs_in_flight += len(batches)
        stats.dispatches_total += 1
        stats.lookups_per_dispatch.observe(len(self._dispatch_lookups))
        self._dispatch_lookups.clear()
        return batches, None

    def whole_rpcs_queued(self) -> bool:
        """The keys queued fill every free RPC slot with a whole RPC (``max_keys_per_rpc``
        keys, in whole items), and no ``linger`` is to be waited out: time to send them, with
        :meth:`take_batches` ``whole_only``, rather than on the dispatcher's next turn."""
        options = self.options
        free = options.max_rpcs_in_flight - self.rpcs_in_flight
        return (
            not options.linger
            and free > 0
            and self.table.live >= free * self._entries_per_rpc()
        )

    def _entries_per_rpc(self) -> int:
        """Key-table entries one RPC takes: keys, or whole items of :attr:`_unit` keys."""
        return max(1, self.options.max_keys_per_rpc // self._unit)

    def _fail_queued(self) -> None:
        """The store is failing: answer queued keys now instead of feeding it."""
        self._dispatch_lookups.clear()
        code = self.breaker.last_code
        for subscribers in self.table.clear_queued().values():
            self._settle_failed(subscribers, code, "store unavailable; failing fast")

    def _settle_failed(self, subscribers: Subscribers, code: int | None, why: str) -> None:
        if self.options.on_error == "absent":
            self._answer(subscribers, 0.0)
            return
        if code is not None and f"code {code}" not in why:  # (the store's text may say it)
            why = f"{why} (code {code})"
        for lookup, _ in self._subscribed(subscribers):
            self.fail(lookup, StoreError(why, code=code))

    def settle_rpc(
        self,
        keys: tuple[bytes, ...],
        sent_at: float,
        outcome: Sequence[int] | BaseException,
        now: float,
    ) -> None:
        """An RPC of ``keys`` sent at ``sent_at`` is over: fan its answers out (and cache
        them), or fail its keys."""
        self._now = now
        self.rpcs_in_flight -= 1
        options = self.options
        error, present = None, None
        items = keys.items if isinstance(keys, Batch) else None
        if isinstance(outcome, BaseException):
            error = outcome
        elif len(outcome) != len(keys):
            error = StoreError(f"store answered {len(outcome)} values for {len(keys)} keys")
        else:  # vLLM: only 1 is present. A present key is marked with until when that holds.
            mark = _PRESENT if options.cache_ttl is None else sent_at + options.cache_ttl
            try:
                present = present_keys(outcome, len(keys))
                if items is not None:  # an item is present when every key of it is
                    assert isinstance(keys, Batch)
                    present = np.logical_and.reduceat(present, keys.starts)
            except Exception as exc:  # (answers that are not ints)
                error = StoreError(f"store answered something other than ints: {exc!r}")
        if items is not None:
            keys = items  # (the key table's entries from here on)
        waiting = self.table.waiting
        if error is not None or present is None:
            code = error.code if isinstance(error, StoreError) else None
            self.stats.rpc_errors_total += 1
            self.stats.last_error = f"{type(error).__name__}: {error}"
            self.breaker.failed(code, now)
            failed = [waiting.pop(key, None) for key in keys]  # (all out of the table before
            self.table.answered(keys)  # a failing lookup looks for its queued keys there)
            for subscribers in failed:
                if subscribers:
                    self._settle_failed(subscribers, code, f"store RPC failed: {error}")
            return
        self.table.answered(keys)
        self.breaker.succeeded(now)
        flags = present.tolist()
        values: list[float] = np.where(present, mark, 0.0).tolist()
        if options.cache_ttl is not None:  # before the fan-out: next rounds may read it
            self._cache.add(
                tuple(itertools.compress(keys, flags)), mark, options.cache_max_keys
            )
            # Next rounds started by this fan-out take these answers too, wherever they are
            # (the present ones from the cache).
            self.table.answering = dict.fromkeys(
                itertools.compress(keys, map(operator.not_, flags)), 0.0
            )
        else:
            self.table.answering = dict(zip(keys, values))
        try:
            for lookup in self.table.fan_out(keys, values, self.lookups):
                if not lookup.done:  # (a walker's advance may settle its followers)
                    self._advance(lookup)
        finally:
            self.table.answering = {}


class Batch(tuple[bytes, ...]):
    """The keys of one RPC whose entries include items (several keys each): ``items`` are
    those entries, ``starts`` where each one's keys begin."""

    items: tuple[bytes, ...]
    starts: npt.NDArray[np.intp]


def _expand(entries: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """An RPC's keys from its key-table entries: items (see :func:`assemble_items`) become
    their keys (a :class:`Batch`); plain keys stay."""
    keys, starts = split_items(entries)
    if len(keys) == len(entries):  # (no items: an item has several keys)
        return entries
    batch = Batch(keys)
    batch.items = entries
    batch.starts = np.array(starts, dtype=np.intp)
    return batch


def _without(
    keys: Sequence[bytes], skip: Sequence[int], base: int
) -> tuple[Sequence[bytes], range | list[int]]:
    """``keys`` but those at the ascending positions ``skip``, and the subscribers (``base``
    plus position) of those left, in slices (``skip`` holds a few scouts at most)."""
    if not skip:
        return keys, range(base, base + len(keys))
    open_keys: list[bytes] = []
    open_subs: list[int] = []
    start = 0
    for pos in (*skip, len(keys)):
        open_keys += keys[start:pos]
        open_subs += range(base + start, base + pos)
        start = pos + 1
    return open_keys, open_subs


def _entries(lookup: LookupState, indices: KeyIndices) -> list[bytes]:
    """The key-table entries of a lookup's keys at ``indices`` (whole chunks): the keys, or
    one item per chunk (see :attr:`LookupState.unit`)."""
    if lookup.unit > 1:
        return lookup.plan._items_at(indices)
    return lookup.plan._keys_at(indices)


def _build_keys(plan: LookupPlan) -> None:
    """Build every key of the plan at once (cached by the plan), as one array if it can."""
    if plan.key_array() is None:
        plan.keys  # noqa: B018 - builds and caches the list
