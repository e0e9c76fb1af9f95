"""Pipe.step's inputs and targets: graphs built before the step, and how targets weigh micro-batches."""
import copy
import functools
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from torchpipe import Pipe

SCHEDULES = [("gpipe", {}, [2, 2]), ("1f1b", {}, [2, 2]), ("zb-h1", {}, [1, 3]),
             ("interleaved-1f1b", {"virtual_stages": 2}, [1, 1, 1, 1]), ("zb-v", {}, [1, 1, 1, 1])]


class CountBackward(torch.autograd.Function):
    """Identity that counts how often autograd runs its backward."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        CountBackward.calls += 1
        return grad


def body():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))


def assert_same_grads(modules, references):
    for module, reference in zip(modules, references):
        for (name, param), expected in zip(module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-6, msg=name)


# Regression: an input or target computed by trainable modules before the step was
# back-propagated into once per micro-batch, so the second micro-batch found the upstream
# graph's buffers freed ("backward through the graph a second time") and the first one's
# gradients stayed on the upstream parameters.
@pytest.mark.parametrize("schedule,options,balance", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_an_input_and_target_from_trainable_modules_get_the_plain_gradients_once(schedule, options, balance,
                                                                                 checkpoint, chunks):
    torch.manual_seed(0)
    encoder, other, model = nn.Linear(4, 4), nn.Linear(4, 2), body()
    references = [copy.deepcopy(m) for m in (encoder, other, model)]
    x = torch.randn(7, 4)

    hidden = references[0](x)
    expected = nn.MSELoss()(references[2](hidden), references[1](x) + hidden[:, :2])
    expected.backward()

    CountBackward.calls = 0
    with Pipe(model, balance, chunks=chunks, checkpoint=checkpoint) as pipe:
        hidden = CountBackward.apply(encoder(x))
        loss = pipe.step(hidden, other(x) + hidden[:, :2], nn.MSELoss(), schedule=schedule, **options)
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads((encoder, other, model), references)
    assert CountBackward.calls == 1, "the graph before the step was walked once per micro-batch"


def test_one_upstream_tensor_used_twice_in_a_tuple_input_gets_both_gradients():
    class TakeTwo(nn.Module):
        def forward(self, pair):
            a, b = pair
            return a * 2 + b.tanh()

    encoder, model = nn.Linear(3, 3), nn.Sequential(TakeTwo(), nn.Linear(3, 2))
    ref_encoder, ref_model = copy.deepcopy(encoder), copy.deepcopy(model)
    x, y = torch.randn(6, 3), torch.randn(6, 2)
    h = ref_encoder(x)
    nn.MSELoss()(ref_model((h, h)), y).backward()
    with Pipe(model, [1, 1], chunks=2) as pipe:
        h = encoder(x)
        pipe.step((h, h), y, nn.MSELoss())
    assert_same_grads((encoder, model), (ref_encoder, ref_model))


def test_a_failed_step_sends_nothing_into_the_graph_before_it():
    encoder, model = nn.Linear(4, 4), body()
    x = torch.randn(8, 4)
    with Pipe(model, [2, 2], chunks=4) as pipe:
        bad_target = torch.randn(8, 3)  # the output has 2 features: MSELoss fails in the first micro-batch
        with pytest.raises(RuntimeError), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # MSELoss warns about the broadcast before failing
            pipe.step(encoder(x), bad_target, nn.MSELoss())
        assert encoder.weight.grad is None and encoder.bias.grad is None
        pipe.step(encoder(x), torch.randn(8, 2), nn.MSELoss())  # and the next step works
    assert encoder.weight.grad is not None



class FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ArithmeticError("the encoder's backward failed")


def test_a_failure_in_the_backward_into_the_input_leaves_what_the_plain_model_leaves():
    """The guide: when the backward into the input's own graph raises, the Pipe's gradients
    stay, as after the plain model's ``loss.backward()`` failing in its encoder, and the
    error reaches the caller with its type; the step's record says it failed."""
    torch.manual_seed(0)
    encoder, model = nn.Linear(4, 4), body()
    ref_encoder, ref_model = copy.deepcopy(encoder), copy.deepcopy(model)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with pytest.raises(ArithmeticError):
        nn.MSELoss()(ref_model(FailsInBackward.apply(ref_encoder(x))), y).backward()
    with Pipe(model, [2, 2], chunks=4) as pipe:
        with pytest.raises(ArithmeticError, match="encoder's backward failed"):
            pipe.step(FailsInBackward.apply(encoder(x)), y, nn.MSELoss())
        assert pipe.last_step.error is not None and "ArithmeticError" in pipe.last_step.error
    assert encoder.weight.grad is None and ref_encoder.weight.grad is None
    for param, expected in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-6)

