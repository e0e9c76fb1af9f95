"""Pipe(..., reproducible=True): a seeded run repeats itself whatever order the threads run in.

Without it, partitions with dropout on one CPU draw from the one CPU generator in thread
order, so the same torch.manual_seed can give other masks from run to run (guide, section 2).
The proof that these tests see that: the layer below sleeps a Python-random while before
each dropout, so the threads' order changes from run to run. With reproducible=False,
`docs/probe_seeded_runs.py` gave other outputs in 7 and 8 of 8 reruns (two runs, twenty-eighth session), with
True in none; and with the seeding broken on purpose (no seed per forward) every repeat test
below failed.
"""
import copy
import pickle
import random
import threading
import time
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import torchpipe.checkpoint as checkpoint_module
from torchpipe import Pipe

pytestmark = pytest.mark.timeout(120)

CHECKPOINTS = ["never", "except_last", "always"]


class Jitter(nn.Module):
    """Sleeps 0-2 ms (Python's random, not torch's): the threads' order varies from run to run."""

    def forward(self, x):
        time.sleep(random.random() * 0.002)
        return x


class Noise(nn.Module):
    """y = x * u, u uniform: dy/dx = y / x exactly when the recompute drew u again."""

    def forward(self, x):
        return x * torch.rand_like(x)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), Jitter(), nn.Dropout(0.5), nn.Linear(32, 32), Jitter(), nn.Dropout(0.5),
                         nn.Linear(32, 4), Jitter(), nn.Dropout(0.3))


def run(path: str, checkpoint: str, seed: int = 123):
    """One seeded run: its output (or loss) and every gradient."""
    torch.manual_seed(1)
    x, y = torch.randn(24, 16), torch.randn(24, 4)
    with Pipe(model(), [3, 3, 3], chunks=4, checkpoint=checkpoint, reproducible=True) as pipe:
        torch.manual_seed(seed)
        if path == "forward":
            out = pipe(x)
            out.pow(2).sum().backward()
            result = out.detach()
        else:
            result = pipe.step(x, y, nn.MSELoss(), schedule=path)
        return result, [p.grad.clone() for p in pipe.parameters()], torch.rand(1)


