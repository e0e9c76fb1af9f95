"""Constructor errors: torchgpipe's error types, a message naming the bad value, no state changed."""
import copy
import re

import pytest
import torch
from thread_helpers import torchpipe_threads
from torch import nn

from torchpipe import Pipe
from torchpipe import BalanceError
from torchpipe.balance import balance_by_time
from torchpipe.retired import Pipe as RetiredPipe


def model(layers=4):
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])


def names(module):
    return [name for name, _ in module.named_children()]


@pytest.mark.parametrize("balance, message", [
    ([1, 1], r"module: 4, sum of balance: 2\); .*torchpipe.balance.balance_by_time"),
    ([2, 0, 2], r"positive integers \(balance: \[2, 0, 2\]\)"),
    ([2, -1, 3], "positive integers"),
    ([2.0, 2], r"positive integers \(balance: \[2.0, 2\]\) \(floats are refused, not rounded"),
    ([True, 3], "positive integers"),
    ([], "balance is empty"),
    (4, "sequence of positive integers, got 4"),
    ({3, 1}, r"in partition order, got a set, which has no order: \{1, 3\}"),  # list({3, 1}) is [1, 3]
    ({3: "a", 1: "b"}, "got a dict, which has no order"),
])
def test_bad_balance_is_a_balance_error(balance, message):
    with pytest.raises(BalanceError, match=message):
        Pipe(model(), balance)
    assert issubclass(BalanceError, ValueError)  # torchgpipe users catch ValueError


@pytest.mark.parametrize("balance", [None, [], [1]])
def test_an_empty_sequential_is_a_balance_error_whatever_the_balance(balance):
    with pytest.raises(BalanceError, match="the module is an empty nn.Sequential"):
        Pipe(nn.Sequential(), balance)


@pytest.mark.parametrize("chunks", [0, -1, 1.5, "2", True, None])
def test_bad_chunks(chunks):
    with pytest.raises(ValueError, match=f"number of chunks must be a positive integer, got {chunks!r}"):
        Pipe(model(), [2, 2], chunks=chunks)


@pytest.mark.parametrize("mode", ["sometimes", None, "Always"])
def test_bad_checkpoint_mode(mode):
    with pytest.raises(ValueError, match=f"checkpoint is not one of .*got {mode!r}"):
        Pipe(model(), [2, 2], checkpoint=mode)


# Regression: the settings were plain attributes, so a bad value set after construction
# surfaced later as a bare KeyError ('sometimes') or torch's chunk() error.
@pytest.mark.parametrize("name, value, words", [
    ("checkpoint", "sometimes", r"checkpoint is not one of 'always', 'except_last', or 'never' \(got 'sometimes'\)"),
    ("chunks", "4", r"number of chunks must be a positive integer, got '4'"),
    ("chunks", 0, r"number of chunks must be a positive integer, got 0"),
    ("chunks", 2**80, r"number of chunks must be at most 9223372036854775807, got 1208925819614629174706176"),
])
def test_settings_changed_after_construction_are_checked_when_set(name, value, words):
    from torchpipe import is_checkpointing

    seen = []

    class Record(nn.Module):
        def forward(self, x):
            seen.append((x.size(0), is_checkpointing()))
            return x * 2

    with Pipe(nn.Sequential(nn.Linear(2, 2), Record()), [1, 1], chunks=2) as pipe:
        with pytest.raises(ValueError, match=words):
            setattr(pipe, name, value)
        assert (pipe.chunks, pipe.checkpoint) == (2, "except_last")
        pipe.chunks, pipe.checkpoint = 3, "always"  # valid values take effect on the next call
        pipe(torch.randn(6, 2))
        assert (pipe.chunks, pipe.checkpoint) == (3, "always")
    assert seen == [(2, True)] * 3


