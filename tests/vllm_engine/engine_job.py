"""One real vLLM engine (CPU, a tiny dummy model, the Mooncake store connector), driven by a
JSON job; run with the vLLM environment's Python. Prints one JSON line of results.

Job: ``{"module": "recording_stock" | "recording_ours", "kv_role": "kv_both" | "kv_consumer",
"model_dir": ..., "extra": {...}, "log_stats": bool (report vLLM's Prometheus lines),
"exit": "plain" (end without an engine shutdown), "phases": [{"name": ..., "lookup_async":
bool, "max_tokens": int, "prompts": [{"tokens": [...], "cache_salt": str | null}]}]}``. Each
phase starts with an empty local prefix cache and submits all its prompts at once (greedy
decoding). Per phase it reports, per prompt, the lookup results the scheduler's client
returned, the output token ids, its time to first token, when its hit was known and when it
was first scheduled; the scheduler's time in lookups, lookup submissions, a per-step trace,
and the CPU time of the engine's process and of the sidecar.
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


def _cpu_seconds(pids: list[int]) -> float:
    """The CPU time (user + system) the processes ``pids`` used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as file:
                fields = file.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's threads, summed by name (a Python thread's name;
    the others, torch's workers among them, by their OS name)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as file:
                raw = file.read()
        except OSError:
            continue
        name = names.get(int(tid)) or raw[raw.index(b"(") + 1 : raw.rindex(b")")].decode(
            errors="replace"
        )
        fields = raw.rsplit(b")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _run(llm: Any, prompts: list[Any], params: Any, started: float) -> tuple[list[Any], Any]:
    """Submit every prompt at once and step the engine until all are done (what
    ``LLM.generate`` does), noting when each request's first output token came out (seconds
    from ``started``). The final outputs in prompt order, and those times by request id."""
    engine = llm.llm_engine
    order = [f"b{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(order, prompts):
        engine.add_request(request_id, prompt, params)
    final: dict[str, Any] = {}
    first: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - started
            if out.finished:
                final[out.request_id] = out
    return [final[r] for r in order], first


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
        disable_log_stats=not job.get("log_stats", False),
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
        sidecar_cpu = _cpu_seconds(_sidecars())
        threads = _thread_cpu()
        cpu = time.process_time()
        started = time.perf_counter()
        connector.trace_from(started)
        outputs, first_token = _run(llm, prompts, params, started)
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu
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
            # per request, seconds from the burst's submission: first token, hit known,
            # first scheduled (as the recording connector saw them)
            "ttft": [first_token[r] for r in ids],
            "hit_at": [connector.hit_at.get(r.rsplit("-", 1)[0]) for r in ids],
            "scheduled_at": [connector.scheduled_at.get(r.rsplit("-", 1)[0]) for r in ids],
            "step_trace": connector.step_trace,
            "engine_cpu_seconds": cpu,
            "sidecar_cpu_seconds": _cpu_seconds(_sidecars()) - sidecar_cpu,
            "thread_cpu_seconds": {
                name: round(spent - threads.get(name, 0.0), 3)
                for name, spent in _thread_cpu().items()
                if spent - threads.get(name, 0.0) >= 0.01
            },
        }
        if client is not None and before is not None:
            stats = client.stats()
            entry["rpcs"] = stats.rpcs_total - before.rpcs_total + client.direct_rpcs - direct
            entry["keys_sent"] = stats.keys_sent_total - before.keys_sent_total
        report["phases"].append(entry)
    if job["kv_role"] == "kv_both":
        _wait_for_saves(llm, connector)
    if job.get("log_stats"):  # vLLM's own Prometheus registry, as its /metrics serves it
        import prometheus_client
        from vllm import SamplingParams

        # The plug-in asks for a statistics snapshot at most once a second and files the reply
        # at a later step: let a snapshot taken after the phases through (a few steps), so
        # the registry holds their final counters rather than a mid-lookup one.
        time.sleep(1.1)
        llm.generate([{"prompt_token_ids": [1]}], SamplingParams(max_tokens=4), use_tqdm=False)

        text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
        report["metrics"] = [
            line for line in text.splitlines() if line.startswith(("aio_mclookup_", "vllm:"))
        ]
    sidecars = len(_sidecars())
    if job.get("exit") == "plain":  # no engine shutdown: the interpreter's exit closes all
        report["sidecars_started"] = sidecars
        print("RESULT " + json.dumps(report), flush=True)
        return
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
