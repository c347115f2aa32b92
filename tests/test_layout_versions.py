"""KVLayout's ``vllm_version`` and the inputs vLLM 0.32 / 0.33 add: defaults, validation,
the dict form and the typed constructor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import aio_mclookup as mcl
from aio_mclookup import (
    CircularBuffer,
    FullAttention,
    InvalidRequest,
    KVLayout,
    Mamba,
    SlidingWindow,
)

DATA = Path(__file__).resolve().parent / "data"


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


def _configs(name: str) -> list[dict[str, Any]]:
    out = []
    for line in (DATA / name).read_text().splitlines():
        if line.strip():
            case = json.loads(line)
            version = case.get("vllm_version")
            out.append(dict(case["config"], **({"vllm_version": version} if version else {})))
    return out


# ------------------------------------------------------------------------------- versions
@pytest.mark.parametrize(
    ("given", "written"),
    [
        ("0.26", "0.26.0"),
        ("0.26.0", "0.26.0"),
        ("0.32", "0.32.0"),
        ("0.32.0", "0.32.0"),
        ("0.33", "0.33.0"),
        ("0.33.0", "0.33.0"),
    ],
)
def test_supported_versions_are_normalised(given: str, written: str) -> None:
    layout = KVLayout.from_dict(_cfg(vllm_version=given))
    assert layout.vllm_version == written
    assert layout.to_dict()["vllm_version"] == written
    typed = KVLayout(
        [FullAttention(32), SlidingWindow(8, 8)],
        model="test-model",
        hash_block_size=8,
        scheduler_block_size=32,
        vllm_version=given,
    )
    assert typed == layout


def test_default_version_is_033() -> None:
    layout = KVLayout.from_dict(_cfg())
    assert layout.vllm_version == "0.33.0"
    assert layout.to_dict()["vllm_version"] == "0.33.0"
    assert (
        KVLayout(
            [FullAttention(16)], model="m", hash_block_size=16, scheduler_block_size=16
        ).vllm_version
        == "0.33.0"
    )


@pytest.mark.parametrize(
    "version", ["0.27.0", "0.30", "0.31.0", "0.34.0", "0.33.1", "1.0", "", 0.33, None, "v0.33.0"]
)
def test_other_versions_are_refused_naming_the_supported_ones(version: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        KVLayout.from_dict(_cfg(vllm_version=version))
    assert info.value.field == "vllm_version"
    for supported in ("0.26", "0.32", "0.33"):
        assert supported in str(info.value)


def test_026_conformance_configs_carry_num_kv_heads() -> None:
    configs = _configs("conformance_public.jsonl")
    assert configs and all("num_kv_heads" in c for c in configs)
    for cfg in configs:
        assert KVLayout.from_dict(dict(cfg, vllm_version="0.26.0")).vllm_version == "0.26.0"


@pytest.mark.parametrize("name", ["v033_public.jsonl", "v032_public.jsonl"])
def test_era_c_configs_round_trip(name: str) -> None:
    for cfg in _configs(name):
        layout = KVLayout.from_dict(cfg)
        again = KVLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
        assert again == layout
        assert again.key_prefixes == layout.key_prefixes
        assert layout.to_dict()["vllm_version"] == cfg["vllm_version"]


# -------------------------------------------------------------------- 0.26 refuses 0.32+
@pytest.mark.parametrize(
    ("field", "value"),
    [("cache_hit_alignment_tokens", 8), ("store_namespace", "@x"), ("store_tp_size", 2)],
)
def test_026_refuses_new_top_level_fields_off_default(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        KVLayout.from_dict(_cfg(vllm_version="0.26", **{field: value}))
    assert info.value.field == field
    KVLayout.from_dict(
        _cfg(vllm_version="0.33", **{field: value})
        if field != "store_tp_size"
        else _cfg(vllm_version="0.33")
    )


@pytest.mark.parametrize(
    ("group", "field"),
    [
        ({"kind": "full_attention", "block_size": 32, "mla": True}, "mla"),
        ({"kind": "full_attention", "block_size": 32, "eagle": True}, "eagle"),
        ({"kind": "mamba", "block_size": 32, "prefix_cacheable": False}, "prefix_cacheable"),
        (
            {
                "kind": "sliding_window",
                "block_size": 8,
                "sliding_window": 8,
                "extra_retained_tokens": 4,
            },
            "extra_retained_tokens",
        ),
        ({"kind": "circular_buffer", "block_size": 8}, "kind"),
    ],
)
def test_026_refuses_new_group_fields_off_default(group: dict[str, Any], field: str) -> None:
    groups = [{"kind": "full_attention", "block_size": 32}, group]
    with pytest.raises(InvalidRequest) as info:
        KVLayout.from_dict(_cfg(vllm_version="0.26.0", groups=groups))
    assert info.value.field == f"groups.1.{field}"
    assert KVLayout.from_dict(_cfg(groups=groups)).vllm_version == "0.33.0"


def test_026_accepts_new_fields_at_their_defaults() -> None:
    groups = [
        {
            "kind": "full_attention",
            "block_size": 32,
            "mla": False,
            "eagle": False,
            "prefix_cacheable": True,
        },
        {
            "kind": "sliding_window",
            "block_size": 8,
            "sliding_window": 8,
            "extra_retained_tokens": 0,
        },
    ]
    layout = KVLayout.from_dict(
        _cfg(
            vllm_version="0.26",
            groups=groups,
            cache_hit_alignment_tokens=None,
            store_namespace="",
            store_tp_size=None,
        )
    )
    assert layout.to_dict()["groups"] == _cfg()["groups"]  # defaults are not written
    assert "store_namespace" not in layout.to_dict()


# --------------------------------------------------------------------------- validation
def test_unknown_fields_stay_refused() -> None:
    with pytest.raises(InvalidRequest, match="nope"):
        KVLayout.from_dict(_cfg(nope=1))
    groups = [{"kind": "mamba", "block_size": 32, "mla": True}]  # mla: attention groups only
    with pytest.raises(InvalidRequest, match="mla"):
        KVLayout.from_dict(_cfg(groups=groups))


@pytest.mark.parametrize(
    ("group", "field"),
    [
        ({"kind": "full_attention", "block_size": 32, "mla": 1}, "groups.0.mla"),
        ({"kind": "full_attention", "block_size": 32, "eagle": "yes"}, "groups.0.eagle"),
        (
            {
                "kind": "sliding_window",
                "block_size": 8,
                "sliding_window": 8,
                "extra_retained_tokens": -1,
            },
            "groups.0.extra_retained_tokens",
        ),
        (
            {
                "kind": "sliding_window",
                "block_size": 8,
                "sliding_window": 8,
                "extra_retained_tokens": 1.5,
            },
            "groups.0.extra_retained_tokens",
        ),
        (
            {"kind": "circular_buffer", "block_size": 8, "prefix_cacheable": True},
            "groups.0.prefix_cacheable",
        ),
    ],
)
def test_bad_new_group_fields_are_refused(group: dict[str, Any], field: str) -> None:
    groups = [group, {"kind": "full_attention", "block_size": 32}]
    with pytest.raises(InvalidRequest) as info:
        KVLayout.from_dict(_cfg(groups=groups))
    assert info.value.field == field


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0"])
def test_num_kv_heads_required(version: str) -> None:
    cfg = _cfg(vllm_version=version, tp_size=2)
    with pytest.raises(InvalidRequest) as info:
        KVLayout.from_dict(cfg)
    assert info.value.field == "num_kv_heads"
    hint = "1 for an MLA model" if version == "0.26.0" else "mla: true"
    assert hint in str(info.value)
    assert KVLayout.from_dict(dict(cfg, num_kv_heads=2)).num_kv_heads == 2
    # Not needed where it cannot change the namespaces: tp 1, or DCP.
    assert KVLayout.from_dict(_cfg(vllm_version=version)).num_kv_heads == 1
    KVLayout.from_dict(
        _cfg(
            vllm_version=version,
            tp_size=2,
            dcp_size=2,
            groups=[{"kind": "full_attention", "block_size": 32}],
        )
    )


def test_alignment_must_be_what_vllm_resolves() -> None:
    with pytest.raises(InvalidRequest) as info:
        KVLayout.from_dict(_cfg(cache_hit_alignment_tokens=16))
    assert info.value.field == "cache_hit_alignment_tokens"
    # Fine-grained mode with a sliding window wider than the hash block: vLLM never does it.
    with pytest.raises(InvalidRequest, match="fine-grained"):
        KVLayout.from_dict(
            _cfg(
                cache_hit_alignment_tokens=8,
                groups=[
                    {"kind": "full_attention", "block_size": 32},
                    {"kind": "sliding_window", "block_size": 16, "sliding_window": 8},
                ],
            )
        )
    fine = KVLayout.from_dict(_cfg(cache_hit_alignment_tokens=8))
    assert fine.fine_grained and fine.lookup_alignment == 8 and fine.align(37) == 32
    block = KVLayout.from_dict(_cfg(cache_hit_alignment_tokens=32))
    assert not block.fine_grained and block.lookup_alignment == 32 and block.align(37) == 32


def test_connector_refusals() -> None:
    with pytest.raises(InvalidRequest, match="no prefix-cacheable"):
        KVLayout.from_dict(_cfg(groups=[{"kind": "circular_buffer", "block_size": 8}]))
    with pytest.raises(InvalidRequest) as info:
        KVLayout.from_dict(_cfg(pcp_size=2))
    assert info.value.field == "pcp_size"
    one = [
        {"kind": "full_attention", "block_size": 32},
        {"kind": "circular_buffer", "block_size": 8},
    ]
    assert KVLayout.from_dict(_cfg(pcp_size=2, groups=one)).store_group_ids == (0, None)


def test_excluded_groups_are_not_size_checked() -> None:
    groups = [
        {"kind": "full_attention", "block_size": 32},
        {
            "kind": "sliding_window",
            "block_size": 12,
            "sliding_window": 8,
            "prefix_cacheable": False,
        },
    ]
    layout = KVLayout.from_dict(_cfg(groups=groups))
    assert layout.store_group_ids == (0, None)
    with pytest.raises(InvalidRequest, match="block_size"):
        KVLayout.from_dict(_cfg(groups=[groups[0], dict(groups[1], prefix_cacheable=True)]))


def test_store_tp_size_only_for_tp_sharded_layouts() -> None:
    full = [{"kind": "full_attention", "block_size": 32}]
    ok = KVLayout.from_dict(
        _cfg(
            groups=full,
            tp_size=2,
            num_kv_heads=8,
            store_tp_size=4,
            store_namespace="@store_tp:4@store_pp:1@store_format:x",
        )
    )
    assert [ns[0] for ns in ok.group_namespaces[0]] == [0, 1, 2, 3]
    assert ok.key_prefixes[0][0].startswith("test-model@store_tp:4@store_pp:1@store_format:x@")
    for bad in (
        {"store_tp_size": 3},  # not a multiple of tp
        {"store_tp_size": 16},  # does not divide num_kv_heads
        {"groups": _cfg()["groups"], "store_tp_size": 4},  # two groups
        {"groups": [dict(full[0], mla=True)], "store_tp_size": 4},
    ):
        with pytest.raises(InvalidRequest) as info:
            KVLayout.from_dict(_cfg(**{"groups": full, "tp_size": 2, "num_kv_heads": 8, **bad}))
        assert info.value.field == "store_tp_size"


def test_per_group_replication() -> None:
    layout = KVLayout(
        [FullAttention(16, mla=True), FullAttention(16), Mamba(16)],
        model="m",
        hash_block_size=16,
        scheduler_block_size=16,
        tp_size=4,
        num_kv_heads=2,
    )
    assert [len(ns) for ns in layout.group_namespaces] == [1, 2, 4]
    assert (
        len(
            KVLayout(
                [FullAttention(16)],
                model="m",
                hash_block_size=16,
                scheduler_block_size=16,
                tp_size=4,
                num_kv_heads=3,
            ).namespaces
        )
        == 4
    )
    old = KVLayout(
        [FullAttention(16)],
        model="m",
        hash_block_size=16,
        scheduler_block_size=16,
        tp_size=4,
        num_kv_heads=3,
        vllm_version="0.26",
    )
    assert len(old.namespaces) == 3  # 0.26: min(tp, kv)


def test_typed_constructor_equals_from_dict_with_new_fields() -> None:
    typed = KVLayout(
        [
            FullAttention(256, mla=True),
            SlidingWindow(64, 128, mla=True, extra_retained_tokens=3, eagle=True),
            CircularBuffer(8),
            SlidingWindow(4, 8, mla=True, prefix_cacheable=False),
            Mamba(256),
        ],
        model="deepseek-ai/DeepSeek-V4-Flash",
        hash_block_size=4,
        scheduler_block_size=256,
        use_eagle=True,
        tp_size=2,
        num_kv_heads=1,
        cache_hit_alignment_tokens=256,
        store_namespace="@ns",
        vllm_version="0.33",
    )
    cfg = {
        "model": "deepseek-ai/DeepSeek-V4-Flash",
        "hash_block_size": 4,
        "scheduler_block_size": 256,
        "use_eagle": True,
        "tp_size": 2,
        "num_kv_heads": 1,
        "cache_hit_alignment_tokens": 256,
        "store_namespace": "@ns",
        "vllm_version": "0.33.0",
        "groups": [
            {"kind": "full_attention", "block_size": 256, "mla": True},
            {
                "kind": "sliding_window",
                "block_size": 64,
                "sliding_window": 128,
                "mla": True,
                "extra_retained_tokens": 3,
                "eagle": True,
            },
            {"kind": "circular_buffer", "block_size": 8, "prefix_cacheable": False},
            {
                "kind": "sliding_window",
                "block_size": 4,
                "sliding_window": 8,
                "mla": True,
                "prefix_cacheable": False,
            },
            {"kind": "mamba", "block_size": 256},
        ],
    }
    from_dict = KVLayout.from_dict(cfg)
    assert typed == from_dict
    assert typed.to_dict()["groups"] == cfg["groups"]
    assert typed.store_group_ids == (0, 1, None, None, 2)
    assert typed.key_prefixes[2][1] == ["deepseek-ai", "DeepSeek-V4-Flash"][-1] + (
        "@ns@tp_rank:1@pcp0@dcp0@pp_rank:0@group:2"
    )
    assert "vllm_version='0.33.0'" in repr(typed)
    with pytest.raises(InvalidRequest):
        CircularBuffer(8, prefix_cacheable=True)
    with pytest.raises(InvalidRequest):
        FullAttention(16, mla="yes")  # type: ignore[arg-type]


def test_leave_one_token_only_on_026() -> None:
    assert KVLayout.from_dict(_cfg(vllm_version="0.26")).leave_one_token(64, 64) == 32
    assert KVLayout.from_dict(_cfg()).leave_one_token(64, 64) == 64


def test_exports() -> None:
    for name in ("LookupResult", "TailKeyBoundary", "CircularBuffer"):
        assert name in mcl.__all__ and getattr(mcl, name).__module__ == "aio_mclookup"


def test_from_vllm_maps_releases_to_their_rules() -> None:
    from aio_mclookup import InvalidRequest, UnsupportedLayout
    from aio_mclookup._layout.from_vllm import running_release

    assert running_release("0.32.0") == "0.32.0"
    assert running_release("0.32.1+cpu") == "0.32.0"
    assert running_release("0.33.0") == "0.33.0"
    for other in ("0.26.0", "0.31.2", "0.34.0", "1.0.0"):
        with pytest.raises(UnsupportedLayout, match=r"0\.32, 0\.33 only") as info:
            running_release(other)
        assert isinstance(info.value, InvalidRequest) and info.value.field == "vllm_version"
