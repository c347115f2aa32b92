"""The benchmarks' own switches, which reach into the coordinator's internals (a change there
must not leave a benchmark measuring something else, or crashing). The benchmarks themselves
run outside the suite (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
from benchmarks import bench_epochs

from aio_mclookup import FakeStore, LookupCoordinator
from helpers import chain


@pytest.mark.parametrize("check", [True, False])
async def test_bench_epochs_turns_the_epoch_check_on_and_off(check: bool) -> None:
    layout = bench_epochs.CHAT
    hashes = chain(4, b"bench-epochs")
    store = FakeStore(layout.plan(64, hashes).keys)
    async with LookupCoordinator(layout, store) as coord:
        bench_epochs._set_check(coord, store if check else None)
        assert await coord.lookup(64, hashes) == 48  # (vLLM leaves the last block to compute)
        store.restart()  # the cache still holds the prompt; the master lost it
        assert await coord.lookup(64, hashes) == (0 if check else 48)
        assert coord.stats().epoch_changes_total == (1 if check else 0)
