"""Pipe gives the outputs and gradients of the plain nn.Sequential (transparency)."""
import collections
import copy
import json
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import torchpipe
import torchpipe.profiling
import torchpipe.thread_state
from torchpipe import MovingDenied, Pipe, RNGReplayError, is_checkpointing, is_recomputing


def make_model(width=8, depth=6, dropout=0.0):
    layers = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i % 2 == 1:
            layers.append(nn.ReLU())
        if dropout:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def grads(module):
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def run_both(model, balance, chunks, checkpoint, x, **kwargs):
    reference = copy.deepcopy(model)
    with Pipe(model, balance, chunks=chunks, checkpoint=checkpoint, **kwargs) as pipe:
        out = pipe(x)
        out.pow(2).sum().backward()
        expected = reference(x)
        expected.pow(2).sum().backward()
        return out, expected, grads(pipe), grads(reference)


def test_bitwise_for_one_chunk_without_checkpointing():
    model = make_model()
    x = torch.randn(12, 8)
    out, expected, got, want = run_both(model, [3, 2, 2, 2], 1, "never", x)
    assert torch.equal(out, expected)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_bitwise_convolutions_with_the_callers_intra_op_thread_count():
    # Convolution results depend on the thread count; with the caller's count they are bitwise.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 1), nn.AdaptiveAvgPool2d(2))
    reference = copy.deepcopy(model)
    x = torch.rand(6, 3, 8, 8)
    with Pipe(model, [2, 2], chunks=1, checkpoint="never", intra_op_threads=torch.get_num_threads()) as pipe:
        out = pipe(x)
        expected = reference(x)
        assert torch.equal(out, expected)
        out.sum().backward()
        expected.sum().backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(got.grad, want.grad), name


@pytest.mark.parametrize("balance", [[9], [1, 8], [3, 3, 3], [1, 1, 1, 6], [2, 2, 2, 2, 1]])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_outputs_and_every_gradient_match(balance, chunks, checkpoint):
    model = make_model()
    x = torch.randn(10, 8, requires_grad=False)  # 10 does not divide by 3, 4 or 7
    out, expected, got, want = run_both(model, balance, chunks, checkpoint, x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_input_gradient_matches():
    model = make_model()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with Pipe(model, [3, 3, 3], chunks=3) as pipe:
        pipe(x).sum().backward()
    reference(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_batch_smaller_than_chunks():
    model = make_model()
    x = torch.randn(2, 8)
    out, expected, got, want = run_both(model, [4, 5], 8, "except_last", x)
    torch.testing.assert_close(out, expected)
    for name in want:
        torch.testing.assert_close(got[name], want[name])


class TupleLinear(nn.Module):
    """Takes and returns (tensor, tensor, flag): tuples and non-tensor values travel through."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, inputs):
        x, y, flag = inputs
        assert flag == "keep"
        return self.a(x) + y, self.b(y) * x, flag


def test_tuple_inputs_and_outputs():
    model = nn.Sequential(TupleLinear(), TupleLinear(), TupleLinear())
    reference = copy.deepcopy(model)
    x, y = torch.randn(7, 4), torch.randn(7, 4)
    with Pipe(model, [1, 1, 1], chunks=3) as pipe:
        out = pipe((x, y, "keep"))
        (out[0].sum() + out[1].sum()).backward()
    expected = reference((x, y, "keep"))
    (expected[0].sum() + expected[1].sum()).backward()
    assert out[2] == "keep"
    torch.testing.assert_close(out[0], expected[0])
    torch.testing.assert_close(out[1], expected[1])
    for (name, p), (_, q) in zip(pipe.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


Hidden = collections.namedtuple("Hidden", "h mask")


class ToHidden(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return Hidden(self.linear(x), x > 0)


class FromHidden(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, hidden):
        assert isinstance(hidden, Hidden), type(hidden)
        return Hidden(self.linear(hidden.h * hidden.mask), hidden.mask)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_namedtuple_between_partitions_stays_a_namedtuple(checkpoint):
    model = nn.Sequential(ToHidden(), FromHidden(), FromHidden())
    reference = copy.deepcopy(model)
    x = torch.randn(6, 4)
    with Pipe(model, [1, 1, 1], chunks=3, checkpoint=checkpoint) as pipe:
        out = pipe(x)
        assert isinstance(out, Hidden)
        out.h.sum().backward()
        expected = reference(x)
        expected.h.sum().backward()
        torch.testing.assert_close(out.h, expected.h)
        assert torch.equal(out.mask, expected.mask)
        for (name, p), (_, q) in zip(pipe.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
        step_model = copy.deepcopy(reference)
        with Pipe(step_model, [1, 1, 1], chunks=3, checkpoint=checkpoint) as stepping:
            loss = stepping.step(x, torch.zeros(6, 4), lambda out, target: (out.h - target).pow(2).mean())
        torch.testing.assert_close(loss, (copy.deepcopy(reference)(x).h).pow(2).mean())


class Returns(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, x):
        return self.make(x)


@pytest.mark.parametrize("make, chunks, error", [
    (lambda x: {"out": x}, 1, "takes and returns a Tensor or a tuple.*got dict"),
    (lambda x: [x, x], 2, "takes and returns a Tensor or a tuple.*got list"),
    (lambda x: None, 2, "takes and returns a Tensor or a tuple.*got NoneType"),
    (lambda x: (x, [x]), 2, "output 1 of the pipeline is a list holding tensors"),
    (lambda x: (x, (x, x)), 2, r"output 1 of the pipeline is a tuple holding tensors.*: return them there, or give "
                               r"that item None in output_batch_dim"),
    (lambda x: (x, x.sum()), 2, "output 1 of the pipeline is a 0-dim tensor"),
    (lambda x: x.sum(), 2, "output is a 0-dim tensor per micro-batch"),
])
def test_outputs_that_cannot_be_gathered_are_refused_by_name(make, chunks, error):
    """Not silently turned into a tuple of keys, nor cut to the first micro-batch's part."""
    with Pipe(nn.Sequential(nn.Linear(4, 4), Returns(make)), [1, 1], chunks=chunks) as pipe:
        with pytest.raises(TypeError, match=error):
            pipe(torch.randn(4, 4))
        # Refused in the stage that returned it, or in the join after the stages ran well:
        # either way the step failed, and its record says so.
        assert pipe.last_step.error.startswith("TypeError")


def test_per_sample_values_in_an_output_tuple_gather_but_other_values_pass():
    with Pipe(nn.Sequential(nn.Linear(4, 4), Returns(lambda x: (x, "tag", 3))), [1, 1], chunks=2) as pipe:
        out = pipe(torch.randn(4, 4))
    assert out[0].shape == (4, 4) and out[1:] == ("tag", 3)


def test_in_place_layers_at_partition_boundaries():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8))
    for checkpoint in ("always", "never"):
        out, expected, got, want = run_both(copy.deepcopy(model), [1, 2, 2], 3, checkpoint, torch.randn(9, 8))
        torch.testing.assert_close(out, expected)
        for name in want:
            torch.testing.assert_close(got[name], want[name])


