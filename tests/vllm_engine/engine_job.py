"""One real vLLM engine (CPU, a tiny dummy model, the Mooncake store connector), driven by a
JSON job; run with the vLLM environment's Python. Prints one JSON line of results.

Job: ``{"module": "recording_stock" | "recording_ours", "kv_role": "kv_both" | "kv_consumer",
"model_dir": ..., "phases": [{"name": ..., "lookup_async": bool, "max_tokens": int,
"prompts": [{"tokens": [...], "cache_salt": str | null}]}]}``. Each phase starts with an
empty local prefix cache and submits all its prompts at once (greedy decoding). Per phase it
reports, per prompt, the lookup results the scheduler's client returned, the output token ids,
the scheduler's time in lookups, lookup submissions and steps.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _reset_prefix_cache(llm: Any) -> None:
    """Empty the local prefix cache (vLLM refuses while a save is pending: step and retry)."""
    from vllm import SamplingParams

    for _ in range(200):
        if llm.reset_prefix_cache():
            return
        llm.generate([{"prompt_token_ids": [1]}], SamplingParams(max_tokens=1), use_tqdm=False)
        time.sleep(0.05)
    raise RuntimeError("reset_prefix_cache() kept returning False")


def _wait_for_saves(llm: Any, connector: Any) -> None:
    """Step the engine until the scheduler holds no save still pending on a worker (saves run
    on the workers' send threads; exiting earlier would lose them)."""
    from vllm import SamplingParams

    for _ in range(400):
        if not connector.has_pending_push_work():
            return
        llm.generate([{"prompt_token_ids": [1]}], SamplingParams(max_tokens=1), use_tqdm=False)
        time.sleep(0.05)
    raise RuntimeError("saves still pending after 20 s")


def _sidecars() -> list[int]:
    """The live child processes of this one that are aio-mclookup sidecars."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                parent = int(file.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                command = file.read()
        except OSError:
            continue
        if parent == os.getpid() and b"aio_mclookup._scheduler.sidecar" in command:
            out.append(int(entry))
    return out


def main() -> None:
    job = json.loads(sys.stdin.read())
    import recording
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["model_dir"],
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=2048,
        block_size=32,
        enable_prefix_caching=True,
        max_num_seqs=job.get("max_num_seqs", 256),
        seed=0,
        kv_transfer_config={
            "kv_connector": "MooncakeStoreConnector",
            "kv_connector_module_path": job["module"],
            "kv_role": job["kv_role"],
            "kv_connector_extra_config": {
                "lookup_async": bool(job["phases"][0]["lookup_async"]),  # (each phase sets it)
                **job.get("extra", {}),
            },
        },
    )
    connector = recording.SCHEDULERS[-1]
    client = getattr(connector, "lookup_client", None)
    report: dict[str, Any] = {
        "coalescing": client is not None,
        "layout": client.layout.to_dict() if client is not None else None,
        "phases": [],
    }
    for phase in job["phases"]:
        _reset_prefix_cache(llm)
        connector.connector_scheduler.lookup_async = bool(phase["lookup_async"])
        connector.results.clear()
        connector.lookup_seconds, connector.lookup_calls, connector.steps = 0.0, 0, 0
        connector.meta_seconds = 0.0
        connector.idle_seconds = connector.lookup_cpu_seconds = connector.flush_seconds = 0.0
        connector.submitted = 0
        connector.last_answer_step = 0
        prompts = [
            TokensPrompt(
                prompt_token_ids=p["tokens"],
                **({"cache_salt": p["cache_salt"]} if p.get("cache_salt") else {}),
            )
            for p in phase["prompts"]
        ]
        client = getattr(connector, "lookup_client", None)
        before = client.stats() if client is not None else None
        direct = client.direct_rpcs if client is not None else 0
        params = SamplingParams(temperature=0.0, max_tokens=phase.get("max_tokens", 4))
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        ids = [o.request_id for o in outputs]
        by_request: dict[str, list[Any]] = {}
        for req_id, num_tokens, hit, bounds in connector.results:
            # (the engine's own request id is the caller's plus "-<random suffix>")
            by_request.setdefault(req_id.rsplit("-", 1)[0], []).append(
                [num_tokens, hit, [list(b) for b in bounds]]
            )
        entry: dict[str, Any] = {
            "name": phase["name"],
            "lookups": [by_request.get(r, []) for r in ids],
            "outputs": [list(o.outputs[0].token_ids) for o in outputs],
            "lookup_seconds": connector.lookup_seconds,
            "lookup_calls": connector.lookup_calls,
            "idle_seconds": connector.idle_seconds,
            "flush_seconds": connector.flush_seconds,
            "lookup_cpu_seconds": connector.lookup_cpu_seconds,
            "meta_seconds": connector.meta_seconds,
            "submitted": connector.submitted,
            "steps": connector.steps,
            "steps_to_last_answer": connector.last_answer_step + 1,
            "seconds_to_last_answer": max(0.0, connector.last_answer_at - started),
            "wall_seconds": wall,
        }
        if client is not None and before is not None:
            stats = client.stats()
            entry["rpcs"] = stats.rpcs_total - before.rpcs_total + client.direct_rpcs - direct
            entry["keys_sent"] = stats.keys_sent_total - before.keys_sent_total
        report["phases"].append(entry)
    if job["kv_role"] == "kv_both":
        _wait_for_saves(llm, connector)
    sidecars = len(_sidecars())
    llm.llm_engine.engine_core.shutdown()  # vLLM's own shutdown: scheduler, then its connector
    import threading

    report["threads"] = sorted(
        t.name for t in threading.enumerate() if t.name.startswith("aio-mclookup")
    )
    report["sidecars_started"] = sidecars
    report["sidecars_left"] = _sidecars()
    print("RESULT " + json.dumps(report), flush=True)
    os._exit(0)  # (vLLM's engine teardown in-process is slow and not under test here)


if __name__ == "__main__":
    main()
