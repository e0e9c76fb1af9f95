"""Overlapped use from threads: planning ahead, swaps of consecutive batches on separate
threads, write-backs deferred to other threads with injected delays. Still bitwise exact."""

from __future__ import annotations

import random
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from rec_helpers import (assert_same_tables, build_pair, loss_coefficients, make_kjt, make_tables,
                         max_unique_per_table, zipf_batches)
from torchrec import KeyedJaggedTensor

from torchpipe.rec import SGD, Adam, BatchPlan, CacheAbortedError, CachedEmbeddingBagCollection, HostEmbeddingTable

TIMEOUT = 20.0


def delayed_write_backs(model: CachedEmbeddingBagCollection, seed: int, max_delay: float) -> None:
    """Make every write-back of evicted rows late by a random delay (instance-level patch)."""
    rng = random.Random(seed)
    original = model.write_back

    def slow_write_back(plan: BatchPlan, rows: dict[str, torch.Tensor]) -> None:
        time.sleep(rng.uniform(0, max_delay))
        original(plan, rows)

    model.write_back = slow_write_back  # type: ignore[method-assign]


def run_overlapped(cached: CachedEmbeddingBagCollection, reference, batches: list[KeyedJaggedTensor],
                   depth: int) -> None:
    """A hand-made pipeline: plan up to ``depth`` batches ahead; swap-in on 2 threads, write-back on 2 more."""
    coefs = loss_coefficients(cached.layouts[0].dim * 4, batches[0].stride(), len(batches))
    swappers, writers = ThreadPoolExecutor(2), ThreadPoolExecutor(2)
    write_futures: list[Future] = []

    def swap_in(plan: BatchPlan) -> None:
        rows = cached.gather_out(plan)
        write_futures.append(writers.submit(cached.write_back, plan, rows))
        cached.scatter_in(plan, cached.fetch_in(plan))

    planned: list[tuple[BatchPlan, Future]] = []
    next_batch = 0
    try:
        for step, kjt in enumerate(batches):
            while next_batch < len(batches) and len(planned) < depth:
                plan = cached.plan(cached.prepare(batches[next_batch]))
                planned.append((plan, swappers.submit(swap_in, plan)))
                next_batch += 1
            plan, swapped = planned.pop(0)
            swapped.result(TIMEOUT)
            out, ref = cached(kjt, plan), reference(kjt)
            assert torch.equal(out.values(), ref.values()), f"outputs differ at step {step}"
            loss, ref_loss = (out.values() * coefs[step]).sum(), (ref.values() * coefs[step]).sum()
            assert torch.equal(loss, ref_loss)
            loss.backward()
            ref_loss.backward()
            cached.release(plan)
        for f in write_futures:
            f.result(TIMEOUT)
    finally:
        cached.abort(RuntimeError("test over"))  # never leave a thread blocked
        swappers.shutdown(wait=True)
        writers.shutdown(wait=True)
        cached.clear_abort()
    assert cached.in_flight() == 0 and cached.pending_writes() == 0
    assert_same_tables(cached, reference)


@pytest.mark.parametrize("optimizer", [SGD(lr=1.0), Adam(lr=0.5)], ids=["sgd", "adam"])
@pytest.mark.parametrize("depth", [2, 3])
def test_overlapped_zipf_stream_is_exact(optimizer, depth: int) -> None:
    tables = make_tables()
    batches = zipf_batches(tables, 80, seed=depth)
    cached, reference = build_pair(tables, depth * max_unique_per_table(tables, batches), optimizer)
    delayed_write_backs(cached, seed=depth, max_delay=0.01)
    run_overlapped(cached, reference, batches, depth)
    assert cached.cache_stats()["t0"].swapped_out > 0


def cycling_batches(tables, cycles: int) -> list[KeyedJaggedTensor]:
    """Key sets A, B, C, A, B, C...: with 2 batches in flight and room for 2, every plan
    evicts the keys the next batch needs (evicted at i, needed at i+1)."""
    sets = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    batches = []
    for i in range(3 * cycles):
        k = sets[i % 3]
        bags = {f: [k, k[:1]] for t in tables for f in t.feature_names}
        batches.append(make_kjt(tables, bags))
    return batches


def test_evicted_at_i_needed_at_i_plus_1_with_slow_write_backs() -> None:
    tables = make_tables(num_rows=(12, 12))
    batches = cycling_batches(tables, 6)
    cached, reference = build_pair(tables, 6, SGD(lr=1.0))
    delayed_write_backs(cached, seed=0, max_delay=0.05)
    run_overlapped(cached, reference, batches, depth=2)
    assert cached.cache_stats()["t0"].hits == 0  # all-miss stream


def test_disabling_the_ordering_breaks_exactness(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above is sensitive: without the ticket wait, stale rows are read."""
    monkeypatch.setattr(HostEmbeddingTable, "_wait_for_writes", lambda self, keys, before_seq: None)
    tables = make_tables(num_rows=(12, 12))
    batches = cycling_batches(tables, 4)
    cached, reference = build_pair(tables, 6, SGD(lr=1.0))
    delayed_write_backs(cached, seed=0, max_delay=0.05)
    with pytest.raises((AssertionError, RuntimeError)):
        run_overlapped(cached, reference, batches, depth=2)


def test_failed_write_back_wakes_the_waiting_swap_via_abort() -> None:
    tables = make_tables(num_rows=(12, 12))
    batches = cycling_batches(tables, 2)
    cached, _ = build_pair(tables, 6, SGD(lr=1.0))
    plans = [cached.plan(cached.prepare(b)) for b in batches[:2]]
    for p in plans:  # A and B are in, nothing to write back yet
        cached.swap(p)
        cached.release(p)
    plan_c = cached.plan(cached.prepare(batches[2]))  # evicts A
    cached.gather_out(plan_c)  # ... and its write-back "fails": never lands
    plan_a = cached.plan(cached.prepare(batches[3]))  # needs A back
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(cached.fetch_in, plan_a)
        time.sleep(0.1)
        assert not waiting.done()  # blocked on the earlier write-back, as it must be
        cause = OSError("write-back failed")
        cached.abort(cause)
        with pytest.raises(CacheAbortedError) as info:
            waiting.result(TIMEOUT)
        assert info.value.__cause__ is cause
