"""A feature read by several tables, as TorchRec's ``EmbeddingBagCollection`` allows.

TorchRec keys such a feature's pooled output ``feature@table`` in each table that reads it
(a feature read by one table keeps its name). Integer rows, keys and loss coefficients keep
every sum exact, so outputs and the rows after a step are compared with torch.equal against
TorchRec's own module, and cache training (directly and through the train pipeline) against
the full-table reference.
"""

from __future__ import annotations

import pytest
import torch
from rec_helpers import integer_weights, zipf_keys
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from torchpipe.rec import (SGD, Adam, CachedEmbeddingBagCollection, FullTableEmbeddingBagCollection, RecInputError,
                           RowWiseAdagrad)
from torchpipe.rec.batch_keys import batch_size_of
from torchpipe.train import EmbCacheTrainPipeline, RecBatch

# ``user`` feeds t0 and t1, ``item`` feeds t1 and t2, ``page`` only t0.
EXPECTED_KEYS = ["user@t0", "page", "user@t1", "item@t1", "item@t2"]


def shared_tables(pooling: PoolingType = PoolingType.SUM) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(num_embeddings=40, embedding_dim=4, name="t0", feature_names=["user", "page"],
                           pooling=pooling),
        EmbeddingBagConfig(num_embeddings=24, embedding_dim=3, name="t1", feature_names=["user", "item"],
                           pooling=PoolingType.SUM),
        EmbeddingBagConfig(num_embeddings=16, embedding_dim=2, name="t2", feature_names=["item"], pooling=pooling),
    ]


def feature_rows(tables: list[EmbeddingBagConfig]) -> dict[str, int]:
    """Each feature, in first-use order, with the rows of the smallest table it feeds."""
    rows: dict[str, int] = {}
    for table in tables:
        for feature in table.feature_names:
            rows[feature] = min(rows.get(feature, table.num_embeddings), table.num_embeddings)
    return rows


def shared_batches(tables: list[EmbeddingBagConfig], steps: int, batch_size: int = 4, max_bag: int = 3,
                   seed: int = 0) -> list[KeyedJaggedTensor]:
    """Each feature once per batch, with keys every table that reads it has rows for."""
    rows = feature_rows(tables)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        values, lengths = [], []
        for feature, num_rows in rows.items():
            bag_lengths = torch.randint(0, max_bag + 1, (batch_size,), generator=g)
            lengths.append(bag_lengths)
            values.append(zipf_keys(num_rows, int(bag_lengths.sum()), g))
        out.append(KeyedJaggedTensor.from_lengths_sync(keys=list(rows), values=torch.cat(values),
                                                       lengths=torch.cat(lengths)))
    return out


def torchrec_ebc(tables: list[EmbeddingBagConfig], is_weighted: bool = False) -> EmbeddingBagCollection:
    """TorchRec's EBC with the tests' integer rows (``integer_weights``)."""
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=is_weighted)
    with torch.no_grad():
        for name, weight in integer_weights(tables).items():
            ebc.embedding_bags[name].weight.copy_(weight)
    return ebc


def most_unique_keys(tables: list[EmbeddingBagConfig], batches: list[KeyedJaggedTensor]) -> int:
    """The least cache rows a synchronous loop runs with: the most unique keys one table gets."""
    return max(int(torch.cat([kjt[f].values() for f in table.feature_names]).unique().numel())
               for kjt in batches for table in tables)


def width(tables: list[EmbeddingBagConfig]) -> int:
    return sum(t.embedding_dim * len(t.feature_names) for t in tables)


