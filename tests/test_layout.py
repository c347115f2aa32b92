"""KVLayout: validation, the dict form, key prefixes, rank namespaces, and the scheduler rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aio_mclookup import (
    ChunkedLocalAttention,
    FullAttention,
    InvalidRequest,
    Mamba,
    SlidingWindow,
)
from aio_mclookup._layout.namespaces import model_name
from aio_mclookup._reference.v026 import BaselineLookup
from v026_layouts import KVLayout  # these tests pin vLLM 0.26's rules

CASES_FILE = Path(__file__).resolve().parent / "data" / "conformance_public.jsonl"


def _cfg(**overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": "test-model",
        "hash_block_size": 8,
        "scheduler_block_size": 32,
        "groups": [
            {"kind": "full_attention", "block_size": 32},
            {"kind": "sliding_window", "block_size": 8, "sliding_window": 8},
        ],
    }
    cfg.update(overrides)
    return cfg


def _one_block(layout: KVLayout, hash_: bytes) -> Any:
    sched = layout.scheduler_block_size
    return layout.plan(sched, [hash_] * (sched // layout.hash_block_size))


def _key(layout: KVLayout, group: int = 0, ns: int = 0, hash_: bytes = b"\xde\xad\xbe\xef") -> str:
    """The key a plan gives ``hash_`` in ``group`` and namespace ``ns``."""
    plan = _one_block(layout, hash_)
    key: bytes = plan.keys[plan.groups[group].key_offset + ns]
    return key.decode()


def _prefixes(layout: KVLayout, group: int = 0) -> list[str]:
    """The part of each key of ``group``'s first chunk between the model and the hash."""
    plan = _one_block(layout, b"\x01")
    probe = plan.groups[group]
    k = len(layout.namespaces)
    keys = [key.decode() for key in plan.keys[probe.key_offset : probe.key_offset + k]]
    return ["@".join(key.split("@")[1:-1]) for key in keys]


# ------------------------------------------------------------------------------ from_dict
@pytest.mark.parametrize("field", ["model", "hash_block_size", "scheduler_block_size", "groups"])
def test_required_fields(field: str) -> None:
    cfg = _cfg()
    del cfg[field]
    with pytest.raises(InvalidRequest, match=field):
        KVLayout.from_dict(cfg)


def test_optional_fields_have_defaults() -> None:
    layout = KVLayout.from_dict(_cfg())
    assert layout.cache_prefix == ""
    assert layout.use_eagle is False
    assert (layout.tp_size, layout.pcp_size, layout.dcp_size, layout.pp_size) == (1, 1, 1, 1)
    assert layout.num_kv_heads == 1
    assert layout.namespaces == ((0, 0, 0, 0),)


@pytest.mark.parametrize("field", ["block_sizes", "Model", "extra", "sliding_window"])
def test_unknown_top_level_field_is_refused(field: str) -> None:
    with pytest.raises(InvalidRequest, match=field):
        KVLayout.from_dict(_cfg(**{field: 1}))


@pytest.mark.parametrize(
    ("group", "name"),
    [
        ({"kind": "full_attention", "block_size": 16, "sliding_window": 16}, "sliding_window"),
        ({"kind": "full_attention", "block_size": 16, "window": 16}, "window"),
        ({"kind": "mamba", "block_size": 16, "mode": "align"}, "mode"),
        (
            {"kind": "sliding_window", "block_size": 16, "sliding_window": 16, "chunk": 2},
            "chunk",
        ),
        (
            {"kind": "chunked_local", "block_size": 16, "attention_chunk_size": 32,
             "sliding_window": 8},
            "sliding_window",
        ),
    ],
)
def test_unknown_group_field_is_refused(group: dict[str, Any], name: str) -> None:
    with pytest.raises(InvalidRequest, match=name):
        KVLayout.from_dict(_cfg(scheduler_block_size=32, hash_block_size=16, groups=[group]))


@pytest.mark.parametrize(
    ("group", "name"),
    [
        ({"kind": "sliding_window", "block_size": 16}, "sliding_window"),
        ({"kind": "chunked_local", "block_size": 16}, "attention_chunk_size"),
        ({"kind": "full_attention"}, "block_size"),
        ({"kind": "mamba"}, "block_size"),
    ],
)
def test_missing_group_field_is_refused(group: dict[str, Any], name: str) -> None:
    with pytest.raises(InvalidRequest, match=name):
        KVLayout.from_dict(_cfg(scheduler_block_size=32, hash_block_size=16, groups=[group]))


