"""Split an ``nn.Sequential`` into partitions and check that it can be split at all."""
from __future__ import annotations

import collections.abc
import operator
from collections import OrderedDict
from typing import Any, List, Optional, Sequence, Tuple, cast

import torch
from torch import nn

from .devices import as_device

__all__ = ["verify_module", "verify_only_children_run", "verify_unshared", "verify_balance", "split_module",
           "infer_placement", "BalanceError", "as_positive_int",
           "SpreadingSequential", "PartitionSequential", "SpreadingPartition", "PartitionList", "layers_fixed_error",
           "fixed_partitions"]


class BalanceError(ValueError):
    """The balance does not describe a split of the module."""


def verify_module(module: nn.Module, spread_tuples: bool = False) -> None:
    """Reject what a pipeline cannot run: non-Sequential modules, shared children or parameters."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be nn.Sequential to be partitioned, got {type(module).__name__}")
    verify_only_children_run(module, spread_tuples)
    # named_children() drops repeats, so count the Sequential's own slots.
    verify_unshared(list(module._modules.items()))


_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_STATE_DICT_HOOKS = ("_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks")


def verify_only_children_run(module: nn.Sequential, spread_tuples: bool = False) -> None:
    """Reject a Sequential that does more than call its children in order, or has an empty slot.

    A pipeline calls the children, one partition after another, and never the Sequential
    itself: a ``forward`` of its own, its own module or state-dict hooks, and parameters or
    buffers not under a child would silently drop out of the pipelined model (and out of its
    ``state_dict``).
    A `SpreadingSequential` (a slice of a ``spread_tuples`` Pipe) runs as such a Pipe does.
    """
    kind = type(module)
    name = kind.__name__
    empty = [slot for slot, child in module._modules.items() if child is None]
    if empty:
        raise TypeError(f"the {name}'s child {empty[0]!r} is None, which a Sequential cannot call ('NoneType' object "
                        "is not callable) and a pipeline would silently skip, shifting the balance: delete that "
                        "slot, or put nn.Identity() in it")
    runs_as_pipeline = {nn.Sequential.forward, SpreadingSequential.forward} if spread_tuples else {nn.Sequential.forward}
    if (kind.forward not in runs_as_pipeline or "forward" in vars(module) or kind.__call__ is not nn.Module.__call__
            or kind._call_impl is not nn.Module._call_impl):
        raise TypeError(f"{name} overrides nn.Sequential's forward (or its call), which a pipeline never calls: it "
                        "runs the children one after another. Move that work into a layer of its own (a child), or "
                        "pass a plain nn.Sequential")
    hooks = [attribute.strip("_") for attribute in _MODULE_HOOKS if getattr(module, attribute, None)]
    if hooks:
        raise ValueError(f"the {name} has module hooks of its own ({', '.join(hooks)}), which would never run: a "
                         "pipeline calls its children, not the Sequential. Register them on its first or last "
                         "child instead")
    state_hooks = [attribute.strip("_") for attribute in _STATE_DICT_HOOKS if getattr(module, attribute, None)]
    if state_hooks:
        raise ValueError(f"the {name} has state-dict hooks of its own ({', '.join(state_hooks)}), which would never "
                         "run: a Pipe's state_dict is built from its partitions. Register them on the Pipe instead "
                         "(its state_dict has the same keys)")
    own = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
    if own:
        raise ValueError(f"the {name} holds parameters or buffers of its own, not under a child ({', '.join(own)}): "
                         "a pipeline keeps only its children's. Move them into a layer")


def verify_unshared(layers: Sequence[Tuple[str, Optional[nn.Module]]], since: str = "") -> None:
    """Reject a layer found twice in ``layers`` (name, layer), or a parameter or buffer two of them share.

    Checked when a Pipe is built, and again before a call once a layer changed inside
    (``since`` then says so in the message): two workers would update a shared running
    statistic at once.
    """
    owners: dict = {}
    for name, child in layers:
        first = owners.setdefault(id(child), name)
        if first != name:
            raise ValueError(
                f"{since}module with duplicate children is not supported: the same layer object is "
                f"children {first!r} and {name!r}"
            )
    # Shared parameters, or buffers (running statistics), would be updated by two workers at once.
    seen: dict = {}
    for name, child in layers:
        if child is None:
            continue
        for kind, tensors in (("parameter", child.parameters()), ("buffer", child.buffers())):
            for tensor in tensors:
                owner = seen.setdefault(id(tensor), name)
                if owner != name:
                    tie = (" To tie a weight across layers (an embedding and a language model's head), let the "
                           "first layer stash it with torchpipe.skip's @skippable(stash=[...]) and the later one "
                           "pop it (guide, section 7)") if kind == "parameter" else ""
                    raise ValueError(
                        f"{since}module with duplicate {kind}s on distinct children is not supported "
                        f"(children {owner!r} and {name!r} share a {kind}).{tie}"
                    )


def as_positive_int(value: Any) -> Optional[int]:
    """``value`` as an int if it is a positive integer (NumPy and 0-dim integer tensors too), else None.

    bool is refused: ``True`` is an int to Python, but never a meant count.
    """
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        return None  # no value to read (``int()`` of it raises a RuntimeError that names nothing)
    try:
        number = operator.index(value)
    except TypeError:
        return None
    return number if number > 0 else None


def verify_balance(balance: Sequence[int], num_layers: int) -> List[int]:
    """Check that ``balance`` is a list of positive ints summing to ``num_layers``."""
    if isinstance(balance, (collections.abc.Set, collections.abc.Mapping)):  # no order: the split would be a guess
        raise BalanceError(f"balance must be a sequence of positive integers in partition order, got a "
                           f"{type(balance).__name__}, which has no order: {balance!r}")
    try:
        values = list(balance)
    except TypeError:
        hint = ""
        if as_positive_int(balance) is not None:  # Pipe(model, 4): torch's retired Pipe took chunks second
            hint = f" (to split into micro-batches, pass chunks={balance!r})"
        raise BalanceError(f"balance must be a sequence of positive integers, got {balance!r}{hint}") from None
    if not values:
        raise BalanceError("balance is empty: expected at least one partition size")
    numbers = [as_positive_int(v) for v in values]
    if any(n is None for n in numbers):
        floats = any(isinstance(v, float) for v in values)
        hint = " (floats are refused, not rounded: compute sizes with //)" if floats else ""
        raise BalanceError(f"all balance numbers must be positive integers (balance: {values}){hint}")
    values = cast(List[int], numbers)
    if sum(values) != num_layers:
        raise BalanceError(
            f"module and sum of balance have different length (module: {num_layers}, sum of balance: {sum(values)}); "
            "a model that still changes can compute its balance with torchpipe.balance.balance_by_time or "
            "balance_by_size"
        )
    return values


def _device_of(module: nn.Module) -> Optional[torch.device]:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return None


def infer_placement(module: nn.Sequential) -> Tuple[List[int], List[torch.device]]:
    """Group consecutive children by the device their parameters already live on.

    Children without parameters or buffers join the group of the child before them (the
    first ones join the first placed child). Raises ValueError naming the child if one child
    spreads over several devices.
    """
    devices: List[Optional[torch.device]] = []
    for name, child in module.named_children():
        tensors = list(child.parameters()) + list(child.buffers())
        found = {t.device for t in tensors}
        if len(found) > 1:
            raise ValueError(f"child {name!r} has tensors on several devices {sorted(map(str, found))}")
        devices.append(found.pop() if found else None)
    placed = [d for d in devices if d is not None]
    if not placed:
        return [len(devices)], [torch.device("cpu")]
    current = placed[0]
    balance: List[int] = []
    groups: List[torch.device] = []
    for device in devices:
        device = device or current
        if groups and device == groups[-1]:
            balance[-1] += 1
        else:
            groups.append(device)
            balance.append(1)
        current = device
    return balance, groups


def _refuse_dataless_layers(named: List[Tuple[str, nn.Module]], balance: Sequence[int],
                            devices: Sequence[torch.device]) -> None:
    """ValueError for a layer with tensors on ``meta`` bound for a device that is not: they
    hold no values to copy (torch's own error names neither the layer nor the device)."""
    start = 0
    for size, device in zip(balance, devices):
        target = as_device(device)
        if target.type != "meta":
            for name, layer in named[start:start + size]:
                dataless = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers())
                            if t.device.type == "meta"]
                if dataless:
                    raise ValueError(f"layer {name!r} ({type(layer).__name__}) has tensors on the 'meta' device "
                                     f"({', '.join(dataless)}), which hold no values to move to {target}: "
                                     "materialise them first (to_empty() and initialise them, or load a state dict)")
        start += size


