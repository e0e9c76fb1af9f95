"""Pipe(deferred_batch_norm=True): running statistics of the whole mini-batch, every path."""
import copy
import threading
import time

import pytest
import torch
from torch import nn

from torchpipe import Pipe


def model():
    # One BatchNorm, after layers without normalisation, so that its input is the same in the
    # pipeline and in the whole-batch reference (a later BN would see micro-batch-normalised
    # activations, which no pipeline can avoid).
    return nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6))


def assert_stats_equal(pipe, reference):
    pipe_bns = [m for m in pipe.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    ref_bns = [m for m in reference.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(pipe_bns) == len(ref_bns) == 1
    for got, want in zip(pipe_bns, ref_bns):
        torch.testing.assert_close(got.running_mean, want.running_mean)
        torch.testing.assert_close(got.running_var, want.running_var)
        assert int(got.num_batches_tracked) == int(want.num_batches_tracked)


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
@pytest.mark.parametrize("batch,chunks", [(12, 4), (10, 3), (4, 3)])
def test_forward_path_tracks_whole_batch_statistics(checkpoint, batch, chunks):
    plain = model()
    reference = copy.deepcopy(plain)
    with Pipe(plain, [2, 3], chunks=chunks, checkpoint=checkpoint, deferred_batch_norm=True) as pipe:
        for _ in range(3):
            x = torch.randn(batch, 6)
            pipe(x).sum().backward()
            reference(x)
            assert_stats_equal(pipe, reference)
        state = pipe.state_dict()
    restored = model()
    restored.load_state_dict(state)  # keys are the plain BatchNorm's
    assert_stats_equal(restored, reference)


def test_gradients_equal_the_model_run_per_microbatch():
    plain = model()
    per_microbatch = copy.deepcopy(plain)
    x = torch.randn(12, 6)
    with Pipe(plain, [2, 3], chunks=3, checkpoint="always", deferred_batch_norm=True) as pipe:
        out = pipe(x)
        out.sum().backward()
    expected = torch.cat([per_microbatch(chunk) for chunk in x.chunk(3)])
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    for got, want in zip(plain.parameters(), per_microbatch.parameters()):
        torch.testing.assert_close(got.grad, want.grad)


def test_explicit_backward_path_tracks_whole_batch_statistics():
    plain = model()
    reference = copy.deepcopy(plain)
    with Pipe(plain, [2, 3], chunks=4, checkpoint="always", deferred_batch_norm=True) as pipe:
        for schedule in ("1f1b", "gpipe", "zb-h1"):
            x, y = torch.randn(8, 6), torch.randn(8, 6)
            pipe.step(x, y, nn.MSELoss(), schedule=schedule)
            reference(x)
            assert_stats_equal(pipe, reference)


def test_without_deferral_statistics_differ():
    plain = model()
    reference = copy.deepcopy(plain)
    with Pipe(plain, [2, 3], chunks=4) as pipe:
        x = torch.randn(12, 6)
        pipe(x)
        reference(x)
        bn = [m for m in pipe.modules() if isinstance(m, nn.BatchNorm1d)][0]
        ref_bn = [m for m in reference.modules() if isinstance(m, nn.BatchNorm1d)][0]
        assert not torch.allclose(bn.running_var, ref_bn.running_var)


@pytest.mark.parametrize("call", ["forward", "gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_plain_batch_norm_is_not_updated_again_by_the_recompute(call, checkpoint):
    """Without deferral, each micro-batch updates the statistics once, as a per-micro-batch loop does.

    A checkpointed micro-batch runs its forward a second time in backward (zero-bubble
    schedules even twice, in I and in W); that must not count as another update.
    """
    plain = model()
    reference = copy.deepcopy(plain)
    x, target = torch.randn(12, 6), torch.randn(12, 6)
    with Pipe(plain, [2, 3], chunks=3, checkpoint=checkpoint) as pipe:
        for _ in range(2):
            if call == "forward":
                pipe(x).sum().backward()
            else:
                pipe.step(x, target, nn.MSELoss(), schedule=call)
            for part in x.chunk(3):
                reference(part)
        assert_stats_equal(pipe, reference)
        assert int(pipe[3].num_batches_tracked) == 6


class _Slow(nn.Module):
    """Holds a stage for a moment, so calls from two threads overlap."""

    def forward(self, x):
        time.sleep(0.005)
        return x


# Regression: the micro-batch count deferred batch norm commits with was set before the call
# waited for the pipeline, so a call from another thread changed it mid-step: running
# statistics were committed too few times.
def test_two_threads_calling_one_pipe_commit_batch_norm_statistics_once_per_call():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), _Slow(), nn.Linear(8, 8))

    x = torch.randn(16, 8)
    calls = 8
    with Pipe(build(), [2, 2], chunks=4, deferred_batch_norm=True) as pipe:
        threads = [threading.Thread(target=lambda: [pipe(x) for _ in range(calls)]) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        concurrent = pipe[1]
        with Pipe(build(), [2, 2], chunks=4, deferred_batch_norm=True) as sequential:
            for _ in range(2 * calls):
                sequential(x)
            assert int(concurrent.num_batches_tracked) == 2 * calls
            torch.testing.assert_close(concurrent.running_mean, sequential[1].running_mean)
            torch.testing.assert_close(concurrent.running_var, sequential[1].running_var)


def test_a_refused_pipe_leaves_the_model_unconverted(monkeypatch):
    """Review: with deferred_batch_norm=True the user's batch norms were replaced before the
    partitions moved to their devices; a move that failed left the model converted."""
    from torchpipe import pipe as pipe_module

    norm = nn.BatchNorm1d(4)
    model = nn.Sequential(norm, nn.Linear(4, 4, device="meta"))
    with pytest.raises(ValueError, match=r"layer '1' \(Linear\) has tensors on the 'meta' device \(weight, bias\), "
                                         r"which hold no values to move to cpu"):
        Pipe(model, [1, 1], devices=["cpu", "cpu"], chunks=2, deferred_batch_norm=True)
    assert model[0] is norm

    def failing_split(*args, **kwargs):
        raise MemoryError("no room on the device")

    model = nn.Sequential(norm, nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    inner = model[1][1]
    monkeypatch.setattr(pipe_module, "split_module", failing_split)
    with pytest.raises(MemoryError):
        Pipe(model, [1, 1], devices=["cpu", "cpu"], chunks=2, deferred_batch_norm=True)
    assert model[0] is norm and model[1][1] is inner


class FailsOnMicrobatch(nn.Module):
    """Raises in the forward of its ``fail_at``-th micro-batch of a call (0-based)."""

    def __init__(self, fail_at):
        super().__init__()
        self.fail_at = fail_at
        self.seen = 0

    def forward(self, x):
        self.seen += 1
        if self.seen == self.fail_at + 1:
            raise ValueError("boom in a later partition")
        return x


@pytest.mark.parametrize("path", ["forward", "gpipe", "1f1b"])
def test_a_failed_call_leaves_the_running_statistics_as_they_were(path):
    """Review: a partition commits its statistics after its last micro-batch's forward, while a
    later partition may still fail; whether a layer had got that far depended on the schedule
    and on timing, so a failed step left the statistics changed or not. The commits of a failed
    call are now undone; a later call commits as usual."""
    chunks = 4
    failing = FailsOnMicrobatch(fail_at=chunks - 1)
    layers = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), failing, nn.Linear(6, 6))
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    with Pipe(layers, [2, 2], chunks=chunks, checkpoint="never", deferred_batch_norm=True) as pipe:
        norm = pipe[1]
        before = (norm.running_mean.clone(), norm.running_var.clone(), int(norm.num_batches_tracked))

        def call():
            if path == "forward":
                pipe(x).sum().backward()
            else:
                pipe.step(x, y, nn.MSELoss(), schedule=path)

        # Under GPipe partition 0 has run all its forwards, and committed, before partition 1
        # fails on the last micro-batch; under 1F1B it has too, by the time its last F ran.
        with pytest.raises(ValueError, match="boom"):
            call()
        assert torch.equal(norm.running_mean, before[0]) and torch.equal(norm.running_var, before[1])
        assert int(norm.num_batches_tracked) == before[2] == 0
        failing.fail_at = -1  # never again
        call()
        assert int(norm.num_batches_tracked) == 1 and not torch.equal(norm.running_mean, before[0])


class _Mean(nn.Module):
    """A 0-dim output per micro-batch: the run succeeds, joining the outputs fails."""

    def forward(self, x):
        return x.mean()


def _fails_to_join():
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), _Mean())


