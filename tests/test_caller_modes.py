"""The caller's Python modes reach the stages; transforms and tracers that cannot are refused.

PyTorch keeps ``TorchFunctionMode``/``TorchDispatchMode`` stacks (``with torch.device(...)``,
``FlopCounterMode``, ``allow_mutation_on_saved_tensors``), ``torch.func`` transforms and
tracers per thread. Each test compares with the plain ``nn.Sequential`` under the same mode.
"""
import copy
import re

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from torchpipe import Pipe
from torchpipe.workers import HostPool

SCHEDULES = ["gpipe", "1f1b", "zb-h1"]


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def make_pipe(model: nn.Sequential, checkpoint: str = "never", chunks: int = 2) -> Pipe:
    return Pipe(model, balance=[2, 2, 1], devices=["cpu"] * 3, chunks=chunks, checkpoint=checkpoint)


@pytest.fixture
def data():
    torch.manual_seed(1)
    return torch.randn(8, 16), torch.randn(8, 4)


def _flops_of_a_second_call(call) -> int:
    """The flops one call adds once a first call has made the counter's keys.

    FlopCounterMode is not thread-safe where it makes a key (two workers may both make one,
    and one's count is lost); adding to an existing key has no such window.
    """
    with FlopCounterMode(display=False) as counter:
        call()
        first = counter.get_total_flops()
        call()
        return counter.get_total_flops() - first


def test_flop_counter_counts_the_stages_like_the_plain_model(data):
    x, y = data
    plain, model = make_model(), make_model()
    pipe = make_pipe(model)
    forward = _flops_of_a_second_call(lambda: plain(x))
    forward_backward = _flops_of_a_second_call(lambda: nn.functional.mse_loss(plain(x), y).backward())
    assert forward > 0 and forward_backward > forward

    assert _flops_of_a_second_call(lambda: pipe(x)) == forward
    assert _flops_of_a_second_call(lambda: nn.functional.mse_loss(pipe(x), y).backward()) == forward_backward
    for schedule in SCHEDULES:
        assert _flops_of_a_second_call(lambda: pipe.step(x, y, nn.MSELoss(), schedule=schedule)) == forward_backward
    pipe.close()


class RoundMatmuls(TorchDispatchMode):
    """Emulates a low-precision matmul: every matmul result rounded to bfloat16."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
            out = out.to(torch.bfloat16).to(out.dtype)
        return out


def test_a_dispatch_mode_changes_the_stages_like_the_plain_model(data):
    x, _ = data
    plain, model = make_model(), make_model()
    pipe = make_pipe(model, chunks=1)
    with RoundMatmuls():
        expected = plain(x)
        got = pipe(x)
    assert not torch.equal(expected, plain(x))  # the mode changes the result
    assert torch.equal(got, expected)
    pipe.close()


class CountLinear(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is nn.functional.linear:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_modes_are_popped_after_each_job(data):
    x, _ = data
    pipe = make_pipe(make_model())
    with CountLinear() as mode:
        pipe(x)
    assert mode.calls == 3 * 2  # three Linear layers, two micro-batches
    pipe(x)  # without the mode: the workers must not keep it
    assert mode.calls == 6
    with HostPool(2) as pool:
        with CountLinear() as mode:
            pool.submit(nn.functional.linear, x, torch.ones(2, 16)).result()
        assert mode.calls == 1
        pool.submit(nn.functional.linear, x, torch.ones(2, 16)).result()
        assert mode.calls == 1
    pipe.close()


class MakesATensor(nn.Module):
    """Creates a tensor without naming a device, as layers often do (a mask, positions)."""

    def __init__(self):
        super().__init__()
        self.devices = []

    def forward(self, x):
        made = torch.zeros(3)
        self.devices.append(made.device.type)
        return x


def test_the_default_device_context_reaches_the_stages(data):
    x, _ = data
    plain = nn.Sequential(MakesATensor(), MakesATensor())
    pipe = Pipe(nn.Sequential(MakesATensor(), MakesATensor()), balance=[1, 1], devices=["cpu"] * 2, chunks=1)
    with torch.device("meta"):
        plain(x)
        pipe(x)
    assert [m.devices for m in plain] == [["meta"], ["meta"]]
    assert [m.devices for m in pipe] == [["meta"], ["meta"]]
    pipe.close()


class ChangesASavedTensor(nn.Module):
    """Changes in place a tensor autograd saved: allowed under allow_mutation_on_saved_tensors."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = torch.sigmoid(self.lin(x))  # sigmoid saves its result
        out = y * 3
        y.mul_(2)
        return out + y


def mutating_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(ChangesASavedTensor(), nn.Tanh(), ChangesASavedTensor())


@pytest.mark.parametrize("path", ["forward", *SCHEDULES])
def test_allow_mutation_on_saved_tensors_trains_like_the_plain_model(path):
    torch.manual_seed(2)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    plain = mutating_model()
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        nn.functional.mse_loss(plain(x), y).backward()
    pipe = Pipe(mutating_model(), balance=[1, 1, 1], devices=["cpu"] * 3, chunks=2, checkpoint="never")
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        if path == "forward":
            nn.functional.mse_loss(pipe(x), y).backward()
        else:
            pipe.step(x, y, nn.MSELoss(), schedule=path)
    for (name, want), got in zip(plain.named_parameters(), pipe.parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=name)
    pipe.close()