@pytest.mark.parametrize("call", ["forward", "step"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("lead", [[], [nn.Identity()], [nn.Unflatten(1, (2, 4)), nn.Flatten()]],
                         ids=["first", "after-identity", "after-views"])
def test_partitions_that_start_in_place(call, checkpoint, lead):
    """A stage that overwrites its input first thing (possibly behind pass-through layers) works
    on a private copy: the checkpointed input must survive for the recompute, and Pipe.step's
    stage inputs are autograd leaves."""
    model = nn.Sequential(nn.Linear(8, 8), *copy.deepcopy(lead), nn.ReLU(inplace=True), nn.Linear(8, 8))
    reference = copy.deepcopy(model)
    x, target = torch.randn(6, 8), torch.randn(6, 8)
    nn.MSELoss()(reference(x), target).backward()
    with Pipe(model, [1, len(model) - 1], chunks=3, checkpoint=checkpoint) as pipe:
        if call == "forward":
            nn.MSELoss()(pipe(x), target).backward()
        else:
            pipe.step(x, target, nn.MSELoss())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class InPlaceByClass(nn.Module):
    inplace = True

    def forward(self, x):
        return x.mul_(2)


class InPlaceByProperty(nn.Module):
    @property
    def inplace(self):
        return True

    def forward(self, x):
        return x.mul_(2)


class InPlaceBuffer(nn.Module):  # a buffer named like the flag: nn.Module.__getattr__ finds it
    def __init__(self):
        super().__init__()
        self.register_buffer("inplace", torch.ones(()))

    def forward(self, x):
        return x * self.inplace


class InPlaceParameter(nn.Module):  # a parameter named like the flag
    def __init__(self):
        super().__init__()
        self.inplace = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * self.inplace


class InPlaceChild(nn.Module):  # a child module named like the flag
    def __init__(self):
        super().__init__()
        self.inplace = nn.Identity()

    def forward(self, x):
        return self.inplace(x)


@pytest.mark.parametrize("layer", [nn.Linear(2, 2), nn.ReLU(), nn.ReLU(inplace=True), InPlaceByClass(),
                                   InPlaceByProperty(), InPlaceBuffer(), InPlaceParameter(), InPlaceChild()],
                         ids=lambda layer: type(layer).__name__)
def test_the_per_call_in_place_check_reads_the_flag_as_getattr_does(layer):
    # Read before every call, without getattr's AttributeError for the many layers that lack it.
    from torchpipe.lowering import _inplace_flag

    assert bool(_inplace_flag(layer)) == bool(getattr(layer, "inplace", False))


def _module_trees():
    shared = nn.Linear(2, 2)
    with_hole = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with_hole.register_module("absent", None)  # a None child: skipped, as modules() skips it
    with_hole.append(nn.Tanh())
    parametrized = nn.Linear(2, 2)
    torch.nn.utils.parametrize.register_parametrization(parametrized, "weight", nn.Identity())
    return {
        "one leaf": nn.Sequential(nn.Linear(2, 2)),
        "a leaf alone": nn.ReLU(),
        "nested": nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Tanh())), nn.Linear(2, 2)),
        "shared, first seen deep": nn.Sequential(nn.Sequential(shared, nn.ReLU()), shared, nn.Sequential(shared)),
        "a None child": with_hole,
        "a dict and a list": nn.Sequential(nn.ModuleDict({"b": nn.ReLU(), "a": nn.Tanh()}),
                                           nn.ModuleList([nn.Linear(2, 2), nn.Identity()])),
        "parametrized": nn.Sequential(parametrized, nn.ReLU()),
    }


@pytest.mark.parametrize("name", list(_module_trees()))
def test_the_per_step_layer_walk_finds_what_modules_finds_in_its_order(name):
    # Read before every step in place of modules(): a difference would miss a layer changed
    # inside, or see a change where there is none and read the layout again each step.
    from torchpipe.module_reads import modules_in_order

    root = _module_trees()[name]
    assert [id(m) for m in modules_in_order(root)] == [id(m) for m in root.modules()]


def test_the_per_step_layer_walk_tells_modules_apart_by_identity():
    # modules() drops a module equal to one seen before (a set), and what is under it: an
    # in-place layer in there would go unseen, and its checkpointed input be overwritten.
    from torchpipe.module_reads import modules_in_order

    class AllEqual(nn.Sequential):
        def __eq__(self, other):
            return isinstance(other, AllEqual)

        def __hash__(self):
            return 0

    inner = AllEqual(nn.ReLU(inplace=True))
    root = nn.Sequential(AllEqual(inner))
    assert [id(m) for m in modules_in_order(root)] == [id(root), id(root[0]), id(inner), id(inner[0])]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("leaf_input", [True, False])
@pytest.mark.parametrize("balance", [[2], [1, 1]])
def test_a_model_that_starts_in_place_on_a_chunked_input(checkpoint, leaf_input, balance):
    """The micro-batches are views of one input and share its version counter: overwriting one
    in place must not invalidate what the others saved for backward."""
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(3, 3)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    source = x.clone().requires_grad_(not leaf_input)
    expected_source = x.clone().requires_grad_(not leaf_input)
    reference(expected_source * 1).sum().backward()
    with Pipe(model, balance, chunks=2, checkpoint=checkpoint) as pipe:
        pipe(source * 1 if not leaf_input else source).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    if not leaf_input:
        torch.testing.assert_close(source.grad, expected_source.grad, rtol=0, atol=0)


# Regression: chunks handed over with ``.data`` had version counters of their own, so an in-place
# first layer changed the caller's input behind autograd's back: a graph that had saved it gave
# wrong gradients instead of the plain model's error.
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_an_in_place_stage_never_changes_a_saved_input_behind_autograds_back(checkpoint):
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(8, 4)
    y = (x * w).sum()  # saves x for dy/dw
    expected = x.sum(0).clone()
    with Pipe(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4)), [1, 1], chunks=2, checkpoint=checkpoint) as pipe:
        pipe(x)
    try:
        y.backward()
    except RuntimeError as exc:  # what the plain model does: loud
        assert "modified by an inplace operation" in str(exc)
    else:
        torch.testing.assert_close(w.grad, expected)  # or the input was left unchanged


# Review: struct sequences (torch.return_types.*) came back as plain tuples whenever a
# micro-batch was rebuilt (checkpointing, chunks > 1, Pipe.step), so a layer reading .values failed.
@pytest.mark.parametrize("call", ["forward", "step"])
@pytest.mark.parametrize("checkpoint,chunks", [("always", 1), ("except_last", 3), ("never", 3)])
def test_a_struct_sequence_between_or_after_partitions_keeps_its_fields(call, checkpoint, chunks):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), Returns(lambda x: x.view(-1, 2, 3).max(dim=1)),
                          Returns(lambda m: m.values * 2), nn.Linear(3, 4), Returns(lambda x: x.max(dim=1))).double()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 4, dtype=torch.double)
    expected = reference(x)
    expected.values.sum().backward()
    with Pipe(model, [2, 3], chunks=chunks, checkpoint=checkpoint) as pipe:
        if call == "forward":
            out = pipe(x)
            assert type(out) is type(expected)
            torch.testing.assert_close(out.values, expected.values)
            torch.testing.assert_close(out.indices, expected.indices)
            out.values.sum().backward()
        else:
            pipe.step(x, None, lambda out, _: out.values.sum(), reduction="sum")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class ComplexLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, dtype=torch.complex128))

    def forward(self, x):
        return x @ self.weight


class HalveInPlace(nn.Module):
    inplace = True  # flagged like ReLU(inplace=True)

    def forward(self, x):
        return x.mul_(0.5)


