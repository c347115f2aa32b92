"""SGLangLayout (``_layout/sglang.py``, ``_layout/sglang_geometry.py``): the deployment's keys
as docs/sglang.md tabulates them, the dict form, and what is refused."""

from __future__ import annotations

from typing import Any

import pytest

from aio_mclookup import InvalidRequest, SGLangLayout

H = "ab" * 32


def keys_of_page(layout: SGLangLayout) -> list[str]:
    return [layout.key_prefix + H + suffix for suffix in layout.key_suffixes]


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"model_name": "Qwen/Qwen3-8B", "tp_size": 2},
         [f"Qwen-Qwen3-8B_{H}_{r}_{kv}" for r in (0, 1) for kv in "kv"]),
        ({"model_name": "Qwen/Qwen3-8B", "tp_size": 2, "pp_size": 2},
         [f"Qwen-Qwen3-8B_{H}_{r}_{p}_{kv}" for p in (0, 1) for r in (0, 1) for kv in "kv"]),
        ({"model_name": "deepseek-ai/DeepSeek-V3", "tp_size": 8, "mla": True},
         [f"deepseek-ai-DeepSeek-V3_{H}__k"]),
        ({"model_name": "deepseek-ai/DeepSeek-V3", "tp_size": 8, "mla": True, "pp_size": 2},
         [f"deepseek-ai-DeepSeek-V3_{H}_0_k", f"deepseek-ai-DeepSeek-V3_{H}_1_k"]),
        ({"model_name": "Qwen/Qwen3-8B", "tp_size": 2, "tp_lcm_size": 4,
          "hicache_mem_layout": "page_head", "extra_backend_tag": "tenantA"},
         [f"tenantA_Qwen-Qwen3-8B_{H}_{v}_{kv}" for v in range(4) for kv in "kv"]),
        ({"model_name": "Qwen/Qwen3-8B", "tp_size": 2, "tp_lcm_size": 4},  # (not page_head)
         [f"Qwen-Qwen3-8B_{H}_{r}_{kv}" for r in (0, 1) for kv in "kv"]),
        ({"model_name": "/models/qwen3", "extra_backend_tag": ""}, [f"_-models-qwen3_{H}_0_k",
                                                                    f"_-models-qwen3_{H}_0_v"]),
        ({"extra_backend_tag": ""}, [f"_{H}_0_k", f"_{H}_0_v"]),
        ({}, [f"{H}_0_k", f"{H}_0_v"]),
        ({"model_name": ""}, [f"{H}_0_k", f"{H}_0_v"]),
    ],
)
def test_keys_of_one_page(fields: dict[str, Any], want: list[str]) -> None:
    layout = SGLangLayout(sglang_version="0.5.23", page_size=64, **fields)
    assert keys_of_page(layout) == want
    assert layout.keys_per_page == len(want)


def test_split_heads() -> None:
    def split(**fields: Any) -> int:
        return SGLangLayout(sglang_version="0.5.20", page_size=16, **fields).heads_split

    assert split(tp_size=2, tp_lcm_size=8, hicache_mem_layout="page_head") == 4
    assert split(tp_size=2, tp_lcm_size=2, hicache_mem_layout="page_head") == 1
    assert split(tp_size=2, tp_lcm_size=8, hicache_mem_layout="page_head", mla=True) == 1
    assert split(tp_size=2, tp_lcm_size=8, hicache_mem_layout="page_first") == 1
    assert split(tp_size=2, tp_lcm_size=0, hicache_mem_layout="page_head") == 1  # (unset)
    assert split(tp_size=3, tp_lcm_size=0, hicache_mem_layout="page_head", mla=True) == 1


def test_dict_round_trip_and_equality() -> None:
    cfg = {"engine": "sglang", "sglang_version": "0.5.17", "page_size": 32,
           "model_name": "org/m", "tp_size": 4, "pp_size": 2, "eagle": True,
           "prefetch_threshold": 0, "extra_backend_tag": "x"}
    layout = SGLangLayout.from_dict(cfg)
    again = SGLangLayout.from_dict(layout.to_dict())
    assert again == layout and hash(again) == hash(layout)
    assert layout != SGLangLayout.from_dict({**cfg, "prefetch_threshold": 1})
    assert layout.to_dict()["engine"] == "sglang" and layout.engine == "sglang"
    assert "keys_per_page=16" in repr(layout)
    assert SGLangLayout(sglang_version="0.5.23", page_size=1).prefetch_threshold == 256


