"""One unit of pipeline work: run ``kind`` of ``stage`` on ``microbatch``.

Schedules are data: a plan is per-worker lists of these, and the compact text form
("2F0") is what tables, traces, error messages and hand-written plans all use.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = ["Action", "KINDS", "FORWARD", "BACKWARD", "INPUT_GRAD", "WEIGHT_GRAD"]

FORWARD: Final = "F"
"""Forward of one stage on one micro-batch (the last stage's forward includes the loss)."""
BACKWARD: Final = "B"
"""Full backward: input gradient and weight gradient together."""
INPUT_GRAD: Final = "I"
"""Input-gradient half of a split backward: what the previous stage waits for."""
WEIGHT_GRAD: Final = "W"
"""Weight-gradient half of a split backward: nobody waits for it, so it fills bubbles."""
KINDS: Final = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)
"""All action kinds, in the order used for documentation and defaults."""

_TEXT = re.compile(r"(0|[1-9][0-9]*)([FBIW])(0|[1-9][0-9]*)")  # canonical: ASCII, no leading zeros


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """``Action(stage, kind, microbatch)``; ``str`` gives "2F0", ``Action.parse`` inverts it.

    Frozen and hashable so plans can use actions as keys (dependencies, timings).
    """

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        for field, value in (("stage", self.stage), ("microbatch", self.microbatch)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Action {field} must be an int, got {value!r}")
            if value < 0:
                raise ValueError(f"Action {field} must be >= 0, got {value}")
        if not isinstance(self.kind, str):
            raise TypeError(f"Action kind must be a str, one of {KINDS}, got {self.kind!r}")
        if self.kind not in KINDS:
            raise ValueError(f"Action kind must be one of {KINDS}, got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parse the text form ("12B103"), so plans can be written and read by hand."""
        if not isinstance(text, str):
            raise TypeError(f"Action.parse takes the text form of an action, a str such as '2F0'; got {text!r}")
        match = _TEXT.fullmatch(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><kind><microbatch> "
                f"with kind in {''.join(KINDS)}, e.g. '2F0'"
            )
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))

    @property
    def is_backward(self) -> bool:
        """True for B, I and W: the runtime needs the forward's autograd graph for these."""
        return self.kind != FORWARD
