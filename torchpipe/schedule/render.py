"""Views of a plan: text time table, Chrome trace, PNG Gantt chart.

All of them are drawn from ``Plan.simulate``, i.e. from the same ``worker_actions`` the
runtime executes, never from a separate description of the schedule.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from .simulate import Costs, Simulation, simulate

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["table", "chrome_trace", "save_png", "IDLE", "CONTINUED"]

IDLE = "."
"""Cell of a slot where the worker does nothing: the pipeline bubble."""
CONTINUED = "~"
"""Cell of a slot where the action started in an earlier slot is still running."""

_MAX_SLOTS = 4000
_MAX_WIDTH_IN = 60.0


def _slot_size(sim: Simulation) -> float:
    """Greatest common slot of all times (as small fractions), or the smallest duration."""
    times = [Fraction(t).limit_denominator(1000) for _, _, s, e in sim.timeline for t in (s, e)]
    durations = [Fraction(e - s).limit_denominator(1000) for _, _, s, e in sim.timeline if e > s]
    if not durations:
        return 1.0
    g = Fraction(0)
    for t in times + durations:
        g = Fraction(math.gcd(g.numerator * t.denominator, t.numerator * g.denominator), g.denominator * t.denominator)
    if g > 0 and sim.makespan / float(g) <= _MAX_SLOTS:
        return float(g)
    return float(min(durations))


def table(plan: "Plan", costs: Costs = None, *, comm: float = 0.0) -> str:
    """One row per worker, one column per time slot; idle slots are ``.``.

    With non-unit costs a slot is the gcd of all times (the smallest duration when that
    would be too fine); an action spanning several slots is drawn as its name followed
    by ``~`` continuation cells. Zero-duration actions are not drawn.
    """
    sim = simulate(plan, costs, comm=comm)
    slot = _slot_size(sim)
    num_slots = max(1, round(sim.makespan / slot))
    width = max([len(str(a)) for a in plan.actions()] + [len(str(num_slots - 1)), 1])
    grid = [[IDLE] * num_slots for _ in range(plan.num_workers)]
    for w, act, start, end in sim.timeline:
        first, last = round(start / slot), round(end / slot)
        for k in range(first, min(last, num_slots)):
            grid[w][k] = str(act) if k == first else CONTINUED
    label = max(len(f"w{plan.num_workers - 1}"), len("slot"))
    lines = [" ".join([f"{'slot':<{label}}"] + [f"{k:<{width}}" for k in range(num_slots)]).rstrip()]
    for w, row in enumerate(grid):
        lines.append(" ".join([f"{'w' + str(w):<{label}}"] + [f"{c:<{width}}" for c in row]).rstrip())
    return "\n".join(lines)


def chrome_trace(plan: "Plan", costs: Costs = None, *, comm: float = 0.0, us_per_unit: float = 1.0) -> dict[str, Any]:
    """Chrome trace dict: one complete ("X") event per action, ``tid`` = worker.

    Cost units are taken as microseconds unless ``us_per_unit`` says otherwise
    (e.g. 1e6 for costs measured in seconds).
    """
    sim = simulate(plan, costs, comm=comm)
    events = [
        {
            "name": str(act),
            "cat": act.kind,
            "ph": "X",
            "pid": 0,
            "tid": w,
            "ts": start * us_per_unit,
            "dur": (end - start) * us_per_unit,
            "args": {"stage": act.stage, "microbatch": act.microbatch},
        }
        for w, act, start, end in sim.timeline
    ]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"plan": plan.name}}


def save_png(plan: "Plan", path: str, costs: Costs = None, *, comm: float = 0.0) -> None:
    """Write a Gantt chart of the simulated plan; raises ImportError without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "Plan.save_png needs matplotlib, which is not installed (pip install matplotlib); "
            "Plan.table() and Plan.chrome_trace() need nothing extra"
        ) from exc
    sim = simulate(plan, costs, comm=comm)
    colors = {"F": "tab:blue", "B": "tab:orange", "I": "tab:purple", "W": "tab:green"}
    # Width follows the number of time slots, not the cost unit: costs in microseconds must
    # not ask for a million-inch figure. Capped so that long plans still make a sane image.
    slots = round(sim.makespan / _slot_size(sim), 3) if sim.makespan > 0 else 0.0
    width = min(_MAX_WIDTH_IN, max(6.0, slots * 0.4))
    fig, ax = plt.subplots(figsize=(width, 0.6 * plan.num_workers + 1.0))
    try:
        for w, act, start, end in sim.timeline:
            ax.barh(w, end - start, left=start, color=colors[act.kind], edgecolor="black")
            ax.text((start + end) / 2, w, str(act), ha="center", va="center", fontsize=7)
        ax.set_yticks(range(plan.num_workers), [f"w{w}" for w in range(plan.num_workers)])
        ax.invert_yaxis()
        ax.set_xlabel("time")
        ax.set_title(f"{plan.name}: bubble {sim.bubble_ratio:.1%}")
        fig.tight_layout()
        fig.savefig(path)
    finally:  # a failed save (missing directory, full disk) must not leak the figure
        plt.close(fig)
