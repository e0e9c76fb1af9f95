"""Pooled lookup whose backward applies the sparse optimizer to the rows in place.

Why fused: like TorchRec's fused EBC and FBGEMM's TBE, the tables have no dense ``.grad``;
the gradient of the unique rows of a batch is used once, right in backward, and dropped.
Shared by the cached collection and the full-table reference so both run the very same
ops on the very same shapes, which is what makes cache training bitwise equal to it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Sequence

import torch
from torchrec import KeyedTensor

from .batch_keys import TableBatch
from .optim import RowOptimizer

__all__ = ["fused_pooled_lookup", "apply_row_update"]


def pool_bags(rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor, mode: str,
              weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum or mean of ``rows[inverse]`` per bag (``offsets`` with the last offset); empty bags give 0.

    ``weights`` (one per key position, sum pooling): each row is scaled by its weight first,
    as ``per_sample_weights`` in torch's ``embedding_bag``; its backward scales the rows' grads.

    Gather + ``index_add`` rather than ``F.embedding_bag``: on CPU the latter JIT-compiles
    FBGEMM kernels per input shape (milliseconds per new shape), and this form is plain,
    deterministic ops whose backward is the dedup sum of the positions' grads.
    """
    lengths = offsets[1:] - offsets[:-1]
    bag_of_position = torch.repeat_interleave(torch.arange(lengths.numel(), device=rows.device), lengths,
                                              output_size=int(inverse.numel()))
    pooled = torch.zeros(lengths.numel(), rows.shape[1], dtype=rows.dtype, device=rows.device)
    gathered = rows.index_select(0, inverse)
    if weights is not None:
        gathered = gathered * weights.to(rows.dtype).unsqueeze(1)
    pooled = pooled.index_add(0, bag_of_position, gathered)
    if mode == "mean":
        pooled = pooled / lengths.clamp(min=1).unsqueeze(1).to(rows.dtype)
    return pooled


def apply_row_update(storage: torch.Tensor, row_index: torch.Tensor, grad: torch.Tensor,
                     optimizer: RowOptimizer, dim: int) -> None:
    """Update ``storage[row_index]`` (unique rows ``[emb | state]``) with their summed ``grad``."""
    rows = storage.index_select(0, row_index)
    storage.index_copy_(0, row_index, optimizer.apply(rows, grad.to(rows.dtype), dim))


class _FusedRows(torch.autograd.Function):
    """Gathers the unique embedding rows of every table; backward hands their grads to ``on_backward``."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, storages: Sequence[torch.Tensor], row_indices: Sequence[torch.Tensor],
                dims: Sequence[int], on_backward: Callable[[list[torch.Tensor | None]], None]):
        ctx.on_backward = on_backward
        ctx.set_materialize_grads(False)
        return tuple(s.index_select(0, i)[:, :d].contiguous() for s, i, d in zip(storages, row_indices, dims))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ctx.on_backward(list(grads))
        return None, None, None, None, None


def fused_pooled_lookup(anchor: torch.Tensor, storages: Sequence[torch.Tensor], row_indices: Sequence[torch.Tensor],
                        batches: Sequence[TableBatch], optimizer: RowOptimizer,
                        before_update: Callable[[], None] | None = None,
                        after_update: Callable[[], None] | None = None,
                        update_lock: ContextManager[Any] | None = None) -> KeyedTensor:
    """Pool every table's bags from ``storages[t][row_indices[t]]`` into a `KeyedTensor`.

    ``row_indices[t][u]`` is the storage row of unique key ``u`` of table ``t`` (a cache
    slot, or the key itself for a full table). ``anchor`` is a tensor requiring grad so
    the output joins autograd without the tables being parameters. In backward the
    optimizer updates each table's unique rows (grads of duplicate keys are summed by the
    pooling backward); ``before_update``/``after_update`` bracket that (stale check, release),
    all three under ``update_lock`` when given (so that another thread cannot release the
    batch's rows between the check and the update).
    """
    dims = [b.layout.dim for b in batches]
    device = storages[0].device if storages else anchor.device

    def on_backward(grads: list[torch.Tensor | None]) -> None:
        with update_lock if update_lock is not None else contextlib.nullcontext():
            if before_update is not None:
                before_update()
            for storage, index, grad, dim in zip(storages, row_indices, grads, dims):
                if grad is not None:
                    apply_row_update(storage, index, grad, optimizer, dim)
            if after_update is not None:
                after_update()

    rows = _FusedRows.apply(anchor, list(storages), list(row_indices), dims, on_backward)
    keys: list[str] = []
    lengths: list[int] = []
    pooled: list[torch.Tensor] = []
    for batch, table_rows in zip(batches, rows):
        layout = batch.layout
        weights = batch.weights.to(device) if batch.weights is not None else None
        bags = pool_bags(table_rows, batch.inverse.to(device), batch.offsets.to(device), layout.pooling, weights)
        if batch.bag_of_sample is not None:  # inverse_indices: each sample reads its bag
            bags = bags.index_select(0, batch.bag_of_sample.to(device))
        num_features = len(layout.feature_names)
        per_sample = bags.view(num_features, batch.batch_size, layout.dim).transpose(0, 1)
        pooled.append(per_sample.reshape(batch.batch_size, num_features * layout.dim))
        keys.extend(layout.output_names)
        lengths.extend([layout.dim] * num_features)
    return KeyedTensor(keys=keys, length_per_key=lengths, values=torch.cat(pooled, dim=1))
