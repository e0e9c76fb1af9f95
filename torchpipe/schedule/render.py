"""Views of a plan: text time table, Chrome trace, PNG Gantt chart.

All of them are drawn from ``Plan.simulate``, i.e. from the same ``worker_actions`` the
runtime executes, never from a separate description of the schedule.
"""
from __future__ import annotations

import bisect
import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from ..checks import check_file_path
from .simulate import Costs, Simulation, _cost_value, shown, simulate

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["table", "chrome_trace", "save_png", "IDLE", "CONTINUED"]

IDLE = "."
"""Cell of a slot where the worker does nothing: the pipeline bubble."""
CONTINUED = "~"
"""Cell of a slot where the action started in an earlier slot is still running."""

_MAX_SLOTS = 4000
_MAX_WIDTH_IN = 60.0


def _equal_slot(sim: Simulation) -> float | None:
    """The largest slot that every start and end time is a whole multiple of, if sane.

    Found from the times as fractions of the shortest duration, so the cost unit (steps,
    seconds, microseconds) does not matter. None when there is no such slot, or when it
    would need more than ``_MAX_SLOTS`` columns (measured durations, say).
    """
    durations = [e - s for _, _, s, e in sim.timeline if e > s]
    if not durations:
        return None
    unit = min(durations)
    slot = Fraction(0)
    for _, _, s, e in sim.timeline:
        for t in (s, e):
            if not math.isfinite(t / unit):  # durations too far apart for one slot size
                return None
            q = Fraction(t / unit).limit_denominator(1000)
            slot = Fraction(math.gcd(slot.numerator * q.denominator, q.numerator * slot.denominator),
                            slot.denominator * q.denominator)
    size = float(slot) * unit
    if size <= 0 or sim.makespan / size > _MAX_SLOTS:
        return None
    for _, _, s, e in sim.timeline:
        for t in (s, e):
            if abs(t / size - round(t / size)) > 1e-6:
                return None
    return size


def _columns(sim: Simulation) -> tuple[list[float], float | None]:
    """Start time of every column, and the slot size when the columns are equal slots.

    Equal slots when the times allow it (unit costs, small integer ratios) and the slots
    are not much finer than the events. Otherwise one column per distinct start or end
    time: column widths then differ, but every action with a duration still gets at least
    one cell of its own, whatever the costs.
    """
    tolerance = 1e-9 * max(sim.makespan, 1e-300)
    events: list[float] = []
    for t in sorted({t for _, _, s, e in sim.timeline for t in (s, e)}):
        if t < sim.makespan - tolerance and (not events or t - events[-1] > tolerance):
            events.append(t)
    events = events or [0.0]
    slot = _equal_slot(sim)
    if slot is not None and sim.makespan / slot <= 4 * len(events):
        return [k * slot for k in range(max(1, round(sim.makespan / slot)))], slot
    return events, None


def _column_at(starts: list[float], t: float, tolerance: float) -> int:
    """Index of the first column that starts at or after ``t`` (``len`` at the end)."""
    return bisect.bisect_left(starts, t - tolerance)


def _time_labels(starts: list[float]) -> list[str]:
    """Each column's start time, with as few digits as keep distinct times apart (4 at least)."""
    for digits in range(4, 18):
        labels = [f"{t:.{digits}g}" for t in starts]
        if len(set(labels)) == len(labels):
            return labels
    return [repr(t) for t in starts]