@pytest.mark.parametrize("path", ["forward", "gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_seeded_runs_repeat_themselves_outputs_and_gradients(path, checkpoint):
    first = run(path, checkpoint)
    for _ in range(3):
        again = run(path, checkpoint)
        assert torch.equal(again[0], first[0])
        assert all(torch.equal(a, b) for a, b in zip(again[1], first[1]))
        assert torch.equal(again[2], first[2])  # and the caller's generator goes on alike
    assert not torch.equal(run(path, checkpoint, seed=124)[0], first[0])  # another seed: other masks


@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
@pytest.mark.parametrize("path", ["forward", "1f1b"])
def test_the_recompute_draws_what_the_seeded_forward_drew(checkpoint, path):
    with Pipe(nn.Sequential(Noise(), Jitter(), Noise(), Jitter()), [2, 2], chunks=4, checkpoint=checkpoint,
              reproducible=True) as pipe:
        for _ in range(3):
            x = (torch.rand(16, 8) + 0.5).requires_grad_()
            if path == "forward":
                y = pipe(x)
                y.sum().backward()
            else:
                captured = []  # each micro-batch's output, in order (the last stage runs them so)
                pipe.step(x, None, lambda out, _: (captured.append(out.detach()), out.sum())[1], reduction="sum")
                y = torch.cat(captured)
            # y = x * u1 * u2, so dy/dx = y / x when both recomputes drew u1 and u2 again.
            torch.testing.assert_close(x.grad, y.detach() / x.detach())


def test_micro_batches_and_calls_each_get_masks_of_their_own():
    with Pipe(nn.Sequential(nn.Identity(), nn.Dropout(0.5)), [1, 1], chunks=4, checkpoint="never",
              reproducible=True) as pipe:
        torch.manual_seed(7)
        ones = torch.ones(16, 64)
        first, second = pipe(ones), pipe(ones)
    masks = first.view(4, 4, 64)
    assert all(not torch.equal(masks[i], masks[j]) for i in range(4) for j in range(i + 1, 4))
    assert not torch.equal(first, second)


class RandomLoss(nn.Module):
    def forward(self, output, target):
        return ((output - target) * torch.rand_like(output)).pow(2).mean()


@pytest.mark.parametrize("case", ["two partitions", "one partition", "checkpointed", "step with a loss that draws"])
def test_a_call_advances_the_callers_generator_by_one_draw_only(case):
    """The seeded forwards give the generator's own state back: the caller's numbers after a
    call do not depend on how much the partitions drew. (Review, s28: a partition alone on its
    generator, and a loss that drew, moved it.)"""
    x = torch.ones(8, 64)
    balance = [2] if case == "one partition" else [1, 1]
    layers = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5))
    with Pipe(layers, balance, chunks=4, checkpoint="always" if case == "checkpointed" else "never",
              reproducible=True) as pipe:
        torch.manual_seed(3)
        if case == "step with a loss that draws":
            pipe.step(x, x, RandomLoss())
        else:
            pipe(x).sum().backward()
        after = torch.rand(4)
    torch.manual_seed(3)
    torch.randint(0, 1 << 62, (1,))
    assert torch.equal(after, torch.rand(4))


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the other Pipe's locked draws are not stray ones
def test_a_reproducible_pipe_beside_a_checkpointed_one_on_another_thread_replays_exactly():
    """Review (s28): the step's seed was drawn without the CPU generator's lock, so it could land
    inside the other Pipe's locked forward and shift its draws: its recompute then raised
    RNGReplayError (64 of 300 steps), although every draw was torchpipe's own."""
    start, errors = threading.Barrier(2), []

    def train(reproducible: bool) -> None:
        torch.manual_seed(0)
        layers = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5), Jitter(), nn.Dropout(0.5), nn.Linear(32, 32),
                               nn.Dropout(0.5))
        with Pipe(layers, [3, 3], chunks=4, checkpoint="always", reproducible=reproducible) as pipe:
            inputs = [torch.randn(16, 32) for _ in range(60)]
            start.wait()
            for x in inputs:
                try:
                    pipe(x).sum().backward()
                except Exception as exc:  # noqa: BLE001 - counted, asserted below
                    errors.append(exc)

    threads = [threading.Thread(target=train, args=(flag,)) for flag in (True, False)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_reproducible_pipe_that_draws_may_run_inside_torch_checkpoint(use_reentrant):
    """Its draws no longer follow the thread order, so torch's recompute (which restores the
    CPU generator first) draws the same masks: the gradients equal a run without the checkpoint.
    Without reproducible=True this is refused (test_reliability)."""
    def gradients(checkpointed: bool):
        torch.manual_seed(0)
        inner = nn.Sequential(nn.Linear(16, 16), Jitter(), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5))
        with Pipe(inner, [3, 2], chunks=4, checkpoint="never", reproducible=True) as pipe:
            x = torch.randn(8, 16, requires_grad=True)
            torch.manual_seed(11)
            out = torch_checkpoint(pipe, x, use_reentrant=use_reentrant) if checkpointed else pipe(x)
            out.pow(2).sum().backward()
            return [x.grad] + [p.grad for p in pipe.parameters()]

    for got, want in zip(gradients(True), gradients(False)):
        assert torch.equal(got, want)


def test_a_reproducible_pipe_that_draws_may_run_in_another_pipes_checkpointed_stage():
    """The outer recompute restores the CPU generator, so the inner call draws its seed again.
    Without reproducible=True this is refused (test_reliability)."""
    def gradients(outer_checkpoint: str):
        torch.manual_seed(0)
        inner = Pipe(nn.Sequential(nn.Linear(16, 16), Jitter(), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5)),
                     [3, 2], chunks=4, checkpoint="always", reproducible=True)
        with inner, Pipe(nn.Sequential(inner, nn.Linear(16, 16), nn.Identity()), [2, 1], chunks=2,
                         checkpoint=outer_checkpoint) as outer:
            x = torch.randn(8, 16, requires_grad=True)
            torch.manual_seed(11)
            outer(x).pow(2).sum().backward()
            return [x.grad] + [p.grad for p in outer.parameters()]

    for got, want in zip(gradients("always"), gradients("never")):
        assert torch.equal(got, want)


