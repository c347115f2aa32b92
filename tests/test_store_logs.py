"""The Mooncake client's log lines (aio_mclookup._store.logs): a writer and a store opened on a
real master print nothing to stderr by default (33 lines without the policy, two at error
level), everything with ``AIO_MCLOOKUP_MOONCAKE_LOGS=1``; a line a normal setup does not print
is kept."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from aio_mclookup._store import logs

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    import aio_mclookup as mcl

    async def main(master, metadata):
        async with mcl.StoreWriter(master, metadata) as writer:
            await writer.put_keys(["k1"])
            async with mcl.MooncakeStore(master, metadata) as store:
                print(await store.batch_is_exist(["k1", "k2"]))

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)
GLOG = re.compile(r"^[IWEF]\d{4} ", re.MULTILINE)


def run(local_master: Any, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("MC_LOG_LEVEL", logs.LOGS_SWITCH)}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, local_master.master_address, local_master.metadata_server],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **env},
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.integration
def test_clients_are_quiet_by_default_and_loud_with_the_switch(local_master: Any) -> None:
    pytest.importorskip("mooncake.store")
    quiet = run(local_master)
    assert quiet.returncode == 0 and quiet.stdout.strip() == "[1, 0]", quiet.stderr
    assert quiet.stderr == "", quiet.stderr
    loud = run(local_master, **{logs.LOGS_SWITCH: "1"})
    assert loud.returncode == 0 and loud.stdout.strip() == "[1, 0]", loud.stderr
    assert len(GLOG.findall(loud.stderr)) >= 10 and "metadata not found" in loud.stderr
    own_level = run(local_master, MC_LOG_LEVEL="WARNING")  # the process's own setting stands
    assert "metadata not found" in own_level.stderr
    assert " client_service.cpp" not in own_level.stderr  # (INFO lines)


def test_setup_output_drops_only_the_lines_every_setup_prints(
    capfd: pytest.CaptureFixture[str],
) -> None:
    expected = (
        "WARNING: Logging before InitGoogleLogging() is written to STDERR\n"
        "E1204 01:27:09.541132  2762 transfer_metadata_plugin.cpp:292] GET http://127.0.0.1:1/"
        "metadata?key=mooncake%2Fram%2F127.0.0.1%3A14243 http=404 body: metadata not found\n"
    )
    other = "E1204 01:27:09.6  2762 client.cpp:1] something else went wrong\n"
    with logs.setup_output(True):
        os.write(2, (expected + other).encode())
    assert capfd.readouterr().err == other
    with logs.setup_output(False):
        os.write(2, expected.encode())
    assert capfd.readouterr().err == expected


def test_quiet_unless_switched_on_or_the_level_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MC_LOG_LEVEL", raising=False)
    monkeypatch.delenv(logs.LOGS_SWITCH, raising=False)
    assert logs.quiet_settings() == {"MC_LOG_LEVEL": "ERROR"}
    for value in ("1", "yes"):
        monkeypatch.setenv(logs.LOGS_SWITCH, value)
        assert logs.quiet_settings() == {}
    monkeypatch.setenv(logs.LOGS_SWITCH, "0")
    assert logs.quiet_logs()
    monkeypatch.setenv("MC_LOG_LEVEL", "INFO")
    assert not logs.quiet_logs()
