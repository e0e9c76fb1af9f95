"""EmbeddingCache bookkeeping: invariants, eviction policies, protection, the too-small error."""

from __future__ import annotations

import pytest
import torch

from torchpipe.rec import CacheTooSmallError, EmbeddingCache


def keys(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def snapshot(cache: EmbeddingCache) -> tuple:
    return (cache.slot_of_key.clone(), cache.key_of_slot.clone(), cache._protect_count.clone(),
            cache._last_used.clone(), cache._freq_of_key.clone(), cache.stats.plans, cache._seq)


def assert_unchanged(before: tuple, after: tuple) -> None:
    for a, b in zip(before, after):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_all_miss_then_all_hit() -> None:
    cache = EmbeddingCache(10, 4)
    plan = cache.plan_swap(keys(1, 2, 3))
    assert plan.misses == 3 and plan.hits == 0 and plan.swap_out_keys.numel() == 0
    cache.release(plan)
    plan = cache.plan_swap(keys(1, 2, 3))
    assert plan.hits == 3 and plan.swap_in_keys.numel() == 0 and plan.swap_out_keys.numel() == 0
    cache.release(plan)
    assert cache.stats.hits == 3 and cache.stats.misses == 3 and cache.stats.hit_rate == 0.5


def test_batch_exactly_fills_cache_then_evicts_all() -> None:
    cache = EmbeddingCache(10, 3)
    first = cache.plan_swap(keys(0, 1, 2))
    cache.release(first)
    second = cache.plan_swap(keys(3, 4, 5))  # exactly fills again: everything goes
    assert sorted(second.swap_out_keys.tolist()) == [0, 1, 2]
    assert sorted(second.swap_in_slots.tolist()) == [0, 1, 2]
    cache.release(second)
    third = cache.plan_swap(keys(0, 1, 2))  # evicted at i, needed at i+1
    assert sorted(third.swap_in_keys.tolist()) == [0, 1, 2]
    assert sorted(third.swap_out_keys.tolist()) == [3, 4, 5]
    cache.release(third)


def test_lru_evicts_least_recently_used() -> None:
    cache = EmbeddingCache(10, 3, "lru")
    for k in (0, 1, 2):
        cache.release(cache.plan_swap(keys(k)))
    cache.release(cache.plan_swap(keys(0)))  # 1 is now the oldest
    plan = cache.plan_swap(keys(5))
    assert plan.swap_out_keys.tolist() == [1]
    cache.release(plan)


def test_lfu_evicts_least_frequent_and_keeps_counts_across_evictions() -> None:
    cache = EmbeddingCache(10, 3, "lfu")
    for batch in ([0, 1, 2], [0, 1], [0, 2]):
        cache.release(cache.plan_swap(torch.tensor(batch)))
    plan = cache.plan_swap(keys(7))  # frequencies 0:3, 1:2, 2:2 -> 1 (older among the 2s)
    assert plan.swap_out_keys.tolist() == [1]
    cache.release(plan)
    plan = cache.plan_swap(keys(8))  # 7 has frequency 1: lowest
    assert plan.swap_out_keys.tolist() == [7]
    cache.release(plan)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_protected_keys_are_never_evicted(policy: str) -> None:
    cache = EmbeddingCache(20, 4, policy)
    in_flight = cache.plan_swap(keys(0, 1))  # not released: batch i still in flight
    later = cache.plan_swap(keys(2, 3))
    cache.release(later)
    nxt = cache.plan_swap(keys(4, 5))  # must evict 2, 3, never 0, 1
    assert sorted(nxt.swap_out_keys.tolist()) == [2, 3]
    assert bool(cache.is_cached(keys(0, 1)).all())
    cache.release(nxt)
    cache.release(in_flight)
    assert cache.protected_slots() == 0


def test_too_small_raises_with_numbers_before_any_change() -> None:
    cache = EmbeddingCache(20, 4)
    in_flight = cache.plan_swap(keys(0, 1, 2))
    before = snapshot(cache)
    with pytest.raises(CacheTooSmallError) as info:
        cache.plan_swap(keys(5, 6))
    err = info.value
    assert (err.cache_rows, err.keys_requested, err.keys_protected, err.slots_available) == (4, 2, 3, 1)
    assert "cache_rows=4" in str(err) and "protected by in-flight batches=3" in str(err)
    assert "Raise cache_rows to at least 5 or keep fewer batches in flight." in str(err)
    assert isinstance(err, RuntimeError)
    assert_unchanged(before, snapshot(cache))
    with pytest.raises(CacheTooSmallError):
        cache.check_fits(keys(5, 6))
    assert_unchanged(before, snapshot(cache))
    # Review: a key both requested and protected was counted twice in the advice (6, where 5
    # rows hold the union {0, 1, 2, 3, 4}).
    with pytest.raises(CacheTooSmallError, match=r"at least 5 or keep") as info:
        cache.plan_swap(keys(2, 3, 4))
    assert info.value.rows_needed == 5
    twin = EmbeddingCache(20, 5)
    twin.plan_swap(keys(0, 1, 2))
    twin.plan_swap(keys(2, 3, 4))  # and 5 rows do hold it
    cache.release(in_flight)
    with pytest.raises(CacheTooSmallError, match=r"at least 5\.$"):  # nothing in flight: no advice about it
        cache.plan_swap(keys(0, 1, 2, 3, 4))
    cache.release(cache.plan_swap(keys(5, 6)))  # fits once released


def test_bad_keys_and_double_release() -> None:
    cache = EmbeddingCache(10, 4)
    for bad in (keys(10), keys(-1), keys(1, 1), torch.tensor([1.0])):
        with pytest.raises(ValueError):
            cache.plan_swap(bad)
    plan = cache.plan_swap(keys(1))
    cache.release(plan)
    with pytest.raises(RuntimeError):
        cache.release(plan)
    with pytest.raises(ValueError):
        EmbeddingCache(10, 4, "fifo")


def test_random_stream_invariants() -> None:
    g = torch.Generator().manual_seed(3)
    cache = EmbeddingCache(50, 12, "lfu")
    in_flight = []
    for _ in range(300):
        batch = torch.unique(torch.randint(0, 50, (5,), generator=g))
        was_cached = cache.slot_of_key >= 0
        plan = cache.plan_swap(batch)
        assert not set(plan.swap_out_keys.tolist()) & set(batch.tolist())
        assert not bool(was_cached[plan.swap_in_keys].any())
        assert torch.equal(cache.key_of_slot[plan.slots_of_keys], batch)
        for other in in_flight:  # nothing in flight was evicted
            assert torch.equal(cache.key_of_slot[other.slots_of_keys], other.unique_keys)
        in_flight.append(plan)
        if len(in_flight) == 2:
            cache.release(in_flight.pop(0))
    for plan in in_flight:
        cache.release(plan)
    assert cache.protected_slots() == 0


def test_distinct_count_equals_the_number_of_unique_keys() -> None:
    """The admission check counts a batch's distinct keys without a sort; the scratch it writes
    holds stale indices from earlier batches, which must not count."""
    cache = EmbeddingCache(1000, 10)
    generator = torch.Generator().manual_seed(0)
    for size, high in ((0, 1000), (1, 1000), (50, 20), (5000, 1000), (3000, 3000 // 4)):
        keys = torch.randint(0, high, (size,), generator=generator)
        assert cache.distinct_count(keys) == torch.unique(keys).numel(), (size, high)
    assert cache.distinct_count(torch.tensor([7, 7, 7, 999, 0, 999])) == 3
