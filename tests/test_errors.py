"""The error tree: everything derives from ``Error`` and from the standard exception it is a
kind of; ``InvalidRequest`` names its field; ``error_label`` is the one table of labels."""

from __future__ import annotations

import pytest

import aio_mclookup as mcl
from aio_mclookup._errors import error_label


@pytest.mark.parametrize(
    ("error", "standard"),
    [
        (mcl.InvalidRequest("x"), ValueError),
        (mcl.LookupTimeout("x"), TimeoutError),
        (mcl.InternalError("x"), RuntimeError),
        (mcl.StoreError("x", code=-900), Exception),
        (mcl.Overloaded("x"), Exception),
        (mcl.ClosedError("x"), Exception),
    ],
)
def test_every_error_is_ours_and_its_standard_kind(error: Exception, standard: type) -> None:
    assert isinstance(error, mcl.Error) and isinstance(error, standard)


def test_invalid_request_names_its_field() -> None:
    assert mcl.InvalidRequest("bad").field is None
    error = mcl.InvalidRequest("timeout must be > 0", field="timeout")
    assert error.field == "timeout" and str(error) == "timeout must be > 0"


@pytest.mark.parametrize(
    ("error", "label"),
    [
        (mcl.StoreError("down", code=-900), "-900"),
        (mcl.StoreError("raised"), "exception"),
        (mcl.LookupTimeout("late"), "timeout"),
        (mcl.Overloaded("full"), "overloaded"),
        (mcl.ClosedError("closed"), "closed"),
        (mcl.InvalidRequest("bad"), "invalid_request"),
        (mcl.InternalError("bug"), "internal"),
        (KeyError("other"), "KeyError"),
    ],
)
def test_error_labels(error: BaseException, label: str) -> None:
    assert error_label(error) == label


def test_a_layout_error_names_the_field() -> None:
    with pytest.raises(mcl.InvalidRequest) as info:
        mcl.KVLayout([mcl.FullAttention(16)], model="m", hash_block_size=0,
                     scheduler_block_size=16)
    assert info.value.field == "hash_block_size"


def test_a_failed_rpc_says_its_code_once() -> None:
    """A store whose RPC fails as Mooncake's does (every key the same negative code): the
    caller's error names the code's meaning and its number, each once."""
    import asyncio

    from aio_mclookup._store.codes import raise_if_failed_rpc

    class Failing(mcl.FakeStore):
        async def batch_is_exist(self, keys):  # type: ignore[no-untyped-def, override]
            raise_if_failed_rpc("batch_is_exist", [-900] * len(keys))

    layout = mcl.KVLayout([mcl.FullAttention(16)], model="m", hash_block_size=16,
                          scheduler_block_size=16)

    async def run() -> str:
        async with mcl.LookupCoordinator(layout, Failing()) as coordinator:
            with pytest.raises(mcl.StoreError) as info:
                await coordinator.lookup(64, [bytes([i]) * 32 for i in range(4)])
        assert info.value.code == -900
        return str(info.value)

    message = asyncio.run(run())
    assert message.count("-900") == 1 and message.count("RPC_FAIL") == 1, message