# Regression: uint8 class indices (torch's losses take them) indexed the class weights as a
# boolean mask: a wrong micro-batch weighting (loss and gradients off by about 1 %) or an
# IndexError, depending on the labels.
@pytest.mark.parametrize("labels", [[3, 3, 3, 3, 1, 1, 2, 2], [0, 3, 3, 3, 1, 1, 0, 2]])
@pytest.mark.parametrize("loss_class", [nn.CrossEntropyLoss, nn.NLLLoss])
def test_uint8_class_indices_with_class_weights_weigh_micro_batches_like_long_ones(labels, loss_class):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.LogSoftmax(dim=1))
    reference = copy.deepcopy(model)
    loss_fn = loss_class(weight=torch.tensor([1.0, 2.0, 3.0, 4.0]))
    x = torch.randn(8, 4)
    target = torch.tensor(labels, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates uint8 targets but takes them
        expected = loss_fn(reference(x), target.long())
        expected.backward()
        with Pipe(model, [2, 2], chunks=2) as pipe:
            loss = pipe.step(x, target, loss_fn)
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads((model,), (reference,))


@pytest.mark.parametrize("schedule,options,balance", SCHEDULES[:3])
def test_losses_receives_each_micro_batch_loss_like_torch_pipelining(schedule, options, balance):
    torch.manual_seed(0)
    model = body()
    reference = copy.deepcopy(model)
    x, y = torch.randn(7, 4), torch.randn(7, 2)  # micro-batches of 3, 3 and 1
    losses = ["left from before"]
    with Pipe(model, balance, chunks=3) as pipe:
        total = pipe.step(x, y, nn.MSELoss(), schedule=schedule, losses=losses, **options)
    expected = [nn.MSELoss()(reference(xs), ys) for xs, ys in zip(x.chunk(3), y.chunk(3))]
    assert len(losses) == 3 and all(not loss.requires_grad for loss in losses)
    for got, want in zip(losses, expected):
        torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close(total, sum(l * n / 7 for l, n in zip(losses, (3, 3, 1))))


def test_losses_is_left_alone_by_a_failed_step_and_must_be_a_list():
    model = body()
    losses = ["kept"]
    with Pipe(model, [2, 2], chunks=2) as pipe:
        with pytest.raises(TypeError, match=r"losses must be a list to fill with each micro-batch's loss, or None; "
                                            r"got \(\)"):
            pipe.step(torch.randn(4, 4), torch.randn(4, 2), nn.MSELoss(), losses=())
        with pytest.raises(RuntimeError), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe.step(torch.randn(4, 4), torch.randn(4, 3), nn.MSELoss(), losses=losses)
    assert losses == ["kept"]
    assert all(p.grad is None for p in model.parameters())


# Regression: a keyword Pipe.step does not know (an input keyword) was blamed on the schedule ("schedule '1f1b' does not take option(s)").
@pytest.mark.parametrize("schedule, takes", [("1f1b", "no options"), ("interleaved-1f1b", r"\['virtual_stages'\]")])
def test_an_unknown_keyword_names_step_own_keywords_and_the_schedules_options(schedule, takes):
    with Pipe(body(), [1, 1, 1, 1], chunks=2) as pipe:
        with pytest.raises(TypeError, match=r"Pipe.step got unexpected keyword argument\(s\) \['attention_mask'\]: "
                                            r"its own are reduction, return_outputs, losses and loss_kwargs, and schedule "
                                            rf"'{schedule}' takes {takes}"):
            pipe.step(torch.randn(4, 4), torch.randn(4, 2), nn.MSELoss(), schedule=schedule,
                      attention_mask=torch.ones(4))
        assert all(p.grad is None for p in pipe.parameters())


def test_kl_divergence_with_batchmean_weighs_micro_batches_by_samples():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3), nn.LogSoftmax(dim=1))
    reference = copy.deepcopy(model)
    loss_fn = nn.KLDivLoss(reduction="batchmean")
    x, y = torch.randn(7, 4), torch.softmax(torch.randn(7, 3), dim=1)
    expected = loss_fn(reference(x), y)
    expected.backward()
    with Pipe(model, [2, 2], chunks=3) as pipe:
        loss = pipe.step(x, y, loss_fn)
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads((model,), (reference,))


