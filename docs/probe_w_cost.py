"""What W (WeightSplit.weight_grads) costs for a 5-layer MLP stage, median of 7 rounds of 500: quoted in docs/benchmarks.md (41st session).

    cd <tree> && PYTHONPATH=. /work/main/.venv/bin/python docs/probe_w_cost.py
"""
import time, statistics, torch
from torch import nn
from torchpipe.split_backward import WeightSplit
torch.manual_seed(0)
stage = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))
def once():
    x = torch.randn(16, 64, requires_grad=True)
    out = stage(x)
    split = WeightSplit([out], [x])
    g = torch.ones_like(out)
    split.input_grads([out], [g], [x])
    s = time.perf_counter()
    split.weight_grads([out], [g])
    return time.perf_counter() - s
for _ in range(200): once()
rounds = []
for r in range(7):
    rounds.append(statistics.median(once() for _ in range(500)))
print(f"W median {statistics.median(rounds)*1e6:.1f} us", [round(v*1e6,1) for v in rounds])
