"""Zero-bubble order generation: insert weight-gradient (W) steps into a fixed F/I order.

The zero-bubble schedules keep a 1F1B-like order of forwards (F) and input-gradient
steps (I), which form the critical path, and move the W steps, which nobody waits for,
into the slots where the worker would otherwise idle. Where a W goes is found by a
unit-cost simulation: a W runs when the worker's next F/I is not ready yet, or when the
worker's activation budget is full (a W releases a micro-batch). The result is plain
per-worker lists; any topological order stays deadlock-free under other costs.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from .action import FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action
from .plan import Plan

__all__ = ["fill_weight_grads", "greedy_order"]


class _Placement:
    """Per-worker lists under construction, and what the unit-step loops track while placing."""

    def __init__(self, num_workers: int) -> None:
        self.end: dict[Action, int] = {}
        self.pending: list[deque[Action]] = [deque() for _ in range(num_workers)]
        self.live = [0] * num_workers
        self.lists: list[list[Action]] = [[] for _ in range(num_workers)]

    def placed(self) -> int:
        return sum(map(len, self.lists))

    def place(self, w: int, choice: Action | None, t: int) -> Action | None:
        """Run ``choice`` on worker ``w`` in slot ``t``, or else its oldest pending W.

        An F takes an activation slot and its W gives it back; an I queues its W.
        Returns what was placed (None when the worker idles in this slot).
        """
        if choice is None and self.pending[w]:
            choice = self.pending[w].popleft()
        if choice is None:
            return None
        self.lists[w].append(choice)
        self.end[choice] = t + 1
        if choice.kind == FORWARD:
            self.live[w] += 1
        elif choice.kind == INPUT_GRAD:
            self.pending[w].append(Action(choice.stage, WEIGHT_GRAD, choice.microbatch))
        else:
            self.live[w] -= 1
        return choice

    def check_progress(self, t: int, total: int, name: str, what: str, limits: Sequence[int]) -> None:
        if t > 10 * total + 10:  # a generator bug, not a user error: never loop forever
            raise RuntimeError(f"schedule {name!r}: {what} made no progress (limits={list(limits)})")

    def plan(self, name: str, num_stages: int, num_microbatches: int, stage_to_worker: tuple[int, ...]) -> Plan:
        return Plan(name, num_stages, num_microbatches, stage_to_worker, tuple(map(tuple, self.lists)))


def fill_weight_grads(
    name: str,
    num_stages: int,
    num_microbatches: int,
    stage_to_worker: tuple[int, ...],
    critical: Sequence[Sequence[Action]],
    *,
    limits: Sequence[int],
) -> Plan:
    """Plan whose worker ``w`` runs ``critical[w]`` (F and I only) in order, plus W steps.

    ``limits[w]`` caps the (stage, micro-batch) activations worker ``w`` holds: an F
    acquires one, the matching W releases it. W steps run oldest first, as soon as the
    worker has nothing else ready or needs the memory; leftovers run at the end.
    """
    num_workers = len(critical)
    pos = [0] * num_workers
    placement = _Placement(num_workers)
    end, live = placement.end, placement.live
    plan = Plan(name, num_stages, num_microbatches, stage_to_worker, tuple(map(tuple, critical)))
    deps = {a: plan.dependencies(a) for acts in critical for a in acts}
    total = sum(map(len, critical)) * 3 // 2
    t = 0
    while placement.placed() < total:
        for w in range(num_workers):
            choice = None
            if pos[w] < len(critical[w]):
                act = critical[w][pos[w]]
                ready = all(end.get(d, t + 1) <= t for d in deps[act])
                if ready and (act.kind != FORWARD or live[w] < limits[w]):
                    choice = act
                    pos[w] += 1
            placement.place(w, choice, t)
        t += 1
        placement.check_progress(t, total, name, "W placement", limits)
    return placement.plan(name, num_stages, num_microbatches, stage_to_worker)


def greedy_order(
    name: str,
    num_stages: int,
    num_microbatches: int,
    stage_to_worker: tuple[int, ...],
    *,
    limits: Sequence[int],
) -> Plan:
    """Split-backward plan whose F/I order is itself chosen greedily (used by ZB-V).

    At each unit step a free worker runs, in priority order: a ready I (oldest
    micro-batch first: the previous stage waits for it), a ready F if its activation
    budget ``limits[w]`` allows (deepest stage first, to reach the loss sooner), else
    its oldest pending W. Each stage runs its F and its I in micro-batch order.
    """
    p, m = num_stages, num_microbatches
    num_workers = max(stage_to_worker) + 1
    stages = [[s for s in range(p) if stage_to_worker[s] == w] for w in range(num_workers)]
    next_f = [0] * p
    next_i = [0] * p
    placement = _Placement(num_workers)
    end, live = placement.end, placement.live
    total = 3 * p * m
    t = 0

    def done(act: Action) -> bool:
        return end.get(act, t + 1) <= t

    while placement.placed() < total:
        for w in range(num_workers):
            choice = None
            ready_i = [
                Action(s, INPUT_GRAD, next_i[s])
                for s in stages[w]
                if next_i[s] < m
                and done(Action(s, FORWARD, next_i[s]))
                and (s == p - 1 or done(Action(s + 1, INPUT_GRAD, next_i[s])))
            ]
            if ready_i:
                choice = min(ready_i, key=lambda a: (a.microbatch, -a.stage))
            elif live[w] < limits[w]:
                ready_f = [
                    Action(s, FORWARD, next_f[s])
                    for s in stages[w]
                    if next_f[s] < m and (s == 0 or done(Action(s - 1, FORWARD, next_f[s])))
                ]
                if ready_f:
                    choice = min(ready_f, key=lambda a: (-a.stage, a.microbatch))
            placed = placement.place(w, choice, t)
            if placed is not None and placed.kind == FORWARD:
                next_f[placed.stage] += 1
            elif placed is not None and placed.kind == INPUT_GRAD:
                next_i[placed.stage] += 1
        t += 1
        placement.check_progress(t, total, name, "greedy order", limits)
    return placement.plan(name, p, m, stage_to_worker)
