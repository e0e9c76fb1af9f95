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
from contextlib import contextmanager
from numbers import Real
from typing import Iterator, List, Optional, Union

import torch
from torch import nn

from torchpipe.balance.layer_call import Activation, tensors_of
from torchpipe.balance.profile_size import profile_sizes
from torchpipe.balance.profile_time import profile_times
from torchpipe.balance.solver import as_count, balance_by_cost, blockpartition, check_partitions
from torchpipe.devices import BackendUnavailableError, as_device, get_backend, usable_device
from torchpipe.microbatch import BatchDim, batch_size, check_batch_dim
from torchpipe.partition import verify_only_children_run

__all__ = ["balance_by_time", "balance_by_size", "blockpartition", "balance_by_cost"]

Device = Union[torch.device, str, int]

balance_cost = balance_by_cost
"""torchgpipe's name for :func:`balance_by_cost` (outside its ``__all__`` too), so that code
importing it from ``torchgpipe.balance`` moves by changing the import."""


def balance_by_time(partitions: int, module: nn.Sequential, sample: Activation, *,
                    timeout: float = 1.0, device: Optional[Device] = None, batch_dim: BatchDim = 0) -> List[int]:
    """Balance by the time each layer takes, forward plus backward, on ``device``.

    Why: a pipeline's throughput is bounded by its slowest partition. Each layer is run on
    ``sample`` (any batch size) and timed repeatedly for about ``timeout / len(module)``
    seconds, at least once, after one untimed warm-up run; its cost is the median time. The
    whole call takes about ``timeout`` seconds plus one warm-up per layer. ``device``
    defaults, as in torchgpipe, to the current accelerator (CUDA, NPU) when there is one,
    else the CPU. ``batch_dim`` says where the sample's batch is, as ``Pipe(batch_dim=...)``
    does; it is only checked here (every split tensor has the same, non-empty, batch size).

    Returns the number of consecutive layers per partition, the ``balance`` a pipe takes.
    Raises ``TypeError`` if ``module`` is not an ``nn.Sequential`` or an argument has the
    wrong type, ``ValueError`` if ``partitions`` is below 1 or above ``len(module)``,
    ``timeout`` is negative or not finite, or ``device`` is ``meta``.
    """
    partitions = _check_common(partitions, module, sample, batch_dim)
    timeout = _non_negative("timeout", timeout, "a finite number of seconds >= 0")
    device = _profiling_device(device)
    with _profiling_mode(device):
        times = profile_times(module, sample, timeout, device)
    return balance_by_cost(times, partitions)


def balance_by_size(partitions: int, module: nn.Sequential, input: Activation, *,
                    chunks: int = 1, param_scale: float = 2.0,
                    device: Optional[Device] = None, batch_dim: BatchDim = 0) -> List[int]:
    """Balance by the memory each layer needs on its device while training.

    Why: a partition must fit its device, and the largest partition bounds the batch size.
    ``input`` is a mini-batch of the size to train with; ``chunks`` the number of
    micro-batches the pipe will split it into, along ``batch_dim`` (as ``Pipe(batch_dim=...)``
    splits it: ``1`` for a sequence-first model, ``None`` in a tuple for an item every
    micro-batch gets whole). A layer's cost is the activation bytes of one
    (the largest) micro-batch plus ``param_scale`` times the bytes of its parameters that
    require grad plus, once, those of its frozen parameters and buffers. Activations come
    from the allocator on an accelerator and from the tensors autograd keeps on CPU: see
    :mod:`torchpipe.balance.profile_size` for exactly what is counted.

    ``param_scale`` depends on the optimizer: 2 counts weights and gradients (plain SGD); add
    1 per optimizer state tensor per parameter (SGD with momentum: 3, Adam: 4).

    Raises ``TypeError`` if ``module`` is not an ``nn.Sequential`` or an argument has the
    wrong type, ``ValueError`` if ``partitions`` is below 1 or above ``len(module)``,
    ``chunks`` is below 1, ``param_scale`` is negative or not finite, or ``device`` is
    ``meta``. ``device`` defaults as for :func:`balance_by_time`.
    """
    partitions = _check_common(partitions, module, input, batch_dim)
    chunks = as_count("chunks", chunks)
    param_scale = _non_negative("param_scale", param_scale, "a finite number >= 0")
    device = _profiling_device(device)
    with _profiling_mode(device):
        sizes = profile_sizes(module, input, chunks, param_scale, device, batch_dim)
    return balance_by_cost(sizes, partitions)


def _check_common(partitions: int, module: nn.Sequential, sample: Activation, batch_dim: BatchDim) -> int:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be an nn.Sequential, got {type(module).__name__}")
    verify_only_children_run(module, spread_tuples=True)  # a Pipe would refuse it: no balance to find for it
    partitions = check_partitions(partitions, len(module))
    batch_dim = check_batch_dim(batch_dim)
    tensors = tensors_of(sample, "the sample")
    if not tensors:
        raise TypeError("the sample tuple holds no Tensor to run the layers on")
    if any(t.is_meta for t in tensors):
        raise ValueError("the sample is on the meta device: it has shapes but no values to run the layers on; "
                         "give a sample with values (torch.randn(..., device='cpu'))")
    if isinstance(sample, torch.Tensor) and sample.dim() == 0:
        raise ValueError("the sample is a 0-dim tensor: it needs a batch dimension to stand for a mini-batch")
    if batch_size(sample, batch_dim, what="sample") == 0:
        raise ValueError(f"the sample has no samples along its batch dim (batch_dim={batch_dim!r}): "
                         "there is nothing to run the layers on")
    return partitions


def _non_negative(name: str, value: float, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return float(value)


def _profiling_device(device: Optional[Device]) -> torch.device:
    """``device``, or the current accelerator (torchgpipe profiles on the current CUDA device)."""
    if device is None:
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        if accelerator is None:
            return torch.device("cpu")
        try:
            backend = get_backend(accelerator.type)
        except BackendUnavailableError as exc:
            raise BackendUnavailableError(
                f"the current accelerator is {accelerator.type!r}, which torchpipe has no backend for: pass "
                "device='cpu' (or another device) to profile on, or register a backend for it "
                "(torchpipe.devices.register_backend)") from exc
        return backend.canonical(usable_device(accelerator.type))
    if as_device(device).type == "meta":
        raise ValueError(f"device={device!r} cannot be profiled: meta tensors take no time and share no "
                         "storage to measure; profile on the CPU or an accelerator")
    return usable_device(device)  # a clear error for a bad string, an NPU without torch_npu, no CUDA


@contextmanager
def _profiling_mode(device: torch.device) -> Iterator[None]:
    """Forward plus backward whatever the caller's mode, on ``device`` as the current device,
    without advancing the user's RNG.

    ``no_grad`` and ``inference_mode`` around the call would otherwise turn profiling into
    forward-only silently; the RNG is forked so that dropout in profiling draws nothing from
    the user's random stream. The device is made current as a pipe's worker makes its own,
    so a layer that allocates on ``'cuda'`` profiles on the device it would run on.
    """
    if device.type == "cpu":
        rng = torch.random.fork_rng(devices=[])
    else:
        rng = torch.random.fork_rng(devices=[device], device_type=device.type)
    with rng, torch.inference_mode(False), torch.enable_grad(), get_backend(device).use_device(device):
        yield
