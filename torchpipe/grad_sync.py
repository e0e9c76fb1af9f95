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
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .thread_state import first_frame_outside_torchpipe

__all__ = ["GradientSync", "PeerStepFailed", "RanksOutOfStep"]

_POLL_S = 0.0002  # how often a wait for an all-reduce checks for it (and for Ctrl-C)


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """One flat copy of ``tensors``, for one collective instead of one per tensor."""
    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy ``flat`` (made by :func:`flatten`) back into ``tensors``, in place."""
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


class PeerStepFailed(RuntimeError):
    """Another rank's step failed: nothing was averaged, this rank's gradients are its own."""


class RanksOutOfStep(PeerStepFailed):
    """The ranks met in different calls (a step refused or run under ``no_sync()`` on some
    ranks only): their collectives paired up wrongly, so nothing was averaged."""


def by_dtype(tensors: Sequence[Tensor]) -> List[List[Tensor]]:
    """``tensors`` grouped by dtype, in order of first appearance (the same on every rank)."""
    groups: Dict[torch.dtype, List[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.values())


def grad_buckets(parameters: Sequence[Tensor], extra: Optional[Tensor] = None,
                 scale: float = 1.0) -> List[Tuple[Tensor, List[Tensor]]]:
    """``parameters``' gradients as flat buffers to all-reduce, one per dtype (as DDP's buckets),
    with the parameters each holds.

    A buffer holds its parameters' gradients (zeros where one is ``None``), then one
    has-a-gradient flag per parameter, so that a parameter no rank gave a gradient can keep
    ``None`` (`write_back_grads`) and every rank's buffers have the same size whichever
    gradients it has. ``extra`` (small counts, such as a flag per rank) is appended to the
    first buffer, or makes a float32 buffer of its own without parameters: it then travels in
    the same collective.

    ``scale`` (``1 / world_size`` for an average) multiplies the gradients before they are
    summed, as DDP's buckets do: a low-precision average that fits then never overflows in the
    sum (and the rounding is DDP's).
    """
    buckets = []
    for group in by_dtype(parameters):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
        flags = torch.tensor([float(p.grad is not None) for p in group], dtype=group[0].dtype, device=group[0].device)
        flat = flatten(grads + [flags])
        if scale != 1.0:
            flat.mul_(scale)  # DDP's order: each rank's share first; a flag stays nonzero
        buckets.append((flat, group))
    if extra is not None:
        if buckets:
            flat, group = buckets[0]
            buckets[0] = (torch.cat([flat, extra.to(flat)]), group)
        else:
            buckets.append((extra.to(torch.float32), []))
    return buckets


def write_back_grads(flat: Tensor, parameters: Sequence[Tensor]) -> None:
    """Set each parameter's ``.grad`` from its all-reduced `grad_buckets` buffer. A parameter
    no rank gave a gradient keeps ``None``, as in the plain model; one only some ranks gave
    gets it on every rank."""
    offset = 0
    reduced: List[Tensor] = []
    for parameter in parameters:
        reduced.append(flat[offset:offset + parameter.numel()].view_as(parameter))
        offset += parameter.numel()
    given = flat[offset:offset + len(parameters)]  # how many ranks gave each parameter a gradient (scaled)
    for parameter, value, count in zip(parameters, reduced, given.tolist()):
        if count == 0:
            continue  # no rank gave one: it stays None
        if parameter.grad is None:
            parameter.grad = value.clone()
        else:
            parameter.grad.copy_(value)


def start_first_rank_broadcast(tensors: Sequence[Tensor], group: Any) -> List[Tuple[Any, Tensor, List[Tensor]]]:
    """Start broadcasting the first rank of ``group``'s values of ``tensors``, one flat buffer
    per dtype: ``(work, buffer, tensors)`` each; `unflatten_into` a buffer once its work is done.

    All are issued before any is waited for, so that a KeyboardInterrupt in a wait (which gets
    through: the waits are polled) leaves no broadcast unissued for the peers to pair with
    the next collective."""
    import torch.distributed as dist

    source = dist.get_global_rank(group, 0) if group is not None else 0
    issued = []
    for same_dtype in by_dtype(tensors):
        flat = flatten(same_dtype)
        issued.append((dist.broadcast(flat, src=source, group=group, async_op=True), flat, same_dtype))
    return issued


def take_first_ranks_values(tensors: Sequence[Tensor], group: Any) -> None:
    """The first rank of ``group``'s values of ``tensors`` (parameters, buffers) on every rank."""
    issued = start_first_rank_broadcast(tensors, group)
    for work, _, _ in issued:
        _wait(work)
    with torch.no_grad():
        for _, flat, same_dtype in issued:
            unflatten_into(flat, same_dtype)


class _Round:
    """One step's collectives: started by the workers, finished by the caller.

    Every rank issues the same collectives in the same order, a failed step too: the buffer
    broadcast, one all-reduce per partition (last partition first), then a status all-reduce
    that says whether any rank failed. Averages are written back only when none did.
    """

    def __init__(self, sync: "GradientSync", call: int) -> None:
        self.sync = sync
        self.call = call  # this rank's count of step/all_reduce calls: the ranks' must agree
        self.parameters = sync.partition_parameters()  # read per step: a .double() keeps them, buffers not
        count = len(self.parameters)
        self.lock = threading.Lock()
        self.ready = [False] * count
        self.next = count - 1  # the partition whose all-reduce starts next (last one first)
        self.started: List[Tuple[Any, Tensor, List[Tensor]]] = []
        self.finished = False

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
        """All-reduce partition ``index``'s gradients, one buffer per dtype (as DDP's buckets),
        each with one has-a-gradient flag per parameter (a parameter no rank gave a gradient
        keeps ``None``, as in the plain model)."""
        import torch.distributed as dist

        for flat, parameters in grad_buckets(self.parameters[index], scale=1.0 / self.sync.world_size):
            work = dist.all_reduce(flat, group=self.sync.process_group, async_op=True)
            self.started.append((work, flat, parameters))

    def finish(self, failed: bool = False) -> None:
        """Issue what is left, learn whether any rank failed, and only if none did write the
        averages back. ``failed``: this rank's step failed (its collectives still go out, so
        the other ranks learn it at once instead of at the group's timeout)."""
        import torch.distributed as dist

        if self.finished:
            return
        self.finished = True
        with self.lock:  # partitions that did not reach their last backward action
            for index in range(self.next, -1, -1):
                self._launch(index)
            self.next = -1
        # Whether any rank failed, and the highest and lowest call count (as -lowest).
        status = torch.tensor([int(failed), self.call, -self.call], dtype=torch.int64)
        status_work = dist.all_reduce(status, op=dist.ReduceOp.MAX, group=self.sync.process_group, async_op=True)
        for work, _, _ in self.started:
            _wait(work)
        _wait(status_work)
        any_failed, highest, lowest = status[0].item(), status[1].item(), -status[2].item()
        if highest != lowest:  # every rank learnt it in this round: all go on from the highest count
            self.sync.catch_up(highest)
        if failed:
            return
        if highest != lowest:
            raise RanksOutOfStep(
                f"the ranks are out of step: this rank's call {self.call} of step()/all_reduce() met calls "
                f"{lowest}..{highest} of the others (a step refused, or run inside no_sync(), on some ranks only), "
                "so the collectives paired up wrongly and no gradient was averaged: this rank's gradients are its "
                f"own. Every rank goes on counting from call {highest}, so the next step averages again; every "
                "rank must make the same calls")
        if any_failed:
            raise PeerStepFailed("another rank's step failed, so no gradient was averaged: this rank's gradients "
                                 "are its own. The ranks stay in step: the next step averages as usual (the "
                                 "gradients this step created were removed, what it added to existing ones stays: "
                                 "zero_grad() before redoing it)")
        for _, flat, parameters in self.started:
            write_back_grads(flat, parameters)


def _refusal(pipe: Any) -> Optional[Exception]:
    """Why this rank cannot attach a sync to ``pipe`` (None if it can): told to every rank."""
    others = [str(d) for d in pipe.devices if d.type != "cpu"]
    if others:
        return ValueError(f"GradientSync runs on CPU partitions only (gloo), got devices {others}; for "
                          "accelerators, train through DistributedDataParallel(pipe) and pipe(x)")
    if getattr(pipe, "_gradient_sync", None) is not None:
        return RuntimeError("this Pipe already has a GradientSync; build one per Pipe (detach() the old one first "
                            "to replace it)")
    sparse = [name for name, p in pipe.named_parameters() if p.grad is not None and p.grad.is_sparse]
    sparse += [name for name, m in pipe.named_modules() if getattr(m, "sparse", False) is True]
    if sparse:
        return ValueError(f"GradientSync averages dense gradients; {sparse} make sparse ones")
    return None


class GradientSync:
    """Averages a :class:`~torchpipe.Pipe`'s gradients over ``process_group`` in every ``step``.

    Construct it on every rank of the group, after ``torch.distributed.init_process_group``;
    it checks that every rank's partitions hold the same parameters and buffers, copies the
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
        outside = process_group is dist.GroupMember.NON_GROUP_MEMBER  # what new_group gives a non-member
        if outside:
            raise ValueError("this rank is not a member of process_group: build the GradientSync on the group's "
                             "ranks only")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None (the default group), "
                            f"got {type(process_group).__name__}: {process_group!r}")
        if dist.get_rank(process_group) < 0:
            raise ValueError("this rank is not a member of process_group: build the GradientSync on the group's "
                             "ranks only")
        self.process_group = process_group
        # With the default group: the one this sync counted and checked (see _refuse_a_new_default_group).
        self._default_group = dist.group.WORLD if process_group is None else None
        self.world_size = dist.get_world_size(process_group)
        self.broadcast_buffers = broadcast_buffers
        self._pipe = weakref.ref(pipe)
        self._check_same_layout(dist, _refusal(pipe))
        self._broadcast([p.data for p in pipe.parameters()] + list(pipe.buffers()))
        self._disabled = 0
        self._disabled_lock = threading.Lock()
        self._calls = 0  # step() and all_reduce() calls so far, refused ones too: the ranks' must agree
        self._warned_forward = False
        pipe._gradient_sync = self

    def _partitions(self) -> List[Any]:
        pipe = self._pipe()
        if pipe is None:
            raise RuntimeError("the Pipe of this GradientSync is gone")
        return list(pipe.partitions)

    def partition_parameters(self) -> List[List[Tensor]]:
        """Every partition's parameters that can have a gradient (the frozen ones too: they
        keep a ``None`` gradient); an integer parameter cannot, and is left alone as in DDP."""
        return [[p for p in partition.parameters() if p.is_floating_point() or p.is_complex()]
                for partition in self._partitions()]

    def _buffers(self) -> List[Tensor]:
        pipe = self._pipe()
        return [] if pipe is None else list(pipe.buffers())

    def _check_same_layout(self, dist: Any, refusal: Optional[Exception]) -> None:
        """Every rank's partitions hold parameters of the same shapes, dtypes and trainability,
        and the same buffers, and every rank broadcasts buffers or none does: a broadcast or an
        all-reduce of different layouts would mix values up without an error, and mismatched
        broadcasts would wait for the group's timeout. ``refusal``: why this rank refuses its
        sync (`_refusal`), told to the others in the same exchange so that none waits for it."""
        layout = ([[(tuple(p.shape), str(p.dtype), p.requires_grad) for p in partition.parameters()]
                   for partition in self._partitions()],
                  [(tuple(b.shape), str(b.dtype)) for b in self._buffers()])
        mine = (layout, self.broadcast_buffers, None if refusal is None else str(refusal))
        everyone: List[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        if refusal is not None:
            raise refusal
        for rank, (theirs, broadcasts, refused) in enumerate(everyone):
            if refused is not None:
                raise RuntimeError(f"rank {rank} of the group refused its GradientSync ({refused}), so this "
                                   "rank's is refused too")
            if theirs != layout:
                raise ValueError(f"rank {rank} of the group has partitions with parameters (shape, dtype, "
                                 f"requires_grad) {theirs[0]} and buffers {theirs[1]}, this rank {layout[0]} and "
                                 f"{layout[1]}: every rank must build the same Pipe (model, dtype and balance)")
            if broadcasts != self.broadcast_buffers:
                raise ValueError(f"rank {rank} of the group has broadcast_buffers={broadcasts}, this rank "
                                 f"{self.broadcast_buffers}: every rank must give the same")

    def refuse_a_new_default_group(self) -> None:
        """RuntimeError if this sync runs over the default group and it was rebuilt since: its
        world size (the average's divisor), the ranks whose layout it checked and its call count
        are the old group's. Before a step or an ``all_reduce`` changes anything."""
        import torch.distributed as dist

        if self.process_group is None and (not dist.is_initialized() or dist.group.WORLD is not self._default_group):
            now = f"of {dist.get_world_size()} ranks" if dist.is_initialized() else "none: it was destroyed"
            raise RuntimeError(f"the default process group changed since this GradientSync was built over it (then of "
                               f"{self.world_size} ranks, now {now}): call sync.detach() and build a new "
                               "GradientSync on every rank of the new group")

    def _broadcast(self, tensors: Sequence[Tensor]) -> None:
        """The first rank's values of ``tensors`` on every rank (`take_first_ranks_values`)."""
        take_first_ranks_values(tensors, self.process_group)

    def broadcast_buffers_now(self) -> None:
        """Every rank takes the first rank's buffers (done before each step by default)."""
        buffers = self._buffers()
        if buffers:
            self._broadcast(buffers)

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

    def count_call(self) -> int:
        """Count one ``Pipe.step`` or :meth:`all_reduce` call (a refused step too): the ranks
        compare their counts in every synchronised step, so a rank that skipped a step is
        found instead of averaging another step's gradients."""
        with self._disabled_lock:
            self._calls += 1
            return self._calls

    def catch_up(self, count: int) -> None:
        """Count on from ``count`` (the highest of the ranks', which all of them learnt in one
        round): after `RanksOutOfStep` the ranks' counts agree again."""
        with self._disabled_lock:
            self._calls = max(self._calls, count)

    def detach(self) -> None:
        """Take this sync off its Pipe: its steps are local from now on, and a new
        `GradientSync` (over a rebuilt process group, say) may be attached. Call it on every
        rank, between steps."""
        pipe = self._pipe()
        if pipe is not None and getattr(pipe, "_gradient_sync", None) is self:
            pipe._gradient_sync = None

    def ticket(self) -> "CallTicket":
        """A ``Pipe.step`` call's place in the count, taken when the call runs (see `CallTicket`)."""
        self.refuse_a_new_default_group()
        return CallTicket(self)

    def round(self, call: int) -> Optional[_Round]:
        """What ``Pipe.step`` call number ``call`` uses; None inside :meth:`no_sync`."""
        return None if self._disabled else _Round(self, call)

    def all_reduce(self) -> None:
        """Average every parameter's ``.grad`` over the group now (after ``pipe(x)`` and ``backward``);
        then, with ``broadcast_buffers``, every rank takes the first rank's buffers, as DDP's
        next forward would (its own step does that before it)."""
        self.refuse_a_new_default_group()
        _Round(self, self.count_call()).finish()
        if self.broadcast_buffers:
            self.broadcast_buffers_now()


class CallTicket:
    """One ``Pipe.step`` call's number in its sync's count.

    A call that runs takes it under the Pipe's step lock, so steps from several threads are
    numbered in the order their collectives go out (the same on every rank). A call refused
    before that takes it when it ends (`settle`).
    """

    def __init__(self, sync: GradientSync) -> None:
        self.sync = sync
        self.number: Optional[int] = None

    def take(self) -> int:
        if self.number is None:
            self.number = self.sync.count_call()
        return self.number

    def settle(self) -> None:
        """At the end of the call: count it if it never ran."""
        self.take()
