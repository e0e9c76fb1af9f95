"""One call at a time, with a lock that knows which thread holds it.

A pipeline runs one call (``pipe(x)``, ``step``, ``progress``) at a time under a lock.
Code can run on the calling thread while it holds that lock: a signal handler, a
callback, a data iterator. If that code waited for the lock (a shutdown handler that
calls ``close()``), it would wait for itself. :class:`CallLock` lets it see that it holds
the lock already, and leave an action (the close) for the moment the call ends.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Tuple, TypeVar

__all__ = ["CallLock"]

T = TypeVar("T")


class CallLock:
    """A non-reentrant lock for one call at a time that knows its holder thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: Optional[int] = None
        self._after: Optional[Tuple[int, Callable[[], Any]]] = None

    def held_here(self) -> bool:
        """Whether this thread is inside a call under the lock (a re-entry would wait for itself)."""
        return self._holder == threading.get_ident()

    def call(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` under the lock; then the action :meth:`after_call` left, if any."""
        here = threading.get_ident()
        try:
            with self._lock:
                self._holder = here
                try:
                    return function(*args)
                finally:
                    self._holder = None
        finally:
            pending = self._after
            if pending is not None and pending[0] == here:
                self._after = None
                pending[1]()

    def after_call(self, action: Callable[[], Any]) -> None:
        """Run ``action`` once the call this thread is inside ends (failed or not)."""
        if not self.held_here():
            raise RuntimeError("after_call() is for the thread inside a call under this lock")
        self._after = (threading.get_ident(), action)

    def acquire(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for no call to be running; True if the lock is now held."""
        return self._lock.acquire(timeout=timeout)

    def release(self) -> None:
        self._lock.release()