@pytest.mark.parametrize("schedule,options,balance", SCHEDULES[1:3])
def test_a_model_that_computes_its_own_loss_takes_target_none(schedule, options, balance):
    class MeanSquare(nn.Module):  # the last layer is the loss: one value per sample
        def forward(self, x):
            return x.pow(2).mean(dim=1)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2), MeanSquare())
    reference = copy.deepcopy(model)
    x = torch.randn(7, 4)
    expected = reference(x).mean()
    expected.backward()
    seen = []

    def loss_fn(per_sample, target):
        seen.append(target)
        return per_sample.mean()

    with Pipe(model, balance, chunks=3) as pipe:
        loss = pipe.step(x, None, loss_fn, schedule=schedule, **options)
    assert seen == [None] * 3
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads((model,), (reference,))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_loss_kwargs_reach_every_micro_batchs_loss_and_a_reduction_in_them_counts(schedule):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(7, 4), torch.randint(0, 3, (7,))
    for loss_kwargs in ({"label_smoothing": 0.2}, {"label_smoothing": 0.2, "reduction": "sum"}):
        reference = copy.deepcopy(model)
        expected = F.cross_entropy(reference(x), y, **loss_kwargs)
        expected.backward()
        with Pipe(copy.deepcopy(model), [2, 1], chunks=3) as pipe:
            each: list = []
            loss = pipe.step(x, y, F.cross_entropy, schedule=schedule, losses=each, loss_kwargs=loss_kwargs)
            torch.testing.assert_close(loss, expected.detach())
            assert_same_grads((pipe,), (reference,))
            for part, x_part, y_part in zip(each, x.chunk(3), y.chunk(3)):
                torch.testing.assert_close(part, F.cross_entropy(reference(x_part), y_part, **loss_kwargs))


@pytest.mark.parametrize("loss_kwargs", [[("label_smoothing", 0.1)], {1: 0.1}, "label_smoothing"])
def test_loss_kwargs_that_are_not_a_dict_of_names_are_refused_before_anything_runs(loss_kwargs):
    with Pipe(body(), [1, 1, 1, 1], chunks=2) as pipe:
        with pytest.raises(TypeError, match="loss_kwargs must be a dict of keyword arguments for loss_fn"):
            pipe.step(torch.randn(4, 4), torch.randn(4, 2), nn.MSELoss(), loss_kwargs=loss_kwargs)
        assert pipe.last_step is None and all(p.grad is None for p in pipe.parameters())


# Regression (review): the functional cross-entropy's ignore_index and class weights came
# through loss_kwargs but the micro-batches were weighted by samples (NaN with a fully padded one).
_WEIGHT = torch.tensor([0.1, 1.0, 5.0])


