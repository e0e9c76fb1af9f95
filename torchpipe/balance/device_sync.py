"""Device helpers shared by the profilers, through the device's backend: wait for queued
kernels, count allocator bytes."""
from __future__ import annotations

import torch

from torchpipe.devices import get_backend

__all__ = ["synchronize", "allocated_bytes", "has_allocator_statistics"]


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device``; a no-op on CPU, where work is synchronous.

    Why: accelerator kernels run asynchronously, so a timer read without it measures launch
    time only.
    """
    get_backend(device).synchronize(device)


def has_allocator_statistics(device: torch.device) -> bool:
    """Whether ``device``'s backend counts allocated bytes (an accelerator's allocator, not the CPU)."""
    return get_backend(device).memory_allocated(device) is not None


def allocated_bytes(device: torch.device) -> int:
    """Bytes held by live tensors on an accelerator ``device``, from its allocator."""
    allocated = get_backend(device).memory_allocated(device)
    if allocated is None:
        raise ValueError(f"device {str(device)!r} has no allocator statistics to measure with")
    return allocated
