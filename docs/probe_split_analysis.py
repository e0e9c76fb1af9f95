"""What ``WeightSplit(...)`` costs per micro-batch: the zero-bubble ``I`` job's graph analysis (quoted in
docs/benchmarks.md, fortieth session).

Builds one stage graph (a ``SplitSleepLayer`` of the ``schedules`` suite with t = 0, and a
6-layer MLP), then constructs a ``WeightSplit`` on it and removes its hooks 2,000 times; prints
the median construction time. Run it from each tree to compare:

    cd <tree> && PYTHONPATH=. /work/main/.venv/bin/python /work/main/docs/probe_split_analysis.py
"""
import statistics, time, torch
from torch import nn
import torchpipe.bench.schedules as suite
from torchpipe.split_backward import WeightSplit
def graphs():
    layer = suite.SplitSleepLayer(0.0)
    x = torch.randn(8, 256, requires_grad=True)
    yield "sleep layer", [layer(x)], [x]
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    x = torch.randn(8, 64, requires_grad=True)
    yield "6-layer mlp", [m(x)], [x]
for name, outs, leaves in graphs():
    ts = []
    for _ in range(2000):
        t = time.perf_counter()
        s = WeightSplit(outs, leaves)
        ts.append(time.perf_counter() - t)
        for h in s._hooks: h.remove()
    print(f"{name}: {statistics.median(ts)*1e6:.1f} us, frontier {len(s.frontier)}")
