"""The ``aio-mclookup loadgen`` command line: arguments, workload, and end-to-end runs.

The end-to-end tests run small loads against a real ``mooncake_master`` on loopback: embedded
(the command starts its own), against the session's master (``--master``), in-process through
``main()`` and once as ``python -m aio_mclookup`` (also interrupted with SIGINT).
"""

from __future__ import annotations

import itertools
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aio_mclookup as mcl
from aio_mclookup._cli import main
from aio_mclookup._layout.layout import KVLayout
from aio_mclookup._loadgen.report import format_summary
from aio_mclookup._loadgen.results import (
    COORDINATOR,
    NAIVE,
    LoadgenConfig,
    LoadgenReport,
    RunResult,
)
from aio_mclookup._loadgen.run import compare_hits
from aio_mclookup._loadgen.workload import (
    PRESETS,
    WorkloadSpec,
    build_workload,
    preset_layout,
    workload_hasher,
)
from aio_mclookup._local.master import LocalMaster

ROOT = Path(__file__).resolve().parents[1]

RUN_FIELDS = {
    "mode",
    "concurrency",
    "lookups",
    "errors",
    "lookups_per_s",
    "latency_ms",
    "rpcs",
    "keys_sent",
    "keys_planned",
    "rpcs_per_lookup",
    "keys_per_lookup",
    "hit_tokens",
    "prompt_tokens",
    "aligned_tokens",
    "hit_ratio",
}


def _needs_mooncake() -> None:
    pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine-non-cuda")


