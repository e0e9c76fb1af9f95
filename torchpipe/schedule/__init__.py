"""Schedules as data: actions, plans, generators, validation, simulation, rendering.

Pure Python with no torch import, so plans can be built, checked and printed anywhere.
The runtime executes ``Plan.worker_actions`` exactly as generated here; the tables and
traces are drawn from the same lists, so what is printed is what runs.
"""
from __future__ import annotations

from .action import Action
from .errors import InvalidPlanError, ScheduleDeadlockError
from .generators import SCHEDULES, build
from .plan import Plan
from .simulate import Simulation

__all__ = ["Action", "Plan", "build", "Simulation", "InvalidPlanError", "ScheduleDeadlockError", "SCHEDULES"]
