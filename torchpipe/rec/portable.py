"""Copy and pickle support for the objects of `torchpipe.rec` that hold locks.

Why: ``copy.deepcopy(model)`` and ``torch.save(model)`` walk every attribute, and a lock
can be neither copied nor pickled. A copy gets fresh, unheld locks of the same kinds:
copying is only allowed while nothing holds them (`CachedEmbeddingBagCollection` checks
that no batch is in flight first).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

__all__ = ["state_without_locks", "restore_locks"]


def state_without_locks(obj: Any, locks: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
    """``obj.__dict__`` with the attributes named in ``locks`` left out (for ``__getstate__``)."""
    return {name: value for name, value in obj.__dict__.items() if name not in locks}


def restore_locks(obj: Any, state: Mapping[str, Any], locks: Mapping[str, Callable[[], Any]]) -> None:
    """``obj.__dict__`` from ``state``, with a new lock from each factory in ``locks`` (for ``__setstate__``)."""
    obj.__dict__.update(state)
    for name, make in locks.items():
        obj.__dict__[name] = make()
