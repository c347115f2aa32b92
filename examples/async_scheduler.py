"""An async scheduler that asks aio-mclookup how much of each prompt is already cached.

Run it from the repository root (``bash run.sh setup`` first installs the package and the
Mooncake wheel into ``.venv``)::

    .venv/bin/python examples/async_scheduler.py

What it does, everything on 127.0.0.1 and in a few seconds:

1. starts a throw-away Mooncake master (``LocalMaster``);
2. plays the vLLM workers: a ``StoreWriter`` stores the KV-cache keys of a few prompts that were
   already served, built the way the workers build them (``layout.plan(len, hashes).keys``);
3. opens the lookup side once, at start-up: a ``MooncakeStore`` and a ``LookupCoordinator``;
4. runs a scheduler loop: requests (``num_tokens`` and the prompt's chained block hashes) arrive
   on a queue; each is looked up concurrently with the others with
   ``coordinator.lookup(num_tokens, hashes)``: vLLM's scheduler's count for the request;
5. prints each request's hit and the coordinator's stats, checks every hit against vLLM's own
   way (all keys of one request in one ``batch_is_exist``, then ``plan.resolve``), and ends with
   a machine-checkable line ``hits: [...]``.

The layout names vLLM 0.26, whose scheduler aligns the length, looks up and leaves one token to
compute itself (``coordinator.lookup`` does all three on 0.26, and on 0.32+ what those releases
do; the check in step 5 does them by hand). It is
DeepSeek-V4-like: full attention with 256-token blocks plus three sliding-window
groups, 4-token hash blocks, 256-token scheduler blocks, TP 4 with MLA (one KV head, so every TP
rank writes the same ``tp_rank:0`` keys and there is one key namespace).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import struct
import sys
import time
from dataclasses import dataclass

import aio_mclookup as mcl

LAYOUT = mcl.KVLayout.from_dict(
    {
        "model": "deepseek-ai/DeepSeek-V4-Pro",
        "hash_block_size": 4,
        "scheduler_block_size": 256,
        "tp_size": 4,
        "num_kv_heads": 1,
        "vllm_version": "0.26",
        "groups": [
            {"kind": "full_attention", "block_size": 256},
            {"kind": "sliding_window", "block_size": 64, "sliding_window": 128},
            {"kind": "sliding_window", "block_size": 4, "sliding_window": 8},
            {"kind": "sliding_window", "block_size": 8, "sliding_window": 128},
        ],
    }
)

# What each request below must get, after leave_one_token (see the comments in REQUESTS).
EXPECTED_HITS = [3584, 2560, 1280, 1024, 0, 0, 3584, 1792, 3584, 1280, 2304]


# ------------------------------------------------------------------------------ prompts
def tokens(seed: str, n: int) -> list[int]:
    """``n`` deterministic token ids."""
    rng = random.Random(seed)
    return [rng.randrange(1, 151_000) for _ in range(n)]


def block_hashes(prompt: list[int], h: int = LAYOUT.hash_block_size) -> list[bytes]:
    """Chained block hashes, one per complete ``h``-token block, like vLLM's
    ``request.block_hashes``: hash i covers the parent hash and block i's token ids."""
    out: list[bytes] = []
    parent = b"\0" * 32  # vLLM's NONE_HASH stands here; it only has to match the writer's
    for start in range(0, len(prompt) - h + 1, h):
        block = struct.pack(f"<{h}I", *prompt[start : start + h])
        parent = hashlib.sha256(parent + block).digest()
        out.append(parent)
    return out


SYSTEM = tokens("system prompt", 1100)
DOC_A = SYSTEM + tokens("conversation A", 2500)  # 3,600 tokens, served and stored
DOC_B = tokens("another system prompt", 1024)  # 1,024 tokens, served and stored
DOC_C = tokens("conversation C", 2100)  # 2,100 tokens, stored, then partly evicted


@dataclass
class Request:
    name: str
    prompt: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt)


REQUESTS_STEP_1 = [
    # A follow-up turn of A: A's stored prefix (3,584 = align(3,600)) is found.
    Request("A follow-up", DOC_A + tokens("turn A2", 500)),
    # Exactly A's first 2,816 tokens: all cached, but vLLM computes at least one token,
    # so the hit drops to the previous scheduler block (2,560).
    Request("A prefix, 2816", DOC_A[:2816]),
    # Shares the system prompt and 300 more tokens of A (1,400), then diverges: the last
    # scheduler-block boundary inside the shared part is 1,280.
    Request("A branch", DOC_A[:1400] + tokens("branch", 900)),
    # B plus a new user message: B's 1,024 tokens are found.
    Request("B follow-up", DOC_B + tokens("turn B2", 100)),
    # Nothing of this prompt was ever stored.
    Request("cold", tokens("cold prompt", 1500)),
    # Shorter than one scheduler block: vLLM skips the lookup (align() gives 0).
    Request("short", tokens("short prompt", 200)),
    # Another follow-up of A arriving in the same step: it shares A's keys with the first one
    # (deduplicated into the same RPCs).
    Request("A follow-up 2", DOC_A + tokens("turn A2'", 700)),
    # C's full-attention blocks are all cached up to 2,048, but the 4-token sliding-window group
    # lost the window of its last segment: a hit at 2,048 needs it, so the hit is 1,792.
    Request("C follow-up", DOC_C + tokens("turn C2", 300)),
]
REQUESTS_STEP_2 = [
    # The next scheduler step: the same prefixes again, answered partly from the coordinator's
    # short-lived cache of positive answers.
    Request("A follow-up 3", DOC_A + tokens("turn A3", 400)),
    Request("A branch 2", DOC_A[:1400] + tokens("branch 2", 600)),
    # Shorter than A's stored prefix and a multiple of 256: all cached, so leave_one_token
    # applies (2,560 -> 2,304).
    Request("A prefix, 2560", DOC_A[:2560]),
]


