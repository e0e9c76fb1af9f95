"""``gpipe``: schedule efficiency of GPipe fill-drain on simulated-latency stages.

Each stage is one layer whose forward sleeps ``t`` and whose backward sleeps ``2t``.
``time.sleep`` releases the GIL, the way a GPU kernel runs while the host thread waits,
so the figures measure the runtime's scheduling and hand-offs, not the 2-core CPU.

The ideal forward makespan of fill-drain is ``(m + p - 1) * t``. ``t`` is taken as the
*measured* duration of ``time.sleep(t)`` in this run (the OS oversleeps by tens of us,
which is the stage's cost, not the runtime's); the ratio against the nominal ``t`` is
shown too. The ideal forward+backward makespan comes from simulating the GPipe plan with
costs F = t, B = 2t.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..schedule import Action, build
from .peers import PEER_NAMES, SHIMS_APPLIED, THREADS, Peer, build_peers, close_pipeline, load_peers, release
from .registry import Options
from .report import Column, Goal, SuiteResult, Table
from .stats import median_interval
from .timing import compare

STAGES = 4
BATCH = 64
WIDTH = 16
MICROBATCHES = (8, 32)
STAGE_S = 0.002
QUICK_STAGE_S = 0.0002
GOAL = 0.95


class _Sleep(torch.autograd.Function):
    """``x * w`` that takes ``t`` seconds forward and ``2t`` backward without holding the GIL."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, seconds: float) -> torch.Tensor:
        time.sleep(seconds)
        ctx.seconds = seconds
        ctx.save_for_backward(x, weight)
        return x * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, None]:
        time.sleep(2 * ctx.seconds)
        x, weight = ctx.saved_tensors
        return grad * weight, (grad * x).sum().reshape(weight.shape), None


