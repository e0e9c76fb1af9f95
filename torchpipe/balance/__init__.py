"""Choose a pipeline's ``balance`` (layers per partition) from measured per-layer costs.

Usage::

    from torchpipe.balance import balance_by_time
    balance = balance_by_time(4, model, torch.empty(128, 3, 224, 224))

Each layer is profiled alone on a sandbox copy (the user's model, its ``.grad``, running
statistics and ``training`` flag are untouched, and so is the global RNG state), and the cost
sequence is split optimally into consecutive partitions (:func:`blockpartition`).
"""
from __future__ import annotations

import math
from numbers import Real
from typing import List, Union

import torch
from torch import nn

from torchpipe.balance.layer_call import Activation, tensors_of
from torchpipe.balance.profile_size import profile_sizes
from torchpipe.balance.profile_time import profile_times
from torchpipe.balance.solver import balance_by_cost, blockpartition

__all__ = ["balance_by_time", "balance_by_size", "blockpartition", "balance_by_cost"]

Device = Union[torch.device, str, int]


def balance_by_time(partitions: int, module: nn.Sequential, sample: Activation, *,
                    timeout: float = 1.0, device: Device = torch.device("cpu")) -> List[int]:
    """Balance by the time each layer takes, forward plus backward, on ``device``.

    Why: a pipeline's throughput is bounded by its slowest partition. Each layer is run on
    ``sample`` (any batch size) and timed repeatedly for about ``timeout / len(module)``
    seconds, at least once, after one untimed warm-up run; its cost is the median time. The
    whole call takes about ``timeout`` seconds plus one warm-up per layer.

    Returns the number of consecutive layers per partition, the ``balance`` a pipe takes.
    Raises ``TypeError`` if ``module`` is not an ``nn.Sequential``, ``ValueError`` if
    ``partitions`` is below 1 or above ``len(module)``, or ``timeout`` is negative or not finite.
    """
    _check_common(partitions, module, sample)
    if isinstance(timeout, bool) or not isinstance(timeout, Real) or not (
        math.isfinite(timeout) and timeout >= 0
    ):
        raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
    device = torch.device(device)
    with _untouched_rng(device), torch.enable_grad():
        times = profile_times(module, sample, float(timeout), device)
    return balance_by_cost(times, partitions)


def balance_by_size(partitions: int, module: nn.Sequential, input: Activation, *,
                    chunks: int = 1, param_scale: float = 2.0,
                    device: Device = torch.device("cpu")) -> List[int]:
    """Balance by the memory each layer needs on its device while training.

    Why: a partition must fit its device, and the largest partition bounds the batch size.
    ``input`` is a mini-batch of the size to train with; ``chunks`` the number of
    micro-batches the pipe will split it into. A layer's cost is the activation bytes of one
    (the largest) micro-batch plus ``param_scale`` times its parameter bytes plus its buffer
    bytes. Activations come from the allocator on an accelerator and from the tensors autograd
    keeps on CPU: see :mod:`torchpipe.balance.profile_size` for exactly what is counted.

    ``param_scale`` depends on the optimizer: 2 counts weights and gradients (plain SGD); add
    1 per optimizer state tensor per parameter (SGD with momentum: 3, Adam: 4).

    Raises ``TypeError`` if ``module`` is not an ``nn.Sequential``, ``ValueError`` if
    ``partitions`` is below 1 or above ``len(module)``, ``chunks`` is not a positive int, or
    ``param_scale`` is negative or not finite.
    """
    _check_common(partitions, module, input)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    if isinstance(param_scale, bool) or not isinstance(param_scale, Real) or not (
        math.isfinite(param_scale) and param_scale >= 0
    ):
        raise ValueError(f"param_scale must be a finite number >= 0, got {param_scale!r}")
    device = torch.device(device)
    with _untouched_rng(device), torch.enable_grad():
        sizes = profile_sizes(module, input, chunks, float(param_scale), device)
    return balance_by_cost(sizes, partitions)


def _check_common(partitions: int, module: nn.Sequential, sample: Activation) -> None:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be an nn.Sequential, got {type(module).__name__}")
    if isinstance(partitions, bool) or not isinstance(partitions, int):
        raise TypeError(f"partitions must be an int, got {type(partitions).__name__}")
    if partitions < 1:
        raise ValueError(f"partitions must be at least 1 (got {partitions} < 1)")
    if partitions > len(module):
        raise ValueError(
            f"more partitions than layers: cannot split {len(module)} layers into "
            f"{partitions} non-empty partitions ({partitions} > {len(module)})"
        )
    tensors = tensors_of(sample)
    if not tensors or tensors[0].dim() == 0 or tensors[0].size(0) == 0:
        raise ValueError("the sample must have a non-empty batch dimension (dimension 0)")


def _untouched_rng(device: torch.device):  # type: ignore[no-untyped-def]
    """Fork the RNG so that profiling (dropout, ...) does not advance the user's random stream."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)