@pytest.mark.parametrize("loss_fn, loss_kwargs", [
    (F.cross_entropy, {}), (F.nll_loss, {}),  # the default ignore_index, -100
    (F.cross_entropy, {"ignore_index": 0}), (F.nll_loss, {"ignore_index": 0}),
    (F.cross_entropy, {"weight": _WEIGHT}), (F.nll_loss, {"weight": _WEIGHT}),
    (F.cross_entropy, {"ignore_index": 0, "weight": _WEIGHT, "label_smoothing": 0.2}),
], ids=["ce", "nll", "ce-ignore", "nll-ignore", "ce-weight", "nll-weight", "ce-all"])
def test_functional_class_index_losses_weigh_micro_batches_by_their_counted_targets(loss_fn, loss_kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3), nn.LogSoftmax(dim=1))
    x = torch.randn(8, 4)
    y = torch.tensor([-100, -100, 2, 1, 0, 0, 1, 0]) if not loss_kwargs else torch.tensor([0, 0, 2, 1, 0, 0, 1, 0])
    reference = copy.deepcopy(model)
    expected = loss_fn(reference(x), y, **loss_kwargs)
    expected.backward()
    with Pipe(copy.deepcopy(model), [2, 2], chunks=4) as pipe:
        loss = pipe.step(x, y, loss_fn, loss_kwargs=loss_kwargs)
        torch.testing.assert_close(loss, expected.detach())
        assert_same_grads((pipe,), (reference,))
        pipe.eval()
        torch.testing.assert_close(pipe.evaluate(x, y, loss_fn, loss_kwargs=loss_kwargs), expected.detach())


# Regression (review): a wrapped loss hid its settings. torch.compile(nn.CrossEntropyLoss())
# was weighted by samples, not by its counted targets (padding skewed the loss by 2 %, the
# gradients by 0.2), and partial(F.cross_entropy, reduction='sum') was weighted as a mean.
@pytest.mark.parametrize("wrapped", [
    "compiled module", "compiled function", "partial", "partial sum", "compiled partial sum", "partial then kwargs",
    "compiled twice", "compiled forward sum", "bound call",
])
def test_a_compiled_or_partial_loss_weighs_micro_batches_as_the_loss_inside(wrapped):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(10, 4, dtype=torch.float64)
    y = torch.tensor([-100, -100, -100, 1, 0, 2, 1, 0, 2, 2])  # padding in micro-batch 0 of 3
    compiled = functools.partial(torch.compile, backend="eager")
    loss_fn, loss_kwargs, plain = {
        "compiled module": (compiled(nn.CrossEntropyLoss()), None, nn.CrossEntropyLoss()),
        "compiled function": (compiled(F.cross_entropy), None, F.cross_entropy),
        "partial": (functools.partial(F.cross_entropy, label_smoothing=0.1), None,
                    functools.partial(F.cross_entropy, label_smoothing=0.1)),
        "partial sum": (functools.partial(F.cross_entropy, reduction="sum"), None,
                        functools.partial(F.cross_entropy, reduction="sum")),
        "compiled partial sum": (compiled(functools.partial(F.cross_entropy, reduction="sum")), None,
                                 functools.partial(F.cross_entropy, reduction="sum")),
        # loss_kwargs come after the partial's keywords, as partial itself merges them
        "partial then kwargs": (functools.partial(F.cross_entropy, reduction="sum"), {"reduction": "mean"},
                                F.cross_entropy),
        "compiled twice": (compiled(compiled(nn.CrossEntropyLoss())), None, nn.CrossEntropyLoss()),
        "compiled forward sum": (compiled(nn.CrossEntropyLoss(reduction="sum").forward), None,
                                 nn.CrossEntropyLoss(reduction="sum")),
        "bound call": (nn.CrossEntropyLoss().__call__, None, nn.CrossEntropyLoss()),
    }[wrapped]
    reference = copy.deepcopy(model)
    expected = plain(reference(x), y)
    expected.backward()
    with Pipe(copy.deepcopy(model), [2, 1], chunks=3) as pipe:
        loss = pipe.step(x, y, loss_fn, loss_kwargs=loss_kwargs)
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
        assert_same_grads((pipe,), (reference,))
        torch.testing.assert_close(pipe.evaluate(x, y, loss_fn, loss_kwargs=loss_kwargs), expected.detach(),
                                   rtol=1e-12, atol=1e-12)


