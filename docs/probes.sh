#!/usr/bin/env bash
# Side measurements quoted in docs/benchmarks.md (machine facts, per-call costs). Run from the repo root: bash docs/probes.sh
set -e
.venv/bin/python -c "
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
.venv/bin/python -c "
import timeit, torch
from torchpipe import engine
w = torch.randn(4, requires_grad=True); g = torch.ones(4)
def plain(): torch.autograd.backward([w * 2], [g])
def direct(): engine.backward([w * 2], [g])
def forward_only(): w * 2
t = {f.__name__: min(timeit.repeat(f, number=5000, repeat=5)) / 5000 * 1e6 for f in (plain, direct, forward_only)}
print('us per call:', {k: round(v, 1) for k, v in t.items()})
"
.venv/bin/python -c "
import timeit, torch
from torchpipe.bench.schedules import SplitSleepLayer
layer = SplitSleepLayer(0.0); x = torch.randn(8, 256, requires_grad=True)
def forward(): layer(x)
def forward_backward(): y = layer(x); y.backward(torch.ones_like(y))
print({f.__name__: round(min(timeit.repeat(f, number=2000, repeat=5)) / 2000 * 1e6) for f in (forward, forward_backward)}, 'us with t = 0')
"
