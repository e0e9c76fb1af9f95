"""Data and model builders shared by the embedding-cache tests.

Integer-valued weights, keys and loss coefficients (as FBGEMM's cache tests use), and
the reference shares the cache's ops, so cache training must match it with torch.equal.
"""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from torchpipe.rec import BatchPlan, CachedEmbeddingBagCollection, FullTableEmbeddingBagCollection, RowOptimizer


def make_tables(num_rows: tuple[int, ...] = (40, 24), dim: int = 4,
                pooling: tuple[PoolingType, ...] = (PoolingType.SUM, PoolingType.MEAN)) -> list[EmbeddingBagConfig]:
    """Table i has features f{i}a and f{i}b (two features share a table: exercises dedup)."""
    return [EmbeddingBagConfig(num_embeddings=n, embedding_dim=dim, name=f"t{i}",
                               feature_names=[f"f{i}a", f"f{i}b"], pooling=pooling[i % len(pooling)])
            for i, n in enumerate(num_rows)]


def integer_weights(tables: list[EmbeddingBagConfig], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randint(-3, 4, (t.num_embeddings, t.embedding_dim), generator=g).float()
            for t in tables}


def zipf_keys(num_rows: int, count: int, g: torch.Generator, alpha: float = 1.1) -> torch.Tensor:
    """Zipf-distributed keys whose hot keys are spread over the table."""
    if count == 0:
        return torch.empty(0, dtype=torch.int64)
    probs = 1.0 / torch.arange(1, num_rows + 1, dtype=torch.float64) ** alpha
    ranks = torch.multinomial(probs, count, replacement=True, generator=g)
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(num_rows))
    return perm[ranks]


def make_kjt(tables: list[EmbeddingBagConfig], keys_per_feature: dict[str, list[list[int]]]) -> KeyedJaggedTensor:
    """A KJT from explicit bags: ``{feature: [bag0_keys, bag1_keys, ...]}``."""
    names, values, lengths = [], [], []
    for table in tables:
        for feature in table.feature_names:
            bags = keys_per_feature[feature]
            names.append(feature)
            for bag in bags:
                values.extend(bag)
                lengths.append(len(bag))
    return KeyedJaggedTensor.from_lengths_sync(keys=names, values=torch.tensor(values, dtype=torch.int64),
                                               lengths=torch.tensor(lengths, dtype=torch.int64))


def zipf_kjt(tables: list[EmbeddingBagConfig], batch_size: int, max_bag: int, g: torch.Generator) -> KeyedJaggedTensor:
    """One batch: per feature, bags of 0..max_bag Zipf keys (draws from ``g`` in a fixed order)."""
    names, values, lengths = [], [], []
    for table in tables:
        for feature in table.feature_names:
            names.append(feature)
            bag_lengths = torch.randint(0, max_bag + 1, (batch_size,), generator=g)
            lengths.append(bag_lengths)
            values.append(zipf_keys(table.num_embeddings, int(bag_lengths.sum()), g))
    return KeyedJaggedTensor.from_lengths_sync(keys=names, values=torch.cat(values), lengths=torch.cat(lengths))


def zipf_batches(tables: list[EmbeddingBagConfig], steps: int, batch_size: int = 4, max_bag: int = 3,
                 seed: int = 0) -> list[KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(seed)
    return [zipf_kjt(tables, batch_size, max_bag, g) for _ in range(steps)]


def loss_coefficients(width: int, batch_size: int, steps: int, seed: int = 1) -> list[torch.Tensor]:
    """Integer coefficients of a linear loss: integer upstream grads, exact sums."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-2, 3, (batch_size, width), generator=g).float() for _ in range(steps)]


def max_unique_per_table(tables: list[EmbeddingBagConfig], batches: list[KeyedJaggedTensor]) -> int:
    """The least cache size a synchronous loop can run with: the most unique keys of one batch."""
    best = 0
    for kjt in batches:
        d = kjt.to_dict()
        for table in tables:
            keys = torch.cat([d[f].values() for f in table.feature_names])
            best = max(best, int(torch.unique(keys).numel()))
    return best


def build_pair(tables: list[EmbeddingBagConfig], cache_rows: int | dict[str, int], optimizer: RowOptimizer,
               policy: str = "lru", seed: int = 0) -> tuple[CachedEmbeddingBagCollection, FullTableEmbeddingBagCollection]:
    weights = integer_weights(tables, seed)
    cached = CachedEmbeddingBagCollection(tables, cache_rows, optimizer=optimizer, policy=policy, weights=weights)
    reference = FullTableEmbeddingBagCollection(tables, optimizer=optimizer, weights=weights)
    return cached, reference


def check_plan_invariants(model: CachedEmbeddingBagCollection, plan: BatchPlan,
                          cached_before: dict[str, torch.Tensor]) -> None:
    """Swap-out keys not in the batch, swap-in keys were not cached, every key resolves to its slot."""
    for name, p in plan.tables.items():
        batch_keys = set(p.unique_keys.tolist())
        assert not batch_keys & set(p.swap_out_keys.tolist())
        was_cached = cached_before[name]
        assert not bool(was_cached[p.swap_in_keys].any())
        assert bool(was_cached[p.swap_out_keys].all())
        cache = model.caches[name]
        assert torch.equal(cache.slot_of_key[p.unique_keys], p.slots_of_keys)
        assert torch.equal(cache.key_of_slot[p.slots_of_keys], p.unique_keys)
        assert p.slots_of_keys.unique().numel() == p.slots_of_keys.numel()
        inverse = plan.keys.tables[name].inverse
        assert torch.equal(cache.key_of_slot[p.slots_of_positions(inverse)], p.unique_keys[inverse])


def cached_masks(model: CachedEmbeddingBagCollection) -> dict[str, torch.Tensor]:
    return {name: cache.slot_of_key >= 0 for name, cache in model.caches.items()}


def assert_same_tables(cached: CachedEmbeddingBagCollection, reference: FullTableEmbeddingBagCollection) -> None:
    cached.flush()
    for layout in cached.layouts:
        assert torch.equal(cached.full_weight(layout.name), reference.full_weight(layout.name)), layout.name
        assert torch.equal(cached.optimizer_state(layout.name), reference.optimizer_state(layout.name)), layout.name


class SumOfPooled(torch.nn.Module):
    """A model a train pipeline can run over ``ebc``: its loss is the pooled embeddings' sum."""

    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, batch):
        loss = self.ebc(batch.sparse_features).values().sum()
        return loss, loss.detach()
