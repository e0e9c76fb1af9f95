"""Autograd's check that a tensor saved for backward was not changed in place since.

Autograd compares a saved tensor's version counter when backward unpacks it, but skips the
check whenever saved-tensor hooks are installed. ``Pipe.step`` counts saved bytes through
such hooks, and checkpointing recomputes through torch's, so both must check for themselves:
otherwise a layer that overwrites a tensor it saved (``y = x.sigmoid(); y.mul_(2)``) trains
on the overwritten values, silently, where the plain model raises.
"""
from __future__ import annotations

from typing import Callable, List, Tuple

from torch import Tensor

__all__ = ["VersionedSaves", "check_unchanged"]


def check_unchanged(alias: Tensor, version: int, where: Callable[[], str]) -> None:
    """Raise autograd's RuntimeError if ``alias`` changed in place since it was at ``version``.

    ``alias`` shares the saved tensor's version counter (a ``detach()`` of it); ``where``
    names the job, built only for the message.
    """
    now = alias._version
    if now != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{alias.type()} {list(alias.shape)}] is at version {now}; expected version "
            f"{version} instead ({where()}). Avoid changing a tensor in place after an operation "
            "saved it for backward, as in the plain model, where backward raises this error too"
        )


class VersionedSaves:
    """The tensors a recompute saved, with their versions, to check once it has finished.

    A checkpoint recomputes a whole partition before backward unpacks anything, so a tensor
    saved early and overwritten later in the same recompute must be caught at the end.
    """

    def __init__(self) -> None:
        self.saved: List[Tuple[Tensor, int]] = []

    def record(self, tensor: Tensor) -> None:
        self.saved.append((tensor.detach(), tensor._version))

    def check(self, where: Callable[[], str]) -> None:
        saved, self.saved = self.saved, []
        for alias, version in saved:
            check_unchanged(alias, version, where)