def with_a_feature_no_table_reads(kjt: KeyedJaggedTensor, at: int = 1) -> KeyedJaggedTensor:
    """``kjt`` with a feature ``other`` at position ``at``: two keys per bag, out of every
    table's range (a KJT built for several collections carries such features)."""
    features, samples = kjt.to_dict(), batch_size_of(kjt)
    names, values, lengths = [], [], []
    for position, name in enumerate(list(kjt.keys())):
        if position == at:
            names.append("other")
            values.append(torch.full((2 * samples,), 10 ** 9, dtype=torch.int64))
            lengths.append(torch.full((samples,), 2, dtype=torch.int64))
        names.append(name)
        values.append(features[name].values())
        lengths.append(features[name].lengths())
    return KeyedJaggedTensor.from_lengths_sync(keys=names, values=torch.cat(values), lengths=torch.cat(lengths))


@pytest.mark.parametrize("extra", [False, True], ids=["own features", "with a feature no table reads"])
@pytest.mark.parametrize("kind", ["cached", "full"])
def test_output_keys_values_and_an_sgd_step_equal_torchrecs(kind: str, extra: bool) -> None:
    # Review (s30): a feature no table reads was refused ("unknown feature"); TorchRec's EBC
    # ignores it, so one KJT can feed several collections. Ours get it, TorchRec's does not.
    tables = shared_tables()
    theirs = torchrec_ebc(tables)
    ours = FullTableEmbeddingBagCollection(tables, optimizer=SGD(lr=1.0), weights=integer_weights(tables))
    data = shared_batches(tables, 20, seed=3)
    if kind == "cached":
        ours = CachedEmbeddingBagCollection(tables, most_unique_keys(tables, data), optimizer=SGD(lr=1.0),
                                            weights=integer_weights(tables))
    for i, kjt in enumerate(data):
        out, expected = ours(with_a_feature_no_table_reads(kjt) if extra else kjt), theirs(kjt)
        assert out.keys() == expected.keys() == EXPECTED_KEYS
        assert out.length_per_key() == expected.length_per_key()
        assert torch.equal(out.values(), expected.values())
        assert torch.equal(out["user@t1"], expected["user@t1"])
        coefficients = torch.randint(-2, 3, out.values().shape, generator=torch.Generator().manual_seed(i)).float()
        (out.values() * coefficients).sum().backward()
        theirs.zero_grad()
        (expected.values() * coefficients).sum().backward()
        with torch.no_grad():  # SGD(lr=1) on TorchRec's dense grads: the same rows
            for bag in theirs.embedding_bags.values():
                bag.weight -= bag.weight.grad
        for name, bag in theirs.embedding_bags.items():
            assert torch.equal(ours.full_weight(name), bag.weight.detach()), (i, name)
    if kind == "cached":
        assert sum(stats.swapped_out for stats in ours.cache_stats().values()) > 0  # evictions happened


def assert_cache_training_equals_the_full_table(tables: list[EmbeddingBagConfig], data: list[KeyedJaggedTensor],
                                                optimizer) -> None:
    """Lookups and backward through a cache just big enough (so it evicts) == the full tables:
    every output (keyed alike), then every row and its optimizer state, bitwise."""
    cached = CachedEmbeddingBagCollection(tables, most_unique_keys(tables, data), optimizer=optimizer,
                                          weights=integer_weights(tables))
    full = FullTableEmbeddingBagCollection(tables, optimizer=optimizer, weights=integer_weights(tables))
    for i, kjt in enumerate(data):
        a, b = cached(kjt), full(kjt)
        assert a.keys() == b.keys() == EXPECTED_KEYS
        assert torch.equal(a.values(), b.values()), i
        coefficients = torch.randint(-2, 3, a.values().shape, generator=torch.Generator().manual_seed(i)).float()
        (a.values() * coefficients).sum().backward()
        (b.values() * coefficients).sum().backward()
    assert sum(stats.swapped_out for stats in cached.cache_stats().values()) > 0
    cached.flush()
    for layout in cached.layouts:
        assert torch.equal(cached.full_weight(layout.name), full.full_weight(layout.name)), layout.name
        assert torch.equal(cached.optimizer_state(layout.name), full.optimizer_state(layout.name)), layout.name


