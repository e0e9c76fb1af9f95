#!/usr/bin/env bash
# Side measurements quoted in docs/benchmarks.md (machine facts, per-call costs). Run from the repo root: bash docs/probes.sh
# To compare trees, run it from the other tree's root, which is then the code measured (python -c
# puts the current directory first on sys.path, before PYTHONPATH):
#   cd <tree> && PYTHON=/work/main/.venv/bin/python bash /work/main/docs/probes.sh
set -e
PY=${PYTHON:-.venv/bin/python}
$PY -c "
import statistics, threading, time, timeit
print(f'sleep(0): {timeit.timeit(lambda: time.sleep(0), number=2000) / 2000 * 1e6:.0f} us')
runs = [[] for _ in range(4)]
def sleeper(out):
    for _ in range(200):
        start = time.perf_counter(); time.sleep(0.002); out.append((time.perf_counter() - start) * 1e3)
threads = [threading.Thread(target=sleeper, args=(r,)) for r in runs]
[t.start() for t in threads]; [t.join() for t in threads]
q = statistics.quantiles(sum(runs, []), n=100)
print(f'sleep(2 ms) on 4 threads: p50 {q[49]:.2f} ms, p90 {q[89]:.2f} ms, p99 {q[98]:.2f} ms')
"
$PY -c "
import timeit, torch
from torchpipe import engine
w = torch.randn(4, requires_grad=True); g = torch.ones(4)
def plain(): torch.autograd.backward([w * 2], [g])
def direct(): engine.backward([w * 2], [g])
def forward_only(): w * 2
t = {f.__name__: min(timeit.repeat(f, number=5000, repeat=5)) / 5000 * 1e6 for f in (plain, direct, forward_only)}
print('us per call:', {k: round(v, 1) for k, v in t.items()})
"
$PY -c "
import timeit, torch
from torchpipe.bench.schedules import SplitSleepLayer
layer = SplitSleepLayer(0.0); x = torch.randn(8, 256, requires_grad=True)
def forward(): layer(x)
def forward_backward(): y = layer(x); y.backward(torch.ones_like(y))
print({f.__name__: round(min(timeit.repeat(f, number=2000, repeat=5)) / 2000 * 1e6) for f in (forward, forward_backward)}, 'us with t = 0')
"
# Thread round trip with the vCPUs kept awake by SCHED_IDLE busy loops (a VM's halted vCPU is
# slow to wake): the round trip, then the same with two idle-priority spinners running.
$PY -c "
import os, queue, subprocess, sys, threading, time
def round_trip(n=2000):
    a, b = queue.SimpleQueue(), queue.SimpleQueue()
    echo = threading.Thread(target=lambda: [b.put(a.get()) for _ in range(n)]); echo.start()
    start = time.perf_counter()
    for i in range(n):
        a.put(i); b.get()
    echo.join()
    return (time.perf_counter() - start) / n * 1e6
spin = 'import os\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True: pass'
print('round trip: %.0f us' % min(round_trip() for _ in range(3)))
spinners = [subprocess.Popen([sys.executable, '-c', spin]) for _ in range(os.cpu_count())]
try:
    time.sleep(0.3)
    print('round trip with idle spinners: %.0f us' % min(round_trip() for _ in range(3)))
finally:
    for p in spinners: p.kill()
"
# What leaving autocast costs a Pipe.step backward action when autocast is off (the usual case).
$PY -c "
import timeit
from types import SimpleNamespace
from torchpipe.step import _runs_outside_autocast
wrapped = _runs_outside_autocast(SimpleNamespace(backend=SimpleNamespace(type='cpu')))(lambda ctx, inputs: None)
print('autocast exit per backward action: %.2f us' % (min(timeit.repeat(lambda: wrapped(None, ()), number=20000, repeat=5)) / 20000 * 1e6))
"
# Where a Pipe.step goes (1F1B, 4 stages, m = 32, t = 2 ms): median action per kind from
# pipe.last_report(), and the sleeps as measured inside the jobs.
$PY -c "
import statistics, time, torch
from torch import nn
import torchpipe.bench.schedules as layers
from torchpipe import Pipe
torch.set_num_threads(1)
slept, sleep = [], time.sleep
class Timed:
    @staticmethod
    def sleep(seconds):
        start = time.perf_counter(); sleep(seconds); slept.append(time.perf_counter() - start)
