"""``schedules``: every schedule of ``Pipe.step`` on simulated-latency stages, in one run.

Each stage is one layer whose forward sleeps ``t``, whose input-gradient backward sleeps
``t`` and whose weight-gradient backward sleeps ``t`` (so ``B = I + W = 2t``). The two
backward halves are separate autograd nodes, so ``I`` (gradient for the stage input) and
``W`` (gradient for the weight) each pay only their own half, as real split backward
kernels do. ``time.sleep`` releases the GIL, the way an accelerator kernel runs while the
host thread waits: the figures measure the runtime's schedule execution, not the 2-core CPU.

Reported per schedule and m: simulated makespan (the plan's list scheduler fed with what each
action kind costs the stage run alone on one thread, its sleeps and the layer's own Python)
against the achieved one (the wall time of the ``Pipe.step`` call), measured against simulated
bubble, and peak bytes saved for backward per stage and per worker
(``pipe.last_memory``). For
contrast, the ``forward()`` path (GPipe forward, then autograd's backward on the caller's
thread) and torchgpipe on the same stages.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from .. import Pipe
from ..schedule import build
from .gpipe import measured_sleep
from .peers import close_pipeline, load_peers
from .registry import Options
from .report import Column, Goal, SuiteResult, Table
from .stats import median_interval

STAGES = 4
BATCH = 64
WIDTH = 256
MICROBATCHES = (8, 32)
STAGE_S = 0.002
QUICK_STAGE_S = 0.0005
GOAL = 0.95
SCHEDULES: Tuple[Tuple[str, Dict[str, Any], int], ...] = (
    ("gpipe", {}, 1),
    ("1f1b", {}, 1),
    ("interleaved-1f1b", {"virtual_stages": 2}, 2),
    ("zb-h1", {}, 1),
    ("zb-v", {}, 2),
)


class _SleepInput(torch.autograd.Function):
    """Forward sleeps ``t``; backward (the input gradient, ``I``) sleeps ``t``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        time.sleep(seconds)
        ctx.seconds = seconds
        out = x.clone()
        # An activation of the stage's own, kept for backward and counted by pipe.last_memory
        # (the caller's batch, stage 0's input, is not counted).
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class _SleepWeight(torch.autograd.Function):
    """Adds ``0 * w``; its backward (the weight gradient, ``W``) sleeps ``t``."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return weight * 0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad.sum().reshape(1), None


class SplitSleepLayer(nn.Module):
    """A stage with latencies F = t, I = t, W = t (B = 2t) and one parameter."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepInput.apply(x, self.seconds) + _SleepWeight.apply(self.weight, self.seconds)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output * target).sum()


