"""The load generator's SGLang preset: page-hash workloads (``_loadgen/workload.py``), SGLang's
seed-naive way, one ``batch_is_exist`` per querying rank (``_loadgen/baseline.py``), and a run
against the embedded master whose hits are ``plan.resolve`` over every key."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import pytest

from aio_mclookup import FakeStore, SGLangLayout
from aio_mclookup._cli import _config, build_parser, main
from aio_mclookup._loadgen.baseline import sglang_naive_lookup
from aio_mclookup._loadgen.results import COORDINATOR, NAIVE, LoadgenConfig, RunResult
from aio_mclookup._loadgen.run import Progress, coordinator_run
from aio_mclookup._loadgen.workload import (
    SGLANG_PRESETS,
    PageHasher,
    Workload,
    WorkloadSpec,
    build_workload,
    describe_layout,
    preset_layout,
    workload_hasher,
)


def _oracle_hits(workload: Workload) -> list[int]:
    """SGLang's hit of every request: every key of its plan asked of the stored keys."""
    layout = workload.layout
    assert isinstance(layout, SGLangLayout)
    stored = set(workload.store_keys())
    out = []
    for req in workload.requests:
        plan = layout.plan(req.num_tokens, req.hash_list or list(map(bytes, req.hashes)))
        out.append(plan.resolve([1 if k in stored else 0 for k in plan.keys]))
    return out


def _layout() -> SGLangLayout:
    layout = preset_layout("sglang")
    assert isinstance(layout, SGLangLayout)
    return layout


def test_the_preset_is_bench_sglangs_deployment_from_token_ids() -> None:
    layout = _layout()
    assert layout == SGLangLayout.from_dict(SGLANG_PRESETS["sglang"])
    assert (layout.sglang_version, layout.page_size, layout.tp_size) == ("0.5.23", 64, 2)
    assert layout.keys_per_page == 4 and layout.prefetch_threshold == 256
    assert WorkloadSpec.for_layout(layout, "sglang").token_ids is True
    assert isinstance(workload_hasher(layout), PageHasher)
    assert "page=64 tp=2 (4 keys per page)" in describe_layout(layout)


@pytest.mark.parametrize(
    "layout",
    [
        _layout(),
        SGLangLayout(sglang_version="0.5.20", page_size=16, model_name="d", tp_size=4, mla=True,
                     eagle=True, prefetch_threshold=64),
    ],
    ids=["preset", "mla-eagle"],
)
def test_sglang_workloads_are_page_hashes_of_the_sessions(layout: SGLangLayout) -> None:
    spec = WorkloadSpec.for_layout(layout, "sglang", sessions=60, seed=4)
    workload = build_workload(layout, spec)
    again = build_workload(layout, spec)
    assert workload.store_keys() == again.store_keys() and workload.store_keys()
    page = layout.page_size
    for req in workload.requests:
        assert req.token_ids is not None and req.token_ids.size == req.num_tokens
        hashes = layout.page_hashes(req.token_ids)
        assert [bytes(r) for r in req.hashes] == hashes  # the prompt's own page hashes
        assert req.token_len == layout.query_pages(req.num_tokens) * page
    hits = _oracle_hits(workload)
    assert any(hits) and all(
        hit <= req.token_len and hit % page == 0 for hit, req in zip(hits, workload.requests)
    )
    # the same sessions with chained synthetic page hashes: the same shape and the same hits
    by_hash = build_workload(layout, WorkloadSpec.for_layout(layout, "sglang", sessions=60,
                                                             seed=4, token_ids=False))
    assert [(r.session, r.num_tokens, r.token_len) for r in by_hash.requests] == [
        (r.session, r.num_tokens, r.token_len) for r in workload.requests
    ]
    assert all(r.token_ids is None and len(r.hash_list) == len(r.hashes)
               for r in by_hash.requests)
    assert _oracle_hits(by_hash) == hits


