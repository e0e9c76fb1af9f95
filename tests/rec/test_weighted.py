"""Weighted KJTs (per-sample weights), as TorchRec's ``EmbeddingBagCollection(is_weighted=True)``.

Integer rows, keys and weights keep every sum exact, so pooled outputs, the weights'
gradients and the rows after a step are compared with torch.equal against TorchRec's own
module, and cache training against the full-table reference.
"""

from __future__ import annotations

import pytest
import torch
from rec_helpers import integer_weights, make_tables, max_unique_per_table, zipf_batches
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor, PoolingType

from torchpipe.rec import (SGD, Adam, CachedEmbeddingBagCollection, FullTableEmbeddingBagCollection, RecInputError,
                           RowWiseAdagrad)

SUM = (PoolingType.SUM,)


def weighted(kjt: KeyedJaggedTensor, seed: int, requires_grad: bool = False) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    weights = torch.randint(-3, 4, (kjt.values().numel(),), generator=g).float().requires_grad_(requires_grad)
    return KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths(), weights=weights)


def batches(tables, steps: int, seed: int = 0) -> list[KeyedJaggedTensor]:
    return [weighted(kjt, seed + i) for i, kjt in enumerate(zipf_batches(tables, steps, seed=seed))]


def torchrec_ebc(tables) -> EmbeddingBagCollection:
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=True)
    with torch.no_grad():
        for name, weight in integer_weights(tables).items():
            ebc.embedding_bags[name].weight.copy_(weight)
    return ebc


def test_pooled_outputs_weight_grads_and_an_sgd_step_equal_torchrecs() -> None:
    tables = make_tables(pooling=SUM)
    theirs = torchrec_ebc(tables)
    ours = CachedEmbeddingBagCollection(tables, 16, optimizer=SGD(lr=1.0), weights=integer_weights(tables),
                                        is_weighted=True)
    assert ours.is_weighted() and theirs.is_weighted()
    for i, kjt in enumerate(batches(tables, 6, seed=3)):
        mine, other = weighted(kjt, 100 + i, True), weighted(kjt, 100 + i, True)
        out, expected = ours(mine), theirs(other)
        assert out.keys() == expected.keys() and torch.equal(out.values(), expected.values())
        coefficients = torch.randint(-2, 3, out.values().shape, generator=torch.Generator().manual_seed(i)).float()
        (out.values() * coefficients).sum().backward()
        theirs.zero_grad()
        (expected.values() * coefficients).sum().backward()
        assert torch.equal(mine.weights().grad, other.weights().grad)  # d loss / d per-sample weight
        with torch.no_grad():  # SGD(lr=1) on TorchRec's dense grads: the same rows
            for bag in theirs.embedding_bags.values():
                bag.weight -= bag.weight.grad
        for name, bag in theirs.embedding_bags.items():
            assert torch.equal(ours.full_weight(name), bag.weight.detach()), (i, name)


@pytest.mark.parametrize("optimizer", [SGD(lr=0.5), RowWiseAdagrad(lr=0.5), Adam(lr=0.25)],
                         ids=["sgd", "adagrad", "adam"])
def test_cache_training_equals_the_full_table_reference_bitwise(optimizer) -> None:
    tables = make_tables(pooling=SUM)
    data = batches(tables, 40, seed=8)
    cached = CachedEmbeddingBagCollection(tables, max_unique_per_table(tables, data), optimizer=optimizer,
                                          weights=integer_weights(tables), is_weighted=True)
    full = FullTableEmbeddingBagCollection(tables, optimizer=optimizer, weights=integer_weights(tables),
                                           is_weighted=True)
    unweighted = FullTableEmbeddingBagCollection(tables, optimizer=optimizer, weights=integer_weights(tables))
    for kjt in data:
        a, b = cached(kjt), full(kjt)
        assert torch.equal(a.values(), b.values())
        a.values().sum().backward()
        b.values().sum().backward()
        plain = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths())
        unweighted(plain).values().sum().backward()
    assert sum(stats.swapped_out for stats in cached.cache_stats().values()) > 0  # evictions happened
    for layout in cached.layouts:
        assert torch.equal(cached.full_weight(layout.name), full.full_weight(layout.name))
        assert torch.equal(cached.optimizer_state(layout.name), full.optimizer_state(layout.name))
    assert not torch.equal(full.full_weight("t0"), unweighted.full_weight("t0"))  # the weights did count


def test_weighted_input_errors_are_refused_before_anything_changes() -> None:
    tables = make_tables(pooling=SUM)
    kjt = zipf_batches(tables, 1, seed=2)[0]
    plain = CachedEmbeddingBagCollection(tables, 16, weights=integer_weights(tables))
    with pytest.raises(RecInputError, match="built with is_weighted=False; build it with is_weighted=True"):
        plain(weighted(kjt, 0))
    model = CachedEmbeddingBagCollection(tables, 16, weights=integer_weights(tables), is_weighted=True)
    with pytest.raises(RecInputError, match="built with is_weighted=True, but the batch has no per-sample weights"):
        model(kjt)  # TorchRec's weighted EBC asserts too
    before = ([model.hosts[n].rows.clone() for n in model.hosts]
              + [model.caches[n].key_of_slot.clone() for n in model.caches])
    n = kjt.values().numel()
    for bad, words in ((torch.ones(n, dtype=torch.int64), "torch.int64 of shape"),
                       (torch.ones(n - 1), rf"one weight per key \({n}\), got torch.float32 of shape \({n - 1},\)"),
                       (torch.ones(n, 1), rf"of shape \({n}, 1\)")):
        kjt_bad = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=bad)
        with pytest.raises(RecInputError, match=words):
            model(kjt_bad)
    after = [model.hosts[n].rows for n in model.hosts] + [model.caches[n].key_of_slot for n in model.caches]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(ValueError, match=r"table 't1': per-sample weights \(is_weighted=True\) pool with SUM only"):
        CachedEmbeddingBagCollection(make_tables(), 16, is_weighted=True)  # t1 is a MEAN table
    with pytest.raises(TypeError, match="is_weighted must be a bool, got 'yes'"):
        CachedEmbeddingBagCollection(tables, 16, is_weighted="yes")
    with pytest.raises(TypeError, match="is_weighted must be a bool, got 1"):
        FullTableEmbeddingBagCollection(tables, is_weighted=1)


def test_both_collections_say_whether_they_are_weighted_also_when_loaded_from_an_older_pickle() -> None:
    tables = make_tables(pooling=SUM)
    assert FullTableEmbeddingBagCollection(tables, is_weighted=True).is_weighted()
    assert not FullTableEmbeddingBagCollection(tables).is_weighted()
    saved = CachedEmbeddingBagCollection(tables, 8).__getstate__()
    for layout in saved["layouts"]:  # as pickled before is_weighted existed: the class default applies
        object.__delattr__(layout, "weighted")
    older = CachedEmbeddingBagCollection.__new__(CachedEmbeddingBagCollection)
    older.__setstate__(saved)
    assert older.is_weighted() is False
