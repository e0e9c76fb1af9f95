"""Which partition stashes each skip and which pops it: the routes a pipeline must serve."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from torch import nn

from .skippable import skip_events
from .tracker import SkipKey

__all__ = ["SkipLayout", "inspect_skip_layout"]


@dataclass(frozen=True)
class SkipLayout:
    """``routes[key] = (stash partition, pop partition)`` for every skip name."""

    routes: Dict[SkipKey, Tuple[int, int]]

    def crossing(self) -> List[Tuple[SkipKey, int, int]]:
        """Skips that leave their partition (the ones a pipeline must carry)."""
        return [(key, src, dst) for key, (src, dst) in self.routes.items() if src != dst]

    def stashes_of(self, partition: int) -> List[SkipKey]:
        return [key for key, (src, _) in self.routes.items() if src == partition]

    def pops_of(self, partition: int) -> List[SkipKey]:
        return [key for key, (_, dst) in self.routes.items() if dst == partition]


def inspect_skip_layout(partitions: Sequence[nn.Sequential]) -> SkipLayout:
    """Map every skip name to the partitions that stash and pop it (pops before stashes fail).

    Layers are read in run order where it is known (:func:`skip_events`). A name stashed
    again after its pop maps to its last route.
    """
    stash_at: Dict[SkipKey, int] = {}
    routes: Dict[SkipKey, Tuple[int, int]] = {}
    for index, partition in enumerate(partitions):
        for kind, key, _ in skip_events(partition):
            if kind == "stash":
                stash_at[key] = index
            elif key not in stash_at:
                raise ValueError(f"skip {key[1]!r} is popped in partition {index} before any partition stashes it")
            else:
                routes[key] = (stash_at[key], index)
    return SkipLayout(routes)
