"""Schedule names: ours, and ``torch.distributed.pipelining``'s for the same schedules.

Code written for torch's pipelining names its schedule the way torch does: a name for
``get_schedule_class`` (``"Interleaved1F1B"``, any case), a class name
(``"ScheduleInterleaved1F1B"``) or the class itself. Such code should move to ``Pipe.step``
without a table of renames, so every place that takes a schedule name reads it here.

A torch name selects our generator of the same schedule, not torch's own order: where the
two differ (GPipe's backward order, ZBV's placement of ``I`` and ``W``), the plan is ours,
and ``plan.table()`` shows it. torch's exact order runs through ``Plan.from_torch``. torch's
schedules without a counterpart here are refused with that advice.
"""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["TORCH_NAMES", "resolve"]

TORCH_NAMES: dict[str, str] = {
    "GPipe": "gpipe",
    "1F1B": "1f1b",
    "Interleaved1F1B": "interleaved-1f1b",
    "ZBVZeroBubble": "zb-v",
}
"""torch's schedule names (``get_schedule_class``) with a schedule of ours: ours for each."""

_TORCH_ONLY = ("LoopedBFS", "InterleavedZeroBubble", "DualPipeV")
"""torch's schedules with no generator here; their orders run through ``Plan.from_torch``.

(``get_schedule_class`` also names the abstract bases ``PipelineScheduleSingle`` and
``PipelineScheduleMulti``, which have no order: they are unknown names here.)
"""

_PREFIX = "schedule"


def _folded(text: str) -> str:
    """A name as it is looked up: case and torch's class prefix ``Schedule`` do not count."""
    key = text.lower()
    return key[len(_PREFIX):] if key.startswith(_PREFIX) and key != _PREFIX else key


def resolve(schedule: Any, ours: Sequence[str], *, besides: str = "") -> str:
    """Our name for ``schedule``: one of ``ours``, or torch's name or class for the same schedule.

    Raises TypeError for anything but a str or a torch schedule class, and ValueError for an
    unknown name or a torch schedule that has no generator here. ``besides`` names what the
    caller takes besides a name (``"a Plan"``), for the messages.
    """
    if isinstance(schedule, str) and schedule in ours:  # every step passes here: keep it cheap
        return schedule
    known = f"one of {list(ours)}, or torch's name for one of them ({', '.join(TORCH_NAMES)})"
    other = f", or {besides}" if besides else ""
    if isinstance(schedule, type) and schedule.__module__.startswith("torch.distributed.pipelining"):
        text = schedule.__name__
    elif isinstance(schedule, str):
        text = schedule
    else:
        hint = ""
        if hasattr(schedule, "pipeline_order"):
            hint = "; to run this schedule object's own order, pass Plan.from_torch(schedule)"
        raise TypeError(f"a schedule is named by a str ({known}) or by a torch.distributed.pipelining "
                        f"schedule class{other}; got {schedule!r}{hint}")
    for name in ours:
        if name.lower() == text.lower():
            return name
    key = _folded(text)
    for torch_name, name in TORCH_NAMES.items():
        if _folded(torch_name) == key and name in ours:
            return name
    if any(_folded(torch_name) == key for torch_name in _TORCH_ONLY):
        raise ValueError(f"torch's schedule {text!r} has no generator in torchpipe; build its order with "
                         f"torch and run it here with schedule=Plan.from_torch(schedule), or use {known}")
    raise ValueError(f"unknown schedule {text!r}; expected {known}{other}")
