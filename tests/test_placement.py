"""balance=None: the constructor form of PyTorch's retired Pipe (children already placed)."""
import pytest
import torch
from torch import nn

from torchpipe import Pipe
from torchpipe.partition import infer_placement


def placed_model():
    # Two layers on the CPU, then an activation without parameters, then two on 'meta'.
    return nn.Sequential(
        nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU(),
        nn.Linear(4, 4, device="meta"), nn.Linear(4, 4, device="meta"),
    )


def test_children_are_grouped_by_the_device_they_live_on():
    balance, devices = infer_placement(placed_model())
    # The parameter-less ReLU joins the group before it.
    assert balance == [3, 2]
    assert devices == [torch.device("cpu"), torch.device("meta")]


def test_leading_parameterless_children_join_the_first_placed_group():
    model = nn.Sequential(nn.ReLU(), nn.Linear(4, 4, device="meta"), nn.Linear(4, 4))
    assert infer_placement(model) == ([2, 1], [torch.device("meta"), torch.device("cpu")])


def test_pipe_without_balance_uses_the_placement():
    with Pipe(placed_model(), chunks=2) as pipe:
        assert pipe.balance == [3, 2]
        assert pipe.devices == [torch.device("cpu"), torch.device("meta")]
        out = pipe(torch.randn(6, 4))
        assert out.device.type == "meta" and out.shape == (6, 4)


def test_without_placement_or_balance_the_error_points_to_torchpipe_balance():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="torchpipe.balance"):
        Pipe(model)
    with pytest.raises(ValueError, match="torchpipe.balance"):
        Pipe(model, devices=["cpu", "cpu"])


def test_a_child_spread_over_two_devices_is_named():
    class Spread(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2, device="meta")

    with pytest.raises(ValueError, match="child '1'"):
        infer_placement(nn.Sequential(nn.Linear(2, 2), Spread()))