# ------------------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["loadgen", "--preset", "nope"],
         "unknown preset 'nope' (choose from chat, dsv4, sessions, sglang)"),
        (["loadgen", "--concurrency", "0"], "--concurrency must be >= 1, got 0"),
        (["loadgen", "--concurrency", "4,-2"], "--concurrency must be >= 1, got -2"),
        (["loadgen", "--concurrency", "four"], "--concurrency must be integers >= 1"),
        (["loadgen", "--master", "127.0.0.1:1"], "--master and --metadata go together"),
        (["loadgen", "--metadata", "http://127.0.0.1:1/m"], "--master and --metadata go together"),
        (["loadgen", "--write"], "--write only applies with --master"),
        (["loadgen", "--requests", "0"], "--requests must be >= 1, got 0"),
        (["loadgen", "--hit-ratio", "1.5"], "--hit-ratio must be within [0, 1]"),
        (["loadgen", "--turn-tokens", "9-3"], "--turn-tokens must satisfy 0 <= LO <= HI"),
        (["loadgen", "--duration", "-1"], "--duration must be > 0"),
        (["loadgen", "--report", "out.txt"], "--report must name a .png file"),
        (["loadgen", "--requests", "5", "--duration", "3"], "not allowed with argument"),
        (["loadgen", "--preset", "chat", "--layout", "x.json"], "not allowed with argument"),
        (["loadgen", "--bogus"], "unrecognized arguments: --bogus"),
        ([], "choose a command (loadgen, layout, serve)"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: " in err
    assert message in err


def test_unreadable_layout_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.json"
    assert main(["loadgen", "--layout", str(missing)]) == 2
    assert f"--layout: cannot read {missing}" in capsys.readouterr().err


def test_layout_file_that_is_not_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "layout.json"
    path.write_text("{model: oops")
    assert main(["loadgen", "--layout", str(path)]) == 2
    assert f"--layout: {path} is not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({**PRESETS["chat"], "colour": "red"}, "unknown layout field(s): colour"),
        ({**PRESETS["chat"], "hash_block_size": 5}, "must be a multiple of hash_block_size=5"),
        ({k: v for k, v in PRESETS["chat"].items() if k != "model"}, "'model' is required"),
        ([1, 2], "layout must be a mapping"),
    ],
)
def test_invalid_layout_file_shows_the_layout_error(
    tmp_path: Path, cfg: object, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(cfg))
    assert main(["loadgen", "--layout", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--layout: {path} is not a valid layout: " in err
    assert message in err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["loadgen", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--preset", "--layout", "--master", "--metadata", "--compare", "--json"):
        assert flag in out


# ----------------------------------------------------------------------------------- workload
def _hits(layout: KVLayout, stored: set[bytes], spec: WorkloadSpec) -> list[tuple[int, int]]:
    workload = build_workload(layout, spec)
    out = []
    for req in workload.requests:
        plan = layout.plan(req.token_len, req.hashes)
        out.append((plan.resolve([1 if k in stored else 0 for k in plan.keys]), req.token_len))
    return out


def _spec(layout: KVLayout, preset: str, **kw: Any) -> WorkloadSpec:
    return WorkloadSpec.for_layout(layout, preset, **{"sessions": 30, "seed": 5, **kw})


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_workload_is_deterministic_and_shares_prefixes(preset: str) -> None:
    layout = preset_layout(preset)
    spec = WorkloadSpec.for_layout(layout, sessions=40, seed=7)
    a, b = build_workload(layout, spec), build_workload(layout, spec)
    assert a.store_keys() == b.store_keys()
    assert [(r.session, r.num_tokens) for r in a.requests] == [
        (r.session, r.num_tokens) for r in b.requests
    ]
    assert all(np.array_equal(x.hashes, y.hashes) for x, y in zip(a.requests, b.requests))
    other = build_workload(layout, WorkloadSpec.for_layout(layout, sessions=40, seed=8))
    assert not set(a.store_keys()) & set(other.store_keys())
    for req in a.requests:
        assert req.token_len == layout.align(req.num_tokens)
        assert req.hashes.shape == (req.num_tokens // layout.hash_block_size, 32)
        assert req.hash_list == [bytes(row) for row in req.hashes]
    # Sessions share their system prompt's hashes: at most 8 distinct first hashes.
    assert len({r.hash_list[0] for r in a.requests}) <= spec.system_prompts


def test_workload_hit_ratio_controls_what_is_found() -> None:
    layout = preset_layout("chat")
    warm = WorkloadSpec.for_layout(layout, sessions=60, hit_ratio=1.0, seed=3)
    stored = set(build_workload(layout, warm).store_keys())
    results = _hits(layout, stored, warm)
    # Every request finds something (its system prompt at least) but never its own new tokens.
    assert all(0 < hit < token_len for hit, token_len in results)
    cold = WorkloadSpec.for_layout(layout, sessions=60, hit_ratio=0.0, seed=3)
    assert build_workload(layout, cold).store_keys() == []
    assert all(hit == 0 for hit, _ in _hits(layout, set(), cold))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_token_id_workload_has_the_hash_workloads_shape_and_hits(preset: str) -> None:
    layout = preset_layout(preset)
    by_hash = build_workload(layout, _spec(layout, preset))
    by_ids = build_workload(layout, _spec(layout, preset, token_ids=True))
    assert by_ids.summary() == {**by_hash.summary(), "token_ids": True}
    assert [(r.session, r.turn, r.num_tokens, r.token_len) for r in by_ids.requests] == [
        (r.session, r.turn, r.num_tokens, r.token_len) for r in by_hash.requests
    ]
    hasher = workload_hasher(layout)
    for req in by_ids.requests:
        assert req.token_ids is not None and req.token_ids.size == req.num_tokens
        assert req.hash_list == []  # the lookups hash the token ids themselves
        assert np.array_equal(hasher.hash(req.token_ids), req.hashes)
    # The same sessions share the same prefixes: every request finds the same hit either way.
    hash_hits = _hits(layout, set(by_hash.store_keys()), _spec(layout, preset))
    id_hits = _hits(layout, set(by_ids.store_keys()), _spec(layout, preset, token_ids=True))
    assert id_hits == hash_hits
    assert any(hit for hit, _ in id_hits)
    # Token ids are deterministic for a seed, and differ with another.
    again = build_workload(layout, _spec(layout, preset, token_ids=True))
    assert all(np.array_equal(a.token_ids, b.token_ids)  # type: ignore[arg-type]
               for a, b in zip(again.requests, by_ids.requests))
    other = build_workload(layout, _spec(layout, preset, token_ids=True, seed=6))
    assert not set(other.store_keys()) & set(by_ids.store_keys())


def test_token_id_sessions_share_their_system_prompt_tokens() -> None:
    layout = preset_layout("chat")
    spec = _spec(layout, "chat", token_ids=True, system_prompts=2, system_tokens=(100, 100))
    workload = build_workload(layout, spec)
    firsts = {req.token_ids[:100].tobytes() for req in workload.requests}  # type: ignore[index]
    assert len(firsts) == 2
    # 100 system tokens: 6 full hash blocks shared, the 7th already holds the session's own
    rows = {bytes(req.hashes[:6].tobytes()) for req in workload.requests}
    seventh = {bytes(req.hashes[6]) for req in workload.requests}
    assert len(rows) == 2 and len(seventh) == len(workload.requests)


def test_workload_hasher_follows_the_release() -> None:
    assert workload_hasher(preset_layout("chat")).to_dict() == {
        "algo": "sha256", "hash_block_size": 16, "vllm_version": "0.33.0", "era": "0.31-0.33",
        "width": 32, "seeded": False,
    }
    dsv4 = workload_hasher(preset_layout("dsv4"))
    assert dsv4.block_size == 4 and not dsv4.seeded
    old = workload_hasher(preset_layout("sessions"))  # 0.26 cannot go without a seed
    assert old.seeded and old.vllm_version == "0.26.0"
    assert old.none_hash == mcl.BlockHasher(16, seed="0", vllm_version="0.26").none_hash


def test_sessions_preset_mirrors_the_coalescing_benchmark() -> None:
    layout = preset_layout("sessions")
    assert (layout.tp_size, layout.num_kv_heads, len(layout.namespaces)) == (4, 8, 4)
    assert layout.cache_prefix == "tenant-a" and layout.vllm_version == "0.26.0"
    spec = WorkloadSpec.for_layout(layout, "sessions")
    assert (spec.sessions, spec.turns, spec.system_prompts) == (128, 6, 4)
    assert (spec.system_tokens, spec.turn_tokens, spec.hit_ratio) == ((1024, 1024),
                                                                      (512, 512), 1.0)
    assert spec.every_turn
    # A layout file of the same model does not take the preset's workload.
    assert not WorkloadSpec.for_layout(layout).every_turn
    workload = build_workload(layout, spec)
    by_session: dict[int, list[int]] = {}
    for req in workload.requests:
        by_session.setdefault(req.session, []).append(req.turn)
        assert req.num_tokens == 1024 + 512 * (req.turn + 1)
    # Every turn from 1 to the session's current one (1..5) is asked for.
    assert all(sorted(t) == list(range(1, max(t) + 1)) and max(t) <= 5
               for t in by_session.values())
    assert len(workload.requests) == sum(max(t) for t in by_session.values())
    # Every key has four rank namespaces and the cache prefix.
    keys = workload.store_keys()
    assert keys and all(k.startswith(b"tenant-a@") for k in keys)
    assert len(keys) % 4 == 0
    # Earlier turns find their whole prompt (one token left), the current one the turn before.
    stored = set(keys)
    current = {s: max(t) for s, t in by_session.items()}
    for req in workload.requests:
        plan = layout.plan(req.token_len, req.hashes)
        hit = layout.leave_one_token(
            plan.resolve([1 if k in stored else 0 for k in plan.keys]), req.num_tokens)
        if req.turn < current[req.session]:
            assert hit == req.num_tokens - 16
        else:
            assert hit == req.num_tokens - 512


def test_every_turn_needs_two_turns() -> None:
    with pytest.raises(mcl.InvalidRequest, match="every_turn needs turns >= 2"):
        WorkloadSpec(turns=1, every_turn=True)


# ------------------------------------------------------------------------- summary, unit level
def _run(mode: str, hits: list[int]) -> RunResult:
    run = RunResult(mode, 4, len(hits), elapsed=0.5)
    run.positions = list(range(len(hits)))
    run.hits = hits
    run.latencies = [0.001] * len(hits)
    run.prompt_tokens = 100 * len(hits)
    run.rpcs = len(hits)
    run.keys_sent = 10 * len(hits)
    return run


def test_summary_states_that_hashing_is_included_and_how_long_it_took() -> None:
    layout = preset_layout("chat")
    spec = WorkloadSpec(sessions=3, token_ids=True)
    cfg = LoadgenConfig(layout, "preset chat", spec, concurrency=(4,))
    runs = [_run(COORDINATOR, [16, 32, 0]), _run(NAIVE, [16, 32, 0])]
    runs[0].hash_times = [0.001, 0.003, 0.002]
    runs[1].hash_times = [0.004, 0.004, 0.005]
    report = LoadgenReport(cfg, runs=runs)
    text = format_summary(report)
    assert ("token ids: each lookup, both ways, first hashed its prompt's token ids with "
            "BlockHasher(16, algo='sha256', seed=None, vllm_version='0.33.0'); that hashing is "
            "included in the latencies and lookups/s below") in text
    assert "coordinator c=4    0.01 s in all, 2.000 ms per lookup (median), 1% of" in text
    assert "seed-naive  c=4    0.01 s in all, 4.000 ms per lookup (median)" in text
    data = report.to_dict()
    assert data["token_ids"]["hasher"]["hash_block_size"] == 16
    assert data["runs"][0]["hashing"] == {"included_in_latency": True, "lookups_hashed": 3,
                                          "total_s": 0.006, "median_ms": 2.0, "mean_ms": 2.0}
    plain = LoadgenReport(LoadgenConfig(layout, "preset chat", WorkloadSpec(sessions=3)),
                          runs=[_run(COORDINATOR, [16])])
    assert "hashing" not in format_summary(plain) and plain.to_dict()["token_ids"] is None
    assert plain.to_dict()["runs"][0]["hashing"] is None


def test_hit_mismatch_is_reported_and_counted() -> None:
    layout = preset_layout("chat")
    cfg = LoadgenConfig(layout, "preset chat", WorkloadSpec(sessions=3), concurrency=(4,))
    report = LoadgenReport(cfg, runs=[_run(COORDINATOR, [16, 32, 0]), _run(NAIVE, [16, 48, 0])])
    compare_hits(report)
    assert (report.compared, report.mismatches) == (3, 1)
    text = format_summary(report)
    assert "hits: MISMATCH in 1 of 3 compared lookups" in text
    assert report.to_dict()["hits_check"]["equal"] is False
    report.runs[1].hits = [16, 32, 0]
    compare_hits(report)
    assert "hits: identical across coordinator and seed-naive runs" in format_summary(report)


# --------------------------------------------------------------------------------- end to end
def _check_json(
    data: dict[str, Any], modes: list[str], concurrency: list[int], lookups: int
) -> None:
    assert data["tool"] == "aio-mclookup loadgen"
    assert "layout.align(num_tokens)" in data["alignment"]
    assert data["interrupted"] is False and data["failure"] is None
    runs = data["runs"]
    assert [(r["mode"], r["concurrency"]) for r in runs] == [
        (m, c) for c in concurrency for m in modes
    ]
    for run in runs:
        assert set(run) >= RUN_FIELDS
        assert run["lookups"] == lookups and run["errors"] == 0
        assert run["lookups_per_s"] > 0
        lat = run["latency_ms"]
        assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
        assert 0 < run["hit_tokens"] < run["aligned_tokens"] <= run["prompt_tokens"]
        assert run["hit_ratio"] == pytest.approx(run["hit_tokens"] / run["prompt_tokens"], 1e-3)
        if run["mode"] == NAIVE:
            # One RPC per request, carrying every planned key.
            assert run["rpcs_per_lookup"] == 1.0
            assert run["keys_sent"] == run["keys_planned"]
        else:
            assert run["keys_sent"] <= run["keys_planned"]
    # The same requests find the same hits in every run.
    assert len({r["hit_tokens"] for r in runs}) == 1
    check = data["hits_check"]
    assert check["equal"] is True and check["mismatches"] == 0
    assert check["compared"] == lookups * (len(runs) - 1)


@pytest.mark.integration
def test_loadgen_compare_embedded_master_json_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _needs_mooncake()
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    argv = ["loadgen", "--requests", "150", "-c", "1,8", "--json", str(out_json)]
    rc = main([*argv, "--report", str(out_png), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    _check_json(json.loads(out_json.read_text()), [COORDINATOR, NAIVE], [1, 8], 150)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = captured.out
    assert "p50 ms" in out and "RPCs/lookup" in out and "hit/prompt tokens" in out
    assert "each lookup counts what vLLM's scheduler does: num_tokens as vLLM 0.33.0" in out
    assert "saving at concurrency 8:" in out
    assert "hits: identical across coordinator and seed-naive runs (450 lookups" in out


@pytest.mark.integration
def test_loadgen_compare_hybrid_layout_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _needs_mooncake()
    layout = tmp_path / "dsv4.json"
    layout.write_text(json.dumps(PRESETS["dsv4"]))
    rc = main(["loadgen", "--layout", str(layout), "--sessions", "40", "-c", "4", "--json", "-"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    data = json.loads(captured.out)  # only JSON on stdout; the table went to stderr
    assert data["layout"] == KVLayout.from_dict(PRESETS["dsv4"]).to_dict()
    assert data["layout_source"] == str(layout)
    _check_json(data, [COORDINATOR, NAIVE], [4], 40)
    assert "hits: identical" in captured.err


@pytest.mark.integration
def test_sessions_preset_with_token_ids_finds_the_hash_modes_hits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _needs_mooncake()
    argv = ["loadgen", "--preset", "sessions", "--sessions", "20", "-c", "1,4", "--json", "-"]
    assert main(argv) == 0
    by_hash = json.loads(capsys.readouterr().out)
    assert main([*argv, "--token-ids"]) == 0
    captured = capsys.readouterr()
    by_ids = json.loads(captured.out)
    lookups = by_hash["runs"][0]["lookups"]
    assert lookups > 20  # every turn of each session is asked for
    for data in (by_hash, by_ids):
        _check_json(data, [COORDINATOR, NAIVE], [1, 4], lookups)
        assert data["layout"]["tp_size"] == 4 and data["layout"]["cache_prefix"] == "tenant-a"
        assert data["workload"]["spec"]["every_turn"] is True
    # The same workload, hashed from its token ids by every lookup: the same hits.
    assert [r["hit_tokens"] for r in by_ids["runs"]] == [r["hit_tokens"] for r in by_hash["runs"]]
    assert by_hash["token_ids"] is None and all(r["hashing"] is None for r in by_hash["runs"])
    assert by_ids["token_ids"]["hasher"] == {
        "algo": "sha256", "hash_block_size": 16, "vllm_version": "0.26.0", "era": "0.26-0.28",
        "width": 32, "seeded": True, "seed": "0",
    }
    for run in by_ids["runs"]:
        hashing = run["hashing"]
        assert hashing["included_in_latency"] is True
        assert hashing["lookups_hashed"] == lookups
        assert 0 < hashing["median_ms"] < run["latency_ms"]["p50"]
    assert "hashing token ids (included above), per run:" in captured.err
    assert "(hashing " in captured.err  # the per-run lines on stderr too


@pytest.mark.integration
def test_loadgen_against_an_existing_master(
    local_master: LocalMaster, capsys: pytest.CaptureFixture[str]
) -> None:
    _needs_mooncake()
    where = ["--master", local_master.master_address, "--metadata", local_master.metadata_server]
    common = ["loadgen", *where, "--requests", "60", "-c", "4", "--no-compare", "--json", "-"]
    # Read-only by default: nothing is written, so the synthetic prompts find nothing.
    assert main([*common, "--seed", "11"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["store"]["kind"] == "external" and data["store"]["keys_written"] == 0
    assert [r["hit_tokens"] for r in data["runs"]] == [0]
    # --write fills it for the run; then the cache is found.
    assert main([*common, "--seed", "12", "--write"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["store"]["keys_written"] > 0
    assert data["runs"][0]["hit_tokens"] > 0 and data["runs"][0]["errors"] == 0


def test_unreachable_master_fails_with_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    _needs_mooncake()
    where = ["--master", "127.0.0.1:1", "--metadata", "http://127.0.0.1:1/metadata"]
    assert main(["loadgen", *where, "--requests", "5", "-c", "2"]) == 1
    out = capsys.readouterr().out
    assert "nothing was measured" in out
    assert "FAILED: StoreError: Mooncake master 127.0.0.1:1 is not reachable" in out


def _python_m(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen(
        [sys.executable, "-m", "aio_mclookup", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.integration
def test_python_m_loadgen_subprocess() -> None:
    _needs_mooncake()
    proc = _python_m("loadgen", "--requests", "80", "-c", "4", "--json", "-")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    data = json.loads(out)
    _check_json(data, [COORDINATOR, NAIVE], [4], 80)
    assert "coordinator" in err and "seed-naive" in err
    # The Mooncake client's own (glog) lines stay out of the user's output.
    assert "transfer_engine" not in err and "client_service" not in err


@pytest.mark.integration
def test_sigint_stops_cleanly_and_prints_what_was_measured() -> None:
    _needs_mooncake()
    proc = _python_m("loadgen", "--duration", "60", "-c", "4", "--progress", "--sessions", "50")
    assert proc.stderr is not None
    deadline = time.monotonic() + 40
    seen = ""
    while "coordinator c=4:" not in seen:
        assert time.monotonic() < deadline, seen
        ready, _, _ = select.select([proc.stderr], [], [], 1.0)
        if ready:
            line = proc.stderr.readline()
            assert line, f"exited early: {seen}"
            seen += line
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted: the table shows what was measured before Ctrl-C" in out
    row = next(line for line in out.splitlines() if line.startswith(COORDINATOR))
    assert "(interrupted)" in row and int(row.split()[2].replace(",", "")) > 0


# ------------------------------------------------------------------ --report: checked up front
def _no_load(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Make running a load an error, and record attempts (the pre-checks must stop first)."""
    import aio_mclookup._loadgen.run as loadgen

    attempts: list[object] = []

    async def refuse(cfg: object, **kwargs: object) -> None:
        attempts.append(cfg)
        raise AssertionError("the load ran")

    monkeypatch.setattr(loadgen, "run_loadgen", refuse)
    return attempts


def test_report_without_matplotlib_fails_before_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    attempts = _no_load(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what a missing package does
    out_png = tmp_path / "out.png"
    started = time.perf_counter()
    assert main(["loadgen", "--report", str(out_png), "--no-progress"]) == 2
    assert time.perf_counter() - started < 5.0
    err = capsys.readouterr().err
    assert "error: --report needs matplotlib, which is not installed" in err
    assert "pip install -e '.[report]'" in err
    assert attempts == [] and not out_png.exists()


def test_report_into_a_missing_directory_fails_before_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    attempts = _no_load(monkeypatch)
    target = tmp_path / "nowhere" / "out.png"
    assert main(["loadgen", "--report", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"error: --report: the directory {target.parent} does not exist" in err
    assert attempts == []


def test_write_png_without_matplotlib_says_why() -> None:
    import aio_mclookup._loadgen.report as loadgen

    cfg = LoadgenConfig(
        layout=preset_layout("chat"),
        layout_source="preset chat",
        spec=WorkloadSpec.for_layout(preset_layout("chat"), sessions=3),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "matplotlib", None)
        assert loadgen.report_unavailable("x.png") == loadgen.REPORT_NEEDS
        skipped = loadgen.write_png(LoadgenReport(cfg, runs=[_run(COORDINATOR, [16])]), "x.png")
    assert skipped is not None and skipped.startswith(loadgen.REPORT_NEEDS)
    assert not Path("x.png").exists()


def test_png_has_latency_throughput_and_per_lookup_work_panels(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import aio_mclookup._loadgen.report as loadgen

    layout = preset_layout("chat")
    cfg = LoadgenConfig(
        layout=layout, layout_source="preset chat", spec=WorkloadSpec.for_layout(layout, sessions=3)
    )
    runs = []
    for conc, rpcs, keys in ((1, 1.0, 77.0), (16, 0.58, 51.4), (64, 0.159, 51.4)):
        for mode, r, k in ((COORDINATOR, rpcs, keys), (NAIVE, 1.0, 181.0)):
            run = _run(mode, [16] * 100)
            run.concurrency = conc
            run.rpcs, run.keys_sent = round(r * 100), round(k * 100)
            runs.append(run)
    report = LoadgenReport(cfg, runs=runs)
    figures: list[Any] = []
    real_close = plt.close
    # Keep the figure to inspect it (write_png closes it).
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plt, "close", lambda fig=None: figures.append(fig))
        assert loadgen.write_png(report, str(tmp_path / "r.png")) is None
    fig = figures[0]
    try:
        assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        ax_lat, ax_tput, ax_work = fig.axes
        assert "Latency" in ax_lat.get_title() and "Throughput" in ax_tput.get_title()
        assert "RPCs" in ax_work.get_title() and "keys" in ax_work.get_title()
        # Every run has its CDF; the legend sits below the axes, so it covers no curve.
        assert len(ax_lat.get_lines()) == len(runs)
        legend = ax_lat.get_legend()
        fig.canvas.draw()
        box = legend.get_window_extent()
        assert box.y1 <= ax_lat.get_window_extent().y0
        labels = [t.get_text() for t in legend.get_texts()]
        assert "coordinator c=1" in labels and "seed-naive c=1" in labels
        # The per-lookup panel plots what the runs measured.
        lines = {line.get_label(): line for line in ax_work.get_lines()}
        assert list(lines["RPCs, coordinator"].get_ydata()) == pytest.approx([1.0, 0.58, 0.16])
        assert list(lines["keys, seed-naive"].get_ydata()) == pytest.approx([181.0] * 3)
        assert list(lines["keys, coordinator"].get_xdata()) == [1, 16, 64]
    finally:
        real_close(fig)


# --------------------------------------------------------------------- aio-mclookup layout
@pytest.mark.parametrize("release", ["0.26", "0.32", "0.33"])
def test_layout_command_prints_the_keys_workers_write(
    release: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = {
        "model": "org/Llama-70B", "cache_prefix": "tenant", "hash_block_size": 16,
        "scheduler_block_size": 64, "tp_size": 4, "num_kv_heads": 2, "vllm_version": release,
        "groups": [
            {"kind": "full_attention", "block_size": 64},
            {"kind": "sliding_window", "block_size": 16, "sliding_window": 32},
        ],
    }
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(cfg))
    assert main(["layout", str(path), "--hash", "ab" * 32]) == 0
    out = capsys.readouterr().out
    layout = mcl.KVLayout.from_dict(cfg)
    assert f"vLLM release: {layout.vllm_version}" in out
    # every hash equal: chunk 0's key of each group is whatever the plan makes for it
    plan = layout.plan(64 if release == "0.26" else 65, [bytes.fromhex("ab" * 32)] * 4)
    printed = {line.split(": ", 1)[1] for line in out.splitlines() if "@" in line}
    planned = {k.decode() for k in plan.keys}
    assert printed and printed <= planned
    assert len(printed) == len(layout.group_namespaces[0]) + len(layout.group_namespaces[1])


def test_layout_command_refuses_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"model": "m", "vllm_version": "0.29"}))
    assert main(["layout", str(path)]) == 2
    assert "0.29" in capsys.readouterr().err


def test_missing_mooncake_names_installs_that_exist(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from aio_mclookup import _cli

    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import mooncake.store fails
    code = _cli.main(["loadgen"])
    err = capsys.readouterr().err
    assert code == 2 and "mooncake-transfer-engine-non-cuda" in err, err
    assert "aio-mclookup[" not in err  # not on PyPI: only a clone's extras


@pytest.mark.parametrize(
    ("latency_ms", "work"),
    [
        ((1.0, 1.6), ((1.0, 0.9, 60.0), (1.0, 1.0, 64.0))),  # narrow: under a decade each
        ((0.3, 250.0), ((1.0, 0.053, 51.0), (1.0, 1.0, 181.0))),  # the chat sample's spread
    ],
)
def test_png_ticks_are_readable_and_colours_mean_one_thing(
    latency_ms: tuple[float, float], work: tuple[tuple[float, float, float], ...]
) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    import aio_mclookup._loadgen.report as loadgen

    layout = preset_layout("chat")
    cfg = LoadgenConfig(layout, "preset chat", WorkloadSpec.for_layout(layout, sessions=3))
    runs = []
    for i, conc in enumerate((1, 16, 64)):
        for mode, (_, rpcs, keys) in zip((COORDINATOR, NAIVE), work):
            run = _run(mode, [16] * 50)
            run.concurrency = conc
            lo, hi = latency_ms
            run.latencies = list(np.linspace(lo, hi, 50) / 1e3 * (1 + 0.01 * i))
            per_lookup = rpcs / (i + 1) if mode == COORDINATOR else rpcs
            run.rpcs, run.keys_sent = round(per_lookup * 50), round(keys * 50)
            runs.append(run)
    figures: list[Any] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plt, "close", lambda fig=None: figures.append(fig))
        assert loadgen.write_png(LoadgenReport(cfg, runs=runs), os.devnull) is None
    fig = figures[0]
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax_lat, ax_tput, ax_work = fig.axes
        for axis, (low, high) in ((ax_lat.xaxis, ax_lat.get_xlim()),
                                  (ax_work.yaxis, ax_work.get_ylim())):
            shown = [
                (tick.get_loc(), tick.label1.get_window_extent(renderer))
                for tick in axis.get_major_ticks()
                if tick.label1.get_visible() and tick.label1.get_text()
                and min(low, high) <= tick.get_loc() <= max(low, high)
            ]
            assert len(shown) >= 2, [loc for loc, _ in shown]
            boxes = [box for _, box in shown]
            for a, b in itertools.pairwise(boxes):
                assert not a.overlaps(b), [loc for loc, _ in shown]
            assert not [t for t in axis.get_minor_ticks() if t.label1.get_text()]
        mode_colours = {to_rgba(c) for c in loadgen.MODE_COLOURS.values()}
        for ax in (ax_tput, ax_work):
            for line in ax.get_lines():
                mode = COORDINATOR if COORDINATOR in line.get_label() else NAIVE
                assert to_rgba(line.get_color()) == to_rgba(loadgen.MODE_COLOURS[mode])
        assert not {to_rgba(line.get_color()) for line in ax_lat.get_lines()} & mode_colours
    finally:
        for f in figures:
            plt.close(f)
