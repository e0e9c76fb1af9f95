"""Plan validation: every rule a runtime relies on, checked before anything runs.

Structural checks come first (so later checks may assume every dependency exists), then
same-worker order, then a simulation, which is the only sound way to find cross-worker
deadlocks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .action import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action
from .errors import InvalidPlanError

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["check_structure", "validate"]


def check_structure(plan: "Plan") -> None:
    """Every check except cross-worker deadlock; raises ``InvalidPlanError``.

    Separate from ``validate`` so the simulator can run it without recursing.
    """
    _check_shape(plan)
    where = _check_placement(plan)
    _check_completeness(plan, where)
    _check_local_order(plan, where)


def validate(plan: "Plan") -> None:
    """Raise ``InvalidPlanError`` (or ``ScheduleDeadlockError``) if ``plan`` cannot run."""
    from .simulate import simulate

    simulate(plan)  # runs check_structure first, then detects deadlocks


def _check_shape(plan: "Plan") -> None:
    if plan.num_stages < 1:
        raise InvalidPlanError(f"plan {plan.name!r}: num_stages must be >= 1, got {plan.num_stages}")
    if plan.num_microbatches < 1:
        raise InvalidPlanError(f"plan {plan.name!r}: num_microbatches must be >= 1, got {plan.num_microbatches}")
    if plan.num_workers < 1:
        raise InvalidPlanError(f"plan {plan.name!r} has no workers")
    if len(plan.stage_to_worker) != plan.num_stages:
        raise InvalidPlanError(
            f"plan {plan.name!r}: stage_to_worker has {len(plan.stage_to_worker)} entries "
            f"for {plan.num_stages} stages"
        )
    for s, w in enumerate(plan.stage_to_worker):
        if not isinstance(w, int) or isinstance(w, bool):
            raise InvalidPlanError(
                f"plan {plan.name!r}: stage {s} is mapped to {w!r} of type {type(w).__name__}; "
                f"stage_to_worker must hold Python ints"
            )
        if not 0 <= w < plan.num_workers:
            raise InvalidPlanError(
                f"plan {plan.name!r}: stage {s} is mapped to worker {w!r}, "
                f"but the plan has {plan.num_workers} workers"
            )


def _check_placement(plan: "Plan") -> dict[Action, tuple[int, int]]:
    """Range, ownership and duplicate checks; returns action -> (worker, position)."""
    where: dict[Action, tuple[int, int]] = {}
    for w, acts in enumerate(plan.worker_actions):
        for i, act in enumerate(acts):
            if act.stage >= plan.num_stages:
                raise InvalidPlanError(
                    f"action {act} on worker {w}: stage {act.stage} is out of range "
                    f"(plan has {plan.num_stages} stages)"
                )
            if act.microbatch >= plan.num_microbatches:
                raise InvalidPlanError(
                    f"action {act} on worker {w}: micro-batch {act.microbatch} is out of range "
                    f"(plan has {plan.num_microbatches} micro-batches)"
                )
            owner = plan.stage_to_worker[act.stage]
            if owner != w:
                raise InvalidPlanError(_misplaced(plan, act, w, owner))
            if act in where:
                raise InvalidPlanError(
                    f"duplicate action {act} on worker {w} (positions {where[act][1]} and {i})"
                )
            where[act] = (w, i)
    return where


def _misplaced(plan: "Plan", act: Action, worker: int, owner: int) -> str:
    """What is wrong with ``act`` on ``worker`` when its stage is ``owner``'s: a duplicate of an
    action the owner has, or a stray one, with where the stage's actions are."""
    if act in plan.worker_actions[owner]:
        return f"duplicate action {act}: on worker {worker} and on worker {owner}, which owns stage {act.stage}"
    held = sum(a.stage == act.stage for a in plan.worker_actions[owner])
    total = sum(a.stage == act.stage for acts in plan.worker_actions for a in acts)
    return (f"action {act} is on worker {worker}, but stage {act.stage} belongs to worker {owner} "
            f"(which holds {held} of its {total} actions)")


def _check_completeness(plan: "Plan", where: dict[Action, tuple[int, int]]) -> None:
    """F everywhere; per (stage, mb) exactly B or I+W, or no backward anywhere."""
    with_backward = any(a.is_backward for a in where)
    for s in range(plan.num_stages):
        for m in range(plan.num_microbatches):
            fwd, full = Action(s, FORWARD, m), Action(s, BACKWARD, m)
            inp, wgt = Action(s, INPUT_GRAD, m), Action(s, WEIGHT_GRAD, m)
            if fwd not in where:
                raise InvalidPlanError(f"missing action {fwd} (every stage runs F for every micro-batch)", fwd)
            if wgt in where and inp not in where:
                raise InvalidPlanError(f"action {wgt} on worker {where[wgt][0]} has no matching {inp} (W without I)")
            if full in where and inp in where:
                raise InvalidPlanError(
                    f"action {inp} on worker {where[inp][0]} duplicates the backward of {full} "
                    f"(use either B or I+W per stage and micro-batch)"
                )
            if inp in where and wgt not in where:
                raise InvalidPlanError(f"missing action {wgt}: {inp} has no weight-gradient step", wgt)
            if with_backward and full not in where and inp not in where:
                raise InvalidPlanError(
                    f"missing action {full} (or {inp} + {wgt}): the plan has backward actions, "
                    f"so every stage needs a backward for every micro-batch", full
                )


def _check_local_order(plan: "Plan", where: dict[Action, tuple[int, int]]) -> None:
    """A dependency on the same worker must come earlier in that worker's list."""
    for act, (w, i) in where.items():
        for dep in plan.dependencies(act):
            dw, di = where[dep]
            if dw == w and di > i:
                raise InvalidPlanError(f"action {act} on worker {w} runs before its dependency {dep}")
