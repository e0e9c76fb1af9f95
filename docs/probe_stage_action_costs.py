"""Per (stage, kind) durations of a schedules-suite step against the stage alone: quoted in docs/benchmarks.md (41st session).

Builds the schedules suite's model (4 or 8 SplitSleepLayer(2 ms) stages, batch 64 x 256), runs 11 steps of
Pipe.step and prints, per (stage, kind), the median and the largest duration of its actions, the
plan simulated with the stage-alone costs (the suite's simulated makespan), with the per-(stage, kind)
medians, and with each step's own durations (pipe.last_report().planned_makespan).

    .venv/bin/python docs/probe_stage_action_costs.py [schedule] [m]     # default: zb-h1 8
"""
import statistics, sys, torch
from torch import nn
import torchpipe.bench.schedules as suite
from torchpipe import Pipe
from torchpipe.schedule import build
name = sys.argv[1] if len(sys.argv) > 1 else "zb-h1"
m = int(sys.argv[2]) if len(sys.argv) > 2 else 8
opts = {"virtual_stages": 2} if name in ("interleaved-1f1b",) else {}
v = 2 if name in ("interleaved-1f1b", "zb-v") else 1
stages = 4 * v
t = 0.002
alone = suite.StageAlone.measure(t, 64 // m, 30)
print("alone", alone.as_ms())
x = torch.randn(64, 256, requires_grad=True); y = torch.randn(64, 256)
model = nn.Sequential(*[suite.SplitSleepLayer(t) for _ in range(stages)])
plan = build(name, stages, m, **opts)
sim = plan.simulate(alone.costs(stages)).makespan
with Pipe(model, [1]*stages, devices=["cpu"]*stages, chunks=m, checkpoint="never") as pipe:
    pipe.step(x, y, suite._loss, schedule=name, reduction="sum", **opts)
    per = {}
    spans=[]; owns=[]
    for _ in range(11):
        pipe.step(x, y, suite._loss, schedule=name, reduction="sum", **opts)
        r = pipe.last_step
        spans.append(r.makespan); owns.append(pipe.last_report().planned_makespan)
        for k, s, e in zip(r.keys, r.starts, r.ends):
            per.setdefault((k.stage, k.kind), []).append(e - s)
        # gaps: for each job, time from its deps' end to its start is not known; print per worker idle
print(f"sim {sim*1e3:.2f} span {statistics.median(spans)*1e3:.2f} own {statistics.median(owns)*1e3:.2f}")
for key in sorted(per):
    print(key, f"{statistics.median(per[key])*1e3:.3f}", f"max {max(per[key])*1e3:.3f}")
med = {k: statistics.median(v) for k, v in per.items()}
def cost(a):
    return med[(a.stage, a.kind)]
print(f"sim with per-(stage,kind) medians {plan.simulate(cost).makespan*1e3:.2f}")