def _refusals(pipe: Pipe, x: torch.Tensor, y: torch.Tensor):
    """Each untransferable state, with a call of each public entry under it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    calls = {
        "pipe(x)": lambda: pipe(x).sum(),
        "Pipe.step": lambda: pipe.step(x, y, nn.MSELoss()),
        "Pipe.evaluate": lambda: pipe.evaluate(x, y, nn.MSELoss()),
    }
    for what, call in calls.items():
        yield what, "torch.func transform", lambda call=call: torch.func.grad(lambda t: call())(x)
        yield what, "torch.func transform", lambda call=call: torch.func.vmap(lambda t: call(), randomness="same")(x)
        yield what, "make_fx", lambda call=call: make_fx(lambda t: call())(x)
        yield what, "make_fx(pre_dispatch=True)", lambda call=call: make_fx(lambda t: call(), pre_dispatch=True)(x)
        yield what, "FakeTensorMode", lambda call=call: _under(FakeTensorMode(allow_non_fake_inputs=True), call)
        yield what, "functionalization", lambda call=call: _under(FunctionalTensorMode(), call)
    yield "pipe(x)", "torch.jit.trace", lambda: torch.jit.trace(pipe, (x,), check_trace=False)
    yield "pipe(x)", "torch.export", lambda: torch.export.export(pipe, (x,), strict=False)


def _under(mode, call):
    with mode:
        return call()


def test_transforms_and_tracers_are_refused_before_anything_changes(data):
    x, y = data
    plain, model = make_model(), make_model()
    pipe = make_pipe(model, checkpoint="except_last")
    for what, name, call in _refusals(pipe, x, y):
        with pytest.raises(RuntimeError, match=f"{re.escape(what)} cannot run under .*{re.escape(name)}") as info:
            call()
        assert "worker threads" in str(info.value)
        assert all(p.grad is None for p in pipe.parameters()), (what, name)
    # Still usable, and right.
    loss = pipe.step(x, y, nn.MSELoss())
    want = nn.functional.mse_loss(plain(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    for p, q in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    with HostPool(1) as pool:
        with pytest.raises(RuntimeError, match="HostPool.submit cannot run under a torch.func transform"):
            torch.func.grad(lambda t: pool.submit(torch.sum, t).result())(x)
    pipe.close()


def test_torch_compile_of_the_pipe_still_runs_it(data):
    x, _ = data
    plain, model = make_model(), make_model()
    pipe = make_pipe(model)
    torch.testing.assert_close(torch.compile(pipe)(x), plain(x))
    pipe.close()


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_functional_call_recomputes_with_the_tensors_it_was_given(checkpoint, data):
    # functional_call swaps the given tensors in for the call only; the checkpointed
    # micro-batches recompute in backward, after the module's own tensors are back.
    # In float64: the chunked backward sums in another order, which in float32 can pass the
    # default tolerance by a little with these random weights (2.7e-5 on one CPU).
    x, y = (t.double() for t in data)
    plain, model = make_model().double(), make_model().double()
    pipe = make_pipe(model, checkpoint=checkpoint, chunks=4)
    torch.manual_seed(3)
    given = {name: torch.randn_like(p, requires_grad=True) for name, p in plain.named_parameters()}
    given_to_pipe = {name: t.detach().clone().requires_grad_(True) for name, t in given.items()}
    own = dict(pipe.named_parameters())
    own_values = {name: p.detach().clone() for name, p in own.items()}

    nn.functional.mse_loss(torch.func.functional_call(plain, given, (x,)), y).backward()
    out = torch.func.functional_call(pipe, given_to_pipe, (x,))
    nn.functional.mse_loss(out, y).backward()
    for name, tensor in given.items():
        torch.testing.assert_close(given_to_pipe[name].grad, tensor.grad, msg=name)
    for name, p in pipe.named_parameters():
        assert p is own[name], name  # the recompute put the module's own tensors back
        assert p.grad is None, name  # and they took no part
        assert torch.equal(p, own_values[name]), name
    pipe.close()


class _EnergyGradient(nn.Module):
    """A layer that differentiates inside its forward with torch.func (energy models, PINNs)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x):
        return -torch.func.vmap(torch.func.grad(lambda row: torch.tanh(row @ self.w).sum()))(x)


def test_torch_func_grad_inside_a_layer_runs_where_no_hook_is_active_and_is_explained_where_one_is():
    # torch.func's grad transforms refuse any active saved-tensor hook. Without checkpointing,
    # pipe(x) installs none and trains as the plain model; Pipe.step and checkpointed
    # micro-batches do, and the refusal (which blames hooks the user never installed) says whose.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), _EnergyGradient(), nn.Tanh(), nn.Linear(8, 4))
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    nn.functional.mse_loss(plain(x), y).backward()
    with Pipe(copy.deepcopy(plain), [2, 2], checkpoint="never") as pipe:
        pipe.zero_grad(set_to_none=True)
        nn.functional.mse_loss(pipe(x), y).backward()
        for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad), name
        pipe.zero_grad(set_to_none=True)
        with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks") as raised:
            pipe.step(x, y, nn.MSELoss())
        assert any("Pipe.step runs each stage's forward under saved-tensor hooks of its own" in note
                   and "torch.autograd.grad(..., create_graph=True)" in note for note in raised.value.__notes__)
        assert all(p.grad is None for p in pipe.parameters())  # the failed step left nothing behind
        pipe.checkpoint = "always"
        with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks") as raised:
            pipe(x)
        assert any("a checkpointed micro-batch runs its stage under the checkpoint's saved-tensor hooks" in note
                   for note in raised.value.__notes__)
