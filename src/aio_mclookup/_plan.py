"""Plan: one request's candidate keys (vLLM's order) and how to resolve the store's answers.

Planning never touches a hash it does not need: sliding-window masks pick chunk indices first,
then only those hashes are gathered, hex-encoded in one C call and glued to precomputed key
prefixes with numpy.
"""

from __future__ import annotations

import array
import binascii
import functools
import itertools
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ._errors import InvalidRequest
from ._hits import full_attention_prefix_hit, longest_hit
from ._layout import ChunkedLocalAttention, SlidingWindow, window_blocks

if TYPE_CHECKING:
    from ._layout import KVLayout

__all__ = ["HashInput", "KeyIndices", "LookupPlan", "ProbeState", "build_plan"]

HashInput = Sequence[bytes] | npt.NDArray[np.uint8]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
KeyIndices = IntArray | range
"""Key indices of a plan: an ascending array, or a contiguous ``range``."""

_EMPTY = np.zeros(0, dtype=np.int64)
_FEW_KEYS = 48  # fewer keys than this are built by concatenation: faster than the array path
_SPLIT_KEYS = 96  # likewise, where one split builds them (one namespace; see _concatenate)
SCOUT_WINDOW = 8
"""Prefix-mode rounds probing at least this many chunks also send scouts (see ProbeState)."""


@dataclass(eq=False, slots=True)
class GroupProbe:
    """What a plan probes in one KV-cache group.

    ``chunks`` are the probed chunk indices (ascending); key ``key_offset + j * k + n`` (``k``
    namespaces) is chunk ``chunks[j]`` in namespace ``n``. ``limit`` is how many chunks exist
    for this request. ``hash_rows`` holds the probed chunks' raw hashes, C-contiguous (None
    when of mixed widths: ``hex_items`` then holds them in hex); :attr:`hex_rows` encodes on first
    use, so a caller that needs only some keys (probing in rounds) encodes only those. Chunks
    not probed count as absent unless ``unprobed_ids`` maps them to a probed chunk with the
    same hash; :attr:`hash_ids` links probed chunks that share a hash (vLLM records presence
    per hash), computed on first use.
    """

    group_id: int
    chunks: IntArray
    limit: int
    key_offset: int
    hex_items: list[bytes]
    hash_rows: npt.NDArray[np.uint8] | None
    unprobed_ids: IntArray | None
    subset_of: GroupProbe | None = field(default=None, init=False)
    """A group whose probed hashes include all of this one's (rows taken from its rows)."""
    _hex_rows: npt.NDArray[np.uint8] | None = field(default=None, init=False)
    _hash_ids: IntArray | None = field(default=None, init=False)
    _hash_ids_known: bool = field(default=False, init=False)

    @property
    def hex_rows(self) -> npt.NDArray[np.uint8] | None:
        """Every probed hash in hex, a read-only (n, 2 * width) uint8 array, not necessarily
        contiguous (None: mixed widths)."""
        if self._hex_rows is None and self.hash_rows is not None:
            self._hex_rows = _hex_rows(self.hash_rows)
        return self._hex_rows

    @property
    def hex_if_encoded(self) -> npt.NDArray[np.uint8] | None:
        """:attr:`hex_rows` if every hash is encoded already, else None (encoding nothing)."""
        return self._hex_rows

    def hex_at(self, rows: IntArray) -> npt.NDArray[np.uint8]:
        """The hex of some probed hashes (by probe index), encoding only those unless every
        hash is encoded already."""
        if self._hex_rows is not None:
            return self._hex_rows[rows]
        assert self.hash_rows is not None
        return _hex_rows(self.hash_rows[rows])

    @property
    def hash_ids(self) -> IntArray | None:
        """Ids equal exactly where probed hashes are equal; None when all differ."""
        if not self._hash_ids_known:
            superset = self.subset_of
            if superset is not None and superset.hash_ids is None:  # none repeat there
                self._hash_ids = None
            else:
                self._hash_ids = _duplicate_ids(self.hash_rows, self.hex_items)
            self._hash_ids_known = True
        return self._hash_ids

    @property
    def dense(self) -> bool:
        """Every chunk < limit is probed (chunk index == probe index)."""
        return self.chunks.size == self.limit

    @property
    def shares_hashes(self) -> bool:
        return self.hash_ids is not None or self.unprobed_ids is not None


