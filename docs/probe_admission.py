"""What EmbCacheTrainPipeline's admission checks cost per batch, on the caller's thread.

The demo's DLRM batch (4 tables x 200,000 rows, batch 1024, pooling 10): `check_kjt` (names,
dtype, jagged structure, key range) and `check_batch_fits` (a table with more keys than cache
rows is deduplicated to see whether it can ever fit). Median of repeats, in microseconds.

    .venv/bin/python docs/probe_admission.py
"""
from __future__ import annotations

import statistics
import time

import torch

from torchpipe.bench.rec import RecConfig, build_torchpipe, make_batches
from torchpipe.rec.batch_keys import check_kjt


def median_us(fn, repeats: int = 200) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    torch.set_num_threads(1)
    cfg = RecConfig(tables=4, rows=200_000, dim=32, batch=1024, pooling=10, pool_batches=4, torchrec=False)
    batch = make_batches(cfg)[0]
    for cache_rows in (int(cfg.rows * cfg.cache_fraction), 5_000):
        model, pipe = build_torchpipe(cfg, cache_rows, overlap=True)
        collection = pipe.collection
        features = batch.sparse_features
        check = median_us(lambda: check_kjt(features, collection.layouts))
        fits = median_us(lambda: collection.check_batch_fits(features))
        admit = median_us(lambda: pipe._admit(batch))
        print(f"cache_rows {cache_rows:>6,}: check_kjt {check:7.1f} us, check_batch_fits {fits:7.1f} us, "
              f"whole admission {admit:7.1f} us per batch of {cfg.batch} samples "
              f"({features.values().numel():,} keys)")
        pipe.close()
    # One table's keys of this batch: counting distinct keys without a sort, against torch.unique.
    cache = collection.caches[collection.layouts[0].name]
    keys = torch.cat([features[f].values() for f in collection.layouts[0].feature_names]).to(torch.int64)
    print(f"{keys.numel():,} keys of one table: torch.unique {median_us(lambda: torch.unique(keys)):.1f} us, "
          f"distinct_count {median_us(lambda: cache.distinct_count(keys)):.1f} us")


if __name__ == "__main__":
    main()
