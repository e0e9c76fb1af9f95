"""Reproduce an abort at interpreter exit: a process that ran a Pipe and a gloo process group.

Found in the sixteenth session, explained and fixed in the seventeenth. Two ranks each build a
Pipe, run two ``Pipe.step`` calls, ``all_gather`` their gradients and
``destroy_process_group()``, then return normally. Before the fix, about one process in 20-60
died with SIGABRT in the interpreter's teardown ("terminate called without an active
exception"), after all its work.

Cause (from a core dump): the first ``torch.utils.checkpoint`` call imports ``torch._dynamo``,
which imports ``torch.distributed.nn.functional``; its collectives take ``group=group.WORLD``
as a default, evaluated at that import. After ``init_process_group`` those defaults hold the
default group, so ``destroy_process_group()`` does not free it, and its gloo threads run on into
finalization. A gloo thread that drops a finished collective's tensors there must take the GIL,
is ended by ``pthread_exit``, and the forced unwind through a noexcept destructor calls
``std::terminate``. ``import torchpipe`` now imports that module first, while no group exists
(``torchpipe/checkpoint.py``); ``tests/test_dist_teardown.py`` checks that the group's threads
end at ``destroy_process_group()``.

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
