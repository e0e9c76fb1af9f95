"""Training through a small cache equals full-table training, bitwise, step by step."""

from __future__ import annotations

import pytest
import torch
from rec_helpers import (assert_same_tables, build_pair, cached_masks, check_plan_invariants, loss_coefficients,
                         make_tables, max_unique_per_table, zipf_batches)

from torchpipe.rec import SGD, Adam, CacheTooSmallError, RowWiseAdagrad

OPTIMIZERS = {"sgd": SGD(lr=1.0), "adagrad": RowWiseAdagrad(lr=0.5), "adam": Adam(lr=0.5)}
STEPS = 200


def train_compare(tables, batches, cached, reference, explicit_steps: bool) -> None:
    coefs = loss_coefficients(cached.layouts[0].dim * 4, 4, len(batches))
    for step, kjt in enumerate(batches):
        if explicit_steps:
            keys = cached.prepare(kjt)
            before = cached_masks(cached)
            plan = cached.plan(keys)
            check_plan_invariants(cached, plan, before)
            cached.swap(plan)
            out = cached(kjt, plan)
        else:
            out = cached(kjt)
        ref = reference(kjt)
        assert out.keys() == ref.keys()
        assert torch.equal(out.values(), ref.values()), f"outputs differ at step {step}"
        loss, ref_loss = (out.values() * coefs[step]).sum(), (ref.values() * coefs[step]).sum()
        assert torch.equal(loss, ref_loss), f"losses differ at step {step}"
        loss.backward()
        ref_loss.backward()
        if explicit_steps:
            cached.release(plan)
    assert cached.in_flight() == 0 and cached.pending_writes() == 0
    assert_same_tables(cached, reference)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("size", ["minimal", "half", "whole"])
def test_cache_training_equals_full_table(optimizer: str, policy: str, size: str) -> None:
    tables = make_tables()
    batches = zipf_batches(tables, STEPS, seed=len(optimizer) * 7 + len(policy) + len(size) * 3)
    minimal = max_unique_per_table(tables, batches)
    rows = {"minimal": minimal, "half": max(minimal, 20), "whole": 40}[size]
    cached, reference = build_pair(tables, rows, OPTIMIZERS[optimizer], policy)
    train_compare(tables, batches, cached, reference, explicit_steps=(size != "half"))
    stats = cached.cache_stats()
    if size == "minimal":
        assert stats["t0"].swapped_out > 0  # the small cache really evicted
    assert stats["t0"].hits + stats["t0"].misses == sum(
        int(cached.prepare(b).tables["t0"].unique_keys.numel()) for b in batches)


def test_one_row_less_than_minimal_is_refused() -> None:
    tables = make_tables()
    batches = zipf_batches(tables, 50)
    minimal = max_unique_per_table(tables, batches)
    cached, reference = build_pair(tables, minimal - 1, SGD(lr=1.0))
    with pytest.raises(CacheTooSmallError):
        for kjt in batches:
            cached(kjt).values().sum().backward()


def two_batch_minimum(tables, batches) -> int:
    """Least cache rows that hold the unique keys of every two consecutive batches together."""
    best = 0
    for pair in zip(batches, batches[1:]):
        dicts = [kjt.to_dict() for kjt in pair]
        for table in tables:
            keys = torch.cat([d[f].values() for d in dicts for f in table.feature_names])
            best = max(best, int(torch.unique(keys).numel()))
    return best


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_lookups_in_one_backward_equal_full_table(optimizer: str) -> None:
    """Two towers read one collection and share one loss. The second lookup released the
    first one's keys, whose backward then raised StaleBatchError after the second's update."""
    tables = make_tables()
    batches = zipf_batches(tables, 40, seed=5)
    cached, reference = build_pair(tables, two_batch_minimum(tables, batches), OPTIMIZERS[optimizer], "lru")
    coefs = loss_coefficients(cached.layouts[0].dim * 4, 4, len(batches))
    for step in range(len(batches) - 1):
        first, second = batches[step], batches[step + 1]
        out = (cached(first).values() * coefs[step]).sum() + (cached(second).values() * coefs[step + 1]).sum()
        ref = (reference(first).values() * coefs[step]).sum() + (reference(second).values() * coefs[step + 1]).sum()
        assert torch.equal(out, ref), f"losses differ at step {step}"
        out.backward()
        ref.backward()
    assert cached.in_flight() == 0 and cached.cache_stats()["t0"].swapped_out > 0
    assert_same_tables(cached, reference)


def test_an_evaluation_loop_without_no_grad_still_runs_at_the_one_batch_minimum() -> None:
    """The previous lookup's graph is alive while the next one plans (``loss`` is rebound after
    the call): with no room for both, the previous one goes stale, as before, instead of failing."""
    tables = make_tables()
    batches = zipf_batches(tables, 30, seed=6)
    cached, reference = build_pair(tables, max_unique_per_table(tables, batches), OPTIMIZERS["sgd"], "lru")
    for kjt in batches:
        out = cached(kjt)  # grad enabled, never backward
        assert torch.equal(out.values(), reference(kjt).values())
    cached.flush()
    assert cached.in_flight() == 0
    assert_same_tables(cached, reference)
