"""The baselines: seed-naive, vLLM's own per-request way (its key loop and hit search, from the
literal ports in ``_reference``, plus one ``batch_is_exist`` per request through the loop's
default executor, as Mooncake's own async wrapper does; for SGLang, one ``batch_exists`` per
querying rank and request, :func:`sglang_naive_lookup`), and per-request, the same with this
project's planning (what a user who skips the coordinator gets)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .._errors import StoreError
from .._hashing import BlockHasher
from .._layout.layout import KVLayout
from .._layout.sglang import SGLangLayout
from .._store.codes import failed_rpc_code
from .._store.logs import quiet_settings, setup_output
from .._store.pool import client_config, client_env
from .results import RunResult
from .workload import PageHasher, Request

__all__ = ["Lookup", "RawClient", "naive_lookup", "per_request_lookup", "sglang_naive_lookup"]

class RawClient:
    """A plain ``MooncakeDistributedStore`` used exactly as Mooncake's async wrapper uses it:
    ``await loop.run_in_executor(None, client.batch_is_exist, keys)``."""

    def __init__(self, master: str, metadata: str, local_hostname: str) -> None:
        self.config = client_config(master, metadata, local_hostname)
        self.client: Any = None

    def open_blocking(self) -> None:
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", str(self.config["local_hostname"]))
        quiet = quiet_settings()  # (the library's own logging policy: docs/mooncake.md)
        with client_env(quiet), setup_output(bool(quiet)):
            from mooncake.store import MooncakeDistributedStore

            client = MooncakeDistributedStore()
            rc = client.setup(dict(self.config))
        if rc != 0:
            with contextlib.suppress(Exception):
                client.close()
            raise StoreError(f"Mooncake setup() for the seed-naive client returned {rc}", rc)
        self.client = client

    def close_blocking(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()


Lookup = Callable[[Request], Awaitable[int]]


def naive_lookup(
    layout: KVLayout | SGLangLayout,
    raw: RawClient,
    result: RunResult,
    hasher: BlockHasher | PageHasher | None = None,
) -> Lookup:
    """vLLM's per-request lookup, as its scheduler counts it: build the keys with the layout's
    release's own loop, one executor-hopped RPC, resolve (0.26: for the aligned length, then
    leave one token; 0.32+: for ``num_tokens``, the worker re-deriving a full hit). For an
    :class:`SGLangLayout`, :func:`sglang_naive_lookup`.

    With ``hasher`` (a token-id workload) it first hashes the request's token ids, as the
    coordinator's runs do (timed into ``result.hash_times``), then takes the rows as
    ``list[bytes]``, the form vLLM's loop reads."""
    if isinstance(layout, SGLangLayout):
        assert hasher is None or isinstance(hasher, PageHasher)
        return sglang_naive_lookup(layout, raw, result, hasher)
    assert hasher is None or isinstance(hasher, BlockHasher)
    from .._reference.v026 import BaselineLookup
    from .._reference.v033 import BaselineLookupV033

    clock = time.perf_counter

    def hash_list(req: Request) -> list[bytes]:
        if hasher is None:
            return req.hash_list
        assert req.token_ids is not None
        started = clock()
        rows = hasher.hash(req.token_ids)
        result.hash_times.append(clock() - started)
        blob = rows.tobytes()
        width = rows.shape[1]
        return [blob[i : i + width] for i in range(0, len(blob), width)]

    answers_for = _one_rpc(raw, result)

    if layout.vllm_version == "0.26.0":
        baseline = BaselineLookup(layout.to_dict())

        async def lookup(req: Request) -> int:
            hashes = hash_list(req)
            keys, meta = baseline.build_keys(req.token_len, hashes)
            if not keys:
                return 0
            answers = await answers_for(keys)
            hit = baseline.resolve(req.token_len, hashes, meta, answers)
            return layout.leave_one_token(hit, req.num_tokens)

        return lookup
    baseline_033 = BaselineLookupV033(layout.to_dict())

    async def lookup_033(req: Request) -> int:
        hashes = hash_list(req)
        keys, meta = baseline_033.build_keys(req.num_tokens, hashes)
        if not keys:
            return 0
        answers = await answers_for(keys)
        return baseline_033.resolve(req.num_tokens, hashes, meta, answers).hit_length

    return lookup_033