@pytest.mark.parametrize("name, value", [
    ("balance", [2, 1]), ("devices", ["cpu"]), ("deferred_batch_norm", False), ("spread_tuples", True),
    ("intra_op_threads", 4),
])
def test_settings_the_pipe_was_built_with_are_read_only(name, value):
    # Assigned later, these would change what the Pipe reports, not what it runs: a balance
    # that is not the real split, deferred batch norm switched off while its layers still
    # accumulate (an update lost). Refused, naming the setting and what may change instead.
    x = torch.randn(8, 2)
    with Pipe(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2)), [1, 2], chunks=2,
              deferred_batch_norm=True) as pipe:
        before = {n: getattr(pipe, n) for n in ("balance", "devices", "deferred_batch_norm", "spread_tuples",
                                                "intra_op_threads")}
        with pytest.raises(AttributeError, match=rf"Pipe.{name} is fixed when the Pipe is built .*got "
                                                 rf"{re.escape(repr(value))}\. Build a new Pipe"):
            setattr(pipe, name, value)
        assert {n: getattr(pipe, n) for n in before} == before
        pipe(x)
        assert int(pipe[1].num_batches_tracked) == 1  # one mini-batch: deferred batch norm still on
    pipe.balance.append(5)  # a copy: the Pipe's own split cannot be edited through it
    assert pipe.balance == [1, 2]


def test_a_pipe_pickled_with_plain_setting_attributes_still_loads():
    with Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], spread_tuples=True) as pipe:
        state = pipe.__getstate__()
    for name in ("balance", "devices", "deferred_batch_norm", "spread_tuples", "intra_op_threads"):
        state[name] = state.pop(f"_{name}")  # as the attributes were stored before they were read-only
    old = Pipe.__new__(Pipe)
    old.__setstate__(state)
    with old:
        assert (old.balance, old.spread_tuples, old.deferred_batch_norm) == ([1, 1], True, False)
        assert old(torch.ones(3, 2)).shape == (3, 2)


def test_layers_set_added_or_deleted_on_a_built_pipe_are_refused():
    # The partitions were built from the layers given: a module put on the Pipe later would
    # show in pipe[i], parameters() and state_dict() but never run.
    x = torch.randn(4, 2)
    with Pipe(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2)), [1, 2]) as pipe:
        expected = pipe(x)
        attempts = {
            "layer '2' cannot be replaced": lambda: setattr(pipe, "2", nn.Linear(2, 2)),
            "layer '1' cannot be replaced": lambda: setattr(pipe, "1", None),
            "a module as attribute 'aux' cannot be added": lambda: setattr(pipe, "aux", nn.Linear(2, 2)),
            "a module as attribute 'head' cannot be added": lambda: pipe.register_module("head", nn.ReLU()),
            "layer '0' cannot be deleted": lambda: delattr(pipe, "0"),
            "layer '0' cannot be replaced ": lambda: nn.SyncBatchNorm.convert_sync_batchnorm(pipe),
        }
        for words, attempt in attempts.items():
            with pytest.raises(TypeError, match=rf"a Pipe's layers are fixed when it is built: {words}"):
                attempt()
        assert [type(layer) for layer in pipe] == [nn.Linear, nn.BatchNorm1d, nn.Linear]
        assert len(pipe) == 3 and len(list(pipe.parameters())) == 6
        assert torch.equal(pipe(x), expected)
        pipe.note = "plain attributes are fine"
        with torch.no_grad():
            pipe[2].weight.zero_()  # a change inside a layer runs
            pipe[2].bias.fill_(7.0)
        assert torch.equal(pipe(x), torch.full((4, 2), 7.0))


