"""pipe.last_report(): a finished step next to its own plan fed the measured durations."""
import pytest
import torch
from torch import nn

from torchpipe import Pipe
from torchpipe.runtime import StepRecord
from torchpipe.schedule import build
from torchpipe.step_report import report


def make_pipe(chunks=4):
    return Pipe(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), [1] * 4, devices=["cpu"] * 4, chunks=chunks)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_report_of_a_step_matches_its_record_and_plan(schedule):
    with make_pipe() as pipe:
        pipe.step(torch.randn(8, 8), torch.randn(8, 8), nn.MSELoss(), schedule=schedule)
        record, result = pipe.last_step, pipe.last_report()
    assert result.schedule == schedule
    assert result.makespan == record.makespan and result.bubble_ratio == record.bubble_ratio
    # Real execution follows the plan's per-worker order and its dependencies, so it can be no
    # faster than the plan simulated with the same durations and free hand-offs.
    assert 0 < result.planned_makespan <= result.makespan * (1 + 1e-9)
    assert 0 < result.runtime_efficiency <= 1 + 1e-9
    assert 0 <= result.planned_bubble_ratio < 1
    kinds = {"gpipe": ["F", "B"], "1f1b": ["F", "B"], "zb-h1": ["F", "I", "W"]}[schedule]
    assert list(result.median_seconds) == kinds and all(v > 0 for v in result.median_seconds.values())
    assert schedule in str(result) and "ms" in str(result)


def test_report_of_a_forward_uses_the_forward_plan():
    with make_pipe() as pipe:
        pipe(torch.randn(8, 8))
        result = pipe.last_report()
    assert result.schedule == "gpipe" and list(result.median_seconds) == ["F"]
    assert result.planned_makespan <= result.makespan * (1 + 1e-9)


def test_planned_makespan_is_the_plan_simulated_with_the_recorded_durations():
    plan = build("1f1b", 2, 2)
    durations = {action: 0.001 * (1 + action.stage) * (2 if action.kind == "B" else 1)
                 for actions in plan.worker_actions for action in actions}
    keys = [a for actions in plan.worker_actions for a in actions]
    starts = [float(i) for i in range(len(keys))]
    record = StepRecord(labels=[str(a) for a in keys], workers=[0] * len(keys), worker_names=["w0", "w1"],
                        starts=starts, ends=[s + durations[a] for s, a in zip(starts, keys)],
                        wall_start=0.0, wall_end=10.0, keys=keys)
    result = report(plan, record)
    assert result.planned_makespan == pytest.approx(plan.simulate(durations.__getitem__).makespan)
    assert result.median_seconds == {"F": pytest.approx(0.0015), "B": pytest.approx(0.003)}


def test_no_report_before_a_step_or_after_a_failed_one():
    class Fail(nn.Module):
        def forward(self, x):
            raise KeyError("stage fails")

    with make_pipe() as pipe:
        with pytest.raises(RuntimeError, match="no step has run"):
            pipe.last_report()
    with Pipe(nn.Sequential(nn.Linear(8, 8), Fail()), [1, 1], devices=["cpu"] * 2, chunks=2) as pipe:
        with pytest.raises(KeyError):
            pipe(torch.randn(4, 8))
        with pytest.raises(ValueError, match="did not complete"):
            pipe.last_report()


def test_a_record_of_another_plan_is_rejected():
    with make_pipe() as pipe:
        pipe.step(torch.randn(8, 8), torch.randn(8, 8), nn.MSELoss(), schedule="1f1b")
        record = pipe.last_step
    with pytest.raises(ValueError, match="does not match"):
        report(build("1f1b", 4, 8), record)
    record.keys = ["not an action"] * len(record.keys)
    with pytest.raises(ValueError, match="not of a plan"):
        report(build("1f1b", 4, 4), record)


# Regression: the measured bubble divided by every thread of the Pipe, so an interleaved plan on
# 2 of 4 workers reported the 2 unused threads as half the step's idle time.
def test_measured_bubble_counts_only_the_workers_the_plan_uses():
    record = StepRecord(labels=["a", "b", "c"], workers=[0, 0, 1], worker_names=["w0", "w1", "w2", "w3"],
                        starts=[0.0, 1.0, 1.0], ends=[1.0, 2.0, 2.0], wall_start=0.0, wall_end=2.0)
    assert record.bubble_ratio == pytest.approx(1 - 3.0 / (2 * 2.0))
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    with Pipe(model, [1, 1, 1, 1], chunks=4) as pipe:
        pipe.step(torch.randn(8, 4), torch.randn(8, 4), nn.MSELoss(), schedule="interleaved-1f1b", virtual_stages=2)
        last = pipe.last_step
    assert sorted(set(last.workers)) == [0, 1] and len(last.worker_names) == 4
    busy = sum(last.busy())
    assert last.bubble_ratio == pytest.approx(1 - busy / (2 * last.makespan))
