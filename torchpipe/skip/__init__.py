"""Skip connections across partitions (torchgpipe's ``torchgpipe.skip`` API).

>>> @skippable(stash=["1to3"])
... class Encoder(nn.Module):
...     def forward(self, x):
...         yield stash("1to3", x)
...         return self.conv(x)
"""
from .layout import SkipLayout, inspect_skip_layout
from .namespace import Namespace
from .skippable import Skippable, pop, skippable, stash, verify_skippables
from .tracker import SkipTracker, current_skip_tracker, use_skip_tracker

__all__ = [
    "Namespace",
    "skippable",
    "stash",
    "pop",
    "Skippable",
    "verify_skippables",
    "SkipLayout",
    "inspect_skip_layout",
    "SkipTracker",
    "current_skip_tracker",
    "use_skip_tracker",
]
