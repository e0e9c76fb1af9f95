"""``torchpipe.retired.Pipe``: PyTorch's retired ``torch.distributed.pipeline.sync.Pipe``, without RPC.

Code written for the retired ``Pipe`` (torch 1.8 to 2.3) moves here by changing its import.
The constructor takes the same arguments and splits the model the same way: consecutive
children on one accelerator form a partition, every child on the CPU (or without
parameters) gets a partition of its own, and ``WithDevice(module, device)`` places a child
by hand. Calls take several inputs (``pipe(a, b)``), and a tuple between layers is spread
over the next layer's arguments (``forward(self, a, b)``). Its state dicts (layers numbered
per partition) load as they are. One difference remains: the output is the value itself,
not an ``RRef`` (no ``.local_value()``), and no RPC needs to be initialised.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, List, Tuple

import torch
from torch import nn

from .checkpoint import is_checkpointing, is_recomputing
from .devices import DeviceLike, as_device
from .partition import verify_only_children_run
from .pipe import Pipe as _Pipe
from .state_keys import retired_pipe_state_dict

__all__ = ["Pipe", "WithDevice", "retired_pipe_state_dict", "is_checkpointing", "is_recomputing"]


class WithDevice(nn.Module):
    """Puts ``module`` on ``device`` in a retired-style ``Pipe``: for a layer without parameters
    (which would otherwise get a CPU partition of its own), or to override placement."""

    def __init__(self, module: nn.Module, device: DeviceLike) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"WithDevice wraps an nn.Module, got {type(module).__name__}: {module!r:.80}")
        placed = as_device(device)  # a ValueError naming the spelling, as for a Pipe's devices
        super().__init__()
        self._module = module
        self._device = placed

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._module(*args, **kwargs)

    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def device(self) -> torch.device:
        return self._device


def _parameter_device(name: str, module: nn.Module) -> torch.device:
    """The device of ``module``'s parameters; the CPU for a module without any (the retired rule)."""
    found = {p.device for p in module.parameters()}
    if len(found) > 1:
        raise ValueError(f"child {name!r} has parameters on several devices {sorted(map(str, found))}; "
                         "expected one device per child (move it with .to(), or wrap it in WithDevice)")
    return found.pop() if found else torch.device("cpu")


def retired_split(module: nn.Sequential) -> Tuple[nn.Sequential, List[int], List[torch.device]]:
    """The retired ``Pipe``'s partitions: ``(module without WithDevice wrappers, balance, devices)``.

    A new partition starts wherever the device changes, and at every child on the CPU.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be an nn.Sequential, got {type(module).__name__}")
    verify_only_children_run(module, spread_tuples=True)  # only the children go on
    children: "OrderedDict[str, nn.Module]" = OrderedDict()
    balance: List[int] = []
    devices: List[torch.device] = []
    for name, child in module.named_children():
        if isinstance(child, WithDevice):
            device, child = child.device, child.module
        else:
            device = _parameter_device(name, child)
        children[name] = child
        if devices and devices[-1] == device and device.type != "cpu":
            balance[-1] += 1
        else:
            balance.append(1)
            devices.append(device)
    return nn.Sequential(children), balance, devices


class Pipe(_Pipe):
    """PyTorch's retired ``Pipe``: ``Pipe(module, chunks=1, checkpoint='except_last', deferred_batch_norm=False)``.

    A :class:`torchpipe.Pipe` with the retired one's split (see :func:`retired_split`), its
    calling convention (``pipe(*inputs)``, tuples spread over the next layer's arguments) and
    its state-dict layout. Every other method (``step``, ``evaluate``, the schedules) is
    torchpipe's.
    """

    def __init__(self, module: nn.Sequential, chunks: int = 1, checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False, **options: Any) -> None:
        unwrapped, balance, devices = retired_split(module)
        super().__init__(unwrapped, balance, devices=devices, chunks=chunks, checkpoint=checkpoint,
                         deferred_batch_norm=deferred_batch_norm, spread_tuples=True, **options)
        self._retired_layout = True  # partitions.<i>.<j> keys are read as the retired Pipe wrote them

    def forward(self, *inputs: Any) -> Any:  # type: ignore[override]
        """``pipe(a, b)`` runs the first layer as ``forward(a, b)``, split into micro-batches."""
        if not inputs:
            raise TypeError("Pipe() needs at least one input")
        return super().forward(inputs[0] if len(inputs) == 1 else inputs)
