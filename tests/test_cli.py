"""The ``aio-mclookup loadgen`` command line: arguments, workload, and end-to-end runs.

The end-to-end tests run small loads against a real ``mooncake_master`` on loopback: embedded
(the command starts its own), against the session's master (``--master``), in-process through
``main()`` and once as ``python -m aio_mclookup`` (also interrupted with SIGINT).
"""

from __future__ import annotations

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
from aio_mclookup._loadgen.workload import PRESETS, WorkloadSpec, build_workload, preset_layout
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
        (["loadgen", "--preset", "nope"], "unknown preset 'nope' (choose from chat, dsv4)"),
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
        ([], "choose a command (loadgen, layout)"),
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
