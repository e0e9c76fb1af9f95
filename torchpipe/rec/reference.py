"""`FullTableEmbeddingBagCollection`: all rows on the device, same fused rule, no cache.

The ground truth the cache is compared with (tests, benchmarks, the train pipelines):
it uses the same validation, dedup, pooling and optimizer code, on full tables.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor

from ..checks import check_bool
from .batch_keys import check_weights, collection_device, prepare_batch, starting_rows, table_layouts
from .fused_lookup import fused_pooled_lookup
from .optim import FusedOptimizerAttribute, RowOptimizer, check_row_optimizer

__all__ = ["FullTableEmbeddingBagCollection"]


class FullTableEmbeddingBagCollection(nn.Module):
    """A fused-optimizer EBC holding full tables ``[num_rows, dim + state_width]`` on ``device``."""

    optimizer = FusedOptimizerAttribute()

    def __init__(self, tables: list[EmbeddingBagConfig], device: torch.device | str | None = None,
                 optimizer: RowOptimizer | None = None, weights: dict[str, torch.Tensor] | None = None,
                 is_weighted: bool = False) -> None:
        device = collection_device(device)
        optimizer = check_row_optimizer(optimizer)
        check_bool("is_weighted", is_weighted)
        layouts = table_layouts(tables, weighted=is_weighted)
        check_weights(weights, layouts)
        super().__init__()
        self.device = device
        self.optimizer = optimizer
        self.layouts = layouts
        self._configs = list(tables)
        self.rows = {name: rows.to(self.device) for name, rows in self._initial_rows(weights).items()}
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings; the optimizer updates the batch's unique rows in backward."""
        keys = prepare_batch(features, self.layouts)
        names = list(keys.tables)
        return fused_pooled_lookup(self._anchor, [self.rows[n] for n in names],
                                   [keys.tables[n].unique_keys.to(self.device) for n in names],
                                   [keys.tables[n] for n in names], self.optimizer)

    def _initial_rows(self, weights: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Each table's starting ``[embeddings | optimizer state]`` on the host, in config order."""
        return {layout.name: torch.cat([weight, state], dim=1)
                for layout, weight, state in starting_rows(self._configs, self.layouts, weights,
                                                           self.optimizer.init_state)}

    def reset_parameters(self) -> None:
        """Every table's rows drawn again from its config's ``init_fn``, optimizer state reset (in place)."""
        for layout, weight, state in starting_rows(self._configs, self.layouts, None, self.optimizer.init_state):
            self.rows[layout.name].copy_(torch.cat([weight, state], dim=1))

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        """Whether lookups pool with the KJT's per-sample weights (TorchRec's ``is_weighted``)."""
        return any(layout.weighted for layout in self.layouts)

    def full_weight(self, table: str) -> torch.Tensor:
        """A copy of the table's embeddings."""
        return self.rows[table][:, :self._dim(table)].cpu().clone()

    def optimizer_state(self, table: str) -> torch.Tensor:
        """A copy of the table's optimizer state."""
        return self.rows[table][:, self._dim(table):].cpu().clone()

    def _dim(self, table: str) -> int:
        return next(layout.dim for layout in self.layouts if layout.name == table)
