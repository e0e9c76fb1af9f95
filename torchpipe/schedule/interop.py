"""Plans written elsewhere: ``torch.distributed.pipelining`` schedules and CSV files.

torch describes a schedule the way we do, one ordered list of actions per rank in the same
text form ("2F0", "1I3"), with ``None`` for an idle slot. Its multi-rank schedules
(``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, a
custom order loaded with ``_load_csv``) run across processes only. Reading their lists into
a :class:`Plan` runs them in one process, on ``Pipe.step``, and prints them with our table.

The translation, entry by entry:

* compute actions (``F``, ``B``, ``I``, ``W``) are kept, in order;
* an overlapped pair, ``(0F7;7B3)OVERLAP_F_B``, becomes its actions one after the other
  (one worker thread runs one action at a time);
* sends, receives and FSDP's ``UNSHARD``/``RESHARD``/``REDUCE_GRAD`` are dropped: in one
  process the runtime hands tensors from stage to stage itself;
* ``None`` and empty cells are idle slots and are dropped too.

The plan is then validated like a hand-written one (``Plan.from_lists``), so a schedule
that cannot run here is refused with the offending action named.
"""
from __future__ import annotations

import csv
import os
import re
from typing import Any, List, Optional, Sequence, Union

from ..checks import check_file_path
from .action import Action
from .errors import InvalidPlanError
from .plan import Plan

__all__ = ["from_torch", "load_csv", "save_csv"]

PathLike = Union[str, "os.PathLike[str]"]

# torch's text forms besides ours: a communication or sharding action ("1SEND_F0",
# "0UNSHARD"), and a group of actions run overlapped ("(0F7;7B3)OVERLAP_F_B").
_DROPPED = re.compile(r"\d+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*")
_OVERLAPPED = re.compile(r"\((?P<inner>[^()]*)\)OVERLAP_F_B")


def _translate(entry: Any, where: str) -> List[Action]:
    """The compute actions one entry of a torch order stands for (none for an idle slot)."""
    if entry is None:
        return []
    text = entry if isinstance(entry, str) else str(entry)
    text = text.strip()
    if not text or _DROPPED.fullmatch(text):
        return []
    overlapped = _OVERLAPPED.fullmatch(text)
    if overlapped:
        return [a for part in overlapped.group("inner").split(";") for a in _translate(part, where)]
    try:
        return [Action.parse(text)]
    except ValueError:
        raise ValueError(
            f"{where}: cannot read {text!r} as a pipeline action: expected a compute action such as '2F0' "
            f"(kinds F, B, I, W), an overlapped group '(0F7;7B3)OVERLAP_F_B', a send/receive or "
            f"(UN|RE)SHARD action, or an empty slot"
        ) from None


def _plan_from_rows(name: str, rows: Sequence[Sequence[Any]], what: str, *,
                    num_microbatches: Optional[int] = None) -> Plan:
    lists = [
        [a for position, entry in enumerate(row) for a in _translate(entry, f"{what} {worker}, entry {position}")]
        for worker, row in enumerate(rows)
    ]
    return Plan.from_lists(name, lists, num_microbatches=num_microbatches)


def from_torch(schedule: Any, name: Optional[str] = None) -> Plan:
    """A validated :class:`Plan` from a ``torch.distributed.pipelining`` schedule or order.

    ``schedule`` is a schedule object (its ``pipeline_order`` is read) or such an order: a
    dict from rank to that rank's list of actions, or a list of per-rank lists. Stage ``s``
    belongs to the rank whose list runs it, so V-shaped placements carry over.
    """
    order = getattr(schedule, "pipeline_order", schedule)
    if name is None:
        name = type(schedule).__name__ if order is not schedule else "torch"
    if isinstance(order, dict):
        for rank in order:
            if not isinstance(rank, int) or isinstance(rank, bool):
                raise TypeError(f"a pipeline order's ranks must be ints 0..{len(order) - 1}, got the key {rank!r} "
                                f"({type(rank).__name__})")
        ranks = sorted(order)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"a pipeline order's ranks must be 0..{len(ranks) - 1}, got {ranks}")
        rows = [order[rank] for rank in ranks]
    elif isinstance(order, (list, tuple)):
        rows = list(order)
    else:
        raise TypeError(
            "from_torch takes a torch.distributed.pipelining schedule (with .pipeline_order) or its order, "
            f"a dict from rank to actions; got {type(schedule).__name__}"
        )
    for rank, row in enumerate(rows):
        if isinstance(row, (str, bytes)) or not isinstance(row, (list, tuple)):
            raise TypeError(f"rank {rank}'s actions must be a list, got {type(row).__name__}: {row!r}")
    if order is schedule:
        return _plan_from_rows(name, rows, "rank")
    # A schedule object knows its micro-batch count: an order that names another one is torch's
    # own inconsistency (torch 2.13's Schedule1F1B lists 1F1..1F4 for 4 micro-batches on rank 1,
    # while its step() runs 1F0..1F3), not a typo the user could fix by passing a count.
    count = getattr(schedule, "_n_microbatches", None)
    count = count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None
    try:
        return _plan_from_rows(name, rows, "rank", num_microbatches=count)
    except InvalidPlanError as exc:
        kind = type(schedule).__name__
        raise InvalidPlanError(
            f"{kind}.pipeline_order cannot run as written: {exc}. That list is torch's own, and for some of its "
            f"schedules (Schedule1F1B in torch 2.13) it is not the order its step() runs; to run {kind} here, "
            f"pass the class or its name, Pipe.step(..., schedule={kind}), which builds it with torchpipe's "
            "generator") from None


def load_csv(path: PathLike, name: Optional[str] = None) -> Plan:
    """A validated :class:`Plan` from a CSV file: one row of actions per worker.

    The format is torch's ``compute_only`` CSV (``_dump_csv``): cells such as ``2F0``,
    empty cells for idle slots. The name defaults to the file's name without extension.
    Empty lines at the end of the file (an editor's habit) are not workers; an empty line
    between rows is a worker with nothing to do, as in torch's ``_load_csv``. ``save_csv``
    writes a worker with nothing to do as ``""``, which is kept wherever it stands.
    """
    check_file_path(path, "load_csv")
    shown = os.fsdecode(os.fspath(path))  # a bytes path too, in messages and the default name
    try:  # utf-8-sig: a spreadsheet's "CSV UTF-8" export starts with a byte-order mark
        with open(path, newline="", encoding="utf-8-sig") as handle:
            rows = list(csv.reader(handle))
    except UnicodeDecodeError as error:
        raise ValueError(f"{shown}: not a UTF-8 text file ({error.reason} at byte {error.start}); a plan CSV "
                         "holds cells such as 2F0, one row per worker") from None
    while rows and rows[-1] == []:
        rows.pop()
    if name is None:
        name = os.path.splitext(os.path.basename(shown))[0]
    return _plan_from_rows(name, rows, f"{shown}: row")


def save_csv(plan: Plan, path: PathLike) -> None:
    """Write ``plan`` as a CSV file, one row per worker, that ``load_csv`` reads back.

    torch's ``_load_csv(..., format="compute_only")`` reads it as well.
    """
    check_file_path(path, "save_csv")
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        for actions in plan.worker_actions:
            writer.writerow([str(a) for a in actions] or [""])  # not an empty line: see load_csv
