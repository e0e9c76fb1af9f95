"""Timed list scheduling of a plan: makespan, bubble, busy time, peak activations.

Each worker runs its list in order; an action starts when its worker is free and its
dependencies have ended. This is exactly how the runtime executes a plan, so the
simulated timeline is what an ideal runtime achieves with the given costs.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from .action import BACKWARD, FORWARD, INPUT_GRAD, KINDS, WEIGHT_GRAD, Action
from .errors import ScheduleDeadlockError

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["Costs", "DEFAULT_COSTS", "Simulation", "resolve_costs", "simulate"]

Costs = Union[None, Mapping[str, Union[float, Sequence[float]]], Callable[[Action], float]]
"""None (unit defaults), kind -> cost or per-stage costs, or a function of the action."""

DEFAULT_COSTS: Mapping[str, float] = {FORWARD: 1.0, INPUT_GRAD: 1.0, WEIGHT_GRAD: 1.0, BACKWARD: 2.0}
"""Unit costs: a backward is twice a forward, split evenly into I and W (B = I + W)."""

TimelineEntry = tuple[int, Action, float, float]


@dataclass(frozen=True)
class Simulation:
    """Result of ``Plan.simulate``: the numbers used to compare schedules.

    ``timeline`` holds ``(worker, action, start, end)`` sorted by start then worker;
    ``bubble_ratio`` is the idle share of the workers that have actions (as measured after
    a step: a worker given nothing is out of the step, not idle in it);
    ``peak_activations[w]`` counts (stage, micro-batch) pairs whose F has run on worker
    ``w`` and whose backward (B, or W when split) has not finished yet.
    """

    makespan: float
    bubble_ratio: float
    busy: tuple[float, ...]
    peak_activations: tuple[int, ...]
    timeline: tuple[TimelineEntry, ...]

    def span(self, action: Action) -> tuple[float, float]:
        """``(start, end)`` of ``action``; KeyError if the plan does not contain it."""
        for _, act, start, end in self.timeline:
            if act == action:
                return start, end
        raise KeyError(f"action {action} is not in the simulated plan")


def shown(value: object) -> str:
    """``repr(value)`` for a message, cut short when long (an int of 400 digits)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def _cost_value(where: str, value: object) -> float:
    """One cost as a float; a clear error for anything that is not a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a real number, got {value!r}")
    try:
        result = float(value)
    except OverflowError:  # an int beyond a float's range: no finite cost
        result = math.inf
    if not (math.isfinite(result) and result >= 0.0):  # also rejects NaN and inf
        raise ValueError(f"{where} must be a finite number >= 0, got {shown(value)}")
    return result


def _per_stage(kind: str, value: object, num_stages: int) -> tuple[float, ...]:
    """A kind's cost as one value per stage: a scalar for all, or a sequence of ``num_stages``
    (a NumPy array or a tensor too, as ``balance_by_cost`` takes them)."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple, numbers.Real)):
        value = value.tolist()  # a 0-dim one gives its number
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return (_cost_value(f"costs[{kind!r}]", value),) * num_stages
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"costs[{kind!r}] must be a number or a sequence of {num_stages} numbers, got {value!r}")
    if len(value) != num_stages:
        raise ValueError(f"costs[{kind!r}] has {len(value)} entries for {num_stages} stages")
    return tuple(_cost_value(f"costs[{kind!r}][{s}]", v) for s, v in enumerate(value))


def _derive_backward_halves(table: dict[str, tuple[float, ...]], given: set) -> None:
    """Fill the backward kinds the caller left out so that B = I + W (see resolve_costs)."""
    split = [kind for kind in (INPUT_GRAD, WEIGHT_GRAD) if kind in given]
    if BACKWARD not in given:
        if split:
            table[BACKWARD] = tuple(i + w for i, w in zip(table[INPUT_GRAD], table[WEIGHT_GRAD]))
        return
    if not split:
        table[INPUT_GRAD] = table[WEIGHT_GRAD] = tuple(b / 2 for b in table[BACKWARD])
    elif len(split) == 1:
        (known,) = split
        other = WEIGHT_GRAD if known == INPUT_GRAD else INPUT_GRAD
        for stage, (b, part) in enumerate(zip(table[BACKWARD], table[known])):
            if part > b:
                raise ValueError(f"costs[{known!r}] at stage {stage} is {part:g}, more than costs['B'] = {b:g}: "
                                 f"{other} would cost B - {known} < 0; give {other!r} too, or a B >= {known}")
        table[other] = tuple(b - part for b, part in zip(table[BACKWARD], table[known]))


