"""Hand a micro-batch from one partition's stream (and device) to the next.

On an accelerator every worker computes on its own stream. The producer records an event
after its output; the consumer makes its stream (or, across devices, its copy stream) wait
for that event instead of the whole producer stream, copies on the copy stream, and marks
every tensor with ``record_stream`` so that the caching allocator does not reuse memory that
another stream still reads. On the CPU all of this is a no-op and tensors pass unchanged.
Copies use ``Tensor.to``, so autograd routes gradients back to the producer's device.

Tensors nested in the batch's tuples, lists and dicts (an LSTM's ``(out, (h_n, c_n))``) are
fenced the same way, and those on an accelerator are moved too: only the pipeline can copy
them in order with their producer's stream. Nested CPU tensors stay on the CPU, where some
must be (``pack_padded_sequence``'s lengths), and where the consumer may move them itself
safely; top-level tensors always go to the consumer's device.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Tuple

import torch
from torch import Tensor

from .devices import Backend, get_backend
from .microbatch import Batch, map_nested, nested_tensors, rebuild

__all__ = ["mark_ready", "receive", "streams_wait_for_caller", "caller_waits_for_streams"]


def mark_ready(backend: Backend, stream: Any) -> Any:
    """Record an event on the producer's ``stream`` after its output (None on the CPU)."""
    if backend.type == "cpu":
        return None
    event = backend.new_event()
    backend.record_event(event, stream)
    return event


def receive(
    batch: Batch,
    ready_event: Any,
    device: torch.device,
    stream: Any,
    copy_stream_for: Callable[[torch.device], Any],
) -> Batch:
    """Make ``batch`` usable on ``stream`` of ``device``, copying across devices if needed.

    ``ready_event`` is the producer's :func:`mark_ready` event. ``copy_stream_for(d)`` gives
    the consumer's copy stream on device ``d``; a cross-device copy runs with the copy streams
    of both devices current, as PyTorch's device-to-device copy uses both.
    """
    backend = get_backend(device)
    if all(t.device == device for t in _bound_for_the_device(batch)):
        if ready_event is not None:
            backend.wait_event(stream, ready_event)
        _record_on(backend, batch, device, stream)
        return batch

    target_copy = copy_stream_for(device)
    waited = False
    if ready_event is not None and any(t.device == device for t in nested_tensors(batch.values)):
        # The tensors already here are used as they are: wait for their producer too.
        backend.wait_event(stream, ready_event)

    def copy(tensor: Tensor) -> Tensor:
        nonlocal waited
        if tensor.device == device:
            return tensor
        source_backend = get_backend(tensor.device)
        if source_backend.type == "cpu":
            # Asynchronous only from pageable memory, where the copy returns once the data is
            # staged. From pinned memory it would still be reading when the call returns, and a
            # caller refilling a pinned staging buffer would change the input under it.
            with backend.use_stream(target_copy):
                return tensor.to(device, non_blocking=backend.type != "cpu" and not tensor.is_pinned())
        source_copy = copy_stream_for(tensor.device)
        if ready_event is not None and not waited:
            source_backend.wait_event(source_copy, ready_event)
            waited = True
        with source_backend.use_stream(source_copy), backend.use_stream(target_copy):
            moved = tensor.to(device, non_blocking=backend.type != "cpu")
        source_backend.record_stream(tensor, source_copy)
        return moved

    def copy_nested(tensor: Tensor) -> Tensor:
        return tensor if tensor.is_cpu else copy(tensor)

    moved = [copy(value) if isinstance(value, Tensor) else map_nested(value, copy_nested) for value in batch.values]
    moved_batch = Batch(moved[0] if batch.atomic else rebuild(batch.values, moved))
    backend.wait_stream(stream, target_copy)
    _record_on(backend, moved_batch, device, stream)
    return moved_batch


def _bound_for_the_device(batch: Batch) -> Iterator[Tensor]:
    """The tensors of ``batch`` that ``receive`` puts on the consumer's device: the top-level
    ones, and those nested on an accelerator."""
    for value in batch.values:
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, (tuple, list, dict)):
            yield from (tensor for tensor in nested_tensors(value) if not tensor.is_cpu)


def _record_on(backend: Backend, batch: Batch, device: torch.device, stream: Any) -> None:
    """``record_stream`` every tensor of ``batch`` on ``device`` (nested ones too) for ``stream``."""
    if backend.type != "cpu":
        for tensor in nested_tensors(batch.values):
            if tensor.device == device:
                backend.record_stream(tensor, stream)


def streams_wait_for_caller(streams: Iterable[Tuple[torch.device, Any]]) -> None:
    """Order every worker stream after the work the caller has queued so far.

    Call it on the caller's thread before a step's jobs are queued. The caller may have just
    written what the stages read — ``optimizer.step()`` and ``zero_grad()`` on its current
    stream, say — and a worker stream does not wait for another stream by itself.
    """
    for device, stream in streams:
        backend = get_backend(device)
        if backend.type != "cpu":
            backend.wait_stream(stream, backend.current_stream(device))


def caller_waits_for_streams(streams: Iterable[Tuple[torch.device, Any]]) -> None:
    """Order the caller's current stream after everything the worker streams have queued.

    Call it on the caller's thread once a step's jobs have all run: gradients, losses and
    freed activations were written or used on worker streams, and whatever the caller does
    next (read a loss, step an optimizer, reuse memory) must come after them.
    """
    for device, stream in streams:
        backend = get_backend(device)
        if backend.type != "cpu":
            backend.wait_stream(backend.current_stream(device), stream)