def _no_loss_graph():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.Linear(4, 4))
    return model.requires_grad_(False)  # a loss with no graph: refused once the plan ran


@pytest.mark.parametrize("call", ["forward", "evaluate", "step"])
def test_a_call_that_fails_after_its_run_leaves_the_running_statistics_as_they_were(call):
    """Review (helper-144): the commits were undone only for a failure inside the run, so
    ``pipe(x)`` failing to join its outputs, ``evaluate`` whose loss raised and a ``step``
    refused once its plan ran kept the statistics of a call that raised."""
    model = _fails_to_join() if call == "forward" else _no_loss_graph()

    def raising_loss(output, target):
        raise ValueError("a loss that raises")

    x, y = torch.randn(8, 4) + 5, torch.randn(8, 4)
    with Pipe(model, [2, 2], chunks=2, deferred_batch_norm=True) as pipe:
        norm = pipe[1]
        before = (norm.running_mean.clone(), norm.running_var.clone(), int(norm.num_batches_tracked))
        if call == "forward":
            with pytest.raises(TypeError, match="0-dim tensor per micro-batch"):
                pipe(x)
        elif call == "evaluate":
            with pytest.raises(ValueError, match="a loss that raises"):
                pipe.evaluate(x, y, raising_loss, reduction="mean")
        else:
            with pytest.raises(RuntimeError, match="no loss with a graph"):
                pipe.step(x, y, nn.MSELoss())
        assert torch.equal(norm.running_mean, before[0]) and torch.equal(norm.running_var, before[1])
        assert int(norm.num_batches_tracked) == before[2] == 0
        assert pipe.last_step.error is not None
        pipe.evaluate(x, y, lambda output, target: output.sum(), reduction="sum")  # the next call commits as usual
        assert int(norm.num_batches_tracked) == 1 and not torch.equal(norm.running_mean, before[0])


