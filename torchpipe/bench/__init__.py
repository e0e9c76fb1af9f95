"""Benchmarks: ``python -m torchpipe.bench <suite> [--repeats N] [--json PATH] [--quick]``.

Every figure is a ratio against a baseline measured in the same run, from the median of
interleaved repeats (see ``timing.py``). Suites live one per module and are listed in
``registry.SUITES``; ``report.py`` prints the tables and writes the JSON.
"""
from .registry import SUITES, Options, register, suite_names
from .report import Column, Goal, SuiteResult, Table
from .timing import Measurement, TimingConfig, compare

__all__ = [
    "SUITES",
    "Options",
    "register",
    "suite_names",
    "SuiteResult",
    "Table",
    "Column",
    "Goal",
    "Measurement",
    "TimingConfig",
    "compare",
]
