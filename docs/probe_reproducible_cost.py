"""What Pipe(..., reproducible=True) costs a step whose partitions all draw (dropout).

    .venv/bin/python docs/probe_reproducible_cost.py [repeats]

Four CPU partitions of Linear(256, 256) + ReLU + Dropout(0.1), batch 256, chunks 8, forward
and backward through autograd; each checkpoint mode with reproducible off and on, timed in
alternation (off, on, off, on, ...) so that a burst of load hits both. Prints the median
step time of each and the ratio on/off. With the option on, forwards on the shared CPU
generator run one at a time, so the ratio shows what that serialisation costs here.
"""
import statistics
import sys
import time

import torch
from torch import nn

from torchpipe import Pipe


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.ReLU(), nn.Dropout(0.1)]
    return nn.Sequential(*layers)


def main(repeats: int) -> None:
    x = torch.randn(256, 256)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads in the caller, {repeats} repeats")
    for checkpoint in ("never", "except_last"):
        pipes = {flag: Pipe(model(), [3, 3, 3, 3], chunks=8, checkpoint=checkpoint, reproducible=flag)
                 for flag in (False, True)}
        times = {False: [], True: []}
        for flag, pipe in pipes.items():  # warm up
            for _ in range(3):
                pipe(x).sum().backward()
        for _ in range(repeats):
            for flag, pipe in pipes.items():
                start = time.perf_counter()
                pipe(x).sum().backward()
                times[flag].append(time.perf_counter() - start)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"checkpoint={checkpoint:12s} off {off * 1e3:7.2f} ms   on {on * 1e3:7.2f} ms   on/off {on / off:5.2f}")
        for pipe in pipes.values():
            pipe.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 21)
