"""Private copies of layers to profile, so that profiling leaves the user's model untouched.

Profiling runs forward and backward in training mode: on the user's own layers it would
write ``.grad``, update batch-norm running statistics, and flip ``training``. Each layer is
deep-copied instead, one at a time, so only one layer's copy occupies the profiling device
(the whole model may not fit on it: that is why it is being pipelined).
"""
from __future__ import annotations

import copy
from typing import Iterator

import torch
from torch import nn

__all__ = ["layerwise_sandbox"]


def layerwise_sandbox(module: nn.Sequential, device: torch.device) -> Iterator[nn.Module]:
    """Yield a training-mode copy of each layer of ``module`` on ``device``, in order.

    The copy of a layer is dropped by the caller before the next one is made. Parameters
    shared between layers are copied once per layer that uses them, which is what each
    partition would hold anyway.
    """
    for layer in module:
        layer_copy = copy.deepcopy(layer).to(device)
        layer_copy.train()
        for parameter in layer_copy.parameters():
            parameter.grad = None
        yield layer_copy
        del layer_copy  # before copying the next layer, so only one copy is alive
