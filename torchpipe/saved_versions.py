"""Autograd's check that a tensor saved for backward was not changed in place since.

Autograd compares a saved tensor's version counter when backward unpacks it, but skips the
check whenever saved-tensor hooks are installed. ``Pipe.step`` counts saved bytes through
such hooks, and checkpointing recomputes through torch's, so both must check for themselves:
otherwise a layer that overwrites a tensor it saved (``y = x.sigmoid(); y.mul_(2)``) trains
on the overwritten values, silently, where the plain model raises.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import Tensor

__all__ = ["CheckpointVersions", "check_unchanged"]


def check_unchanged(alias: Tensor, version: int, where: Callable[[], str]) -> None:
    """Raise autograd's RuntimeError if ``alias`` changed in place since it was at ``version``.

    ``alias`` shares the saved tensor's version counter (a ``detach()`` of it); ``where``
    names the job, built only for the message.
    """
    now = alias._version
    if now != version:
        _raise_changed(alias, now, version, where)


def _raise_changed(alias: Tensor, now: int, version: int, where: Callable[[], str]) -> None:
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{alias.type()} {list(alias.shape)}] is at version {now}; expected version "
        f"{version} instead ({where()}). Avoid changing a tensor in place after an operation "
        "saved it for backward, as in the plain model, where backward raises this error too"
    )


_GRAPH_EXEC_GROUP = getattr(torch._C, "_get_graph_exec_group", None)  # torch 2.13; looked up once


def backward_call_key() -> Any:
    """Which backward call runs on this thread, as torch's checkpoint tells them apart: the
    ``GraphExecGroup`` in effect (torch 2.13), else the graph task (-1 outside backward)."""
    current = None if _GRAPH_EXEC_GROUP is None else _GRAPH_EXEC_GROUP()
    return current if current is not None else torch._C._current_graph_task_id()


class CheckpointVersions:
    """Autograd's in-place check for one checkpointed call, made when backward reads a tensor.

    Backward reads a checkpointed tensor from the recompute, so two changes could hide there:
    one made later in the same recompute (torch keeps the recomputed tensors as aliases, which
    change with them), and one made to a parameter, or another leaf that requires grad,
    between the forward and the backward (the recompute saves it again, at its new version).
    Tensors are numbered in the order they are saved, which is how torch's checkpoint pairs
    the forward's saves with the recompute's. As in autograd, a tensor that backward never
    reads is never checked. Only leaves are remembered from the forward: they stay alive
    anyway, where remembering an activation would undo the checkpoint's memory saving.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        # Leaves the forward saved, with their versions once the forward (or the last
        # recompute) was done with them; changed before a recompute starts: which, how.
        self.at_forward: Dict[int, Tuple[Tensor, int]] = {}
        self.changed_before: Dict[int, Tuple[int, int]] = {}
        # Per backward call (see backward_call_key): a nested or concurrent call recomputes on
        # its own, and its end must not drop what another call still has to check.
        self.at_recompute: Dict[Any, List[Tuple[Tensor, int]]] = {}

    def forward_saved(self, index: int, tensor: Tensor) -> None:
        base = tensor._base if tensor._base is not None else tensor
        if base.requires_grad and base.is_leaf:
            self.at_forward[index] = (tensor.detach(), tensor._version)

    def forward_finished(self) -> None:
        """The forward's own changes to its leaves (a weight normalised in place) are its own."""
        self._settle_leaves()

    def recompute_started(self) -> None:
        """Note the leaves changed since: by the caller (an optimizer step), not by the replay."""
        self.changed_before = {index: (alias._version, version) for index, (alias, version) in self.at_forward.items()
                               if alias._version != version}
        self.at_recompute[backward_call_key()] = []

    def recompute_finished(self) -> None:
        self._settle_leaves()  # a second recompute (a split backward) replays them again

    def _settle_leaves(self) -> None:
        self.at_forward = {index: (alias, alias._version) for index, (alias, _) in self.at_forward.items()}

    def recompute_saved(self, tensor: Tensor) -> None:
        self.at_recompute.setdefault(backward_call_key(), []).append((tensor.detach(), tensor._version))

    def recompute_released(self, key: Any) -> None:
        """Backward call ``key`` has ended: its recompute's tensors may go (their aliases here
        would keep them alive until the graph's end)."""
        self.at_recompute.pop(key, None)

    def check(self, index: int, key: Any) -> None:
        """Raise autograd's error if the tensor saved ``index``-th changed in place since; ``key``:
        the backward call reading it (`backward_call_key`)."""
        where = self._where
        changed = self.changed_before.get(index)
        if changed is not None:
            _raise_changed(self.at_forward[index][0], *changed, where)
        recomputed = self.at_recompute.get(key, ())
        if index < len(recomputed):
            check_unchanged(*recomputed[index], where)

    def _where(self) -> str:
        return self.where
