"""Pipe.step frees a stage's outputs once the next stage holds its own copy (Megatron's idea).

Across devices the next stage copies its input, so the producer's output is needed only for
its graph and shape. On CPU every stage shares one device and nothing is copied, so these
tests stand in a cloning ``receive`` for the device-to-device copy: exactly what the next
stage gets across devices, a tensor of its own.
"""
import copy

import pytest
import torch
from torch import nn

import torchpipe
import torchpipe.step as step_module
from torchpipe import Pipe
from torchpipe.microbatch import Batch, map_nested

WIDTH = 8
SCHEDULES = [
    ("gpipe", {}, 4),
    ("1f1b", {}, 4),
    ("zb-h1", {}, 4),
    ("interleaved-1f1b", {"virtual_stages": 2}, 8),
    ("zb-v", {}, 8),
]


def model_of(stages: int, last_layer: type) -> nn.Sequential:
    """``stages`` pairs; each stage ends in ``last_layer`` (Linear: output not saved by autograd)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(stages):
        pair = [nn.Tanh(), nn.Linear(WIDTH, WIDTH)] if last_layer is nn.Linear else [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        layers += pair
    return nn.Sequential(*layers)


@pytest.fixture
def copying_handoffs(monkeypatch):
    """Every hand-off between stages copies, as it does between two devices."""

    def clone(batch: Batch, event, device, stream, copy_stream_for) -> Batch:
        return Batch(map_nested(batch.value, lambda tensor: tensor.detach().clone()))

    monkeypatch.setattr(step_module, "_copies_between", lambda producer, consumer: True)
    monkeypatch.setattr(step_module, "needs_receive", lambda stage, batch, event: True)
    monkeypatch.setattr(step_module, "receive", clone)


def run_and_compare(model, stages, chunks, schedule, options, checkpoint="never", balance=None):
    reference = copy.deepcopy(model)
    x, y = torch.randn(4 * chunks, WIDTH), torch.randn(4 * chunks, WIDTH)
    loss_fn = nn.MSELoss()
    expected_loss = loss_fn(reference(x), y)
    expected_loss.backward()
    with Pipe(model, balance or [2] * stages, chunks=chunks, checkpoint=checkpoint) as pipe:
        loss = pipe.step(x, y, loss_fn, schedule=schedule, **options)
        memory = pipe.last_memory
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-6, msg=name)
    return memory


@pytest.mark.parametrize("schedule,options,stages", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_each_copied_output_is_freed_at_the_handoff_and_gradients_stay_exact(
        copying_handoffs, schedule, options, stages, checkpoint):
    chunks = 4
    memory = run_and_compare(model_of(stages, nn.Linear), stages, chunks, schedule, options, checkpoint)
    output_bytes = 4 * WIDTH * 4  # one micro-batch of 4 rows, float32
    # Every stage but the last handed each micro-batch on, and its output storage died right
    # then (counted only if the storage was gone when the next stage had copied it).
    assert memory.freed_output_bytes == [chunks * output_bytes] * (stages - 1) + [0]


class Fork(nn.Module):
    """``x -> (a(x), (b(x),))``: an LSTM-like output, its state nested in a tuple."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.a(x), (self.b(x),)


class Carry(nn.Module):
    """``(y, (h,)) -> (f(y + h), (g(h),))``, keeping its last state as stateful RNN code does."""

    def __init__(self):
        super().__init__()
        self.f, self.g = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.kept = []

    def forward(self, batch):
        y, (h,) = batch
        state = self.g(h)
        self.kept.append(state)
        return self.f(y + h), (state,)


class Join(nn.Module):
    def forward(self, batch):
        y, (h,) = batch
        return y * h


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_state_nested_in_a_tuple_is_not_freed_at_the_handoff(copying_handoffs, schedule):
    """Only top-level outputs are freed: a layer that keeps its nested state (an RNN carrying
    it to its next call) must find it intact. (Freeing nested outputs too wiped it.)"""
    torch.manual_seed(0)
    model = nn.Sequential(Fork(), Carry(), Carry(), nn.Sequential(Carry(), Join()))
    reference = copy.deepcopy(model)
    chunks = 4
    torch.manual_seed(1)
    memory = run_and_compare(model, 4, chunks, schedule, {}, balance=[1, 1, 1, 1])
    assert memory.freed_output_bytes == [chunks * 4 * WIDTH * 4] * 3 + [0]  # the top-level output only
    torch.manual_seed(1)
    reference(torch.randn(4 * chunks, WIDTH))  # the x run_and_compare drew
    for carry, expected in zip([model[1], model[2]], [reference[1], reference[2]]):
        assert len(carry.kept) == chunks
        torch.testing.assert_close(torch.cat(carry.kept), expected.kept[0], rtol=1e-5, atol=1e-6)


def test_an_output_that_autograd_saved_stays_alive_and_is_not_counted(copying_handoffs):
    # Tanh saves its result for backward: the producer drops its reference, the memory stays.
    memory = run_and_compare(model_of(4, nn.Tanh), 4, 4, "1f1b", {})
    assert memory.freed_output_bytes == [0, 0, 0, 0]


