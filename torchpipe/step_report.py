"""A finished step next to what its own plan predicts: where the time went.

``pipe.last_step`` says when each action ran; the plan says what waits for what. Fed back
into the plan's simulator, the measured durations give the makespan a runtime with free
hand-offs would reach with these very actions. The gap between that and the measured
makespan is the runtime's own cost (waking workers, passing results); everything else is
the actions themselves. The measured bubble sits next to the bubble that plan promises for
the same durations.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Dict

from .runtime import StepRecord
from .schedule import Action, Plan
from .schedule.action import KINDS

__all__ = ["StepReport", "report"]


@dataclass(frozen=True)
class StepReport:
    """One step's measured makespan and bubble against its plan fed the measured durations."""

    schedule: str
    makespan: float
    """Seconds from the first action's start to the last action's end, as measured."""
    bubble_ratio: float
    """Share of worker time idle during the measured makespan."""
    planned_makespan: float
    """The plan simulated with each action's measured duration and free hand-offs."""
    planned_bubble_ratio: float
    """The bubble of that simulation: what the schedule itself leaves idle."""
    median_seconds: Dict[str, float]
    """Median measured duration per action kind (F, B, I, W), waits for a generator's lock left out."""
    lock_wait_seconds: float = 0.0
    """Time the actions spent waiting for a random generator's lock (`StepRecord.lock_waits`):
    forwards that draw, on partitions sharing a generator, run one at a time under
    checkpointing or ``reproducible=True``. Left out of the durations the plan is fed, so it
    shows in the gap between the measured and the planned makespan."""

    @property
    def runtime_efficiency(self) -> float:
        """``planned_makespan / makespan``: 1.0 means the runtime added nothing between actions."""
        return self.planned_makespan / self.makespan if self.makespan > 0 else 1.0

    def __str__(self) -> str:
        kinds = ", ".join(f"{kind} {seconds * 1e3:.3f} ms" for kind, seconds in self.median_seconds.items())
        waits = (f"; {self.lock_wait_seconds * 1e3:.3f} ms waiting for random generators' locks"
                 if self.lock_wait_seconds > 0 else "")
        return (
            f"{self.schedule}: makespan {self.makespan * 1e3:.3f} ms, its plan with these durations "
            f"{self.planned_makespan * 1e3:.3f} ms ({self.runtime_efficiency:.1%}); bubble "
            f"{self.bubble_ratio:.3f} measured, {self.planned_bubble_ratio:.3f} planned; median {kinds}{waits}"
        )


def report(plan: Plan, record: StepRecord) -> StepReport:
    """Measure ``record`` (a step of ``plan``) against ``plan``; ValueError if it did not complete."""
    if not isinstance(plan, Plan):
        raise TypeError(f"report takes the step's Plan first, got {type(plan).__name__}: {plan!r:.80}")
    if not isinstance(record, StepRecord):
        raise TypeError(f"report takes the step's StepRecord (pipe.last_step) second, got "
                        f"{type(record).__name__}: {record!r:.80}")
    if record.error is not None:
        raise ValueError(f"the step failed ({record.error}): nothing to report against its plan; its record "
                         "(pipe.last_step) holds the actions that ran before it stopped")
    durations: Dict[Action, float] = {}
    per_kind: Dict[str, list] = {}
    for key, start, seconds in zip(record.keys, record.starts, record.job_seconds()):
        if not isinstance(key, Action):
            raise ValueError(f"the step record is not of a plan (job key {key!r})")
        if start < 0:
            raise ValueError(f"the step did not complete (action {key} never ran): nothing to report")
        durations[key] = seconds
        per_kind.setdefault(key.kind, []).append(seconds)
    planned_actions = {action for actions in plan.worker_actions for action in actions}
    if planned_actions != set(durations):
        raise ValueError(f"the step record does not match the {plan.name!r} plan it is compared with")
    simulated: Any = plan.simulate(durations.__getitem__)
    return StepReport(
        schedule=plan.name,
        makespan=record.makespan,
        bubble_ratio=record.bubble_ratio,
        planned_makespan=simulated.makespan,
        planned_bubble_ratio=simulated.bubble_ratio,
        median_seconds={kind: statistics.median(per_kind[kind]) for kind in KINDS if kind in per_kind},
        lock_wait_seconds=sum(end - start for _, start, end in record.lock_waits),
    )