# Review: the private copy for a partition that starts in place was made of floating-point
# tensors only, so a checkpointed complex partition was refused for changing its input.
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_complex_partition_that_starts_in_place_gets_its_private_copy(checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(ComplexLinear(), HalveInPlace(), ComplexLinear())
    reference = copy.deepcopy(model)
    x = torch.randn(6, 4, dtype=torch.complex128)
    expected = reference(x)
    expected.abs().sum().backward()
    with Pipe(model, [1, 2], chunks=2, checkpoint=checkpoint) as pipe:
        out = pipe(x)
        out.abs().sum().backward()
    torch.testing.assert_close(out, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class OverwritesWhatItSaved(nn.Module):
    """sigmoid saves its output for backward; doubling it in place afterwards is an error."""

    def forward(self, x):
        y = torch.sigmoid(x)
        y.mul_(2)
        return y


# Regression: saved-tensor hooks (Pipe.step's byte count, the checkpoint's recompute) turn off
# autograd's own version check, so these trained on the overwritten values without a word.
@pytest.mark.parametrize("call", ["forward", "gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_tensor_changed_in_place_after_it_was_saved_fails_backward_as_in_the_plain_model(call, checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), OverwritesWhatItSaved(), nn.Linear(4, 1)).double()
    x, target = torch.randn(6, 4, dtype=torch.double), torch.randn(6, 1, dtype=torch.double)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        nn.MSELoss()(copy.deepcopy(model)(x), target).backward()
    with Pipe(model, [2, 1], chunks=2, checkpoint=checkpoint) as pipe:
        with pytest.raises(RuntimeError, match=r"modified by an inplace operation: \[torch.DoubleTensor \[3, 4\]\].* "
                                               r"is at version 1; expected version 0 instead"):
            if call == "forward":
                nn.MSELoss()(pipe(x), target).backward()
            else:
                pipe.step(x, target, nn.MSELoss(), schedule=call)
        pipe[1].forward = lambda x: torch.sigmoid(x) * 2  # the same layer, written out of place
        reference = copy.deepcopy(model)
        for p in model.parameters():
            p.grad = None
        pipe.step(x, target, nn.MSELoss())
    nn.MSELoss()(reference(x), target).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def assert_trains_like_the_plain_model(model, balance, chunks, checkpoint, call, x, target):
    """``call`` ('forward' for pipe(x) + backward, else a step schedule) gives the plain model's gradients."""
    reference = copy.deepcopy(model)
    nn.MSELoss()(reference(x), target).backward()
    with Pipe(model, balance, chunks=chunks, checkpoint=checkpoint) as pipe:
        if call == "forward":
            nn.MSELoss()(pipe(x), target).backward()
        else:
            pipe.step(x, target, nn.MSELoss(), schedule=call)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class ChangesAnUnreadSave(nn.Module):
    """exp saves its result, which is then changed in place; backward never reaches that node."""

    def forward(self, h):
        aux = h.exp()
        aux.add_(1)
        self.last = aux.detach()
        return h * 2


# Review of the check above: the recompute checked every tensor it saved, also those backward
# never reads (autograd checks a saved tensor only when it is read).
@pytest.mark.parametrize("call", ["forward", "gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_saved_tensor_backward_never_reads_may_change_in_place(call, checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), ChangesAnUnreadSave(), nn.Linear(4, 1)).double()
    x, target = torch.randn(8, 4, dtype=torch.double), torch.randn(8, 1, dtype=torch.double)
    assert_trains_like_the_plain_model(model, [2, 1], 2, checkpoint, call, x, target)


# Review: a parameter changed between a checkpointed forward and its backward was recomputed
# at its new value, and backward used it without a word, where the plain model raises.
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_parameter_changed_between_forward_and_backward_fails_backward(checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x = torch.randn(8, 4)
    with Pipe(model, [2, 1], chunks=2, checkpoint=checkpoint) as pipe:
        out = pipe(x)
        with torch.no_grad():
            pipe[2].weight.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


class NormalisesItsWeightInPlace(nn.Linear):
    """Weight normalisation by hand: the forward changes its own weight before using it."""

    def forward(self, x):
        with torch.no_grad():
            self.weight.div_(self.weight.norm(dim=1, keepdim=True))
        return nn.functional.linear(x, self.weight, self.bias)


# Review (fuzz): the check above counted the recompute's replay of such a change as a change
# between forward and backward, and raised where the plain model trains.
@pytest.mark.parametrize("call", ["forward", "1f1b"])
def test_a_forward_that_changes_its_own_weight_first_is_recomputed_without_error(call):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), NormalisesItsWeightInPlace(4, 4), nn.Linear(4, 4)).double()
    x, target = torch.randn(6, 4, dtype=torch.double), torch.randn(6, 4, dtype=torch.double)
    assert_trains_like_the_plain_model(model, [1, 1, 1], 1, "always", call, x, target)


class ScalesItsNestedInputInPlace(nn.Module):
    def forward(self, value):
        h, (mask,) = value
        mask.mul_(2)
        return h * mask


# Review (fuzz): the check that a checkpointed partition left its input alone looked at the
# input tuple's own items only; one nested in it (an LSTM's state) was changed unseen, and
# the recompute started from the changed values: wrong gradients, no error.
@pytest.mark.parametrize("call", ["forward", "gpipe"])
def test_a_checkpointed_partition_that_changes_a_nested_input_in_place_is_refused(call):
    model = nn.Sequential(nn.Linear(4, 4), Returns(lambda h: (h, ((h.detach() > 0).double(),))),
                          ScalesItsNestedInputInPlace(), nn.Linear(4, 1)).double()
    x, target = torch.randn(6, 4, dtype=torch.double), torch.randn(6, 1, dtype=torch.double)
    with Pipe(model, [2, 2], chunks=2, checkpoint="always") as pipe:
        with pytest.raises(RuntimeError, match="partition 1 modified its input in place while being checkpointed"):
            if call == "forward":
                nn.MSELoss()(pipe(x), target).backward()
            else:
                pipe.step(x, target, nn.MSELoss(), schedule=call)


def test_a_layer_called_partitions_keeps_its_own_state_dict_keys():
    model = nn.Sequential(collections.OrderedDict(partitions=nn.Sequential(nn.Linear(4, 4)), out=nn.Linear(4, 4)))
    with Pipe(model, [1, 1]) as pipe:
        state = {key: value.clone() for key, value in pipe.state_dict().items()}
        assert "partitions.0.weight" in state
        pipe.load_state_dict(state)


@pytest.mark.parametrize("name", ["step", "chunks", "checkpoint", "close", "plan", "balance", "last_memory"])
def test_a_child_named_like_a_pipe_attribute_is_refused_by_name(name):
    model = nn.Sequential(collections.OrderedDict([("embed", nn.Linear(2, 2)), (name, nn.Linear(2, 2))]))
    before = {t for t in threading.enumerate() if t.name.startswith("torchpipe")}
    with pytest.raises(ValueError, match=rf"children named \['{name}'\], which are also attributes of Pipe"):
        Pipe(model, [1, 1])
    assert {t for t in threading.enumerate() if t.name.startswith("torchpipe")} == before


def test_no_grad_and_eval_mode():
    model = make_model(dropout=0.5)
    reference = copy.deepcopy(model).eval()
    x = torch.randn(10, 8)
    with Pipe(model, [5, 5, 5], chunks=4) as pipe:
        pipe.eval()
        with torch.no_grad():
            out = pipe(x)
        assert not out.requires_grad
        torch.testing.assert_close(out, reference(x))
        out = pipe(x)  # eval with grad: no dropout, no checkpointing needed
        assert out.requires_grad
        torch.testing.assert_close(out, reference(x))


def test_checkpoint_flags_and_recompute_only_for_checkpointed_microbatches():
    seen = []

    class Spy(nn.Module):
        def forward(self, x):
            seen.append((x.shape[0], is_checkpointing(), is_recomputing()))
            return torch.tanh(x)  # saves a tensor, so backward needs the recompute

    model = nn.Sequential(nn.Linear(4, 4), Spy())
    with Pipe(model, [1, 1], chunks=3, checkpoint="except_last") as pipe:
        out = pipe(torch.randn(6, 4))
        forward_calls = list(seen)
        out.sum().backward()
    assert sorted(forward_calls) == sorted([(2, True, False), (2, True, False), (2, False, False)])
    assert sorted(seen[len(forward_calls):]) == [(2, False, True), (2, False, True)]


@pytest.mark.parametrize("step", [False, True])
def test_every_checkpointed_forward_is_recomputed_to_the_partition_end(step):
    # torchgpipe's pattern: a layer hands a value from each checkpointed forward to its own
    # recompute through the flags. The layer saves nothing for backward, so a recompute that
    # stops once the last saved tensor is rebuilt would never reach it.
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.pending = []

        def forward(self, x):
            if is_recomputing():
                factor = self.pending.pop(0)
            else:
                factor = float(torch.randint(1, 4, ()).item())
                if is_checkpointing():
                    self.pending.append(factor)
            return x * factor

    scale = Scale()
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), scale)
    with Pipe(model, [2, 2], chunks=4, checkpoint="always") as pipe:
        for _ in range(3):
            x, y = torch.randn(8, 4), torch.randn(8, 4)
            if step:
                pipe.step(x, y, nn.MSELoss())
            else:
                pipe(x).sum().backward()
            assert scale.pending == []


class NestedSource(nn.Module):
    """``x -> (x without a graph, (linear(x),))``: the only tensor that carries a gradient is nested."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return x.detach(), (self.linear(x),)


class NestedMiddle(nn.Module):
    """Records its flags; with ``bias`` it saves nothing for backward (an add), without it it has
    no parameter and its only input that requires grad is nested."""

    def __init__(self, bias: bool):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4)) if bias else None
        self.flags = []

    def forward(self, batch):
        self.flags.append("checkpointing" if is_checkpointing() else "recomputing" if is_recomputing() else "plain")
        x, (h,) = batch
        if self.bias is not None:
            return x, (h + self.bias,)
        return x + torch.tanh(h)  # tanh saves its output: an activation the checkpoint drops


class NestedSink(nn.Module):
    def forward(self, batch):
        if isinstance(batch, torch.Tensor):
            return batch
        x, (h,) = batch
        return x + h


@pytest.mark.parametrize("step", [False, True])
@pytest.mark.parametrize("bias", [True, False], ids=["saves nothing", "no parameter"])
def test_a_partition_whose_only_gradient_is_nested_is_checkpointed_and_recomputed(step, bias):
    """Regression: the checks for "backward can reach this partition" looked at top-level
    tensors only. A partition whose only grad-carrying input or output sits in a nested tuple
    ran unpaired (checkpointed, never recomputed) or not checkpointed at all."""
    torch.manual_seed(0)
    middle = NestedMiddle(bias)
    model = nn.Sequential(NestedSource(), middle, NestedSink()).double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 4, dtype=torch.double), torch.randn(4, 4, dtype=torch.double)
    with Pipe(model, [1, 1, 1], chunks=2, checkpoint="always") as pipe:
        if step:
            loss = pipe.step(x, y, nn.MSELoss())
            expected = nn.MSELoss()(reference(x), y)
        else:
            loss = pipe(x).sum()
            loss.backward()
            expected = reference(x).sum()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert middle.flags == ["checkpointing"] * 2 + ["recomputing"] * 2
    for (name, param), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, want.grad, msg=name)


class PairedState(nn.Module):
    """Hands a token from each checkpointed forward to its recompute, as torchgpipe allows.

    ``body`` decides what the layer keeps for backward: nothing at all (``x * 2``, an
    identity) or a tensor (``sigmoid``).
    """

    def __init__(self, body):
        super().__init__()
        self.body = body
        self.pending = []
        self.checkpointed = self.recomputed = 0

    def forward(self, x):
        if is_checkpointing():
            self.checkpointed += 1
            self.pending.append("token")
        elif is_recomputing():
            self.recomputed += 1
            self.pending.pop()
        return self.body(x)


@pytest.mark.parametrize("body", [lambda x: x * 2, lambda x: x, torch.sigmoid], ids=["scale", "identity", "sigmoid"])
@pytest.mark.parametrize("input_grad", [True, False])
@pytest.mark.parametrize("how", ["forward", "gpipe", "1f1b"])
def test_a_partition_that_saves_nothing_is_still_recomputed_once_per_checkpointed_forward(body, input_grad, how):
    # torch's checkpoint recomputes when backward unpacks a saved tensor: a partition that
    # saves none was never recomputed, and PairedState's tokens piled up. A partition whose
    # input and parameters need no gradient records no graph at all: it is not checkpointed.
    layer = PairedState(body)
    model = nn.Sequential(layer, nn.Linear(4, 4))
    reference = copy.deepcopy(model)
    with Pipe(model, [1, 1], chunks=4, checkpoint="always") as pipe:
        for _ in range(2):
            x, y = torch.randn(8, 4, requires_grad=input_grad), torch.randn(8, 4)
            x_ref = x.detach().clone().requires_grad_(input_grad)
            if how == "forward":
                out = pipe(x)
                loss = nn.MSELoss()(out, y)
                loss.backward()
                out.add_(1)  # the output is the caller's to change, also behind an identity
            else:
                loss = pipe.step(x, y, nn.MSELoss(), schedule=how)
            expected = nn.MSELoss()(reference(x_ref), y)
            expected.backward()
            torch.testing.assert_close(loss.detach(), expected.detach())
            if input_grad:
                torch.testing.assert_close(x.grad, x_ref.grad)
    assert layer.pending == []
    assert layer.recomputed == layer.checkpointed == (8 if input_grad else 0)
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad)


class SplitInTwo(nn.Module):
    def forward(self, x):
        return x * 2, x * 3


class TakeSecond(nn.Module):
    def forward(self, pair):
        return pair[1]


@pytest.mark.parametrize("how", ["forward", "1f1b"])
def test_a_partition_that_saves_nothing_is_recomputed_when_backward_reaches_only_a_later_output(how):
    layer = PairedState(SplitInTwo())
    model = nn.Sequential(nn.Linear(4, 4), layer, TakeSecond(), nn.Linear(4, 4))
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    with Pipe(model, [1, 1, 2], chunks=4, checkpoint="always") as pipe:
        if how == "forward":
            nn.MSELoss()(pipe(x), y).backward()
        else:
            pipe.step(x, y, nn.MSELoss(), schedule=how)
    nn.MSELoss()(reference(x), y).backward()
    assert layer.pending == [] and layer.recomputed == layer.checkpointed == 4
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad)


class RecordDropout(nn.Dropout):
    """Dropout that records each output with the phase it ran in."""

    def __init__(self, p, log):
        super().__init__(p)
        self.log = log

    def forward(self, x):
        out = super().forward(x)
        self.log.append(("recompute" if is_recomputing() else "forward", x.shape[0], out.detach().clone()))
        return out


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_dropout_is_replayed_identically_on_recompute(checkpoint):
    # Four CPU partitions share one generator and draw concurrently; each recompute must
    # still see the masks of its own forward.
    logs = [[] for _ in range(4)]
    layers = []
    for log in logs:
        layers += [nn.Linear(64, 64), RecordDropout(0.5, log)]  # a trailing dropout is recomputed too
    model = nn.Sequential(*layers)
    x = torch.randn(64, 64)
    with Pipe(model, [2, 2, 2, 2], chunks=8, checkpoint=checkpoint) as pipe:
        for _ in range(5):
            for log in logs:
                log.clear()
            pipe(x).sum().backward()
            for log in logs:
                forward = [entry for entry in log if entry[0] == "forward"]
                recompute = [entry for entry in log if entry[0] == "recompute"]
                expected_recomputes = 8 if checkpoint == "always" else 7
                assert len(recompute) == expected_recomputes
                # Match each recompute with a forward of the same micro-batch (same order per partition).
                for (_, _, again) in recompute:
                    assert any(torch.equal(again, first) for (_, _, first) in forward)


def test_dropout_gradients_match_the_masks_the_forward_used():
    first_log, second_log = [], []
    model = nn.Sequential(
        nn.Linear(16, 16), RecordDropout(0.5, first_log), nn.Linear(16, 16), RecordDropout(0.5, second_log)
    )
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    with Pipe(model, [2, 2], chunks=2, checkpoint="always") as pipe:
        pipe(x).sum().backward()

    def forward_masks(log):
        return [entry[2] != 0 for entry in log if entry[0] == "forward"]

    # Rebuild the forward per micro-batch with the masks the pipeline's forward drew.
    for mb, chunk in enumerate(x.chunk(2)):
        h = reference[0](chunk) * forward_masks(first_log)[mb] * 2
        out = reference[2](h) * forward_masks(second_log)[mb] * 2
        out.sum().backward()
    for (name, p), (_, q) in zip(pipe.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


# Regression: a partition seen once not to draw (dropout at p=0, a warm-up schedule) was marked
# RNG-free for good, so once p was raised its checkpointed forwards saved no generator state
# and the recompute drew other masks: wrong gradients, no error.
@pytest.mark.parametrize("call", ["forward", "step"])
def test_dropout_raised_from_zero_between_steps_is_still_replayed(call):
    logs = [[], []]
    dropouts = [RecordDropout(0.0, log) for log in logs]
    model = nn.Sequential(dropouts[0], nn.Linear(16, 16), dropouts[1], nn.Linear(16, 16))
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    with Pipe(model, [2, 2], chunks=4, checkpoint="always") as pipe:
        for p in (0.0, 0.5):
            for dropout, log in zip(dropouts, logs):
                dropout.p = p
                log.clear()
            if call == "forward":
                pipe(x).sum().backward()
            else:
                pipe.step(x, y, nn.MSELoss())
        for log in logs:
            forward = [out for kind, _, out in log if kind == "forward"]
            recompute = [out for kind, _, out in log if kind == "recompute"]
            assert len(recompute) == 4 and any((out == 0).any() for out in forward)
            for again in recompute:
                assert any(torch.equal(again, first) for first in forward), "recompute drew another mask"


class DropoutOnSmallBatches(RecordDropout):
    """Draws only for micro-batches of fewer than 3 samples: RNG use that depends on the data."""

    def forward(self, x):
        return super().forward(x) if x.shape[0] < 3 else x * 1.0


@pytest.mark.parametrize("call", ["forward", "step"])
def test_dropout_on_some_micro_batches_only_is_still_replayed(call):
    """Micro-batch 0 draws nothing, which must not make the recompute of the last one skip its replay."""
    log = []
    # Dropout first: the recompute stops after the partition's last saved tensor.
    model = nn.Sequential(DropoutOnSmallBatches(0.5, log), nn.Linear(16, 16), nn.Linear(16, 16))
    x, y = torch.randn(10, 16), torch.randn(10, 16)  # 4 chunks: 3, 3, 3 and 1 samples
    with Pipe(model, [2, 1], chunks=4, checkpoint="always") as pipe:
        if call == "forward":
            pipe(x).sum().backward()
        else:
            pipe.step(x, y, nn.MSELoss())
    forward = [out for kind, _, out in log if kind == "forward"]
    recompute = [out for kind, _, out in log if kind == "recompute"]
    assert len(forward) == len(recompute) == 1 and (forward[0] == 0).any()
    assert torch.equal(recompute[0], forward[0]), "the recompute drew another mask"


class DrawsFromSecondMicroBatch(nn.Module):
    """Draws only from micro-batch 1 on (column 0 holds the micro-batch index): seen RNG-free first."""

    def forward(self, x):
        if x[0, 0] >= 1:
            return torch.cat([x[:, :1], x[:, 1:] * torch.rand_like(x[:, 1:])], 1)
        time.sleep(0.003)
        return x * 1.0


class DrawsAfterASleep(nn.Module):
    def forward(self, x):
        time.sleep(0.003)
        return torch.cat([x[:, :1], x[:, 1:] * torch.rand_like(x[:, 1:])], 1)


@pytest.fixture
def cpu_generator_relearns():
    """A replay error leaves the CPU generator always locked for the process: undo that here."""
    from torchpipe import checkpoint as checkpoint_module

    yield
    checkpoint_module._always_locked.discard(id(torch.default_generator))


# Regression: the second partition looked RNG-free on micro-batch 0, so later micro-batches ran
# without the generator lock and their draws interleaved with the first partition's: 26 steps in
# 30 had gradients from other numbers than the forward used, and nothing was raised.
def test_a_partition_that_starts_drawing_late_never_gives_wrong_gradients(cpu_generator_relearns):
    wrong, replay_errors = 0, 0
    with Pipe(nn.Sequential(DrawsAfterASleep(), DrawsFromSecondMicroBatch()), [1, 1], chunks=4, checkpoint="always") as pipe:
        for _ in range(30):
            x = torch.rand(8, 5) + 0.5
            x[:, 0] = torch.arange(4).repeat_interleave(2).float()
            for _attempt in range(2):  # a replay error asks for the step again
                x.grad = None
                x.requires_grad_()
                y = pipe(x)
                try:
                    y[:, 1:].sum().backward()
                    break
                except RNGReplayError as error:
                    replay_errors += 1
                    assert "run the step again" in str(error)
            # y = x * (the product of the numbers drawn for it), so dy/dx = y / x on those columns.
            if not torch.allclose(x.grad[:, 1:], y.detach()[:, 1:] / x.detach()[:, 1:], rtol=1e-4, atol=1e-5):
                wrong += 1
    assert wrong == 0
    assert replay_errors <= 1, "after one replay error the generator stays locked"


def test_a_thread_outside_the_pipeline_drawing_mid_forward_is_caught(cpu_generator_relearns):
    class DrawsBesideAnotherThread(nn.Module):
        def forward(self, x):
            if not is_recomputing():  # another thread draws between the forward's start and its draw
                drawer = threading.Thread(target=torch.rand, args=(3,))
                drawer.start()
                drawer.join()
            return x * torch.rand_like(x)

    x = torch.rand(4, 3, requires_grad=True)
    with Pipe(nn.Sequential(DrawsBesideAnotherThread()), [1], chunks=1, checkpoint="always") as pipe:
        y = pipe(x)
        with pytest.raises(RNGReplayError, match="partition 0: its recompute drew other random numbers"):
            y.sum().backward()
        # A recompute that draws exactly what its forward drew passes the same check.
        pipe[0].forward = lambda x: x * torch.rand_like(x)
        y = pipe(x)
        x.grad = None
        y.sum().backward()
        torch.testing.assert_close(x.grad, y.detach() / x.detach())


def test_sequential_like_access_and_names():
    model = make_model(depth=4)
    names = [name for name, _ in model.named_children()]
    keys = list(model.state_dict().keys())
    layers = list(model)
    with Pipe(model, [2, 2, 2], chunks=2) as pipe:
        assert len(pipe) == len(layers)
        assert pipe[0] is layers[0] and pipe[-1] is layers[-1]
        assert pipe[-len(layers)] is layers[0] and pipe[np.int64(1)] is layers[1]
        for index in (len(layers), -len(layers) - 1):
            with pytest.raises(IndexError, match=rf"index {index} is out of range for a Pipe of {len(layers)} layers"):
                pipe[index]
        with pytest.raises(TypeError):
            pipe["0"]
        assert list(pipe) == layers
        assert [name for name, _ in pipe.named_children()] == names
        assert list(pipe.state_dict().keys()) == keys
        assert pipe.balance == [2, 2, 2]
        assert pipe.chunks == 2 and pipe.checkpoint == "except_last"
        assert [len(p) for p in pipe.partitions] == [2, 2, 2]
        assert pipe.devices == [torch.device("cpu")] * 3
        nn.Sequential(*copy.deepcopy(layers)).load_state_dict(pipe.state_dict())


def test_copies_and_pickles_run_on_workers_of_their_own():
    """copy.deepcopy(pipe) (an EMA or best-model snapshot), pickle and torch.save work like torchgpipe's."""
    import io
    import pickle

    x = torch.randn(6, 8)
    with Pipe(make_model(), [3, 6], chunks=3) as pipe:
        expected = pipe(x)
        saved = io.BytesIO()
        torch.save(pipe, saved)
        saved.seek(0)
        copies = [copy.deepcopy(pipe), pickle.loads(pickle.dumps(pipe)), torch.load(saved, weights_only=False)]
    for twin in copies:
        with twin:
            assert twin[0] is not pipe[0] and twin._workers[0].thread is not pipe._workers[0].thread
            torch.testing.assert_close(twin(x), expected, rtol=0, atol=0)
            twin(x).sum().backward()
            assert pipe[0].weight.grad is None  # the copy's parameters are its own


def test_train_and_eval_reach_the_partition_containers():
    with Pipe(make_model(), [3, 6]) as pipe:
        pipe.eval()
        assert [p.training for p in pipe.partitions] == [False, False] and not pipe[0].training
        pipe.train()
        assert [p.training for p in pipe.partitions] == [True, True] and pipe[0].training


def test_a_slice_is_a_sequential_of_the_named_layers():
    model = make_model()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    with Pipe(model, [3, 6]) as pipe:
        head = pipe[:4]
        assert isinstance(head, nn.Sequential)
        assert [name for name, _ in head.named_children()] == ["0", "1", "2", "3"]
        assert head[0] is pipe[0] and pipe[-1] is pipe[len(pipe) - 1]
        torch.testing.assert_close(head(x), reference[:4](x))


def test_state_dicts_of_torchgpipe_and_fairscale_load():
    """Both keep the layers under 'partitions.<i>.<name>'; a Pipe keeps the model's own names."""
    from torchgpipe import GPipe

    source = make_model()
    gpipe = GPipe(copy.deepcopy(source), [3, 6], devices=["cpu", "cpu"], chunks=2)
    saved = gpipe.state_dict()
    assert next(iter(saved)).startswith("partitions.0.")
    with Pipe(make_model(), [4, 5]) as pipe:  # another balance: the names still line up
        pipe.load_state_dict(saved)
        for (name, tensor), (_, want) in zip(pipe.state_dict().items(), source.state_dict().items()):
            assert torch.equal(tensor, want), name
        wrapper = nn.Module()
        wrapper.pipe = pipe
        wrapper.load_state_dict({"pipe." + key: value for key, value in saved.items()})
        with pytest.raises(RuntimeError, match="Unexpected key"):
            pipe.load_state_dict({**source.state_dict(), "partitions.x.y": torch.zeros(1)})


def test_state_dicts_of_torchgpipe_with_deferred_batch_norm_load():
    # torchgpipe saves its DeferredBatchNorm's accumulators ('sum', 'sum_squares') as buffers.
    from torchgpipe import GPipe

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 3, 1))

    old = GPipe(model(), [2, 2], devices=["cpu"] * 2, chunks=2, deferred_batch_norm=True)
    old(torch.rand(4, 3, 4, 4)).sum().backward()
    saved = old.state_dict()
    assert "partitions.0.1.sum_squares" in saved
    with Pipe(model(), [2, 2], chunks=2, deferred_batch_norm=True) as pipe:
        pipe.load_state_dict(saved)
        assert torch.equal(pipe[1].running_mean, saved["partitions.0.1.running_mean"])
        assert "1.sum" not in pipe.state_dict()
        with pytest.raises(RuntimeError, match="Unexpected key.*1.other"):  # strict otherwise
            pipe.load_state_dict({**pipe.state_dict(), "1.other": torch.zeros(1)})
    # Review (s28): into a Pipe without deferred batch norm (to evaluate, say) it was refused for
    # the accumulators, which only carry a step's sums. Only those of a BatchNorm are dropped.
    with Pipe(model(), [3, 1]) as plain:
        plain.load_state_dict(saved)
        for name, value in plain.state_dict().items():
            assert torch.equal(value, saved[f"partitions.{0 if int(name[0]) < 2 else 1}.{name}"]), name
        with pytest.raises(RuntimeError, match=r'Unexpected key.*"0\.sum"'):  # a Conv2d has no such buffer
            plain.load_state_dict({**saved, "partitions.0.0.sum": torch.zeros(3)})


class _Noise(nn.Module):
    def forward(self, x):
        time.sleep(0.002)  # widens the window between the RNG snapshot and the draw
        return x * torch.rand_like(x)


def test_two_spellings_of_one_device_share_its_generator_lock():
    """'cpu' and 'cpu:0' are one generator: the recompute must redraw the same numbers."""
    with Pipe(nn.Sequential(_Noise(), _Noise()), [1, 1], devices=["cpu", "cpu:0"], chunks=8,
              checkpoint="always") as pipe:
        assert pipe.devices == [torch.device("cpu")] * 2
        for _ in range(3):
            x = (torch.rand(32, 4) + 0.5).requires_grad_()
            y = pipe(x)
            y.sum().backward()
            # y = x * r1 * r2, so dy/dx = y / x if the recompute drew r1 and r2 again.
            torch.testing.assert_close(x.grad, y.detach() / x.detach())
    linear = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    with Pipe(linear, [1, 1, 1, 1], devices=["cpu", "cpu:0", "cpu:1", "cpu"], chunks=4) as pipe:
        pipe.step(torch.randn(8, 4), torch.randn(8, 4), nn.MSELoss(), schedule="zb-v")


def test_moving_is_denied_but_dtype_casts_work():
    with Pipe(make_model(depth=2), [1, 2]) as pipe:
        moves = (lambda: pipe.cuda(), lambda: pipe.cpu(), lambda: pipe.to("cpu"), lambda: pipe.to(torch.device("cpu")),
                 lambda: pipe.to(device="cpu"), lambda: pipe.to_empty(device="meta"), lambda: pipe.xpu(),
                 lambda: pipe.mtia(), lambda: pipe.ipu())
        for move in moves:
            with pytest.raises(MovingDenied, match="Pipe should manage device placement"):
                move()
        assert {p.device.type for p in pipe.parameters()} == {"cpu"}
        pipe.to(torch.float64)
        assert pipe(torch.randn(3, 8, dtype=torch.float64)).dtype == torch.float64
        pipe.to(device=None, dtype=torch.float32)  # no move, as to(None, torch.float32): was refused
        assert pipe(torch.randn(3, 8)).dtype == torch.float32


def test_workers_are_created_once_and_reused():
    with Pipe(make_model(), [3, 3, 3], chunks=2) as pipe:
        threads = {w.thread.ident for w in pipe._workers}
        for _ in range(3):
            pipe(torch.randn(4, 8)).sum().backward()
        assert {w.thread.ident for w in pipe._workers} == threads
        assert len(threads) == 3


def test_every_partition_runs_on_its_own_thread_on_cpu():
    seen = {}

    class Where(nn.Module):
        def __init__(self, index):
            super().__init__()
            self.index = index

        def forward(self, x):
            import threading

            seen.setdefault(self.index, set()).add(threading.get_ident())
            return x

    model = nn.Sequential(*[Where(i) for i in range(4)])
    with Pipe(model, [1, 1, 1, 1], chunks=4) as pipe:
        pipe(torch.randn(8, 2))
    idents = [next(iter(seen[i])) for i in range(4)]
    assert all(len(seen[i]) == 1 for i in range(4))
    assert len(set(idents)) == 4


def test_step_record_and_chrome_trace(tmp_path):
    with Pipe(make_model(), [3, 3, 3], chunks=4) as pipe:
        pipe(torch.randn(8, 8))
        record = pipe.last_step
        assert len(record.labels) == 12
        assert "stage 2 F mb 3" in record.labels
        assert 0.0 <= record.bubble_ratio < 1.0
        trace = record.chrome_trace()
        # (Events of category "wait" are waits for a generator's lock inside a job: a first
        # checkpointed forward takes it to learn whether its partition draws.)
        names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") != "wait"}
        assert names == set(record.labels)
        path = tmp_path / "step.json"
        record.save_chrome_trace(str(path))
        assert path.stat().st_size > 0


@pytest.mark.parametrize("schedule,options", [("interleaved-1f1b", {"virtual_stages": 2}), ("zb-v", {})])
def test_step_trace_has_a_track_per_plan_worker_and_matches_the_plan_trace(schedule, options):
    # 4 partitions on 2 plan workers: the threads of partitions 2 and 3 run nothing.
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    with Pipe(model, [1, 1, 1, 1], devices=["cpu"] * 4, chunks=4) as pipe:
        pipe.step(torch.randn(8, 4), torch.randn(8, 4), nn.MSELoss(), schedule=schedule, **options)
        plan = pipe.plan(4, schedule, **options)
        trace = json.loads(json.dumps(pipe.last_step.chrome_trace()))
    tracks = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") != "wait"]  # waits: nested
    assert sorted(tracks) == sorted({e["tid"] for e in spans}) == [0, 1]
    for w, actions in enumerate(plan.worker_actions):
        stages = sorted({a.stage for a in actions})
        assert tracks[w].endswith(f"(stages {', '.join(map(str, stages))})"), tracks[w]
    planned = {e["args"]["action"]: e for e in plan.chrome_trace()["traceEvents"]}
    assert sorted(planned) == sorted(e["args"]["action"] for e in spans)
    for e in spans:
        twin = planned[e["args"]["action"]]
        assert (e["cat"], e["tid"], e["args"]) == (twin["cat"], twin["tid"], twin["args"])
        assert e["name"] == f"stage {twin['args']['stage']} {twin['cat']} mb {twin['args']['microbatch']}"


def test_a_trace_track_names_the_stage_a_plan_placed_on_another_worker():
    # Worker threads are named after their partition: with stage 1 on worker 0, the track read
    # "torchpipe-stage-0" for stage 1's actions.
    from torchpipe.schedule import Plan

    plan = Plan.from_lists("swapped", [["1F0", "1B0", "1F1", "1B1"], ["0F0", "0F1", "0B0", "0B1"]])
    with Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], devices=["cpu"] * 2, chunks=2) as pipe:
        pipe.step(torch.randn(4, 4), torch.randn(4, 4), nn.MSELoss(), schedule=plan)
        trace = pipe.last_step.chrome_trace()
    tracks = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert tracks == {0: "torchpipe-stage-0 (stage 1)", 1: "torchpipe-stage-1 (stage 0)"}


