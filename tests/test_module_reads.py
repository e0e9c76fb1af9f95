"""The per-call module reads give what nn.Module's own (getattr, parameters()) give."""
import types

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


class WithOwnGetattribute(nn.Module):
    def __getattribute__(self, name):
        if name == "flag":
            return "from __getattribute__"
        return super().__getattribute__(name)


class WithDynamicClassAttribute(nn.Module):
    @types.DynamicClassAttribute
    def flag(self):
        return "dynamic"


class _InstanceOnly:
    """A data descriptor that raises AttributeError when read on the class."""

    def __get__(self, obj, owner=None):
        if obj is None:
            raise AttributeError("read on an instance only")
        return "via descriptor"

    def __set__(self, obj, value):
        obj.__dict__["flag"] = value


class WithInstanceOnlyDescriptor(nn.Module):
    flag = _InstanceOnly()


class PosingAsAModule:  # isinstance says nn.Module; its type has no nn.Module.__getattr__
    __class__ = property(lambda self: nn.Linear)


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
            "a property over __dict__": shadowed, "a __getattribute__ of its own": WithOwnGetattribute(),
            "a DynamicClassAttribute": WithDynamicClassAttribute(),
            "a descriptor that raises on the class": WithInstanceOnlyDescriptor(),
            "an object posing as a module": PosingAsAModule()}


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
