"""The vLLM 0.33 / 0.32 oracle must itself reproduce the real vLLM lookups exactly.

``aio_mclookup._reference.v033`` (the 0.33 benchmarks' baseline and the property tests' oracle)
is only worth anything if it computes the same keys, hit lengths, tail-key boundaries and wire
replies as vLLM 0.33.0 (and 0.32.0). This runs it over every case of both public conformance
files (outputs of the real vLLM code), plus a few hand-checked properties of the rules.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from aio_mclookup._errors import InvalidRequest
from aio_mclookup._reference.v033 import (
    BaselineLookupV033,
    TailKeyBoundary,
    V033Result,
)

DATA = Path(__file__).resolve().parent / "data"


def _load(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


V033 = _load("v033_public.jsonl")
V032 = _load("v032_public.jsonl")


def _config(case: dict[str, Any]) -> dict[str, Any]:
    return dict(case["config"], vllm_version=case["vllm_version"])


def _hashes(case: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(h) for h in case["block_hashes_hex"]]


def _run(case: dict[str, Any]) -> None:
    hashes = _hashes(case)
    oracle = BaselineLookupV033(_config(case))
    keys, meta = oracle.build_keys(case["num_tokens"], hashes)
    assert keys == case["expected_keys"]
    if case["error"]:
        with pytest.raises(InvalidRequest) as info:
            oracle.resolve(case["num_tokens"], hashes, meta, case["exists"])
        assert isinstance(info.value, ValueError)
        return
    result = oracle.resolve(case["num_tokens"], hashes, meta, case["exists"])
    assert result.hit_length == case["expected_hit"]
    assert [list(b) for b in result.tail_key_boundaries] == case["expected_tail_boundaries"]
    assert result.to_bytes().hex() == case["expected_response_hex"]

    # The whole lookup against a fake store: exactly one batch_is_exist call with the keys.
    calls: list[list[str]] = []

    def store(batch: list[str]) -> list[int]:
        calls.append(batch)
        if case["exists"] is None:
            raise ConnectionError("store unavailable")
        return list(case["exists"])

    assert oracle.lookup(case["num_tokens"], hashes, store) == result
    assert calls == ([keys] if keys else [])


def test_case_files_are_complete() -> None:
    assert len(V033) == 300
    assert len(V032) == 291
    assert {c["vllm_version"] for c in V033} == {"0.33.0"}
    assert {c["vllm_version"] for c in V032} == {"0.32.0"}
    assert len({c["id"] for c in V033}) == 300
    assert sum(1 for c in V033 if c["error"]) == 3


@pytest.mark.parametrize("case", V033, ids=[c["id"] for c in V033])
def test_oracle_matches_vllm033(case: dict[str, Any]) -> None:
    _run(case)


@pytest.mark.parametrize("case", V032, ids=[c["id"] for c in V032])
def test_oracle_matches_vllm032(case: dict[str, Any]) -> None:
    _run(case)


# ---------------------------------------------------------------------------------- rules


def _cfg(groups: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": "org/test-model",
        "hash_block_size": 16,
        "scheduler_block_size": 16,
        "groups": groups,
    }
    base.update(kw)
    return base


def _h(n: int) -> list[bytes]:
    return [f"h{i}".encode() for i in range(n)]


def _all_present(oracle: BaselineLookupV033, n: int, hashes: list[bytes]) -> V033Result:
    return oracle.lookup(n, hashes, lambda keys: [1] * len(keys))


def test_wire_reply() -> None:
    """Spec §3.8: full16, lookup(32, [h0, h1]) both present -> hit 16, one boundary (0, 16)."""
    oracle = BaselineLookupV033(_cfg([{"kind": "full_attention", "block_size": 16}]))
    res = _all_present(oracle, 32, _h(2))
    assert res == V033Result(16, (TailKeyBoundary(0, 16),))
    assert res.to_bytes() == bytes.fromhex("000000100000000000000010")
    assert V033Result(0).to_bytes() == b"\x00\x00\x00\x00"


def test_unaligned_num_tokens_and_rederivation() -> None:
    oracle = BaselineLookupV033(_cfg([{"kind": "full_attention", "block_size": 16}]))
    assert _all_present(oracle, 65, _h(4)).hit_length == 64  # aligned inside, below num_tokens
    assert _all_present(oracle, 64, _h(4)).hit_length == 48  # a full hit is searched again
    assert _all_present(oracle, 16, _h(1)).hit_length == 0  # nothing usable below the end
    assert _all_present(oracle, 15, _h(1)).hit_length == 0  # shorter than one block: no keys
    assert oracle.build_keys(15, _h(1)) == ([], [])


def test_swa_rederivation_drops_to_zero() -> None:
    """Spec §1 item 1: SWA 16/W32, 64 tokens, only blocks 2-3 stored: 0.33 -> 0."""
    oracle = BaselineLookupV033(
        _cfg([{"kind": "sliding_window", "block_size": 16, "sliding_window": 32}])
    )
    assert oracle.lookup(64, _h(4), lambda keys: [0, 0, 1, 1]).hit_length == 0


def test_mamba_namespaces_need_every_tp_rank() -> None:
    """tp=2, kv=1, full16 + Mamba16: 6 keys for 32 tokens (Mamba at tp_rank 0 and 1)."""
    groups = [{"kind": "full_attention", "block_size": 16}, {"kind": "mamba", "block_size": 16}]
    oracle = BaselineLookupV033(_cfg(groups, tp_size=2, num_kv_heads=1))
    keys, _ = oracle.build_keys(33, _h(2))
    assert len(keys) == 6
    assert [k.split("@")[1] for k in keys] == ["tp_rank:0"] * 3 + ["tp_rank:1", "tp_rank:0"] + [
        "tp_rank:1"
    ]


def test_replication_factors() -> None:
    """Spec §5.2: tp=4, kv=2, MLA / GQA / Mamba -> 1, 2, 4 prefixes; tp=4, kv=3 -> 4."""
    groups = [
        {"kind": "full_attention", "block_size": 16, "mla": True},
        {"kind": "full_attention", "block_size": 16},
        {"kind": "mamba", "block_size": 16},
    ]
    oracle = BaselineLookupV033(_cfg(groups, tp_size=4, num_kv_heads=2))
    assert [len(p) for p in oracle.lookup_key_prefixes] == [1, 2, 4]
    oracle = BaselineLookupV033(
        _cfg([{"kind": "full_attention", "block_size": 16}], tp_size=4, num_kv_heads=3)
    )
    assert len(oracle.lookup_key_prefixes[0]) == 4


def test_excluded_groups_are_renumbered() -> None:
    groups = [
        {"kind": "full_attention", "block_size": 16},
        {"kind": "circular_buffer", "block_size": 8},
        {"kind": "mamba", "block_size": 16},
    ]
    oracle = BaselineLookupV033(_cfg(groups))
    keys, _ = oracle.build_keys(33, _h(2))
    assert {k.split("@")[5] for k in keys} == {"group:0", "group:1"}
    assert oracle.store_group_of == [0, None, 1]


def test_fine_grained_tail_boundary_beyond_hit() -> None:
    """Spec §3.6 upstream example: fine-grained full16 + Mamba16, h=4, EAGLE, lookup(25)."""
    groups = [{"kind": "full_attention", "block_size": 16}, {"kind": "mamba", "block_size": 16}]
    cfg = _cfg(
        groups,
        hash_block_size=4,
        scheduler_block_size=16,
        cache_hit_alignment_tokens=4,
        use_eagle=True,
    )
    oracle = BaselineLookupV033(cfg)
    hashes = _h(6)
    keys, meta = oracle.build_keys(25, hashes)
    present = {(0, 3), (0, 5), (1, 4), (1, 5)}
    answers = [1 if (g, hashes.index(hb)) in present else 0 for g, hb in meta]
    res = oracle.resolve(25, hashes, meta, answers)
    assert res == V033Result(20, (TailKeyBoundary(0, 24), TailKeyBoundary(1, 20)))
    assert len(keys) == 12


def test_extra_retained_tokens_widen_only_in_033() -> None:
    """Spec §1 item 9: full32 + SWA 8/W8, 96 tokens: extra 8 -> 9 keys on 0.33, 6 on 0.32."""
    groups = [
        {"kind": "full_attention", "block_size": 32},
        {
            "kind": "sliding_window",
            "block_size": 8,
            "sliding_window": 8,
            "extra_retained_tokens": 8,
        },
    ]
    cfg = _cfg(groups, hash_block_size=8, scheduler_block_size=32)
    assert len(BaselineLookupV033(cfg).build_keys(96, _h(12))[0]) == 9
    cfg32 = dict(cfg, vllm_version="0.32")
    assert len(BaselineLookupV033(cfg32).build_keys(96, _h(12))[0]) == 6


def test_store_raised_gives_zero() -> None:
    oracle = BaselineLookupV033(_cfg([{"kind": "full_attention", "block_size": 16}]))
    keys, meta = oracle.build_keys(48, _h(3))
    assert oracle.resolve(48, _h(3), meta, None) == V033Result(0)
    assert len(keys) == 3


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"vllm_version": "0.30.0"}, "vllm_version"),
        ({"tp_size": 2}, "num_kv_heads"),
        ({"cache_hit_alignment_tokens": 8}, "cache_hit_alignment_tokens"),
        ({"groups": [{"kind": "circular_buffer", "block_size": 16}]}, "groups"),
    ],
)
def test_refused_configs(change: dict[str, Any], field: str) -> None:
    cfg = _cfg([{"kind": "full_attention", "block_size": 16}], hash_block_size=4)
    cfg.update(change)
    with pytest.raises(InvalidRequest) as info:
        BaselineLookupV033(cfg)
    assert info.value.field == field


def test_circular_buffer_cannot_be_prefix_cacheable() -> None:
    groups = [
        {"kind": "full_attention", "block_size": 16},
        {"kind": "circular_buffer", "block_size": 8, "prefix_cacheable": True},
    ]
    with pytest.raises(InvalidRequest):
        BaselineLookupV033(_cfg(groups))