def test_the_forward_program_keeps_the_outputs_in_micro_batch_order_and_refuses_a_plan_that_would_not():
    # Pipe's forward reads the outputs by position (Runtime.run_kept), not sorted by key.
    from torchpipe.lowering import lower_forward
    from torchpipe.schedule import Plan

    with Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], devices=["cpu"] * 2, chunks=3) as pipe:
        program = pipe._forward_program(3)[1]
        assert [key.microbatch for key, _ in program.kept] == [0, 1, 2]
        x = torch.randn(6, 4)
        assert torch.equal(pipe(x), pipe[:](x))
        reversed_outputs = Plan.from_lists("reversed", [["0F0", "0F1"], ["1F1", "1F0"]])
        with pytest.raises(ValueError, match=r"last stage's forwards in micro-batch order, got \[1, 0\]"):
            lower_forward(reversed_outputs, pipe._stages)
        with pytest.raises(ValueError, match="got a B action .*expected a forward-only plan"):
            lower_forward(pipe.plan(2, "1f1b"), pipe._stages)


def test_profiler_sees_labelled_tasks_from_worker_threads():
    with Pipe(make_model(), [3, 3, 3], chunks=2) as pipe:
        with torchpipe.profiling.profile() as prof:
            pipe(torch.randn(4, 8)).sum().backward()
    names = {event.name for event in prof.events()}
    assert "stage 0 F mb 0" in names and "stage 2 F mb 1" in names


