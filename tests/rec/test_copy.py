"""copy.deepcopy and torch.save of a CachedEmbeddingBagCollection (review: both raised
"cannot pickle '_thread.RLock' object"; TorchRec's EBC copies fine)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from rec_helpers import SumOfPooled, integer_weights, make_tables, zipf_batches

from torchpipe.rec import Adam, CachedEmbeddingBagCollection


def trained(steps: int = 12) -> tuple[CachedEmbeddingBagCollection, list]:
    tables = make_tables()
    batches = zipf_batches(tables, 2 * steps, seed=4)
    model = CachedEmbeddingBagCollection(tables, 16, optimizer=Adam(lr=0.25), policy="lfu",
                                         weights=integer_weights(tables))
    for kjt in batches[:steps]:
        model(kjt).values().sum().backward()
    return model, batches[steps:]


def assert_equal_collections(a: CachedEmbeddingBagCollection, b: CachedEmbeddingBagCollection) -> None:
    for name in a.hosts:
        assert torch.equal(a.full_weight(name), b.full_weight(name)), name
        assert torch.equal(a.optimizer_state(name), b.optimizer_state(name)), name
        assert a.cache_stats()[name] == b.cache_stats()[name], name
        assert torch.equal(a.caches[name].key_of_slot, b.caches[name].key_of_slot), name


def pickled(model: CachedEmbeddingBagCollection) -> CachedEmbeddingBagCollection:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", [copy.deepcopy, pickled], ids=["deepcopy", "torch.save"])
def test_a_copy_is_the_same_collection_and_trains_on_its_own(how) -> None:
    model, rest = trained()
    own_hook_calls = []
    if how is copy.deepcopy:  # torch.save cannot take a lambda, as for any module
        model.register_forward_pre_hook(lambda module, args: own_hook_calls.append(1))
    twin = how(model)
    assert twin is not model and twin.hosts["t0"].rows.data_ptr() != model.hosts["t0"].rows.data_ptr()
    assert_equal_collections(model, twin)  # the cache's contents and statistics too
    before = {name: model.full_weight(name) for name in model.hosts}
    for kjt in rest[:6]:
        twin(kjt).values().sum().backward()  # the copy trains; the original does not move
    assert all(torch.equal(before[name], model.full_weight(name)) for name in model.hosts)
    for kjt in rest[:6]:
        model(kjt).values().sum().backward()
    assert_equal_collections(model, twin)  # and the same steps give the same state, bitwise
    if how is copy.deepcopy:  # a hook of your own goes with the copy: 6 lookups each
        assert len(own_hook_calls) == 12


def test_copying_while_a_lookup_waits_for_its_backward_is_refused_and_changes_nothing() -> None:
    model, rest = trained()
    out = model(rest[0])
    with pytest.raises(RuntimeError, match="cannot be copied or pickled while it is in use: .* 1 direct lookups"):
        copy.deepcopy(model)
    out.values().sum().backward()  # the lookup is still valid
    twin = copy.deepcopy(model)
    assert_equal_collections(model, twin)
    with torch.no_grad():
        model(rest[1])  # a lookup without a graph holds nothing
    pickled(model)


def test_a_compiled_collection_copies_and_saves_like_any_compiled_module() -> None:
    """Review: the copy kept the original's compiled call, so stepping the copy trained the
    original; torch.save failed on it. nn.Module drops ``_compiled_call_impl``; so do we."""
    model, rest = trained()
    model.compile()
    twin = copy.deepcopy(model)
    before = {name: model.full_weight(name) for name in model.hosts}
    twin(rest[0]).values().sum().backward()  # the copy does not carry the original's compiled call
    assert all(torch.equal(before[name], model.full_weight(name)) for name in model.hosts)
    assert any(not torch.equal(before[name], twin.full_weight(name)) for name in twin.hosts)
    assert "_compiled_call_impl" not in vars(twin) and "_compiled_call_impl" not in vars(pickled(model))


def test_a_copy_of_an_aborted_collection_starts_usable() -> None:
    """Review: the copy carried the abort (its lookups raised CacheAbortedError), and an abort
    caused by a CacheTooSmallError could not be copied at all."""
    from torchpipe.rec import CacheTooSmallError

    model, rest = trained()
    model.abort(CacheTooSmallError("t0", 16, 40, 0, 40, 16))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin(rest[0])
    assert all(host._abort_exc is not None for host in model.hosts.values())  # the original is left as it was


def test_copying_finds_a_pipeline_dropped_in_a_reference_cycle() -> None:
    """Review: a pipeline dropped inside a reference cycle hands its batches back only when the
    cycle collector runs; a copy refused until then, naming a pipeline nobody holds."""
    import gc

    from torchpipe.train import EmbCacheTrainPipeline, RecBatch

    model, rest = trained()

    batches = [RecBatch(torch.zeros(4, 1), kjt, torch.zeros(4)) for kjt in rest]
    gc.disable()
    try:
        pipe = EmbCacheTrainPipeline(SumOfPooled(model), None, host_threads=1, device_threads=1)
        it = iter(batches)
        pipe.progress(it)
        pipe.cycle = pipe  # dropped below, but alive until the cycle collector runs
        del pipe
        assert model.in_flight() > 0
        twin = copy.deepcopy(model)
    finally:
        gc.enable()
    assert model.in_flight() == 0 and twin.in_flight() == 0


def test_a_host_table_or_cache_in_use_is_not_copied() -> None:
    """Review: copied with a write pending, a table's copy made later lookups wait for a write
    that only the original would get; a cache copied with protected slots kept them for good."""
    from torchpipe.rec import EmbeddingCache, HostEmbeddingTable

    table = HostEmbeddingTable(10, 2, 1)
    ticket = table.reserve_write(torch.tensor([3]))
    with pytest.raises(RuntimeError, match="HostEmbeddingTable cannot be copied .* 1 write tickets pending"):
        copy.deepcopy(table)
    table.update(torch.tensor([3]), torch.ones(1, 3), ticket)
    twin = copy.deepcopy(table)
    assert torch.equal(twin.lookup(torch.tensor([3]), twin.reserve_write(torch.tensor([4]))), torch.ones(1, 3))
    cache = EmbeddingCache(10, 4)
    plan = cache.plan_swap(torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="EmbeddingCache cannot be copied .* 2 slots protected"):
        copy.deepcopy(cache)
    cache.release(plan)
    assert copy.deepcopy(cache).plan_swap(torch.tensor([5, 6, 7, 8])).swap_in_keys.numel() == 4