def layers_fixed_error(what: str, how: str, why: str = "the pipeline would not run it") -> TypeError:
    """The refusal of a layer change once a Pipe is built, for the Pipe and its partitions alike.

    The partitions, and the worker that runs each, were built from the layers the Pipe was
    given, and the Pipe keeps those layers as its own children (its ``parameters()`` and
    ``state_dict()``): a layer set, added or removed on either alone would be trained but not
    run, or run but not trained. Changes *inside* a layer run.
    """
    return TypeError(
        f"a Pipe's layers are fixed when it is built: {what} cannot be {how} afterwards ({why}). Change the "
        "layer in place (pipe[i].weight, a submodule of pipe[i]), build a new Pipe from the changed "
        "nn.Sequential, or keep extra modules beside the Pipe in a wrapper module"
    )


class _FixedChildren(nn.Module):
    """A container whose children are refused any change once :meth:`fix_children` ran.

    Mixed into the partition containers (``pipe.partitions`` and each ``pipe.partitions[i]``):
    a layer swapped there would run without being the Pipe's, so no optimizer over
    ``pipe.parameters()`` would train it and ``state_dict()`` would not save it.
    """

    _children_fixed = False

    def fix_children(self, owner: str, why: str) -> None:
        """Refuse child changes from now on; ``owner`` names this container and ``why`` says
        what a change would break, in the refusal."""
        object.__setattr__(self, "_fixed_as", (owner, why))
        object.__setattr__(self, "_children_fixed", True)

    def _refuse(self, name: str, how: str) -> None:
        owner, why = self.__dict__.get("_fixed_as", ("a partition", "the Pipe would not follow"))
        raise layers_fixed_error(f"child {name!r} of {owner}", how, why)

    def __setattr__(self, name: str, value: Any) -> None:
        if self._children_fixed and (isinstance(value, nn.Module) or name in self._modules):
            self._refuse(name, "replaced" if name in self._modules else "added")
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self._children_fixed and name in self._modules:
            self._refuse(name, "deleted")
        super().__delattr__(name)

    def add_module(self, name: str, module: Optional[nn.Module]) -> None:
        """Refused once fixed (``append``, ``extend`` and ``register_module`` come here too)."""
        if self._children_fixed:
            self._refuse(name, "replaced" if name in self._modules else "added")
        super().add_module(name, module)

    def insert(self, index: int, module: nn.Module) -> Any:
        """Refused once fixed (``nn.Sequential.insert`` writes its children directly)."""
        if self._children_fixed:
            self._refuse(str(index), "inserted")
        return super().insert(index, module)  # type: ignore[misc]