@pytest.mark.parametrize("kind", ["full", "FullAttention", "swa", "", None, 1, ["mamba"]])
def test_bad_kind_is_refused(kind: Any) -> None:
    with pytest.raises(InvalidRequest, match="kind"):
        KVLayout.from_dict(_cfg(groups=[{"kind": kind, "block_size": 32}]))


def test_missing_kind_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="kind"):
        KVLayout.from_dict(_cfg(groups=[{"block_size": 32}]))


@pytest.mark.parametrize("groups", [[], "full_attention", {"kind": "mamba"}, None, 3, [3], ["x"]])
def test_bad_groups_are_refused(groups: Any) -> None:
    with pytest.raises(InvalidRequest):
        KVLayout.from_dict(_cfg(groups=groups))


@pytest.mark.parametrize("cfg", [None, [], "model", 3, [("model", "m")]])
def test_non_mapping_is_refused(cfg: Any) -> None:
    with pytest.raises(InvalidRequest):
        KVLayout.from_dict(cfg)


BAD_SIZES = [0, -8, True, False, 8.0, "8", None, 2.5, [8]]


@pytest.mark.parametrize("value", BAD_SIZES)
@pytest.mark.parametrize(
    "field",
    ["hash_block_size", "scheduler_block_size", "tp_size", "pcp_size", "dcp_size", "pp_size",
     "num_kv_heads"],
)
def test_bad_top_level_size_is_refused(field: str, value: Any) -> None:
    if field == "num_kv_heads" and value is None:
        pytest.skip("null num_kv_heads means not given (see test_num_kv_heads_required)")
    with pytest.raises(InvalidRequest, match=field):
        KVLayout.from_dict(_cfg(**{field: value}))


@pytest.mark.parametrize("value", BAD_SIZES)
@pytest.mark.parametrize(
    ("kind", "field"),
    [
        ("full_attention", "block_size"),
        ("mamba", "block_size"),
        ("sliding_window", "block_size"),
        ("sliding_window", "sliding_window"),
        ("chunked_local", "block_size"),
        ("chunked_local", "attention_chunk_size"),
    ],
)
def test_bad_group_size_is_refused(kind: str, field: str, value: Any) -> None:
    group: dict[str, Any] = {"kind": kind, "block_size": 32}
    if kind == "sliding_window":
        group["sliding_window"] = 64
    if kind == "chunked_local":
        group["attention_chunk_size"] = 64
    group[field] = value
    with pytest.raises(InvalidRequest, match=field):
        KVLayout.from_dict(_cfg(groups=[group]))


def test_numpy_integers_are_sizes() -> None:
    groups = [{"kind": "full_attention", "block_size": np.int32(32)}]
    layout = KVLayout.from_dict(_cfg(hash_block_size=np.int64(8), groups=groups))
    assert layout.hash_block_size == 8 and type(layout.hash_block_size) is int
    assert layout == KVLayout.from_dict(_cfg(groups=[{"kind": "full_attention", "block_size": 32}]))


def test_numpy_integer_sizes_give_json_friendly_to_dict() -> None:
    """BUG (reported): group specs keep the numpy integer they were given, so ``to_dict()`` (the
    "JSON-friendly form") holds an ``np.int32`` that ``json.dumps`` refuses."""
    groups = [{"kind": "full_attention", "block_size": np.int32(32)}]
    layout = KVLayout.from_dict(_cfg(hash_block_size=np.int64(8), groups=groups))
    assert type(layout.groups[0].block_size) is int
    assert json.loads(json.dumps(layout.to_dict()))["groups"][0]["block_size"] == 32


@pytest.mark.parametrize("model", ["", "/", "//", None, 3, b"model"])
def test_bad_model_is_refused(model: Any) -> None:
    with pytest.raises(InvalidRequest, match="model"):
        KVLayout.from_dict(_cfg(model=model))


@pytest.mark.parametrize(("field", "value"), [("cache_prefix", None), ("cache_prefix", 1),
                                             ("use_eagle", 1), ("use_eagle", "true"),
                                             ("use_eagle", None)])
def test_bad_flags_are_refused(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest, match=field):
        KVLayout.from_dict(_cfg(**{field: value}))


