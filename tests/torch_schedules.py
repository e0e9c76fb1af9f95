"""torch.distributed.pipelining's multi-rank schedules, built without a process group.

A schedule object computes every rank's order from the stages it is given; the stand-in
stages carry only what the constructors read (index, stage count, group size and rank).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest

V_SHAPED = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
"""Two stages per rank in a V: rank r holds stages r and 2p - 1 - r."""

CLASSES = ("ScheduleLoopedBFS", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
           "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
"""The schedules with several stages per rank, which torch runs only across processes."""


def _stand_in_stage(stage_index: int, num_stages: int, group_size: int) -> Any:
    base = pytest.importorskip("torch.distributed.pipelining.stage")._PipelineStageBase

    class StandInStage(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:  # no super(): no process group
            self.stage_index, self.num_stages = stage_index, num_stages
            self.group_size, self.group_rank = group_size, 0
            self.submod, self.dw_builder = None, None

        def _create_grad_recv_info(self, *args: Any, **kwargs: Any) -> None:
            return None

        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> None:
            return None

        def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> None:
            return None

    return StandInStage()


def torch_schedule(name: str, ranks: int, microbatches: int) -> Any:
    """torch's schedule ``name`` for ``ranks`` ranks of two stages each, seen from rank 0."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, name, None)
    if cls is None:
        pytest.skip(f"this torch has no {name}")
    stages = 2 * ranks
    indices = [0, stages - 1] if name in V_SHAPED else [0, ranks]
    return cls([_stand_in_stage(i, stages, ranks) for i in indices], microbatches,
               loss_fn=lambda out, target: out.sum())


def torch_order(schedule: Any) -> Dict[int, List[Optional[str]]]:
    """Each rank's entries as text, ``None`` kept: what a plan read from it must follow."""
    return {rank: [None if a is None else str(a) for a in actions] for rank, actions in schedule.pipeline_order.items()}


def torch_single_schedule(name: str, ranks: int, microbatches: int) -> Any:
    """torch's one-stage-per-rank schedule ``name`` (``ScheduleGPipe``) for ``ranks`` ranks."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, name, None)
    if cls is None:
        pytest.skip(f"this torch has no {name}")
    return cls(_stand_in_stage(0, ranks, ranks), microbatches, loss_fn=lambda out, target: out.sum())