def test_statistics_of_a_float16_model_are_rounded_to_the_buffer_once_as_torch_does():
    """Review (s33): the update ran as two in-place float16 ops (two roundings), and the
    statistics drifted up to 8 float16 steps from the plain model's in three steps."""
    worst = 0.0
    for seed in range(4):
        def build():
            torch.manual_seed(seed)
            return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32)).half()

        reference, model = build(), build()
        torch.manual_seed(100 + seed)
        batches = [torch.randn(16, 16, dtype=torch.float16) * 3 + 1 for _ in range(3)]
        with Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=1, checkpoint="never", deferred_batch_norm=True) as pipe:
            for x in batches:
                reference(x)
                pipe(x)
        for name in ("running_mean", "running_var"):
            got, want = getattr(model[1], name).float(), getattr(reference[1], name).float()
            step = torch.finfo(torch.float16).eps * want.abs()  # one float16 step, relative
            worst = max(worst, float(((got - want).abs() / step).max()))
        assert torch.equal(model[1].num_batches_tracked, reference[1].num_batches_tracked)
    assert worst <= 1.0, worst


@pytest.mark.parametrize("path", ["forward", "step"])
@pytest.mark.parametrize("outer_checkpoint", ["never", "always"])
def test_a_deferred_norm_in_a_nested_pipe_commits_once_when_the_outer_pipe_recomputes(path, outer_checkpoint):
    """Review (helper-144): the outer stage's recompute runs the inner Pipe again, whose workers
    cannot see the recompute, so its deferred norms committed a second time (2 batches tracked
    for one step); a plain norm there was already frozen by the outer recompute."""
    torch.manual_seed(0)
    inner_model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    reference = copy.deepcopy(inner_model[1])
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    with Pipe(inner_model, [1, 2], chunks=2, deferred_batch_norm=True) as inner, \
            Pipe(nn.Sequential(nn.Linear(4, 4), inner, nn.Linear(4, 4)), [2, 1], chunks=1,
                 checkpoint=outer_checkpoint) as outer:
        hidden = outer[0](x).detach()
        if path == "step":
            outer.step(x, y, nn.MSELoss())
        else:
            nn.MSELoss()(outer(x), y).backward()
        reference(inner_model[0](hidden))  # the plain model's one update, on the whole batch
        norm = inner_model[1]
        assert int(norm.num_batches_tracked) == 1
        torch.testing.assert_close(norm.running_mean, reference.running_mean)
        torch.testing.assert_close(norm.running_var, reference.running_var)