# ------------------------------------------------------------------- block-size divisibility
@pytest.mark.parametrize(
    ("h", "sched", "blocks", "why"),
    [
        (16, 32, [24], "hash_block_size"),  # B % h
        (8, 36, [4], "hash_block_size"),  # L % h (h=8, L=36)
        (4, 48, [32], "groups\\[0\\].block_size"),  # L % B
        (4, 64, [64, 24], "groups\\[1\\].block_size"),  # L % B for a later group
        (8, 32, [32, 12], "hash_block_size"),  # B % h for a later group
    ],
)
def test_block_size_divisibility(h: int, sched: int, blocks: list[int], why: str) -> None:
    groups = [{"kind": "full_attention", "block_size": b} for b in blocks]
    with pytest.raises(InvalidRequest, match=why):
        KVLayout.from_dict(_cfg(hash_block_size=h, scheduler_block_size=sched, groups=groups))


def test_divisible_block_sizes_are_accepted() -> None:
    layout = KVLayout.from_dict(
        _cfg(
            hash_block_size=4,
            scheduler_block_size=512,
            groups=[
                {"kind": "full_attention", "block_size": 256},
                {"kind": "sliding_window", "block_size": 64, "sliding_window": 128},
                {"kind": "sliding_window", "block_size": 4, "sliding_window": 8},
                {"kind": "mamba", "block_size": 512},
            ],
        )
    )
    assert [g.block_size for g in layout.groups] == [256, 64, 4, 512]


def test_typed_specs_validate() -> None:
    bad: Any
    for bad in (0, -1, True, 1.5, "4"):
        with pytest.raises(InvalidRequest):
            FullAttention(bad)
        with pytest.raises(InvalidRequest):
            SlidingWindow(16, bad)
        with pytest.raises(InvalidRequest):
            ChunkedLocalAttention(bad, 16)
        with pytest.raises(InvalidRequest):
            Mamba(bad)
    with pytest.raises(InvalidRequest):
        KVLayout([], model="m", hash_block_size=16, scheduler_block_size=16)
    with pytest.raises(InvalidRequest):
        KVLayout(["full_attention"], model="m", hash_block_size=16, scheduler_block_size=16)  # type: ignore[list-item]
    with pytest.raises(InvalidRequest):
        KVLayout(FullAttention(16), model="m", hash_block_size=16, scheduler_block_size=16)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- dict form
def _all_configs() -> list[dict[str, Any]]:
    cases = [json.loads(line) for line in CASES_FILE.read_text().splitlines() if line.strip()]
    seen: dict[str, dict[str, Any]] = {}
    for case in cases:
        seen.setdefault(json.dumps(case["config"], sort_keys=True), case["config"])
    return list(seen.values())


@pytest.mark.parametrize("cfg", _all_configs())
def test_to_dict_round_trip(cfg: dict[str, Any]) -> None:
    layout = KVLayout.from_dict(cfg)
    # the conformance configs spell out every field but the release (written as "x.y.0")
    assert layout.to_dict() == {**cfg, "vllm_version": "0.26.0"}
    again = KVLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert again == layout
    assert hash(again) == hash(layout)
    assert again.key_prefixes == layout.key_prefixes


def test_typed_constructor_equals_from_dict() -> None:
    typed = KVLayout(
        [
            FullAttention(256),
            SlidingWindow(64, sliding_window=128),
            SlidingWindow(4, sliding_window=8),
            ChunkedLocalAttention(256, attention_chunk_size=8192),
            Mamba(256),
        ],
        model="deepseek-ai/DeepSeek-V4-Pro",
        hash_block_size=4,
        scheduler_block_size=256,
        cache_prefix="depA",
        use_eagle=False,
        tp_size=4,
        pcp_size=2,
        dcp_size=1,
        pp_size=2,
        num_kv_heads=2,
    )
    from_dict = KVLayout.from_dict(
        {
            "model": "deepseek-ai/DeepSeek-V4-Pro",
            "cache_prefix": "depA",
            "hash_block_size": 4,
            "scheduler_block_size": 256,
            "tp_size": 4,
            "pcp_size": 2,
            "pp_size": 2,
            "num_kv_heads": 2,
            "groups": [
                {"kind": "full_attention", "block_size": 256},
                {"kind": "sliding_window", "block_size": 64, "sliding_window": 128},
                {"kind": "sliding_window", "block_size": 4, "sliding_window": 8},
                {"kind": "chunked_local", "block_size": 256, "attention_chunk_size": 8192},
                {"kind": "mamba", "block_size": 256},
            ],
        }
    )
    assert typed == from_dict
    assert typed.to_dict() == from_dict.to_dict()
    assert typed.key_prefixes == from_dict.key_prefixes
    assert typed.groups == from_dict.groups
    assert typed != KVLayout.from_dict({**from_dict.to_dict(), "use_eagle": True})
    assert typed != "not a layout"