@pytest.mark.parametrize("activities, error, words", [
    ("cpu", TypeError, r"activities must be a list of torch\.profiler\.ProfilerActivity .*got str: 'cpu'"),
    (["cpu"], TypeError, r"ProfilerActivity members .*got 'cpu'"),
    ([], ValueError, "at least one torch.profiler.ProfilerActivity"),
])
def test_profiler_activities_of_the_wrong_kind_are_named(activities, error, words):
    # Review: torch answered these with a bare AssertionError ("No valid profiler activities found").
    with pytest.raises(error, match=words):
        torchpipe.profiling.profile(activities=activities)


def test_profiler_activities_may_be_any_iterable_read_once():
    cpu = torch.profiler.ProfilerActivity.CPU
    with Pipe(make_model(), [3, 3, 3], chunks=2) as pipe:
        with torchpipe.profiling.profile(activities=(a for a in [cpu])) as prof:
            pipe(torch.randn(4, 8)).sum().backward()
    assert "stage 2 F mb 1" in {event.name for event in prof.events()}


@pytest.mark.parametrize("profiler", [torch.profiler.profile, torch.autograd.profiler.profile])
def test_a_profiler_that_records_the_caller_only_is_named_once(monkeypatch, profiler):
    # A plain profiler drops every event of the worker threads; the user is told what records them.
    monkeypatch.setattr(torchpipe.thread_state, "_warned_profiler_misses_workers", False)
    with Pipe(make_model(), [3, 3, 3], chunks=2) as pipe:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with profiler():
                pipe(torch.randn(4, 8)).sum().backward()
                pipe.step(torch.randn(4, 8), torch.randn(4, 8), nn.MSELoss())
    told = [w for w in caught if "records only the thread that started it" in str(w.message)]
    assert len(told) == 1, [str(w.message) for w in caught]
    assert "torchpipe.profiling.profile" in str(told[0].message)
    assert told[0].filename == __file__  # points at the call, not into torchpipe or torch


