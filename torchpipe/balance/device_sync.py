"""Device helpers shared by the profilers: wait for queued kernels, count allocator bytes."""
from __future__ import annotations

import torch

__all__ = ["synchronize", "allocated_bytes", "has_allocator_statistics"]


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device``; a no-op on CPU, where work is synchronous.

    Why: accelerator kernels run asynchronously, so a timer read without it measures launch
    time only.
    """
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def has_allocator_statistics(device: torch.device) -> bool:
    """Whether ``device`` has a caching allocator that counts allocated bytes (not the CPU)."""
    return device.type != "cpu" and device.type != "meta"


def allocated_bytes(device: torch.device) -> int:
    """Bytes held by live tensors on an accelerator ``device``, from its allocator."""
    return int(torch.accelerator.memory_allocated(device))
