"""What the sharded pipeline's per-clock vote costs: 2 ranks (gloo, one process each),
EmbCacheTrainPipeline over TableWiseSharding, with the vote on and off in alternating rounds.

    .venv/bin/python docs/probe_clock_vote.py [rounds] [steps]
    .venv/bin/python docs/probe_clock_vote.py [rounds] [steps] eval

"Off" builds the pipeline, then takes `agree` out of its StagedPipeline before any clock
runs: a rank's plan failure then fails only that rank (the behaviour before the vote).
Prints the median milliseconds per progress() call of each variant, and also times the
vote's all-reduce alone.

``eval`` runs the model in eval mode (no backward, no dense all-reduce) and times the pipeline
as it is, with no "off" variant: its forward-only step needs the clock's vote to count, so
taking the vote out is no baseline. Compare two trees instead (each with this file).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "train"), os.path.join(HERE, "..", "tests", "rec"),
                os.path.join(HERE, "..", "tests")]


def one_run(rank: int, vote: bool, steps: int, batches, tables, sharding, evaluating: bool = False) -> float:
    from train_helpers import DENSE_IN, TinyDLRM, emb_width, integer_weights
    from torchpipe.rec import SGD, CachedEmbeddingBagCollection
    from torchpipe.train import EmbCacheTrainPipeline

    mine = sharding.local_tables
    ebc = CachedEmbeddingBagCollection(mine, 400, optimizer=SGD(lr=0.01), weights=integer_weights(tables))
    model = TinyDLRM(ebc, emb_width(tables))
    if evaluating:
        model.eval()
    with EmbCacheTrainPipeline(model, torch.optim.SGD(model.parameters(), lr=0.01), collection=ebc,
                               sharding=sharding, host_threads=2, device_threads=1) as pipe:
        if not vote:
            pipe.pipeline._agree = None  # jobs are built on the first clock: none defers, none votes
        it = iter(batches[:steps])
        for _ in range(5):
            pipe.progress(it)
        start = time.perf_counter()
        done = 0
        while True:
            try:
                pipe.progress(it)
            except StopIteration:
                break
            done += 1
        return (time.perf_counter() - start) / done * 1e3


def worker(rank: int, init: str, rounds: int, steps: int, evaluating: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    from train_helpers import make_batches, make_tables
    from torchpipe.train import TableWiseSharding

    tables = make_tables(num_rows=(2000, 1000))
    sharding = TableWiseSharding(tables, output_group=dist.new_group([0, 1]))
    batches = make_batches(tables, steps, batch_size=32, seed=rank)
    times = {True: [], False: []}
    for r in range(rounds):
        for vote in ((True,) if evaluating else (True, False) if r % 2 == 0 else (False, True)):
            times[vote].append(one_run(rank, vote, steps, batches, tables, sharding, evaluating))
    alone = []
    for _ in range(500):
        start = time.perf_counter()
        sharding.vote(False)
        alone.append(time.perf_counter() - start)
    if rank == 0:
        on = statistics.median(times[True])
        if evaluating:
            print(f"eval mode, the pipeline as it is: ms per progress() {on:.3f} "
                  f"({rounds} rounds of {steps} batches of 32 per rank)")
            print("rounds:", [round(t, 1) for t in times[True]])
        else:
            off = statistics.median(times[False])
            print(f"train mode, ms per progress(): vote on {on:.3f}, off {off:.3f}, on - off {on - off:.3f} "
                  f"({rounds} rounds of {steps} batches of 32 per rank)")
            print("rounds on:", [round(t, 1) for t in times[True]], "off:", [round(t, 1) for t in times[False]])
        print(f"the vote alone: median {statistics.median(alone) * 1e6:.0f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    evaluating = len(sys.argv) > 3 and sys.argv[3] == "eval"
    init = os.path.join(tempfile.mkdtemp(), "init")
    mp.spawn(worker, args=(init, rounds, steps, evaluating), nprocs=2)