def test_the_profiler_warning_as_an_error_changes_nothing(monkeypatch):
    # Under -W error the warning is an exception: raised before the step touched the Pipe.
    monkeypatch.setattr(torchpipe.thread_state, "_warned_profiler_misses_workers", False)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with Pipe(make_model(), [3, 3, 3], chunks=2) as pipe:
        pipe.step(x, y, nn.MSELoss(), schedule="1f1b")
        record, memory = pipe.last_step, pipe.last_memory
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.profiler.profile():
                with pytest.raises(UserWarning, match="records only the thread that started it"):
                    pipe.step(x, y, nn.MSELoss(), schedule="gpipe")
        assert pipe.last_step is record and pipe.last_memory is memory
        assert pipe.last_report().schedule == "1f1b"


def test_the_profiler_warning_points_past_torchs_wrappers_and_covers_host_tasks(monkeypatch):
    model = make_model()
    with Pipe(model, [3, 3, 3], chunks=2) as pipe, torchpipe.HostPool(1) as pool:
        for call in ("checkpoint", "host task"):
            monkeypatch.setattr(torchpipe.thread_state, "_warned_profiler_misses_workers", False)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.profiler.profile():
                    if call == "checkpoint":
                        torch.utils.checkpoint.checkpoint(pipe, torch.randn(4, 8), use_reentrant=False)
                    else:
                        pool.submit(torch.ones, 2).result()
            told = [w for w in caught if "records only the thread" in str(w.message)]
            assert [(w.filename, call) for w in told] == [(__file__, call)]


