"""Where a gpipe forward's wall time goes outside the runtime's own makespan (issue 3).

The ``gpipe`` suite judges ideal / wall, and prints ideal / ``last_step.makespan`` beside it.
This probe splits the difference for the suite's model (4 simulated-latency stages, t = 2 ms,
``no_grad``) into the call's entry (splitting, checks, the plan, queueing: call to
``wall_start``), the first hand-off (``wall_start`` to the first job's start), the last
hand-off (last job's end to ``wall_end``) and the exit (``wall_end`` to the call's return:
gathering). It also prints what the runtime's jobs themselves allow: the fill-drain critical
path computed from each job's own measured duration.

``count`` counts the Python-level calls (function calls and builtin calls) per forward call,
by thread, with ``t = 0``: the caller's entry and exit, and each stage thread's share of its
jobs; with a schedule name after ``m``, per ``Pipe.step`` on the ``schedules`` suite's model. A measure of the work that, unlike the times above, does not move with the VM's noise.

``cold`` shows why the entry and exit cost more here than the same code in a tight loop: on
this VM a thread that slept runs its first torch ops several times slower (the caller sleeps
for the whole step, the stages' threads for each job's sleep).

    .venv/bin/python docs/probe_call_edges.py edges [m]
    .venv/bin/python docs/probe_call_edges.py count [m] [schedule]
    .venv/bin/python docs/probe_call_edges.py cold
"""

from __future__ import annotations

import collections
import statistics
import sys
import threading
import time
from typing import Any

import torch

import torchpipe
from torchpipe import Pipe
from torchpipe.bench.gpipe import STAGE_S, STAGES, make_model, measured_sleep


def _median_us(values: list) -> float:
    return statistics.median(values) * 1e6


def edges(m: int, calls: int = 60) -> None:
    pipe = Pipe(make_model(STAGE_S), balance=[1] * STAGES, chunks=m, checkpoint="never")
    x = torch.randn(64, 16)
    sleep = measured_sleep(STAGE_S, 200)
    ideal = (m + STAGES - 1) * sleep
    walls, makespans, paths = [], [], []
    entry, first_handoff, last_handoff, exit_ = [], [], [], []
    with torch.no_grad():
        pipe(x)  # warm-up
        for _ in range(calls):
            called = time.perf_counter()
            pipe(x)
            returned = time.perf_counter()
            step = pipe.last_step
            first = min(s for s in step.starts if s >= 0)
            last = max(e for s, e in zip(step.starts, step.ends) if s >= 0)
            duration = {(a.stage, a.microbatch): e - s for a, s, e in zip(step.keys, step.starts, step.ends)}
            finish: dict = {}
            for stage in range(STAGES):
                for mb in range(m):
                    ready = max(finish.get((stage - 1, mb), 0.0), finish.get((stage, mb - 1), 0.0))
                    finish[(stage, mb)] = ready + duration[(stage, mb)]
            walls.append(returned - called)
            makespans.append(step.makespan)
            paths.append(finish[(STAGES - 1, m - 1)])
            entry.append(step.wall_start - called)
            first_handoff.append(first - step.wall_start)
            last_handoff.append(step.wall_end - last)
            exit_.append(returned - step.wall_end)
    pipe.close()
    print(f"m = {m}, {calls} calls, sleep(2 ms) measured {sleep * 1e3:.3f} ms, ideal {ideal * 1e3:.2f} ms")
    for name, values in (("wall", walls), ("last_step.makespan", makespans),
                         ("critical path of the jobs' own durations", paths)):
        median = statistics.median(values)
        print(f"  {name:42s} {median * 1e3:7.3f} ms   ideal / this {ideal / median:.3f}")
    print(f"  entry (call -> wall_start)   {_median_us(entry):6.0f} us")
    print(f"  first hand-off               {_median_us(first_handoff):6.0f} us")
    print(f"  last hand-off                {_median_us(last_handoff):6.0f} us")
    print(f"  exit (wall_end -> return)    {_median_us(exit_):6.0f} us")


