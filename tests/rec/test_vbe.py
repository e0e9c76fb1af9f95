"""A batch size per feature (TorchRec's variable batch, VBE): each feature has its own bags
(``stride_per_key_per_rank``) and ``inverse_indices`` say which bag each sample reads.

TorchRec's ``EmbeddingBagCollection`` pools each feature's bags, then expands them to the
batch through the inverse indices; ours must give the same outputs, and the same rows after
a step (the gradient of a bag read by several samples is their sum). Integer rows, keys,
weights and coefficients keep every sum exact, so everything is compared with torch.equal.
"""

from __future__ import annotations

import pytest
import torch
from rec_helpers import integer_weights, zipf_keys
from test_shared_features import (EXPECTED_KEYS, assert_cache_training_equals_the_full_table,
                                  assert_the_pipeline_equals_the_loop, feature_rows, most_unique_keys, shared_batches,
                                  shared_tables, torchrec_ebc)
from torchrec import KeyedJaggedTensor, PoolingType

from torchpipe.rec import (SGD, Adam, CachedEmbeddingBagCollection, FullTableEmbeddingBagCollection, RecInputError,
                           RowWiseAdagrad)


def vbe_batches(tables, steps: int, batch_size: int = 5, ranks: int = 1, max_bag: int = 3, seed: int = 0,
                weighted: bool = False) -> list[KeyedJaggedTensor]:
    """Batches whose features have 1..batch_size bags each (split over ``ranks`` as after
    TorchRec's input dist), every sample reading a random bag of every feature."""
    rows = feature_rows(tables)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        values, lengths, strides, inverse = [], [], [], []
        for num_rows in rows.values():
            per_rank = torch.randint(0, batch_size + 1, (ranks,), generator=g).tolist()
            per_rank[0] = max(per_rank[0], 1)  # at least one bag for the samples to read
            bags = sum(per_rank)
            bag_lengths = torch.randint(0, max_bag + 1, (bags,), generator=g)
            lengths.append(bag_lengths)
            values.append(zipf_keys(num_rows, int(bag_lengths.sum()), g))
            strides.append(per_rank)
            inverse.append(torch.randint(0, bags, (batch_size,), generator=g))
        keys = list(rows)
        all_values = torch.cat(values)
        weights = torch.randint(-2, 3, (all_values.numel(),), generator=g).float() if weighted else None
        out.append(KeyedJaggedTensor(keys=keys, values=all_values, lengths=torch.cat(lengths), weights=weights,
                                     stride_per_key_per_rank=strides, inverse_indices=(keys, torch.stack(inverse))))
    return out


def sgd_step_on_theirs(theirs: EmbeddingBagCollection) -> None:
    """SGD(lr=1) on TorchRec's dense grads: what our fused SGD does to the rows."""
    with torch.no_grad():
        for bag in theirs.embedding_bags.values():
            bag.weight -= bag.weight.grad
    theirs.zero_grad()


def assert_equal(got: torch.Tensor, want: torch.Tensor, exact: bool, what: object) -> None:
    """Bitwise where the sums are exact; MEAN pooling divides, and TorchRec's backward adds
    the divided grads in another order than ours, so its rows may differ in the last bit."""
    if exact:
        assert torch.equal(got, want), what
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("kind", ["cached", "full"])
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN], ids=["sum", "mean"])
def test_outputs_and_an_sgd_step_equal_torchrecs(kind: str, ranks: int, pooling: PoolingType) -> None:
    tables = shared_tables(pooling)  # shared features (``user@t0``); t1 is a SUM table either way
    exact = pooling == PoolingType.SUM
    theirs = torchrec_ebc(tables)
    data = vbe_batches(tables, 16, ranks=ranks, seed=3)
    if kind == "cached":
        ours = CachedEmbeddingBagCollection(tables, most_unique_keys(tables, data), optimizer=SGD(lr=1.0),
                                            weights=integer_weights(tables))
    else:
        ours = FullTableEmbeddingBagCollection(tables, optimizer=SGD(lr=1.0), weights=integer_weights(tables))
    for i, kjt in enumerate(data):
        assert kjt.variable_stride_per_key()
        out, expected = ours(kjt), theirs(kjt)
        assert out.keys() == expected.keys() == EXPECTED_KEYS
        assert out.values().shape == (5, sum(out.length_per_key()))  # the whole batch, as TorchRec's
        assert_equal(out.values(), expected.values(), exact, i)
        coefficients = torch.randint(-2, 3, out.values().shape, generator=torch.Generator().manual_seed(i)).float()
        (out.values() * coefficients).sum().backward()
        (expected.values() * coefficients).sum().backward()
        sgd_step_on_theirs(theirs)
        for name, bag in theirs.embedding_bags.items():
            assert_equal(ours.full_weight(name), bag.weight.detach(), exact, (i, name))
    if kind == "cached":
        assert sum(stats.swapped_out for stats in ours.cache_stats().values()) > 0  # evictions happened


