"""PositiveCache: membership is validity; batches expire in order; the size bound holds."""

from __future__ import annotations

from aio_mclookup._cache import PositiveCache


def test_keys_expire_at_send_time_plus_ttl() -> None:
    cache = PositiveCache(ttl=5.0, max_keys=100)
    cache.add([b"a", b"b"], sent_at=10.0)
    cache.expire(14.999)
    assert b"a" in cache and b"b" in cache.members
    cache.expire(15.0)
    assert b"a" not in cache and len(cache) == 0


def test_a_batch_added_late_with_an_earlier_expiry_takes_later_ones_with_it() -> None:
    # RPC X sent at t=1 answers after RPC Y sent at t=0: Y's keys must still go at t=5.
    cache = PositiveCache(ttl=5.0, max_keys=100)
    cache.add([b"x"], sent_at=1.0)
    cache.add([b"y"], sent_at=0.0)
    cache.expire(5.0)
    assert b"y" not in cache
    assert b"x" not in cache  # merged into Y's batch: it expires early, never late
    cache.add([b"z"], sent_at=2.0)
    cache.expire(6.99)
    assert b"z" in cache


def test_a_refreshed_key_may_expire_early_but_never_late() -> None:
    cache = PositiveCache(ttl=5.0, max_keys=100)
    cache.add([b"k"], sent_at=0.0)
    cache.add([b"k"], sent_at=3.0)
    cache.expire(5.0)
    assert b"k" not in cache
    cache.expire(8.0)
    assert len(cache) == 0


def test_size_bound_drops_oldest_batches_to_ninety_percent() -> None:
    cache = PositiveCache(ttl=60.0, max_keys=10)
    for i in range(11):
        cache.add([b"k%d" % i], sent_at=float(i))
    assert len(cache) == 9
    assert b"k0" not in cache and b"k1" not in cache and b"k10" in cache


def test_leading_counts_cached_keys_up_to_the_first_miss() -> None:
    cache = PositiveCache(ttl=5.0, max_keys=100)
    cache.add([b"a", b"b", b"d"], sent_at=0.0)
    assert cache.leading([b"a", b"b", b"c", b"d"]) == 2
    assert cache.leading(iter([b"c", b"a"])) == 0
    assert cache.leading([]) == 0
    cache.add([], sent_at=1.0)
    assert len(cache) == 3
