"""Suite registry: ``SUITES`` maps a suite name to ``run(options) -> SuiteResult``.

Suites are imported lazily, so a suite whose dependencies are missing (say ``rec``
without torchrec) cannot break the others. Later suites register with ``register``
(or a line in ``_BUILTIN``); ``all`` runs every registered suite in order.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, TextIO

from .report import SuiteResult
from .timing import TimingConfig

__all__ = ["Options", "SUITES", "STAGE_MS_SUITES", "register", "suite_names"]


@dataclass
class Options:
    """What the command line asked for; each suite derives its own timing from it."""

    repeats: Optional[int] = None
    quick: bool = False
    stage_ms: Optional[float] = None
    progress: Optional[TextIO] = field(default_factory=lambda: sys.stderr)

    def timing(self, *, target_s: float, quick_target_s: float, warmup: int = 3, min_iters: int = 3) -> TimingConfig:
        """Timing for a suite: 7 repeats by default, fewer and shorter with ``--quick``."""
        if self.quick:
            repeats = self.repeats if self.repeats is not None else 3
            return TimingConfig(repeats=repeats, warmup=1, target_s=quick_target_s, min_iters=1)
        repeats = self.repeats if self.repeats is not None else 7
        return TimingConfig(repeats=repeats, warmup=warmup, target_s=target_s, min_iters=min_iters)

    def stage_seconds(self, *, default_s: float, quick_s: float) -> float:
        """The simulated stage latency ``t``: ``--stage-ms`` if given, else the suite's default.

        The fixed per-job costs of a machine (waking a thread, passing the GIL, the OS
        oversleeping) weigh less against a longer stage, so a sweep over ``t`` separates
        them from the schedule itself.
        """
        if self.stage_ms is not None:
            return self.stage_ms / 1e3
        return quick_s if self.quick else default_s

    def say(self, message: str) -> None:
        if self.progress is not None:
            self.progress.write(f"[bench] {message}\n")
            self.progress.flush()


Suite = Callable[[Options], SuiteResult]


def _lazy(module: str, function: str = "run") -> Suite:
    def run(options: Options) -> SuiteResult:
        return getattr(importlib.import_module(module, __package__), function)(options)

    run.__name__ = f"run_{module.lstrip('.')}"
    return run


SUITES: Dict[str, Suite] = {
    "overhead": _lazy(".overhead"),
    "gpipe": _lazy(".gpipe"),
    "rec": _lazy(".rec"),
    "schedules": _lazy(".schedules"),
    "cuda": _lazy(".cuda"),
}
"""Suite name -> runner. ``cuda`` needs a GPU: without one it returns at once, its notes saying it was skipped."""

STAGE_MS_SUITES = ("gpipe", "schedules")
"""The suites whose simulated stages take ``--stage-ms``; the others have no such latency."""


def register(name: str, suite: Suite) -> None:
    if name == "all":
        raise ValueError("'all' is reserved: it runs every registered suite")
    SUITES[name] = suite


def suite_names() -> List[str]:
    return list(SUITES)
