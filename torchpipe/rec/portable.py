"""Copy and pickle support for the objects of `torchpipe.rec` that hold locks.

Why: ``copy.deepcopy(model)`` and ``torch.save(model)`` walk every attribute, and a lock
can be neither copied nor pickled. A copy gets fresh, unheld locks of the same kinds.
Each class refuses to be copied while it is in use (`in_use_error`): pending host writes
or protected cache slots would never be completed or released in the copy.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

__all__ = ["state_without_locks", "restore_locks", "fresh_locks", "in_use_error"]


def state_without_locks(obj: Any, locks: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
    """``obj.__dict__`` with the attributes named in ``locks`` left out (for ``__getstate__``)."""
    return {name: value for name, value in obj.__dict__.items() if name not in locks}


def fresh_locks(obj: Any, locks: Mapping[str, Callable[[], Any]]) -> None:
    """Give ``obj`` a new lock from each factory in ``locks`` (for ``__setstate__``)."""
    for name, make in locks.items():
        obj.__dict__[name] = make()


def restore_locks(obj: Any, state: Mapping[str, Any], locks: Mapping[str, Callable[[], Any]]) -> None:
    """``obj.__dict__`` from ``state``, then `fresh_locks` (for ``__setstate__``)."""
    obj.__dict__.update(state)
    fresh_locks(obj, locks)


def in_use_error(what: str, busy: str, remedy: str) -> RuntimeError:
    """The error of a copy or pickle refused while ``what`` is in use (``busy`` says how)."""
    return RuntimeError(f"a {what} cannot be copied or pickled while it is in use: {busy}. {remedy}")
