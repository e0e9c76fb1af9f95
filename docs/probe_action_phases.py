"""Where a ``schedules`` action's time goes beyond its sleep: quoted in docs/benchmarks.md (twentieth session).

Runs ``Pipe.step`` on the ``schedules`` suite's stages (4 x ``SplitSleepLayer(2 ms)``, batch
64 x 256, m = 8) with ``time.sleep`` wrapped to record when each sleep starts and ends, and on
which thread. For every action it splits the step record's span into: the sleeps inside it (on
its own worker), the Python before the first sleep, and the Python after the last one. For
comparison it times the same phases of the layer alone on this thread (forward, then backward
of the output), with no pipeline and no other thread running: the layer's own Python.

    .venv/bin/python docs/probe_action_phases.py [schedule ...]     # default: 1f1b zb-h1

The "after the sleep" figure starts once ``time.sleep`` has returned, so it already holds the GIL:
what is longer in the pipeline than alone is Python that ran slower or waited while it ran (every
torch op called from Python releases the GIL and takes it back).
"""
import statistics
import sys
import threading
import time
import types

import torch
from torch import nn

import torchpipe.bench.schedules as suite
from torchpipe import Pipe
from torchpipe.bench.gpipe import measured_sleep

STAGE_S = 0.002
MICROBATCHES = 8
REPEATS = 7

_real_sleep = time.sleep
_sleeps = []  # (start, end, thread id)


def _recorded_sleep(seconds: float) -> None:
    start = time.perf_counter()
    _real_sleep(seconds)
    _sleeps.append((start, time.perf_counter(), threading.get_ident()))


def _median_ms(values) -> str:
    return f"{statistics.median(values) * 1e3:.3f}" if values else "-"


def layer_alone() -> None:
    """The layer's own phases on this thread: forward (one sleep), backward (two sleeps)."""
    layer = suite.SplitSleepLayer(STAGE_S)
    x = torch.randn(suite.BATCH // MICROBATCHES, suite.WIDTH, requires_grad=True)
    phases = {"F": ([], []), "B": ([], [])}
    for _ in range(50):
        _sleeps.clear()
        start = time.perf_counter()
        out = layer(x)
        end = time.perf_counter()
        phases["F"][0].append(_sleeps[0][0] - start)
        phases["F"][1].append(end - _sleeps[-1][1])
        _sleeps.clear()
        start = time.perf_counter()
        out.backward(torch.ones_like(out))
        end = time.perf_counter()
        phases["B"][0].append(_sleeps[0][0] - start)
        phases["B"][1].append(end - _sleeps[-1][1])
    for kind, (before, after) in phases.items():
        print(f"layer alone {kind}: before the first sleep {_median_ms(before)} ms, after the last {_median_ms(after)} ms")


def in_pipeline(schedule: str) -> None:
    x = torch.randn(suite.BATCH, suite.WIDTH, requires_grad=True)
    target = torch.randn(suite.BATCH, suite.WIDTH)
    model = nn.Sequential(*[suite.SplitSleepLayer(STAGE_S) for _ in range(4)])
    by_kind = {}
    with Pipe(model, [1] * 4, devices=["cpu"] * 4, chunks=MICROBATCHES, checkpoint="never") as pipe:
        threads = [worker.thread.ident for worker in pipe._runtime.workers]
        pipe.step(x, target, suite._loss, schedule=schedule, reduction="sum")
        for _ in range(REPEATS):
            _sleeps.clear()
            pipe.step(x, target, suite._loss, schedule=schedule, reduction="sum")
            record = pipe.last_step
            for action, start, end, worker in zip(record.keys, record.starts, record.ends, record.workers):
                inside = sorted((a, b) for a, b, thread in _sleeps
                                if thread == threads[worker] and a >= start and b <= end)
                if not inside:  # stage 0's I computes nothing: no sleep
                    continue
                row = by_kind.setdefault(action.kind, {"span": [], "sleeps": [], "before": [], "after": []})
                row["span"].append(end - start)
                row["sleeps"].append(sum(b - a for a, b in inside))
                row["before"].append(inside[0][0] - start)
                row["after"].append(end - inside[-1][1])
    for kind, row in by_kind.items():
        print(f"{schedule} {kind}: span {_median_ms(row['span'])} ms, sleeps {_median_ms(row['sleeps'])} ms, "
              f"before the first sleep {_median_ms(row['before'])} ms, after the last {_median_ms(row['after'])} ms")


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(f"time.sleep({STAGE_S}) alone: {measured_sleep(STAGE_S, 100) * 1e3:.3f} ms")
    suite.time = types.SimpleNamespace(sleep=_recorded_sleep)  # the layers' sleeps, recorded
    layer_alone()
    for name in sys.argv[1:] or ["1f1b", "zb-h1"]:
        in_pipeline(name)
