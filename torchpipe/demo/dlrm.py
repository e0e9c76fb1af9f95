"""Demo 3: a DLRM-like model whose embedding tables live in host memory, trained through a
device row cache with the 5-stage EmbCacheTrainPipeline (host work on host threads)."""
from __future__ import annotations

import time

import torch

from ..bench.rec import RecConfig, build_torchpipe, make_batches
from .progress import progress


def run(steps: int = 40) -> None:
    torch.manual_seed(0)
    cfg = RecConfig(tables=4, rows=200_000, dim=32, batch=1024, pooling=10, pool_batches=steps, torchrec=False)
    batches = make_batches(cfg)
    for batch in batches:  # a learnable label: the sign of the first dense feature
        batch.labels.copy_((batch.dense_features[:, 0] > 0).float())
    cache_rows = int(cfg.rows * cfg.cache_fraction)
    model, pipe = build_torchpipe(cfg, cache_rows, overlap=True)
    for group in pipe.optimizer.param_groups:  # the benchmark's lr is for speed runs; learn visibly here
        group["lr"] = 0.3
    print(f"\nDLRM-like: {cfg.tables} tables x {cfg.rows:,} rows x dim {cfg.dim} in host memory, "
          f"device cache {cache_rows:,} rows per table, batch {cfg.batch}, pooling {cfg.pooling}")
    print("pipeline schedule (which batch each stage handles in each progress() call):")
    print(pipe.schedule_table(6))
    data = iter(batches)
    losses = []
    started = time.perf_counter()
    for _ in progress(steps, "DLRM   EmbCacheTrainPipeline"):
        loss, _ = pipe.progress(data)  # the model output of one finished step: (loss, logits)
        losses.append(float(loss))
        progress.postfix = f"loss {losses[-1]:.3f} hit {pipe.hit_rate():.0%}"  # type: ignore[attr-defined]
    pipe.flush()  # nothing in flight after StopIteration-free use; writes the cache back
    elapsed = time.perf_counter() - started
    print(f"throughput {steps * cfg.batch / elapsed:,.0f} samples/s; cache hit rate {pipe.hit_rate():.1%}; "
          f"loss {sum(losses[:5]) / 5:.3f} -> {sum(losses[-5:]) / 5:.3f}")
    pipe.close()