def run(options: Options) -> SuiteResult:
    t = options.stage_seconds(default_s=STAGE_S, quick_s=QUICK_STAGE_S)
    repeats = options.repeats if options.repeats is not None else (3 if options.quick else 7)
    p = STAGES
    result = SuiteResult(
        "schedules",
        f"Pipe.step on {p} workers of simulated-latency stages (F = t, I = t, W = t, B = 2t), batch {BATCH}, CPU",
        config={"t_ms": t * 1e3, "repeats": repeats, "microbatches": list(MICROBATCHES), "quick": options.quick},
    )
    t_measured = measured_sleep(t, 20 if options.quick else 100)
    result.config["measured_t_ms"] = round(t_measured * 1e3, 4)
    alone = {m: StageAlone.measure(t, BATCH // m, 10 if options.quick else 40) for m in MICROBATCHES}
    result.config["stage_alone_ms"] = {m: costs.as_ms() for m, costs in alone.items()}
    table = Table(
        "Achieved vs simulated makespan (simulated = the same plan's list scheduler with each action's cost as the "
        "stage alone takes it)",
        [
            Column("m", "m"),
            Column("schedule", "schedule", align="<"),
            Column("sim_ms", "simulated ms", "{:.2f}"),
            Column("achieved_ms", "achieved ms", "{:.2f}"),
            Column("eff", "sim/achieved", "{:.3f}"),
            Column("sleep_sim_ms", "sim, sleeps only ms", "{:.2f}"),
            Column("eff_sleep", "sleeps-only sim/achieved", "{:.3f}"),
            Column("span_ms", "runtime span ms", "{:.2f}"),
            Column("own_sim_ms", "sim, own jobs ms", "{:.2f}"),
            Column("eff_own", "own sim/span", "{:.3f}"),
            Column("bubble_sim", "bubble sim", "{:.3f}"),
            Column("bubble", "bubble measured", "{:.3f}"),
            Column("peak_mb", "peak mb/stage", align="<"),
            Column("peak_kib", "peak KiB/stage", align="<"),
            Column("peak_worker_kib", "peak KiB/worker", align="<"),
            Column("peak_vs_gpipe", "peak bytes / gpipe's", "{:.3f}"),
            Column("goal", f">= {GOAL:g}", align="<"),
        ],
    )
    contrast = Table(
        "Forward + backward wall time of other paths on the same stages",
        [Column("m", "m"), Column("case", "case", align="<"), Column("wall_ms", "wall ms", "{:.2f}"),
         Column("vs_1f1b", "x 1f1b achieved", "{:.2f}")],
    )
    contrast.notes.append("pipe(x) + backward: GPipe forward on the workers, then autograd's backward, which on CPU "
                          "runs every stage one after another on the caller's thread (torchgpipe does the same)")
    table.notes.append("interleaved-1f1b and zb-v run 2 stages (2 layers) per worker, twice the model of the others: "
                       "their byte ratio against GPipe's one-layer workers counts twice the layers")
    table.notes.append("peak mb/stage, peak KiB/stage: micro-batches, and bytes saved for backward, that a stage held "
                       "at once; peak KiB/worker: what all of a worker's stages held at once (pipe.last_memory); "
                       "peak bytes / gpipe's is the worst worker's ratio")
    table.notes.append("achieved = wall time of the pipe.step call; runtime span = pipe.last_step.makespan, from the "
                       "first action's start to the last one's end (without splitting the batch and the call's set-up)")
    table.notes.append("simulated: each action kind costs what one SplitSleepLayer takes for it alone on one thread, "
                       "no pipeline and no other thread running (median; per m, since the micro-batch size "
                       "differs): its sleeps plus the layer's own Python, which on this machine runs slower "
                       "right after a sleep than in a warm loop. The runtime cannot beat the layer it runs")
    table.notes.append("sim, sleeps only: the same plan with the bare sleep as every cost (F = I = W = t, B = 2t, "
                       "t = time.sleep(t) measured alone): what a layer with no Python at all would allow")
    table.notes.append("stage 0 of the split schedules (zb-h1, zb-v) is costed as it runs: I = 0 and W = the whole "
                       "backward, since its I has no stage input to compute a gradient for and its W runs the whole "
                       "backward, into the caller's input too")
    table.notes.append("sim, own jobs = pipe.last_report().planned_makespan: the same plan's list scheduler fed with "
                       "each action's duration as measured in that very step (median over repeats): a runtime with "
                       "zero hand-off cost running these "
                       "actions. own sim/span isolates the runtime's hand-offs and ordering from what each action "
                       "took (its sleep, the layer's Python, waiting for the GIL), which sim/achieved also counts")
    result.tables += [table, contrast]
    # The batch requires grad, so stage 0 is a stage like the others: it saves an activation per
    # micro-batch (1F1B's most loaded stage) and its backward takes 2t (see stage_costs).
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    target = torch.randn(BATCH, WIDTH)
    for m in MICROBATCHES:
        gpipe_bytes: List[int] = []
        one_f_one_b_wall = None
        for name, options_, virtual in SCHEDULES:
            options.say(f"schedules: m={m} {name}")
            stages = p * virtual
            model = nn.Sequential(*[SplitSleepLayer(t) for _ in range(stages)])
            plan = build(name, stages, m, **options_)
            simulated = plan.simulate(alone[m].costs(stages))
            sleeps_only = plan.simulate(stage_costs(t_measured, stages))
            with Pipe(model, [1] * stages, devices=["cpu"] * stages, chunks=m, checkpoint="never") as pipe:
                pipe.step(x, target, _loss, schedule=name, reduction="sum", **options_)  # warm-up
                walls, makespans, bubbles, own_makespans = [], [], [], []
                for _ in range(repeats):
                    start = time.perf_counter()
                    pipe.step(x, target, _loss, schedule=name, reduction="sum", **options_)
                    walls.append(time.perf_counter() - start)
                    makespans.append(pipe.last_step.makespan)
                    bubbles.append(pipe.last_step.bubble_ratio)
                    own_makespans.append(pipe.last_report().planned_makespan)
                memory = pipe.last_memory
            achieved = statistics.median(walls)
            span = statistics.median(makespans)
            # Peak bytes saved for backward on a worker (all its stages at once), against GPipe's.
            worker_bytes = list(memory.peak_worker_bytes)
            if name == "gpipe":
                gpipe_bytes = worker_bytes
            if name == "1f1b":
                one_f_one_b_wall = achieved
            row: Dict[str, Any] = dict(m=m, schedule=name, sim_ms=simulated.makespan * 1e3, achieved_ms=achieved * 1e3,
                                       span_ms=span * 1e3,
                                       bubble_sim=simulated.bubble_ratio, bubble=statistics.median(bubbles),
                                       peak_mb=str(memory.peak_microbatches),
                                       peak_kib=str([round(b / 1024) for b in memory.peak_bytes]),
                                       peak_worker_kib=str([round(b / 1024) for b in worker_bytes]))
            row["eff"] = result.ratio(f"m={m}/{name} simulated makespan / achieved wall time", simulated.makespan,
                                      achieved)
            row["sleep_sim_ms"] = sleeps_only.makespan * 1e3
            row["eff_sleep"] = result.ratio(f"m={m}/{name} sleeps-only simulated makespan / achieved wall time",
                                            sleeps_only.makespan, achieved)
            own = statistics.median(own_makespans)
            row["own_sim_ms"] = own * 1e3
            row["eff_own"] = result.ratio(f"m={m}/{name} simulated with its own job times / runtime span", own, span)
            # Worst worker: its peak bytes saved for backward over GPipe's on the same worker.
            shares = [mine / theirs for mine, theirs in zip(worker_bytes, gpipe_bytes) if theirs]
            if shares:
                row["peak_vs_gpipe"] = result.ratio(f"m={m}/{name} worst worker peak bytes / gpipe's", max(shares), 1.0)
            goal = Goal(f"m={m}: {name} simulated makespan / achieved wall time", row["eff"], ">=", GOAL,
                        median_interval([simulated.makespan / wall for wall in walls]))
            result.goals.append(goal)
            row["goal"] = goal.status
            if name == "1f1b" and shares:
                result.goals.append(Goal(f"m={m}: 1f1b worst stage peak bytes / gpipe's (target p/m = {p / m:.3f})",
                                         max(shares), "<=", p / m))
            table.add(**row)
        contrast_walls = _contrast(m, t, x, target, repeats, options)
        for case, wall in contrast_walls.items():
            contrast.add(m=m, case=case, wall_ms=wall * 1e3,
                         vs_1f1b=result.ratio(f"m={m}/{case} wall / 1f1b achieved", wall, one_f_one_b_wall))
    return result


@dataclass(frozen=True)
class StageAlone:
    """What each action kind costs one ``SplitSleepLayer`` run alone on the calling thread, in seconds.

    The simulated makespan must not charge the runtime for the layer's own work: the sleeps,
    and the Python around them (two custom autograd Functions, a clone, an add), which on a
    VM whose vCPU idles during the sleep runs several times slower after it than in a warm
    loop. Measured with no pipeline and no other thread running.
    """

    forward: float
    backward: float
    input_grad: float
    weight_grad: float

    @classmethod
    def measure(cls, seconds: float, rows: int, samples: int) -> "StageAlone":
        layer = SplitSleepLayer(seconds)
        x = torch.randn(rows, WIDTH, requires_grad=True)
        times: Dict[str, List[float]] = {"F": [], "B": [], "I": [], "W": []}
        for _ in range(samples):
            start = time.perf_counter()
            out = layer(x)
            times["F"].append(time.perf_counter() - start)
            grad = torch.ones_like(out)
            start = time.perf_counter()
            out.backward(grad)
            times["B"].append(time.perf_counter() - start)
            out = layer(x)
            start = time.perf_counter()
            torch.autograd.grad(out, x, grad, retain_graph=True)  # the input half only
            times["I"].append(time.perf_counter() - start)
            start = time.perf_counter()
            torch.autograd.grad(out, layer.weight, grad)  # the weight half only
            times["W"].append(time.perf_counter() - start)
        f, b, i, w = (statistics.median(times[kind]) for kind in "FBIW")
        return cls(f, b, i, w)

    def costs(self, stages: int) -> Dict[str, Any]:
        """Per-kind costs for ``Plan.simulate``; stage 0's split as it runs (I = 0, W = the whole backward)."""
        return {"F": self.forward, "B": self.backward, "I": [0.0] + [self.input_grad] * (stages - 1),
                "W": [self.backward] + [self.weight_grad] * (stages - 1)}

    def as_ms(self) -> Dict[str, float]:
        return {"F": round(self.forward * 1e3, 4), "B": round(self.backward * 1e3, 4),
                "I": round(self.input_grad * 1e3, 4), "W": round(self.weight_grad * 1e3, 4)}


def stage_costs(t: float, stages: int) -> Dict[str, Any]:
    """Each action's cost as the stages run it: F = I = W = t and B = 2t, except stage 0's split.

    Stage 0 has no stage input, so under the split schedules its ``I`` computes nothing and
    its ``W`` runs the whole backward (the caller's batch requires grad here): I = 0, W = 2t.
    """
    return {"F": t, "B": 2 * t, "I": [0.0] + [t] * (stages - 1), "W": [2 * t] + [t] * (stages - 1)}


def _contrast(m: int, t: float, x: torch.Tensor, target: torch.Tensor, repeats: int, options: Options) -> Dict[str, float]:
    """Wall time of ``pipe(x)`` + autograd backward, for torchpipe and torchgpipe."""
    walls: Dict[str, float] = {}
    for peer in load_peers():
        if peer.name not in ("torchpipe", "torchgpipe") or not peer.available or peer.make is None:
            continue
        options.say(f"schedules: m={m} {peer.label} forward() + autograd backward")
        pipeline = peer.make(nn.Sequential(*[SplitSleepLayer(t) for _ in range(STAGES)]), m)
        try:
            samples: List[float] = []
            for i in range(repeats + 1):
                start = time.perf_counter()
                _loss(pipeline(x), target).backward()
                if i:
                    samples.append(time.perf_counter() - start)
            walls[f"{peer.label} forward() + autograd backward"] = statistics.median(samples)
        finally:
            close_pipeline(pipeline)
    return walls
