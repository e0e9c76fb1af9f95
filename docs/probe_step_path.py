"""Time ``Pipe.step`` on the `overhead` suite's model in the tree it runs from: quoted in docs/benchmarks.md.

4 x Linear(16, 16), batch 64, four CPU partitions, one intra-op thread, schedule 1f1b (or the
one named as the first argument: ``zb-h1`` exercises the split backward; ``forward`` times
``pipe(x).sum().backward()`` instead, the ``overhead`` suite's path, at chunks 1 and 8), with
``checkpoint='never'`` (saved tensors go through the step's counting hooks) and
``'always'`` (every micro-batch recomputed). Prints the median milliseconds per step over
``REPEATS`` repeats of 20 steps, for chunks 1, 8 and 32, and first the plain model's
``loss_fn(model(x), y).backward()`` for scale. To compare two trees, run it from each
with the tree first on ``sys.path`` (the script's own directory is ``docs/``, so without
``PYTHONPATH`` the installed checkout would run); the first line names the code that ran:

    cd <tree> && PYTHONPATH=. /work/main/.venv/bin/python docs/probe_step_path.py [schedule]
"""
import statistics
import sys
import time

import torch
from torch import nn

import torchpipe
from torchpipe import Pipe
from torchpipe.bench.overhead import make_model

REPEATS = 9
STEPS = 20


def median_ms(pipe: nn.Module, x: torch.Tensor, y: torch.Tensor, schedule: str) -> float:
    loss_fn = nn.MSELoss()

    def one_step() -> None:
        if schedule == "forward":
            pipe(x).sum().backward()
        elif not isinstance(pipe, Pipe):  # the plain model, for scale
            loss_fn(pipe(x), y).backward()
        else:
            pipe.step(x, y, loss_fn, schedule=schedule)

    for _ in range(3):
        one_step()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(STEPS):
            one_step()
        times.append((time.perf_counter() - start) / STEPS * 1e3)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    schedule = sys.argv[1] if len(sys.argv) > 1 else "1f1b"
    print("torchpipe from", torchpipe.__file__, "schedule", schedule, flush=True)
    x, y = torch.randn(64, 16), torch.randn(64, 16)
    print(f"plain model: {median_ms(make_model(), x, y, schedule):.3f} ms per step", flush=True)
    cases = [("never", 1), ("never", 8)] if schedule == "forward" else \
        [(checkpoint, chunks) for checkpoint in ("never", "always") for chunks in (1, 8, 32)]
    for checkpoint, chunks in cases:
        with Pipe(make_model(), [1, 1, 1, 1], devices=["cpu"] * 4, chunks=chunks, checkpoint=checkpoint) as pipe:
            print(f"checkpoint={checkpoint} chunks={chunks}: {median_ms(pipe, x, y, schedule):.3f} ms per step",
                  flush=True)


if __name__ == "__main__":
    main()
