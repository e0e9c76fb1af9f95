"""State dicts of PyTorch's retired ``Pipe``: refused by ``load_state_dict``, converted by ``retired_pipe_state_dict``."""
import copy
from collections import OrderedDict
from typing import List, Sequence

import pytest
import torch
from torch import nn

from torchpipe import Pipe
from torchpipe.partition import BalanceError
from torchpipe.retired import retired_pipe_state_dict


def retired_layout(model: nn.Sequential, balance: Sequence[int]) -> nn.Module:
    """The module tree the retired torch ``Pipe`` saved: per partition, an ``nn.Sequential`` of
    its children renumbered from 0, children that are themselves ``nn.Sequential`` flattened
    (its ``_assemble_partition``), under ``partitions``."""
    children = list(model.children())
    partitions: List[nn.Sequential] = []
    start = 0
    for size in balance:
        layers: List[nn.Module] = []
        for child in children[start:start + size]:
            layers.extend(child.children() if isinstance(child, nn.Sequential) else [child])
        partitions.append(nn.Sequential(*layers))
        start += size
    holder = nn.Module()
    holder.partitions = nn.ModuleList(partitions)
    return holder


def named_model() -> nn.Sequential:
    return nn.Sequential(OrderedDict([
        ("embed", nn.Linear(4, 6)), ("act", nn.ReLU()),
        ("block", nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))),
        ("norm", nn.LayerNorm(6)), ("head", nn.Linear(6, 3)),
    ]))


def unnamed_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))


def nested_model() -> nn.Sequential:
    return nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4))


@pytest.mark.parametrize("make, balance", [
    (unnamed_model, [1, 1, 1, 1]),  # on CPU the retired Pipe made one partition per child
    (unnamed_model, [2, 2]),        # on GPUs, one per run of children on a device
    (named_model, [1, 1, 1, 1, 1]),
    (named_model, [2, 3]),
    # One GPU: a single partition, numbered like torchgpipe's but with the nested Sequential
    # flattened, so by name partitions.0.1 (its inner second Linear) would load into layer 1.
    (nested_model, [2]),
])
@pytest.mark.parametrize("strict", [True, False])
def test_a_retired_state_dict_is_refused_before_anything_loads(make, balance, strict):
    torch.manual_seed(0)
    trained = make()
    saved = retired_layout(trained, balance).state_dict()
    with Pipe(make(), [len(trained) - 1, 1]) as pipe:
        before = copy.deepcopy(pipe.state_dict())
        with pytest.raises(ValueError, match=r"partitions\.\d.*retired_pipe_state_dict"):
            pipe.load_state_dict(saved, strict=strict)
        for name, tensor in pipe.state_dict().items():
            assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize("make, balance", [
    (unnamed_model, [1, 1, 1, 1]),
    (unnamed_model, [1, 3]),
    (named_model, [1, 1, 1, 1, 1]),
    (named_model, [3, 2]),
])
def test_a_converted_retired_state_dict_loads_into_any_balance_and_the_plain_model(make, balance):
    torch.manual_seed(0)
    trained = make()
    saved = retired_layout(trained, balance).state_dict()
    converted = retired_pipe_state_dict(saved, make(), balance)
    assert converted.keys() == trained.state_dict().keys()
    plain = make()
    plain.load_state_dict(converted)
    with Pipe(make(), [2, len(trained) - 2]) as pipe:
        pipe.load_state_dict(converted)
        for want, got_plain, got_pipe in zip(trained.parameters(), plain.parameters(), pipe.parameters()):
            assert torch.equal(got_plain, want) and torch.equal(got_pipe, want)
        again = retired_pipe_state_dict(saved, pipe, balance)  # a Pipe of the model serves too
        assert again.keys() == converted.keys()


def test_the_conversion_keeps_a_prefix_and_other_keys():
    torch.manual_seed(0)
    trained = unnamed_model()
    saved = {"net." + key: value for key, value in retired_layout(trained, [2, 2]).state_dict().items()}
    saved["step"] = torch.tensor(7)
    converted = retired_pipe_state_dict(saved, unnamed_model(), [2, 2], prefix="net.")
    assert set(converted) == {"net." + key for key in trained.state_dict()} | {"step"}