@pytest.mark.parametrize("optimizer", [SGD(lr=0.5), RowWiseAdagrad(lr=0.5), Adam(lr=0.25)],
                         ids=["sgd", "adagrad", "adam"])
def test_cache_training_equals_the_full_table_reference_bitwise(optimizer) -> None:
    tables = shared_tables(PoolingType.MEAN)
    assert_cache_training_equals_the_full_table(tables, shared_batches(tables, 40, seed=8), optimizer)


class _Model(torch.nn.Module):
    """Pooled embeddings (read by key, as a TorchRec model does) and a dense layer; a linear loss."""

    def __init__(self, ebc: torch.nn.Module, tables: list[EmbeddingBagConfig]) -> None:
        super().__init__()
        self.ebc = ebc
        self.top = torch.nn.Linear(width(tables), 1)
        with torch.no_grad():
            self.top.weight.copy_(torch.randint(-1, 2, self.top.weight.shape,
                                                generator=torch.Generator().manual_seed(7)).float())
            self.top.bias.zero_()

    def forward(self, batch: RecBatch):
        pooled = self.ebc(batch.sparse_features).to_dict()
        x = torch.cat([pooled[key] for key in EXPECTED_KEYS], dim=1)
        logit = self.top(x).squeeze(1)
        loss = (logit * batch.labels).sum()
        return loss, logit.detach()


def assert_the_pipeline_equals_the_loop(tables: list[EmbeddingBagConfig], kjts: list[KeyedJaggedTensor],
                                        cache_rows: int) -> CachedEmbeddingBagCollection:
    """EmbCacheTrainPipeline over ``kjts`` (a small cache) == the unpipelined full-table loop:
    every step's logits, the tables' rows and the dense layer, bitwise. Returns the collection."""
    g = torch.Generator().manual_seed(5)
    batches = []
    for kjt in kjts:
        samples = batch_size_of(kjt)
        batches.append(RecBatch(torch.zeros(samples, 1), kjt, torch.randint(-2, 3, (samples,), generator=g).float()))
    reference = _Model(FullTableEmbeddingBagCollection(tables, optimizer=SGD(lr=1.0),
                                                       weights=integer_weights(tables)), tables)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=2.0 ** -6)
    expected = []
    for batch in batches:
        ref_opt.zero_grad()
        loss, logit = reference(batch)
        loss.backward()
        ref_opt.step()
        expected.append(logit)
    ebc = CachedEmbeddingBagCollection(tables, cache_rows, optimizer=SGD(lr=1.0), weights=integer_weights(tables))
    model = _Model(ebc, tables)
    opt = torch.optim.SGD(model.parameters(), lr=2.0 ** -6)
    outputs = []
    with EmbCacheTrainPipeline(model, opt, collection=ebc) as pipe:
        it = iter(batches)
        while True:
            try:
                outputs.append(pipe.progress(it))
            except StopIteration:
                break
    assert len(outputs) == len(expected)
    for step, (got, want) in enumerate(zip(outputs, expected)):
        assert torch.equal(got, want), f"step {step} differs"
    ebc.flush()
    for table in tables:
        assert torch.equal(ebc.full_weight(table.name), reference.ebc.full_weight(table.name)), table.name
    assert torch.equal(model.top.weight, reference.top.weight)
    return ebc


def test_the_train_pipeline_equals_the_unpipelined_full_table_loop_bitwise() -> None:
    tables = shared_tables()
    assert_the_pipeline_equals_the_loop(tables, shared_batches(tables, 24, seed=5), cache_rows=24)


def test_the_train_pipeline_ignores_a_feature_no_table_reads() -> None:
    tables = shared_tables()
    batches = [with_a_feature_no_table_reads(kjt, at=i % 3) for i, kjt in enumerate(shared_batches(tables, 12, seed=6))]
    assert_the_pipeline_equals_the_loop(tables, batches, cache_rows=24)


