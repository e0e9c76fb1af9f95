"""Per-layer memory profile: bytes a layer keeps on its device while a micro-batch trains.

The cost of layer ``i`` is::

    activation_bytes(i) + param_scale * parameter_bytes(i) + frozen_bytes(i) + buffer_bytes(i)

* ``activation_bytes``: bytes that the forward of ONE micro-batch leaves allocated until
  backward, measured on the largest micro-batch, i.e. the first ``ceil(batch / chunks)``
  samples of the input (along ``batch_dim``, as the pipe splits it). How it is measured:

  - on an accelerator (CUDA, NPU, ...): the allocator's ``memory_allocated`` after the
    forward (output alive) minus before it, as torchgpipe does. The input and the layer are
    already on the device, so only new allocations count. Python's garbage is collected
    before profiling and the cyclic collector is off during each measured call, so that
    device tensors freed with reference cycles are not subtracted from a layer's size.
    Tensors that other threads of the process allocate or free meanwhile are counted:
    profile on a quiet device.
  - on CPU, which has no allocator statistics: the bytes of every distinct storage among the
    layer's outputs, the tensors it stashes for a skip connection and the tensors autograd
    saves for backward (captured with ``torch.autograd.graph.saved_tensors_hooks``),
    excluding storages of the layer's input, the skip tensors it pops (charged to the layer
    that stashed them), parameters and buffers, which exist anyway. Each storage counts whole and once (views
    and in-place results share storage). Transient temporaries freed during the forward are
    not counted, on either device.

* ``parameter_bytes``: bytes of the layer's distinct storages of parameters that require
  grad, scaled by ``param_scale`` for the gradient and the optimizer state (2 = weights +
  gradients).
* ``frozen_bytes``: bytes of its other parameters (``requires_grad=False``), once: a frozen
  parameter gets neither a gradient nor optimizer state.
* ``buffer_bytes``: bytes of the layer's buffers (e.g. batch-norm running statistics), once,
  for the same reason.
"""
from __future__ import annotations

import gc
import math
from typing import Dict, Iterable, List, Set

import torch
from torch import Tensor, nn

from torchpipe.balance.device_sync import allocated_bytes, has_allocator_statistics
from torchpipe.balance.layer_call import (Activation, ProfilingSkipTracker, call_layer, partition_input, tensors_of,
                                          to_device)
from torchpipe.balance.sandbox import profile_layerwise
from torchpipe.microbatch import BatchDim, scatter

__all__ = ["profile_sizes", "microbatch_of"]


def profile_sizes(module: nn.Sequential, input: Activation, chunks: int, param_scale: float,
                  device: torch.device, batch_dim: BatchDim = 0) -> List[int]:
    """Bytes each layer of ``module`` costs on ``device`` (see the module docstring)."""
    value = to_device(microbatch_of(input, chunks, batch_dim), device)
    if has_allocator_statistics(device):
        gc.collect()  # once (it can take 0.2 s): earlier garbage must not be freed mid-measurement
    sizes: List[int] = []
    profile_layerwise(module, value, device,
                      lambda layer, value, skips: _size_layer(layer, value, param_scale, device, sizes, skips))
    return sizes


def _size_layer(layer: nn.Module, value: Activation, param_scale: float, device: torch.device, sizes: List[int],
                skips: ProfilingSkipTracker) -> Activation:
    """Append ``layer``'s byte cost to ``sizes``; return its output."""
    value = partition_input(value)
    popped = skips.prepare(layer)  # allocated before the measurement: charged to their stasher
    if has_allocator_statistics(device):
        output, activation = _forward_measured_by_allocator(layer, value, device)
    else:
        output, activation = _forward_measured_by_autograd(layer, value, popped, skips)
    trained = [p for p in layer.parameters() if p.requires_grad]
    parameters = _storage_bytes(trained)
    once = _storage_bytes([*trained, *(p for p in layer.parameters() if not p.requires_grad), *layer.buffers()])
    size = activation + param_scale * parameters + (once - parameters)
    if not math.isfinite(size):
        raise ValueError(f"param_scale={param_scale!r} times the {parameters} parameter bytes of layer {len(sizes)} "
                         "overflows: give a param_scale of a sensible size (torchgpipe's default is 2.0)")
    sizes.append(int(size))
    return output


def microbatch_of(input: Activation, chunks: int, batch_dim: BatchDim = 0) -> Activation:
    """The largest micro-batch a batch splits into: the first, as the pipe splits it (``Tensor.chunk``)."""
    return scatter(input, chunks, batch_dim)[0].value


def _forward_measured_by_allocator(layer: nn.Module, value: Activation,
                                   device: torch.device) -> tuple[Activation, int]:
    # The allocator counts the whole process: device tensors freed by the cyclic collector
    # during the call would be charged to this layer as a negative size. profile_sizes has
    # collected what was garbage before profiling; keep the collector out of the call.
    collecting = gc.isenabled()
    gc.disable()
    try:
        before = allocated_bytes(device)
        output = call_layer(layer, value)
        return output, allocated_bytes(device) - before
    finally:
        if collecting:
            gc.enable()


def _same(tensor: Tensor) -> Tensor:
    return tensor


def _forward_measured_by_autograd(layer: nn.Module, value: Activation, popped: List[Tensor],
                                  skips: ProfilingSkipTracker) -> tuple[Activation, int]:
    kept: Dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        _remember_storage(kept, tensor)
        # An alias, never the tensor itself: a layer that saves its own output (ReLU, tanh)
        # would close a cycle output -> grad_fn -> output through C++, which no collector
        # sees and, with no backward run here, nothing breaks: every call would leak it.
        return tensor.detach()

    # Not compiled by torch.compile (as torch's checkpoint hooks are not): a profiled layer
    # that breaks its graph would otherwise have the hook compiled, on fake tensors.
    with torch.autograd.graph.saved_tensors_hooks(torch.compiler.disable(pack), torch.compiler.disable(_same)):
        output = call_layer(layer, value)
    for tensor in (*tensors_of(output), *skips.stashed):  # a stash lives until its pop
        _remember_storage(kept, tensor)

    existing: Set[int] = set()
    for tensor in (*tensors_of(value), *popped, *layer.parameters(), *layer.buffers()):
        existing.update(_storage_entry(tensor))
    return output, sum(size for key, size in kept.items() if key not in existing)


def _storage_entry(tensor: Tensor) -> Dict[int, int]:
    """``{storage address: storage bytes}`` for a tensor; empty if it has no plain storage."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. sparse or wrapper subclasses
        return {}
    return {storage.data_ptr(): storage.nbytes()} if storage.nbytes() else {}


def _remember_storage(kept: Dict[int, int], tensor: Tensor) -> None:
    key = _storage_entry(tensor)
    if key:
        kept.update(key)
    elif tensor.numel():
        # No storage to identify: count the tensor's own bytes under a unique key.
        kept[-id(tensor)] = tensor.numel() * tensor.element_size()


def _storage_bytes(tensors: Iterable[Tensor]) -> int:
    seen: Dict[int, int] = {}
    for tensor in tensors:
        seen.update(_storage_entry(tensor))
    return sum(seen.values())

