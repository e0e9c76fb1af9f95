"""pipe.last_report(): a finished step next to its own plan fed the measured durations."""
import json
import time

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
        with pytest.raises(ValueError, match=r"the step failed \(KeyError: 'stage fails'\)"):
            pipe.last_report()


class SlowThenFail(nn.Module):
    """Sleeps, then raises on its ``fail_at``-th call (counting from 0); a plain layer otherwise."""

    def __init__(self, fail_at=0, seconds=0.05):
        super().__init__()
        self.linear, self.calls, self.fail_at, self.seconds = nn.Linear(8, 8), 0, fail_at, seconds

    def forward(self, x):
        call, self.calls = self.calls, self.calls + 1
        if call == self.fail_at:
            time.sleep(self.seconds)
            raise ArithmeticError("stage 1 gave up")
        return self.linear(x)


def test_a_failed_step_is_recorded_as_failed_with_the_job_that_raised_and_its_time():
    # Review (s33): a failed step's record looked like a finished one, and the job that raised,
    # which took most of the step's time, was missing from it (a 0.3 ms makespan for 50 ms).
    failing = SlowThenFail(fail_at=-1)
    model = nn.Sequential(nn.Linear(8, 8), failing, nn.Linear(8, 8))
    with Pipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=4, checkpoint="never") as pipe:
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        pipe.step(x, y, nn.MSELoss(), schedule="1f1b")
        finished = pipe.last_step
        assert finished.error is None and finished.failed_job is None
        assert "otherData" not in finished.chrome_trace()
        failing.fail_at = failing.calls  # the next step's first forward in stage 1
        with pytest.raises(ArithmeticError):
            pipe.step(x, y, nn.MSELoss(), schedule="1f1b")
        record = pipe.last_step
        assert record is not finished
        assert record.error == "ArithmeticError: stage 1 gave up"
        assert record.labels[record.failed_job] == "stage 1 F mb 0"
        took = record.ends[record.failed_job] - record.starts[record.failed_job]
        assert took >= 0.05 and record.makespan >= took
        trace = json.loads(json.dumps(record.chrome_trace()))
        assert trace["otherData"] == {"error": "ArithmeticError: stage 1 gave up"}
        failed = [e for e in trace["traceEvents"] if e.get("args", {}).get("error")]
        assert [(e["name"], e["args"]["action"]) for e in failed] == [("stage 1 F mb 0", "1F0")]
        with pytest.raises(ValueError, match=r"the step failed \(ArithmeticError: stage 1 gave up\)"):
            pipe.last_report()
        failing.fail_at = -1
        pipe.step(x, y, nn.MSELoss(), schedule="1f1b")  # a finished step reports again
        assert pipe.last_step.error is None and pipe.last_report().schedule == "1f1b"


def test_a_check_after_the_run_marks_the_step_failed_and_a_refused_call_changes_nothing():
    # Review (s33): a step whose plan ran and that then raised (no loss with a graph) was
    # reported as a good one; a call refused before its plan started is no step at all.
    with make_pipe() as pipe:
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        pipe.step(x, y, nn.MSELoss(), schedule="1f1b")
        finished = pipe.last_step
        with pytest.raises(ValueError, match="target has 6 samples"):
            pipe.step(x, y[:6], nn.MSELoss(), schedule="gpipe")
        assert pipe.last_step is finished and pipe.last_report().schedule == "1f1b"
        with pytest.raises(RuntimeError, match="no loss with a graph"):
            pipe.step(x, y, lambda out, target: torch.zeros(()), schedule="zb-h1")
        record = pipe.last_step
        assert record is not finished and record.error.startswith("RuntimeError: loss_fn returned no loss")
        assert record.failed_job is None and all(s >= 0 for s in record.starts)  # every action ran
        with pytest.raises(ValueError, match="the step failed"):
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


class _BrokenStr(Exception):
    def __str__(self):
        return self.missing  # AttributeError: the class forgot to set it


def test_an_error_whose_str_fails_still_reaches_the_caller_as_itself():
    """Review (s33): describing the error for the record called str() on it, and a broken
    __str__ replaced the stage's exception with an AttributeError."""
    class Raises(nn.Module):
        def forward(self, x):
            raise _BrokenStr()

    with Pipe(nn.Sequential(nn.Linear(8, 8), Raises()), [1, 1], devices=["cpu"] * 2, chunks=2) as pipe:
        with pytest.raises(_BrokenStr):
            pipe(torch.randn(4, 8))
        assert pipe.last_step.error == "_BrokenStr: <str() of the error failed>"


def test_a_forward_or_evaluate_failing_after_its_run_marks_the_step_failed():
    """Review (s33): only step() marked a failure after the run; pipe(x) whose outputs do not
    join, or evaluate whose loss raises on the caller's thread, left a record that looked
    finished, and last_report() reported it."""
    class Ragged(nn.Module):
        def forward(self, x):
            return x[:, : 4 + x.shape[0] % 2]  # micro-batches of 3 and 2 samples: widths 5 and 4

    with Pipe(nn.Sequential(nn.Linear(8, 8), Ragged()), [1, 1], devices=["cpu"] * 2, chunks=2) as pipe:
        with pytest.raises(ValueError):
            pipe(torch.randn(5, 8))
        assert pipe.last_step.error.startswith("ValueError")
        with pytest.raises(ValueError, match="the step failed"):
            pipe.last_report()

    def failing_loss(out, target):
        raise ArithmeticError("loss fails on the caller")

    with make_pipe() as pipe:
        with pytest.raises(ArithmeticError):
            pipe.evaluate(torch.randn(8, 8), torch.randn(8, 8), failing_loss)
        assert pipe.last_step.error == "ArithmeticError: loss fails on the caller"
        pipe.evaluate(torch.randn(8, 8), torch.randn(8, 8), nn.MSELoss())
        assert pipe.last_step.error is None and pipe.last_report().schedule == "gpipe"


