"""``torch.compile`` around a Pipe: the pipeline itself runs eagerly, with the same results."""
import copy

import pytest
import torch
from torch import nn

from torchpipe import Pipe

pytest.importorskip("torch._dynamo")
# torch's compiler, imported here, uses its own deprecated torch.jit.script_method.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def assert_same_grads(module, reference):
    for (name, param), expected in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, expected.grad, msg=name)


@pytest.fixture(autouse=True)
def fresh_compiler_caches():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# Regression: torch.compile(pipe)(x) failed inside torch's compiler ("Guard failed on the same
# frame it was created. This is a bug"), tracing the Pipe's own bookkeeping.
def test_a_compiled_pipe_gives_the_plain_outputs_and_gradients():
    reference = model()
    x = torch.randn(6, 4)
    with Pipe(copy.deepcopy(reference), [2, 3], chunks=3) as pipe:
        compiled = torch.compile(pipe)
        for _ in range(2):  # the second call reuses what the compiler decided
            pipe.zero_grad()
            reference.zero_grad()
            output = compiled(x)
            expected = reference(x)
            output.sum().backward()
            expected.sum().backward()
            torch.testing.assert_close(output, expected)
            assert_same_grads(pipe, reference)


def test_a_pipe_inside_a_compiled_model_and_a_compiled_step():
    reference = nn.Sequential(nn.Linear(4, 4), model(), nn.Linear(2, 2))
    outer = copy.deepcopy(reference)
    outer[1] = Pipe(outer[1], [3, 2], chunks=2)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    try:
        torch.testing.assert_close(torch.compile(outer)(x), reference(x))
        reference.zero_grad()
        expected = nn.MSELoss()(reference[1](x), y)
        expected.backward()
        loss = torch.compile(outer[1].step)(x, y, nn.MSELoss())
        torch.testing.assert_close(loss, expected.detach())
        assert_same_grads(outer[1], reference[1])
    finally:
        outer[1].close()
