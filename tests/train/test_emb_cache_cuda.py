"""EmbCacheTrainPipeline with the row cache on a CUDA device: swaps on their own stream,
train steps on the compute stream, outputs read on the caller's; still equal, bitwise, to
the synchronous full-table loop on the same device. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from train_helpers import (TinyDLRM, assert_same_state, drain, emb_width, integer_weights, make_batches, make_tables,
                           window_minimum)

from torchpipe.rec import SGD, CachedEmbeddingBagCollection, FullTableEmbeddingBagCollection
from torchpipe.train import EmbCacheTrainPipeline, train_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda", 0)


def build_on_cuda(tables, batches, cached: bool):
    weights = integer_weights(tables)
    if cached:
        rows = window_minimum(tables, batches)
        ebc = CachedEmbeddingBagCollection(tables, rows, optimizer=SGD(lr=2.0 ** -7), weights=weights, device=CUDA)
    else:
        ebc = FullTableEmbeddingBagCollection(tables, optimizer=SGD(lr=2.0 ** -7), weights=weights, device=CUDA)
    model = TinyDLRM(ebc, emb_width(tables))
    model.bottom.to(CUDA)
    model.top.to(CUDA)
    return model, torch.optim.SGD(model.parameters(), lr=2.0 ** -12)


def test_emb_cache_pipeline_on_cuda_equals_the_full_table_loop() -> None:
    tables = make_tables(num_rows=(4000, 2400), dim=32)
    batches = make_batches(tables, 40, batch_size=128, max_bag=8, seed=11)
    reference, ref_opt = build_on_cuda(tables, batches, cached=False)
    ref_outputs = [train_step(reference, ref_opt, b.to(CUDA)) for b in batches]
    model, opt = build_on_cuda(tables, batches, cached=True)
    with EmbCacheTrainPipeline(model, opt, device=CUDA, host_threads=3) as pipe:
        outputs = drain(pipe, iter(batches))
        pipe.flush()
    assert model.ebc.cache_stats()["t0"].swapped_out > 0, "the cache never evicted: the test proves nothing"
    assert len(outputs) == len(ref_outputs)
    for step, ((loss, logit), (ref_loss, ref_logit)) in enumerate(zip(outputs, ref_outputs)):
        assert torch.equal(loss, ref_loss), f"loss differs at step {step}"
        assert torch.equal(logit, ref_logit), f"output differs at step {step}"
    assert_same_state(model, reference)