def test_a_key_is_checked_against_every_table_its_feature_feeds_before_anything_changes() -> None:
    tables = shared_tables()
    model = CachedEmbeddingBagCollection(tables, 12, weights=integer_weights(tables))
    kjt = shared_batches(tables, 1, seed=2)[0]
    values = kjt.values().clone()
    values[0] = 30  # ``user`` is the first feature: t0 has 40 rows, t1 only 24
    bad = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), values, kjt.lengths())
    assert kjt.length_per_key()[0] > 0  # position 0 is a key of ``user``
    before = [model.hosts[n].rows.clone() for n in model.hosts] + [model.caches[n].key_of_slot.clone()
                                                                   for n in model.caches]
    with pytest.raises(RecInputError, match=r"feature 'user' \(table 't1'\) has keys out of range \[0, 24\): "
                                            r"e.g. \[30\]"):
        model(bad)
    after = [model.hosts[n].rows for n in model.hosts] + [model.caches[n].key_of_slot for n in model.caches]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    model(kjt)  # the good batch still goes through


def test_tables_whose_outputs_would_share_a_key_are_refused_when_built() -> None:
    twice = [EmbeddingBagConfig(num_embeddings=8, embedding_dim=2, name="t0", feature_names=["f", "g", "f"])]
    with pytest.raises(ValueError, match=r"table 't0' lists features \['f'\] more than once"):
        CachedEmbeddingBagCollection(twice, 4)
    clash = [EmbeddingBagConfig(num_embeddings=8, embedding_dim=2, name="t0", feature_names=["f"]),
             EmbeddingBagConfig(num_embeddings=8, embedding_dim=2, name="t1", feature_names=["f", "f@t0"])]
    with pytest.raises(ValueError, match=r"would share keys: 'f@t0' from feature 'f' of table 't0' and feature "
                                         r"'f@t0' of table 't1'\. Rename a feature"):
        FullTableEmbeddingBagCollection(clash)


def test_weighted_shared_features_in_another_key_order_with_int32_keys_equal_torchrecs() -> None:
    """Review gap: per-sample weights on a shared feature, a KJT whose keys come in another order
    than the configs, and int32 values and lengths; TorchRec's weighted EBC is the reference."""
    tables = shared_tables()
    theirs = torchrec_ebc(tables, is_weighted=True)
    ours = CachedEmbeddingBagCollection(tables, {t.name: t.num_embeddings for t in tables}, optimizer=SGD(lr=1.0),
                                        weights=integer_weights(tables), is_weighted=True)
    for i, kjt in enumerate(shared_batches(tables, 6, seed=9)):
        d = kjt.to_dict()
        order = ["item", "user", "page"]
        g = torch.Generator().manual_seed(i)
        values = torch.cat([d[f].values() for f in order]).to(torch.int32)
        lengths = torch.cat([d[f].lengths() for f in order]).to(torch.int32)
        per_sample = torch.randint(-3, 4, (values.numel(),), generator=g).float()
        mine = KeyedJaggedTensor.from_lengths_sync(order, values, lengths, weights=per_sample.clone().requires_grad_())
        other = KeyedJaggedTensor.from_lengths_sync(order, values, lengths, weights=per_sample.clone().requires_grad_())
        out, expected = ours(mine), theirs(other)
        assert out.keys() == expected.keys() == EXPECTED_KEYS
        assert torch.equal(out.values(), expected.values())
        coefficients = torch.randint(-2, 3, out.values().shape, generator=g).float()
        (out.values() * coefficients).sum().backward()
        theirs.zero_grad()
        (expected.values() * coefficients).sum().backward()
        assert torch.equal(mine.weights().grad, other.weights().grad)
        with torch.no_grad():
            for bag in theirs.embedding_bags.values():
                bag.weight -= bag.weight.grad
        for name, bag in theirs.embedding_bags.items():
            assert torch.equal(ours.full_weight(name), bag.weight.detach()), (i, name)
