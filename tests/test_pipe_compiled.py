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


def test_a_compiled_layer_with_deferred_batch_norm_trains_like_the_eager_one():
    """Review: traced, DeferredBatchNorm's pending counters became guards, so a compiled block
    compiled anew for every micro-batch; past dynamo's recompile limit a checkpointed
    micro-batch's forward and its recompute ran different code, and backward failed with
    torch's CheckpointError. The statistics tracking now stays out of the graph. (Each
    micro-batch is normalised with its own statistics, so the reference is the same pipe with
    the block left eager.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1),
                          nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
                          nn.Flatten(), nn.Linear(4 * 4 * 4, 5))
    eager_model = copy.deepcopy(model)
    model[1] = torch.compile(model[1], backend="aot_eager")
    x, y = torch.randn(20, 3, 4, 4), torch.randint(0, 5, (20,))
    settings = dict(chunks=10, checkpoint="always", deferred_batch_norm=True)
    with Pipe(model, [1, 1, 2], **settings) as pipe, Pipe(eager_model, [1, 1, 2], **settings) as eager:
        for _ in range(2):
            pipe.zero_grad()
            eager.zero_grad()
            loss = pipe.step(x, y, nn.CrossEntropyLoss(), schedule="1f1b")
            expected = eager.step(x, y, nn.CrossEntropyLoss(), schedule="1f1b")
            torch.testing.assert_close(loss, expected)
            for (name, param), want in zip(pipe.named_parameters(), eager.parameters()):
                torch.testing.assert_close(param.grad, want.grad, msg=name)
        norm, want = pipe[1]._orig_mod[1], eager[1][1]
        torch.testing.assert_close(norm.running_mean, want.running_mean)
        torch.testing.assert_close(norm.running_var, want.running_var)
        assert norm.num_batches_tracked.item() == want.num_batches_tracked.item() == 2


class _UntracedDropout(nn.Module):
    """A module torch.compile does not trace (a logging module, a custom kernel): the compiled
    layer around it breaks its graph there."""

    @torch.compiler.disable
    def forward(self, x):
        return nn.functional.dropout(x, 0.1, self.training)


def _encoder_block():
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    layer.dropout = _UntracedDropout()
    return layer


@pytest.mark.parametrize("path, checkpoint", [("step", "never"), ("step", "always"), ("forward", "always")])
def test_a_compiled_layer_that_breaks_its_graph_runs_under_the_pipes_saved_tensor_hooks(path, checkpoint):
    """Review: after a graph break inside a compiled layer, torch.compile compiled the frames
    autograd called into, our saved-tensor hooks among them, on fake tensors: Pipe.step failed
    in its byte-counting hook, and a checkpointed pipe(x) in its save-counting hook. The hooks
    are now out of the compiler's reach, as torch's checkpoint keeps its own."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), _encoder_block(), nn.Linear(8, 2)).eval()  # no dropout draws
    model = copy.deepcopy(reference)
    model[1] = torch.compile(model[1], backend="aot_eager")
    x, y = torch.randn(4, 3, 8), torch.randn(4, 3, 2)
    with Pipe(model, [1, 1, 1], chunks=2, checkpoint=checkpoint) as pipe:
        pipe.train()
        reference.train()
        pipe[1]._orig_mod.dropout.eval()  # the graph still breaks there; no random numbers drawn
        reference[1].dropout.eval()
        if path == "step":
            loss = pipe.step(x, y, nn.MSELoss())
            expected = nn.MSELoss()(reference(x), y)
            torch.testing.assert_close(loss, expected.detach())
        else:
            pipe(x).sum().backward()
            expected = reference(x).sum()
        expected.backward()
        for (name, param), want in zip(pipe.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, want.grad, msg=name)
