"""Schedule generators: pure functions from (stages, micro-batches, options) to a Plan.

Each generator only decides per-worker *order*; timing, validation and rendering are
shared, so every schedule is checked and printed the same way.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from ..checks import as_int
from .action import BACKWARD, FORWARD, INPUT_GRAD, Action
from .greedy import fill_weight_grads, greedy_order
from .names import resolve
from .plan import Plan

__all__ = ["SCHEDULES", "build", "schedule_name", "schedule_options"]


def _positive_int(name: str, value: Any) -> int:
    """``value`` as a Python int >= 1: a NumPy integer is taken, as ``Pipe`` takes one for ``chunks``."""
    number = as_int(value)
    if number is None:
        raise TypeError(f"{name} must be an int, got {value!r}")
    if number < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return number


def _gpipe(p: int, m: int, *, backward: bool = True) -> Plan:
    """Fill-drain: all forwards, then all backwards in reverse micro-batch order."""
    if not isinstance(backward, bool):
        raise TypeError(f"option backward must be a bool, got {backward!r}")
    lists = []
    for s in range(p):
        acts = [Action(s, FORWARD, i) for i in range(m)]
        if backward:
            acts += [Action(s, BACKWARD, i) for i in reversed(range(m))]
        lists.append(tuple(acts))
    return Plan("gpipe", p, m, tuple(range(p)), tuple(lists))


def _one_f_one_b(p: int, m: int) -> Plan:
    """PipeDream-flush: ``p - 1 - s`` warm-up forwards, then alternate F and B, then drain.

    Stage ``s`` never holds more than ``p - s`` micro-batches, against ``m`` for GPipe.
    """
    lists = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        acts = [Action(s, FORWARD, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action(s, FORWARD, warmup + i), Action(s, BACKWARD, i)]
        acts += [Action(s, BACKWARD, i) for i in range(m - warmup, m)]
        lists.append(tuple(acts))
    return Plan("1f1b", p, m, tuple(range(p)), tuple(lists))


def _microbatch_groups(p: int, m: int) -> list[range]:
    """Consecutive micro-batch groups of at least ``min(p, m)``, sizes differing by at most one.

    ``max(1, m // p)`` groups, the larger ones first. When ``p`` divides ``m`` these are
    Megatron's groups of ``p``; otherwise they are torch.distributed.pipelining's rounds
    (which need the group count to divide ``m``), made ragged so that every ``m`` works.
    """
    rounds = max(1, m // p)
    size, larger = divmod(m, rounds)
    groups, first = [], 0
    for g in range(rounds):
        n = size + (1 if g < larger else 0)
        groups.append(range(first, first + n))
        first += n
    return groups


def _interleaved(num_stages: int, m: int, *, virtual_stages: int = 2) -> Plan:
    """Megatron interleaved 1F1B: ``v`` model chunks per worker, stage ``s`` on worker ``s % p``.

    Micro-batches go in consecutive groups (see ``_microbatch_groups``: groups of ``p`` when
    ``p`` divides ``m``); within a group a worker runs chunk 0 for all of them, then chunk 1,
    and backwards go chunk ``v - 1`` first. The warm-up is Megatron's, sized by the first
    (largest) group. The bubble shrinks by ``v`` against 1F1B when ``m`` is a multiple of ``p``.
    """
    v = _positive_int("virtual_stages", virtual_stages)
    if num_stages % v:
        raise ValueError(
            f"interleaved-1f1b needs num_stages to be a multiple of virtual_stages "
            f"(num_stages = workers * virtual_stages), got num_stages={num_stages}, virtual_stages={v}"
        )
    p = num_stages // v
    groups = _microbatch_groups(p, m)
    order = [(c, i) for mbs in groups for c in range(v) for i in mbs]  # (chunk, micro-batch), forward order
    back = [(c, i) for mbs in groups for c in reversed(range(v)) for i in mbs]
    total = m * v
    lists = []
    for r in range(p):
        # Megatron's warm-up; with v == 1 it is exactly 1F1B's ``p - 1 - r``.
        warmup = min((v - 1) * len(groups[0]) + 2 * (p - 1 - r) if v > 1 else p - 1 - r, total)
        fwd = [Action(c * p + r, FORWARD, i) for c, i in order]
        bwd = [Action(c * p + r, BACKWARD, i) for c, i in back]
        acts = fwd[:warmup]
        for k in range(total - warmup):
            acts += [fwd[warmup + k], bwd[k]]
        acts += bwd[total - warmup:]
        lists.append(tuple(acts))
    return Plan("interleaved-1f1b", num_stages, m, tuple(s % p for s in range(num_stages)), tuple(lists))


def _zb_h1(p: int, m: int) -> Plan:
    """Zero-bubble H1 (Qi et al. 2023): 1F1B with the backward split into I and W.

    I is on the critical path (the previous stage waits for it) so it runs as soon as it
    can; W waits for idle time. Every stage may hold up to ``p`` micro-batches in flight
    (released by W): 1F1B's peak, that of its first stage, so the pipeline's peak
    activation memory equals 1F1B's (later stages hold more than under 1F1B), while the
    bubble drops to about a third under equal F/I/W costs and m >> p.
    """
    critical = [
        [a if a.kind == FORWARD else Action(a.stage, INPUT_GRAD, a.microbatch) for a in acts]
        for acts in _one_f_one_b(p, m).worker_actions
    ]
    return fill_weight_grads("zb-h1", p, m, tuple(range(p)), critical, limits=(p,) * p)


def _zb_v(num_stages: int, m: int) -> Plan:
    """Zero-bubble V (Qi et al. 2024): ``2p`` stages on ``p`` workers in a V shape.

    Worker ``w`` owns stages ``w`` and ``2p - 1 - w``, so worker 0 computes both the first
    stage and the loss. Each worker holds at most ``2p`` (stage, micro-batch)
    activations; a stage here is half a 1F1B stage, so that is the memory of 1F1B's
    first stage. The order is chosen greedily (see ``greedy.greedy_order``); the bubble
    is near zero under equal F/I/W costs.
    """
    if num_stages % 2:
        raise ValueError(f"zb-v needs an even num_stages (2 per worker), got {num_stages}")
    p = num_stages // 2
    placement = tuple(s if s < p else num_stages - 1 - s for s in range(num_stages))
    return greedy_order("zb-v", num_stages, m, placement, limits=(2 * p,) * p)


_GENERATORS: dict[str, Callable[..., Plan]] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved-1f1b": _interleaved,
    "zb-h1": _zb_h1,
    "zb-v": _zb_v,
}

SCHEDULES: tuple[str, ...] = tuple(_GENERATORS)
"""Names accepted by ``build``."""


def schedule_name(schedule: Any) -> str:
    """Our name (one of ``SCHEDULES``) for a schedule named by us or by torch's pipelining.

    ``schedule`` is one of ``SCHEDULES`` in any case, or what torch's pipelining calls the
    same schedule: ``"Interleaved1F1B"``, ``"ScheduleInterleaved1F1B"`` or the class
    ``ScheduleInterleaved1F1B`` (see ``torchpipe.schedule.names``), so code written for torch
    moves over without renaming its schedules.
    """
    return resolve(schedule, SCHEDULES)


def schedule_options(name: Any) -> list[str]:
    """The keyword options schedule ``name`` takes (see :func:`build`)."""
    return list(_keyword_options(schedule_name(name)))


@functools.lru_cache(maxsize=None)
def _keyword_options(name: str) -> tuple[str, ...]:
    """The keyword-only parameters of the generator ``name`` (read once: every step asks)."""
    params = inspect.signature(_GENERATORS[name]).parameters.values()
    return tuple(prm.name for prm in params if prm.kind is prm.KEYWORD_ONLY)


def build(name: Any, num_stages: int, num_microbatches: int, **options: Any) -> Plan:
    """Generate a schedule by name; the result is validated before it is returned.

    ``name`` is one of ``SCHEDULES`` or torch's name for one of them (:func:`schedule_name`);
    the plan carries our name. Options: ``gpipe`` takes ``backward=False`` for a forward-only
    plan; ``interleaved-1f1b`` takes ``virtual_stages=v`` with ``num_stages = workers * v``;
    ``zb-v`` uses ``num_stages = 2 * workers``.
    """
    name = schedule_name(name)
    p = _positive_int("num_stages", num_stages)
    m = _positive_int("num_microbatches", num_microbatches)
    generator = _GENERATORS[name]
    accepted = schedule_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(f"schedule {name!r} does not take option(s) {unknown}; it takes {accepted or 'none'}")
    plan = generator(p, m, **options)
    plan.validate()
    return plan
