"""A small DLRM-like model over a cached (or full-table) embedding collection, and data.

Integer-valued weights, keys, dense features and loss coefficients as in tests/rec; the
pipeline runs the very same ops as the synchronous reference loop (same model code, same
`train_step`, one intra-op thread), so results must be equal with torch.equal.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from rec_helpers import integer_weights, make_tables, zipf_kjt  # noqa: F401 (make_tables re-exported to the tests)
from torch import nn
from torchrec import KeyedJaggedTensor

from torchpipe.rec import CachedEmbeddingBagCollection, FullTableEmbeddingBagCollection, RowOptimizer
from torchpipe.train import RecBatch, train_step

DENSE_IN = 3


def make_batches(tables, steps: int, batch_size: int = 4, max_bag: int = 3, seed: int = 0) -> List[RecBatch]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        kjt = zipf_kjt(tables, batch_size, max_bag, g)
        dense = torch.randint(-2, 3, (batch_size, DENSE_IN), generator=g).float()
        labels = torch.randint(-2, 3, (batch_size,), generator=g).float()
        batches.append(RecBatch(dense, kjt, labels))
    return batches


def with_weights(batches: List[RecBatch], seed: int, dtype: torch.dtype = torch.float32) -> List[RecBatch]:
    """The same batches with integer per-sample weights in [-2, 2] (exact in any float dtype)."""
    g = torch.Generator().manual_seed(seed)
    weighted = []
    for b in batches:
        kjt = b.sparse_features
        weights = torch.randint(-2, 3, (kjt.values().numel(),), generator=g).to(dtype)
        weighted.append(RecBatch(b.dense_features, KeyedJaggedTensor.from_lengths_sync(
            kjt.keys(), kjt.values(), kjt.lengths(), weights=weights), b.labels))
    return weighted


def window_minimum(tables, batches: List[RecBatch], window: int = 3) -> int:
    """Least cache rows for a pipeline that protects ``window`` consecutive batches' keys."""
    best = 0
    for i in range(len(batches)):
        chunk = batches[i:i + window]
        for table in tables:
            keys = torch.cat([b.sparse_features[f].values() for b in chunk for f in table.feature_names])
            best = max(best, int(torch.unique(keys).numel()))
    return best


class TinyDLRM(nn.Module):
    """dense -> Linear; concat with pooled embeddings -> Linear -> logit; linear loss (exact grads)."""

    def __init__(self, ebc: nn.Module, emb_width: int, hidden: int = 4) -> None:
        super().__init__()
        self.ebc = ebc
        self.bottom = nn.Linear(DENSE_IN, hidden)
        self.top = nn.Linear(hidden + emb_width, 1)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in list(self.bottom.parameters()) + list(self.top.parameters()):
                p.copy_(torch.randint(-1, 2, p.shape, generator=g).float())

    def forward(self, batch: RecBatch):
        pooled = self.ebc(batch.sparse_features)
        x = torch.cat([self.bottom(batch.dense_features), pooled.values()], dim=1)
        logit = self.top(x).squeeze(1)
        loss = (logit * batch.labels).sum()
        return loss, (loss.detach(), logit.detach())


def emb_width(tables) -> int:
    return sum(t.embedding_dim * len(t.feature_names) for t in tables)


def build(tables, cache_rows, sparse_opt: RowOptimizer, policy: str = "lru", dense_lr: float = 2.0 ** -6,
          cached: bool = True):
    weights = integer_weights(tables)
    if cached:
        ebc = CachedEmbeddingBagCollection(tables, cache_rows, optimizer=sparse_opt, policy=policy, weights=weights)
    else:
        ebc = FullTableEmbeddingBagCollection(tables, optimizer=sparse_opt, weights=weights)
    model = TinyDLRM(ebc, emb_width(tables))
    return model, torch.optim.SGD(model.parameters(), lr=dense_lr)


def reference_run(tables, batches, sparse_opt, steps: Optional[int] = None, model=None, opt=None):
    """The unpipelined full-table loop; returns (model, optimizer, outputs)."""
    if model is None:
        model, opt = build(tables, None, sparse_opt, cached=False)
    outputs = [train_step(model, opt, b) for b in batches[:steps]]
    return model, opt, outputs


def assert_same_state(model, reference) -> None:
    cached, full = model.ebc, reference.ebc
    if hasattr(cached, "flush"):  # a full-table model holds no cache
        cached.flush()
    for layout in cached.layouts:
        assert torch.equal(cached.full_weight(layout.name), full.full_weight(layout.name)), layout.name
        assert torch.equal(cached.optimizer_state(layout.name), full.optimizer_state(layout.name)), layout.name
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), n


def assert_same_outputs(outputs: list, expected: list) -> None:
    """Every step's (loss, logit) equal, bitwise, and as many steps."""
    assert len(outputs) == len(expected)
    for step, (got, want) in enumerate(zip(outputs, expected)):
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"step {step} differs"


def drain(pipe, it) -> list:
    out = []
    while True:
        try:
            out.append(pipe.progress(it))
        except StopIteration:
            return out