def count(m: int, schedule: str = "forward", calls: int = 10) -> None:
    """Calls per ``pipe(x)`` under no_grad (``schedule='forward'``), or per ``Pipe.step`` with
    ``schedule`` on the ``schedules`` suite's model (t = 0); also per job on the stage threads."""
    counts: collections.Counter = collections.Counter()
    counting = False

    def profile(frame: Any, event: str, arg: Any) -> None:
        if counting and event in ("call", "c_call"):
            counts[(threading.current_thread().name.split("-")[0], event)] += 1

    sys.setprofile(profile)  # before the Pipe starts its workers, so that they inherit it
    threading.setprofile(profile)
    if schedule == "forward":
        pipe = Pipe(make_model(0.0), balance=[1] * STAGES, chunks=m, checkpoint="never")
        x = torch.randn(64, 16)

        def call() -> None:
            with torch.no_grad():
                pipe(x)
    else:
        from torchpipe.bench.schedules import BATCH, WIDTH, SplitSleepLayer, _loss

        pipe = Pipe(torch.nn.Sequential(*[SplitSleepLayer(0.0) for _ in range(STAGES)]), [1] * STAGES,
                    chunks=m, checkpoint="never")
        x, target = torch.randn(BATCH, WIDTH, requires_grad=True), torch.randn(BATCH, WIDTH)

        def call() -> None:
            pipe.step(x, target, _loss, schedule=schedule, reduction="sum")
    for _ in range(5):
        call()
    counting = True
    for _ in range(calls):
        call()
    counting = False
    sys.setprofile(None)
    threading.setprofile(None)
    jobs = len(pipe.last_step.keys)
    pipe.close()
    print(f"m = {m}, {schedule}: calls per call, by thread, and per job on the stage threads "
          f"({jobs} jobs; torchpipe from {torchpipe.__file__})")
    for (thread, event), n in sorted(counts.items()):
        print(f"  {thread:12s} {event:7s} {n / calls:7.1f}" + (f"  {n / calls / jobs:5.2f} per job"
                                                             if thread == "torchpipe" else ""))


def cold(rounds: int = 60) -> None:
    x = torch.randn(64, 16)
    for idle in (0.0, 0.0005, 0.002, 0.025):
        firsts, seconds = [], []
        for _ in range(rounds):
            if idle:
                time.sleep(idle)
            for out in (firsts, seconds):
                start = time.perf_counter()
                x.chunk(8)
                torch.cat([x, x])
                out.append(time.perf_counter() - start)
        print(f"after sleeping {idle * 1e3:5.1f} ms: chunk + cat {_median_us(firsts):6.1f} us, "
              f"then again {_median_us(seconds):6.1f} us")
    spun = []  # a clock that ramps up after idling would be up to speed after a busy loop
    for _ in range(rounds):
        time.sleep(0.025)
        start = time.perf_counter()
        while time.perf_counter() - start < 0.0003:
            pass
        start = time.perf_counter()
        x.chunk(8)
        torch.cat([x, x])
        spun.append(time.perf_counter() - start)
    print(f"after sleeping 25.0 ms, then a 300 us busy loop: chunk + cat {_median_us(spun):6.1f} us")


if __name__ == "__main__":
    torch.set_num_threads(1)
    what = sys.argv[1] if len(sys.argv) > 1 else "edges"
    if what == "edges":
        edges(int(sys.argv[2]) if len(sys.argv) > 2 else 8)
    elif what == "count":
        count(int(sys.argv[2]) if len(sys.argv) > 2 else 8, sys.argv[3] if len(sys.argv) > 3 else "forward")
    elif what == "cold":
        cold()
    else:
        raise SystemExit(f"unknown probe {what!r}: expected 'edges', 'count' or 'cold'")
