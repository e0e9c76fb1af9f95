"""The one place where a profiler runs a layer: the hook for layers that need more than input.

Both profilers (time and size) call :func:`call_layer` for every layer, and nothing else calls
a layer. A later issue adds ``@skippable`` layers (``torchpipe.skip``), which stash tensors
for, or pop tensors from, a layer further down the sequence; their support belongs here (keep
the stashed tensors between calls, hand them to the popping layer), so that both profilers
get it at once.

A layer takes and returns either one tensor or a tuple of tensors, as in torchgpipe: a tuple
is passed to the layer as a single argument.
"""
from __future__ import annotations

from typing import Tuple, Union

import torch
from torch import Tensor, nn

__all__ = ["Activation", "call_layer", "tensors_of", "partition_input", "to_device"]

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