def test_layers_swapped_through_the_partitions_or_pipe_items_are_refused():
    # pipe.partitions[i] holds the layers the workers run; a layer swapped there alone would
    # run without being in parameters() or state_dict(), so no optimizer would train it.
    x = torch.randn(4, 2)
    with Pipe(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2)),
              [2, 2]) as pipe:
        expected = pipe(x)
        attempts = {
            r"pipe\[1\] \(layer '1'\) cannot be replaced": lambda: pipe.__setitem__(1, nn.Tanh()),
            r"pipe\[0:2\] \(layers '0', '1'\) cannot be deleted": lambda: pipe.__delitem__(slice(0, 2)),
            r"pipe\[9\] cannot be replaced": lambda: pipe.__setitem__(9, nn.Tanh()),
            r"child '1' of pipe.partitions\[0\] cannot be replaced .*parameters\(\) and state_dict\(\) would not hold it":
                lambda: pipe.partitions[0].__setitem__(1, nn.Tanh()),
            r"child '2' of pipe.partitions\[0\] cannot be added": lambda: pipe.partitions[0].append(nn.Tanh()),
            r"child '0' of pipe.partitions\[0\] cannot be inserted": lambda: pipe.partitions[0].insert(0, nn.Tanh()),
            r"child '2' of pipe.partitions\[1\] cannot be deleted": lambda: pipe.partitions[1].pop(0),
            r"child 'aux' of pipe.partitions\[1\] cannot be added": lambda: setattr(pipe.partitions[1], "aux", nn.ReLU()),
            r"child '2' of pipe.partitions cannot be added .*a worker was started for each partition":
                lambda: pipe.partitions.append(nn.Sequential(nn.ReLU())),
            r"child '0' of pipe.partitions cannot be replaced": lambda: pipe.partitions.__setitem__(0, nn.ReLU()),
            r"child '1' of pipe.partitions cannot be deleted": lambda: pipe.partitions.__delitem__(1),
        }
        for words, attempt in attempts.items():
            with pytest.raises(TypeError, match=rf"a Pipe's layers are fixed when it is built: {words}"):
                attempt()
        assert [type(layer) for layer in pipe] == [nn.Linear, nn.ReLU, nn.Sequential, nn.Linear]
        assert [list(p._modules) for p in pipe.partitions] == [["0", "1"], ["2", "3"]]
        assert torch.equal(pipe(x), expected)
        copied = copy.deepcopy(pipe)  # a copy's partitions are fixed too
        with pytest.raises(TypeError, match="child '0' of pipe.partitions\\[0\\] cannot be replaced"):
            copied.partitions[0][0] = nn.Tanh()
        copied.close()
        pipe[2].append(nn.Tanh())  # inside a layer: runs
        assert torch.equal(pipe(x), pipe[3](torch.tanh(pipe[2][0](pipe[1](pipe[0](x))))))


@pytest.mark.parametrize("spread_tuples", [False, True])
def test_a_pipe_pickled_with_plain_partition_containers_loads_with_them_fixed(spread_tuples):
    # Review (s31): a Pipe pickled before the containers were fixed kept plain ones, which took a
    # swapped layer that ran without being the Pipe's.
    from collections import OrderedDict

    from torchpipe.partition import SpreadingSequential

    x = torch.randn(3, 2)
    with Pipe(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)), [2, 1], spread_tuples=spread_tuples) as pipe:
        expected = pipe(x)
        state = pipe.__getstate__()
    plain = SpreadingSequential if spread_tuples else nn.Sequential
    state["partitions"] = nn.ModuleList([plain(OrderedDict(p._modules)) for p in state["partitions"]])
    old = Pipe.__new__(Pipe)
    old.__setstate__(state)
    with old:
        assert type(old.partitions[1]).__name__ == ("SpreadingPartition" if spread_tuples else "PartitionSequential")
        with pytest.raises(TypeError, match=r"child '2' of pipe.partitions\[0\] cannot be added"):
            old.partitions[0].append(nn.ReLU())
        with pytest.raises(TypeError, match="child '2' of pipe.partitions cannot be added"):
            old.partitions.append(nn.Sequential())
        assert torch.equal(old(x), expected)


def test_too_few_devices_is_an_index_error():
    with pytest.raises(IndexError, match="devices: 2, partitions: 3"):
        Pipe(model(3), [1, 1, 1], devices=["cpu", "cpu"])


def test_module_must_be_a_sequential():
    with pytest.raises(TypeError, match="must be nn.Sequential.*got ModuleList"):
        Pipe(nn.ModuleList([nn.Linear(4, 4)]), [1])


class _Residual(nn.Sequential):
    def forward(self, x):
        return x + super().forward(x)


def _with_forward_hook():
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    module.register_forward_hook(lambda *args: None)
    return module


def _with_full_backward_hook():
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    module.register_full_backward_hook(lambda *args: None)
    return module


def _with_state_dict_hook():
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    module.register_state_dict_post_hook(lambda *args: None)
    return module