def test_weighted_vbe_batches_and_their_weight_grads_equal_torchrecs() -> None:
    tables = shared_tables()  # SUM tables: per-sample weights need them
    theirs = torchrec_ebc(tables, is_weighted=True)
    ours = CachedEmbeddingBagCollection(tables, {t.name: t.num_embeddings for t in tables}, optimizer=SGD(lr=1.0),
                                        weights=integer_weights(tables), is_weighted=True)
    for i, kjt in enumerate(vbe_batches(tables, 8, seed=4, weighted=True)):
        mine, other = (KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                                         weights=kjt.weights().clone().requires_grad_(),
                                         stride_per_key_per_rank=kjt.stride_per_key_per_rank(),
                                         inverse_indices=kjt.inverse_indices()) for _ in range(2))
        out, expected = ours(mine), theirs(other)
        assert out.keys() == expected.keys() == EXPECTED_KEYS
        assert torch.equal(out.values(), expected.values())
        coefficients = torch.randint(-2, 3, out.values().shape, generator=torch.Generator().manual_seed(i)).float()
        (out.values() * coefficients).sum().backward()
        (expected.values() * coefficients).sum().backward()
        assert torch.equal(mine.weights().grad, other.weights().grad)
        sgd_step_on_theirs(theirs)
        for name, bag in theirs.embedding_bags.items():
            assert torch.equal(ours.full_weight(name), bag.weight.detach()), (i, name)


@pytest.mark.parametrize("optimizer", [RowWiseAdagrad(lr=0.5), Adam(lr=0.25)], ids=["adagrad", "adam"])
def test_cache_training_on_mixed_batches_equals_the_full_table_reference_bitwise(optimizer) -> None:
    """VBE batches between ordinary ones, through a cache small enough to evict."""
    tables = shared_tables(PoolingType.MEAN)
    vbe, plain = vbe_batches(tables, 20, seed=8), shared_batches(tables, 20, batch_size=5, seed=9)
    assert_cache_training_equals_the_full_table(tables, [kjt for pair in zip(vbe, plain) for kjt in pair], optimizer)


def test_the_train_pipeline_on_vbe_batches_equals_the_unpipelined_loop_bitwise() -> None:
    tables = shared_tables()
    ebc = assert_the_pipeline_equals_the_loop(tables, vbe_batches(tables, 24, seed=5), cache_rows=30)
    assert sum(stats.swapped_out for stats in ebc.cache_stats().values()) > 0


@pytest.mark.parametrize("kind", ["cached", "full"])
def test_inverse_indices_on_one_batch_size_and_equal_bags_without_them_are_torchrecs(kind: str) -> None:
    """Review: TorchRec applies ``inverse_indices`` whenever a KJT has them (request-level dedup
    gives one batch size, fewer bags than samples), and pools a VBE KJT whose features all have
    as many bags as there are samples without any; ours ignored the first and refused the second."""
    tables = shared_tables()
    theirs = torchrec_ebc(tables)
    ours = (CachedEmbeddingBagCollection(tables, 40, optimizer=SGD(lr=1.0), weights=integer_weights(tables))
            if kind == "cached" else
            FullTableEmbeddingBagCollection(tables, optimizer=SGD(lr=1.0), weights=integer_weights(tables)))
    plain = shared_batches(tables, 4, batch_size=3, seed=11)
    g = torch.Generator().manual_seed(12)
    for i, kjt in enumerate(plain):
        keys = kjt.keys()
        deduped = KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=kjt.lengths(), inverse_indices=(
            keys, torch.randint(0, 3, (len(keys), 5), generator=g)))
        split_over_ranks = KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=kjt.lengths(),
                                             stride_per_key_per_rank=[[1, 2]] * len(keys))
        assert not deduped.variable_stride_per_key() and split_over_ranks.variable_stride_per_key()
        for batch, samples in ((deduped, 5), (split_over_ranks, 3)):
            out, expected = ours(batch), theirs(batch)
            assert out.values().shape == expected.values().shape == (samples, sum(out.length_per_key()))
            assert torch.equal(out.values(), expected.values())
            coefficients = torch.randint(-2, 3, out.values().shape, generator=g).float()
            (out.values() * coefficients).sum().backward()
            (expected.values() * coefficients).sum().backward()
            sgd_step_on_theirs(theirs)
            for name, bag in theirs.embedding_bags.items():
                assert torch.equal(ours.full_weight(name), bag.weight.detach()), (i, name)
