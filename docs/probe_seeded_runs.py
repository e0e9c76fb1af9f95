"""Do seeded runs of a Pipe with dropout on two CPU partitions repeat themselves?

    .venv/bin/python docs/probe_seeded_runs.py

Runs one model five times per mode, each after torch.manual_seed(123), and prints whether each
rerun's output equals the first. A layer sleeps a Python-random while before each dropout, so
the worker threads' order changes from run to run (tests/test_reproducible.py uses the same).
"""
import random, time, sys
import torch
from torch import nn
from torchpipe import Pipe

class Jitter(nn.Module):
    """Sleeps a random (Python-random) while, so the threads' order changes from run to run."""
    def forward(self, x):
        time.sleep(random.random() * 0.002)
        return x

def mk():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), Jitter(), nn.Dropout(0.5), nn.Linear(64, 64), Jitter(), nn.Dropout(0.5), nn.Linear(64, 2))

x = torch.randn(64, 16)
for reproducible in (False, True):
    for ck in ("never", "always"):
        outs = []
        for run in range(5):
            with Pipe(mk(), [3, 4], devices=["cpu"] * 2, chunks=4, checkpoint=ck, reproducible=reproducible) as m:
                torch.manual_seed(123)
                outs.append(m(x).detach())
        print(reproducible, ck, [torch.equal(outs[0], o) for o in outs[1:]])