def test_no_profiler_warning_when_every_thread_is_recorded_or_none_is(monkeypatch):
    monkeypatch.setattr(torchpipe.thread_state, "_warned_profiler_misses_workers", False)
    with Pipe(make_model(), [3, 3, 3], chunks=2) as pipe:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe(torch.randn(4, 8)).sum().backward()
            with torchpipe.profiling.profile() as prof:
                pipe(torch.randn(4, 8)).sum().backward()
    assert not [w for w in caught if "profiler" in str(w.message)], [str(w.message) for w in caught]
    assert "stage 2 F mb 1" in {event.name for event in prof.events()}


class _CountingHooks:
    """A saved_tensors_hooks pair that counts what it packs and unpacks, from any thread."""

    def __init__(self):
        self.packed = self.unpacked = 0
        self.lock = threading.Lock()

    def pack(self, tensor):
        with self.lock:
            self.packed += 1
        return ("packed", tensor)

    def unpack(self, packed):
        with self.lock:
            self.unpacked += 1
        return packed[1]

    def __call__(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


# Regression: the caller's saved-tensor hooks (save_on_cpu, say) are thread-local and did not
# reach the workers, so a Pipe silently kept every activation where it was.
def test_saved_tensor_hooks_of_the_caller_reach_the_workers():
    model = make_model()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    plain = _CountingHooks()
    with plain():
        nn.MSELoss()(copy.deepcopy(model)(x), y).backward()
    assert plain.packed > 0 and plain.unpacked == plain.packed
    with Pipe(model, [3, 3, 3], chunks=1, checkpoint="never") as pipe:
        for call in ("forward", "step"):
            hooks = _CountingHooks()
            with hooks():
                if call == "forward":
                    nn.MSELoss()(pipe(x), y).backward()
                else:
                    pipe.step(x, y, nn.MSELoss())
            assert (call, hooks.packed, hooks.unpacked) == (call, plain.packed, plain.packed)
        with torch.autograd.graph.save_on_cpu():
            loss = pipe.step(x, y, nn.MSELoss())
        torch.testing.assert_close(loss, nn.MSELoss()(model(x), y).detach())


def test_autocast_state_reaches_workers():
    with Pipe(make_model(), [3, 3, 3], chunks=2) as pipe:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = pipe(torch.randn(4, 8))
        assert out.dtype == torch.bfloat16
        assert pipe(torch.randn(4, 8)).dtype == torch.float32


def test_profile_takes_every_keyword_of_torch_profiler():
    """An experimental_config of the user's own crashed (torch's config is read-only)."""
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with Pipe(make_model(), [3, 3, 3], chunks=2) as pipe:
        with torchpipe.profiling.profile(experimental_config=config, record_shapes=True) as prof:
            pipe(torch.randn(4, 8)).sum().backward()
    assert "stage 1 F mb 1" in {event.name for event in prof.events()}


class _SelfAttention(nn.Module):
    def forward(self, x):
        return torch.nn.functional.scaled_dot_product_attention(x, x, x)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_pipe_step_under_autocast_follows_the_amp_recipe(schedule, checkpoint):
    """Forward (and loss) under autocast, backward outside it, as ``loss.backward()`` after the
    autocast block: the backward actions ran under the caller's autocast, and attention's
    backward then gave other bf16 gradients (0.3 % off)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _SelfAttention(), nn.Linear(8, 4))
    reference = copy.deepcopy(model)
    x, y = torch.randn(2, 5, 8), torch.randn(2, 5, 4)

    def loss_fn(out, target):
        return nn.functional.mse_loss(out.float(), target)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = loss_fn(reference(x), y)
    expected.backward()
    with Pipe(model, [1, 2], devices=["cpu", "cpu"], chunks=1, checkpoint=checkpoint) as pipe:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = pipe.step(x, y, loss_fn, schedule=schedule)
    assert torch.equal(loss, expected.detach())
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(got.grad, want.grad), name


class _ToDtype(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)  # a head that emits its own low-precision dtype


@pytest.mark.parametrize("autocast_dtype,output_dtype", [(torch.bfloat16, torch.float16),
                                                         (torch.float16, torch.bfloat16)])
def test_outputs_and_losses_of_another_low_precision_dtype_join_under_autocast(autocast_dtype, output_dtype):
    """Review (s33): the micro-batch outputs were joined (torch.cat) and the losses totalled
    (torch.stack) under the caller's autocast, where torch fails on an fp16 tensor under bf16
    autocast ("Unexpected floating ScalarType"): the plain model joins nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _ToDtype(output_dtype))
    x, y = torch.randn(4, 8), torch.randn(4, 8)

    def loss_fn(out, target):
        return nn.functional.mse_loss(out.float(), target).to(output_dtype)  # a loss kept in low precision

    with torch.autocast("cpu", dtype=autocast_dtype):
        expected = model(x)
        expected_halves = [loss_fn(model(part), target) for part, target in zip(x.chunk(2), y.chunk(2))]
    expected_loss = torch.stack(expected_halves).float().mean().to(output_dtype)
    with Pipe(model, [1, 1], devices=["cpu", "cpu"], chunks=2, checkpoint="never") as pipe:
        with torch.autocast("cpu", dtype=autocast_dtype):
            out = pipe(x)
            loss, stepped = pipe.step(x, y, loss_fn, return_outputs=True)
            evaluated_loss, evaluated = pipe.evaluate(x, y, loss_fn, return_outputs=True)
    for got in (out, stepped, evaluated):
        assert got.dtype == output_dtype and torch.equal(got, expected.detach())
    for got in (loss, evaluated_loss):
        assert got.dtype == output_dtype
        torch.testing.assert_close(got.float(), expected_loss.float(), rtol=1e-2, atol=0)