def resolve_costs(costs: Costs, num_stages: int) -> Callable[[Action], float]:
    """Normalise every accepted cost form into one function, rejecting bad values early.

    In a mapping, a missing kind takes its unit default, except where the backward kinds
    give it: B = I + W always holds for what is missing, so that a full and a split backward
    cost the same and schedules compare fairly. B missing while I or W is given: B = I + W
    (with the default for the other half). B given with neither I nor W: each is half of B.
    B given with one of them: the other is the rest of B.
    """
    if costs is None:
        costs = DEFAULT_COSTS
    if callable(costs):
        fn = costs
    elif isinstance(costs, Mapping):
        unknown = set(costs) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown action kinds in costs: {sorted(unknown, key=repr)}; expected {KINDS}")
        table = {
            kind: _per_stage(kind, costs.get(kind, DEFAULT_COSTS[kind]), num_stages)
            for kind in (FORWARD, INPUT_GRAD, WEIGHT_GRAD, BACKWARD)
        }
        _derive_backward_halves(table, given=set(costs))

        def fn(action: Action) -> float:
            return table[action.kind][action.stage]
    else:
        raise TypeError(f"costs must be None, a mapping or a callable, got {type(costs).__name__}")

    def checked(action: Action) -> float:
        return _cost_value(f"cost of action {action}", fn(action))

    return checked


def simulate(plan: "Plan", costs: Costs = None, *, comm: float = 0.0) -> Simulation:
    """Simulate ``plan``; ``comm`` is added when a dependency crosses workers.

    Raises ``InvalidPlanError`` for a malformed plan and ``ScheduleDeadlockError`` when
    no worker can make progress.
    """
    from .validate import check_structure

    check_structure(plan)
    comm = _cost_value("comm", comm)
    cost = resolve_costs(costs, plan.num_stages)
    deps = {a: plan.dependencies(a) for a in plan.actions()}
    end: dict[Action, float] = {}
    free = [0.0] * plan.num_workers
    busy = [0.0] * plan.num_workers
    nxt = [0] * plan.num_workers
    timeline: list[TimelineEntry] = []
    remaining = sum(len(acts) for acts in plan.worker_actions)
    while remaining:
        progressed = False
        for w, acts in enumerate(plan.worker_actions):
            # Run as far as this worker can; order between workers does not change times.
            while nxt[w] < len(acts):
                act = acts[nxt[w]]
                if any(d not in end for d in deps[act]):
                    break
                start = free[w]
                for d in deps[act]:
                    ready = end[d] + (comm if plan.worker_of(d) != w else 0.0)
                    start = max(start, ready)
                duration = cost(act)
                end[act] = free[w] = start + duration
                busy[w] += duration
                timeline.append((w, act, start, start + duration))
                nxt[w] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleDeadlockError(_deadlock_message(plan, nxt, deps, end))
    makespan = max(free)
    if not math.isfinite(makespan):
        raise ValueError(f"plan {plan.name!r}: the costs add up past the largest float (makespan {makespan}); scale them down")
    # Workers with actions only, as the runtime's measured bubble counts them: a worker the
    # plan gives nothing takes no part in the step rather than idling through it.
    working = sum(1 for actions in plan.worker_actions if actions)
    bubble = 1.0 - sum(busy) / (working * makespan) if makespan > 0 else 0.0
    timeline.sort(key=lambda e: (e[2], e[0], e[3]))
    return Simulation(
        makespan=makespan,
        bubble_ratio=bubble,
        busy=tuple(busy),
        peak_activations=peak_activations(plan),
        timeline=tuple(timeline),
    )


def peak_activations(plan: "Plan") -> tuple[int, ...]:
    """Per worker, the most (stage, micro-batch) activations held at once.

    A worker runs its actions one at a time, so list order is time order and no timing
    is needed: F acquires, the backward that ends the micro-batch (B, or W) releases.
    """
    peaks = []
    for acts in plan.worker_actions:
        live = peak = 0
        for act in acts:
            if act.kind == FORWARD:
                live += 1
                peak = max(peak, live)
            elif act.kind in (BACKWARD, WEIGHT_GRAD):
                live -= 1
        peaks.append(peak)
    return tuple(peaks)


def _deadlock_message(plan: "Plan", nxt: list[int], deps: dict[Action, tuple[Action, ...]], end: dict[Action, float]) -> str:
    parts = []
    for w, acts in enumerate(plan.worker_actions):
        if nxt[w] >= len(acts):
            parts.append(f"worker {w} finished")
            continue
        act = acts[nxt[w]]
        waiting = ", ".join(str(d) for d in deps[act] if d not in end)
        parts.append(f"worker {w} is stuck at {act} waiting for {waiting}")
    return f"schedule deadlock in plan {plan.name!r}: " + "; ".join(parts)
