"""The one place where a profiler runs a layer: the hook for layers that need more than input.

Both profilers (time and size) call :func:`call_layer` for every layer, and nothing else calls
a layer. ``@skippable`` layers (``torchpipe.skip``) stash tensors for, or pop tensors from, a layer
further down the sequence: :func:`profiling_skips` keeps the latest stash of every name and
serves each pop a fresh copy of it, so that a layer can be run many times and a popping
layer profiles with the tensor its stashing layer produced.

A layer takes and returns either one tensor or a tuple of tensors, as in torchgpipe: a tuple
is passed to the layer as a single argument.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, Tuple, Union

import torch
from torch import Tensor, nn

from torchpipe.skip import use_skip_tracker
from torchpipe.skip.tracker import SkipKey, skip_name

__all__ = ["Activation", "call_layer", "tensors_of", "partition_input", "to_device", "profiling_skips"]

Activation = Union[Tensor, Tuple[Tensor, ...]]


def tensors_of(value: Activation) -> Tuple[Tensor, ...]:
    """The tensors of an activation, whether it is one tensor or a tuple of them."""
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, tuple) and all(isinstance(x, Tensor) for x in value):
        return value
    raise TypeError(
        "a layer input or output must be a Tensor or a tuple of Tensors, "
        f"got {type(value).__name__}"
    )


def partition_input(value: Activation) -> Activation:
    """A fresh input for one profiling run of a layer, cut from the previous layer's graph.

    Why: each layer is profiled alone, like the first layer of a partition. ``requires_grad``
    is kept. Every tensor is cloned, so an in-place layer (``ReLU(inplace=True)``) neither
    writes into the user's sample nor into the input of the next run, and a tensor that
    requires grad is not a leaf, so in-place layers work on it as they do on a partition's
    input in the pipe (which comes out of a copy). Make it outside any timed or measured
    region.
    """
    if isinstance(value, tuple):
        return tuple(_fresh(x) for x in tensors_of(value))
    return _fresh(value)


def _fresh(tensor: Tensor) -> Tensor:
    leaf = tensor.detach()
    return leaf.requires_grad_().clone() if tensor.requires_grad else leaf.clone()


def to_device(value: Activation, device: torch.device) -> Activation:
    """Move an activation to the profiling device."""
    if isinstance(value, Tensor):
        return value.to(device)
    return tuple(x.to(device) for x in tensors_of(value))


def call_layer(layer: nn.Module, value: Activation) -> Activation:
    """Run one layer forward on ``value`` and return its output (checked to be tensors)."""
    output = layer(value)
    tensors_of(output)
    return output


class _ProfilingSkipTracker:
    """Keeps the latest stash per name; every pop gets a fresh, graph-free copy of it."""

    def __init__(self) -> None:
        self.tensors: Dict[SkipKey, Tensor] = {}

    def save(self, key: SkipKey, tensor: Tensor) -> None:
        self.tensors[key] = tensor.detach()

    def load(self, key: SkipKey) -> Tensor:
        try:
            return _fresh(self.tensors[key])
        except KeyError:
            raise RuntimeError(f"profiling: pop of skip {skip_name(key)} before any layer stashed it") from None


@contextmanager
def profiling_skips() -> Iterator[None]:
    """Serve ``@skippable`` stashes and pops while layers are profiled one by one."""
    with use_skip_tracker(_ProfilingSkipTracker()):
        yield