class _AutocastInBackward(torch.autograd.Function):
    """``x @ w.T`` whose backward opens ``torch.autocast('cpu')`` without a dtype: the thread's
    default dtype then decides how the gradients are computed."""

    seen = []

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        with torch.autocast("cpu"):
            _AutocastInBackward.seen.append((torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled()))
            return (grad @ w).float(), (grad.flatten(0, -2).t() @ x.flatten(0, -2)).float()


class _AutocastInBackwardLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return _AutocastInBackward.apply(x, self.weight)


def test_backward_runs_with_the_thread_defaults_of_autocast_as_after_the_recipes_block():
    """Review (s33): step's backward actions turned autocast off inside the forward's autocast,
    so its dtype (fp16) and cache flag (off) stayed; after the recipe's block a backward sees the
    defaults (bf16, cache on). A backward into the input's own graph (an encoder in front of the
    Pipe) ran under the caller's autocast itself; attention's backward then casts otherwise."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(8, 8), _SelfAttention())
    model = nn.Sequential(_AutocastInBackwardLinear(), _AutocastInBackwardLinear())
    reference_encoder, reference = copy.deepcopy(encoder), copy.deepcopy(model)
    x = torch.randn(2, 5, 8)

    def loss_fn(out, target):
        return out.float().pow(2).sum()

    _AutocastInBackward.seen.clear()
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        expected = loss_fn(reference(reference_encoder(x)), None)
    expected.backward()
    assert _AutocastInBackward.seen == [(torch.bfloat16, True)] * 2
    _AutocastInBackward.seen.clear()
    with Pipe(model, [1, 1], devices=["cpu", "cpu"], chunks=1, checkpoint="never",
              intra_op_threads=torch.get_num_threads()) as pipe:
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = pipe.step(encoder(x), None, loss_fn, schedule="1f1b")
    assert _AutocastInBackward.seen == [(torch.bfloat16, True)] * 2
    assert torch.equal(loss, expected.detach())
    for (name, got), want in zip([*encoder.named_parameters(), *model.named_parameters()],
                                 [*reference_encoder.parameters(), *reference.parameters()]):
        assert torch.equal(got.grad, want.grad), name
