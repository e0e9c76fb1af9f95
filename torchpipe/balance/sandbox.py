"""Private copies of layers to profile, so that profiling leaves the user's model untouched.

Profiling runs forward and backward in training mode: on the user's own layers it would
write ``.grad``, update batch-norm running statistics, and flip ``training``. Each layer is
deep-copied instead, one at a time, so only one layer's copy occupies the profiling device
(the whole model may not fit on it: that is why it is being pipelined).
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Callable, Iterator, Tuple

import torch
from torch import nn

from torchpipe.balance.layer_call import Activation, ProfilingSkipTracker, cut, profiling_skips
from torchpipe.notes import add_note

__all__ = ["layerwise_sandbox", "blame_layer", "profile_layerwise"]

#: Profiles one layer copy on its input and returns its output (the next layer's input).
LayerProfiler = Callable[[nn.Module, Activation, ProfilingSkipTracker], Activation]


def profile_layerwise(module: nn.Sequential, value: Activation, device: torch.device,
                      profile_layer: LayerProfiler) -> None:
    """Run ``profile_layer`` on a sandbox copy of each layer in order, feeding each the last output.

    Why one walker: the time and the size profiles must both serve skips, name the layer in
    an error, and keep only one copy (and no graph) alive; that protocol lives here once.
    """
    with profiling_skips() as skips:
        for index, layer in layerwise_sandbox(module, device):
            with blame_layer(module, index):
                value = cut(profile_layer(layer, value, skips))
            del layer  # only one copy alive: see layerwise_sandbox


def layerwise_sandbox(module: nn.Sequential, device: torch.device) -> Iterator[Tuple[int, nn.Module]]:
    """Yield the index and a training-mode copy of each layer of ``module`` on ``device``, in order.

    The caller must drop the copy (and anything holding its graph: see
    ``layer_call.cut``) before asking for the next one, so that only one copy is alive.
    Parameters shared between layers are copied once per layer that uses them, which is
    what each partition would hold anyway.
    """
    for index, layer in enumerate(module):
        with blame_layer(module, index):
            layer_copy = copy.deepcopy(layer).to(device)
        layer_copy.train()
        for parameter in layer_copy.parameters():
            parameter.grad = None
        yield index, layer_copy
        del layer_copy


@contextmanager
def blame_layer(module: nn.Sequential, index: int) -> Iterator[None]:
    """Name the layer in an error raised while it is copied or profiled (the error itself is kept)."""
    try:
        yield
    except Exception as exc:
        add_note(exc, f"[torchpipe.balance] while profiling layer {index} ({type(module[index]).__name__}) of "
                      "the module")
        raise