def test_the_option_is_checked_and_kept_by_copies():
    with pytest.raises(TypeError, match="reproducible must be a bool, got 1"):
        Pipe(nn.Sequential(nn.Linear(2, 2)), [1], reproducible=1)
    with Pipe(nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5)), [1, 1], chunks=2, reproducible=True) as pipe:
        for twin in (copy.deepcopy(pipe), pickle.loads(pickle.dumps(pipe))):
            with twin:
                assert twin.reproducible is True
                torch.manual_seed(5)
                expected = pipe(torch.ones(4, 32))
                torch.manual_seed(5)
                assert torch.equal(twin(torch.ones(4, 32)), expected)


def test_setting_the_option_later_is_checked_too():
    with Pipe(nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5)), [1, 1], chunks=2) as pipe:
        assert pipe.reproducible is False
        with pytest.raises(TypeError, match="reproducible must be a bool, got 'no'"):
            pipe.reproducible = "no"
        assert pipe.reproducible is False
        pipe.reproducible = True
        torch.manual_seed(5)
        first = pipe(torch.ones(4, 32))
        torch.manual_seed(5)
        assert torch.equal(pipe(torch.ones(4, 32)), first)


class Sometimes(nn.Module):
    """Draws only for a micro-batch whose first value is positive: data-dependent randomness."""

    def forward(self, x):
        return x * torch.rand_like(x) if x[0, 0] > 0 else x


def seeded_after_a_warning(seed: int):
    """A partition seen not to draw in the first micro-batch draws in later ones: a call whose
    stray draw is seen is named in a warning (one that lands inside another partition's seeded
    forward is absorbed unseen, so it may take a few calls); the seeded calls after it; their
    outputs."""
    checkpoint_module._always_locked.discard(id(torch.default_generator))  # a fresh process, as it were
    torch.manual_seed(0)
    x = torch.ones(8, 16)
    x[:2] = -1  # micro-batch 0 skips the draw
    with Pipe(nn.Sequential(Jitter(), Sometimes(), nn.Dropout(0.5), Jitter()), [2, 2], chunks=4,
              reproducible=True) as pipe:
        for _ in range(60):  # about 3 in 5 calls are seen (measured); 60 misses in a row: never
            with warnings.catch_warnings(record=True) as told:
                warnings.simplefilter("always")
                pipe(x)
            if told:
                break
        assert len(told) == 1 and "moved during this call outside its seeded forwards" in str(told[0].message)
        assert told[0].category is RuntimeWarning and told[0].filename == __file__
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # seeded from here on: nothing more to say
            return [pipe(x) for _ in range(3)] + [torch.rand(2)]


def test_a_partition_drawing_on_some_micro_batches_only_is_named_then_seeded():
    # Review (s29): such a partition ran unseeded, so seeded runs differed silently. With the
    # lock_for_good call removed (seen, said, not seeded after), the calls after the warning
    # drew unseeded again and warned again (3 of 3 runs failed).
    try:
        first = seeded_after_a_warning(5)
        for _ in range(4):
            again = seeded_after_a_warning(5)
            assert all(torch.equal(a, b) for a, b in zip(first, again))
        assert not torch.equal(seeded_after_a_warning(6)[0], first[0])
    finally:
        checkpoint_module._always_locked.discard(id(torch.default_generator))


@pytest.mark.parametrize("case", ["every micro-batch draws", "one partition never draws"])
def test_no_warning_where_every_draw_was_seeded(case):
    second = nn.Dropout(0.5) if case == "every micro-batch draws" else nn.Identity()
    with Pipe(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), Jitter(), nn.Linear(16, 16), second, Jitter()),
              [3, 3], chunks=4, reproducible=True, checkpoint="except_last") as pipe:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                pipe(torch.ones(8, 16)).sum().backward()
                pipe.step(torch.ones(8, 16), torch.ones(8, 16), nn.MSELoss())
