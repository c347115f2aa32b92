"""PositiveCache: membership is validity; batches expire by their own time; the size bound."""

from __future__ import annotations

from aio_mclookup._cache import PositiveCache


def test_keys_expire_at_their_expiry() -> None:
    cache = PositiveCache()
    cache.add([b"a", b"b"], expiry=15.0, max_keys=100)
    cache.expire(14.999)
    assert b"a" in cache and b"b" in cache.members
    cache.expire(15.0)
    assert b"a" not in cache and len(cache) == 0


def test_batches_added_out_of_order_expire_by_their_own_time() -> None:
    # RPC X sent at t=1 answers before RPC Y sent at t=0 (they run in parallel).
    cache = PositiveCache()
    cache.add([b"x"], expiry=6.0, max_keys=100)
    cache.add([b"y"], expiry=5.0, max_keys=100)
    cache.expire(5.0)
    assert b"y" not in cache and b"x" in cache
    cache.expire(6.0)
    assert len(cache) == 0


def test_a_key_in_two_batches_goes_with_the_first_to_expire() -> None:
    cache = PositiveCache()
    cache.add([b"k"], expiry=5.0, max_keys=100)
    cache.add([b"k"], expiry=8.0, max_keys=100)
    cache.expire(5.0)
    assert b"k" not in cache  # early, never late
    cache.expire(8.0)
    assert len(cache) == 0


def test_size_bound_drops_first_expiring_batches_to_ninety_percent() -> None:
    cache = PositiveCache()
    for i in range(11):
        cache.add([b"k%d" % i], expiry=60.0 + i, max_keys=10)
    assert len(cache) == 9
    assert b"k0" not in cache and b"k1" not in cache and b"k10" in cache


def test_a_late_batch_leaves_the_others_alone() -> None:
    """A slow RPC answered after thousands of later ones neither takes their keys with it
    (emptying the cache when it expires) nor touches them when added."""
    cache = PositiveCache()
    for i in range(4000):
        cache.add([b"%d-%d" % (i, j) for j in range(100)], expiry=10.0 + i, max_keys=10**7)
    cache.add([b"late"], expiry=5.0, max_keys=10**7)
    cache.expire(5.0)
    assert b"late" not in cache and len(cache) == 400_000


def test_leading_counts_cached_keys_up_to_the_first_miss() -> None:
    cache = PositiveCache()
    cache.add([b"a", b"b", b"d"], expiry=5.0, max_keys=100)
    assert cache.leading([b"a", b"b", b"c", b"d"]) == 2
    assert cache.leading(iter([b"c", b"a"])) == 0
    assert cache.leading([]) == 0
    cache.add([], expiry=1.0, max_keys=100)
    assert len(cache) == 3