def test_on_one_device_nothing_is_copied_so_nothing_is_freed():
    memory = run_and_compare(model_of(4, nn.Linear), 4, 4, "1f1b", {})
    assert memory.freed_output_bytes == [0, 0, 0, 0]


def test_outputs_are_never_freed_unless_autograd_saved_aliases(monkeypatch):
    """A copy on one device (no aliases packed) must not free: a saved output would be lost."""

    def clone(batch: Batch, event, device, stream, copy_stream_for) -> Batch:
        return batch.map_tensors(lambda tensor: tensor.detach().clone())

    monkeypatch.setattr(step_module, "needs_receive", lambda stage, batch, event: True)
    monkeypatch.setattr(step_module, "receive", clone)
    memory = run_and_compare(model_of(4, nn.Tanh), 4, 4, "1f1b", {})
    assert memory.freed_output_bytes == [0, 0, 0, 0]


def test_skip_stash_views_and_leaves_are_left_alone():
    """Only non-leaf, non-view, non-stashed outputs lose their storage."""
    leaf = torch.randn(4, WIDTH, requires_grad=True)
    base = leaf * 2
    view = base[:2]
    stashed = leaf * 3
    plain = leaf * 4
    saved = step_module._Saved([], [view, stashed, plain], 0, step_module.StageSkips(), aliased=True)
    saved.skips.stashed.append(("key", stashed))
    handoff = step_module._Handoff(Batch((leaf, view, stashed, plain)), None, saved)
    received = Batch(tuple(t.detach().clone() for t in (leaf, view, stashed, plain)))

    freed = step_module._free_sent_outputs(handoff, received)

    assert handoff.batch is None
    assert freed == plain.numel() * plain.element_size()
    assert plain.shape == (4, WIDTH) and plain.untyped_storage().nbytes() == plain.element_size()
    for kept in (leaf, view, stashed):
        assert kept.untyped_storage().nbytes() >= kept.numel() * kept.element_size()
    plain.backward(torch.ones(4, WIDTH))  # the graph survives: d(4 leaf)/d leaf = 4
    torch.testing.assert_close(leaf.grad, torch.full((4, WIDTH), 4.0))


class _Tagged(nn.Module):
    """``x * 1.0``: a fresh activation, saved by the Linear after it; each forward (recomputes
    too) first counts how many earlier ones are still alive, by their storages."""

    def __init__(self, alive_at_forward: list) -> None:
        super().__init__()
        self.alive_at_forward = alive_at_forward
        self.storages: list = []

    def forward(self, x):
        alive = [ref for ref in self.storages if not torch.UntypedStorage._expired(ref)]
        self.alive_at_forward.append(len(alive))
        y = x * 1.0
        self.storages.append(y.untyped_storage()._weak_ref())
        return y


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-v"])
def test_a_checkpointed_stage_keeps_no_recomputed_activation_between_a_split_backwards_halves(schedule):
    # Review (s31): under zero-bubble schedules, the recompute that a micro-batch's I ran kept
    # every tensor I did not read (the Linear inputs W needs) until that micro-batch's W ended,
    # although W recomputes again: with checkpoint='always', stage 3 of 4 held 4 micro-batches'
    # activations at once, as many as with checkpoint='never'.
    torch.manual_seed(0)
    alive_at_forward: list = []
    tags = []
    layers = []
    for _ in range(4):
        tags.append(_Tagged(alive_at_forward))
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU(), tags[-1], nn.Linear(WIDTH, WIDTH)]
    model = nn.Sequential(*layers)
    plain = copy.deepcopy(model)
    x, y = torch.randn(16, WIDTH), torch.randn(16, WIDTH)
    with Pipe(model, [4] * 4, chunks=8, checkpoint="always", intra_op_threads=torch.get_num_threads()) as pipe:
        loss = pipe.step(x, y, nn.MSELoss(), schedule=schedule)
        # A forward or a recompute may start while the micro-batch before it is being let go.
        assert max(alive_at_forward) <= 1, alive_at_forward
        expected = nn.MSELoss()(plain(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)


class _ChangedInPlaceWithAProbe(nn.Module):
    """Changes a tensor sigmoid saved, in place (backward must fail, as in the plain model); a
    hook on it runs a nested backward call in the middle of the outer one (a gradient probe)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.probe = None

    def forward(self, h):
        s = torch.sigmoid(h)
        s.mul_(2)
        if self.probe is not None and not torchpipe.is_recomputing():
            s.register_hook(self.probe)
        return self.lin(s)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_nested_backward_call_ending_keeps_the_outer_calls_in_place_check(checkpoint):
    # Review (s31): the end of a nested backward call dropped the recompute's version records
    # that the outer call still had to check, so its read of the overwritten tensor passed
    # and trained on it, silently.
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    with Pipe(nn.Sequential(nn.Linear(4, 4), _ChangedInPlaceWithAProbe()), [2], chunks=1,
              checkpoint=checkpoint) as pipe:
        layer = pipe[1]
        total = None
        def probe(grad):
            torch.autograd.grad(total, layer.lin.weight, retain_graph=True)  # nested backward call

        layer.probe = probe
        total = pipe(x).sum()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            total.backward(retain_graph=True)