def test_group_specs_to_dict() -> None:
    assert FullAttention(16).to_dict() == {"kind": "full_attention", "block_size": 16}
    assert Mamba(16).to_dict() == {"kind": "mamba", "block_size": 16}
    assert SlidingWindow(8, 16).to_dict() == {
        "kind": "sliding_window", "block_size": 8, "sliding_window": 16,
    }
    assert ChunkedLocalAttention(16, 64).to_dict() == {
        "kind": "chunked_local", "block_size": 16, "attention_chunk_size": 64,
    }


# ------------------------------------------------------------------------------- keys
@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("test-model", "test-model"),
        ("deepseek-ai/DeepSeek-V4-Pro", "DeepSeek-V4-Pro"),
        ("deepseek-ai/DeepSeek-V4-Pro/", "DeepSeek-V4-Pro"),
        ("/models/Qwen3-0.6B//", "Qwen3-0.6B"),
        ("/mnt/ckpt/llama", "llama"),
    ],
)
def test_model_is_the_last_path_component(model: str, name: str) -> None:
    layout = KVLayout([FullAttention(16)], model=model, hash_block_size=16, scheduler_block_size=16)
    assert model_name(layout.model) == name
    assert _key(layout) == f"{name}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@deadbeef"
    assert layout.model == model  # kept as given
    assert BaselineLookup(layout.to_dict()).model_name == name


def test_cache_prefix_rendering() -> None:
    """§1.1: `test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@deadbeef`; with depA in front."""
    plain = KVLayout(
        [FullAttention(16)], model="test-model", hash_block_size=16, scheduler_block_size=16
    )
    assert _key(plain) == "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@deadbeef"
    dep = KVLayout(
        [FullAttention(16)], model="test-model", hash_block_size=16, scheduler_block_size=16,
        cache_prefix="depA",
    )
    assert _key(dep) == "depA@test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@deadbeef"


def test_group_index_and_hex_in_keys() -> None:
    layout = KVLayout.from_dict(_cfg())
    plan = layout.plan(32, [b"h0", b"h1", b"h2", b"h3"])
    assert [k.decode() for k in plan.keys] == [
        "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@6833",
        "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1@6833",
    ]
    # hex is lowercase, two characters per byte, no padding or truncation
    full = KVLayout([FullAttention(16)], model="m", hash_block_size=16, scheduler_block_size=16)
    key = full.plan(16, [bytes(range(250, 256)) + b"\x00\x0a"]).keys[0].decode()
    assert key.endswith("@fafbfcfdfeff000a")


# ------------------------------------------------------------------------- namespaces
def _ns_layout(**kw: Any) -> KVLayout:
    return KVLayout([FullAttention(16), Mamba(16)], model="test-model", hash_block_size=16,
                    scheduler_block_size=16, **kw)


def test_dcp_namespaces() -> None:
    """§1.4 / upstream test line 1624: tp=4, kv=1, dcp=4 -> tp_rank:t@pcp0@dcp t."""
    layout = _ns_layout(tp_size=4, num_kv_heads=1, dcp_size=4)
    assert len(layout.namespaces) == 4
    for group in (0, 1):
        assert _prefixes(layout, group) == [
            f"tp_rank:{t}@pcp0@dcp{t}@pp_rank:0@group:{group}" for t in range(4)
        ]


def test_pcp_namespaces() -> None:
    """Upstream test line 1640: tp=4, kv=1, pcp=2 -> two prefixes, pcp0 and pcp1."""
    layout = _ns_layout(tp_size=4, num_kv_heads=1, pcp_size=2)
    assert _prefixes(layout) == [
        "tp_rank:0@pcp0@dcp0@pp_rank:0@group:0",
        "tp_rank:0@pcp1@dcp0@pp_rank:0@group:0",
    ]


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_mla_has_one_namespace_at_any_tp(tp: int) -> None:
    layout = _ns_layout(tp_size=tp, num_kv_heads=1)
    assert layout.namespaces == ((0, 0, 0, 0),)
    assert _prefixes(layout, 1) == ["tp_rank:0@pcp0@dcp0@pp_rank:0@group:1"]


def test_tp_count_is_min_of_tp_and_kv_heads() -> None:
    assert len(_ns_layout(tp_size=4, num_kv_heads=2).namespaces) == 2
    assert len(_ns_layout(tp_size=2, num_kv_heads=8).namespaces) == 2
    assert len(_ns_layout(tp_size=4, num_kv_heads=3).namespaces) == 3