def test_a_partial_that_reduces_per_element_is_refused_naming_the_partial():
    with Pipe(body(), [1, 1, 1, 1], chunks=2) as pipe:
        with pytest.raises(ValueError, match=r"the partial's reduction='none' makes the loss one value per element"):
            pipe.step(torch.randn(4, 4), torch.randn(4, 2), functools.partial(F.mse_loss, reduction="none"))
        with pytest.raises(ValueError, match=r"reduction='mean', but the loss itself reduces by 'sum' \(its "
                                             r"reduction, a partial's or loss_kwargs'\)"):
            pipe.step(torch.randn(4, 4), torch.randn(4, 2), functools.partial(F.mse_loss, reduction="sum"),
                      reduction="mean")
        assert pipe.last_step is None


def test_a_target_tuple_with_its_tensors_nested_deeper_says_so():
    with Pipe(body(), [1, 1, 1, 1], chunks=2) as pipe:
        y = torch.randn(4, 2)
        with pytest.raises(TypeError, match=r"target is a tuple without tensors at its top level \(it holds lists "
                                            r"and tuples, which are not looked into"):
            pipe.step(torch.randn(4, 4), ((y, y), [y]), lambda output, target: output.sum())
        with pytest.raises(TypeError, match=r"target is a tuple without tensors: it needs one"):
            pipe.step(torch.randn(4, 4), (1, "a"), lambda output, target: output.sum())
        assert pipe.last_step is None


def test_a_reduction_that_disagrees_with_loss_kwargs_is_refused():
    with Pipe(body(), [1, 1, 1, 1], chunks=2) as pipe:
        with pytest.raises(ValueError, match="reduction='sum', but the loss itself reduces by 'mean'"):
            pipe.step(torch.randn(4, 4), torch.randn(4, 2), F.mse_loss, reduction="sum",
                      loss_kwargs={"reduction": "mean"})
        with pytest.raises(ValueError, match=r"loss_kwargs\['reduction'\] makes the loss one value per element"):
            pipe.step(torch.randn(4, 4), torch.randn(4, 2), F.mse_loss, loss_kwargs={"reduction": "none"})
        assert pipe.last_step is None


# Regression (review): an explicit reduction= hid a per-element loss until the step had run and
# changed state; a reduction of the wrong type or spelling was called a conflict.
def test_a_per_element_loss_and_a_bad_reduction_are_refused_before_anything_runs():
    with Pipe(body(), [1, 1, 1, 1], chunks=2) as pipe:
        x, y = torch.randn(4, 4), torch.randn(4, 2)
        for reduction in (None, "sum", "mean"):
            with pytest.raises(ValueError, match=r"MSELoss\(reduction='none'\) makes the loss one value per element"):
                pipe.step(x, y, nn.MSELoss(reduction="none"), reduction=reduction)
        for bad, error, message in ((5, TypeError, "got int: 5"), (["sum"], TypeError, r"got list: \['sum'\]"),
                                    ("SUM", ValueError, "got 'SUM'"), ("none", ValueError, "got 'none'")):
            with pytest.raises(error, match=r"reduction must be 'mean', 'batchmean', 'sum' or None.*" + message):
                pipe.step(x, y, nn.MSELoss(reduction="sum"), reduction=bad)
            with pytest.raises(error, match=message):
                pipe.evaluate(x, y, F.mse_loss, reduction=bad)
        assert pipe.last_step is None

        class SumsItself(nn.Module):  # a custom loss may keep a 'none' attribute and reduce anyway
            reduction = "none"

            def forward(self, output, target):
                return ((output - target) ** 2).sum()

        pipe.step(x, y, SumsItself(), reduction="sum")


