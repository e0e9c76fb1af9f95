"""Reproduce a deadlock in plain torch: a DDP freed after ``destroy_process_group()`` (gloo).

Found in the twenty-first session, when ``tests/test_grad_sync.py``'s DDP case hung in about
one run in 30. No torchpipe code takes part here. Each round, both ranks build a gloo group,
wrap a small model in ``DistributedDataParallel``, run one backward, and tear down in the
order named on the command line:

* ``group_first``: ``destroy_process_group()``, then drop the DDP. The DDP's Reducer now holds
  the last reference to the group, and its destructor (bound without releasing the GIL) runs
  the group's destructor with the GIL held. That destructor takes the mutex of gloo's work
  queue; a gloo thread that holds it while freeing a finished all-reduce must take the GIL to
  drop the tensors' Python objects. Neither moves. ``gdb -p`` on the hung rank shows exactly
  those two stacks.
* ``ddp_first``: drop the DDP (and collect), then ``destroy_process_group()``: the group dies
  through its own binding, which releases the GIL first.

Measured on the 2-vCPU box (the first runs from a draft of this script without the
``gc.collect()``): ``group_first`` hung in 4 of 5 runs of 150 rounds (at rounds 72 and 35 in
two of them; the other two did not record the round); ``ddp_first`` finished all 5 runs (750
rounds).
Kept output: ``docs/results/cpu-2026-11-23-s21/probe_ddp_teardown-*.txt``.

    .venv/bin/python docs/probe_ddp_teardown.py group_first   # ROUNDS=150 by default
    .venv/bin/python docs/probe_ddp_teardown.py ddp_first

A hung rank prints its Python stack after 60 s and exits; the run then fails.
"""
from __future__ import annotations

import faulthandler
import gc
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def rank_main(rank: int, world: int, directory: str, order: str) -> None:
    faulthandler.dump_traceback_later(60, exit=True)
    torch.set_num_threads(1)
    rounds = int(os.environ.get("ROUNDS", "150"))
    for i in range(rounds):
        dist.init_process_group("gloo", init_method=f"file://{directory}/init{i}", rank=rank, world_size=world)
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)))
        ddp(torch.randn(8, 16)).sum().backward()
        if order == "ddp_first":
            del ddp
            gc.collect()
            dist.destroy_process_group()
        else:
            dist.destroy_process_group()
            del ddp
    print(f"rank {rank}: {rounds} rounds, no hang", flush=True)
    os._exit(0)  # skip the interpreter's teardown: what is measured is the rounds above


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("group_first", "ddp_first"):
        raise SystemExit("usage: probe_ddp_teardown.py group_first|ddp_first")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(2, tmp, sys.argv[1]), nprocs=2)
