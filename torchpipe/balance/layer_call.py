"""The one place where a profiler runs a layer: the hook for layers that need more than input.

Both profilers (time and size) call :func:`call_layer` for every layer, and nothing else calls
a layer. ``@skippable`` layers (``torchpipe.skip``) stash tensors for, or pop tensors from, a layer
further down the sequence: :func:`profiling_skips` keeps the latest stash of every name and
serves each pop a fresh copy of it, so that a layer can be run many times and a popping
layer profiles with the tensor its stashing layer produced.

A layer takes and returns either one tensor or a tuple, as in torchgpipe: a tuple is passed
to the layer as a single argument. As in a pipe, a namedtuple keeps its type, the non-tensor
items of a tuple travel unchanged, and tensors nested in its tuples, lists and dicts (an
LSTM's ``(out, (h_n, c_n))``) are handled as its own: cut, cloned, moved and counted.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from torchpipe.microbatch import map_nested, nested_tensors
from torchpipe.skip import use_skip_tracker
from torchpipe.skip.skippable import Skippable
from torchpipe.skip.tracker import SkipKey, skip_name

__all__ = ["Activation", "call_layer", "tensors_of", "partition_input", "to_device", "cut", "map_tensors",
           "profiling_skips", "ProfilingSkipTracker"]

Activation = Union[Tensor, Tuple[Tensor, ...]]


def tensors_of(value: Activation, what: str = "a layer input or output") -> Tuple[Tensor, ...]:
    """The tensors of an activation, whether it is one tensor or a tuple, also those nested in
    its tuples, lists and dicts (other items skipped)."""
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, tuple):
        return tuple(nested_tensors(value))
    raise TypeError(f"{what} must be a Tensor or a tuple, got {type(value).__name__}")


def map_tensors(value: Activation, function: Callable[[Tensor], Tensor]) -> Activation:
    """``value`` with ``function`` applied to each of its tensors, nested ones too; the rest,
    and each container's kind (a namedtuple's type), kept."""
    tensors_of(value)  # the type check
    return map_nested(value, function)


def cut(value: Activation) -> Activation:
    """``value`` without its autograd graph, ``requires_grad`` kept.

    Why: the next layer only needs the values; the graph would keep the previous layer's
    copy (its parameters and gradients) alive while the next one is profiled.
    """
    return map_tensors(value, lambda x: x.detach().requires_grad_(x.requires_grad))


def partition_input(value: Activation) -> Activation:
    """A fresh input for one profiling run of a layer, cut from the previous layer's graph.

    Why: each layer is profiled alone, like the first layer of a partition. ``requires_grad``
    is kept. Every tensor is cloned, so an in-place layer (``ReLU(inplace=True)``) neither
    writes into the user's sample nor into the input of the next run, and a tensor that
    requires grad is not a leaf, so in-place layers work on it as they do on a partition's
    input in the pipe (which comes out of a copy). Make it outside any timed or measured
    region.
    """
    return map_tensors(value, _fresh)


def _fresh(tensor: Tensor) -> Tensor:
    # Cloned before requires_grad is set: a sample made under inference_mode is an inference
    # tensor, which refuses requires_grad; its clone (made outside inference mode) does not.
    copy = tensor.detach().clone()
    return copy.requires_grad_().clone() if tensor.requires_grad else copy


def to_device(value: Activation, device: torch.device) -> Activation:
    """Move an activation to the profiling device."""
    return map_tensors(value, lambda x: x.to(device))


def call_layer(layer: nn.Module, value: Activation) -> Activation:
    """Run one layer forward on ``value`` and return its output (checked to be tensors)."""
    output = layer(value)
    tensors_of(output)
    return output


class ProfilingSkipTracker:
    """Keeps the latest stash per name; every pop gets a fresh, graph-free copy of it.

    The copies for a layer's pops are made by :meth:`prepare`, before the layer runs, so that
    making them is neither timed nor counted as the popping layer's memory: a skip tensor
    lives from its stash to its pop, and is charged to the layer that stashes it
    (:attr:`stashed`).
    """

    def __init__(self) -> None:
        self.tensors: Dict[SkipKey, Any] = {}  # a tensor, None, or a container of tensors
        self.ready: Dict[SkipKey, Any] = {}
        self.stashed: List[Tensor] = []

    def prepare(self, layer: nn.Module) -> List[Tensor]:
        """Before a run of ``layer``: make its pops' copies now; returns them."""
        self.stashed = []
        self.ready = {key: self._copy(key) for key in _pops_of(layer) if key in self.tensors}
        return list(nested_tensors(tuple(self.ready.values())))

    def save(self, key: SkipKey, tensor: Optional[Tensor]) -> None:
        # Detached: the graph would keep this layer's copy alive while the next one is profiled.
        # A skip may hold its tensors in a tuple, list or dict.
        detached = map_nested(tensor, Tensor.detach)
        self.tensors[key] = detached
        self.stashed.extend(nested_tensors((detached,)))

    def load(self, key: SkipKey) -> Optional[Tensor]:
        if key in self.ready:
            return self.ready.pop(key)
        return self._copy(key)

    def _copy(self, key: SkipKey) -> Optional[Tensor]:
        try:
            tensor = self.tensors[key]
        except KeyError:
            raise RuntimeError(f"profiling: pop of skip {skip_name(key)} before any layer stashed it") from None
        return map_nested(tensor, _fresh)


def _pops_of(layer: nn.Module) -> List[SkipKey]:
    return [key for module in layer.modules() if isinstance(module, Skippable) for key in module.poppable()]


@contextmanager
def profiling_skips() -> Iterator[ProfilingSkipTracker]:
    """Serve ``@skippable`` stashes and pops while layers are profiled one by one."""
    tracker = ProfilingSkipTracker()
    with use_skip_tracker(tracker):
        yield tracker
