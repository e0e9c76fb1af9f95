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


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_one_micro_batch_runs_on_the_callers_thread_and_matches_the_plain_model_bitwise(checkpoint):
    # 'always' checkpoints the one micro-batch: its forwards hold the generator's lock, on the
    # caller's thread too (a Ctrl-C there gives it back: tests/test_rng_interrupts.py).
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
        on_caller = {thread for thread, _ in log} == {threading.get_ident()}
        assert on_caller
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
        # Review (helper-145): the trace named the worker threads, which ran nothing.
        tracks = [e["args"]["name"] for e in pipe.last_step.chrome_trace()["traceEvents"] if e["ph"] == "M"]
        caller = threading.current_thread().name
        assert all(name.startswith(f"{caller} (the caller's thread, for torchpipe-stage-") for name in tracks) is on_caller


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


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_inside_torch_checkpoint_a_one_micro_batch_call_matches_the_plain_model_and_records_a_success(use_reentrant):
    # Review (s35): inline, the stages saved through the checkpoint's hooks, whose early stop
    # raises inside the recompute's last stage: the step was recorded as failed. Inside a
    # checkpoint the call keeps to the workers (the Pipe keeps its own saved tensors there).
    from torch.utils.checkpoint import checkpoint

    log = []
    model = model_with_probes(log)
    model[6].p = 0.0  # no dropout: the reentrant recompute of a threaded Pipe may draw differently
    reference = copy.deepcopy(model)
    x = torch.randn(6, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with Pipe(model, [2, 3, 3], chunks=1) as pipe:
        out = checkpoint(pipe, x, use_reentrant=use_reentrant)
        out.pow(2).sum().backward()
        checkpoint(reference, x_ref, use_reentrant=use_reentrant).pow(2).sum().backward()
        assert pipe.last_step.error is None and pipe.last_report().schedule == "gpipe"
        assert torch.equal(x.grad, x_ref.grad)
        assert_same_gradients(pipe, reference)
        if not use_reentrant:  # inside the checkpoint's hooks: on the workers
            assert threading.get_ident() not in {thread for thread, _ in log}


def test_a_training_loop_inside_one_autocast_block_casts_the_updated_weights_every_step():
    # Review (s35): inline, the casts of the first step stayed in the caller's autocast cache,
    # so later steps in the same block computed with the weights from before the updates.
    def train(block_per_step):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        data = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(4)]
        losses = []
        with Pipe(model, [2, 1], chunks=1, checkpoint="never") as pipe:
            optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)

            def step(x, y):
                losses.append(pipe.step(x, y, nn.MSELoss()))
                optimizer.step()
                optimizer.zero_grad()

            if block_per_step:
                for x, y in data:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        step(x, y)
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    for x, y in data:
                        step(x, y)
        return losses

    assert torch.equal(torch.stack(train(block_per_step=False)), torch.stack(train(block_per_step=True)))


def test_a_plain_profiler_is_warned_about_the_workers_only_for_a_call_that_uses_them(monkeypatch):
    import warnings

    monkeypatch.setattr(torchpipe.thread_state, "_warned_profiler_misses_workers", False)
    with Pipe(model_with_probes([]), [2, 3, 3], chunks=1) as pipe:
        with warnings.catch_warnings(record=True) as caught, torch.profiler.profile() as prof:
            warnings.simplefilter("always")
            pipe(torch.randn(2, 8))  # on this thread: the profiler records every stage
            assert not [w for w in caught if "records only the thread" in str(w.message)]
            pipe.chunks = 2
            pipe(torch.randn(2, 8))  # on the workers
    assert "stage 2 F mb 0" in {event.name for event in prof.events()}
    assert len([w for w in caught if "records only the thread" in str(w.message)]) == 1


def test_close_from_a_stage_of_a_call_on_the_callers_thread_closes_the_pipe_once_the_call_ends():
    # On the workers, a stage's close() is refused (its own step could never end). On the
    # caller's thread it cannot be told from a signal handler's close(), which the Pipe runs
    # once the call ends: the call returns, then the Pipe is closed.
    class Closes(nn.Module):
        pipe = None

        def forward(self, x):
            self.pipe.close()
            return x + 1

    closes = Closes()
    pipe = Pipe(nn.Sequential(nn.Identity(), closes), [1, 1], chunks=1)
    Closes.pipe = pipe
    try:
        assert torch.equal(pipe(torch.zeros(2, 1)), torch.ones(2, 1))
        with pytest.raises(RuntimeError, match="closed"):
            pipe(torch.zeros(2, 1))
    finally:
        Closes.pipe = None
        pipe.close()


def test_an_interrupt_as_an_inline_call_ends_leaves_this_thread_as_it_was(monkeypatch):
    # Review (s35): a Ctrl-C landing where the call gave this thread its chain back skipped the
    # rest of the restore: the thread kept serving the step, and every later call from it was
    # refused as re-entrant (close() too).
    import torchpipe.runtime as runtime
    from torchpipe import call_chain

    real_adopt = runtime.adopt
    armed = [True]

    def adopt(chain):
        if armed[0] and not chain.owners:  # giving the caller its own chain back
            armed[0] = False
            raise KeyboardInterrupt  # what a pending SIGINT raises on entry to a call
        real_adopt(chain)

    monkeypatch.setattr(runtime, "adopt", adopt)
    with Pipe(nn.Sequential(nn.Linear(2, 2), nn.Identity()), [1, 1], chunks=1) as pipe:
        with pytest.raises(KeyboardInterrupt):
            pipe(torch.randn(2, 2))
        assert not armed[0], "the interrupt was not injected"
        assert not call_chain.current().owners and pipe._runtime._inline_owner is None
        assert torch.is_grad_enabled()
        assert pipe.last_step.error == "KeyboardInterrupt"
        assert pipe(torch.zeros(2, 2)).shape == (2, 2)
        pipe.step(torch.randn(2, 2), torch.randn(2, 2), nn.MSELoss())