def _with_load_state_dict_hook():
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    module.register_load_state_dict_post_hook(lambda *args: None)
    return module


def _with_own_parameter():
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    module.temperature = nn.Parameter(torch.ones(1))
    return module


def _with_own_buffer():
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    module.register_buffer("scale", torch.ones(1))
    return module


class _CallsTwice(nn.Sequential):
    def __call__(self, x):
        return super().__call__(super().__call__(x))


def _with_forward_on_the_instance():
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    module.forward = lambda x: 2 * nn.Sequential.forward(module, x)
    return module


@pytest.mark.parametrize("build, error, words", [
    (lambda: _Residual(nn.Linear(4, 4), nn.ReLU()), TypeError, "_Residual overrides nn.Sequential's forward"),
    (lambda: _CallsTwice(nn.Linear(4, 4), nn.ReLU()), TypeError, r"_CallsTwice overrides nn.Sequential's forward \(or "
                                                                 r"its call\)"),
    (_with_forward_on_the_instance, TypeError, "Sequential overrides nn.Sequential's forward"),
    (_with_forward_hook, ValueError, r"module hooks of its own \(forward_hooks\)"),
    (_with_full_backward_hook, ValueError, r"module hooks of its own \(backward_hooks\)"),
    (_with_state_dict_hook, ValueError, r"state-dict hooks of its own \(state_dict_hooks\).*on the Pipe instead"),
    (_with_load_state_dict_hook, ValueError, r"state-dict hooks of its own \(load_state_dict_post_hooks\)"),
    (_with_own_parameter, ValueError, r"parameters or buffers of its own, not under a child \(temperature\)"),
    (_with_own_buffer, ValueError, r"parameters or buffers of its own, not under a child \(scale\)"),
])
def test_a_sequential_that_does_more_than_call_its_children_is_refused(build, error, words):
    """Review (helper-138): the pipeline calls the children only, so a Sequential's own forward
    (a residual around them), hooks, parameters and buffers silently dropped out: other outputs
    than the plain model's, and a state_dict the model could not load back."""
    module = build()
    with pytest.raises(error, match=words):
        Pipe(module, [1, 1])
    with pytest.raises(error, match=words):
        balance_by_time(2, module, torch.randn(4, 4))
    with pytest.raises(error, match=words):
        RetiredPipe(module)  # it kept the children only, too
    x = torch.randn(3, 4)
    torch.testing.assert_close(Pipe(nn.Sequential(*module), [1, 1])(x), nn.Sequential(*module)(x))  # its children run


def test_an_empty_slot_in_the_sequential_is_refused():
    """An entry set to None (``seq._modules['1'] = None``) was skipped by the split: balance
    [2, 1] then put layers 0 and 2 on the first partition and none on the second, and the Pipe
    ran a model the plain Sequential cannot run at all (it calls the None)."""
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    module._modules["1"] = None
    words = r"child '1' is None.*delete that slot, or put nn.Identity\(\) in it"
    with pytest.raises(TypeError, match=words):
        Pipe(module, [2, 1])
    with pytest.raises(TypeError, match=words):
        balance_by_time(2, module, torch.randn(4, 4))  # an AttributeError of its profiler before
    with pytest.raises(TypeError, match=words):
        RetiredPipe(module)
    with pytest.raises(TypeError, match="not callable"):
        module(torch.randn(3, 4))  # what the plain model does with it


def test_a_slice_of_a_spreading_pipe_builds_a_spreading_pipe():
    """Review (helper-142): the slice is a SpreadingSequential, whose forward is what a Pipe
    with spread_tuples=True runs; it was refused as a Sequential with a forward of its own."""

    class Pair(nn.Module):
        def forward(self, x):
            return x, 2 * x

    class Join(nn.Module):
        def forward(self, a, b):
            return a + b

    with Pipe(nn.Sequential(Pair(), Join(), nn.Linear(4, 4)), [1, 2], spread_tuples=True) as spreading:
        part = spreading[:]
        x = torch.randn(3, 4)
        with Pipe(part, [2, 1], spread_tuples=True) as again:
            torch.testing.assert_close(again(x), part(x))
        with pytest.raises(TypeError, match="SpreadingSequential overrides nn.Sequential's forward"):
            Pipe(part, [2, 1])  # would pass (a, b) to Join as one argument