class SpreadingSequential(nn.Sequential):
    """An ``nn.Sequential`` that spreads a tuple over the next layer's positional arguments.

    PyTorch's retired ``Pipe`` ran its partitions this way: a layer that returns ``(a, b)``
    feeds ``forward(self, a, b)`` of the next one, where torchgpipe's convention (and
    ``nn.Sequential``'s) passes the tuple as one argument. A child that is a plain
    ``nn.Sequential`` is run the same way, layer by layer, as the retired ``Pipe`` flattened
    such children into its partitions.
    """

    def forward(self, *inputs: Any) -> Any:  # type: ignore[override]
        value: Any = inputs[0] if len(inputs) == 1 else inputs
        return _spread_through(self, value)


def _spread_through(layers: nn.Sequential, value: Any) -> Any:
    for layer in layers:
        if type(layer) is nn.Sequential:
            value = _spread_through(layer, value)
        elif isinstance(value, tuple):
            value = layer(*value)
        else:
            value = layer(value)
    return value


class PartitionSequential(_FixedChildren, nn.Sequential):
    """A partition's layers: an ``nn.Sequential`` whose children are fixed once the Pipe is built."""


class SpreadingPartition(_FixedChildren, SpreadingSequential):
    """A partition's layers, called as :class:`SpreadingSequential` calls them; fixed likewise."""


class PartitionList(_FixedChildren, nn.ModuleList):
    """``pipe.partitions``: an ``nn.ModuleList`` whose partitions are fixed once the Pipe is built."""


def fixed_partitions(partitions: Sequence[nn.Module]) -> PartitionList:
    """``partitions`` as a Pipe keeps them: a :class:`PartitionList` of fixed containers.

    Containers of a Pipe pickled before they were fixed (a plain ``nn.Sequential`` or
    ``nn.ModuleList``) become the fixed classes in place: those add no state of their own.
    """
    for index, partition in enumerate(partitions):
        if not isinstance(partition, _FixedChildren):
            partition.__class__ = SpreadingPartition if isinstance(partition, SpreadingSequential) \
                else PartitionSequential
        partition.fix_children(f"pipe.partitions[{index}]", "the pipeline would run it, but the Pipe's parameters() "
                                                            "and state_dict() would not hold it")
    if isinstance(partitions, nn.ModuleList):
        if not isinstance(partitions, PartitionList):
            partitions.__class__ = PartitionList
        listed = cast(PartitionList, partitions)
    else:
        listed = PartitionList(partitions)
    listed.fix_children("pipe.partitions", "a worker was started for each partition the Pipe was built with, and "
                                           "runs only that one")
    return listed


def split_module(
    module: nn.Sequential, balance: Sequence[int], devices: Sequence[torch.device], spread_tuples: bool = False
) -> Tuple[List[nn.Sequential], List[Tuple[str, nn.Module]]]:
    """Move the children into one ``nn.Sequential`` per partition, on its device.

    Returns the partitions and the children's original ``(name, layer)`` pairs, so that the
    pipeline can keep the Sequential's parameter names. With ``spread_tuples`` the partitions
    are :class:`SpreadingSequential` (the retired torch ``Pipe``'s calling convention). The
    containers are :class:`PartitionSequential`; :func:`fixed_partitions` fixes them.
    """
    named = list(module.named_children())
    _refuse_dataless_layers(named, balance, devices)  # before any layer moves
    partitions: List[nn.Sequential] = []
    container = SpreadingPartition if spread_tuples else PartitionSequential
    start = 0
    for size, device in zip(balance, devices):
        layers = OrderedDict(named[start : start + size])
        partition = container(layers)
        partition.to(as_device(device))
        partitions.append(partition)
        start += size
    return partitions, named