layers.time = Timed
pipe = Pipe(nn.Sequential(*[layers.SplitSleepLayer(0.002) for _ in range(4)]), [1, 1, 1, 1], devices=['cpu'] * 4, chunks=32, checkpoint='never')
x, y = torch.randn(64, 256), torch.randn(64, 256)
for _ in range(3): pipe.step(x, y, layers._loss)
slept.clear(); pipe.step(x, y, layers._loss)
q = statistics.quantiles(slept, n=10)
print(pipe.last_report())
print('sleeps inside the jobs: median %.3f ms, mean %.3f ms, p90 %.3f ms' % (statistics.median(slept) * 1e3, statistics.mean(slept) * 1e3, q[8] * 1e3))
pipe.close()
"
# Python calls per job of one Pipe.step (1F1B, 4 x Linear(16,16), m = 8): the runtime's own
# per-job work, counted rather than timed.
$PY -c "
import collections, sys, threading, torch
from torch import nn
from torchpipe import Pipe
torch.set_num_threads(1); torch.manual_seed(0)
counts = collections.Counter(); on = [False]
def prof(frame, event, arg):
    if on[0] and event in ('call', 'c_call'): counts[event] += 1
threading.setprofile(prof)
pipe = Pipe(nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]), [1, 1, 1, 1], devices=['cpu'] * 4, chunks=8, checkpoint='never')
x, y = torch.randn(64, 16), torch.randn(64, 16)
step = lambda: pipe.step(x, y, nn.MSELoss(), schedule='1f1b')
step(); step()
sys.setprofile(prof); on[0] = True; step(); on[0] = False; sys.setprofile(None)
jobs = len(pipe.last_step.labels)
print(f'calls per job: Python {counts[\"call\"] / jobs:.1f}, C {counts[\"c_call\"] / jobs:.1f} ({jobs} jobs)')
pipe.close()
"

# Pipe.step makespan on the schedules suite's simulated-latency stages (t = 2 ms), median of 7
# steps, with the median forward and backward (or I) action: for a targeted A/B of two trees.
$PY -c "
import statistics, torch
from torch import nn
import torchpipe
from torchpipe import Pipe
from torchpipe.bench.schedules import SplitSleepLayer, _loss
x, target = torch.randn(64, 256), torch.randn(64, 256)
for schedule, m in (('1f1b', 32), ('zb-h1', 8), ('gpipe', 8)):
    model = nn.Sequential(*[SplitSleepLayer(0.002) for _ in range(4)])
    with Pipe(model, [1] * 4, devices=['cpu'] * 4, chunks=m, checkpoint='never') as pipe:
        pipe.step(x, target, _loss, schedule=schedule, reduction='sum')
        spans, forward, backward = [], [], []
        for _ in range(7):
            pipe.step(x, target, _loss, schedule=schedule, reduction='sum')
            record = pipe.last_step
            spans.append(record.makespan)
            for label, start, end in zip(record.labels, record.starts, record.ends):
                (forward if ' F ' in label else backward if (' B ' in label or ' I ' in label) else []).append(end - start)
    print(f'{torchpipe.__file__}: {schedule} m={m} makespan {statistics.median(spans) * 1e3:.1f} ms, '
          f'median F {statistics.median(forward) * 1e3:.3f} ms, B/I {statistics.median(backward) * 1e3:.3f} ms')
"

# What the zero-bubble W's hook check (split_backward._side_grads) costs per W action: the W of
# one simulated-latency stage at t = 0, one thread, with the check and with the engine call alone.
$PY -c "
import statistics, time, torch
from torch.autograd.graph import GradientEdge
from torchpipe import engine
from torchpipe.split_backward import WeightSplit
from torchpipe.bench.schedules import SplitSleepLayer
torch.set_num_threads(1)
layer, checked = SplitSleepLayer(0.0), WeightSplit._side_grads
def unchecked(self, node, kept, side, outputs):
    fed = {i: g for i, g in enumerate(kept) if g is not None}
    return engine.grad([GradientEdge(node, i) for i in fed], [GradientEdge(c, s) for c, s in side],
                       list(fed.values()), retain_graph=True)
def median_w_us(n=2000):
    times = []
    for _ in range(n):
        x = torch.randn(8, 256, requires_grad=True); out = layer(x); g = torch.ones_like(out)
        split = WeightSplit([out], [x]); split.input_grads([out], [g], [x])
        start = time.perf_counter(); split.weight_grads([out], [g]); times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6
for _ in range(3):
    WeightSplit._side_grads = checked; a = median_w_us()
    WeightSplit._side_grads = unchecked; b = median_w_us()
    print(f'W action: {a:.1f} us with the hook check, {b:.1f} us without')
"

