"""``etcd://`` master addresses without an etcd: parsing, the fast failure against
unreachable endpoints, and the one-endpoint-string rule of in-process clients. (Against a
real etcd and HA masters: test_ha.py.)"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import aio_mclookup as mcl
from aio_mclookup._store.etcd import etcd_endpoints, view_key


def test_etcd_addresses_parse_and_others_are_not_etcd() -> None:
    assert etcd_endpoints("etcd://127.0.0.1:2379") == [("127.0.0.1", 2379)]
    assert etcd_endpoints("etcd://a:1; b:2;[::1]:3") == [("a", 1), ("b", 2), ("::1", 3)]
    assert etcd_endpoints("127.0.0.1:50051") is None
    for bad in ("etcd://", "etcd://host", "etcd://h:0", "etcd://h:1;", "etcd://:5"):
        with pytest.raises(mcl.InvalidRequest, match="etcd://HOST:PORT"):
            etcd_endpoints(bad)
    with pytest.raises(mcl.InvalidRequest):
        mcl.MooncakeStore("etcd://nope", "http://127.0.0.1:1/metadata")


def test_the_view_key_follows_the_cluster_id(monkeypatch: pytest.MonkeyPatch) -> None:
    assert view_key() == "mooncake-store/mooncake_cluster/master_view"
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", "blue")
    assert view_key() == "mooncake-store/blue/master_view"


def test_an_etcd_address_isolates_the_client_unless_told() -> None:
    assert mcl.MooncakeStore("etcd://127.0.0.1:1", "P2PHANDSHAKE").isolated
    assert not mcl.MooncakeStore("etcd://127.0.0.1:1", "P2PHANDSHAKE", isolate=False).isolated
    assert not mcl.MooncakeStore("127.0.0.1:1", "P2PHANDSHAKE").isolated
    assert mcl.MooncakeStore("127.0.0.1:1", "P2PHANDSHAKE", isolate=True).isolated


async def test_unreachable_etcd_endpoints_fail_open_fast() -> None:
    store = mcl.MooncakeStore("etcd://127.0.0.1:1;127.0.0.1:2", "P2PHANDSHAKE")
    started = time.monotonic()
    with pytest.raises(mcl.StoreError, match="no etcd endpoint") as err:
        await store.open()
    assert err.value.code == -900 and time.monotonic() - started < 1.0
    assert store.closed


def test_in_process_clients_take_one_etcd_string_per_process() -> None:
    # (in a child: the claim is process-wide, and this test process must keep none)
    script = (
        "import aio_mclookup as mcl\n"
        "from aio_mclookup._store.etcd import claim_endpoints\n"
        "claim_endpoints('etcd://127.0.0.1:2379')\n"
        "claim_endpoints('etcd://127.0.0.1:2379')\n"
        "try:\n"
        "    claim_endpoints('etcd://localhost:2379')\n"
        "except mcl.InvalidRequest as exc:\n"
        "    print('refused:', exc.field, exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60,
                          check=True)
    out = done.stdout.decode()
    assert out.startswith("refused: master_address this process already uses")
    assert "'etcd://127.0.0.1:2379'" in out and "'etcd://localhost:2379'" in out


def test_the_client_is_built_with_an_rpc_connect_timeout() -> None:
    store = mcl.MooncakeStore("127.0.0.1:1", "P2PHANDSHAKE", connect_timeout=0.25)
    settings = store._client_settings()
    assert settings["MC_RPC_CONNECT_TIMEOUT_MS"] == "250"
    assert settings["MC_RPC_TIMEOUT_MS"] == "2000"
    with pytest.raises(mcl.InvalidRequest, match="connect_timeout"):
        mcl.MooncakeStore("127.0.0.1:1", "P2PHANDSHAKE", connect_timeout=0)
