"""Data parallelism for ``Pipe.step``: average each partition's gradients over a process group.

Why not ``DistributedDataParallel``: DDP arms its gradient hooks in its own ``forward``.
``DDP(pipe)(x)`` followed by ``loss.backward()`` goes through it and is averaged as usual,
but ``Pipe.step`` runs forward and backward on the workers without DDP's ``forward``, so
the hooks of a DDP-wrapped Pipe stay unarmed and nothing is reduced, silently.

How: a partition's gradients are final once the last backward action (``B`` or ``W``) of
that partition in the step's plan has run. Its worker then flattens them into one buffer
and starts an asynchronous all-reduce, while the other partitions are still in backward
(under 1F1B the last partition finishes first, so its all-reduce overlaps the drain of the
others). Before ``step`` returns, the caller waits for every all-reduce and writes the
average back into ``.grad``.

Every rank must issue the collectives of one group in the same order, but the workers
finish in an order that thread timing decides. So the all-reduces are started in a fixed
order, last partition first: a partition that is done early waits (without blocking its
worker) until the partitions after it have started theirs, and whichever worker fills the
gap starts the backlog.
"""
from __future__ import annotations

import contextlib
import threading
import time
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .thread_state import first_frame_outside_torchpipe

__all__ = ["GradientSync"]

_POLL_S = 0.0002  # how often a wait for an all-reduce checks for it (and for Ctrl-C)