# CPU time per action of a Pipe.step over a one-thread loop doing the same work (simulated-latency
# stages at t = 0, 4 stages, m = 32): what the runtime and the step add per action, in CPU time.
$PY -c "
import statistics, time, torch
from torch import nn
from torchpipe import Pipe
from torchpipe.bench.schedules import SplitSleepLayer, _loss
torch.set_num_threads(1)
p, m = 4, 32
x, target = torch.randn(64, 256), torch.randn(64, 256)
def cpu_median(fn, n=15):
    times = []
    for _ in range(n):
        start = time.process_time(); fn(); times.append(time.process_time() - start)
    return statistics.median(times)
for schedule in ('1f1b', 'zb-h1'):
    model = nn.Sequential(*[SplitSleepLayer(0.0) for _ in range(p)])
    def loop():
        for xs, ts in zip(x.chunk(m), target.chunk(m)):
            _loss(model(xs), ts).backward()
    with Pipe(model, [1] * p, devices=['cpu'] * p, chunks=m, checkpoint='never') as pipe:
        step = lambda: pipe.step(x, target, _loss, schedule=schedule, reduction='sum')
        for _ in range(3):
            step()
        piped = cpu_median(step)
        actions = len(pipe.last_step.labels)
    serial = cpu_median(loop)
    print(f'{schedule}: {(piped - serial) / actions * 1e6:.0f} us of CPU per action over the loop ({actions} actions)')
"
# LFU victim selection late in a long run: the cache's counters are fast-forwarded to the state
# after `tick` plans with one key in every batch (its frequency = tick), 1M slots, 4096 misses.
$PY -c "
import time, torch
from torchpipe.rec import EmbeddingCache
torch.set_num_threads(1)
rows, slots, batch = 4_000_000, 1_000_000, 4096
generator = torch.Generator().manual_seed(0)
for tick in (10_000, 1_000_000, 3_000_000):
    cache = EmbeddingCache(rows, slots, policy='lfu')
    cache.slot_of_key[:slots] = torch.arange(slots); cache.key_of_slot[:] = torch.arange(slots); cache._free_from = slots
    cache._last_used[:] = torch.randint(0, tick, (slots,), generator=generator)
    cache._freq_of_key[:slots] = torch.randint(1, 50, (slots,), generator=generator); cache._freq_of_key[0] = tick
    cache._tick = tick
    times = []
    for _ in range(5):
        keys = torch.unique(torch.randint(slots, rows, (batch,), generator=generator))
        start = time.perf_counter(); plan = cache.plan_swap(keys); times.append(time.perf_counter() - start); cache.release(plan)
    print(f'LFU plan_swap after {tick:,} plans: median {sorted(times)[2] * 1e3:.1f} ms')
"
# torch.distributed.pipelining's multi-stage schedules run in one process through Plan.from_torch,
# next to our named schedules, on the schedules suite's simulated-latency stages (4 workers of two
# stages, m = 8, t = 2 ms): sim/achieved and own sim/achieved (pipe.last_report()), median of 5 steps.
$PY -c "
import statistics, sys, torch
sys.path.insert(0, 'tests')
from torch import nn
from torch_schedules import CLASSES, torch_schedule
from torchpipe import Pipe
from torchpipe.bench.gpipe import measured_sleep
from torchpipe.bench.schedules import SplitSleepLayer, _loss
from torchpipe.schedule import Plan, build
torch.set_num_threads(1)
p, m, t = 4, 8, 0.002
tm = measured_sleep(t, 50)
costs = {'F': tm, 'I': tm, 'W': tm, 'B': 2 * tm}
x, target = torch.randn(64, 256, requires_grad=True), torch.randn(64, 256)
plans = [build('interleaved-1f1b', 2 * p, m, virtual_stages=2), build('zb-v', 2 * p, m)]
plans += [Plan.from_torch(torch_schedule(name, p, m)) for name in CLASSES]
for plan in plans:
    model = nn.Sequential(*[SplitSleepLayer(t) for _ in range(2 * p)])
    with Pipe(model, [1] * (2 * p), devices=['cpu'] * (2 * p), chunks=m, checkpoint='never') as pipe:
        pipe.step(x, target, _loss, schedule=plan, reduction='sum')
        achieved, own = [], []
        for _ in range(5):
            pipe.step(x, target, _loss, schedule=plan, reduction='sum')
            achieved.append(pipe.last_step.makespan); own.append(pipe.last_report().planned_makespan)
    sim = plan.simulate(costs).makespan
    a = statistics.median(achieved)
    print(f'{plan.name:30s} simulated {sim * 1e3:6.1f} ms  achieved {a * 1e3:6.1f} ms  sim/achieved {sim / a:.3f}  own {statistics.median(own) / a:.3f}')
"
