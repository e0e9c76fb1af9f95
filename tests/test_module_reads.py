"""The per-call module reads give what nn.Module's own (getattr, parameters()) give."""
import pytest
import torch
from torch import nn

from torchpipe.module_reads import optional_attribute, parameters_in_order

MISSING = object()


class WithProperty(nn.Module):
    @property
    def flag(self):
        return "from the property"


class WithFailingProperty(nn.Module):
    @property
    def flag(self):
        raise AttributeError("computed, and absent")


class WithClassAttribute(nn.Module):
    flag = "from the class"


class WithOwnGetattr(nn.Module):
    def __getattr__(self, name):
        if name == "flag":
            return "made up"
        return super().__getattr__(name)


class WithShadowedProperty(nn.Module):  # a data descriptor wins over the instance's __dict__
    @property
    def flag(self):
        return "from the property"

    @flag.setter
    def flag(self, value):
        self.__dict__["flag"] = value


def _holders():
    plain = nn.Linear(2, 2)
    in_dict = nn.ReLU()
    in_dict.flag = "in __dict__"
    parameter = nn.Module()
    parameter.flag = nn.Parameter(torch.ones(1))
    buffer = nn.Module()
    buffer.register_buffer("flag", torch.ones(1))
    child = nn.Module()
    child.flag = nn.Identity()
    shadowed = WithShadowedProperty()
    shadowed.flag = "in __dict__"
    class Plain:
        flag = "on a plain object"
    return {"a module without it": plain, "a plain object without it": object(), "a plain object with it": Plain(),
            "in __dict__": in_dict, "a parameter": parameter, "a buffer": buffer, "a child module": child,
            "a property": WithProperty(), "a property that raises AttributeError": WithFailingProperty(),
            "a class attribute": WithClassAttribute(), "a __getattr__ of its own": WithOwnGetattr(),
            "a property over __dict__": shadowed}


@pytest.mark.parametrize("holder", list(_holders()))
def test_optional_attribute_reads_what_getattr_reads(holder):
    obj = _holders()[holder]
    assert optional_attribute(obj, "flag", MISSING) is getattr(obj, "flag", MISSING)
    assert optional_attribute(obj, "absent", MISSING) is MISSING


def test_parameters_in_order_lists_what_parameters_lists():
    shared = nn.Linear(2, 2)
    tied = nn.Linear(2, 2)
    tied.weight = shared.weight  # one parameter in two modules: listed once, where first seen
    no_bias = nn.Linear(2, 2, bias=False)  # a None parameter: skipped
    root = nn.Sequential(nn.Sequential(shared, nn.ReLU()), tied, no_bias, shared, nn.BatchNorm1d(2))
    assert [id(p) for p in parameters_in_order(root)] == [id(p) for p in root.parameters()]
    assert parameters_in_order(nn.ReLU()) == []