def sglang_naive_lookup(
    layout: SGLangLayout, raw: RawClient, result: RunResult, hasher: PageHasher | None = None
) -> Lookup:
    """SGLang's own per-request way (bench_sglang's seed-naive): every querying rank sends one
    ``batch_is_exist`` of its own keys of the request's probed pages (each rank's prefetch
    thread; here concurrent on the loop's default executor, as the ranks' processes would be),
    and the hit is each rank's first page with a missing key, the minimum over ranks, under
    the cap and threshold (``plan.resolve`` of the ranks' answers put together). One RPC per
    rank per request; ``keys_sent`` counts every rank's keys (MLA ranks of a stage each ask for
    the stage's one key).

    With ``hasher`` it first hashes the request's token ids (``layout.page_hashes``, timed into
    ``result.hash_times``); else it takes the request's page hashes as ``list[bytes]``."""
    client = raw.client
    loop = asyncio.get_running_loop()
    slots = [mine for _, mine in layout.rank_slots]
    per_page = layout.keys_per_page
    clock = time.perf_counter

    async def rank_rpc(keys: list[bytes]) -> list[int]:
        answers: list[int] = await loop.run_in_executor(None, client.batch_is_exist, keys)
        code = failed_rpc_code(answers)
        if code is not None:
            raise StoreError(f"batch_is_exist failed with code {code}", code=code)
        return answers

    async def lookup(req: Request) -> int:
        if hasher is None:
            hashes = req.hash_list
        else:
            started = clock()
            hashes = hasher.hash(req.token_ids)
            result.hash_times.append(clock() - started)
        plan = layout.plan(req.num_tokens, hashes)
        keys = plan.keys
        if not keys:
            return 0
        per_rank = [[keys[p * per_page + j] for p in range(plan.pages) for j in mine]
                    for mine in slots]
        sent = sum(map(len, per_rank))
        result.keys_planned += sent
        result.keys_sent += sent
        result.rpcs += len(per_rank)
        result.rounds += 1
        replies = await asyncio.gather(*(rank_rpc(rank_keys) for rank_keys in per_rank))
        answers = [0] * len(keys)
        for mine, reply in zip(slots, replies):
            for at, answer in enumerate(reply):
                answers[(at // len(mine)) * per_page + mine[at % len(mine)]] = answer
        return plan.resolve(answers)

    return lookup


def per_request_lookup(layout: KVLayout, raw: RawClient, result: RunResult) -> Lookup:
    """One request at a time with this project's planning: ``layout.plan``, one
    executor-hopped ``batch_is_exist`` of all its keys, ``plan.resolve_result``; the
    scheduler's count as :func:`naive_lookup` gives it."""
    answers_for = _one_rpc(raw, result)
    legacy = layout.vllm_version == "0.26.0"

    async def lookup(req: Request) -> int:
        plan = layout.plan(req.token_len if legacy else req.num_tokens, req.hashes)
        keys = plan.keys
        if not keys:
            return 0
        hit = plan.resolve_result(await answers_for(keys)).hit_length
        return layout.leave_one_token(hit, req.num_tokens) if legacy else hit

    return lookup


def _one_rpc(
    raw: RawClient, result: RunResult
) -> Callable[[Sequence[str] | Sequence[bytes]], Awaitable[list[int]]]:
    """A baseline's RPC: every key of one request in one executor-hopped
    ``batch_is_exist``, counted into ``result``; a failed RPC raised."""
    client = raw.client
    loop = asyncio.get_running_loop()

    async def answers_for(keys: Sequence[str] | Sequence[bytes]) -> list[int]:
        result.keys_planned += len(keys)
        result.rpcs += 1
        result.rounds += 1
        result.keys_sent += len(keys)
        answers: list[int] = await loop.run_in_executor(None, client.batch_is_exist, keys)
        code = failed_rpc_code(answers)
        if code is not None:
            raise StoreError(f"batch_is_exist failed with code {code}", code=code)
        return answers

    return answers_for
