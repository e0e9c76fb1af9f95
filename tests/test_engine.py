"""torchpipe.engine: the direct engine calls give what torch.autograd gives."""
import pytest
import torch

from torchpipe import engine


def graph():
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 2, requires_grad=True)
    return x, w, (x @ w).tanh()


def test_backward_and_grad_equal_torch_autograd():
    x, w, y = graph()
    g = torch.randn(3, 2)
    expected = torch.autograd.grad(y, (x, w), g, retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(engine.grad([y], [x, w], [g], retain_graph=True), expected))
    engine.backward([y], [g], inputs=[w])  # only w accumulates
    assert x.grad is None and torch.equal(w.grad, expected[1])


def test_unused_inputs_give_none_and_bad_arguments_are_rejected():
    x, w, y = graph()
    unused = torch.randn(2, requires_grad=True)
    assert engine.grad([y], [unused, x], [torch.ones(3, 2)], retain_graph=True)[0] is None
    with pytest.raises(RuntimeError, match="shape"):
        engine.backward([y], [torch.ones(2, 2)])
    with pytest.raises(ValueError, match="at least one"):
        engine.backward([y], [torch.ones(3, 2)], inputs=[])