def _flat(tensors: Sequence[Tensor]) -> Tensor:
    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflatten_into(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def _wait(work: Any) -> None:
    """``work.wait()``, polled so that a KeyboardInterrupt gets through; the group's timeout
    bounds it when a peer never joins."""
    while not work.is_completed():
        time.sleep(_POLL_S)
    work.wait()  # raises the collective's error, if it failed


class _Round:
    """One step's all-reduces: started by the workers, finished by the caller."""

    def __init__(self, sync: "GradientSync") -> None:
        self.sync = sync
        count = len(sync.parameters)
        self.lock = threading.Lock()
        self.ready = [False] * count
        self.next = count - 1  # the partition whose all-reduce starts next (last one first)
        self.started: Dict[int, Tuple[Any, Tensor, List[Tensor]]] = {}

    def start(self) -> None:
        """At the start of the step, on the caller's thread: the first rank's buffers everywhere."""
        if self.sync.broadcast_buffers:
            self.sync.broadcast_buffers_now()

    def partition_done(self, index: int) -> None:
        """Partition ``index`` has no backward left in this step (called on its worker)."""
        with self.lock:
            self.ready[index] = True
            while self.next >= 0 and self.ready[self.next]:
                self._launch(self.next)
                self.next -= 1

    def _launch(self, index: int) -> None:
        import torch.distributed as dist

        parameters = self.sync.parameters[index]
        if not parameters:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = _flat(grads)
        work = dist.all_reduce(flat, group=self.sync.process_group, async_op=True)
        self.started[index] = (work, flat, grads)

    def finish(self) -> None:
        """Wait for every all-reduce, then write the averages back (all or nothing)."""
        with self.lock:  # a plan whose partition had no backward action: start what is left
            for index in range(self.next, -1, -1):
                self._launch(index)
            self.next = -1
        for work, _, _ in self.started.values():
            _wait(work)
        world = self.sync.world_size
        for index, (_, flat, grads) in self.started.items():
            flat /= world
            for parameter, grad in zip(self.sync.parameters[index], grads):
                if parameter.grad is None:
                    parameter.grad = grad
            _unflatten_into(flat, [p.grad for p in self.sync.parameters[index]])


class GradientSync:
    """Averages a :class:`~torchpipe.Pipe`'s gradients over ``process_group`` in every ``step``.

    Construct it on every rank of the group, after ``torch.distributed.init_process_group``;
    it checks that every rank's partitions hold parameters of the same shapes, copies the
    first rank's parameters and buffers to every rank (as DDP does), and attaches itself to
    ``pipe``. From then on each ``pipe.step(...)`` returns with every parameter's ``.grad``
    averaged over the group (DDP's rule), each partition's all-reduce overlapped with the
    backward of the partitions still running. Inside :meth:`no_sync`, steps keep their
    gradients local (gradient accumulation); the next synchronised step averages the sum.

    ``broadcast_buffers`` (default True, as in DDP): before each step, every rank takes the
    first rank's buffers (batch-norm running statistics).

    Only ``Pipe.step`` is synchronised. For ``pipe(x)`` followed by ``loss.backward()``,
    wrap the Pipe in ``DistributedDataParallel`` instead, or call :meth:`all_reduce` after
    the backward. Partitions on an accelerator are refused for now (see the guide).
    """

    def __init__(self, pipe: Any, process_group: Optional[Any] = None, *, broadcast_buffers: bool = True) -> None:
        import torch.distributed as dist

        from .pipe import Pipe

        if not isinstance(pipe, Pipe):
            raise TypeError(f"GradientSync synchronises a torchpipe.Pipe, got {type(pipe).__name__}")
        if not isinstance(broadcast_buffers, bool):
            raise TypeError(f"broadcast_buffers must be a bool, got {broadcast_buffers!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("GradientSync needs torch.distributed: call torch.distributed.init_process_group "
                               "on every rank first")
        others = [str(d) for d in pipe.devices if d.type != "cpu"]
        if others:
            raise ValueError(f"GradientSync runs on CPU partitions only (gloo), got devices {others}; for "
                             "accelerators, train through DistributedDataParallel(pipe) and pipe(x)")
        if getattr(pipe, "_gradient_sync", None) is not None:
            raise RuntimeError("this Pipe already has a GradientSync; build one per Pipe")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.broadcast_buffers = broadcast_buffers
        self.parameters: List[List[Tensor]] = [
            [p for p in partition.parameters() if p.requires_grad] for partition in pipe.partitions
        ]
        self._buffers = [b for b in pipe.buffers()]
        self._check_same_shapes(dist)
        self._broadcast([p.data for p in pipe.parameters()] + self._buffers)
        self._disabled = 0
        self._disabled_lock = threading.Lock()
        self._warned_forward = False
        pipe._gradient_sync = self

    def _check_same_shapes(self, dist: Any) -> None:
        shapes = ([[tuple(p.shape) for p in partition] for partition in self.parameters],
                  [(tuple(b.shape), str(b.dtype)) for b in self._buffers])
        everyone: List[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, shapes, group=self.process_group)
        for rank, theirs in enumerate(everyone):
            if theirs != shapes:
                raise ValueError(f"rank {rank} of the group has partitions with parameter shapes {theirs[0]} and "
                                 f"buffers {theirs[1]}, this rank {shapes[0]} and {shapes[1]}: every rank must "
                                 "build the same Pipe (model and balance)")

    def _broadcast(self, tensors: Sequence[Tensor]) -> None:
        """The first rank's values of ``tensors`` on every rank: one broadcast per dtype."""
        import torch.distributed as dist

        source = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        by_dtype: Dict[torch.dtype, List[Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = _flat(group)
                dist.broadcast(flat, src=source, group=self.process_group)
                _unflatten_into(flat, group)

    def broadcast_buffers_now(self) -> None:
        """Every rank takes the first rank's buffers (done before each step by default)."""
        if self._buffers:
            self._broadcast(self._buffers)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps inside keep their gradients local: accumulate, then one synchronised step."""
        with self._disabled_lock:
            self._disabled += 1
        try:
            yield
        finally:
            with self._disabled_lock:
                self._disabled -= 1

    def warn_forward_unsynchronised(self) -> None:
        """Once: ``pipe(x)`` and ``backward()`` leave the gradients local, unlike ``step``."""
        if self._warned_forward:
            return
        self._warned_forward = True
        warnings.warn("this Pipe has a GradientSync, which averages the gradients of Pipe.step only: after "
                      "pipe(x) and loss.backward() the gradients are this rank's own. Call sync.all_reduce() "
                      "after the backward, or train through DistributedDataParallel(pipe)", UserWarning,
                      stacklevel=first_frame_outside_torchpipe())

    def round(self) -> Optional[_Round]:
        """What one ``Pipe.step`` uses; None inside :meth:`no_sync`."""
        return None if self._disabled else _Round(self)

    def all_reduce(self) -> None:
        """Average every parameter's ``.grad`` over the group now (after ``pipe(x)`` and ``backward``)."""
        round_ = _Round(self)
        round_.finish()