class LookupPlan:
    """The keys one lookup probes, and :meth:`resolve` to turn the answers into a hit length.

    ``keys`` are ASCII ``bytes`` (Mooncake's ``batch_is_exist`` takes them as they are),
    byte-identical to vLLM 0.26's candidate keys and in its order: group-major, then chunk,
    then rank namespace. They are assembled on first access.
    """

    __slots__ = (
        "_groups", "_key_array", "_key_array_tried", "_keys", "_short", "layout", "num_keys",
        "token_len",
    )

    def __init__(
        self,
        layout: KVLayout,
        token_len: int,
        groups: tuple[GroupProbe, ...],
        num_keys: int,
        short: bool | None = None,
    ) -> None:
        self.layout = layout
        self.token_len = token_len
        self._groups = groups
        self.num_keys = num_keys
        self._keys: list[bytes] | None = None
        self._key_array: npt.NDArray[np.bytes_] | None = None
        self._key_array_tried = False
        self._short = short

    @property
    def keys(self) -> list[bytes]:
        """The candidate keys (a shared list: do not mutate)."""
        if self._keys is None:
            array = self.key_array()
            if array is not None:
                keys: list[bytes] = array.tolist()
            else:  # keys of different widths: group by group
                keys = []
                for probe in self._groups:
                    keys.extend(self._assemble(probe, None))
            self._keys = keys
        return self._keys

    def key_array(self) -> npt.NDArray[np.bytes_] | None:
        """Every key in one fixed-width ``bytes`` array, built once, or None when the keys
        differ in width. :meth:`keys_at` then slices it: a caller that keeps a plan alive
        while it works (the coordinator) holds no Python object per key, which the garbage
        collector would otherwise walk through at every collection."""
        if not self._key_array_tried:
            self._key_array_tried = True
            self._key_array = self._build_key_array()
        return self._key_array

    def _build_key_array(self) -> npt.NDArray[np.bytes_] | None:
        """``prefix@hex`` rows of every group in one buffer (None: widths differ)."""
        probes = [p for p in self._groups if p.chunks.size]
        widths = set()
        for probe in probes:
            prefix_rows = self.layout.prefix_rows[probe.group_id]
            if prefix_rows is None or probe.hash_rows is None:
                return None
            widths.add(prefix_rows.shape[1] + 2 * probe.hash_rows.shape[1])
        if len(widths) != 1:
            return None
        width = widths.pop()
        buf = np.empty((self.num_keys, width), dtype=np.uint8)
        for probe in probes:
            prefix_rows = self.layout.prefix_rows[probe.group_id]
            assert prefix_rows is not None and probe.hex_rows is not None
            k = prefix_rows.shape[0]
            n = probe.hex_rows.shape[0]
            part = buf[probe.key_offset : probe.key_offset + n * k].reshape(n, k, width)
            _glue(part, prefix_rows, probe.hex_rows[:, None, :])
        array: npt.NDArray[np.bytes_] = buf.view(f"S{width}").ravel()
        return array

    @property
    def groups(self) -> tuple[GroupProbe, ...]:
        """Per-group probe details."""
        return self._groups

    def __len__(self) -> int:
        return self.num_keys

    @property
    def probe_in_one_round(self) -> bool:
        """Rounds cannot help: some group has fewer hashes than token_len needs (vLLM's own
        answer may then be an error), or hashes repeat where the hit search infers presence
        across chunks. A lone full-attention group probes its prefix in order, where a
        repeated key simply gets the same answer again: repeats do not matter there."""
        if self.short:
            return True
        if self.single_full_attention:
            return False
        return any(p.shares_hashes for p in self._groups)

    def key_span(self, probe: GroupProbe) -> range:
        """Every key index of one group."""
        k = len(self.layout.namespaces)
        return range(probe.key_offset, probe.key_offset + probe.chunks.size * k)

    @property
    def short(self) -> bool:
        """Fewer hashes than ``token_len`` needs in some group (vLLM truncates, or raises)."""
        if self._short is None:
            groups = self.layout.groups
            self._short = any(
                p.limit < self.token_len // groups[p.group_id].block_size for p in self._groups
            )
        return self._short

    def __repr__(self) -> str:
        return f"<LookupPlan token_len={self.token_len} keys={self.num_keys}>"

    def keys_at(self, indices: KeyIndices) -> list[bytes]:
        """The keys at ascending key indices (without assembling the others)."""
        if self._keys is not None:
            if isinstance(indices, range):
                return self._keys[indices.start : indices.stop]
            return [self._keys[i] for i in indices.tolist()]
        if self._key_array is not None:
            if isinstance(indices, range):
                picked: list[bytes] = self._key_array[indices.start : indices.stop].tolist()
            else:
                picked = self._key_array[indices].tolist()
            return picked
        groups = self._groups
        if len(groups) == 1:  # key indices are the group's own (its offset is 0)
            if isinstance(indices, range):
                if len(indices) == 1:  # (the usual round of a cached prompt: the likely miss)
                    return [self._one_key(groups[0], indices.start)]
                return self._assemble_range(groups[0], indices.start, indices.stop)
            return self._assemble(groups[0], indices)
        k = len(self.layout.namespaces)
        out: list[bytes] = []
        if isinstance(indices, range):
            for probe in self._groups:
                end = probe.key_offset + probe.chunks.size * k
                lo, hi = max(indices.start, probe.key_offset), min(indices.stop, end)
                if hi > lo:
                    base = probe.key_offset
                    out.extend(self._assemble_range(probe, lo - base, hi - base))
            return out
        for probe in self._groups:
            lo = int(np.searchsorted(indices, probe.key_offset))
            hi = int(np.searchsorted(indices, probe.key_offset + probe.chunks.size * k))
            if hi > lo:
                out.extend(self._assemble(probe, indices[lo:hi] - probe.key_offset))
        return out

    def _assemble(self, probe: GroupProbe, local: IntArray | None) -> list[bytes]:
        """``prefix@hex`` for a group's keys (all, or the group-local key indices given),
        hex-encoding only the hashes they need."""
        k = len(self.layout.namespaces)
        if local is None:
            return self._assemble_range(probe, 0, probe.chunks.size * k)
        prefix_rows = self.layout.prefix_rows[probe.group_id]
        if prefix_rows is None or probe.hash_rows is None or local.size < self._few(probe):
            return self._concatenate(probe, local)
        hexed = probe.hex_at(local // k)
        plen = prefix_rows.shape[1]
        width = plen + hexed.shape[1]
        flat = np.empty((local.size, width), dtype=np.uint8)
        _glue(flat, prefix_rows if k == 1 else prefix_rows[local % k], hexed)
        keys: list[bytes] = flat.view(f"S{width}").ravel().tolist()
        return keys

    def _assemble_range(self, probe: GroupProbe, lo: int, hi: int) -> list[bytes]:
        """A group's keys ``lo`` to ``hi`` (group-local key indices), from slices of its
        hashes."""
        prefix_rows = self.layout.prefix_rows[probe.group_id]
        if prefix_rows is None or probe.hash_rows is None or hi - lo < self._few(probe):
            return self._concatenate(probe, range(lo, hi))
        k, plen = prefix_rows.shape
        first, last = lo // k, (hi - 1) // k + 1
        encoded = probe.hex_if_encoded
        if encoded is not None:
            hexed = encoded[first:last]
        else:
            hexed = _hex_rows(probe.hash_rows[first:last])
        n, width = last - first, plen + hexed.shape[1]
        buf = np.empty((n, k, width), dtype=np.uint8)
        _glue(buf, prefix_rows, hexed[:, None, :])
        flat = buf.reshape(n * k, width)[lo - first * k : hi - first * k]
        keys: list[bytes] = flat.view(f"S{width}").ravel().tolist()
        return keys

    def _few(self, probe: GroupProbe) -> int:
        """Below this many keys, :meth:`_concatenate` beats the array path."""
        return _SPLIT_KEYS if self.layout.key_separators[probe.group_id] else _FEW_KEYS

    def _one_key(self, probe: GroupProbe, local: int) -> bytes:
        """The key at one group-local key index."""
        prefixes = self.layout.prefix_bytes[probe.group_id]
        k = len(prefixes)
        raw = probe.hash_rows
        if raw is None:
            return prefixes[local % k] + probe.hex_items[local // k]
        row: bytes = raw[local // k].tobytes()
        return prefixes[local % k] + row.hex().encode()

    def _concatenate(self, probe: GroupProbe, local: range | IntArray) -> list[bytes]:
        """``prefix@hex`` by bytes concatenation (group-local key indices, ascending): for a
        few keys, prefixes of different widths, or hashes of different widths.

        One C call hex-encodes the hashes. With one namespace it puts a separator (a byte in
        no prefix) between them; replacing each separator by itself plus the prefix and then
        splitting there makes every key in C, one object each. Otherwise each key is the
        prefix plus a slice of the hex."""
        prefixes = self.layout.prefix_bytes[probe.group_id]
        k = len(prefixes)
        raw = probe.hash_rows
        if raw is None:
            items = probe.hex_items
            return [prefixes[i % k] + items[i // k] for i in _ints(local)]
        if len(local) == 1:
            return [self._one_key(probe, int(local[0]))]
        if not len(local):
            return []
        w = 2 * raw.shape[1]
        if not w:  # empty hashes: the key is its prefix
            return [prefixes[i % k] for i in _ints(local)]
        if isinstance(local, range):
            first = local.start // k
            rows: slice | IntArray = slice(first, (local.stop - 1) // k + 1)
        else:
            first = 0
            rows = local // k if k > 1 else local
        encoded = probe.hex_if_encoded
        sep = self.layout.key_separators[probe.group_id]
        if sep is not None and encoded is None:  # (one namespace)
            prefix = prefixes[0]
            hexed = binascii.hexlify(raw[rows].data, sep, raw.shape[1])  # (C-contiguous rows)
            return (prefix + hexed.replace(sep, sep + prefix)).split(sep)
        if encoded is not None:
            text = encoded[rows].tobytes()
        else:
            text = binascii.hexlify(raw[rows].data)  # (C-contiguous rows, as above)
        if k == 1:  # one key per row of text
            prefix = prefixes[0]
            return [prefix + text[j : j + w] for j in range(0, len(text), w)]
        if isinstance(local, range):
            return [
                prefixes[i % k] + text[(i // k - first) * w : (i // k - first + 1) * w]
                for i in local
            ]
        return [
            prefixes[i % k] + text[j * w : (j + 1) * w] for j, i in enumerate(local.tolist())
        ]

    def present_keys(self, exists: Sequence[int] | npt.NDArray[Any]) -> BoolArray:
        """vLLM's rule per key: only the value ``1`` means present."""
        answers = _numeric_answers(exists)
        one_by_one = answers is None and isinstance(exists, (list, tuple))
        if answers is None:
            try:
                answers = np.asarray(exists)
            except ValueError as exc:  # ragged
                raise InvalidRequest(f"exists must hold one answer per key: {exc}") from None
        if answers.ndim != 1 or answers.shape[0] != self.num_keys:
            raise InvalidRequest(
                f"exists must have one answer per key ({self.num_keys}), got shape "
                f"{answers.shape}"
            )
        if one_by_one or answers.dtype.kind not in "biuf":
            # compare like Python (and vLLM): "1" != 1, an int subclass uses its own ==
            values = exists.tolist() if isinstance(exists, np.ndarray) else exists
            return np.fromiter((a == 1 for a in values), bool, self.num_keys)
        present: BoolArray = np.asarray(answers == 1, dtype=bool)
        return present

    def resolve(self, exists: Sequence[int] | npt.NDArray[Any]) -> int:
        """The prefix hit in tokens from the store's per-key answers (``plan.keys`` order).

        Only ``1`` means present; ``0``, ``-1``, ``-900`` or anything else means absent.
        """
        if not self.num_keys:
            return 0
        if self.single_full_attention and len(self.layout.namespaces) == 1 and not self.short:
            hit = self._resolve_prefix(exists)
            if hit is not None:
                return hit
        return self.resolve_present(self.present_keys(exists))

    @property
    def single_full_attention(self) -> bool:
        """One full-attention group: its hit is the run of present chunks from the first."""
        return self.layout.lone_full_attention and len(self._groups) == 1

    def prefix_hit(self, chunks: int) -> int:
        """The hit of a :attr:`single_full_attention` plan whose first ``chunks`` chunks are
        present and the next one (if any) absent."""
        sg = self.layout.spec_groups[0]
        block = sg.spec.block_size  # a lone spec-group aligns to its own block size
        return full_attention_prefix_hit(chunks, block, block, sg.drop_eagle)

    def _resolve_prefix(self, exists: Sequence[int] | npt.NDArray[Any]) -> int | None:
        """:meth:`resolve` for a single full-attention group in one namespace, without a
        per-key array; None when the general path must decide (odd input, or a missing hash
        that repeats)."""
        n = self.num_keys
        if isinstance(exists, (list, tuple)):
            if len(exists) != n:
                return None
            raw = _answer_bytes(exists)
            if raw is not None:  # count the leading 1s at C speed
                run = n - len(raw.lstrip(b"\x01"))
            else:
                if not _all_ints(exists):
                    return None
                run = len(list(itertools.takewhile(functools.partial(operator.eq, 1), exists)))
            miss = None if run == n else run
        else:
            answers = _numeric_answers(exists)
            if answers is None or answers.ndim != 1 or answers.shape[0] != n:
                return None
            miss = _first_false(answers == 1)
        if miss is not None:
            keys = self._keys
            repeats = (
                keys.count(keys[miss]) > 1 if keys is not None
                else self._groups[0].hash_ids is not None
            )
            if repeats:  # presence is per hash: another copy may be present
                return None
        return self.prefix_hit(n if miss is None else miss)

    def resolve_present(self, present_keys: BoolArray) -> int:
        """:meth:`resolve` from one boolean per key."""
        if not self.num_keys:
            return 0
        k = len(self.layout.namespaces)
        per_group: list[BoolArray] = []
        for probe in self._groups:
            n = probe.chunks.size
            answers = present_keys[probe.key_offset : probe.key_offset + n * k]
            probed: BoolArray = answers.reshape(n, k).all(axis=1) if k > 1 else answers  # type: ignore[assignment]
            per_group.append(_chunk_presence(probe, probed))
        return longest_hit(self.layout, self.token_len, self._merge(per_group)).hit

    def _merge(self, per_group: list[BoolArray]) -> list[BoolArray]:
        """Per spec-group presence: a chunk must be present in every member group."""
        presence: list[BoolArray] = []
        for sg in self.layout.spec_groups:
            arr = per_group[sg.group_ids[0]]
            for gid in sg.group_ids[1:]:
                arr = arr & per_group[gid]
            presence.append(arr)
        return presence

    def probing(self, rounds: bool = True) -> ProbeState:
        """Start probing this plan in rounds, or every key in one round (see
        :class:`ProbeState`)."""
        return ProbeState(self, rounds)


class ProbeState:
    """Probe a plan in rounds, sending only keys that can change the answer.

    :meth:`next_keys` runs vLLM's hit search on what is known so far, counting unknown chunks
    as present; the unknown chunks that answer rests on are probed next. Every hit rule is
    monotone, so once no answer rests on an unknown chunk the hit is exactly the one vLLM
    computes from all keys. Plans whose chunks share hashes are probed in one round, except a
    lone full-attention group (see :attr:`LookupPlan.probe_in_one_round`).

    A lone full-attention group (the common chat model) needs no search: its answer rests on
    the chunks after the known-present prefix, up to the first miss (*prefix mode*: two
    integers, the prefix and a bound). Each round probes a window of chunks after the prefix;
    a window of :data:`SCOUT_WINDOW` chunks or more also probes four *scouts*, the last chunk
    of each quarter of the next, twice as wide window. An absent scout bounds the first miss,
    so the next window stops there instead of running far past it (those keys would be
    wasted); a present scout is answered again from the coordinator's cache.
    """

    __slots__ = (
        "_all_at_once", "_answered", "_bound", "_prefix", "_present", "_scouted",
        "_scouted_run", "hit", "plan", "rounds",
    )

    def __init__(self, plan: LookupPlan, rounds: bool = True) -> None:
        self.plan = plan
        self._all_at_once = not rounds or plan.probe_in_one_round
        self.hit: int | None = None
        self.rounds = 0
        self._prefix: int | None = None
        """Prefix mode: how many chunks from 0 are known present (None: the general search)."""
        self._bound = plan.groups[0].limit if plan.groups else 0
        """Prefix mode: the first chunk known absent (else the chunk count)."""
        self._scouted: IntArray | None = None
        """Prefix mode: the last key indices with scouts handed out, whose first
        ``_scouted_run`` are the window (so that :meth:`record` need not look for the end)."""
        self._scouted_run = 0
        self._answered: tuple[BoolArray, ...] = ()  # per group (tuples: no GC tracking)
        self._present: tuple[BoolArray, ...] = ()
        if plan.single_full_attention and not self._all_at_once:
            self._prefix = 0
        else:
            self._answered = tuple(np.zeros(p.chunks.size, dtype=bool) for p in plan.groups)
            self._present = tuple(np.zeros(p.chunks.size, dtype=bool) for p in plan.groups)

    @property
    def known_prefix(self) -> int | None:
        """How many chunks from the first are known present (their keys answered present),
        or None outside the lone full-attention case (prefix mode)."""
        return self._prefix

    def next_keys(self, window: int | None = None) -> KeyIndices:
        """Key indices to probe next (ascending); empty once :attr:`hit` is set.

        ``window`` caps how many of the unknown chunks each spec-group's answer rests on are
        probed this round (the lowest first): fewer keys per round, more rounds.
        """
        plan = self.plan
        if self.hit is not None:
            return _EMPTY
        if not plan.num_keys:  # vLLM answers 0 without an RPC
            self.hit = 0
            return _EMPTY
        self.rounds += 1
        if self.rounds == 1 and self._all_at_once:
            return range(plan.num_keys)
        if self._prefix is not None:
            return self._next_prefix_keys(window)
        maybe: list[BoolArray] = []
        known: list[BoolArray] = []
        for probe, answered, present in zip(plan.groups, self._answered, self._present):
            optimistic = present | ~answered
            if probe.dense:
                maybe.append(optimistic)
                known.append(answered)
            else:
                m = np.zeros(probe.limit, dtype=bool)
                m[probe.chunks] = optimistic
                kn = np.ones(probe.limit, dtype=bool)
                kn[probe.chunks] = answered
                maybe.append(m)
                known.append(kn)
        search = longest_hit(plan.layout, plan.token_len, plan._merge(maybe), plan._merge(known))
        if search.exact:
            self.hit = search.hit
            return _EMPTY
        k = len(plan.layout.namespaces)
        wanted: list[IntArray] = []
        for sg, chunks in zip(plan.layout.spec_groups, search.depends):
            if not chunks.size:
                continue
            if window is not None:
                chunks = chunks[:window]
            for gid in sg.group_ids:
                probe = plan.groups[gid]
                pos = chunks if probe.dense else np.searchsorted(probe.chunks, chunks)
                if k == 1:
                    wanted.append(probe.key_offset + pos)
                else:
                    wanted.append(
                        probe.key_offset + (pos[:, None] * k + np.arange(k)[None, :]).ravel()
                    )
        # Groups own disjoint key ranges and positions are unique: sorting is enough.
        return wanted[0] if len(wanted) == 1 else np.sort(np.concatenate(wanted))

    def _next_prefix_keys(self, window: int | None) -> KeyIndices:
        """Prefix mode: the chunks after the known-present prefix (at most ``window``, and
        never the known-absent bound), then scouts (see the class docstring)."""
        assert self._prefix is not None
        probe = self.plan.groups[0]
        start, bound = self._prefix, self._bound
        if start >= bound:  # every chunk is present, or the next one is known absent
            self.hit = self.plan.prefix_hit(start)
            return _EMPTY
        stop = bound if window is None else min(bound, start + window)
        k = len(self.plan.layout.namespaces)
        offset = probe.key_offset
        chunks = range(offset + start * k, offset + stop * k)
        if window is None or window < SCOUT_WINDOW or stop >= bound:
            return chunks
        quarter = window // 2  # of the next window, twice as wide
        keys = list(chunks)
        for chunk in range(stop + quarter - 1, min(bound, stop + 4 * quarter), quarter):
            keys.extend(range(offset + chunk * k, offset + (chunk + 1) * k))
        self._scouted = np.array(keys, dtype=np.int64)
        self._scouted_run = len(chunks)
        return self._scouted

    def record(self, key_indices: KeyIndices, present: Sequence[object] | BoolArray) -> None:
        """Record answers (truthy = present) for ascending key indices that cover whole chunks
        (all namespaces), e.g. from :meth:`next_keys`."""
        count = len(key_indices)
        if self.hit is not None:
            return
        k = len(self.plan.layout.namespaces)
        if self.rounds == 1 and count == self.plan.num_keys:  # every key at once
            self.hit = self.plan.resolve_present(np.asarray(present, dtype=bool))
            if self._prefix is not None:  # (a repeated hash may count more: vLLM's hit does)
                miss = _first_false(present)
                self._prefix = (count if miss is None else miss) // k
            return
        if not count:
            return
        if self._prefix is not None:
            offset = self.plan.groups[0].key_offset
            first = int(key_indices[0]) - offset
            if first == self._prefix * k:
                if key_indices is self._scouted:  # our own window and scouts
                    filled = self._scouted_run
                else:
                    filled = _contiguous_run(key_indices)
                miss = _first_false(present, filled)
                if miss is not None:
                    self._prefix += miss // k
                    self.hit = self.plan.prefix_hit(self._prefix)
                    return
                self._prefix += filled // k
                if filled < count:  # scouts: the first absent one bounds the first miss
                    self._note_scouts(key_indices[filled:], present[filled:], offset, k)
                return
            self._leave_prefix_mode()
        indices = np.asarray(key_indices, dtype=np.int64)
        answers = np.asarray(present, dtype=bool)
        single = len(self.plan.groups) == 1
        for probe, answered, chunk_present in zip(self.plan.groups, self._answered, self._present):
            if single:
                lo, hi = 0, count
            else:
                lo = int(np.searchsorted(indices, probe.key_offset))
                hi = int(np.searchsorted(indices, probe.key_offset + probe.chunks.size * k))
            if hi <= lo:
                continue
            local = indices[lo:hi] - probe.key_offset
            pos = local[::k] // k
            got = answers[lo:hi].reshape(-1, k).all(axis=1) if k > 1 else answers[lo:hi]
            answered[pos] = True
            chunk_present[pos] = got

    def record_present(self, key_indices: range) -> None:
        """Record that a run of keys covering whole chunks is present (known from a cache)."""
        prefix, count = self._prefix, len(key_indices)
        k = len(self.plan.layout.namespaces)
        if (
            prefix is not None
            and self.hit is None
            and count
            and not (self.rounds == 1 and count == self.plan.num_keys)
            and key_indices.start - self.plan.groups[0].key_offset == prefix * k
        ):
            self._prefix = prefix + count // k  # what record() does here, without the scan
            return
        self.record(key_indices, np.ones(count, dtype=bool))

    def _note_scouts(
        self,
        key_indices: KeyIndices,
        present: Sequence[object] | BoolArray,
        offset: int,
        k: int,
    ) -> None:
        """Prefix mode: lower the bound to the first chunk a scout found absent."""
        miss = _first_false(present)
        if miss is not None:
            self._bound = min(self._bound, (int(key_indices[miss]) - offset) // k)

    def _leave_prefix_mode(self) -> None:
        """Answers arrived out of order: keep them in per-chunk arrays from now on."""
        assert self._prefix is not None
        size = self.plan.groups[0].chunks.size
        answered = np.zeros(size, dtype=bool)
        answered[: self._prefix] = True
        present = answered.copy()
        if self._bound < size:  # known absent
            answered[self._bound] = True
        self._answered = (answered,)
        self._present = (present,)
        self._prefix = None


def _ints(indices: KeyIndices) -> range | list[int]:
    """Key indices as Python ints (a range stays a range)."""
    return indices if isinstance(indices, range) else indices.tolist()


def _contiguous_run(indices: KeyIndices) -> int:
    """How many of the ascending ``indices``, from the first, are consecutive."""
    if isinstance(indices, range) or int(indices[-1]) - int(indices[0]) == len(indices) - 1:
        return len(indices)
    steps = np.diff(indices) != 1
    return int(steps.argmax()) + 1


def _first_false(values: Sequence[object] | BoolArray, stop: int | None = None) -> int | None:
    """Index of the first falsy value (among the first ``stop``), or None when all are
    truthy."""
    if isinstance(values, np.ndarray):
        head = values if stop is None else values[:stop]
        return None if head.all() else int(head.argmin())
    falsy = map(operator.not_, values if stop is None else itertools.islice(values, stop))
    return next(itertools.compress(itertools.count(), falsy), None)  # stops at the first


def _all_ints(values: Sequence[object]) -> bool:
    """Every value an int (bools and numpy integers included), checked at C speed."""
    try:
        array.array("q", values)  # type: ignore[type-var]  # refusing non-ints is the point
    except (TypeError, OverflowError):
        return False
    return True


def _numeric_answers(exists: object) -> npt.NDArray[Any] | None:
    """Store answers as a numeric array when they plainly are numbers (every item of a list or
    tuple an int, bools included), else None: then they are compared one by one."""
    if isinstance(exists, np.ndarray):
        return exists if exists.dtype.kind in "biuf" else None
    if isinstance(exists, (list, tuple)):
        raw = _answer_bytes(exists)
        if raw is not None:
            return np.frombuffer(raw, dtype=np.uint8)
        try:
            answers = np.frombuffer(array.array("q", exists), dtype=np.int64)
        except (TypeError, OverflowError):  # floats, strings, None, nested, huge ints
            return None
        return answers if exists.count(1) == np.count_nonzero(answers == 1) else None
    return None


def _answer_bytes(exists: list[Any] | tuple[Any, ...]) -> bytes | None:
    """The answers as one byte each when they all fit (the usual 0 and 1): the fastest
    conversion. None when they do not (negative codes, big ints, not ints).

    Converting reads each answer's integer value (``__index__``) where vLLM tests
    ``answer == 1``; they agree for ints, bools and numpy integers. Answers that count
    differently (int subclasses overriding ``==``, say) make this None, so that the caller
    compares them one by one.
    """
    try:
        raw = bytes(exists)
    except (TypeError, ValueError):
        return None
    return raw if exists.count(1) == raw.count(1) else None


def _chunk_presence(probe: GroupProbe, probed: BoolArray) -> BoolArray:
    """Presence of every chunk < limit: vLLM records presence per (group, hash bytes)."""
    if probe.hash_ids is not None:
        by_id = np.zeros(int(probe.hash_ids.max()) + 1, dtype=bool)
        np.logical_or.at(by_id, probe.hash_ids, probed)
        probed = by_id[probe.hash_ids]
    if probe.unprobed_ids is not None:
        present_ids = np.zeros(probe.chunks.size + 1, dtype=bool)
        present_ids[: probe.chunks.size] = probed
        out = present_ids[probe.unprobed_ids]  # -1 picks the trailing False
        out[probe.chunks] = probed
        return out
    if probe.dense:
        return probed
    out = np.zeros(probe.limit, dtype=bool)
    out[probe.chunks] = probed
    return out


# --------------------------------------------------------------------------------- planning
def _check_token_len(token_len: object) -> int:
    if type(token_len) is int:  # the common case, without the ABC check below
        return token_len
    if isinstance(token_len, bool) or not isinstance(token_len, numbers.Integral):
        raise InvalidRequest(f"token_len must be an int, got {token_len!r}")
    return int(token_len)


class _Hashes:
    """Uniform access to the request's hashes: a 2-D uint8 array or a sequence of bytes."""

    def __init__(self, block_hashes: object) -> None:
        self.array: npt.NDArray[np.uint8] | None = None
        self.items: Sequence[Any] | None = None
        self._duplicates: bool | None = None
        if isinstance(block_hashes, np.ndarray):
            if block_hashes.ndim != 2 or block_hashes.dtype != np.uint8:
                raise InvalidRequest(
                    "block_hashes as an array must be 2-D uint8 (one row per hash), got "
                    f"shape {block_hashes.shape} dtype {block_hashes.dtype}"
                )
            self.array = block_hashes if block_hashes.shape[1] else block_hashes[:0]
            self.count = int(self.array.shape[0])
        elif isinstance(block_hashes, (bytes, bytearray, memoryview, str)) or not isinstance(
            block_hashes, Sequence
        ):
            raise InvalidRequest(
                "block_hashes must be a sequence of bytes or a 2-D uint8 array, got "
                f"{type(block_hashes).__name__}"
            )
        else:
            self.items = block_hashes
            self.count = len(block_hashes)

    def has_duplicates(self) -> bool:
        """Whether two of the request's hashes are equal (computed once)."""
        if self._duplicates is None:
            if self.array is not None:
                self._duplicates = _duplicate_ids(self.array, []) is not None
            else:
                assert self.items is not None
                try:
                    distinct = len(set(self.items))
                except TypeError:  # unhashable bytes-likes (bytearray)
                    distinct = len({bytes(h) for h in self.items})
                self._duplicates = distinct != self.count
        return self._duplicates

    def gather(
        self, units: IntArray | slice, period: tuple[int, int] | None = None
    ) -> tuple[npt.NDArray[np.uint8] | None, list[bytes]]:
        """The hashes at ``units`` (indices, or a slice of the hashes): a (n, width) array when
        they share one width, else bytes. ``period=(m, step)`` says the ascending indices
        repeat every ``m`` with a shift of ``step`` (a sliding window's masked-in tails): a
        list is then read with ``m`` strided slices, much faster than index by index (the
        caller has checked the period)."""
        if self.array is not None:
            if isinstance(units, slice):
                return self.array[units].copy(), []  # the plan must not see later writes
            return self.array.take(units, axis=0), []
        assert self.items is not None
        items = self.items
        if isinstance(units, slice):
            if isinstance(items, (list, tuple)):  # other sequences: read index by index
                return self._joined(items[units], range(units.start, units.stop, units.step))
            units = np.arange(units.start, units.stop, units.step, dtype=np.int64)
        if units.size == 0:
            return np.zeros((0, 0), dtype=np.uint8), []
        if period is not None and isinstance(items, (list, tuple)):
            m, step = period
            stop = int(units[-1]) + 1
            slices = [items[start:stop:step] for start in units[:m].tolist()]
            rows = _interleaved_rows(slices, units.size)
            if rows is not None:
                return rows, []
            full = min(map(len, slices))  # the last period may be cut short
            picked = list(itertools.chain.from_iterable(zip(*slices)))
            picked += [part[full] for part in slices if len(part) > full]
            return self._joined(picked, units)
        picked = operator.itemgetter(*units.tolist())(items)
        return self._joined(picked if units.size > 1 else (picked,), units)

    @staticmethod
    def _joined(
        items: Sequence[Any], units: IntArray | range
    ) -> tuple[npt.NDArray[np.uint8] | None, list[bytes]]:
        """``items`` (the hashes at ``units``) as one (n, width) array when they share one
        width, else as bytes."""
        if not items:
            return np.zeros((0, 0), dtype=np.uint8), []
        try:
            joined = b"".join(items)
        except TypeError:
            for pos, item in zip(units, items):
                if not isinstance(item, (bytes, bytearray, memoryview)):
                    raise InvalidRequest(
                        f"block_hashes[{pos}] must be bytes, got {type(item).__name__}"
                    ) from None
            raise
        n, width = len(items), len(joined) // len(items)
        if len(joined) == n * width and list(map(len, items)).count(width) == n:  # one width
            return np.frombuffer(joined, dtype=np.uint8).reshape(n, width), []
        return None, [bytes(item) for item in items]


def _interleaved_rows(
    slices: Sequence[Sequence[Any]], count: int
) -> npt.NDArray[np.uint8] | None:
    """The first ``count`` hashes taken in turn from ``slices`` (one per offset of a period,
    the longest first), as a (count, width) array; None unless every item is bytes-like with
    one length (the caller's general path then sorts out mixed widths and errors).

    Each slice is joined on its own and written into its column of a (periods, m, width)
    array: no Python-level interleaving. Every item's width is checked, since a join's length
    alone cannot tell one width from a mix."""
    out: npt.NDArray[np.uint8] | None = None
    width = 0
    for j, part in enumerate(slices):
        n = len(part)
        try:
            joined = b"".join(part)
        except TypeError:
            return None
        if out is None:
            width = len(joined) // n
            out = np.empty((n, len(slices), width), dtype=np.uint8)
        if len(joined) != n * width or list(map(len, part)).count(width) != n:
            return None
        out[:n, j] = np.frombuffer(joined, dtype=np.uint8).reshape(n, width)
    assert out is not None
    return out.reshape(out.shape[0] * out.shape[1], width)[:count]  # (width may be 0)


@dataclass(frozen=True, slots=True, eq=False)
class _ProbeTarget:
    """Which hashes one group probes, for one request length and chunk limits.

    ``units`` are the hash indices of the probed ``chunks`` (a slice when every chunk is
    probed); ``period=(m, step)`` when they repeat every ``m`` with a shift of ``step``. When
    another group probes every one of these hashes too, ``source`` names it and
    ``positions`` are these hashes' rows among its own: one read of the request serves both.
    """

    chunks: IntArray
    units: IntArray | slice
    period: tuple[int, int] | None
    source: int | None = None
    positions: IntArray | None = None

    @property
    def nbytes(self) -> int:
        """Memory held by its arrays."""
        size = self.chunks.nbytes + (self.positions.nbytes if self.positions is not None else 0)
        return size + (self.units.nbytes if isinstance(self.units, np.ndarray) else 0)


def _probe_targets(
    layout: KVLayout, token_len: int, limits: tuple[int, ...]
) -> tuple[_ProbeTarget, ...]:
    """Every group's :class:`_ProbeTarget` (cached per layout: request lengths repeat)."""
    cache = layout.probe_cache
    key = (token_len, limits)
    targets = cache.get(key)
    if targets is None:
        targets = _plan_targets(layout, token_len, limits)
        size = sum(t.nbytes for t in targets)
        while cache and (
            len(cache) >= _PROBE_CACHE_ENTRIES
            or layout.probe_cache_bytes + size > _PROBE_CACHE_BYTES
        ):
            oldest = cache.pop(next(iter(cache)))
            layout.probe_cache_bytes -= sum(t.nbytes for t in oldest)
        if size <= _PROBE_CACHE_BYTES:
            cache[key] = targets
            layout.probe_cache_bytes += size
    return targets


_PROBE_CACHE_ENTRIES = 256
_PROBE_CACHE_BYTES = 64 << 20
"""Bounds on a layout's cache of probe targets (oldest entries go first): request lengths
repeat, but one entry of a 1M-token DeepSeek-V4-like request holds about 1.4 MB."""


def _plan_targets(
    layout: KVLayout, token_len: int, limits: tuple[int, ...]
) -> tuple[_ProbeTarget, ...]:
    """:func:`_probe_targets`, computed: the masks, then which groups' hashes are a subset of
    another group's (a sliding window's tails often include the full-attention hashes)."""
    h = layout.hash_block_size
    own: list[_ProbeTarget] = []
    every: list[IntArray] = []
    for gid, (spec, limit) in enumerate(zip(layout.groups, limits)):
        stride = spec.block_size // h
        chunks = _masked_chunks(layout, gid, limit, token_len)
        chunks.flags.writeable = False
        units = chunks * stride + (stride - 1)
        every.append(units)
        if chunks.size == limit:  # dense: every stride-th hash, sliced
            own.append(_ProbeTarget(chunks, slice(stride - 1, limit * stride, stride), None))
            continue
        period = None  # a sliding window's tails: the same offsets in every scheduler block
        if chunks.size:
            segment = _chunks_per_segment(layout, gid)
            m = int(np.searchsorted(chunks, chunks[0] + segment))
            if units.size > m and (units[m:] - units[:-m] == segment * stride).all():
                period = (m, segment * stride)
        own.append(_ProbeTarget(chunks, units, period))
    targets = list(own)
    sources: list[int] = []  # groups read on their own, largest first
    for gid in sorted(range(len(own)), key=lambda g: -every[g].size):
        units = every[gid]
        for src in sources:
            pos = np.searchsorted(every[src], units)
            if units.size and (pos < every[src].size).all() and (every[src][pos] == units).all():
                pos.flags.writeable = False
                mine = own[gid]  # (its own reading stays, for a source of mixed widths)
                targets[gid] = _ProbeTarget(mine.chunks, mine.units, mine.period, src, pos)
                break
        else:
            sources.append(gid)
    return tuple(targets)


def _chunks_per_segment(layout: KVLayout, gid: int) -> int:
    """Chunks of group ``gid`` per scheduler block (the period of a sliding window's mask)."""
    return max(1, layout.scheduler_block_size // layout.groups[gid].block_size)


def _masked_chunks(layout: KVLayout, gid: int, limit: int, token_len: int) -> IntArray:
    """Chunk indices a group probes: all of them, or a sliding window's masked-in tails."""
    spec = layout.groups[gid]
    if not isinstance(spec, SlidingWindow):
        return np.arange(limit, dtype=np.int64)
    eagle = layout.use_eagle
    need = window_blocks(spec, eagle)
    per_segment = layout.scheduler_block_size // spec.block_size
    if need >= per_segment:
        return np.arange(limit, dtype=np.int64)
    shift = 1 if eagle else 0
    # mask[i] = i >= shift and (i - shift) % per_segment >= per_segment - need
    limit = min(limit, token_len // spec.block_size)
    offsets = np.arange(per_segment - need, per_segment, dtype=np.int64) + shift
    segments = np.arange(0, limit + per_segment, per_segment, dtype=np.int64)
    chunks = (segments[:, None] + offsets[None, :]).ravel()
    return chunks[chunks < limit]


def _glue(
    out: npt.NDArray[np.uint8], prefixes: npt.NDArray[np.uint8], hexed: npt.NDArray[np.uint8]
) -> None:
    """``out[..., :plen] = prefixes`` and ``out[..., plen:] = hexed`` (broadcast), each prefix
    and each hex copied as one void item: numpy then moves whole byte strings (a memcpy
    each) instead of running a byte-wide loop per row: about 15 % faster on large plans."""
    plen, width = prefixes.shape[-1], out.shape[-1]
    if plen in (0, width):  # nothing to split into two fields
        out[..., :plen] = prefixes
        out[..., plen:] = hexed
        return
    records = out.view(_key_fields(plen, width))[..., 0]
    records["p"] = prefixes.view(f"V{plen}")[..., 0]
    records["h"] = hexed.view(f"V{width - plen}")[..., 0]


@functools.lru_cache(maxsize=64)
def _key_fields(plen: int, width: int) -> np.dtype[np.void]:
    """A key row as two void fields: the prefix, then the hex."""
    return np.dtype(
        {"names": ["p", "h"], "formats": [f"V{plen}", f"V{width - plen}"],
         "offsets": [0, plen], "itemsize": width}
    )


def _hex_rows(rows: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Lower-case hex of each row, as a (n, 2 * width) uint8 array of ASCII: a read-only view
    whose rows sit ``2 * width + 1`` bytes apart (a plain array when there is nothing to
    encode)."""
    n, width = rows.shape
    if not n or not width:
        return np.zeros((n, 2 * width), dtype=np.uint8)
    # hexlify reads the array's buffer directly: a tobytes() copy would double the memory
    # traffic (and, at large sizes, the page faults). (A 65,536-entry table of hex digit
    # quads beat it only while the table sat in cache, never in the benchmarks.) A separator
    # after every row costs one byte per row but sends CPython 3.11's hexlify down its
    # grouped loop, about 25 % faster than the plain one on large inputs.
    text = binascii.hexlify(np.ascontiguousarray(rows).data, b"-", width)
    hexed: npt.NDArray[np.uint8] = np.ndarray(
        (n, 2 * width), dtype=np.uint8, buffer=text, strides=(2 * width + 1, 1)
    )
    return hexed


def _duplicate_ids(rows: npt.NDArray[np.uint8] | None, items: list[bytes]) -> IntArray | None:
    """Ids that are equal exactly where hashes are equal, or None when all differ."""
    if rows is not None:
        n, width = rows.shape
        if n < 2:
            return None
        if width <= 8:
            padded = np.zeros((n, 8), dtype=np.uint8)
            padded[:, :width] = rows
            fingerprint = padded.view(np.uint64).ravel()
        elif width % 8 == 0 and rows.flags.c_contiguous:  # each row's first 8 bytes, no copy
            fingerprint = rows.view(np.uint64)[:, 0]
        else:
            fingerprint = np.ascontiguousarray(rows[:, :8]).view(np.uint64).ravel()
        ordered = np.sort(fingerprint)  # a sorted copy
        if not (ordered[1:] == ordered[:-1]).any():
            return None
        items = [bytes(r) for r in rows]
    if len(set(items)) == len(items):
        return None
    first: dict[bytes, int] = {}
    return np.array([first.setdefault(h, i) for i, h in enumerate(items)], dtype=np.int64)


_NOT_READ: tuple[npt.NDArray[np.uint8] | None, list[bytes]] = (None, [])
"""Placeholder in build_plan for a group whose rows come from another group's."""


def build_plan(layout: KVLayout, token_len: object, block_hashes: object) -> LookupPlan:
    """Validate one request and build its :class:`LookupPlan` (see :meth:`KVLayout.plan`)."""
    tokens = _check_token_len(token_len)
    hashes = _Hashes(block_hashes)
    if tokens <= 0 or hashes.count == 0:
        return LookupPlan(layout, tokens, (), 0)
    sched = layout.scheduler_block_size
    if tokens % sched:
        raise InvalidRequest(
            f"token_len={tokens} must be a multiple of scheduler_block_size={sched} "
            "(use layout.align(num_tokens))"
        )
    h = layout.hash_block_size
    if not layout.has_full_attention and hashes.count < tokens // h:
        raise InvalidRequest(
            f"block_hashes has {hashes.count} hashes but token_len={tokens} needs "
            f"{tokens // h} (hash_block_size={h}) for a layout without full attention"
        )
    probes: list[GroupProbe] = []
    offset = 0
    # Where the hit search may read a chunk the mask left unprobed (a lone spec-group aligns to
    # its own block; EAGLE groups re-run without their drop on a second pass), an unprobed
    # chunk whose hash equals a probed one counts as that one (vLLM keys presence by hash).
    reads_unprobed = len(layout.spec_groups) == 1 or (layout.use_eagle and layout.multi_pass)
    count = hashes.count
    short = False
    bounds = []  # per group: how many chunks exist for this request
    for block in layout.block_sizes:  # (loops, not comprehensions: this runs per lookup)
        limit = min(count // (block // h), tokens // block)
        short = short or limit < tokens // block
        bounds.append(limit)
    limits = tuple(bounds)
    targets = _probe_targets(layout, tokens, limits)
    # Groups read on their own first; then those whose hashes are all among a source's rows.
    gathered = []
    subsets = False
    for target in targets:
        if target.source is None:
            gathered.append(hashes.gather(target.units, target.period))
        else:
            gathered.append(_NOT_READ)
            subsets = True
    if subsets:
        for gid, target in enumerate(targets):
            if target.source is not None:
                source_rows = gathered[target.source][0]
                if source_rows is not None:  # (a source of mixed widths: read on its own)
                    assert target.positions is not None
                    gathered[gid] = source_rows.take(target.positions, axis=0), []
                else:
                    gathered[gid] = hashes.gather(target.units, target.period)
    for gid, (spec, limit, target) in enumerate(zip(layout.groups, limits, targets)):
        stride = spec.block_size // h
        chunks = target.chunks
        rows, items = gathered[gid]
        unprobed_ids = None
        if reads_unprobed and 0 < chunks.size < limit and hashes.has_duplicates():
            unprobed_ids = _unprobed_ids(hashes, stride, limit, chunks, rows, items)
        probes.append(
            GroupProbe(
                group_id=gid,
                chunks=chunks,
                limit=limit,
                key_offset=offset,
                hex_items=[it.hex().encode() for it in items] if items else [],
                hash_rows=rows,
                unprobed_ids=unprobed_ids,
            )
        )
        offset += chunks.size * len(layout.namespaces)
    if subsets:  # rows taken from a source's: its verdict on repeated hashes holds for them
        for gid, target in enumerate(targets):
            if target.source is not None and gathered[target.source][0] is not None:
                probes[gid].subset_of = probes[target.source]
    if offset and layout.has_chunked_local:
        _check_supported(layout)
    return LookupPlan(layout, tokens, tuple(probes), offset, short)


def _check_supported(layout: KVLayout) -> None:
    """vLLM 0.26 asserts on these when a lookup reaches the chunked-local manager."""
    for i, spec in enumerate(layout.groups):
        if not isinstance(spec, ChunkedLocalAttention):
            continue
        if layout.use_eagle:
            raise InvalidRequest(
                f"groups[{i}] is chunked_local and use_eagle is set: vLLM 0.26 asserts "
                "chunked local attention has no EAGLE"
            )
        if len(layout.spec_groups) > 1 and spec.block_size != layout.scheduler_block_size:
            raise InvalidRequest(
                f"groups[{i}] is chunked_local with block_size={spec.block_size} in a hybrid "
                f"layout: vLLM 0.26 asserts it equals scheduler_block_size="
                f"{layout.scheduler_block_size}"
            )


def _unprobed_ids(
    hashes: _Hashes,
    stride: int,
    limit: int,
    probed_chunks: IntArray,
    rows: npt.NDArray[np.uint8] | None,
    items: list[bytes],
) -> IntArray | None:
    """For every chunk < limit: the index of a probed chunk with the same hash, else -1."""
    probed = [bytes(r) for r in rows] if rows is not None else items
    index: dict[bytes, int] = {}
    for j, hsh in enumerate(probed):
        index.setdefault(hsh, j)
    all_units = np.arange(limit, dtype=np.int64) * stride + (stride - 1)
    every_rows, every_items = hashes.gather(all_units)
    every = [bytes(r) for r in every_rows] if every_rows is not None else every_items
    ids = np.array([index.get(hsh, -1) for hsh in every], dtype=np.int64)
    ids[probed_chunks] = -1
    return ids if (ids >= 0).any() else None