@pytest.mark.parametrize("inner_deferred", [False, True])
def test_deferring_over_a_nested_pipe_that_holds_norms_is_refused(inner_deferred):
    """Review (helper-144): the inner Pipe commits once per call, i.e. per outer micro-batch (2
    updates where the plain model makes 1); with a plain norm inside, the conversion failed
    with "layer '1' cannot be replaced", which the user never tried."""
    inner_model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    with Pipe(inner_model, [1, 2], chunks=2, deferred_batch_norm=inner_deferred) as inner:
        outer_model = nn.Sequential(nn.Linear(4, 4), inner, nn.Linear(4, 4), nn.BatchNorm1d(4))
        with pytest.raises(ValueError, match=r"cannot defer the batch norms of the Pipe nested at '1' \(its layer "
                                             r"'1'\).*this one without"):
            Pipe(outer_model, [2, 2], chunks=2, deferred_batch_norm=True)
        assert type(outer_model[3]) is nn.BatchNorm1d  # refused before anything was converted
        with Pipe(outer_model, [2, 2], chunks=2) as outer:  # without deferral: per outer micro-batch
            outer(torch.randn(8, 4))
        assert int(inner_model[1].num_batches_tracked) == (2 if inner_deferred else 4)


def test_deferring_over_a_nested_pipe_whose_norms_keep_no_statistics_is_allowed():
    """Review (helper-146): a batch norm without running statistics commits nothing."""
    inner_model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False), nn.Linear(4, 4))
    with Pipe(inner_model, [1, 2], chunks=2) as inner, \
            Pipe(nn.Sequential(nn.Linear(4, 4), inner, nn.BatchNorm1d(4)), [2, 1], chunks=2,
                 deferred_batch_norm=True) as outer:
        assert outer(torch.randn(8, 4)).shape == (8, 4)
        assert type(outer[2]) is not nn.BatchNorm1d and inner_model[1].running_mean is None


def test_a_failure_after_the_run_undoes_its_own_commit_never_a_later_calls():
    """Review (helper-146): the undo after the run ran outside the step lock and restored the
    layer's latest snapshot, which by then was another thread's call's: that call's update
    was lost. A call's commits are now marked while no other step runs, and undone only where
    no later call committed on top of them (then both stay)."""
    inside_loss, release = threading.Event(), threading.Event()

    def blocking_loss(output, target):
        inside_loss.set()
        release.wait(10)
        raise ValueError("a loss that raises")

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    with Pipe(model, [2, 1], chunks=2, deferred_batch_norm=True) as pipe:
        norm = pipe[1]
        errors = []

        def call_a():
            try:
                pipe.evaluate(x, y, blocking_loss, reduction="mean")
            except ValueError as exc:
                errors.append(exc)

        a = threading.Thread(target=call_a)
        a.start()
        assert inside_loss.wait(10)  # A's run committed; its loss runs outside the step lock
        pipe(x + 1)  # B commits on top of A's commit
        after_b = norm.running_mean.clone()
        release.set()
        a.join(10)
        assert len(errors) == 1
        assert int(norm.num_batches_tracked) == 2 and torch.equal(norm.running_mean, after_b)  # B's update stays

        # With no call in between, the failed call's commit is undone, as before.
        before = norm.running_mean.clone()
        release.set()
        inside_loss.clear()
        with pytest.raises(ValueError, match="a loss that raises"):
            pipe.evaluate(x, y, blocking_loss, reduction="mean")
        assert int(norm.num_batches_tracked) == 2 and torch.equal(norm.running_mean, before)
