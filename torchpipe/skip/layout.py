"""Which partition stashes each skip and which pops it: the routes a pipeline must serve."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from torch import nn

from .skippable import Skippable
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
    """Map every skip name to the partitions that stash and pop it (pops before stashes fail)."""
    stash_at: Dict[SkipKey, int] = {}
    routes: Dict[SkipKey, Tuple[int, int]] = {}
    for index, partition in enumerate(partitions):
        for layer in partition.modules():
            if not isinstance(layer, Skippable):
                continue
            for key in layer.poppable():
                if key not in stash_at:
                    raise ValueError(f"skip {key[1]!r} is popped in partition {index} before any partition stashes it")
                routes[key] = (stash_at[key], index)
            for key in layer.stashable():
                stash_at[key] = index
    return SkipLayout(routes)