# ------------------------------------------------------------------------------ the cache
async def fill_cache(writer: mcl.StoreWriter) -> int:
    """Store what vLLM's workers would have stored for the prompts served before."""
    written = 0
    for prompt in (DOC_A, DOC_B):
        plan = LAYOUT.plan(LAYOUT.align(len(prompt)), block_hashes(prompt))
        written += await writer.put_keys(k.decode() for k in plan.keys)
    # C: every key except the 4-token sliding window (group 2) of its last 256-token segment.
    hashes = block_hashes(DOC_C)
    token_len = LAYOUT.align(len(DOC_C))
    keys = LAYOUT.plan(token_len, hashes).keys
    earlier = set(LAYOUT.plan(token_len - LAYOUT.scheduler_block_size, hashes).keys)
    evicted = {k for k in keys if k not in earlier and b"@group:2@" in k}
    written += await writer.put_keys(k.decode() for k in keys if k not in evicted)
    return written


# ------------------------------------------------------------------------------ scheduler
async def schedule(
    coordinator: mcl.LookupCoordinator, request: Request
) -> tuple[Request, int, int]:
    """What vLLM's scheduler counts as cached for one waiting request (and, to print, the
    aligned length vLLM 0.26 looks up)."""
    hit = await coordinator.lookup(request.num_tokens, block_hashes(request.prompt))
    return request, LAYOUT.align(request.num_tokens), hit


async def scheduler_loop(
    coordinator: mcl.LookupCoordinator, queue: asyncio.Queue[list[Request] | None]
) -> list[int]:
    """Take one step's requests at a time and look them all up concurrently."""
    hits: list[int] = []
    step = 0
    while (batch := await queue.get()) is not None:
        step += 1
        started = time.perf_counter()
        results = await asyncio.gather(*(schedule(coordinator, r) for r in batch))
        elapsed_ms = (time.perf_counter() - started) * 1000
        print(f"step {step}: {len(batch)} requests in {elapsed_ms:.1f} ms")
        for request, token_len, hit in results:
            print(
                f"  {request.name:<16} num_tokens={request.num_tokens:>5} "
                f"token_len={token_len:>5} cached={hit:>5}"
            )
            hits.append(hit)
    return hits


async def check_like_vllm(store: mcl.MooncakeStore, requests: list[Request]) -> list[int]:
    """vLLM 0.26's way, one request at a time: every planned key, then resolve."""
    hits = []
    for request in requests:
        token_len = LAYOUT.align(request.num_tokens)
        plan = LAYOUT.plan(token_len, block_hashes(request.prompt))
        answers: list[int] = []
        for start in range(0, plan.num_keys, 1000):
            answers += await store.batch_is_exist(plan.keys[start : start + 1000])
        hits.append(LAYOUT.leave_one_token(plan.resolve(answers), request.num_tokens))
    return hits


async def main() -> int:
    t0 = time.perf_counter()
    async with mcl.LocalMaster() as master:
        print(f"master: {master.master_address}, metadata: {master.metadata_server}")
        async with mcl.StoreWriter(master.master_address, master.metadata_server) as writer:
            print(f"writer: stored {await fill_cache(writer)} keys")
            # Open once at start-up (setup() and close() hold the GIL), not per request.
            async with (
                mcl.MooncakeStore(master.master_address, master.metadata_server) as store,
                mcl.LookupCoordinator(LAYOUT, store, timeout=5.0) as coordinator,
            ):
                queue: asyncio.Queue[list[Request] | None] = asyncio.Queue()
                loop_task = asyncio.create_task(scheduler_loop(coordinator, queue))
                for step in (REQUESTS_STEP_1, REQUESTS_STEP_2):
                    await queue.put(step)
                await queue.put(None)
                hits = await loop_task
                stats = coordinator.stats()
                looked_up = stats.lookups_total
                print(
                    f"coordinator: {looked_up} lookups in {stats.rpcs_total} RPCs "
                    f"({stats.dispatches_total} dispatches, {stats.rounds_total} probe rounds); "
                    f"keys sent {stats.keys_sent_total} of {stats.keys_planned_total} planned "
                    f"(dedup {stats.dedup_hits_total}, cache {stats.cache_hits_total}); "
                    f"hit tokens {stats.hit_tokens_total} of {stats.requested_tokens_total}"
                )
                want = await check_like_vllm(store, REQUESTS_STEP_1 + REQUESTS_STEP_2)
    print(f"vLLM check: {'ok' if want == hits else f'MISMATCH, vLLM gives {want}'}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    print(f"hits: {hits}")
    return 0 if want == hits == EXPECTED_HITS else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
