"""``Pipe.evaluate``: a validation batch's loss through the pipeline, without gradients."""
import copy

import pytest
import torch
from torch import nn

from torchpipe import Pipe


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 3)).double()


def make_pipe(chunks: int, **kwargs) -> tuple:
    model = make_model()
    reference = copy.deepcopy(model).eval()
    pipe = Pipe(model, [2, 2, 2], devices=["cpu"] * 3, chunks=chunks, **kwargs).eval()
    return pipe, reference


def class_targets() -> torch.Tensor:
    y = torch.tensor([0, 1, 2, 2, 1, 0, 1, 2, 0, 1])
    y[[0, 1, 2, 5]] = -100  # padding, unevenly spread over the micro-batches
    return y


LOSSES = [
    ("mse-mean", nn.MSELoss(), lambda: torch.randn(10, 3, dtype=torch.float64)),
    ("mse-sum", nn.MSELoss(reduction="sum"), lambda: torch.randn(10, 3, dtype=torch.float64)),
    ("ce-ignore-weight", nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)),
     class_targets),
]


@pytest.mark.parametrize("chunks", [1, 3, 4])
@pytest.mark.parametrize("name, loss_fn, make_target", LOSSES, ids=[c[0] for c in LOSSES])
def test_the_loss_each_micro_batch_loss_and_the_output_are_the_plain_models(chunks, name, loss_fn, make_target):
    pipe, reference = make_pipe(chunks)
    torch.manual_seed(1)
    x, y = torch.randn(10, 4, dtype=torch.float64), make_target()
    each = ["stale"]
    loss, output = pipe.evaluate(x, y, loss_fn, losses=each, return_outputs=True)
    expected = loss_fn(reference(x), y)
    if chunks == 1:
        assert torch.equal(loss, expected) and torch.equal(output, reference(x))
    else:
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
        torch.testing.assert_close(output, reference(x), rtol=1e-12, atol=1e-15)
    assert len(each) == len(x.chunk(chunks))
    for part, x_part, y_part in zip(each, x.chunk(chunks), y.chunk(chunks)):
        torch.testing.assert_close(part, loss_fn(reference(x_part), y_part), rtol=1e-12, atol=0, equal_nan=True)
    assert not loss.requires_grad and not output.requires_grad
    assert all(p.grad is None for p in pipe.parameters())
    pipe.close()


def test_it_leaves_no_gradient_and_keeps_the_callers_mode_and_grad_state():
    pipe, reference = make_pipe(2)
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, 3, dtype=torch.float64)
    pipe.train()
    with torch.no_grad():  # a validation loop's usual surroundings
        pipe.evaluate(x, y, nn.MSELoss())
    loss = pipe.evaluate(x, y, nn.MSELoss())  # dropout on: the mode is the caller's
    assert pipe.training and torch.is_grad_enabled() and not loss.requires_grad
    assert x.grad is None and all(p.grad is None for p in pipe.parameters())
    pipe.close()


def test_a_sequence_first_batch_splits_input_output_and_target_along_dim_1():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    reference = copy.deepcopy(model)
    pipe = Pipe(model, [2, 1], devices=["cpu"] * 2, chunks=3, batch_dim=1)
    x = torch.randn(5, 7, 4, dtype=torch.float64)  # (time, batch, features)
    y = torch.randn(5, 7, 3, dtype=torch.float64)
    each: list = []
    loss, output = pipe.evaluate(x, y, nn.MSELoss(), losses=each, return_outputs=True)
    torch.testing.assert_close(loss, nn.MSELoss()(reference(x), y), rtol=1e-12, atol=0)
    torch.testing.assert_close(output, reference(x), rtol=1e-12, atol=1e-15)
    assert [tuple(part.shape) for part in each] == [()] * 3
    pipe.close()


def test_bad_arguments_are_refused_before_anything_runs_and_the_pipe_still_works():
    pipe, reference = make_pipe(2)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    each = ["kept"]
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        pipe.evaluate(x, y, "mse", losses=each)
    with pytest.raises(TypeError, match="losses must be a list"):
        pipe.evaluate(x, y, nn.MSELoss(), losses=())
    with pytest.raises(ValueError, match=r"MSELoss\(reduction='none'\) makes the loss one value per element"):
        pipe.evaluate(x, y, nn.MSELoss(reduction="none"), losses=each)
    with pytest.raises(TypeError, match="return_outputs must be a bool"):
        pipe.evaluate(x, y, nn.MSELoss(), return_outputs=1)
    with pytest.raises(ValueError, match="target has 5 samples along dim 0 but the input has 6"):
        pipe.evaluate(x, y[:5], nn.MSELoss(), losses=each)
    assert pipe.last_step is None  # the refused calls ran nothing
    with pytest.raises(TypeError, match="loss_fn must return a scalar tensor"):  # known only once it ran
        pipe.evaluate(x, y, lambda out, target: (out - target) ** 2, reduction="mean", losses=each)
    assert each == ["kept"]
    torch.testing.assert_close(pipe.evaluate(x, y, nn.MSELoss()), nn.MSELoss()(reference(x), y))
    pipe.close()
    with pytest.raises(RuntimeError, match="closed"):
        pipe.evaluate(x, y, nn.MSELoss())


def test_loss_kwargs_reach_every_micro_batchs_loss():
    pipe, reference = make_pipe(3)
    x, y = torch.randn(10, 4, dtype=torch.float64), torch.randint(0, 3, (10,))
    for loss_kwargs in ({"label_smoothing": 0.3}, {"label_smoothing": 0.3, "reduction": "sum"}):
        loss = pipe.evaluate(x, y, nn.functional.cross_entropy, loss_kwargs=loss_kwargs)
        torch.testing.assert_close(loss, nn.functional.cross_entropy(reference(x), y, **loss_kwargs))
    with pytest.raises(TypeError, match="loss_kwargs must be a dict"):
        pipe.evaluate(x, y, nn.functional.cross_entropy, loss_kwargs=["label_smoothing"])
    pipe.close()


class NestsItsOutput(nn.Module):
    """``x -> ((x, 2x),)``: the output tuple's only tensors sit inside a nested tuple."""

    def forward(self, x):
        return ((x, x * 2),)


def test_an_output_whose_tensors_are_all_nested_gets_its_loss():
    """Regression: the target was moved to the device of the output's first top-level
    tensor, and an output with none raised a bare StopIteration."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), NestsItsOutput()).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)

    def loss_fn(output, target):
        (first, second), = output
        return ((first + second - target) ** 2).mean()

    with Pipe(model, [1, 1], chunks=3) as pipe:
        loss = pipe.evaluate(x, y, loss_fn)
    torch.testing.assert_close(loss, loss_fn(model(x), y), rtol=1e-12, atol=0)