# Regression (review): a tensor in loss_kwargs kept a partial .grad after a failed step.
def test_a_failed_step_removes_the_gradient_it_gave_a_tensor_in_loss_kwargs():
    temperature = torch.tensor(2.0, requires_grad=True)
    calls = []

    def loss_fn(output, target, temperature):
        calls.append(None)
        if len(calls) == 3:
            raise RuntimeError("bad micro-batch")
        return F.mse_loss(output / temperature, target)

    with Pipe(body(), [1, 1, 1, 1], chunks=4) as pipe:
        with pytest.raises(RuntimeError, match="bad micro-batch"):
            pipe.step(torch.randn(8, 4), torch.randn(8, 2), loss_fn, schedule="1f1b",
                      loss_kwargs={"temperature": temperature})
        assert temperature.grad is None and all(p.grad is None for p in pipe.parameters())


def test_batchmean_in_loss_kwargs_may_be_told_how_to_weigh_and_a_modules_own_reduction_may_not_be_contradicted():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LogSoftmax(dim=1))
    x, y = torch.randn(6, 4), torch.softmax(torch.randn(6, 3), dim=1)
    reference = copy.deepcopy(model)
    expected = F.kl_div(reference(x), y, reduction="batchmean")
    with Pipe(copy.deepcopy(model), [1, 1], chunks=3, output_batch_dim=(0,), target_batch_dim=0) as pipe:
        with pytest.raises(ValueError, match="'batchmean' divides by the output's dim 0"):
            pipe.step(x, y, F.kl_div, loss_kwargs={"reduction": "batchmean"})
        loss = pipe.step(x, y, F.kl_div, reduction="mean", loss_kwargs={"reduction": "batchmean"})
        torch.testing.assert_close(loss, expected.detach())
        with pytest.raises(ValueError, match="reduction='mean', but the loss itself reduces by 'sum'"):
            pipe.step(x, y, nn.MSELoss(reduction="sum"), reduction="mean")


def test_a_tensor_computed_before_the_step_in_loss_kwargs_gets_its_gradient_once():
    torch.manual_seed(0)
    model = body()
    log_scale = nn.Parameter(torch.tensor(0.3))
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def loss_fn(output, target, scale, extra):
        return F.mse_loss(output, target) * scale + extra[0]

    reference = copy.deepcopy(model)
    reference_scale = nn.Parameter(log_scale.detach().clone())
    expected = loss_fn(reference(x), y, reference_scale.exp(), [reference_scale * 0.5])
    expected.backward()
    with Pipe(model, [1, 1, 1, 1], chunks=4) as pipe:
        loss = pipe.step(x, y, loss_fn, loss_kwargs={"scale": log_scale.exp(), "extra": [log_scale * 0.5]})
        torch.testing.assert_close(loss, expected.detach())
        assert_same_grads((pipe,), (reference,))
        torch.testing.assert_close(log_scale.grad, reference_scale.grad)


def test_a_failed_step_rolls_back_a_leaf_nested_in_loss_kwargs():
    nested = torch.tensor(1.5, requires_grad=True)
    calls = []

    def loss_fn(output, target, extra):
        calls.append(None)
        if len(calls) == 3:
            raise RuntimeError("bad micro-batch")
        return F.mse_loss(output, target) * extra[0]

    with Pipe(body(), [1, 1, 1, 1], chunks=4) as pipe:
        with pytest.raises(RuntimeError, match="bad micro-batch"):
            pipe.step(torch.randn(8, 4), torch.randn(8, 2), loss_fn, loss_kwargs={"extra": [nested]})
        assert nested.grad is None


def masked_mse(output, target):
    """MSE over the rows whose target is not all zero; a constant 0 for a fully masked micro-batch."""
    keep = target.abs().sum(dim=1) != 0
    if not keep.any():
        return torch.zeros(())
    return F.mse_loss(output[keep], target[keep], reduction="sum")


@pytest.mark.parametrize("schedule,options,balance", SCHEDULES)
def test_a_micro_batch_whose_loss_is_a_constant_contributes_nothing(schedule, options, balance):
    # Its loss has no graph: the step failed with autograd's "does not require grad" error,
    # where the sum of the micro-batch losses back-propagates.
    torch.manual_seed(0)
    model = body()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    y[6:] = 0  # the last of 4 micro-batches is fully masked
    expected = sum(masked_mse(reference(a), b) for a, b in zip(x.chunk(4), y.chunk(4)))
    expected.backward()
    with Pipe(model, balance, chunks=4) as pipe:
        losses = []
        loss = pipe.step(x, y, masked_mse, schedule=schedule, reduction="sum", losses=losses, **options)
    torch.testing.assert_close(loss, expected.detach())
    assert float(losses[-1]) == 0.0
    assert_same_grads([model], [reference])


