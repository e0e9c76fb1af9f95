"""Reproduce an abort at interpreter exit: a process that ran a Pipe and a gloo process group.

Found in the sixteenth session. Two ranks each build a Pipe, run two ``Pipe.step`` calls,
``all_gather`` their gradients and ``destroy_process_group()``, then return normally. About
one process in 20-60 then dies with SIGABRT during the interpreter's teardown ("terminate
called without an active exception"), after all its work. It happens with and without a
``GradientSync``, and on the fifteenth session's code too; a gloo-only script with a daemon
thread issuing the all-reduces (no Pipe) did not abort in 60 runs. The cause is not found.
The tests' workers leave through ``os._exit`` (``tests/spawn_helpers.py``) to stay clear of it.

    .venv/bin/python docs/probe_exit_abort.py 60          # with a GradientSync
    NOSYNC=1 .venv/bin/python docs/probe_exit_abort.py 60 # without
"""
from __future__ import annotations

import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from torchpipe import GradientSync, Pipe


def worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 1)).double()
        pipe = Pipe(model, balance=[3, 2], devices=["cpu"] * 2, chunks=2)
        if os.environ.get("NOSYNC") != "1":
            GradientSync(pipe)
        x, y = torch.randn(12, 6, dtype=torch.double), torch.randn(12, 1, dtype=torch.double)
        for _ in range(2):
            pipe.step(x, y, nn.MSELoss())
        flat = torch.cat([p.grad.reshape(-1) for p in pipe.parameters()])
        dist.all_gather([torch.empty_like(flat) for _ in range(2)], flat)
    finally:
        dist.destroy_process_group()


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    aborted = 0
    for _ in range(runs):
        try:
            mp.spawn(worker, args=(os.path.join(tempfile.mkdtemp(), "init"),), nprocs=2, join=True)
        except mp.ProcessExitedException as exc:
            aborted += 1
            print(exc, flush=True)
    print(f"{aborted} of {runs} runs had a process abort at exit")


if __name__ == "__main__":
    main()
