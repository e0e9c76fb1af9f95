"""Training through a small cache equals full-table training, bitwise, step by step."""

from __future__ import annotations

import gc

import pytest
import torch
from rec_helpers import (assert_same_tables, build_pair, cached_masks, check_plan_invariants, integer_weights,
                         loss_coefficients, make_tables, max_unique_per_table, zipf_batches)

from torchpipe.rec import (SGD, Adam, CachedEmbeddingBagCollection, CacheTooSmallError,
                           FullTableEmbeddingBagCollection, RowWiseAdagrad)

OPTIMIZERS = {"sgd": SGD(lr=1.0), "adagrad": RowWiseAdagrad(lr=0.5), "adam": Adam(lr=0.5),
              "sgd-decay": SGD(lr=1.0, weight_decay=0.125),
              "adagrad-decoupled-decay": RowWiseAdagrad(lr=0.5, weight_decay=0.25, weight_decay_mode="decoupled"),
              "adam-decay": Adam(lr=0.5, weight_decay=0.25)}
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
    gc.collect()
    gc.disable()  # a graph must die with its last reference: a CacheTooSmallError's traceback
    try:          # cycle kept a failed lookup's frame, and the graph made there, until a collection
        for kjt in batches:
            out = cached(kjt)  # grad enabled, never backward
            assert torch.equal(out.values(), reference(kjt).values())
        cached.flush()  # the last lookup's graph is alive: a backward may still come, it stays protected
        assert cached.in_flight() > 0
        del out
        cached.flush()
        assert cached.in_flight() == 0
    finally:
        gc.enable()
    assert_same_tables(cached, reference)


def test_inference_mode_and_a_float64_default_dtype_give_the_float32_tables_results() -> None:
    """The tables are float32 (TorchRec's FP32) whatever the caller's mode or default dtype."""
    tables = make_tables()
    batches = zipf_batches(tables, 6, seed=11)
    weights = {name: w.double() for name, w in integer_weights(tables).items()}  # cast, as load_state_dict
    model = CachedEmbeddingBagCollection(tables, 12, optimizer=SGD(lr=0.5), weights=weights)
    reference = FullTableEmbeddingBagCollection(tables, optimizer=SGD(lr=0.5), weights=weights)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for kjt in batches:
            with torch.inference_mode():  # used to fail reading an inference tensor's version
                assert torch.equal(model(kjt).values(), reference(kjt).values())
            out, want = model(kjt).values(), reference(kjt).values()
            assert out.dtype == want.dtype == torch.float32 and torch.equal(out, want)
            out.sum().backward()
            want.sum().backward()
    finally:
        torch.set_default_dtype(previous)
    for name in ("t0", "t1"):
        assert torch.equal(model.full_weight(name), reference.full_weight(name))


def test_a_table_that_is_not_fp32_is_refused() -> None:
    from torchrec.types import DataType

    tables = make_tables()
    tables[1].data_type = DataType.FP16
    with pytest.raises(ValueError, match="table 't1': data_type .*FP16.* float32"):
        CachedEmbeddingBagCollection(tables, 12)
