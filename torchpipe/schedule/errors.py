"""Errors raised by the schedule IR.

They are ``ValueError`` subclasses because a bad plan is a bad argument: callers that
already catch ``ValueError`` for bad configuration keep working.
"""
from __future__ import annotations

from typing import Any

__all__ = ["InvalidPlanError", "ScheduleDeadlockError"]


class InvalidPlanError(ValueError):
    """A plan breaks a rule (duplicate, missing or misplaced action, impossible order).

    The message always names the offending action, so a hand-written plan can be fixed
    without re-deriving the rules. ``missing`` is the action a plan lacks, when that is the
    rule broken (a hand-written plan's hint reads it).
    """

    def __init__(self, message: str, missing: Any = None) -> None:
        super().__init__(message)
        self.missing = missing


class ScheduleDeadlockError(InvalidPlanError):
    """No worker can make progress: every worker waits on an action that never runs.

    Raised by the simulator; the message names each worker's stuck next action and what
    it waits for, which is the information needed to find the cycle.
    """