def test_the_same_layer_twice_is_refused():
    layer = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="duplicate children.*'0' and '1'"):
        Pipe(nn.Sequential(layer, layer), [1, 1])
    with pytest.raises(ValueError, match="duplicate children.*'0' and '2'"):
        Pipe(nn.Sequential(layer, nn.ReLU(), layer), [2, 1])


def test_shared_parameters_and_buffers_are_refused():
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    with pytest.raises(ValueError, match="duplicate parameters.*'0' and '1'.*stash it with torchpipe.skip"):
        Pipe(nn.Sequential(first, second), [1, 1])  # the message says how to tie (s33)
    norm = nn.BatchNorm1d(4, affine=False)  # no parameter, but running statistics
    with pytest.raises(ValueError, match="duplicate buffers.*'0' and '2'"):
        Pipe(nn.Sequential(nn.Sequential(norm), nn.ReLU(), nn.Sequential(norm)), [1, 2])


def test_a_refused_module_is_left_untouched_and_no_thread_starts():
    before = torchpipe_threads()
    original = model()
    state = {k: v.clone() for k, v in original.state_dict().items()}
    for kwargs in (dict(balance=[1, 1]), dict(balance=[2, 2], chunks=0), dict(balance=[2, 2], checkpoint="x"),
                   dict(balance=[1, 1, 1, 1], devices=["cpu"])):
        with pytest.raises((ValueError, IndexError)):
            Pipe(original, **kwargs)
        assert names(original) == ["0", "1", "2", "3"]
        assert all(torch.equal(state[k], v) for k, v in original.state_dict().items())
    assert torchpipe_threads() <= before


def test_numpy_and_tensor_integers_count_as_integers():
    """torchgpipe accepts them (balance_by_time results, configs read through NumPy)."""
    import numpy as np

    with Pipe(model(), np.array([1, 3]), chunks=np.int64(2)) as pipe:
        assert pipe.balance == [1, 3] and pipe.chunks == 2
        assert all(type(n) is int for n in pipe.balance) and type(pipe.chunks) is int
    with Pipe(model(), [torch.tensor(2), 2], chunks=torch.tensor(3)) as pipe:
        assert pipe.balance == [2, 2] and pipe.chunks == 3
    with pytest.raises(BalanceError, match="positive integers"):
        Pipe(model(), [np.float64(2.0), 2])
    with pytest.raises(ValueError, match="number of chunks"):
        Pipe(model(), [2, 2], chunks=torch.tensor(True))


def test_chunks_passed_as_balance_gets_a_hint():
    """PyTorch's retired Pipe took chunks as its second argument: Pipe(model, 4)."""
    with pytest.raises(BalanceError, match=r"got 4 \(to split into micro-batches, pass chunks=4\)"):
        Pipe(model(), 4)


def test_devices_as_one_string_is_refused():
    with pytest.raises(TypeError, match=r"devices must be a sequence.*got 'cpu'.*devices=\['cpu'\] \* 2"):
        Pipe(model(), [2, 2], devices="cpu")


@pytest.mark.parametrize("kwargs, error, words", [
    ({"devices": 3}, TypeError, "devices must be a sequence of devices, one per partition, got 3"),
    ({"deferred_batch_norm": "no"}, TypeError, "deferred_batch_norm must be a bool, got 'no'"),
    ({"deferred_batch_norm": 1}, TypeError, "deferred_batch_norm must be a bool, got 1"),
    ({"intra_op_threads": "2"}, TypeError, "intra_op_threads must be a positive int or None, got '2'"),
])
def test_bad_settings_name_the_argument_and_start_no_thread(kwargs, error, words):
    """A truthy string turned deferred batch norm on; devices=3 failed inside a loop, unnamed."""
    before = torchpipe_threads()
    layers = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    with pytest.raises(error, match=words):
        Pipe(layers, [1, 2], **kwargs)
    assert type(layers[1]) is nn.BatchNorm1d
    assert torchpipe_threads() == before