class _Client:
    """A plain client's ``batch_is_exist`` on a set of keys, counting calls."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = set(keys)
        self.calls: list[list[bytes]] = []

    def batch_is_exist(self, keys: list[bytes]) -> list[int]:
        self.calls.append(list(keys))
        return [1 if k in self.keys else 0 for k in keys]


class _Raw:
    def __init__(self, client: _Client) -> None:
        self.client = client


@pytest.mark.parametrize("mla", [False, True])
async def test_seed_naive_is_one_rpc_per_querying_rank(mla: bool) -> None:
    layout = SGLangLayout(sglang_version="0.5.23", page_size=8, model_name="m", tp_size=2,
                          pp_size=2, mla=mla, prefetch_threshold=16)
    workload = build_workload(layout, WorkloadSpec(sessions=30, system_tokens=(50, 90),
                                                   turn_tokens=(10, 60), token_ids=True))
    client = _Client(workload.store_keys())
    result = RunResult(NAIVE, 1, 0)
    raw: Any = _Raw(client)
    lookup = sglang_naive_lookup(layout, raw, result, PageHasher(layout))
    hits = [await lookup(req) for req in workload.requests]
    assert hits == _oracle_hits(workload) and any(hits)
    asked = [r for r in workload.requests if layout.plan(r.num_tokens, r.hashes).keys]
    assert result.rpcs == 4 * len(asked) == len(client.calls)  # 2 TP x 2 PP ranks
    assert len(result.hash_times) == len(workload.requests)
    per_rank = sum(len(c) for c in client.calls)
    assert result.keys_sent == per_rank
    planned = sum(layout.plan(r.num_tokens, r.hashes).num_keys for r in asked)
    # MHA: each rank its own keys; MLA: every TP rank of a stage asks for the stage's key
    assert per_rank == (2 * planned if mla else planned)
    first = client.calls[0]
    assert all(k.endswith(b"_k") or k.endswith(b"_v") for k in first)


@pytest.mark.parametrize("pages", [64, 8], ids=["off-loop", "inline"])
async def test_the_coordinator_looks_token_ids_up_with_lookup_tokens(
    pages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (the coordinator's lookups take the ids: lookup_tokens hashes their pages, on its
    # worker thread from 16 pages; the layout's page_hashes is never called for them)
    layout = SGLangLayout(sglang_version="0.5.23", page_size=pages, model_name="m", tp_size=2,
                          prefetch_threshold=pages)
    workload = build_workload(layout, WorkloadSpec(sessions=40, system_tokens=(900, 1500),
                                                   turn_tokens=(10, 300), token_ids=True))
    store = FakeStore(workload.store_keys())
    want = _oracle_hits(workload)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the coordinator's run hashed the ids itself")

    monkeypatch.setattr(SGLangLayout, "page_hashes", refused)
    cfg = LoadgenConfig(layout=layout, layout_source="test", spec=WorkloadSpec(),
                        concurrency=(16,))
    result = await coordinator_run(store, workload.requests, cfg, 16, asyncio.Event(),
                                   Progress(io.StringIO(), False), PageHasher(layout))
    assert result.mode == COORDINATOR and not result.errors
    assert [h for _, h in sorted(zip(result.positions, result.hits))] == want and any(want)
    assert result.hashed_in_lookup and not result.hash_times
    assert result.to_dict()["hashing"] == {
        "included_in_latency": True, "in_lookup": "lookup_tokens", "lookups": len(want),
    }


@pytest.mark.integration
def test_the_sglang_preset_runs_on_the_embedded_master(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("mooncake.store")
    argv = ["loadgen", "--preset", "sglang", "--sessions", "60", "-c", "1,16", "--json", "-"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    data: dict[str, Any] = json.loads(captured.out)
    layout = _layout()
    assert data["layout"] == layout.to_dict() and data["layout_source"] == "preset sglang"
    assert data["token_ids"]["hasher"]["hasher"] == "SGLangLayout.page_hashes"
    workload = build_workload(layout, WorkloadSpec.for_layout(layout, "sglang", sessions=60))
    want = sum(_oracle_hits(workload))
    runs = data["runs"]
    assert [(r["mode"], r["concurrency"]) for r in runs] == [
        ("coordinator", 1), ("seed-naive", 1), ("coordinator", 16), ("seed-naive", 16)
    ]
    for run in runs:
        assert run["lookups"] == 60 and run["errors"] == 0
        assert run["hit_tokens"] == want > 0  # plan.resolve over every key, summed
        if run["mode"] == "coordinator":  # (hashed inside lookup_tokens: not timed apart)
            assert run["hashing"] == {"included_in_latency": True,
                                      "in_lookup": "lookup_tokens", "lookups": 60}
        else:
            assert run["hashing"]["lookups_hashed"] == 60
        if run["mode"] == NAIVE:
            assert 1.0 < run["rpcs_per_lookup"] <= 2.0  # one RPC per rank (TP 2) when asked
    assert data["hits_check"]["equal"] is True and data["hits_check"]["compared"] == 180
    assert "each lookup counts SGLang 0.5.23's L3 hit" in captured.err
    assert "saving at concurrency 16:" in captured.err


def test_layout_files_may_name_sglang(tmp_path: Path) -> None:
    path = tmp_path / "sglang.json"
    path.write_text(json.dumps({**SGLANG_PRESETS["sglang"], "tp_size": 4}))
    args = build_parser().parse_args(["loadgen", "--layout", str(path), "--sessions", "5"])
    cfg = _config(args, io.StringIO())
    assert isinstance(cfg.layout, SGLangLayout) and cfg.layout.tp_size == 4
    assert cfg.spec.token_ids is False  # a file takes the plain workload (--token-ids: ids)
