"""Per-layer time profile: seconds of one forward plus backward, on the profiling device."""
from __future__ import annotations

import statistics
import time
from typing import List

import torch
from torch import nn

from torchpipe.balance.device_sync import synchronize
from torchpipe.balance.layer_call import (Activation, ProfilingSkipTracker, call_layer, partition_input, tensors_of,
                                          to_device)
from torchpipe.balance.sandbox import profile_layerwise

__all__ = ["profile_times"]


def profile_times(module: nn.Sequential, sample: Activation, timeout: float,
                  device: torch.device) -> List[float]:
    """Median seconds of forward + backward for each layer of ``module`` on ``sample``.

    Each layer gets an equal share ``timeout / len(module)`` of the time budget: it runs once
    untimed (warm-up; its output is the next layer's input) and then is timed repeatedly until
    its share is spent, at least once. The backward pass uses the output itself as the
    incoming gradient and is skipped for outputs that do not require grad. Layers run on
    sandbox copies (see :mod:`torchpipe.balance.sandbox`).
    """
    budget_per_layer = timeout / len(module)
    value = to_device(sample, device)
    times: List[float] = []
    profile_layerwise(module, value, device,
                      lambda layer, value, skips: _time_layer(layer, value, budget_per_layer, device, times, skips))
    return times


def _time_layer(layer: nn.Module, value: Activation, budget: float, device: torch.device, times: List[float],
                skips: ProfilingSkipTracker) -> Activation:
    """Append ``layer``'s median forward+backward seconds to ``times``; return its output."""
    skips.prepare(layer)
    output = _forward_backward(layer, partition_input(value))
    samples: List[float] = []
    began = time.perf_counter()
    while not samples or time.perf_counter() - began < budget:
        fresh_input = partition_input(value)
        skips.prepare(layer)  # the pops' copies, outside the timed region
        synchronize(device)
        tick = time.perf_counter()
        _forward_backward(layer, fresh_input)
        synchronize(device)
        samples.append(time.perf_counter() - tick)
    times.append(statistics.median(samples))
    return output


def _forward_backward(layer: nn.Module, value: Activation) -> Activation:
    output = call_layer(layer, value)
    needs_grad = tuple(y for y in tensors_of(output) if y.requires_grad)
    if needs_grad:
        torch.autograd.backward(needs_grad, tuple(y.detach() for y in needs_grad))
    return output

