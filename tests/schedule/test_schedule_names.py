"""Schedules named as torch.distributed.pipelining names them select our generator of that schedule."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch_schedules import torch_schedule, torch_single_schedule

from torchpipe import Pipe
from torchpipe.schedule import SCHEDULES, Plan, build, schedule_name, schedule_options
from torchpipe.schedule.names import _TORCH_ONLY, TORCH_NAMES

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

OPTIONS = {"interleaved-1f1b": {"virtual_stages": 2}}


def _stages(name: str, workers: int) -> int:
    return 2 * workers if name in ("interleaved-1f1b", "zb-v") else workers


@pytest.mark.parametrize("torch_name", sorted(TORCH_NAMES))
def test_each_of_torchs_spellings_selects_our_schedule(torch_name) -> None:
    ours = TORCH_NAMES[torch_name]
    cls = schedules.get_schedule_class(torch_name)  # the name is torch's own
    for spelling in (torch_name, torch_name.lower(), torch_name.upper(), cls.__name__, cls.__name__.lower(), cls):
        assert schedule_name(spelling) == ours, spelling
    assert schedule_options(cls) == schedule_options(ours)
    plan = build(cls, _stages(ours, 3), 5, **OPTIONS.get(ours, {}))
    assert plan == build(ours, _stages(ours, 3), 5, **OPTIONS.get(ours, {}))
    assert plan.name == ours


@pytest.mark.parametrize("name", SCHEDULES)
def test_our_names_are_read_in_any_case(name) -> None:
    assert schedule_name(name) == name
    assert schedule_name(name.upper()) == name


@pytest.mark.parametrize("torch_name", _TORCH_ONLY)
def test_torchs_schedules_without_a_generator_here_point_to_from_torch(torch_name) -> None:
    cls = schedules.get_schedule_class(torch_name)
    for spelling in (torch_name, cls):
        with pytest.raises(ValueError, match=rf"torch's schedule '{cls.__name__ if spelling is cls else torch_name}' "
                                             r"has no generator in torchpipe; .*Plan\.from_torch"):
            build(spelling, 4, 4)


def test_names_that_are_not_schedules_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown schedule 'Schedule'; expected one of \['gpipe'"):
        schedule_name("Schedule")
    # torch's abstract bases have no order to build or run
    for base in ("PipelineScheduleSingle", schedules.PipelineScheduleMulti, "SchedulePipelineScheduleSingle"):
        with pytest.raises(ValueError, match=r"unknown schedule '(Schedule)?PipelineSchedule(Single|Multi)'"):
            schedule_name(base)
    for odd in ("", " ", " 1f1b", "1f1b ", "ScheduleSchedule1F1B", "zbv"):
        with pytest.raises(ValueError, match="unknown schedule"):
            schedule_name(odd)
    with pytest.raises(ValueError, match=r"unknown schedule 'zbh1'; expected one of .*GPipe, 1F1B, Interleaved1F1B"):
        schedule_name("zbh1")

    class Mine(schedules.Schedule1F1B):  # a subclass may change the order: not taken for torch's
        pass

    with pytest.raises(TypeError, match=r"schedule is named by a str .* got <class '.*Mine'>"):
        schedule_name(Mine)
    with pytest.raises(TypeError, match=r"got .*; to run this schedule object's own order, pass Plan\.from_torch"):
        schedule_name(torch_schedule("ScheduleZBVZeroBubble", 2, 4))


@pytest.mark.parametrize("workers", [2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 6, 8, 12])
def test_where_our_order_differs_from_torchs_it_is_no_slower(workers, microbatches) -> None:
    # GPipe: torch runs the backwards in micro-batch order, we in reverse; zb-v places I and W
    # otherwise. Under unit costs and with backward twice a forward, ours never finishes later.
    pairs = [("gpipe", torch_single_schedule("ScheduleGPipe", workers, microbatches))]
    if microbatches >= 2:  # torch's ZBV wants at least two micro-batches
        pairs.append(("zb-v", torch_schedule("ScheduleZBVZeroBubble", workers, microbatches)))
    for ours, schedule in pairs:
        theirs = Plan.from_torch(schedule)
        mine = build(ours, theirs.num_stages, microbatches)
        assert mine.stage_to_worker == theirs.stage_to_worker
        for costs in (None, {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}):
            assert mine.simulate(costs).makespan <= theirs.simulate(costs).makespan, (ours, costs)


@pytest.mark.parametrize("torch_name", sorted(TORCH_NAMES))
def test_pipe_step_takes_torchs_names_and_classes(torch_name) -> None:
    ours = TORCH_NAMES[torch_name]
    stages = _stages(ours, 2)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    results = []
    for schedule in (ours, torch_name, schedules.get_schedule_class(torch_name)):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(stages)])
        with Pipe(model, [1] * stages, chunks=4, checkpoint="never") as pipe:
            loss = pipe.step(x, y, nn.MSELoss(), schedule=schedule, **OPTIONS.get(ours, {}))
            assert pipe.last_report().schedule == ours
            assert pipe.plan(4, schedule, **OPTIONS.get(ours, {})) == pipe.plan(4, ours, **OPTIONS.get(ours, {}))
        results.append([loss] + [p.grad for p in model.parameters()])
    for named, *others in zip(*results):
        for other in others:
            assert torch.equal(named, other)


def test_pipe_step_refuses_a_torch_schedule_it_has_no_generator_for_before_running() -> None:
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])
    with Pipe(model, [1] * 4, chunks=4) as pipe:
        with pytest.raises(ValueError, match=r"'DualPipeV' has no generator in torchpipe; .*schedule=Plan\.from_torch"):
            pipe.step(torch.randn(8, 6), torch.randn(8, 6), nn.MSELoss(), schedule="DualPipeV")
        assert pipe.last_step is None
        assert all(p.grad is None for p in model.parameters())
