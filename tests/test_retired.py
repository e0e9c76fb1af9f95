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


@pytest.mark.parametrize("make, balance", [
    (unnamed_model, [1, 1, 1, 1]),  # on CPU the retired Pipe made one partition per child
    (unnamed_model, [2, 2]),        # on GPUs, one per run of children on a device
    (named_model, [1, 1, 1, 1, 1]),
    (named_model, [2, 3]),
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
