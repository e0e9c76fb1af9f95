"""Checkpointing of partitions: forward without storing activations, recompute in backward.

Layers that must behave differently while a partition is being checkpointed or recomputed
(deferred batch norm must not count a micro-batch twice) ask ``is_checkpointing()`` and
``is_recomputing()``. Both flags are thread-local, because every partition runs on its own
worker thread and recomputation runs on the autograd engine's thread.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["is_checkpointing", "is_recomputing"]


class _Flags(threading.local):
    checkpointing: bool = False
    recomputing: bool = False


_flags = _Flags()


def is_checkpointing() -> bool:
    """True while a checkpointed partition runs its first (activation-free) forward."""
    return _flags.checkpointing


def is_recomputing() -> bool:
    """True while a checkpointed partition recomputes its forward during backward."""
    return _flags.recomputing


@contextmanager
def _set_flag(name: str) -> Iterator[None]:
    previous = getattr(_flags, name)
    setattr(_flags, name, True)
    try:
        yield
    finally:
        setattr(_flags, name, previous)