def test_the_conversion_refuses_a_balance_that_does_not_fit():
    saved = retired_layout(unnamed_model(), [1, 1, 1, 1]).state_dict()
    with pytest.raises(ValueError, match=r"partitions\.2\.0\.weight.*\[2, 2\] under balance \[2, 2\]"):
        retired_pipe_state_dict(saved, unnamed_model(), [2, 2])  # the wrong sizes: partition 2 does not exist
    with pytest.raises(BalanceError):
        retired_pipe_state_dict(saved, unnamed_model(), [1, 1])  # does not cover the model


def test_torchgpipe_layouts_are_not_taken_for_retired_ones():
    """Names in one partition each and in the model's order: loaded by name, as before."""
    torch.manual_seed(0)
    trained = named_model()
    saved = {f"partitions.{0 if name.split('.')[0] in ('embed', 'act') else 1}.{name}": value
             for name, value in trained.state_dict().items()}
    with Pipe(named_model(), [1, 4]) as pipe:
        pipe.load_state_dict(saved)
        for want, got in zip(trained.parameters(), pipe.parameters()):
            assert torch.equal(got, want)
        backwards = {key.replace("partitions.0.", "partitions.2.", 1): value for key, value in saved.items()}
        with pytest.raises(ValueError, match=r"partitions\.2 name layers that come before those of partitions\.1"):
            pipe.load_state_dict(backwards)  # embed's partition after head's: renumbered, not torchgpipe's


# ---------------------------------------------------------------- torchpipe.retired.Pipe

