"""A/B in one process: workers queued at the step's start ("eager") or once their first input exists ("lazy").

Quoted in docs/benchmarks.md (twentieth session). The runtime queues a worker whose first job needs
results only when the job that completes them ends (``Program.first_needs``/``unblocks``). This
probe switches that off on the very program the ``Pipe`` runs, by giving every worker zero needed
inputs (then the caller queues them all at the start, as before the change: ``first_workers``
is every worker with jobs), and alternates the
two in one process, so that the VM's per-process placement noise is the same for both:

    .venv/bin/python docs/probe_lazy_launch.py forward   # overhead suite's model, pipe(x) + backward
    .venv/bin/python docs/probe_lazy_launch.py step      # schedules suite's 2 ms stages, Pipe.step

Prints, per case, the median ms per call of each variant over the rounds, and in how many
rounds the lazy variant was faster.
"""
import statistics
import sys
import time

import torch
from torch import nn

from torchpipe import Pipe
from torchpipe.bench.overhead import make_model
from torchpipe.bench.schedules import BATCH, WIDTH, SplitSleepLayer, _loss

ROUNDS = 20


def alternate(call, program, calls: int) -> None:
    """Time ``calls`` calls of ``call`` per round, lazy and eager in turn (order swapped each round)."""
    lazy = (list(program.first_needs), list(program.unblocks), program.first_workers)
    eager = ([0] * len(program.first_needs), [()] * len(program.unblocks),
             tuple(w for w, jobs in enumerate(program.worker_jobs) if jobs))
    times = {"lazy": [], "eager": []}
    for r in range(ROUNDS):
        order = [("lazy", lazy), ("eager", eager)]
        for name, (needs, unblocks, first) in order if r % 2 else order[::-1]:
            program.first_needs, program.unblocks, program.first_workers = list(needs), list(unblocks), first
            start = time.perf_counter()
            for _ in range(calls):
                call()
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    program.first_needs, program.unblocks, program.first_workers = lazy
    wins = sum(a < b for a, b in zip(times["lazy"], times["eager"]))
    print(f"  lazy {statistics.median(times['lazy']):.3f} ms, eager {statistics.median(times['eager']):.3f} ms, "
          f"lazy / eager {statistics.median(times['lazy']) / statistics.median(times['eager']):.3f}, "
          f"lazy faster in {wins} of {ROUNDS} rounds")


def forward_cases() -> None:
    x = torch.randn(64, 16)
    for chunks in (1, 8, 32):
        with Pipe(make_model(), [1, 1, 1, 1], devices=["cpu"] * 4, chunks=chunks, checkpoint="never") as pipe:
            for _ in range(20):
                pipe(x).sum().backward()
            print(f"pipe(x) + backward, chunks={chunks}:")
            alternate(lambda: pipe(x).sum().backward(), pipe._forward_program(chunks)[1], 100 if chunks == 1 else 20)


def step_cases() -> None:
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    target = torch.randn(BATCH, WIDTH)
    for schedule in ("1f1b", "zb-h1"):
        for m in (8, 32):
            model = nn.Sequential(*[SplitSleepLayer(0.002) for _ in range(4)])
            with Pipe(model, [1] * 4, devices=["cpu"] * 4, chunks=m, checkpoint="never") as pipe:
                step = lambda: pipe.step(x, target, _loss, schedule=schedule, reduction="sum")  # noqa: E731
                step()
                print(f"Pipe.step, {schedule}, m={m}, 2 ms stages:")
                program = _program_of(pipe, step)
                alternate(step, program, 1)


def _program_of(pipe: Pipe, step) -> object:
    """The frozen program the last step ran (the Pipe caches it per plan)."""
    seen = []
    runtime = pipe._runtime
    original = runtime._run_locked

    def spy(program, *args, **kwargs):
        seen.append(program)
        return original(program, *args, **kwargs)

    runtime._run_locked = spy
    try:
        step()
    finally:
        del runtime._run_locked
    return seen[-1]


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"forward": forward_cases, "step": step_cases}[sys.argv[1] if len(sys.argv) > 1 else "forward"]()
