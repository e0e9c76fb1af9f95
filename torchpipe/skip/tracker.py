"""Where stashed skip tensors wait until they are popped.

Outside a pipeline, the thread's default tracker is a dict: an ``nn.Sequential`` with
skippable layers runs as a plain model (the un-pipelined reference). Inside a pipeline, each
job installs its own tracker that routes tensors between partitions through the step's
:class:`SkipStore`.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional, Tuple

from torch import Tensor

from .namespace import DEFAULT_NAMESPACE, Namespace

__all__ = ["SkipTracker", "current_skip_tracker", "use_skip_tracker", "SkipKey", "skip_name"]

SkipKey = Tuple[Namespace, str]


class SkipTracker:
    """Saves stashed tensors and hands them to pops; the default one is a plain dict.

    A stash replaces an earlier one of the same name (torchgpipe's rule): a forward that
    failed between a stash and its pop, or a prefix of the model run on its own
    (``model[:2](x)``), leaves a stash behind that must not break the next call on the
    thread. Names stashed twice in one model are caught statically by ``verify_skippables``.
    """

    def __init__(self) -> None:
        self.tensors: Dict[SkipKey, Tensor] = {}

    def save(self, key: SkipKey, tensor: Tensor) -> None:
        self.tensors[key] = tensor

    def load(self, key: SkipKey) -> Tensor:
        try:
            return self.tensors.pop(key)
        except KeyError:
            raise RuntimeError(f"pop of skip {skip_name(key)} without a stash before it") from None


def skip_name(key: SkipKey) -> str:
    """``'name'``, or ``'name' (namespace <Namespace ...>)`` for isolated names."""
    namespace, name = key
    return repr(name) if namespace is DEFAULT_NAMESPACE else f"{name!r} ({namespace!r})"


class _Local(threading.local):
    tracker: Optional[Any] = None


_local = _Local()


def current_skip_tracker() -> Any:
    """The tracker of this thread: the pipeline job's, or the thread's default dict tracker."""
    tracker = _local.tracker
    if tracker is None:
        tracker = _local.tracker = SkipTracker()
    return tracker


@contextmanager
def use_skip_tracker(tracker: Any) -> Iterator[None]:
    """Install ``tracker`` for this thread while the block runs."""
    previous = _local.tracker
    _local.tracker = tracker
    try:
        yield
    finally:
        _local.tracker = previous
