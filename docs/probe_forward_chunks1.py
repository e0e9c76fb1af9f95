"""Time, and count the Python calls of, ``pipe(x).sum().backward()`` at chunks = 1: quoted in docs/benchmarks.md.

The eighteenth session saw this path slower after its changes in 8 of 9 alternating pairs of
``docs/probe_step_path.py forward`` (20 calls per repeat). This probe times 15 repeats of 100
calls, wall clock and process CPU time (all threads), on the ``overhead`` suite's model
(4 x Linear(16, 16), batch 64, four CPU partitions, one intra-op thread, ``checkpoint='never'``).
With ``count`` as the first argument it instead counts the Python-level calls per ``pipe(x)``
+ backward, by thread: a measure of added work that does not depend on the VM's noise. With
``phases`` it splits the forward call by the step record's job times: the caller's time until
the first job starts, the jobs themselves, the gaps between consecutive jobs (hand-offs), and
the time from the last job's end until the call returns. Run it from each tree with the tree
first on ``sys.path``:

    cd <tree> && PYTHONPATH=. /work/main/.venv/bin/python docs/probe_forward_chunks1.py [count|phases]
"""
import collections
import statistics
import sys
import threading
import time

import torch

import torchpipe
from torchpipe import Pipe
from torchpipe.bench.overhead import make_model

CALLS_PER_REPEAT = 100
REPEATS = 15
COUNTED_CALLS = 10


class CallCounter:
    """A profile function for every thread, counting calls by thread while switched on."""

    def __init__(self) -> None:
        self.on = False
        self.counts: collections.Counter = collections.Counter()

    def __call__(self, frame, event, arg) -> None:
        if self.on and event in ("call", "c_call"):
            self.counts[(threading.current_thread().name.split("-")[0], event)] += 1


def phases(pipe: Pipe, x: torch.Tensor, calls: int = 2000) -> None:
    """Median microseconds of each phase of a forward call (see the module docstring)."""
    parts: dict = {"total": [], "caller until the first job": [], "4 jobs": [], "3 hand-offs": [],
                   "last job's end until return": []}
    for _ in range(calls):
        start = time.perf_counter()
        y = pipe(x)
        end = time.perf_counter()
        record = pipe.last_step
        order = sorted(range(len(record.starts)), key=lambda i: record.starts[i])
        parts["total"].append(end - start)
        parts["caller until the first job"].append(record.starts[order[0]] - start)
        parts["4 jobs"].append(sum(record.ends[i] - record.starts[i] for i in order))
        parts["3 hand-offs"].append(sum(record.starts[b] - record.ends[a] for a, b in zip(order, order[1:])))
        parts["last job's end until return"].append(end - record.ends[order[-1]])
        y.sum().backward()
    print("torchpipe from", torchpipe.__file__)
    for name, values in parts.items():
        print(f"{name}: {statistics.median(values) * 1e6:.1f} us")


def main() -> None:
    torch.set_num_threads(1)
    count = len(sys.argv) > 1 and sys.argv[1] == "count"
    counter = CallCounter()
    if count:  # before the Pipe starts its workers, so that they inherit it
        sys.setprofile(counter)
        threading.setprofile(counter)
    x = torch.randn(64, 16)
    with Pipe(make_model(), [1, 1, 1, 1], devices=["cpu"] * 4, chunks=1, checkpoint="never") as pipe:
        for _ in range(50):
            pipe(x).sum().backward()
        if len(sys.argv) > 1 and sys.argv[1] == "phases":
            phases(pipe, x)
            return
        if count:
            counter.on = True
            for _ in range(COUNTED_CALLS):
                pipe(x).sum().backward()
            counter.on = False
            sys.setprofile(None)
            threading.setprofile(None)
            print("torchpipe from", torchpipe.__file__)
            for (thread, event), n in sorted(counter.counts.items()):
                print(f"{thread} {event}: {n / COUNTED_CALLS:.1f} per call")
            return
        walls, cpus = [], []
        for _ in range(REPEATS):
            wall0, cpu0 = time.perf_counter(), time.process_time()
            for _ in range(CALLS_PER_REPEAT):
                pipe(x).sum().backward()
            walls.append((time.perf_counter() - wall0) / CALLS_PER_REPEAT * 1e3)
            cpus.append((time.process_time() - cpu0) / CALLS_PER_REPEAT * 1e3)
    print(f"torchpipe from {torchpipe.__file__}: wall {statistics.median(walls):.3f} ms, "
          f"cpu {statistics.median(cpus):.3f} ms per call")


if __name__ == "__main__":
    main()
