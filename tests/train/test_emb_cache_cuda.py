"""EmbCacheTrainPipeline with the row cache on a CUDA device: swaps on their own stream,
train steps on the compute stream, outputs read on the caller's; still equal to the
synchronous full-table loop on the same device. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from train_helpers import (TinyDLRM, emb_width, integer_weights, make_batches, make_tables,
                           window_minimum)

from torchpipe.rec import SGD, CachedEmbeddingBagCollection, FullTableEmbeddingBagCollection
from torchpipe.train import EmbCacheTrainPipeline, train_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda", 0)


DELAY_CYCLES = 20_000_000  # about 12 ms of GPU clock


class StallingDLRM(TinyDLRM):
    """Stalls its stream before each forward: a swap or a caller that does not wait for the
    compute stream then reads rows or outputs before the train step wrote them."""

    def forward(self, batch):
        torch.cuda._sleep(DELAY_CYCLES)
        return super().forward(batch)


def build_on_cuda(tables, batches, cached: bool):
    weights = integer_weights(tables)
    if cached:
        rows = window_minimum(tables, batches)
        ebc = CachedEmbeddingBagCollection(tables, rows, optimizer=SGD(lr=2.0 ** -7), weights=weights, device=CUDA)
    else:
        ebc = FullTableEmbeddingBagCollection(tables, optimizer=SGD(lr=2.0 ** -7), weights=weights, device=CUDA)
    model = StallingDLRM(ebc, emb_width(tables))
    model.bottom.to(CUDA)
    model.top.to(CUDA)
    return model, torch.optim.SGD(model.parameters(), lr=2.0 ** -12)


def test_emb_cache_pipeline_on_cuda_equals_the_full_table_loop() -> None:
    tables = make_tables(num_rows=(4000, 2400), dim=32)
    batches = make_batches(tables, 40, batch_size=128, max_bag=8, seed=11)
    reference, ref_opt = build_on_cuda(tables, batches, cached=False)
    ref_outputs = [train_step(reference, ref_opt, b.to(CUDA)) for b in batches]
    model, opt = build_on_cuda(tables, batches, cached=True)
    outputs = []
    with EmbCacheTrainPipeline(model, opt, device=CUDA, host_threads=3) as pipe:
        it = iter(batches)
        while True:
            try:
                loss, logit = pipe.progress(it)
            except StopIteration:
                break
            # Copied on the caller's stream right away: too early unless that stream waits.
            outputs.append((loss.clone(), logit.clone()))
        pipe.flush()
    assert model.ebc.cache_stats()["t0"].swapped_out > 0, "the cache never evicted: the test proves nothing"
    assert len(outputs) == len(ref_outputs)
    # Not bitwise as on the CPU: CUDA's index_add and matmul reductions use atomics, so float
    # sums round in a run-dependent order. A race (a stale row, a lost update) is far larger.
    for step, ((loss, logit), (ref_loss, ref_logit)) in enumerate(zip(outputs, ref_outputs)):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-3, msg=f"loss differs at step {step}")
        torch.testing.assert_close(logit, ref_logit, rtol=1e-5, atol=1e-3, msg=f"output differs at step {step}")
    cached, full = model.ebc, reference.ebc
    cached.flush()
    for layout in cached.layouts:
        torch.testing.assert_close(cached.full_weight(layout.name), full.full_weight(layout.name), rtol=1e-5, atol=1e-3)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-4, msg=name)