def test_last_memory_is_none_until_a_step_completes():
    """It was missing on a new Pipe (AttributeError), and kept the previous step's record after a failure."""
    with Pipe(model(), [2, 2], devices=["cpu"] * 2, chunks=2) as pipe:
        assert pipe.last_memory is None
        x, y = torch.randn(4, 4), torch.randn(4, 4)
        pipe(x)
        assert pipe.last_memory is None
        pipe.step(x, y, nn.MSELoss())
        assert pipe.last_memory is not None

        def failing_loss(output, target):
            raise RuntimeError("loss failed")

        with pytest.raises(RuntimeError, match="loss failed"):
            pipe.step(x, y, failing_loss, reduction="mean")
        assert pipe.last_memory is None


@pytest.mark.parametrize("loss_fn", [None, "mse"])
def test_a_loss_that_is_not_callable_is_refused_before_any_forward(loss_fn):
    with Pipe(model(), [2, 2], devices=["cpu"] * 2, chunks=2) as pipe:
        with pytest.raises(TypeError, match=f"loss_fn must be callable.*got {loss_fn!r}"):
            pipe.step(torch.randn(4, 4), torch.randn(4, 4), loss_fn, reduction="sum")
        assert pipe.last_step is None


def test_a_meta_target_is_refused_before_anything_runs():
    """Review: torch failed with "Cannot copy out of meta tensor" after evaluate's whole forward
    had run and replaced last_step. (A meta input fails in its copy to the first stage, a copy
    fault like any other: see test_reliability.)"""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with Pipe(model, [2, 1], chunks=2) as pipe:
        pipe.step(x, y, nn.MSELoss())
        record, memory = pipe.last_step, pipe.last_memory
        calls = {
            "step target": (lambda: pipe.step(x, y.to("meta"), nn.MSELoss()), "target"),
            "evaluate target": (lambda: pipe.evaluate(x, (y.to("meta"),), nn.MSELoss()), "target"),
        }
        for name, (call, what) in calls.items():
            with pytest.raises(ValueError, match=rf"the {what} has a tensor on the 'meta' device \(shape \(8, \d\)\)"):
                call()
            assert pipe.last_step is record and pipe.last_memory is memory, name
    with pytest.raises(ValueError, match="number of chunks must be a positive integer, got tensor"):
        Pipe(nn.Sequential(nn.Linear(4, 4)), [1], chunks=torch.tensor(2, device="meta"))


class _ReturnsADict(nn.Module):
    def forward(self, x):
        return {"h": x}


class _FreezesItsInput(nn.Module):
    def forward(self, x):
        x.requires_grad_(False)
        return x * 2


@pytest.mark.parametrize("call", ["forward", "step"])
def test_a_partition_that_returns_a_dict_is_named(call):
    """Review (helper-147): the TypeError said "got dict" without the partition."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), _ReturnsADict(), nn.Linear(4, 4))
    with Pipe(model, [1, 2, 1], chunks=2) as pipe:
        with pytest.raises(TypeError, match="got dict") as caught:
            if call == "forward":
                pipe(torch.randn(4, 4))
            else:
                pipe.step(torch.randn(4, 4), torch.zeros(4, 4), nn.MSELoss())
    assert any("returned by partition 1 (its last layer: _ReturnsADict)" in note for note in caught.value.__notes__)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_requires_grad_false_on_a_stage_input_is_refused_under_step_as_the_plain_model_refuses_it(checkpoint):
    """Review (helper-147): the input of a later stage is a leaf under Pipe.step, so the flag
    could be turned off there, and the earlier partitions silently got no gradient."""
    model = nn.Sequential(nn.Linear(4, 4), _FreezesItsInput(), nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="leaf variables"):
        model(torch.randn(6, 4))
    with Pipe(model, [1, 2], chunks=2, checkpoint=checkpoint) as pipe:
        with pytest.raises(RuntimeError, match=r"partition 1: a layer called requires_grad_\(False\) on the partition's "
                                               "input"):
            pipe.step(torch.randn(6, 4), torch.zeros(6, 4), nn.MSELoss())
    assert model[0].weight.grad is None  # refused before any backward
