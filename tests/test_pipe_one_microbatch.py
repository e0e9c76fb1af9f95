"""A call of one micro-batch with every stage on the CPU runs on the caller's thread.

Its plan is one chain (no two actions could overlap), so worker threads would only add a
hand-off per action. Everything else must stay as on the workers: the results, bitwise; the
plan and its record; errors; profiler labels; and the threads of the calls that do overlap.
"""
import copy
import threading

import pytest
import torch
from torch import nn

import torchpipe.profiling
from torchpipe import Pipe

pytestmark = pytest.mark.timeout(60)


class RecordThread(nn.Module):
    """Records the thread it runs on and that thread's intra-op thread count."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def forward(self, x):
        self.log.append((threading.get_ident(), torch.get_num_threads()))
        return x * 1.0


def model_with_probes(log, width=8):
    torch.manual_seed(0)
    return nn.Sequential(RecordThread(log), nn.Linear(width, width), nn.ReLU(), RecordThread(log),
                         nn.Linear(width, width), RecordThread(log), nn.Dropout(0.2), nn.Linear(width, width))


def assert_same_gradients(pipe, reference):
    for (name, got), want in zip(pipe.named_parameters(), reference.parameters()):
        assert torch.equal(got.grad, want.grad), name


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_one_micro_batch_runs_on_the_callers_thread_and_matches_the_plain_model_bitwise(checkpoint):
    log = []
    model = model_with_probes(log)
    reference = copy.deepcopy(model)
    x = torch.randn(6, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with Pipe(model, [2, 3, 3], chunks=1, checkpoint=checkpoint) as pipe:
        torch.manual_seed(1)
        out = pipe(x)
        out.pow(2).sum().backward()
        torch.manual_seed(1)
        expected = reference(x_ref)
        expected.pow(2).sum().backward()
        assert {thread for thread, _ in log} == {threading.get_ident()}
        assert torch.equal(out, expected) and torch.equal(x.grad, x_ref.grad)
        assert_same_gradients(pipe, reference)
        record = pipe.last_step
        assert record.labels == ["stage 0 F mb 0", "stage 1 F mb 0", "stage 2 F mb 0"]
        assert record.workers == [0, 1, 2] and all(s >= 0 for s in record.starts)
        assert record.error is None


def test_a_batch_smaller_than_chunks_is_one_micro_batch_too_and_more_run_on_the_workers():
    log = []
    with Pipe(model_with_probes(log), [2, 3, 3], chunks=4) as pipe:
        pipe(torch.randn(1, 8))
        assert {thread for thread, _ in log} == {threading.get_ident()}
        log.clear()
        pipe(torch.randn(4, 8))
        assert threading.get_ident() not in {thread for thread, _ in log}
        assert len({thread for thread, _ in log}) == 3  # one worker per partition


def test_one_micro_batch_uses_the_callers_intra_op_threads_unless_the_pipe_was_given_a_count(monkeypatch):
    # The workers share the cores (each gets a part); run one at a time, the stages get what
    # the plain model would get. A count given to the Pipe is applied on its workers.
    import torchpipe.workers as workers_module

    monkeypatch.setattr(workers_module.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(workers_module.os, "cpu_count", lambda: 8)
    original = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        log = []
        with Pipe(model_with_probes(log), [2, 3, 3], chunks=1) as pipe:
            pipe(torch.randn(2, 8))
        assert log == [(threading.get_ident(), 4)] * 3
        log.clear()
        with Pipe(model_with_probes(log), [2, 3, 3], chunks=1, intra_op_threads=3) as pipe:
            pipe(torch.randn(2, 8))
        assert threading.get_ident() not in {thread for thread, _ in log}
        assert {threads for _, threads in log} == {3}
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(original)


@pytest.mark.parametrize("schedule, on_caller", [("1f1b", True), ("gpipe", True), ("zb-h1", False)])
def test_a_step_of_one_micro_batch_runs_inline_when_its_plan_is_one_chain(schedule, on_caller):
    # Zero bubble splits a backward into its input and weight halves: stage 1's weight half
    # may run beside stage 0's input half, so that plan is no chain and keeps its workers.
    log = []
    model = model_with_probes(log)
    reference = copy.deepcopy(model)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    with Pipe(model, [2, 3, 3], chunks=1) as pipe:
        torch.manual_seed(3)
        loss = pipe.step(x, y, nn.MSELoss(), schedule=schedule)
        torch.manual_seed(3)
        expected = nn.MSELoss()(reference(x), y)
        expected.backward()
        assert ({thread for thread, _ in log} == {threading.get_ident()}) is on_caller
        assert torch.equal(loss, expected.detach())
        assert_same_gradients(pipe, reference)
        assert pipe.last_report().schedule == schedule


def test_a_failure_in_one_micro_batch_keeps_its_type_and_the_pipe_works_after():
    class Fails(nn.Module):
        armed = True

        def forward(self, x):
            if self.armed:
                raise ZeroDivisionError("stage 1 cannot")
            return x + 1

    fails = Fails()
    with Pipe(nn.Sequential(nn.Linear(4, 4), fails, nn.Identity()), [1, 1, 1], chunks=1) as pipe:
        with pytest.raises(ZeroDivisionError, match="stage 1 cannot"):
            pipe(torch.randn(2, 4))
        record = pipe.last_step
        assert record.error == "ZeroDivisionError: stage 1 cannot"
        assert record.labels[record.failed_job] == "stage 1 F mb 0" and record.starts[2] == -1.0
        fails.armed = False
        assert pipe(torch.zeros(2, 4)).shape == (2, 4)


def test_a_profile_of_one_micro_batch_shows_each_action_by_its_label():
    with Pipe(model_with_probes([]), [2, 3, 3], chunks=1) as pipe, torchpipe.profiling.profile() as prof:
        pipe(torch.randn(2, 8))
    names = {event.name for event in prof.events()}
    assert {"stage 0 F mb 0", "stage 1 F mb 0", "stage 2 F mb 0"} <= names


def test_convolutions_of_one_micro_batch_are_bitwise_without_naming_a_thread_count():
    # Convolution results may depend on the intra-op thread count; one micro-batch runs with
    # the caller's, as the plain model does (more micro-batches need intra_op_threads=...).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 1), nn.AdaptiveAvgPool2d(2))
    reference = copy.deepcopy(model)
    x = torch.rand(6, 3, 8, 8)
    with Pipe(model, [2, 2], chunks=1, checkpoint="never") as pipe:
        out = pipe(x)
        expected = reference(x)
        assert torch.equal(out, expected)
        out.sum().backward()
        expected.sum().backward()
    assert_same_gradients(model, reference)