def test_a_step_whose_losses_all_lack_a_graph_is_refused_as_the_plain_backward_is():
    model = body()
    with Pipe(model, [2, 2], chunks=2) as pipe:
        with pytest.raises(RuntimeError, match="no loss with a graph in any micro-batch"):
            pipe.step(torch.randn(4, 4), torch.randn(4, 2), lambda out, target: F.mse_loss(out, target).detach())
        assert all(param.grad is None for param in model.parameters())
        pipe.step(torch.randn(4, 4), torch.randn(4, 2), nn.MSELoss())  # usable afterwards
    assert all(param.grad is not None for param in model.parameters())


def test_a_complex_loss_is_refused_as_the_plain_backward_refuses_it_and_evaluate_takes_it():
    """Review (helper-137): step seeded backward with a complex full_like(loss) and gave the
    real part's gradients, where loss.backward() refuses a complex loss."""
    model = body()
    x, y = torch.randn(4, 4), torch.randn(4, 2)

    def complex_mse(out, target):
        return F.mse_loss(out, target) * (1 + 2j)

    with pytest.raises(RuntimeError, match="real scalar outputs"):
        complex_mse(copy.deepcopy(model)(x), y).backward()
    with Pipe(model, [2, 2], chunks=2) as pipe:
        with pytest.raises(TypeError, match=r"loss_fn must return a real loss, got a torch.complex64 one .*\.real"):
            pipe.step(x, y, complex_mse)
        assert all(param.grad is None for param in model.parameters())
        with torch.no_grad():
            expected = complex_mse(model(x), y)
        torch.testing.assert_close(pipe.evaluate(x, y, complex_mse), expected)  # no backward: as the plain model
        pipe.step(x, y, nn.MSELoss())  # usable afterwards
    assert all(param.grad is not None for param in model.parameters())


class _ShiftedCrossEntropy(nn.CrossEntropyLoss):
    """A causal LM's loss: predicts token t + 1 from position t, so it averages over the
    non-ignored labels[:, 1:], not over the whole target."""

    def forward(self, logits, labels):
        return super().forward(logits[:, :, :-1], labels[:, 1:])


class _DefaultsOnlyCrossEntropy(nn.CrossEntropyLoss):
    def __init__(self):
        super().__init__(ignore_index=0)


def test_a_class_index_loss_subclass_with_a_forward_of_its_own_is_not_weighed_by_the_stock_count():
    """Review (s33): any subclass of CrossEntropyLoss was weighed by the stock rule (the
    non-ignored targets of the whole target): a causal LM's shifted loss got weights 4/16 for
    2/12, and step's loss and gradients were off (0.045) without a word. Its forward decides
    what it averages over: it is weighed as any other callable, and with reduction='sum' the
    step is exact."""
    from torchpipe.step_inputs import _counted_targets

    assert _counted_targets(_ShiftedCrossEntropy(ignore_index=0), None) is None
    assert _counted_targets(_DefaultsOnlyCrossEntropy(), None) == (0, None)  # the stock forward: counted
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 6, 1), nn.Conv1d(6, 6, 1))  # (N, classes, T) logits
    x = torch.randn(4, 4, 5)
    labels = torch.tensor([[1, 2, 3, 0, 0], [1, 0, 0, 0, 0], [2, 3, 4, 5, 1], [3, 1, 0, 0, 0]])
    reference = copy.deepcopy(model)
    summed = _ShiftedCrossEntropy(ignore_index=0, reduction="sum")
    expected = summed(reference(x), labels)
    expected.backward()
    with Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint="never") as pipe:
        loss = pipe.step(x, labels, summed, schedule="1f1b")
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=0)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7)