class Mix(nn.Module):
    """A layer of the retired calling convention: two arguments in, two out."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, a, b):
        return torch.tanh(self.linear(a)) + b, b * 0.5 + a


class Merge(nn.Module):
    def forward(self, a, b):
        return a * b


class DropFirst(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.dropout = nn.Dropout(p)

    def forward(self, a, b):
        return self.dropout(a), b


def retired_model():
    torch.manual_seed(0)
    return nn.Sequential(Mix(), nn.Sequential(Mix(), DropFirst(0.2), Mix()), Mix(), Merge()).double()


def spread_reference(model):
    from torchpipe.partition import SpreadingSequential

    return SpreadingSequential(*copy.deepcopy(model))


@pytest.mark.parametrize("chunks, checkpoint", [(1, "never"), (3, "never"), (3, "always"), (3, "except_last")])
def test_the_retired_pipe_spreads_tuples_and_takes_several_inputs(chunks, checkpoint):
    """Review (the retired suite's input_pair, valid_non_tensor, uneven_batch_size): its models
    take several inputs, and a layer's tuple output is spread over the next layer's arguments."""
    from torchpipe.retired import Pipe as RetiredPipe

    model = retired_model()
    reference = spread_reference(model)
    a, b = torch.randn(7, 4, dtype=torch.double), torch.randn(7, 4, dtype=torch.double)
    with RetiredPipe(model, chunks=chunks, checkpoint=checkpoint) as pipe:
        assert pipe.balance == [1, 1, 1, 1] and pipe.devices == [torch.device("cpu")] * 4
        torch.manual_seed(1)
        out = pipe(a, b)
        torch.manual_seed(1)
        expected = reference(a, b) if chunks == 1 else torch.cat(
            [reference(x, y) for x, y in zip(a.chunk(chunks), b.chunk(chunks))])
        if chunks == 1:
            assert torch.equal(out, expected)
        out.sum().backward()
        expected.sum().backward()
        for (name, got), want in zip(pipe.named_parameters(), reference.parameters()):
            if chunks == 1:
                assert torch.equal(got.grad, want.grad), name
            else:  # dropout draws per micro-batch; compare where the arithmetic is the same
                assert got.grad is not None and got.grad.shape == want.grad.shape, name
    with RetiredPipe(retired_model().eval(), chunks=chunks, checkpoint=checkpoint) as pipe:
        reference = spread_reference(retired_model().eval())
        torch.testing.assert_close(pipe(a, b), reference(a, b))
        pipe(a, b).sum().backward()
        reference(a, b).sum().backward()
        for (name, got), want in zip(pipe.named_parameters(), reference.parameters()):
            torch.testing.assert_close(got.grad, want.grad, msg=name)


def test_the_retired_pipe_steps_a_tuple_input_and_slices_like_it_runs():
    from torchpipe.retired import Pipe as RetiredPipe

    model = retired_model().eval()
    reference = spread_reference(model)
    a, b, target = (torch.randn(6, 4, dtype=torch.double) for _ in range(3))
    with RetiredPipe(model, chunks=2) as pipe:
        for schedule in ("gpipe", "1f1b", "zb-h1"):
            pipe.zero_grad()
            reference.zero_grad()
            loss = pipe.step((a, b), target, nn.MSELoss(), schedule=schedule)
            expected = nn.MSELoss()(reference(a, b), target)
            expected.backward()
            torch.testing.assert_close(loss, expected.detach())
            for (name, got), want in zip(pipe.named_parameters(), reference.parameters()):
                torch.testing.assert_close(got.grad, want.grad, msg=f"{schedule} {name}")
        head = pipe[:2]
        torch.testing.assert_close(head(a, b)[0], reference[:2](a, b)[0])
        copied = copy.deepcopy(pipe)
        try:
            torch.testing.assert_close(copied(a, b), reference(a, b))
        finally:
            copied.close()
        with pytest.raises(TypeError, match="at least one input"):
            pipe()


def test_the_retired_pipe_places_with_device_and_refuses_what_the_retired_one_refused():
    from torchpipe.retired import Pipe as RetiredPipe
    from torchpipe.retired import WithDevice, retired_split

    layers = nn.Sequential(nn.Linear(4, 4), WithDevice(nn.ReLU(), "cpu"), nn.Linear(4, 4))
    unwrapped, balance, devices = retired_split(layers)
    assert balance == [1, 1, 1] and isinstance(unwrapped[1], nn.ReLU)
    with RetiredPipe(layers, chunks=2) as pipe:
        x = torch.randn(4, 4)
        torch.testing.assert_close(pipe(x), unwrapped(x))
    with pytest.raises(TypeError, match="nn.Sequential"):
        RetiredPipe(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="chunks"):
        RetiredPipe(nn.Sequential(nn.Linear(2, 2)), chunks=0)
    with pytest.raises(TypeError, match="WithDevice wraps an nn.Module, got int: 5"):
        WithDevice(5, "cpu")
    with pytest.raises(ValueError, match="invalid device 'gpu'"):
        WithDevice(nn.ReLU(), "gpu")
    with pytest.raises(TypeError, match="state_dict must be a mapping .*got list"):
        retired_pipe_state_dict([1], layers, [3])
    with pytest.raises(TypeError, match="model must be the nn.Sequential .*got list"):
        retired_pipe_state_dict({}, [nn.ReLU()], [1])


def test_the_retired_pipe_loads_the_retired_pipes_state_dicts_as_they_are():
    from torchpipe.retired import Pipe as RetiredPipe

    trained = retired_model()
    saved = retired_layout(trained, [1, 1, 1, 1]).state_dict()  # the retired Pipe on CPU
    assert "partitions.1.2.linear.weight" in saved  # the nested Sequential, flattened
    with RetiredPipe(retired_model(), chunks=2) as pipe:
        for module in pipe.modules():
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.weight)
        pipe.load_state_dict(saved)
        for want, got in zip(trained.parameters(), pipe.parameters()):
            assert torch.equal(got, want)
        assert pipe.state_dict().keys() == trained.state_dict().keys()  # saves the model's own names
        pipe.load_state_dict(trained.state_dict())  # and loads them


def test_the_retired_packages_flags_come_from_the_retired_module():
    # torch.distributed.pipeline.sync exported is_checkpointing and is_recomputing beside Pipe.
    import torchpipe
    from torchpipe import retired

    assert retired.is_checkpointing is torchpipe.is_checkpointing
    assert retired.is_recomputing is torchpipe.is_recomputing
    seen = []

    class Record(nn.Module):
        def forward(self, x):
            seen.append((retired.is_checkpointing(), retired.is_recomputing()))
            return x * 2

    with retired.Pipe(nn.Sequential(nn.Linear(2, 2), Record()), chunks=1, checkpoint="always") as pipe:
        pipe(torch.randn(2, 2, requires_grad=True)).sum().backward()
    assert seen == [(True, False), (False, True)]