def test_namespace_order_pcp_then_tp_then_pp() -> None:
    layout = _ns_layout(tp_size=2, num_kv_heads=2, pcp_size=2, pp_size=2)
    assert layout.namespaces == tuple(
        (tp, pcp, 0, pp) for pcp in range(2) for tp in range(2) for pp in range(2)
    )
    assert _prefixes(layout)[:3] == [
        "tp_rank:0@pcp0@dcp0@pp_rank:0@group:0",
        "tp_rank:0@pcp0@dcp0@pp_rank:1@group:0",
        "tp_rank:1@pcp0@dcp0@pp_rank:0@group:0",
    ]


def test_dcp_uses_every_tp_rank_and_pcp() -> None:
    layout = _ns_layout(tp_size=4, num_kv_heads=8, dcp_size=2, pcp_size=2)
    assert layout.namespaces == tuple(
        (tp, pcp, tp % 2, 0) for pcp in range(2) for tp in range(4)
    )


@pytest.mark.parametrize(
    "kw",
    [
        {"tp_size": 4, "num_kv_heads": 1, "dcp_size": 4},
        {"tp_size": 4, "num_kv_heads": 1, "pcp_size": 2},
        {"tp_size": 2, "num_kv_heads": 8, "pp_size": 2, "cache_prefix": "x"},
        {"tp_size": 4, "num_kv_heads": 2, "dcp_size": 2, "pcp_size": 2, "pp_size": 2},
    ],
)
def test_prefixes_match_reference(kw: dict[str, Any]) -> None:
    layout = _ns_layout(**kw)
    ref = BaselineLookup(layout.to_dict())
    assert layout.key_prefixes == ref._lookup_key_prefixes


# -------------------------------------------------------------------- scheduler rules
def test_align_and_leave_one_token_scheduler_example() -> None:
    """§5.1 scheduler tests: L=16, num_tokens=48, a stub lookup answering 48."""
    layout = KVLayout([FullAttention(16)], model="m", hash_block_size=16, scheduler_block_size=16)
    assert layout.align(48) == 48
    hit = layout.leave_one_token(48, 48)
    assert hit == 32  # 47 // 16 * 16
    assert max(0, hit - 16) == 16  # 16 tokens computed locally: load 16
    assert max(0, hit - 32) == 0  # 32 computed locally: nothing to load


@pytest.mark.parametrize(
    ("num_tokens", "aligned"), [(0, 0), (1, 0), (15, 0), (16, 16), (47, 32), (48, 48), (-5, 0)]
)
def test_align(num_tokens: int, aligned: int) -> None:
    layout = KVLayout([FullAttention(16)], model="m", hash_block_size=16, scheduler_block_size=16)
    assert layout.align(num_tokens) == aligned
    assert layout.align(np.int64(num_tokens)) == aligned


@pytest.mark.parametrize(("hit", "num_tokens", "out"), [(48, 48, 32), (32, 48, 32), (16, 16, 0),
                                                       (0, 0, 0), (64, 65, 64), (0, 48, 0)])
def test_leave_one_token(hit: int, num_tokens: int, out: int) -> None:
    layout = KVLayout([FullAttention(16)], model="m", hash_block_size=16, scheduler_block_size=16)
    assert layout.leave_one_token(hit, num_tokens) == out


@pytest.mark.parametrize("bad", [True, 48.0, "48", None])
def test_align_refuses_non_ints(bad: Any) -> None:
    layout = KVLayout([FullAttention(16)], model="m", hash_block_size=16, scheduler_block_size=16)
    with pytest.raises(InvalidRequest):
        layout.align(bad)


def test_align_uses_the_scheduler_block() -> None:
    layout = KVLayout.from_dict(_cfg())  # L = 32
    assert layout.align(100) == 96
    assert layout.leave_one_token(96, 96) == 64


# -------------------------------------------------------------------------- spec-groups
def test_spec_groups_merge_and_put_full_attention_first() -> None:
    layout = KVLayout(
        [
            SlidingWindow(16, 32),
            Mamba(16),
            FullAttention(16),
            SlidingWindow(16, 32),
            FullAttention(16),
        ],
        model="m",
        hash_block_size=16,
        scheduler_block_size=16,
    )
    assert [(type(sg.spec).__name__, sg.group_ids) for sg in layout._geometry.spec_groups] == [
        ("FullAttention", (2, 4)),
        ("SlidingWindow", (0, 3)),
        ("Mamba", (1,)),
    ]


def test_repr_mentions_groups() -> None:
    text = repr(KVLayout.from_dict(_cfg()))
    assert "FullAttention" in text and "SlidingWindow" in text