class SleepLayer(nn.Module):
    """A stage with a fixed latency (forward ``t``, backward ``2t``) and one parameter."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return _Sleep.apply(x, self.weight, self.seconds)
        # Nothing to save for backward: skip the autograd Function, whose Python would be
        # the stage's own cost, not the runtime's (like a kernel launch: wait, little else).
        time.sleep(self.seconds)
        return x * self.weight

    def extra_repr(self) -> str:
        return f"seconds={self.seconds}"


def make_model(seconds: float) -> nn.Sequential:
    return nn.Sequential(*[SleepLayer(seconds) for _ in range(STAGES)])


def measured_sleep(seconds: float, samples: int) -> float:
    """Median wall time of ``time.sleep(seconds)`` on this machine, now."""
    durations = []
    for _ in range(samples):
        start = time.perf_counter()
        time.sleep(seconds)
        durations.append(time.perf_counter() - start)
    return statistics.median(durations)


def step_timings(step: Any) -> Tuple[float, float, float, float]:
    """``(makespan, bubble, median job seconds, median ready-to-start seconds)`` of a StepRecord.

    A forward job (s, i) is ready when (s - 1, i) and (s, i - 1) have ended; the delay
    from then to its start is the runtime's hand-off latency, which is what keeps the
    achieved makespan above the ideal one.
    """
    spans: Dict[Tuple[int, int], Tuple[float, float]] = {}
    for action, start, end in zip(step.keys, step.starts, step.ends):
        if isinstance(action, Action) and action.kind == "F" and start >= 0:
            spans[(action.stage, action.microbatch)] = (start, end)
    jobs = [end - start for start, end in spans.values()]
    delays = []
    for (s, i), (start, _) in spans.items():
        before = [spans[k][1] for k in ((s - 1, i), (s, i - 1)) if k in spans]
        if before:
            delays.append(start - max(before))
    job = statistics.median(jobs) if jobs else math.nan
    delay = statistics.median(delays) if delays else math.nan
    return step.makespan, step.bubble_ratio, job, delay


def _forward(pipeline: nn.Module, x: torch.Tensor, record: Optional[List[Any]]) -> Callable[[], None]:
    def step() -> None:
        with torch.no_grad():
            pipeline(x)
        if record is not None:  # the step's record; its timings are read after the run
            record.append(pipeline.last_step)  # type: ignore[attr-defined]

    return step


def _forward_backward(pipeline: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        pipeline(x).sum().backward()

    return step


def run(options: Options) -> SuiteResult:
    config = options.timing(target_s=0.2, quick_target_s=0.0, warmup=1, min_iters=1)
    t = options.stage_seconds(default_s=STAGE_S, quick_s=QUICK_STAGE_S)
    p = STAGES
    result = SuiteResult(
        "gpipe",
        f"GPipe fill-drain on {p} simulated-latency stages (forward sleeps t, backward 2t), "
        f"batch {BATCH}, checkpoint='never', CPU",
        config={"repeats": config.repeats, "warmup": config.warmup, "t_ms": t * 1e3,
                "microbatches": list(MICROBATCHES), "quick": options.quick},
    )
    options.say("gpipe: calibrating time.sleep")
    samples = 20 if options.quick else 100
    t_f = measured_sleep(t, samples)
    t_b = measured_sleep(2 * t, samples)
    result.config.update({"measured_t_ms": round(t_f * 1e3, 4), "measured_2t_ms": round(t_b * 1e3, 4)})
    result.notes.append(
        f"time.sleep({t * 1e3:g} ms) measured {t_f * 1e3:.3f} ms and sleep({2 * t * 1e3:g} ms) {t_b * 1e3:.3f} ms "
        "(median): the ideal makespans use these; 'vs nominal' uses t itself"
    )
    peers = load_peers(PEER_NAMES + (THREADS,))
    for peer in peers:
        if not peer.available:
            result.notes.append(f"{peer.label} unavailable: {peer.reason}")

    forward = Table(
        "Forward makespan under torch.no_grad() (ideal = (m + p - 1) x t; higher ideal/achieved is better, 1.0 = ideal)",
        [
            Column("m", "m"),
            Column("case", "pipeline", align="<"),
            Column("ideal_ms", "ideal ms", "{:.2f}"),
            Column("wall_ms", "wall ms", "{:.2f}"),
            Column("eff_wall", "ideal/wall", "{:.3f}"),
            Column("eff_nominal", "vs nominal t", "{:.3f}"),
            Column("makespan_ms", "last_step ms", "{:.2f}"),
            Column("eff_makespan", "ideal/last_step", "{:.3f}"),
            Column("job_ms", "job ms", "{:.3f}"),
            Column("delay_us", "hand-off us", "{:.0f}"),
            Column("bubble", "bubble measured", "{:.3f}"),
            Column("bubble_sim", "bubble simulated", "{:.3f}"),
            Column("goal", f">= {GOAL:g}", align="<"),
        ],
    )
    backward = Table(
        "Forward + backward wall time (ideal = simulated GPipe plan with F = t, B = 2t)",
        [
            Column("m", "m"),
            Column("case", "pipeline", align="<"),
            Column("ideal_ms", "ideal ms", "{:.2f}"),
            Column("serial_ms", "serial ms", "{:.2f}"),
            Column("wall_ms", "wall ms", "{:.2f}"),
            Column("eff_wall", "ideal/wall", "{:.3f}"),
        ],
    )
    backward.notes.append(
        "serial = every stage one after another with the measured costs, m x p x (t_f + t_b). On CPU torchpipe's backward runs through "
        "autograd on the caller's thread, so it does not pipeline: expect about (m + p - 1) t + 2 m p t"
    )
    forward.notes.append("last_step, job, hand-off and bubble measured come from pipe.last_step (torchpipe only): "
                         "job = median job duration; hand-off = median delay from a job's inputs being ready "
                         "(previous stage and previous micro-batch ended) to its start")
    forward.notes.append("bubble simulated = pipe.plan(m, 'gpipe', backward=False).simulate() with unit costs")
    forward.notes.append("bare threads (floor) = torchpipe.bench.thread_chain: a thread per stage, a queue between "
                         "neighbours and nothing else; what threads alone achieve on this machine")
    result.tables += [forward, backward]

    x = torch.randn(BATCH, WIDTH)
    for m in MICROBATCHES:
        options.say(f"gpipe: m={m}")
        ideal_fwd = (m + p - 1) * t_f
        ideal_fwd_nominal = (m + p - 1) * t
        ideal_fb = build("gpipe", p, m).simulate({"F": t_f, "B": t_b}).makespan
        sim_bubble = build("gpipe", p, m, backward=False).simulate().bubble_ratio
        steps: List[Any] = []
        pipelines, unavailable = build_peers(peers, lambda peer: _make(peer, m, t, x), f"m={m}", result.notes)
        try:
            if "torchpipe" in pipelines:
                plan_bubble = pipelines["torchpipe"].plan(m, "gpipe", backward=False).simulate().bubble_ratio  # type: ignore[operator]
                if abs(plan_bubble - sim_bubble) > 1e-12:
                    result.notes.append(f"m={m}: pipe.plan() bubble {plan_bubble} != build('gpipe') bubble {sim_bubble}")
            fwd = compare({name: _forward(pl, x, steps if name == "torchpipe" else None)
                           for name, pl in pipelines.items()}, config)
            fb = compare({name: _forward_backward(pl, x) for name, pl in pipelines.items()}, config)
        finally:
            release(pipelines)
        if "torchpipe" in fwd:  # keep the timed calls only, not warm-up and calibration
            del steps[: max(0, len(steps) - config.repeats * fwd["torchpipe"].iters)]
        records = [step_timings(step) for step in steps]
        for name, measured in fwd.items():
            result.measurements[f"m={m}/{name} forward"] = measured.to_json()
        for name, measured in fb.items():
            result.measurements[f"m={m}/{name} forward+backward"] = measured.to_json()
        if records:
            result.measurements[f"m={m}/torchpipe last_step"] = {
                "makespan_s": [r[0] for r in records], "bubble_ratio": [r[1] for r in records],
                "median_job_s": [r[2] for r in records], "median_handoff_s": [r[3] for r in records]}

        for peer in peers:
            if peer.name in unavailable:
                forward.add(m=m, case=f"{peer.label}: unavailable: {unavailable[peer.name]}")
                backward.add(m=m, case=f"{peer.label}: unavailable: {unavailable[peer.name]}")
                continue
            wall = fwd[peer.name].median
            row: Dict[str, Any] = dict(m=m, case=peer.label, ideal_ms=ideal_fwd * 1e3, wall_ms=wall * 1e3,
                                       bubble_sim=sim_bubble)
            row["eff_wall"] = result.ratio(f"m={m}/{peer.name} forward ideal / wall", ideal_fwd, wall)
            row["eff_nominal"] = result.ratio(f"m={m}/{peer.name} forward ideal (nominal t) / wall",
                                              ideal_fwd_nominal, wall)
            if peer.name == "torchpipe" and records:
                makespan = statistics.median(r[0] for r in records)
                row["makespan_ms"] = makespan * 1e3
                row["bubble"] = statistics.median(r[1] for r in records)
                row["job_ms"] = statistics.median(r[2] for r in records) * 1e3
                row["delay_us"] = statistics.median(r[3] for r in records) * 1e6
                row["eff_makespan"] = result.ratio(f"m={m}/torchpipe forward ideal / last_step.makespan",
                                                   ideal_fwd, makespan)
                goal = Goal(f"m={m}: torchpipe forward ideal/achieved (wall)", row["eff_wall"], ">=", GOAL,
                            median_interval([ideal_fwd / sample for sample in fwd["torchpipe"].samples]))
                result.goals.append(goal)
                row["goal"] = goal.status
            forward.add(**row)

            fb_wall = fb[peer.name].median
            backward.add(m=m, case=peer.label, ideal_ms=ideal_fb * 1e3, serial_ms=m * p * (t_f + t_b) * 1e3,
                         wall_ms=fb_wall * 1e3,
                         eff_wall=result.ratio(f"m={m}/{peer.name} forward+backward ideal / wall", ideal_fb, fb_wall))
        if "torchpipe" in fwd and THREADS in fwd:
            result.ratio(f"m={m}/forward wall bare threads / torchpipe", fwd[THREADS].median, fwd["torchpipe"].median)
        if "torchpipe" in fwd and "torchgpipe" in fwd:
            result.ratio(f"m={m}/forward wall torchgpipe / torchpipe", fwd["torchgpipe"].median, fwd["torchpipe"].median)
            result.ratio(f"m={m}/forward+backward wall torchgpipe / torchpipe",
                         fb["torchgpipe"].median, fb["torchpipe"].median)

    if SHIMS_APPLIED:
        result.notes += [f"shim applied: {s}" for s in SHIMS_APPLIED]
    if options.quick:
        result.notes.append(f"quick run: t = {t * 1e3:g} ms and few repeats, figures are indicative only")
    return result


def _make(peer: Peer, m: int, t: float, x: torch.Tensor) -> nn.Module:
    """Build a pipeline of ``m`` micro-batches and run one forward+backward to check it works."""
    assert peer.make is not None
    pipeline = peer.make(make_model(t), m)
    try:
        out = pipeline(x)
        if not torch.allclose(out, x):
            raise RuntimeError("output differs from the input (every stage multiplies by 1)")
        out.sum().backward()
    except BaseException:
        close_pipeline(pipeline)
        raise
    return pipeline