def table(plan: "Plan", costs: Costs = None, *, comm: float = 0.0) -> str:
    """One row per worker, one column per time slot; idle slots are ``.``.

    Under unit costs (and any costs with small integer ratios) a column is a slot of
    equal length, numbered in the header. Otherwise a column runs from one start or end
    time to the next, with its start time in the header. An action spanning several
    columns is drawn as its name followed by ``~`` continuation cells. Every action of
    the plan is shown: those that take no time at all are listed under the grid.
    """
    sim = simulate(plan, costs, comm=comm)
    starts, slot = _columns(sim)
    tolerance = 1e-9 * max(sim.makespan, 1e-300)
    grid = [[IDLE] * len(starts) for _ in range(plan.num_workers)]
    instant: list[list[str]] = [[] for _ in range(plan.num_workers)]
    for w, act, start, end in sim.timeline:
        if end - start <= tolerance:
            instant[w].append(str(act))
            continue
        if slot is not None:  # on the grid _equal_slot checked, to its tolerance
            first, last = (min(len(starts), round(t / slot)) for t in (start, end))
        else:
            first, last = _column_at(starts, start, tolerance), _column_at(starts, end, tolerance)
        for k in range(first, last):
            grid[w][k] = str(act) if k == first else CONTINUED
    header = [str(k) for k in range(len(starts))] if slot is not None else _time_labels(starts)
    width = max([len(str(a)) for a in plan.actions()] + [len(h) for h in header])
    corner = "slot" if slot is not None else "time"
    label = max(len(f"w{plan.num_workers - 1}"), len(corner))
    lines = [" ".join([f"{corner:<{label}}"] + [f"{h:<{width}}" for h in header]).rstrip()]
    for w, row in enumerate(grid):
        lines.append(" ".join([f"{'w' + str(w):<{label}}"] + [f"{c:<{width}}" for c in row]).rstrip())
    if any(instant):
        taken = "; ".join(f"w{w}: {' '.join(names)}" for w, names in enumerate(instant) if names)
        lines.append(f"no duration (not drawn): {taken}")
    return "\n".join(lines)


def chrome_trace(plan: "Plan", costs: Costs = None, *, comm: float = 0.0, us_per_unit: float = 1.0) -> dict[str, Any]:
    """Chrome trace dict: one complete ("X") event per action, ``tid`` = worker.

    Its ``cat`` and ``args`` (the action's text, stage, micro-batch) are those of a step's
    measured trace (``pipe.last_step.chrome_trace()``), so the two match action by action.

    Cost units are taken as microseconds unless ``us_per_unit`` says otherwise
    (e.g. 1e6 for costs measured in seconds).
    """
    try:
        scale = _cost_value("us_per_unit", us_per_unit)
    except ValueError:
        scale = 0.0  # said below with the right bound: 0 is refused too
    if scale == 0.0:
        raise ValueError(f"us_per_unit must be a finite number > 0, got {shown(us_per_unit)}")
    sim = simulate(plan, costs, comm=comm)
    events = [
        {
            "name": str(act),
            "cat": act.kind,
            "ph": "X",
            "pid": 0,
            "tid": w,
            "ts": start * scale,
            "dur": (end - start) * scale,
            "args": {"action": str(act), "stage": act.stage, "microbatch": act.microbatch},
        }
        for w, act, start, end in sim.timeline
    ]
    if not math.isfinite(sim.makespan * scale):
        raise ValueError(f"the trace's times overflow: makespan {sim.makespan!r} cost units times "
                         f"us_per_unit={us_per_unit!r} is not a finite number of microseconds")
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"plan": plan.name}}


def save_png(plan: "Plan", path: Any, costs: Costs = None, *, comm: float = 0.0) -> None:
    """Write a Gantt chart of the simulated plan; raises ImportError without matplotlib.

    Drawn on a bare ``Figure`` with the Agg canvas, not through ``pyplot``: the caller's
    backend (a notebook's inline one) and open figures stay as they were. ``path``: a file
    name, written as PNG whatever its suffix (matplotlib would pick the format from it), or a
    binary file object.
    """
    if not callable(getattr(path, "write", None)):  # a file object (io.BytesIO) is written as such
        check_file_path(path, "save_png")  # before anything is drawn
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "Plan.save_png needs matplotlib, which is not installed (pip install matplotlib); "
            "Plan.table() and Plan.chrome_trace() need nothing extra"
        ) from exc
    sim = simulate(plan, costs, comm=comm)
    colors = {"F": "tab:blue", "B": "tab:orange", "I": "tab:purple", "W": "tab:green"}
    # Width follows the number of time slots, not the cost unit: costs in microseconds must
    # not ask for a million-inch figure. Capped so that long plans still make a sane image.
    width = min(_MAX_WIDTH_IN, max(6.0, len(_columns(sim)[0]) * 0.4))
    fig = Figure(figsize=(width, 0.6 * plan.num_workers + 1.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for w, act, start, end in sim.timeline:
        ax.barh(w, end - start, left=start, color=colors[act.kind], edgecolor="black")
        ax.text((start + end) / 2, w, str(act), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(plan.num_workers), [f"w{w}" for w in range(plan.num_workers)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(f"{plan.name}: bubble {sim.bubble_ratio:.1%}")
    fig.tight_layout()
    fig.savefig(path, format="png")
