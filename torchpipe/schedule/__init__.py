"""Schedules as data: actions, plans, generators, validation, simulation, rendering.

Its modules are pure Python and import no torch themselves (importing them still loads the
``torchpipe`` package, which does), so plans are cheap to build, check and print.
The runtime executes ``Plan.worker_actions`` exactly as generated here; the tables and
traces are drawn from the same lists, so what is printed is what runs.
"""
from __future__ import annotations

from .action import Action
from .errors import InvalidPlanError, ScheduleDeadlockError
from .generators import SCHEDULES, build, schedule_name, schedule_options
from .plan import Plan
from .simulate import Simulation

__all__ = ["Action", "Plan", "build", "Simulation", "InvalidPlanError", "ScheduleDeadlockError", "SCHEDULES",
           "schedule_name", "schedule_options"]