class _DrawsThenSleeps(nn.Module):
    """Dropout (a draw: under checkpointing the forward holds the CPU generator's lock), then a
    wait that releases the GIL, the way a device kernel runs."""

    def __init__(self, seconds):
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.seconds = seconds

    def forward(self, x):
        x = self.dropout(x)
        time.sleep(self.seconds)
        return x


@pytest.mark.parametrize("call", ["forward", "step"])
def test_waits_for_a_generators_lock_count_as_idle_not_as_work(call):
    """Review (helper-145): CPU partitions share one generator, so their checkpointed forwards
    that draw run one at a time; the wait was timed as part of the job, so the record showed
    busy workers, a small bubble and forwards twice their length, and the report blamed the
    actions. Both stages' first forwards after 0F0 want the lock at once: one of them waits."""
    model = nn.Sequential(nn.Linear(8, 8), _DrawsThenSleeps(0.05), nn.Linear(8, 8), _DrawsThenSleeps(0.05))
    with Pipe(model, [2, 2], chunks=3, checkpoint="always") as pipe:
        x, y = torch.randn(6, 8), torch.randn(6, 8)
        if call == "forward":
            pipe(x).sum().backward()
        else:
            pipe.step(x, y, nn.MSELoss(), schedule="1f1b")
        record, result = pipe.last_step, pipe.last_report()
    assert record.lock_waits, "no wait for the generator's lock was recorded"
    seconds = record.job_seconds()
    waited = [0.0] * len(seconds)
    for index, start, end in record.lock_waits:
        assert record.starts[index] <= start <= end <= record.ends[index]  # inside the job that waited
        waited[index] += end - start
    for index, (start, end) in enumerate(zip(record.starts, record.ends)):
        assert seconds[index] == pytest.approx(end - start - waited[index], abs=1e-12)
    busy = [0.0] * 2
    for worker, duration in zip(record.workers, seconds):
        busy[worker] += duration
    assert record.busy() == pytest.approx(busy)
    assert record.bubble_ratio == pytest.approx(1 - sum(busy) / (2 * record.makespan))
    assert result.lock_wait_seconds == pytest.approx(sum(waited)) and "waiting for random generators' locks" in str(result)
    events = record.chrome_trace()["traceEvents"]
    waits = [e for e in events if e.get("cat") == "wait"]
    assert len(waits) == len(record.lock_waits)
    for wait in waits:  # nested in the event of its job, on that job's track
        job = next(e for e in events if e.get("ph") == "X" and e["name"] == wait["args"]["job"])
        assert job["tid"] == wait["tid"] and job["ts"] <= wait["ts"] + 1e-6
        assert wait["ts"] + wait["dur"] <= job["ts"] + job["dur"] + 1e-6
    json.dumps(record.chrome_trace())


def test_report_refuses_arguments_of_the_wrong_types_by_name():
    """Review (helper-145): ``report('1f1b', None)`` failed with an AttributeError of None."""
    with make_pipe() as pipe:
        pipe.step(torch.randn(8, 8), torch.randn(8, 8), nn.MSELoss())
        record = pipe.last_step
    with pytest.raises(TypeError, match="report takes the step's Plan first, got str: '1f1b'"):
        report("1f1b", record)
    with pytest.raises(TypeError, match=r"report takes the step's StepRecord \(pipe.last_step\) second, got NoneType"):
        report(build("1f1b", 4, 4), None)


def test_every_wait_for_a_generators_lock_of_a_long_step_is_recorded(monkeypatch):
    """Review (helper-146): the waits were kept in a ring of 256 per thread, so a step of many
    micro-batches lost the oldest: 868 waits happened, 512 were recorded, and the rest counted
    as work. Each step now keeps its own."""
    import torchpipe.call_chain as call_chain

    noted = []
    take = call_chain.HeldLock.take

    def counting_take(self, lock, cancels, waits=None):
        before = len(waits) if waits is not None else 0
        take(self, lock, cancels, waits)
        if waits is not None and len(waits) > before:
            noted.append(waits[-1])

    monkeypatch.setattr(call_chain.HeldLock, "take", counting_take)
    model = nn.Sequential(nn.Linear(8, 8), _DrawsThenSleeps(0.0005), nn.Linear(8, 8), _DrawsThenSleeps(0.0005))
    with Pipe(model, [2, 2], chunks=400, checkpoint="always") as pipe:
        pipe.step(torch.randn(800, 8), torch.randn(800, 8), nn.MSELoss(), schedule="1f1b")
        record = pipe.last_step
    assert len(noted) > 2 * 256  # the premise: more waits than two rings of 256 (one per thread) kept
    assert sorted((start, end) for _, start, end in record.lock_waits) == sorted((s, e) for _, s, e in noted)