@pytest.mark.parametrize(
    ("change", "field", "match"),
    [
        ({"sglang_version": "0.5.21"}, "sglang_version", "0.5.17, 0.5.20, 0.5.23"),
        ({"sglang_version": 0.5}, "sglang_version", "not supported"),
        ({"tp_size": 4, "tp_lcm_size": 6}, "tp_lcm_size", "not a multiple of tp_size"),
        ({"tp_size": 8, "tp_lcm_size": 7, "hicache_mem_layout": "page_first"}, "tp_lcm_size",
         "multiple"),
        ({"prefetch_threshold": 256.0}, "prefetch_threshold", "must be an int"),
        ({"prefetch_threshold": None}, "prefetch_threshold", "must be an int"),
        ({"prefetch_threshold": [256]}, "prefetch_threshold", "must be an int"),
        ({"prefetch_threshold": True}, "prefetch_threshold", "must be an int"),
        ({"tp_lcm_size": 4.0}, "tp_lcm_size", "must be an int"),
        ({"dcp_size": 2}, "dcp_size", "decode context parallelism"),
        ({"hybrid_pools": ["swa"]}, "hybrid_pools", "hybrid models"),
        ({"hybrid_pools": "swa"}, "hybrid_pools", "list of pool names"),
        ({"page_size": 0}, "page_size", "positive int"),
        ({"mla": 1}, "mla", "bool"),
        ({"model_name": 3}, "model_name", "str or null"),
        ({"hicache_mem_layout": ""}, "hicache_mem_layout", "non-empty"),
    ],
)
def test_refused(change: dict[str, Any], field: str, match: str) -> None:
    cfg = {"sglang_version": "0.5.23", "page_size": 16, **change}
    with pytest.raises(InvalidRequest, match=match) as info:
        SGLangLayout.from_dict(cfg)
    assert info.value.field == field


def test_from_dict_refuses_other_shapes() -> None:
    with pytest.raises(InvalidRequest, match="mapping"):
        SGLangLayout.from_dict([])  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="unknown SGLang layout field"):
        SGLangLayout.from_dict({"sglang_version": "0.5.23", "page_size": 16, "tp": 2})
    with pytest.raises(InvalidRequest, match="describes an SGLang"):
        SGLangLayout.from_dict({"engine": "vllm", "sglang_version": "0.5.23", "page_size": 1})
    with pytest.raises(InvalidRequest, match="'page_size' is required"):
        SGLangLayout.from_dict({"sglang_version": "0.5.23"})


def test_query_pages() -> None:
    plain = SGLangLayout(sglang_version="0.5.23", page_size=4)
    eagle = SGLangLayout(sglang_version="0.5.23", page_size=4, eagle=True)
    assert [plain.query_pages(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]
    assert [eagle.query_pages(n) for n in (0, 5, 6, 9, 10)] == [0, 0, 1, 1, 2]


def test_namespaces_change_hashes_from_0520_only() -> None:
    tokens = list(range(1, 33))
    for version, differs in (("0.5.17", False), ("0.5.20", True), ("0.5.23", True)):
        layout = SGLangLayout(sglang_version=version, page_size=8)
        plain = layout.page_hashes(tokens)
        assert (layout.page_hashes(tokens, extra_key="lora") != plain) is differs
        assert (layout.page_hashes(tokens, cache_salt="s") != plain) is differs
        assert layout.page_hashes(tokens, extra_key="", cache_salt="") == plain


def test_wide_ids_only_from_0523() -> None:
    tokens = [1 << 40] * 8
    assert len(SGLangLayout(sglang_version="0.5.23", page_size=4).page_hashes(tokens)) == 2
    for version in ("0.5.17", "0.5.20"):
        with pytest.raises(InvalidRequest, match="uint32"):
            SGLangLayout(sglang_version=version, page_size=4).page_hashes(tokens)


def test_rank_slots() -> None:
    mha = SGLangLayout(sglang_version="0.5.23", page_size=4, tp_size=2, pp_size=2)
    assert mha.rank_slots == (((0, 0), (0, 1)), ((1, 0), (2, 3)), ((0, 1), (4, 5)),
                              ((1, 1), (6, 7)))
    split = SGLangLayout(sglang_version="0.5.23", page_size=4, tp_size=2, tp_lcm_size=4,
                         hicache_mem_layout="page_head")
    assert split.rank_slots == (((0, 0), (0, 1, 2, 3)), ((1, 0), (4, 5, 6, 7)))
    mla = SGLangLayout(sglang_version="0.5.23", page_size=4, tp_size=2, pp_size=2, mla=True)
    assert mla.rank_slots == (((0, 0), (0,)), ((1, 0), (0,)), ((0, 1), (1,)), ((1, 1), (1,)))
    for layout in (mha, split, mla):  # every key is some rank's
        assert {j for _, js in layout.rank_slots for j in js} == set(range(layout.keys_per_page))
